//! CUDA devices (feature `cuda`): driver contexts, pools of streams, events and pinned host
//! memory, device listing, and the memory model of CUDA tensors.
//!
//! The driver library (`libcuda.so`) is loaded at run time, so this module builds anywhere and a
//! program built with the feature runs on machines without a GPU: [`available`] then says why
//! CUDA cannot be used, and nothing else touches the driver.
//!
//! - [`Gpu`]: one per device and process. It holds the device's primary context and the pools
//!   every pipe of the process draws from: non-blocking streams ([`StreamLease`]), events
//!   ([`Event`], local or interprocess). Nothing is created per message in steady state: a pooled
//!   event goes back to its pool when dropped, a leased stream when its lease is.
//! - [`PinnedPool`]: page-locked host buffers for staging copies, reused.
//! - [`CudaBuffer`]: device memory the user owns, with the stream its data is produced on (when
//!   sent) or consumed on (when received).
//! - [`CudaCompletion`]: what a receive of CUDA tensors completes with, one event per device
//!   touched, with a blocking and a non-blocking (stream-ordered) wait; see docs/cuda.md.
//! - [`devices`]: what `actorpipe info` lists.
//! - [`set_watch_spin`]: how long each device's watcher thread (which runs the channels'
//!   completion callbacks) polls before it naps; process-wide.

mod buffer;
mod completion;
mod device;
mod pinned;
mod pool;
mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use buffer::CudaBuffer;
pub use completion::CudaCompletion;
pub use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
pub use device::{devices, GpuInfo};
pub use pinned::{PinnedBuf, PinnedPool};
pub use pool::{Event, StreamLease};
pub use watch::{set_spin as set_watch_spin, spin as watch_spin, SPIN as WATCH_SPIN};

use crate::error::{Error, Origin};

/// Whether the CUDA driver and at least one device are usable here; `Err` says why not
/// (no driver library, the driver refuses to initialise, no device).
///
/// The answer is computed once per process.
pub fn available() -> Result<u32, String> {
    static STATE: OnceLock<Result<u32, String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only probes whether the library can be loaded; no symbol is called.
            if !unsafe { sys::is_culib_present() } {
                return Err("no CUDA driver library (libcuda.so) on this host".into());
            }
            cudarc::driver::result::init()
                .map_err(|e| format!("the CUDA driver does not initialise: {e}"))?;
            let n = CudaContext::device_count()
                .map_err(|e| format!("the CUDA driver cannot count devices: {e}"))?;
            if n <= 0 {
                return Err("the CUDA driver sees no device".into());
            }
            Ok(n as u32)
        })
        .clone()
}

/// The number of CUDA devices, 0 when CUDA is unavailable.
pub fn device_count() -> u32 {
    available().unwrap_or(0)
}

/// A driver call's failure as an [`Error::Device`].
pub(crate) fn driver_error(call: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Device {
        detail: format!("{call}: {e}"),
        origin: Origin::default(),
    }
}

/// Checks a raw driver result.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> crate::Result<()> {
    r.result().map_err(|e| driver_error(call, e))
}

/// One CUDA device of this process: its primary context and its pools.
pub struct Gpu {
    ordinal: u32,
    ctx: Arc<CudaContext>,
    streams: Mutex<Vec<Arc<CudaStream>>>,
    events: Mutex<Vec<pool::IdleEvent>>,
    ipc_events: Mutex<Vec<pool::IdleEvent>>,
    /// The thread that runs [`on_stream_done`]'s callbacks, started on first use.
    watcher: OnceLock<watch::Watcher>,
    /// The stream [`CudaBuffer::alloc`] puts on buffers it allocates.
    alloc_stream: OnceLock<Arc<CudaStream>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{})", self.ordinal)
    }
}

/// The [`Gpu`] for device `ordinal`, made on first use.
pub fn gpu(ordinal: u32) -> crate::Result<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<u32, Arc<Gpu>>>> = OnceLock::new();
    let n = available().map_err(|reason| Error::Unavailable {
        backend: "cuda".into(),
        reason,
    })?;
    if ordinal >= n {
        return Err(Error::invalid(format!(
            "cuda:{ordinal} does not exist: this host has {n} CUDA device(s)"
        )));
    }
    let mut map = GPUS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    let ctx = CudaContext::new(ordinal as usize)
        .map_err(|e| driver_error(&format!("retaining the context of cuda:{ordinal}"), e))?;
    // Our streams and events order the work explicitly; cudarc's per-slice event tracking would
    // add an event record per use of every slice.
    // SAFETY: called before this context has made any stream or slice of ours.
    unsafe { ctx.disable_event_tracking() };
    let g = Arc::new(Gpu {
        ordinal,
        ctx,
        streams: Mutex::new(Vec::new()),
        events: Mutex::new(Vec::new()),
        ipc_events: Mutex::new(Vec::new()),
        watcher: OnceLock::new(),
        alloc_stream: OnceLock::new(),
    });
    map.insert(ordinal, g.clone());
    Ok(g)
}

impl Gpu {
    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's primary context (shared with every other user of the primary context in
    /// this process, cudarc's `CudaContext::new` included).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the context current on the calling thread (cheap when it already is).
    pub fn bind(&self) -> crate::Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    /// The stream buffers allocated by [`CudaBuffer::alloc`] carry.
    pub fn alloc_stream(&self) -> crate::Result<Arc<CudaStream>> {
        if let Some(s) = self.alloc_stream.get() {
            return Ok(s.clone());
        }
        let s = self
            .ctx
            .new_stream()
            .map_err(|e| driver_error("cuStreamCreate", e))?;
        Ok(self.alloc_stream.get_or_init(|| s).clone())
    }

    /// Free and total memory of the device, in bytes.
    pub fn memory(&self) -> crate::Result<(usize, usize)> {
        self.bind()?;
        self.ctx
            .mem_get_info()
            .map_err(|e| driver_error("cuMemGetInfo", e))
    }

    /// Blocks until every operation on the device has completed.
    pub fn synchronize(&self) -> crate::Result<()> {
        self.bind()?;
        self.ctx
            .synchronize()
            .map_err(|e| driver_error("cuCtxSynchronize", e))
    }

    /// Whether this device can read and write `peer`'s memory directly (NVLink or PCIe peer
    /// access). Copies between the two are staged through host memory by the driver otherwise.
    pub fn can_access_peer(&self, peer: &Gpu) -> bool {
        let mut can = 0;
        // SAFETY: both devices are valid ordinals; the call only writes `can`.
        let r = unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.ctx.cu_device())
        };
        r.result().is_ok() && can != 0
    }

    /// Turns on access from this device's context to `peer`'s memory, once; idempotent.
    pub fn enable_peer_access(&self, peer: &Gpu) -> crate::Result<()> {
        if self.ordinal == peer.ordinal || !self.can_access_peer(peer) {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both contexts are alive (held by `self` and `peer`).
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            other => check("cuCtxEnablePeerAccess", other),
        }
    }
}

/// Copies `len` bytes from device memory `src` to device memory `dst` on `stream`, asynchronously.
/// Between devices the driver uses peer access where enabled and stages through the host
/// otherwise.
///
/// # Safety
/// Both ranges must be valid device memory of their devices for `len` bytes until the copy has
/// run on `stream`.
pub unsafe fn copy_async(
    dst: (sys::CUdeviceptr, &Gpu),
    src: (sys::CUdeviceptr, &Gpu),
    len: usize,
    stream: &CudaStream,
) -> crate::Result<()> {
    if len == 0 {
        return Ok(());
    }
    dst.1.bind()?;
    if dst.1.ordinal == src.1.ordinal {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, len, stream.cu_stream())
        })
    } else {
        // SAFETY: the caller's contract; both contexts are alive.
        check("cuMemcpyPeerAsync", unsafe {
            sys::cuMemcpyPeerAsync(
                dst.0,
                dst.1.ctx.cu_ctx(),
                src.0,
                src.1.ctx.cu_ctx(),
                len,
                stream.cu_stream(),
            )
        })
    }
}

/// Runs `f` once the work queued on `stream` so far has completed, without blocking the caller
/// or the stream: a pooled event is recorded on `stream` and the device's watcher thread runs `f`
/// when it completes (`watch.rs` says why not `cuLaunchHostFunc`). `f` must be short and must not
/// call the CUDA API; sending on a channel is what it is for. If the stream's context fails, `f`
/// still runs (the failure surfaces in the work's own completion).
pub fn on_stream_done(stream: &CudaStream, f: impl FnOnce() + Send + 'static) -> crate::Result<()> {
    let ordinal = u32::try_from(stream.context().ordinal()).unwrap_or(u32::MAX);
    watch::after(&gpu(ordinal)?, stream, f)
}

/// Whether this host's CUDA driver library can be loaded and it lists a GPU, found without
/// cudarc: `dlopen` of the names the driver installs (`libcuda.so.1`, and the development link
/// `libcuda.so`), and the NVIDIA kernel driver's list of GPUs. The tests hold [`available`] and
/// [`device::devices`] to it.
#[cfg(test)]
pub(crate) fn host_has() -> (bool, usize) {
    let loads = [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: dlopen with a NUL-terminated name; loading the driver runs its initialisers,
        // as cudarc's loading does. The handle is closed at once.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return false;
        }
        // SAFETY: the handle dlopen just returned, closed once.
        unsafe { libc::dlclose(handle) };
        true
    });
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    (loads, gpus)
}

#[cfg(test)]
mod tests {
    /// `available`'s answer where no driver library loads: CI, which has no GPU and no libcuda.
    pub(crate) const NO_LIBRARY: &str = "no CUDA driver library (libcuda.so) on this host";

    #[test]
    fn availability_agrees_with_the_host() {
        let available = super::available();
        match super::host_has() {
            (false, _) => {
                assert_eq!(available, Err(NO_LIBRARY.to_string()));
                assert_eq!(super::device_count(), 0);
                let e = super::gpu(0).unwrap_err();
                assert_eq!(e.class(), "unavailable", "{e}");
                assert!(e.to_string().contains(NO_LIBRARY), "{e}");
            }
            (true, 0) => {
                // The library is there but the kernel driver lists no GPU: the driver says so.
                let why = available.expect_err("no GPU is listed, yet CUDA is available");
                assert!(why.starts_with("the CUDA driver "), "{why}");
                assert!(super::gpu(0).is_err());
            }
            (true, gpus) => {
                // CUDA_VISIBLE_DEVICES may hide some; MIG may show an instance per slice.
                let n = available.unwrap_or_else(|why| panic!("{gpus} GPUs listed: {why}"));
                assert!(n > 0);
                assert_eq!(super::device_count(), n);
                assert!(super::gpu(0).is_ok());
                assert!(super::gpu(n).is_err(), "cuda:{n} is past the last device");
            }
        }
    }
}
