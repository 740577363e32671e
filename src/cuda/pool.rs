//! Per-device pools of events and streams: what a message needs is taken from a pool and goes
//! back when dropped, so steady state creates neither.

use std::ops::Deref;
use std::sync::Arc;

use super::{check, driver_error, sys, CudaStream, Gpu};

/// Most events a device's pool keeps (per kind); more are destroyed when they come back.
const EVENTS_KEPT: usize = 1024;
/// Most idle streams a device's pool keeps.
const STREAMS_KEPT: usize = 64;

/// An event waiting in a pool.
pub(crate) struct IdleEvent(sys::CUevent);

// SAFETY: an idle event is a driver handle nobody uses until it leaves the pool.
unsafe impl Send for IdleEvent {}

/// A CUDA event from a device's pool (timing disabled; interprocess when asked for). It goes
/// back to the pool when dropped.
pub struct Event {
    raw: sys::CUevent,
    gpu: Arc<Gpu>,
    ipc: bool,
}

// SAFETY: a CUevent is a driver handle usable from any thread once its context is current, which
// every method makes it; the pool hands each event to one owner at a time.
unsafe impl Send for Event {}
// SAFETY: as above; the methods taking `&self` are driver calls the driver makes thread-safe.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(cuda:{}, {:?})", self.gpu.ordinal(), self.raw)
    }
}

impl Gpu {
    /// An event from this device's pool (not interprocess), recorded on `stream` now: the
    /// point a later wait orders after.
    pub fn recorded(self: &Arc<Self>, stream: &CudaStream) -> crate::Result<Event> {
        let e = self.event(false)?;
        e.record(stream)?;
        Ok(e)
    }

    /// An event from this device's pool (created if the pool is empty). `ipc` asks for an
    /// interprocess event, whose handle another process can open (`export_event` of the `cuda_ipc` backend).
    pub fn event(self: &Arc<Self>, ipc: bool) -> crate::Result<Event> {
        let pool = if ipc { &self.ipc_events } else { &self.events };
        let reused = pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let raw = match reused {
            Some(IdleEvent(raw)) => raw,
            None => {
                self.bind()?;
                let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                if ipc {
                    flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
                }
                let mut raw = std::ptr::null_mut();
                // SAFETY: the context is current; the call writes `raw`.
                check("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut raw, flags)
                })?;
                crate::metrics::cuda_created("event");
                raw
            }
        };
        Ok(Event {
            raw,
            gpu: self.clone(),
            ipc,
        })
    }

    /// A non-blocking stream of this device, leased from its pool until the lease is dropped.
    pub fn lease_stream(self: &Arc<Self>) -> crate::Result<StreamLease> {
        let reused = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match reused {
            Some(s) => s,
            None => {
                crate::metrics::cuda_created("stream");
                self.ctx
                    .new_stream()
                    .map_err(|e| driver_error("cuStreamCreate", e))?
            }
        };
        Ok(StreamLease {
            stream: Some(stream),
            gpu: self.clone(),
        })
    }

    /// Events and streams idle in this device's pools: (events, interprocess events, streams).
    pub fn pooled(&self) -> (usize, usize, usize) {
        let n = |m: &std::sync::Mutex<Vec<IdleEvent>>| {
            m.lock().unwrap_or_else(|p| p.into_inner()).len()
        };
        let streams = self.streams.lock().unwrap_or_else(|p| p.into_inner()).len();
        (n(&self.events), n(&self.ipc_events), streams)
    }
}

impl Event {
    /// The raw handle (valid while this value lives).
    pub fn raw(&self) -> sys::CUevent {
        self.raw
    }

    /// The device whose pool it comes from.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Whether it is an interprocess event.
    pub fn is_ipc(&self) -> bool {
        self.ipc
    }

    /// Captures the work queued on `stream` so far (a stream of this event's device).
    pub fn record(&self, stream: &CudaStream) -> crate::Result<()> {
        self.gpu.bind()?;
        // SAFETY: both handles are alive; the stream belongs to this device's context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.cu_stream())
        })
    }

    /// Makes `stream` (of any device) wait for the captured work, without blocking the CPU.
    pub fn wait_on(&self, stream: &CudaStream) -> crate::Result<()> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: both handles are alive.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.cu_stream(), self.raw, 0)
        })
    }

    /// Blocks the calling thread until the captured work has completed.
    pub fn synchronize(&self) -> crate::Result<()> {
        self.gpu.bind()?;
        // SAFETY: the handle is alive.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Whether the captured work has completed, without waiting.
    pub fn is_complete(&self) -> crate::Result<bool> {
        self.gpu.bind()?;
        // SAFETY: the handle is alive.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|_| false),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let pool = if self.ipc {
            &self.gpu.ipc_events
        } else {
            &self.gpu.events
        };
        let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < EVENTS_KEPT {
            pool.push(IdleEvent(self.raw));
        } else {
            drop(pool);
            if self.gpu.bind().is_ok() {
                // SAFETY: we own the event and nothing uses it any more.
                let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
            }
        }
    }
}

/// A stream leased from a device's pool; it goes back when the lease is dropped. Work still
/// queued on it then runs on: the next lessee's work is ordered after it, as on any stream.
pub struct StreamLease {
    stream: Option<Arc<CudaStream>>,
    gpu: Arc<Gpu>,
}

impl std::fmt::Debug for StreamLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamLease(cuda:{})", self.gpu.ordinal())
    }
}

impl StreamLease {
    /// The stream, shareable (an `Arc` clone outlives the lease but goes back to the pool with
    /// it: do not keep it).
    pub fn arc(&self) -> &Arc<CudaStream> {
        self.stream.as_ref().expect("present until dropped")
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Deref for StreamLease {
    type Target = CudaStream;
    fn deref(&self) -> &CudaStream {
        self.arc()
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            let mut pool = self.gpu.streams.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < STREAMS_KEPT {
                pool.push(s);
            }
        }
    }
}
