//! Device memory in remote operations (feature `cuda`).
//!
//! - The owner's copies into and out of a region of device memory (the lane's fallback,
//!   `cuda_basic`, and the owner's own `read_at`/`write_at`) are the driver's synchronous copies
//!   ([`copy_sync`]); an in-process copy (`cuda_xth`) is queued on a stream and waited for with
//!   the region held ([`copy_pieces`]).
//! - `cuda_ipc`: the initiator maps the owner's allocation once and copies on a stream of its
//!   own. [`Leases`] is the initiator's side: the first operation on a region asks the owner for
//!   a *lease* over the remote lane (the allocation's IPC handle and the region's place in it),
//!   operations issued meanwhile queue behind it, and later ones are copies queued at once. The
//!   owner records every lease it hands out; deregistration sends `REVOKE`, and the initiator
//!   answers `REVOKED` once the copies it queued on the mapping have run and the mapping is
//!   closed. Only then does the owner free or hand back the memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::lane::Job;
use super::{RegionDescriptor, Span};
use crate::backend::cuda_ipc::ipc::{self, Opened, HANDLE_LEN};
use crate::cuda::{check, driver_error, gpu, sys, CudaStream, Gpu};
use crate::error::{Error, Origin};
use crate::message::Buffer;

/// Copies `len` bytes from `src` to `dst`, either of them device memory of `gpu`, returning
/// once they are in place.
///
/// # Safety
/// Both ranges must be valid for `len` bytes (device memory of a live allocation, or host
/// memory) for the call.
pub(crate) unsafe fn copy_sync(gpu: &Gpu, dst: u64, src: u64, len: usize) -> Result<(), Error> {
    if len == 0 {
        return Ok(());
    }
    gpu.bind()?;
    // SAFETY: the caller's contract; with unified addressing the driver tells host from device
    // memory by address.
    check("cuMemcpy", unsafe { sys::cuMemcpy(dst, src, len) })
}

/// Queues each piece's copy on `stream` and waits for them.
///
/// # Safety
/// Each piece's ranges must stay valid (device memory of a live allocation, or host memory)
/// until the call returns.
pub(crate) unsafe fn copy_pieces(
    stream: &Arc<CudaStream>,
    pieces: impl Iterator<Item = crate::copy::Span>,
) -> Result<(), Error> {
    gpu(stream.context().ordinal() as u32)?.bind()?;
    for p in pieces {
        // SAFETY: the caller's contract; the stream is waited for below.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(p.dst as u64, p.src as u64, p.len, stream.cu_stream())
        })?;
    }
    stream
        .synchronize()
        .map_err(|e| driver_error("cuStreamSynchronize", e))
}

/// What the owner hands an initiator for a region of device memory: the allocation's IPC
/// handle and the region's place in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LeaseInfo {
    handle: serde_bytes::ByteBuf,
    /// The owner process's id of the allocation (never reused while that process runs).
    buffer_id: u64,
    /// The allocation's size.
    size: u64,
    /// Where the region starts in the allocation.
    offset: u64,
    /// The owner's device.
    device: u32,
}

impl LeaseInfo {
    /// The lease of `entry`'s memory, if it is exported device memory.
    pub(crate) fn of(entry: &super::Entry) -> Result<LeaseInfo, Error> {
        match (&entry.exported, &entry.gpu) {
            (Some(e), Some(g)) => Ok(LeaseInfo {
                handle: serde_bytes::ByteBuf::from(e.handle.to_vec()),
                buffer_id: e.buffer_id,
                size: e.size,
                offset: e.offset,
                device: g.ordinal(),
            }),
            _ => Err(Error::Unavailable {
                backend: "cuda_ipc".into(),
                reason: "the region is not device memory exported over CUDA IPC".into(),
            }),
        }
    }
}

/// A region of the owner mapped here.
struct Mapping {
    opened: Arc<Opened>,
    /// Where the region starts in the mapping.
    offset: u64,
    /// The descriptor the owner leased it for: operations that name the region by another
    /// (a forged token or length) never reach the mapping.
    descriptor: RegionDescriptor,
}

/// A region's state on the initiator.
enum Slot {
    /// Its lease was asked for with this descriptor: the operations issued meanwhile, in order.
    Leasing(RegionDescriptor, Vec<Job>),
    Mapped(Arc<Mapping>),
}

/// The error of an operation whose descriptor is not the one its region was leased for: spans
/// are checked against the descriptor's length here, and the mapping was granted for the
/// leased one's, so any other is refused before a copy.
fn not_leased(d: &RegionDescriptor) -> Error {
    Error::Unauthenticated {
        reason: format!(
            "region {}: the descriptor is not the one the owner leased the region for",
            d.id()
        ),
        origin: Origin::default(),
    }
}

/// The initiator's leases on one lane: the regions it mapped, the allocations behind them (two
/// regions of one allocation share its mapping: a handle opens once per process), and its
/// copy stream per device, on which every copy of the lane runs, in issue order.
///
/// A copy below [`WAIT_HERE_BELOW`] with nothing ahead of it is waited for where it was issued;
/// the others complete through a thread of the lane's own (`actorpipe-remote-wait`, started at
/// the first one, ended with the lane), which waits for each in turn in the driver
/// (`cuEventSynchronize`, the context's scheduling policy: it spins while cores are free, and
/// only while a copy is pending). The device's watcher, which the channels share, naps between
/// polls: its wake-ups cost a 64 MiB copy 2.7x its raw time. Completions of one lane are in
/// stream order anyway, so a copy stuck behind its buffer's stream holds back only its lane's.
#[derive(Default)]
pub(crate) struct Leases {
    regions: Mutex<HashMap<u64, Slot>>,
    allocations: Mutex<HashMap<u64, Weak<Opened>>>,
    streams: Mutex<HashMap<u32, Arc<CudaStream>>>,
    waiter: Mutex<Option<std::sync::mpsc::Sender<(crate::cuda::Event, Callback)>>>,
    /// Operations handed to the waiter and not completed yet.
    in_flight: std::sync::atomic::AtomicUsize,
}

type Callback = Box<dyn FnOnce() + Send>;

/// A lease request's completion: the owner's answer.
pub(crate) type LeaseDone = Box<dyn FnOnce(Result<LeaseInfo, Error>) + Send + Sync>;

/// What a queued copy needs of the lane: where notifications go (as requests), and the
/// numbers of this side's own requests.
#[derive(Clone)]
pub(crate) struct Link {
    pub(crate) jobs: mpsc::UnboundedSender<Job>,
    pub(crate) leases: Arc<Leases>,
    pub(crate) seq: Arc<std::sync::atomic::AtomicU64>,
    pub(crate) origin: Origin,
}

impl Link {
    /// A number for a request of the lane's own (a lease, a notification): never one of the
    /// pipe's operations' numbers, which stay below 2^63.
    fn next_seq(&self) -> u64 {
        (1 << 63) | self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// A request of the lane's own for `region`, with no bytes.
    fn request(&self, job: &Job, lease: Option<LeaseDone>, notify: Option<Vec<u8>>) -> Job {
        let notice = lease.is_none();
        Job {
            seq: self.next_seq(),
            write: job.write,
            region: job.region.clone(),
            spans: Vec::new(),
            buffer: Buffer::Cpu(Vec::new()),
            notify,
            deadline: None,
            issued: Instant::now(),
            cma: false,
            lease,
            notice,
            done: Box::new(|_, _| {}),
        }
    }
}

impl Leases {
    /// Runs `job` (a read or write of device memory of the peer's) through the region's
    /// mapping: now if it is mapped, after the lease otherwise.
    pub(crate) fn submit(link: &Link, job: Job) {
        let id = job.region.id();
        let mut regions = link
            .leases
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match regions.get_mut(&id) {
            Some(Slot::Mapped(m)) if m.descriptor == job.region => {
                let m = m.clone();
                drop(regions);
                copy(link, &m, job);
            }
            Some(Slot::Leasing(d, queued)) if *d == job.region => queued.push(job),
            Some(_) => {
                drop(regions);
                let e = not_leased(&job.region);
                job.finish(Err(e));
            }
            None => {
                let l = link.clone();
                let d = job.region.clone();
                let done: LeaseDone = Box::new(move |r| Leases::leased(&l, &d, r));
                let lease = link.request(&job, Some(done), None);
                regions.insert(id, Slot::Leasing(job.region.clone(), vec![job]));
                drop(regions);
                if let Err(mpsc::error::SendError(lease)) = link.jobs.send(lease) {
                    lease.finish(Err(super::lane::lane_gone(None, &link.origin)));
                }
            }
        }
    }

    /// The owner answered the lease of region `id`: map it and run the queued operations, or
    /// fail them in order.
    fn leased(link: &Link, d: &RegionDescriptor, r: Result<LeaseInfo, Error>) {
        let id = d.id();
        let mapped = r.and_then(|info| link.leases.map(&info, d));
        let mut regions = link
            .leases
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let queued = match regions.remove(&id) {
            Some(Slot::Leasing(_, q)) => q,
            Some(Slot::Mapped(m)) => {
                regions.insert(id, Slot::Mapped(m));
                Vec::new()
            }
            None => Vec::new(),
        };
        match mapped {
            Ok(m) => {
                let m = Arc::new(m);
                regions.insert(id, Slot::Mapped(m.clone()));
                drop(regions);
                for job in queued {
                    copy(link, &m, job);
                }
            }
            Err(e) => {
                drop(regions);
                for job in queued {
                    job.finish(Err(e.clone()));
                }
            }
        }
    }

    /// Opens (or finds open) the allocation of a lease of a region of `len` bytes.
    fn map(&self, info: &LeaseInfo, d: &RegionDescriptor) -> Result<Mapping, Error> {
        let len = d.len();
        let handle: [u8; HANDLE_LEN] = info.handle.as_slice().try_into().map_err(|_| {
            Error::protocol(
                format!("a CUDA IPC handle of {} bytes", info.handle.len()),
                &Origin::default(),
            )
        })?;
        // Every copy through the mapping stays inside the region, checked against the
        // descriptor's length: the region must lie inside the allocation.
        if info
            .offset
            .checked_add(len)
            .is_none_or(|end| end > info.size)
        {
            return Err(Error::protocol(
                format!(
                    "a lease placing a region of {len} bytes at {} of an allocation of {}",
                    info.offset, info.size
                ),
                &Origin::default(),
            ));
        }
        let mut allocations = self.allocations.lock().unwrap_or_else(|e| e.into_inner());
        let opened = match allocations.get(&info.buffer_id).and_then(Weak::upgrade) {
            Some(o) => o,
            None => {
                // Same host: the owner's device ordinal names the same GPU here unless the two
                // processes see different devices; the driver maps it on any device anyway.
                let here = if info.device < crate::cuda::device_count() {
                    info.device
                } else {
                    0
                };
                let o = Arc::new(ipc::open(&gpu(here)?, &handle, info.size)?);
                allocations.retain(|_, w| w.strong_count() > 0);
                allocations.insert(info.buffer_id, Arc::downgrade(&o));
                o
            }
        };
        Ok(Mapping {
            opened,
            offset: info.offset,
            descriptor: d.clone(),
        })
    }

    /// The lane's copy stream on `gpu`.
    fn stream(&self, gpu: &Arc<Gpu>) -> Result<Arc<CudaStream>, Error> {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = streams.get(&gpu.ordinal()) {
            return Ok(s.clone());
        }
        let s = gpu.alloc_stream()?;
        streams.insert(gpu.ordinal(), s.clone());
        Ok(s)
    }

    /// Runs `f` on the lane's waiter thread once the work queued on `stream` (of `gpu`) so far
    /// has run.
    fn after(&self, gpu: &Arc<Gpu>, stream: &CudaStream, f: Callback) -> Result<(), Error> {
        let done = gpu.recorded(stream)?;
        let mut waiter = self.waiter.lock().unwrap_or_else(|e| e.into_inner());
        if waiter.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<(crate::cuda::Event, Callback)>();
            std::thread::Builder::new()
                .name("actorpipe-remote-wait".into())
                .spawn(move || {
                    for (done, f) in rx {
                        // A failed wait is the context's failure: the copy's own error is
                        // unknowable here, and the operation completes either way.
                        let _ = done.synchronize();
                        f();
                    }
                })
                .map_err(|e| Error::Unavailable {
                    backend: "cuda_ipc".into(),
                    reason: format!("no thread to wait for copies: {e}"),
                })?;
            *waiter = Some(tx);
        }
        let tx = waiter.as_ref().expect("started above");
        tx.send((done, f)).map_err(|_| Error::Unavailable {
            backend: "cuda_ipc".into(),
            reason: "the lane's waiter thread ended".into(),
        })
    }

    /// The owner revoked region `id`: forgets its mapping and returns what to wait for before
    /// acknowledging (the copies queued on it) and to drop after (the mapping).
    pub(crate) fn revoke(&self, id: u64) -> Option<(Arc<CudaStream>, impl Send + 'static)> {
        let slot = self
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)?;
        let Slot::Mapped(m) = slot else {
            return None;
        };
        let stream = self.stream(m.opened.gpu()).ok()?;
        Some((stream, m))
    }

    /// Closes every mapping, once the copies queued on them have run (the lane ends).
    pub(crate) fn clear(&self) {
        let regions = std::mem::take(&mut *self.regions.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, slot) in regions {
            if let Slot::Leasing(_, queued) = slot {
                for job in queued {
                    job.finish(Err(super::lane::lane_gone(None, &Origin::default())));
                }
            }
        }
        // Dropping the last reference to an allocation's mapping synchronizes its context
        // first (`Opened`'s drop), so no queued copy outlives it.
    }
}

/// Below this many bytes an operation through a mapping is waited for on the pipe's thread
/// when nothing else of the lane is in flight and its buffer's stream has no work queued (so
/// that the wait cannot hang on a user's stream): the two thread hops to the waiter and back
/// cost about 17 µs (measured on the H200 host: a 64 MiB read at 1.40x the raw copy through
/// the waiter, 1.09x here), and the wait is bounded by the copy (4 GiB: about 2 ms at the
/// device's rate), as an in-process copy holds its pipe's thread.
const WAIT_HERE_BELOW: u64 = 4 << 30;

/// Queues `job`'s copies on the lane's stream for the mapping's device; it completes (and
/// its notification leaves) once they have run.
fn copy(link: &Link, m: &Arc<Mapping>, job: Job) {
    let total: u64 = job.spans.iter().map(|s: &Span| s.len).sum();
    let queued = (|| {
        let g = m.opened.gpu().clone();
        let stream = link.leases.stream(&g)?;
        let base = m.opened.base() + m.offset;
        let mut waits = false;
        let local = match &job.buffer {
            Buffer::Cuda(b) => {
                // The copies follow the work queued on the buffer's stream so far (nothing to
                // wait for if it has all run).
                b.gpu().bind()?;
                // SAFETY: the stream is alive (the buffer holds it).
                let idle = unsafe { sys::cuStreamQuery(b.stream().cu_stream()) };
                if idle != sys::CUresult::CUDA_SUCCESS {
                    let ready = b.gpu().recorded(b.stream())?;
                    ready.wait_on(&stream)?;
                    waits = true;
                }
                b.device_ptr()
            }
            b => b.as_cpu().map_or(0, |v| v.as_ptr() as u64),
        };
        g.bind()?;
        for s in job.spans.iter().filter(|s| s.len > 0) {
            let (remote, here) = (base + s.remote, local + s.local);
            let (dst, src) = if job.write {
                (remote, here)
            } else {
                (here, remote)
            };
            // SAFETY: the spans were checked against the region (inside the mapping: the
            // owner's lease places the region in its allocation) and the local buffer, which
            // the job holds until it completes; the mapping stays open until the stream has
            // run these copies (revocation and the lane's end wait for it).
            check("cuMemcpyAsync", unsafe {
                sys::cuMemcpyAsync(dst, src, s.len as usize, stream.cu_stream())
            })?;
        }
        Ok::<_, Error>((g, stream, waits))
    })();
    let (g, stream, waits) = match queued {
        Ok(s) => s,
        Err(e) => return job.finish(Err(e)),
    };
    let leases = link.leases.clone();
    let link = link.clone();
    let complete = move |mut job: Job| {
        let result = match job.deadline {
            Some(d) if job.issued.elapsed() > d => Err(super::lane::timeout(d, &link.origin)),
            _ => Ok(total),
        };
        if result.is_ok() {
            if let Some(data) = job.notify.take() {
                let notice = link.request(&job, None, Some(data));
                // A lane gone: the owner is too, and nobody hears the notification.
                let _ = link.jobs.send(notice);
            }
        }
        job.finish(result);
    };
    let busy = leases.in_flight.load(std::sync::atomic::Ordering::Acquire);
    if !waits && busy == 0 && total < WAIT_HERE_BELOW {
        let waited = stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e));
        return match waited {
            Ok(()) => complete(job),
            Err(e) => job.finish(Err(e)),
        };
    }
    // The job rides in a slot the callback empties, so that a failure to register the callback
    // can still complete it.
    let slot = Arc::new(Mutex::new(Some(job)));
    let in_callback = slot.clone();
    let counted = leases.clone();
    counted
        .in_flight
        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let registered = leases.after(
        &g,
        &stream,
        Box::new(move || {
            let job = in_callback.lock().unwrap_or_else(|e| e.into_inner()).take();
            counted
                .in_flight
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            if let Some(job) = job {
                complete(job);
            }
        }),
    );
    if let Err(e) = registered {
        leases
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        if let Some(job) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // The copies may still run: wait for them before the buffer goes back.
            let _ = stream.synchronize();
            job.finish(Err(e));
        }
    }
}
