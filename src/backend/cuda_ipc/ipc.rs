//! CUDA IPC: handles another process of the same host opens to reach our device memory and
//! events.
//!
//! A handle names a whole *allocation*, not a pointer into it: [`export`] finds the allocation
//! holding a tensor (`cuMemGetAddressRange`), exports its base, and gives the tensor's offset in
//! it. It also reads the allocation's buffer id (`CU_POINTER_ATTRIBUTE_BUFFER_ID`), unique per
//! allocation for the life of the process: a freed allocation and a new one at the same address
//! have different ids, which is what keeps the handle caches from handing out a stale mapping.
//!
//! Memory from the stream-ordered allocator (`cuMemAllocAsync`, cudarc's default where the
//! device supports memory pools) cannot be exported this way; [`export`] says so with
//! [`NotExportable`], and the channel stages such tensors through memory of its own.

use std::sync::Arc;

use crate::cuda::{check, sys, Event, Gpu};

/// Bytes of a CUDA IPC handle (memory or event).
pub const HANDLE_LEN: usize = 64;

/// An exported allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Exported {
    /// The handle of the allocation.
    pub handle: [u8; HANDLE_LEN],
    /// The allocation's process-unique buffer id.
    pub buffer_id: u64,
    /// Where the tensor starts inside the allocation.
    pub offset: u64,
    /// The allocation's size.
    pub size: u64,
    /// The allocation's base address in the exporting process. Two live allocations of a
    /// process never overlap, so a new one overlapping an older one's range means the older one
    /// was freed: the receiver drops its mapping (see the handle cache).
    pub base: u64,
}

/// Why a pointer cannot be exported: not `cuMemAlloc` memory (a pool allocation, managed or
/// host memory). The message says what the driver said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotExportable(pub String);

impl std::fmt::Display for NotExportable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The allocation holding `ptr` on `gpu`: (base, size, buffer id).
pub fn allocation_of(gpu: &Gpu, ptr: sys::CUdeviceptr) -> crate::Result<(u64, u64, u64)> {
    gpu.bind()?;
    let (mut base, mut size, mut id) = (0u64, 0usize, 0u64);
    // SAFETY: the context is current; each call writes its out-parameter.
    unsafe {
        check(
            "cuMemGetAddressRange",
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr),
        )?;
        check(
            "cuPointerGetAttribute(BUFFER_ID)",
            sys::cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            ),
        )?;
    }
    Ok((base, size as u64, id))
}

/// Exports the allocation holding `ptr`.
pub fn export(gpu: &Gpu, ptr: sys::CUdeviceptr) -> crate::Result<Result<Exported, NotExportable>> {
    let (base, size, buffer_id) = allocation_of(gpu, ptr)?;
    let mut h = sys::CUipcMemHandle_st {
        reserved: [0; HANDLE_LEN],
    };
    // SAFETY: the context is current; `base` is the start of a live allocation.
    let r = unsafe { sys::cuIpcGetMemHandle(&mut h, base) };
    if let Err(e) = r.result() {
        return Ok(Err(NotExportable(format!(
            "cuIpcGetMemHandle on cuda:{} allocation {base:#x}: {e} (stream-ordered pool \
             memory cannot be exported; allocate with cuMemAlloc to avoid a staging copy)",
            gpu.ordinal()
        ))));
    }
    Ok(Ok(Exported {
        handle: h.reserved.map(|c| c as u8),
        buffer_id,
        offset: ptr - base,
        size,
        base,
    }))
}

/// A peer's allocation mapped into this process; unmapped when dropped.
pub struct Opened {
    base: sys::CUdeviceptr,
    size: u64,
    gpu: Arc<Gpu>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Opened(cuda:{}, {:#x}, {} bytes)",
            self.gpu.ordinal(),
            self.base,
            self.size
        )
    }
}

impl Opened {
    /// The mapping's base address in this process.
    pub fn base(&self) -> sys::CUdeviceptr {
        self.base
    }

    /// The device it was opened on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

/// Opens a peer's memory handle on `gpu` (which need not be the exporting device: the driver
/// enables peer access lazily). `size` is the allocation's size the peer announced.
pub fn open(gpu: &Arc<Gpu>, handle: &[u8; HANDLE_LEN], size: u64) -> crate::Result<Opened> {
    gpu.bind()?;
    let h = sys::CUipcMemHandle_st {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut base = 0;
    // SAFETY: the context is current; the call writes `base`.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    crate::metrics::cuda_ipc_open(1.0);
    Ok(Opened {
        base,
        size,
        gpu: gpu.clone(),
    })
}

impl Drop for Opened {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // Copies from the mapping may still be queued on some stream: let them finish
            // before the mapping goes (closing is rare: a peer gone, an eviction).
            // SAFETY: the context is current.
            let _ = unsafe { sys::cuCtxSynchronize() };
            // SAFETY: opened by `open`, closed once, here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            crate::metrics::cuda_ipc_open(-1.0);
        }
    }
}

/// The handle of an interprocess event (see [`Gpu::event`] with `ipc`).
pub fn export_event(event: &Event) -> crate::Result<[u8; HANDLE_LEN]> {
    if !event.is_ipc() {
        return Err(crate::Error::invalid(
            "only an interprocess event can be exported",
        ));
    }
    event.gpu().bind()?;
    let mut h = sys::CUipcEventHandle_st {
        reserved: [0; HANDLE_LEN],
    };
    // SAFETY: the context is current; the event is alive.
    check("cuIpcGetEventHandle", unsafe {
        sys::cuIpcGetEventHandle(&mut h, event.raw())
    })?;
    Ok(h.reserved.map(|c| c as u8))
}

/// A peer's interprocess event opened here; destroyed when dropped.
pub struct RemoteEvent {
    raw: sys::CUevent,
    gpu: Arc<Gpu>,
}

// SAFETY: an event handle usable from any thread with its context current (the methods make it).
unsafe impl Send for RemoteEvent {}
// SAFETY: as above.
unsafe impl Sync for RemoteEvent {}

impl std::fmt::Debug for RemoteEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteEvent(cuda:{})", self.gpu.ordinal())
    }
}

/// Opens a peer's interprocess event in `gpu`'s context.
pub fn open_event(gpu: &Arc<Gpu>, handle: &[u8; HANDLE_LEN]) -> crate::Result<RemoteEvent> {
    gpu.bind()?;
    let h = sys::CUipcEventHandle_st {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut raw = std::ptr::null_mut();
    // SAFETY: the context is current; the call writes `raw`.
    check("cuIpcOpenEventHandle", unsafe {
        sys::cuIpcOpenEventHandle(&mut raw, h)
    })?;
    Ok(RemoteEvent {
        raw,
        gpu: gpu.clone(),
    })
}

impl RemoteEvent {
    /// Makes `stream` wait for the peer's last record of the event.
    pub fn wait_on(&self, stream: &crate::cuda::CudaStream) -> crate::Result<()> {
        self.gpu.bind()?;
        // SAFETY: both handles are alive.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.cu_stream(), self.raw, 0)
        })
    }

    /// Records the work queued on `stream` into the event (the peer waits on it).
    pub fn record(&self, stream: &crate::cuda::CudaStream) -> crate::Result<()> {
        self.gpu.bind()?;
        // SAFETY: both handles are alive.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.cu_stream())
        })
    }

    /// Whether the peer's last recorded work has completed (`cuEventQuery`), without waiting.
    pub fn is_complete(&self) -> crate::Result<bool> {
        self.gpu.bind()?;
        // SAFETY: the handle is alive.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|_| false),
        }
    }

    /// Blocks until the peer's last recorded work has completed.
    pub fn synchronize(&self) -> crate::Result<()> {
        self.gpu.bind()?;
        // SAFETY: the handle is alive.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }
}

impl Drop for RemoteEvent {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: opened by `open_event`, destroyed once, here.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}
