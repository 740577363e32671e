//! [`CudaBuffer`]: device memory the user owns, with its device and stream.

use std::sync::Arc;

use cudarc::driver::DevicePtr;

use super::{check, driver_error, gpu, sys, CudaSlice, CudaStream, Gpu};

/// Who frees the memory.
enum Owner {
    /// A cudarc slice, handed back whole by [`CudaBuffer::into_slice`].
    Slice(CudaSlice<u8>),
    /// Allocated by [`CudaBuffer::alloc`] with `cuMemAlloc` (so it can be exported over CUDA
    /// IPC); freed on drop.
    Owned,
    /// Memory of another framework: never freed here.
    Borrowed,
}

/// Device memory of one tensor: a pointer, a length, its device and the CUDA stream its data is
/// produced on (for a tensor being sent) or consumed on (for one being received).
///
/// The runtime orders its copies after the work queued on that stream when the `Write` is
/// issued, and orders the stream after its copies when the operation completes (for a `Write`)
/// or when the user waits on the read's [`super::CudaCompletion`]; it never blocks the CPU on
/// the stream. docs/cuda.md says exactly when each side may touch the memory.
///
/// `Clone` is a deep copy: new device memory of the same device, filled by an asynchronous copy
/// on the buffer's stream (it panics if the device is out of memory, as cudarc's slices do).
/// Equality is identity: same device, pointer and length.
pub struct CudaBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    owner: Owner,
}

// SAFETY: the buffer is a device pointer plus handles the driver lets any thread use; cudarc's
// slice and stream are `Send` themselves.
unsafe impl Send for CudaBuffer {}
// SAFETY: `&CudaBuffer` only reads plain fields.
unsafe impl Sync for CudaBuffer {}

impl CudaBuffer {
    /// Takes a cudarc slice (candle and other cudarc users hand their tensors over without a
    /// copy) with the stream its data is produced or consumed on; that stream's context must be
    /// the slice's device's primary context.
    pub fn from_slice(slice: CudaSlice<u8>, stream: Arc<CudaStream>) -> crate::Result<Self> {
        let ordinal = stream.context().ordinal() as u32;
        if slice.ordinal() as u32 != ordinal {
            return Err(crate::Error::invalid(format!(
                "the slice is on cuda:{}, its stream on cuda:{ordinal}",
                slice.ordinal()
            )));
        }
        let gpu = gpu(ordinal)?;
        let ptr = {
            // The guard orders cudarc's own bookkeeping (when its event tracking is on) after
            // nothing: we only read the address.
            let (ptr, _guard) = slice.device_ptr(&stream);
            ptr
        };
        Ok(CudaBuffer {
            ptr,
            len: slice.len(),
            gpu,
            stream,
            owner: Owner::Slice(slice),
        })
    }

    /// Device memory another framework owns.
    ///
    /// # Safety
    /// `ptr` must be `len` bytes of device memory of CUDA device `device`, allocated with the
    /// driver's or runtime's allocator, and `stream` a live stream of that device's primary
    /// context (or null for its legacy default stream). Both must stay valid until the buffer
    /// comes back in `WriteDone` / `ReadDone` and, for a received buffer, until the user has
    /// waited on the read's completion.
    pub unsafe fn from_raw(
        ptr: sys::CUdeviceptr,
        len: usize,
        device: u32,
        stream: sys::CUstream,
    ) -> crate::Result<Self> {
        let gpu = gpu(device)?;
        // SAFETY: the caller promises the stream belongs to this context and outlives us.
        let stream = unsafe { gpu.context().wrap_borrowed_stream(stream) };
        Ok(CudaBuffer {
            ptr,
            len,
            gpu,
            stream,
            owner: Owner::Borrowed,
        })
    }

    /// Allocates `len` bytes (not zeroed) on `device` with `cuMemAlloc`, so the memory can be
    /// exported over CUDA IPC; the buffer's stream is a stream of the runtime's for that device.
    pub fn alloc(device: u32, len: usize) -> crate::Result<Self> {
        let gpu = gpu(device)?;
        let stream = gpu.alloc_stream()?;
        let mut ptr = 0;
        if len > 0 {
            gpu.bind()?;
            // SAFETY: the context is current; the call writes `ptr`.
            check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        }
        Ok(CudaBuffer {
            ptr,
            len,
            gpu,
            stream,
            owner: Owner::Owned,
        })
    }

    /// The device pointer.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.gpu.ordinal()
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The stream the data is produced (sending) or consumed (receiving) on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Replaces the stream (the buffer's data will be consumed or produced on `stream`, of the
    /// same device).
    pub fn set_stream(&mut self, stream: Arc<CudaStream>) -> crate::Result<()> {
        if stream.context().ordinal() as u32 != self.device() {
            return Err(crate::Error::invalid(format!(
                "a stream of cuda:{} for a buffer on cuda:{}",
                stream.context().ordinal(),
                self.device()
            )));
        }
        self.stream = stream;
        Ok(())
    }

    /// The cudarc slice, for a buffer made from one; any other buffer comes back as `Err`.
    pub fn into_slice(mut self) -> Result<CudaSlice<u8>, CudaBuffer> {
        match std::mem::replace(&mut self.owner, Owner::Borrowed) {
            // `self` now borrows: dropping it frees nothing.
            Owner::Slice(s) => Ok(s),
            other => {
                self.owner = other;
                Err(self)
            }
        }
    }

    /// Copies the bytes to a host vector, blocking until done (for tests and tools; the data
    /// path never does this).
    pub fn to_vec(&self) -> crate::Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        if self.len > 0 {
            self.gpu.bind()?;
            // SAFETY: `v` holds `len` bytes; the stream is synchronized before `v` is used.
            check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    v.as_mut_ptr().cast(),
                    self.ptr,
                    self.len,
                    self.stream.cu_stream(),
                )
            })?;
        }
        self.stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e))?;
        Ok(v)
    }

    /// Fills the buffer from host bytes (exactly `len` of them), blocking until done (for tests
    /// and tools).
    pub fn copy_from_host(&mut self, src: &[u8]) -> crate::Result<()> {
        if src.len() != self.len {
            return Err(crate::Error::invalid(format!(
                "{} host bytes for a {}-byte device buffer",
                src.len(),
                self.len
            )));
        }
        if self.len > 0 {
            self.gpu.bind()?;
            // SAFETY: `src` outlives the copy: the stream is synchronized before returning.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.ptr,
                    src.as_ptr().cast(),
                    self.len,
                    self.stream.cu_stream(),
                )
            })?;
        }
        self.stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    /// A deep copy, or the driver's error.
    pub fn try_clone(&self) -> crate::Result<Self> {
        let mut copy = CudaBuffer::alloc(self.device(), self.len)?;
        copy.stream = self.stream.clone();
        // SAFETY: both ranges are `len` bytes of this device; the copy is ordered on the
        // stream both buffers carry.
        unsafe {
            super::copy_async(
                (copy.ptr, &self.gpu),
                (self.ptr, &self.gpu),
                self.len,
                &self.stream,
            )?
        };
        Ok(copy)
    }
}

impl Clone for CudaBuffer {
    fn clone(&self) -> Self {
        self.try_clone()
            .unwrap_or_else(|e| panic!("cloning a CUDA buffer: {e}"))
    }
}

impl PartialEq for CudaBuffer {
    fn eq(&self, other: &Self) -> bool {
        (self.device(), self.ptr, self.len) == (other.device(), other.ptr, other.len)
    }
}

impl Eq for CudaBuffer {}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let owner = match self.owner {
            Owner::Slice(_) => "cudarc slice",
            Owner::Owned => "owned",
            Owner::Borrowed => "borrowed",
        };
        write!(
            f,
            "CudaBuffer(cuda:{}, {:#x}, {} bytes, {owner})",
            self.device(),
            self.ptr,
            self.len
        )
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if matches!(self.owner, Owner::Owned) && self.len > 0 && self.gpu.bind().is_ok() {
            // cuMemFree waits for work on the memory to finish before releasing it.
            // SAFETY: we allocated this memory and nothing else frees it.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}
