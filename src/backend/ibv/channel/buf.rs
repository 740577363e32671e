//! The buffers the channel's protocol moves ([`RdmaBuf`]): host memory, GPU memory, and
//! regions of either (stripes over several devices).

use std::sync::Arc;

use crate::backend::ibv::regcache::{Lease, RegCache};
use crate::transport::stream::{Memory, Region};

/// A buffer the protocol moves: host bytes (the `ibv` channel, and the host end of a
/// `cuda_gdr` pair) or GPU memory (`cuda_gdr`).
#[derive(Debug)]
pub enum RdmaBuf {
    /// Host memory, owned or shared (shared only as the source of writes).
    Host(Memory),
    /// Device memory, registered whole allocation at a time (`cuda_gdr`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaBuffer),
    /// Part of device memory held elsewhere (a stripe of a `cuda_gdr` tensor).
    #[cfg(feature = "cuda")]
    GpuRegion(GpuRegion),
}

/// `len` bytes of device memory at `ptr` on `gpu`, a part of a buffer held elsewhere.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct GpuRegion {
    /// The GPU.
    pub gpu: Arc<crate::cuda::Gpu>,
    /// Its first byte.
    pub ptr: u64,
    /// Its length.
    pub len: usize,
}

impl From<Memory> for RdmaBuf {
    fn from(m: Memory) -> Self {
        RdmaBuf::Host(m)
    }
}

impl From<Vec<u8>> for RdmaBuf {
    fn from(v: Vec<u8>) -> Self {
        RdmaBuf::Host(Memory::Owned(v))
    }
}

impl RdmaBuf {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            RdmaBuf::Host(m) => m.len(),
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(b) => b.len(),
            #[cfg(feature = "cuda")]
            RdmaBuf::GpuRegion(r) => r.len,
        }
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where its first byte is (a device pointer for GPU memory).
    pub(super) fn addr(&mut self) -> u64 {
        match self {
            RdmaBuf::Host(m) => m.base_ptr() as u64,
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(b) => b.device_ptr(),
            #[cfg(feature = "cuda")]
            RdmaBuf::GpuRegion(r) => r.ptr,
        }
    }

    /// The GPU it lives on (`None`: host memory).
    pub fn gpu(&self) -> Option<u32> {
        match self {
            RdmaBuf::Host(_) => None,
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(b) => Some(b.device()),
            #[cfg(feature = "cuda")]
            RdmaBuf::GpuRegion(r) => Some(r.gpu.ordinal()),
        }
    }

    /// `len` bytes of it at `offset` (a stripe), to move on a queue pair of their own.
    ///
    /// # Safety
    /// `offset + len` is at most its length, and the caller keeps the buffer alive, in place
    /// and untouched until every region made of it is back from its queue pair (which hands it
    /// back only once the HCA can no longer touch it: its registration dropped, its writes
    /// completed or flushed). Regions of shared bytes are only written from, never into.
    pub unsafe fn region(&mut self, offset: u64, len: u64) -> RdmaBuf {
        match self {
            RdmaBuf::Host(m) => {
                let base = m.base_ptr();
                // SAFETY: inside the buffer, which the caller keeps as the contract says.
                let region = unsafe { Region::new(base.add(offset as usize), len as usize) };
                RdmaBuf::Host(Memory::Region(region))
            }
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(b) => RdmaBuf::GpuRegion(GpuRegion {
                gpu: b.gpu().clone(),
                ptr: b.device_ptr() + offset,
                len: len as usize,
            }),
            #[cfg(feature = "cuda")]
            RdmaBuf::GpuRegion(r) => RdmaBuf::GpuRegion(GpuRegion {
                gpu: r.gpu.clone(),
                ptr: r.ptr + offset,
                len: len as usize,
            }),
        }
    }

    /// The host bytes (empty for GPU memory).
    pub fn as_slice(&self) -> &[u8] {
        match self {
            RdmaBuf::Host(m) => m.as_slice(),
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(_) | RdmaBuf::GpuRegion(_) => &[],
        }
    }

    /// The host memory, if it is host memory.
    pub fn into_memory(self) -> Option<Memory> {
        match self {
            RdmaBuf::Host(m) => Some(m),
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(_) | RdmaBuf::GpuRegion(_) => None,
        }
    }

    /// Its registration from `cache`: host memory by its own range, GPU memory by the whole
    /// allocation holding it (`cuda_gdr`).
    ///
    /// # Safety
    /// The buffer must stay where it is (it does: a heap block or device memory never moves
    /// while the channel holds it) until the lease is dropped.
    pub(super) unsafe fn lease(
        &mut self,
        cache: &Arc<RegCache>,
    ) -> Result<Lease, crate::backend::ibv::VerbsError> {
        match self {
            // SAFETY: forwarded.
            RdmaBuf::Host(m) => unsafe { cache.lease(m.base_ptr(), m.len()) },
            // SAFETY: forwarded.
            #[cfg(feature = "cuda")]
            RdmaBuf::Cuda(b) => unsafe {
                crate::backend::cuda_gdr::lease(cache, b.gpu(), b.device_ptr(), b.len())
            },
            // SAFETY: forwarded.
            #[cfg(feature = "cuda")]
            RdmaBuf::GpuRegion(r) => unsafe {
                crate::backend::cuda_gdr::lease(cache, &r.gpu, r.ptr, r.len)
            },
        }
    }
}
