//! The `cuda_xth` channel: both ends in one process. The receiver's stream waits for the
//! sender's ready event and copies device-to-device (or peer-to-peer between two GPUs, or
//! to/from host memory for the mixed pairs) straight from the sender's buffer: one copy, enqueued
//! without blocking either CPU.

pub(crate) mod driver;

use std::sync::Arc;

use crate::channel::ChannelBackend;
use crate::negotiate::DevicePair;

/// The channel, for one device pair.
#[derive(Debug, Clone, Copy)]
pub struct CudaXth {
    /// The pair this instance serves.
    pub devices: DevicePair,
}

impl CudaXth {
    /// One instance per device pair it serves (cuda->cuda, cpu->cuda, cuda->cpu).
    pub fn all() -> Vec<Arc<dyn ChannelBackend>> {
        crate::channel::cuda_pairs()
            .into_iter()
            .map(|devices| Arc::new(CudaXth { devices }) as Arc<dyn ChannelBackend>)
            .collect()
    }
}

impl crate::channel::sealed::Sealed for CudaXth {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::CudaXth { pipe: at.pipe }
    }
}

impl ChannelBackend for CudaXth {
    fn name(&self) -> &'static str {
        "cuda_xth"
    }

    fn priority(&self) -> i32 {
        300
    }

    fn domain(&self) -> String {
        // Only peers of this very process show the same token.
        crate::backend::xth::process_token().to_string()
    }

    fn devices(&self) -> DevicePair {
        self.devices
    }

    fn viable(&self) -> Result<(), String> {
        // Carried by its driver (driver.rs): offered wherever CUDA works.
        crate::cuda::available().map(drop)
    }
}

// ----- the in-process rendezvous ---------------------------------------------------------------

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::cuda::{CudaStream, Event, Gpu};
use crate::error::Error;

/// Names one tensor in flight: the sending pipe's id, the message, the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// The sending pipe's process-local id.
    pub sender: u64,
    /// Message sequence number.
    pub seq: u64,
    /// Tensor index.
    pub index: u32,
}

/// One end of a copy.
#[derive(Debug, Clone)]
pub enum End {
    /// Device memory of a GPU.
    Device {
        /// The device pointer.
        ptr: crate::cuda::sys::CUdeviceptr,
        /// Its device.
        gpu: Arc<Gpu>,
    },
    /// Host memory (address as an integer so the end is `Send`).
    Host {
        /// The address.
        ptr: usize,
    },
}

impl End {
    /// The device memory of `b`.
    pub fn of(b: &crate::cuda::CudaBuffer) -> End {
        End::Device {
            ptr: b.device_ptr(),
            gpu: b.gpu().clone(),
        }
    }
}

/// What the sender parks.
pub struct Sent {
    /// Where the bytes are.
    pub src: End,
    /// How many.
    pub len: usize,
    /// Recorded on the sender's stream when the data was ready (`None` for host memory).
    pub ready: Option<Event>,
    /// Called once the receiver's copy has run (the buffer is free) or failed.
    pub on_free: Box<dyn FnOnce(Result<(), Error>) + Send>,
}

/// What the receiver parks.
pub struct Wanted {
    /// Where the bytes go.
    pub dst: End,
    /// How many it expects.
    pub len: usize,
    /// The receiver's stream the copy is queued on. `None` only for host memory (`dst` is
    /// [`End::Host`]): the copy then runs on the sender's device's runtime stream
    /// ([`Gpu::alloc_stream`]).
    pub stream: Option<Arc<CudaStream>>,
    /// Called once the copy is queued, with the event recorded after it on the receiver's
    /// device (`None` for host memory: the bytes have landed), or with the error.
    pub on_done: Box<dyn FnOnce(Result<Option<Event>, Error>) + Send>,
}

enum Slot {
    Sent(Sent),
    Wanted(Wanted),
}

fn table() -> std::sync::MutexGuard<'static, HashMap<Key, Slot>> {
    static TABLE: OnceLock<Mutex<HashMap<Key, Slot>>> = OnceLock::new();
    // Each operation on the map is one insert or remove: a poisoned lock is still consistent.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Parks a sent tensor; if its receiver is waiting, the copy is queued now.
pub fn send(key: Key, s: Sent) {
    let other = {
        let mut t = table();
        match t.remove(&key) {
            Some(Slot::Wanted(w)) => Some(w),
            Some(Slot::Sent(old)) => {
                t.insert(key, Slot::Sent(old));
                drop(t);
                (s.on_free)(Err(Error::invalid("cuda_xth: tensor sent twice")));
                return;
            }
            None => {
                t.insert(key, Slot::Sent(s));
                return;
            }
        }
    };
    if let Some(w) = other {
        finish(s, w);
    }
}

/// Parks a wanted tensor; if its sender is there, the copy is queued now.
pub fn recv(key: Key, w: Wanted) {
    let sent = {
        let mut t = table();
        match t.remove(&key) {
            Some(Slot::Sent(s)) => s,
            Some(Slot::Wanted(old)) => {
                t.insert(key, Slot::Wanted(old));
                drop(t);
                (w.on_done)(Err(Error::invalid("cuda_xth: tensor wanted twice")));
                return;
            }
            None => {
                t.insert(key, Slot::Wanted(w));
                return;
            }
        }
    };
    finish(sent, w);
}

/// Takes back whatever is parked under `key` (its pipe is closing), completing it with `e`.
pub fn withdraw(key: Key, e: &Error) {
    let slot = table().remove(&key);
    match slot {
        Some(Slot::Sent(s)) => (s.on_free)(Err(e.clone())),
        Some(Slot::Wanted(w)) => (w.on_done)(Err(e.clone())),
        None => {}
    }
}

/// Queues the copy on the receiver's stream after the sender's ready event.
fn finish(s: Sent, w: Wanted) {
    match stream_for(&s, &w).and_then(|stream| Ok((copy(&s, &w, &stream)?, stream))) {
        Ok((done, stream)) => {
            // The sender's buffer is free once the copy has run on the receiver's stream.
            let free = Arc::new(Mutex::new(Some(s.on_free)));
            let later = free.clone();
            let queued = crate::cuda::on_stream_done(&stream, move || {
                if let Some(f) = later.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    f(Ok(()))
                }
            });
            if let Err(e) = queued {
                // The driver refused the callback: the stream is broken and the copy may never
                // run. Both sides learn it; the sender's buffer comes back now.
                if let Some(f) = free.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    f(Err(e.clone()))
                }
                (w.on_done)(Err(e));
                return;
            }
            (w.on_done)(Ok(done));
        }
        Err(e) => {
            (s.on_free)(Err(e.clone()));
            (w.on_done)(Err(e));
        }
    }
}

/// The stream the copy runs on: the receiver's, or for a host destination without one the
/// sender's device's.
fn stream_for(s: &Sent, w: &Wanted) -> Result<Arc<CudaStream>, Error> {
    match (&w.stream, &s.src) {
        (Some(stream), _) => Ok(stream.clone()),
        (None, End::Device { gpu, .. }) => gpu.alloc_stream(),
        (None, End::Host { .. }) => Err(Error::invalid(
            "cuda_xth: a copy into device memory needs the receiver's stream",
        )),
    }
}

fn copy(s: &Sent, w: &Wanted, on: &Arc<CudaStream>) -> Result<Option<Event>, Error> {
    use crate::cuda::{check, sys};
    if s.len != w.len {
        return Err(Error::invalid(format!(
            "cuda_xth: the sender has {} bytes, the receiver {}",
            s.len, w.len
        )));
    }
    if let Some(ready) = &s.ready {
        ready.wait_on(on)?;
    }
    let stream = on.cu_stream();
    match (&s.src, &w.dst) {
        (End::Device { ptr: src, gpu: sg }, End::Device { ptr: dst, gpu: dg }) => {
            dg.enable_peer_access(sg)?;
            // SAFETY: both ranges are `len` bytes of live device memory: the sender's buffer is
            // held until `on_free`, the receiver's until its read completes.
            unsafe { crate::cuda::copy_async((*dst, dg), (*src, sg), s.len, on)? };
            Ok(Some(dg.recorded(on)?))
        }
        (End::Host { ptr: src }, End::Device { ptr: dst, gpu: dg }) => {
            dg.bind()?;
            if s.len > 0 {
                // SAFETY: as above; pageable host memory is staged by the driver before the
                // call returns.
                check("cuMemcpyHtoDAsync", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(*dst, *src as *const _, s.len, stream)
                })?;
            }
            Ok(Some(dg.recorded(on)?))
        }
        (End::Device { ptr: src, gpu: sg }, End::Host { ptr: dst }) => {
            sg.bind()?;
            if s.len > 0 {
                // SAFETY: as above.
                check("cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(*dst as *mut _, *src, s.len, stream)
                })?;
            }
            // Host memory has no event to wait on: the bytes must be there when the read
            // completes.
            on.synchronize()
                .map_err(|e| crate::cuda::driver_error("cuStreamSynchronize", e))?;
            Ok(None)
        }
        (End::Host { .. }, End::Host { .. }) => Err(Error::invalid(
            "cuda_xth moves CUDA tensors; host to host is the xth channel's",
        )),
    }
}
