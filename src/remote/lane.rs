//! The remote lane: a connection of a pipe's own (joined at set-up, `Purpose::Remote`) that
//! carries one-sided operations both ways, each served by the side that owns the region.
//!
//! Each side runs three loops on its end of the lane:
//! - the **sender** writes this side's requests, in issue order (a write's bytes after its
//!   request when they travel on the lane), then hands each to the reader;
//! - the **reader** reads everything the peer sends: answers to this side's requests (it
//!   completes them, in order: the owner answers in the order it was asked) and the peer's
//!   requests, which it checks (token, bounds) and queues for the answerer; a write whose bytes
//!   travel on the lane it lands itself, as they come;
//! - the **answerer** serves the queued requests in order: a copy between the region and the
//!   initiator's memory with `process_vm_readv`/`writev` (cma), or a read's bytes streamed out
//!   on the lane, then the answer.
//!
//! The reader never waits for the lane's write half, so two sides writing large batches at each
//! other cannot deadlock. Every copy into or out of a region holds the region's memory shared
//! (`Entry::with_memory`): deregistration waits for it, and none starts after. A cma copy holds
//! it for the whole operation; bytes that travel on the lane are landed or sent a chunk
//! ([`CHUNK`]) at a time, so a deregistration can cut such an operation between two chunks (it
//! fails; a write may have landed in part).
//!
//! A side that drops its lane (the pipe failed or stopped) sends `CLOSE` after its last request;
//! the lane ends once each side has answered everything it was asked. A lane that breaks (the
//! peer died) fails every pending request in issue order, and a cma request is never failed
//! before the lane has ended: until then the owner may still be copying into its buffer.
//!
//! Device memory of the peer's on the same host (`cuda_ipc`) is mapped, not served: this side
//! asks the owner for a lease of the region (a request whose answer carries the allocation's IPC
//! handle), then copies through the mapping on a stream of its own (`super::device`). The owner
//! sends `REVOKE` when the region is deregistered; this side answers `REVOKED` once its copies
//! on the mapping have run and the mapping is closed.
//!
//! Frames: a tag byte, then for [`REQUEST`] and [`ANSWER`] a `u32` LE length and that many
//! bytes of MessagePack, for `REVOKE` and `REVOKED` the region's number, `u64` LE
//! (docs/protocol.md, "The remote lane").

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::{local, lookup, Entry, Notification, RegionDescriptor, Span};
use crate::error::{Error, Origin};
use crate::message::Buffer;

/// Bytes that travel on the lane are landed (a write) or copied out (a read) this many at a
/// time, each piece under the region's lock; the staging buffer stays in the L2 cache.
pub const CHUNK: usize = 256 << 10;

/// Largest request or answer header (a batch of about 600 000 spans).
pub const MAX_HEADER: u32 = 16 << 20;

/// A cma copy of this many bytes or more runs on a blocking thread, not the lane's.
const BLOCKING_MIN: u64 = 1 << 20;

/// One of a lane's loops, for the caller to run.
pub(crate) type Loop = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Frame tags.
const REQUEST: u8 = 1;
const ANSWER: u8 = 2;
const CLOSE: u8 = 3;
const PROBE: u8 = 4;
const PROBED: u8 = 5;
const REVOKE: u8 = 6;
const REVOKED: u8 = 7;

/// The byte a side's `PROBE` asks the peer to read with `process_vm_readv`: whether the peer may
/// reach this process's memory, which `cma` needs both ways.
static PROBE_BYTE: u8 = 0x5a;

/// A request, as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Request {
    seq: u64,
    write: bool,
    region: RegionDescriptor,
    spans: Vec<Span>,
    notify: Option<serde_bytes::ByteBuf>,
    /// Microseconds of the operation's deadline left when it was sent.
    left_us: Option<u64>,
    via: Via,
}

/// A request as this side writes it: [`Request`]'s fields, borrowed from the job (no copy of
/// its spans per operation).
#[derive(Serialize)]
struct RequestOut<'a> {
    seq: u64,
    write: bool,
    region: &'a RegionDescriptor,
    spans: &'a [Span],
    notify: Option<&'a serde_bytes::Bytes>,
    left_us: Option<u64>,
    via: Via,
}

/// Payload pieces shorter than this are gathered into the frame buffer and written with it (one
/// segment for a small operation, whatever its span count); longer ones go straight from the
/// caller's memory.
const GATHER_BELOW: u64 = 64 << 10;

/// How the bytes move.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Via {
    /// The owner copies between the region and `len` bytes at `addr` in the initiator's
    /// process `pid`, with `process_vm_readv`/`writev`.
    Cma { pid: i32, addr: u64, len: u64 },
    /// The bytes travel on the lane: a write's `payload` bytes (its spans' bytes, in span
    /// order) right after the request; a read's after an `Ok` answer, then a status byte (0:
    /// all sent; 1: the region was deregistered part-way, what follows is zeros).
    Inline { local: u64, payload: u64 },
    /// A lease of a region of device memory (no spans): the answer carries the allocation's
    /// CUDA IPC handle, and the owner counts the initiator among the region's mappers.
    Lease,
    /// A notification of an operation the initiator made through its mapping (no spans): the
    /// owner delivers `notify`, the data being in place already.
    Notice,
}

/// An answer, as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    seq: u64,
    /// Bytes moved, or why not.
    result: Result<u64, Failure>,
    /// A lease's handle and place (MessagePack of `super::device::LeaseInfo`).
    #[serde(default)]
    lease: Option<serde_bytes::ByteBuf>,
}

/// An error, as it travels.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Failure {
    kind: FailureKind,
    detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum FailureKind {
    Invalid,
    Unauthenticated,
    Timeout,
    Unavailable,
    /// The owner may not use cma towards the initiator (ptrace restrictions): the initiator
    /// uses the lane for the bytes from then on.
    CmaRefused,
    Other,
}

impl Failure {
    fn of(e: &Error) -> Failure {
        let (kind, detail) = match e {
            Error::InvalidArgument { detail } => (FailureKind::Invalid, detail.clone()),
            Error::Unauthenticated { reason, .. } => (FailureKind::Unauthenticated, reason.clone()),
            Error::Timeout { .. } => (FailureKind::Timeout, String::new()),
            Error::Unavailable { backend, reason } if backend == "cma" => {
                (FailureKind::CmaRefused, reason.clone())
            }
            Error::Unavailable { reason, .. } => (FailureKind::Unavailable, reason.clone()),
            other => (FailureKind::Other, other.to_string()),
        };
        Failure { kind, detail }
    }

    fn into_error(self, deadline: Option<Duration>, origin: &Origin) -> Error {
        match self.kind {
            FailureKind::Invalid => Error::invalid(self.detail),
            FailureKind::Unauthenticated => Error::Unauthenticated {
                reason: self.detail,
                origin: origin.clone(),
            },
            FailureKind::Timeout => timeout(deadline.unwrap_or_default(), origin),
            FailureKind::Unavailable => Error::Unavailable {
                backend: "remote".into(),
                reason: self.detail,
            },
            FailureKind::CmaRefused => Error::Unavailable {
                backend: "cma".into(),
                reason: self.detail,
            },
            FailureKind::Other => {
                Error::protocol(format!("the owner failed: {}", self.detail), origin)
            }
        }
    }
}

/// The error of an operation past its deadline.
pub(crate) fn timeout(after: Duration, origin: &Origin) -> Error {
    Error::Timeout {
        what: "a remote operation",
        after,
        origin: origin.clone(),
    }
}

/// One of this side's operations, handed to the lane.
pub(crate) struct Job {
    pub seq: u64,
    pub write: bool,
    pub region: RegionDescriptor,
    pub spans: Vec<Span>,
    /// The local memory (`Buffer::Cpu` for a read), checked against the spans.
    pub buffer: Buffer,
    pub notify: Option<Vec<u8>>,
    pub deadline: Option<Duration>,
    pub issued: Instant,
    /// The owner copies with cma (the pipe negotiated it), or the bytes travel on the lane.
    pub cma: bool,
    /// A lease request of the lane's own (`cuda_ipc`), completed with the owner's answer.
    #[cfg(feature = "cuda")]
    pub lease: Option<super::device::LeaseDone>,
    /// A notification of the lane's own, for an operation made through a mapping.
    pub notice: bool,
    /// Called once, with the bytes moved or the error, and the buffer back.
    pub done: Box<dyn FnOnce(Result<u64, Error>, Buffer) + Send + Sync>,
}

impl Job {
    pub(crate) fn finish(self, result: Result<u64, Error>) {
        #[cfg(feature = "cuda")]
        if let Some(lease) = self.lease {
            return lease(result.and_then(|_| {
                Err(Error::protocol(
                    "a lease answered without its handle",
                    &Origin::default(),
                ))
            }));
        }
        (self.done)(result, self.buffer)
    }

    fn is_lease(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.lease.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Whether the owner's answer is followed by the bytes read.
    fn reads_inline(&self) -> bool {
        !self.write && !self.cma && !self.notice && !self.is_lease()
    }

    fn total(&self) -> u64 {
        self.spans.iter().map(|s| s.len).sum()
    }
}

/// What both loops of a side know of the lane.
struct State {
    /// Why the lane ended, once it has.
    dead: Mutex<Option<Error>>,
    /// The owner said cma is not permitted towards us.
    cma_refused: AtomicBool,
    /// Most threads one cma copy of ours (as the owner) shares itself among.
    cma_threads: usize,
    /// Told [`ABANDON_AFTER`] after the pipe let go of the lane: the reader then stops waiting
    /// for answers that a frozen peer may never send.
    abandon: tokio::sync::Notify,
    origin: Origin,
    /// As the owner: the acknowledgements that deregistrations wait for, by region, until the
    /// peer's `REVOKED` or, once the lane has ended, the peer process's exit.
    revoking: Mutex<HashMap<u64, Vec<tokio::sync::oneshot::Sender<()>>>>,
    /// The peer's process id, from its `PROBE` (0 until then).
    peer_pid: std::sync::atomic::AtomicI32,
    /// As the initiator: the peer's regions of device memory mapped here.
    #[cfg(feature = "cuda")]
    leases: Arc<super::device::Leases>,
    /// Numbers of the lane's own requests.
    #[cfg(feature = "cuda")]
    seq: Arc<std::sync::atomic::AtomicU64>,
}

impl State {
    fn dead(&self) -> Option<Error> {
        self.dead.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn fail(&self, e: Error) {
        let mut d = self.dead.lock().unwrap_or_else(|e| e.into_inner());
        if d.is_none() {
            *d = Some(e);
        }
    }
}

/// The write half, shared by the sender and the answerer; the last to let go shuts it down.
struct Out<W> {
    write: tokio::sync::Mutex<W>,
    holders: AtomicUsize,
}

impl<W: AsyncWrite + Unpin> Out<W> {
    async fn release(&self) {
        if self.holders.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _ = self.write.lock().await.shutdown().await;
        }
    }
}

/// This side's handle on a pipe's lane: where its operations go. Dropping it closes the lane
/// for new operations (those handed in before still complete).
pub(crate) struct Lane {
    jobs: mpsc::UnboundedSender<Job>,
    state: Arc<State>,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("dead", &self.state.dead())
            .finish_non_exhaustive()
    }
}

impl Lane {
    /// Starts the lane's loops on `read` and `write`; the caller runs the futures (all three,
    /// to their end).
    pub(crate) fn start<R, W>(
        read: R,
        write: W,
        origin: Origin,
        cma_threads: usize,
    ) -> (Lane, Vec<Loop>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let state = Arc::new(State {
            dead: Mutex::new(None),
            cma_refused: AtomicBool::new(false),
            cma_threads,
            abandon: tokio::sync::Notify::new(),
            origin,
            revoking: Mutex::new(HashMap::new()),
            peer_pid: std::sync::atomic::AtomicI32::new(0),
            #[cfg(feature = "cuda")]
            leases: Default::default(),
            #[cfg(feature = "cuda")]
            seq: Default::default(),
        });
        let out = Arc::new(Out {
            write: tokio::sync::Mutex::new(write),
            holders: AtomicUsize::new(2),
        });
        let (jobs, jobs_rx) = mpsc::unbounded_channel();
        let (sent, sent_rx) = mpsc::unbounded_channel();
        let (tasks, tasks_rx) = mpsc::unbounded_channel();
        let loops: Vec<Loop> = vec![
            Box::pin(send_requests(jobs_rx, sent, out.clone(), state.clone())),
            Box::pin(read_lane(read, sent_rx, tasks, out.clone(), state.clone())),
            Box::pin(answer(tasks_rx, out, state.clone())),
        ];
        (Lane { jobs, state }, loops)
    }

    /// Hands `job` to the lane; it completes through its `done`, in the order handed in.
    pub(crate) fn submit(&self, job: Job) {
        if let Err(mpsc::error::SendError(job)) = self.jobs.send(job) {
            let e = self
                .state
                .dead()
                .unwrap_or_else(|| lane_gone(None, &self.state.origin));
            job.finish(Err(e));
        }
    }

    /// Whether the owner refused cma towards this process (the bytes then travel on the lane).
    pub(crate) fn cma_refused(&self) -> bool {
        self.state.cma_refused.load(Ordering::Relaxed)
    }

    /// Hands `job` (on the peer's device memory, `cuda_ipc`) to the region's mapping: copied
    /// here on the lane's stream, after the region's lease where it has none yet.
    #[cfg(feature = "cuda")]
    pub(crate) fn submit_mapped(&self, job: Job) {
        if let Some(e) = self.state.dead() {
            return job.finish(Err(e));
        }
        let link = super::device::Link {
            jobs: self.jobs.clone(),
            leases: self.state.leases.clone(),
            seq: self.state.seq.clone(),
            origin: self.state.origin.clone(),
        };
        super::device::Leases::submit(&link, job);
    }
}

/// How long after its pipe let go of it a lane still waits for the peer's answers: a peer that
/// is frozen (stopped, not dead) keeps its connections open and answers nothing. The cma
/// channel's grace for a frozen reader: a cma operation's buffer must not come back while the
/// owner may still be copying into it, which a live owner never takes this long to do.
pub(crate) const ABANDON_AFTER: Duration = crate::backend::cma::driver::GRACE;

impl Drop for Lane {
    fn drop(&mut self) {
        // The sender ends now (its jobs channel closes); the reader, once every answer is in or
        // the lane has ended, or at the latest `ABANDON_AFTER` from now.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let state = self.state.clone();
            rt.spawn(async move {
                tokio::time::sleep(ABANDON_AFTER).await;
                state.abandon.notify_one();
            });
        }
    }
}

/// The error of operations on a lane that ended.
pub(crate) fn lane_gone(e: Option<io::Error>, origin: &Origin) -> Error {
    Error::PeerClosed {
        reason: match e {
            Some(e) => format!("the remote-memory lane ended: {e}"),
            None => "the remote-memory lane ended".into(),
        },
        graceful: false,
        origin: origin.clone(),
    }
}

/// Appends a frame (`tag`, length, MessagePack of `header`) to `buf`.
fn frame(buf: &mut Vec<u8>, tag: u8, header: &impl Serialize) {
    buf.clear();
    buf.push(tag);
    buf.extend_from_slice(&[0; 4]);
    rmp_serde::encode::write(buf, header).expect("a remote-lane header always serialises");
    let len = (buf.len() - 5) as u32;
    buf[1..5].copy_from_slice(&len.to_le_bytes());
}

/// Reads a header's length and bytes (after its tag) and decodes it.
async fn header<R: AsyncRead + Unpin, T: serde::de::DeserializeOwned>(
    r: &mut R,
    scratch: &mut Vec<u8>,
    origin: &Origin,
) -> Result<T, Error> {
    let len = r
        .read_u32_le()
        .await
        .map_err(|e| lane_gone(Some(e), origin))?;
    if len > MAX_HEADER {
        return Err(Error::LimitExceeded {
            limit: "remote-lane header",
            value: len as u64,
            max: MAX_HEADER as u64,
            origin: origin.clone(),
        });
    }
    scratch.resize(len as usize, 0);
    r.read_exact(scratch)
        .await
        .map_err(|e| lane_gone(Some(e), origin))?;
    rmp_serde::from_slice(scratch).map_err(|e| {
        Error::protocol(
            format!("a remote-lane header that does not decode: {e}"),
            origin,
        )
    })
}

// ----- this side's requests --------------------------------------------------------------

async fn send_requests<W: AsyncWrite + Unpin>(
    mut jobs: mpsc::UnboundedReceiver<Job>,
    sent: mpsc::UnboundedSender<Job>,
    out: Arc<Out<W>>,
    state: Arc<State>,
) {
    let mut buf = Vec::new();
    // First: may the peer reach our memory (cma)? Until it answers, `cma` is assumed.
    buf.push(PROBE);
    buf.extend_from_slice(&(std::process::id() as i32).to_le_bytes());
    buf.extend_from_slice(&(&PROBE_BYTE as *const u8 as u64).to_le_bytes());
    let probed = async {
        let mut w = out.write.lock().await;
        w.write_all(&buf).await?;
        w.flush().await
    };
    if let Err(e) = probed.await {
        state.fail(lane_gone(Some(e), &state.origin));
    }
    while let Some(job) = jobs.recv().await {
        if state.dead().is_none() {
            if let Err(e) = send_request(&job, &out, &mut buf).await {
                state.fail(lane_gone(Some(e), &state.origin));
            }
        }
        // The reader completes it: with its answer, or with the lane's end.
        let _ = sent.send(job);
    }
    // The pipe let go of the lane: no more requests from this side, and no more mappings of
    // the peer's memory (closed once the copies queued on them have run).
    #[cfg(feature = "cuda")]
    state.leases.clear();
    if state.dead().is_none() {
        let mut w = out.write.lock().await;
        let _ = async {
            w.write_all(&[CLOSE]).await?;
            w.flush().await
        }
        .await;
    }
    out.release().await;
}

async fn send_request<W: AsyncWrite + Unpin>(
    job: &Job,
    out: &Out<W>,
    buf: &mut Vec<u8>,
) -> io::Result<()> {
    let src = job.buffer.as_cpu().unwrap_or(&[]);
    let via = if job.notice {
        Via::Notice
    } else if job.is_lease() {
        Via::Lease
    } else if job.cma {
        Via::Cma {
            pid: std::process::id() as i32,
            addr: src.as_ptr() as u64,
            len: src.len() as u64,
        }
    } else {
        Via::Inline {
            local: src.len() as u64,
            payload: if job.write { job.total() } else { 0 },
        }
    };
    let left_us = job
        .deadline
        .map(|d| d.saturating_sub(job.issued.elapsed()).as_micros() as u64);
    let request = RequestOut {
        seq: job.seq,
        write: job.write,
        region: &job.region,
        spans: &job.spans,
        notify: job.notify.as_deref().map(serde_bytes::Bytes::new),
        left_us,
        via,
    };
    frame(buf, REQUEST, &request);
    let mut w = out.write.lock().await;
    if let Via::Inline { payload, .. } = via {
        if payload > 0 {
            for s in &job.spans {
                let piece = &src[s.local as usize..(s.local + s.len) as usize];
                if s.len < GATHER_BELOW {
                    buf.extend_from_slice(piece);
                    if buf.len() >= CHUNK {
                        w.write_all(buf).await?;
                        buf.clear();
                    }
                } else {
                    w.write_all(buf).await?;
                    buf.clear();
                    w.write_all(piece).await?;
                }
            }
        }
    }
    w.write_all(buf).await?;
    w.flush().await
}

/// Completes `job` with its answer (reading a read's bytes into its buffer). An error that
/// ends the lane is returned, after the job is failed with it.
async fn complete<R: AsyncRead + Unpin>(
    slot: &mut Option<Job>,
    answer: Answer,
    r: &mut R,
    state: &State,
) -> Result<(), Error> {
    let origin = &state.origin;
    // The job stays in `slot` while its bytes are read: a reader abandoned meanwhile finishes it.
    let job = slot.as_mut().expect("the job being completed");
    #[cfg(feature = "cuda")]
    if job.is_lease() {
        let job = slot.take().expect("the lease being completed");
        let lease = job.lease.expect("a lease");
        let info = match (answer.result, answer.lease) {
            (Err(f), _) => Err(f.into_error(None, origin)),
            (Ok(_), Some(b)) => rmp_serde::from_slice(&b)
                .map_err(|e| Error::protocol(format!("a lease that does not decode: {e}"), origin)),
            (Ok(_), None) => Err(Error::protocol(
                "a lease answered without its handle",
                origin,
            )),
        };
        lease(info);
        return Ok(());
    }
    let result = match answer.result {
        Err(f) => {
            if f.kind == FailureKind::CmaRefused {
                state.cma_refused.store(true, Ordering::Relaxed);
            }
            Err(f.into_error(job.deadline, origin))
        }
        Ok(n) if job.reads_inline() => {
            // The read's bytes follow, then the status byte.
            if n != job.total() {
                let e = Error::protocol(
                    format!("a remote read of {} bytes answered with {n}", job.total()),
                    origin,
                );
                finish(slot, Err(e.clone()));
                return Err(e);
            }
            let landed = async {
                let dst = job
                    .buffer
                    .as_cpu_mut()
                    .expect("a read's buffer is Buffer::Cpu");
                for s in &job.spans {
                    let at = s.local as usize;
                    r.read_exact(&mut dst[at..at + s.len as usize]).await?;
                }
                r.read_u8().await
            }
            .await;
            match landed {
                Ok(0) => Ok(n),
                Ok(_) => Err(Error::invalid(
                    "the region was deregistered while the read was served",
                )),
                Err(e) => {
                    let e = lane_gone(Some(e), origin);
                    finish(slot, Err(e.clone()));
                    return Err(e);
                }
            }
        }
        Ok(n) => Ok(n),
    };
    // Past its deadline it fails, whatever was copied.
    let result = match job.deadline {
        Some(d) if job.issued.elapsed() > d => result.and(Err(timeout(d, origin))),
        _ => result,
    };
    finish(slot, result);
    Ok(())
}

/// Finishes the job in `slot`.
fn finish(slot: &mut Option<Job>, result: Result<u64, Error>) {
    if let Some(job) = slot.take() {
        job.finish(result);
    }
}

// ----- the reader ------------------------------------------------------------------------

/// What the reader hands the answerer.
enum Task {
    /// The answer to the peer's `PROBE`: whether we may reach its memory.
    Probed(bool),
    /// An answer made already (a refusal, or a write landed by the reader).
    Answer(u64, Result<u64, Error>),
    /// A request to serve: checked, its region found.
    Serve {
        request: Request,
        entry: Arc<Entry>,
        total: u64,
        deadline: Option<Instant>,
        /// For a lease: where the region's deregistration reaches the answerer (`REVOKE`).
        revoke: Option<mpsc::WeakUnboundedSender<Task>>,
    },
    /// The owner deregisters region `0`, which the peer mapped: send `REVOKE`, and hand the
    /// acknowledgement to the peer's `REVOKED`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Revoke(u64, tokio::sync::oneshot::Sender<()>),
}

async fn read_lane<R, W>(
    mut r: R,
    mut sent: mpsc::UnboundedReceiver<Job>,
    tasks: mpsc::UnboundedSender<Task>,
    out: Arc<Out<W>>,
    state: Arc<State>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // The job whose answer is being read, for the abandonment to finish.
    let mut current = None;
    let end = tokio::select! {
        end = read_frames(&mut r, &mut sent, tasks, &out, &state, &mut current) => end,
        () = state.abandon.notified() => Error::PeerClosed {
            reason: format!(
                "the remote-memory lane was abandoned: its pipe failed or stopped {ABANDON_AFTER:?} \
                 ago, and the peer has not answered since (frozen?)"
            ),
            graceful: false,
            origin: state.origin.clone(),
        },
    };
    finish(&mut current, Err(end.clone()));
    state.fail(end.clone());
    // Deregistrations waiting for the peer to let go of its mappings: a peer that died holds
    // none; one that lives (frozen, or its pipe failed on our side first) may still copy
    // through them, so the memory stays until that process has exited.
    let waiting = std::mem::take(&mut *state.revoking.lock().unwrap_or_else(|e| e.into_inner()));
    if !waiting.is_empty() {
        let pid = state.peer_pid.load(Ordering::Relaxed);
        let acks: Vec<_> = waiting.into_values().flatten().collect();
        release_after_exit(pid, acks);
    }
    // Every request of this side not answered fails, in issue order, with the lane's end; the
    // sender hands over those issued after, until the pipe lets go of the lane.
    let end = state.dead().unwrap_or(end);
    while let Some(job) = sent.recv().await {
        job.finish(Err(end.clone()));
    }
}

/// Reads the lane until it ends; returns why.
async fn read_frames<R, W>(
    r: &mut R,
    sent: &mut mpsc::UnboundedReceiver<Job>,
    tasks: mpsc::UnboundedSender<Task>,
    out: &Arc<Out<W>>,
    state: &State,
    current: &mut Option<Job>,
) -> Error
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let origin = state.origin.clone();
    let mut scratch = Vec::new();
    let mut staging = Vec::new();
    // Dropped at the peer's `CLOSE`: the answerer serves what is queued, then lets go of the
    // write half.
    let mut tasks = Some(tasks);
    loop {
        let tag = match r.read_u8().await {
            Ok(t) => t,
            Err(e) => break lane_gone(Some(e), &origin),
        };
        match tag {
            REQUEST => {
                let request: Request = match header(r, &mut scratch, &origin).await {
                    Ok(q) => q,
                    Err(e) => break e,
                };
                let Some(to) = &tasks else {
                    break Error::protocol("a remote request after the peer's close", &origin);
                };
                match take_request(request, r, &mut staging, to, &origin).await {
                    Ok(task) => {
                        let _ = to.send(task);
                    }
                    Err(e) => break e,
                }
            }
            ANSWER => {
                let answer: Answer = match header(r, &mut scratch, &origin).await {
                    Ok(a) => a,
                    Err(e) => break e,
                };
                let Some(job) = sent.recv().await else {
                    break Error::protocol("an answer to no remote request", &origin);
                };
                if job.seq != answer.seq {
                    let e = Error::protocol(
                        format!(
                            "the answer to remote request {} came for {}",
                            job.seq, answer.seq
                        ),
                        &origin,
                    );
                    job.finish(Err(e.clone()));
                    break e;
                }
                *current = Some(job);
                if let Err(e) = complete(current, answer, r, state).await {
                    break e;
                }
            }
            // The peer sends no more requests; the answerer serves those queued, and ends.
            CLOSE => tasks = None,
            PROBE => {
                let mut b = [0u8; 12];
                if let Err(e) = r.read_exact(&mut b).await {
                    break lane_gone(Some(e), &origin);
                }
                let pid = i32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
                let addr = u64::from_le_bytes(b[4..].try_into().expect("8 bytes"));
                state.peer_pid.store(pid, Ordering::Relaxed);
                if let Some(to) = &tasks {
                    let _ = to.send(Task::Probed(super::cma::reaches(pid, addr)));
                }
            }
            PROBED => match r.read_u8().await {
                Ok(ok) => state.cma_refused.store(ok == 0, Ordering::Relaxed),
                Err(e) => break lane_gone(Some(e), &origin),
            },
            // The owner deregisters a region we mapped: acknowledge once our copies on the
            // mapping have run and it is closed.
            REVOKE => match r.read_u64_le().await {
                Ok(id) => revoked(id, out, state),
                Err(e) => break lane_gone(Some(e), &origin),
            },
            // The peer let go of a region of ours: the deregistration may go on.
            REVOKED => match r.read_u64_le().await {
                Ok(id) => {
                    let acks = state
                        .revoking
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                    for ack in acks.into_iter().flatten() {
                        let _ = ack.send(());
                    }
                }
                Err(e) => break lane_gone(Some(e), &origin),
            },
            other => break Error::protocol(format!("remote-lane frame tag {other}"), &origin),
        }
    }
}

/// Writes a `REVOKE` or `REVOKED` frame: the tag and the region's number.
async fn id_frame<W: AsyncWrite + Unpin>(out: &Out<W>, tag: u8, id: u64) -> io::Result<()> {
    let mut frame = [0u8; 9];
    frame[0] = tag;
    frame[1..].copy_from_slice(&id.to_le_bytes());
    let mut w = out.write.lock().await;
    w.write_all(&frame).await?;
    w.flush().await
}

/// Sends `acks` once process `pid` has exited (at once if it has, or if `pid` is unknown): the
/// lane to a peer that held mappings of ours ended without its `REVOKED`.
fn release_after_exit(pid: i32, acks: Vec<tokio::sync::oneshot::Sender<()>>) {
    let release = move || {
        for ack in acks {
            let _ = ack.send(());
        }
    };
    if pid <= 0 || pid == std::process::id() as i32 {
        return release();
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    if fd < 0 {
        // ESRCH: gone already. (Another error, e.g. a kernel without pidfd_open: the peer is
        // taken at its lane's word.)
        return release();
    }
    tracing::warn!(
        pid,
        "a peer's remote lane ended while it mapped regions of ours: their memory is kept \
         until that process exits"
    );
    let watch = move || {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` names the pidfd opened above; it becomes readable when the process exits.
        while unsafe { libc::poll(&mut p, 1, -1) } < 0 {}
        // SAFETY: the descriptor opened above, closed once.
        unsafe { libc::close(fd) };
        release();
    };
    if let Err(e) = std::thread::Builder::new()
        .name("actorpipe-peer-exit".into())
        .spawn(watch)
    {
        tracing::error!("no thread to wait for a peer's exit ({e}): its regions are released now");
    }
}

/// The owner revoked region `id`: once the copies queued on its mapping have run, closes the
/// mapping and answers `REVOKED` (at once if it was not mapped).
fn revoked<W: AsyncWrite + Unpin + Send + 'static>(id: u64, out: &Arc<Out<W>>, state: &State) {
    let out = out.clone();
    #[cfg(feature = "cuda")]
    let pending = state.leases.revoke(id).and_then(|(stream, mapping)| {
        let (tx, rx) = tokio::sync::oneshot::channel();
        crate::cuda::on_stream_done(&stream, move || {
            let _ = tx.send(());
        })
        .ok()
        .map(|()| (rx, mapping))
    });
    #[cfg(not(feature = "cuda"))]
    let _ = state;
    tokio::spawn(async move {
        #[cfg(feature = "cuda")]
        if let Some((done, mapping)) = pending {
            let _ = done.await;
            // Closing synchronizes the mapping's context: off the lane's thread.
            let _ = tokio::task::spawn_blocking(move || drop(mapping)).await;
        }
        let _ = id_frame(&out, REVOKED, id).await;
    });
}

/// Checks a peer's request: its region, token, bounds and deadline.
fn check(
    q: &Request,
    arrived: Instant,
    origin: &Origin,
) -> Result<(Arc<Entry>, u64, Option<Instant>), Error> {
    let deadline = q.left_us.map(|us| arrived + Duration::from_micros(us));
    if q.left_us == Some(0) {
        return Err(timeout(Duration::ZERO, origin));
    }
    let entry = lookup(&q.region)?;
    let local = match q.via {
        Via::Cma { len, .. } => len,
        Via::Inline { local, .. } => local,
        Via::Lease | Via::Notice => 0,
    };
    if matches!(q.via, Via::Cma { .. }) && entry.is_device() {
        return Err(Error::invalid(
            "the region is device memory: cma cannot reach it",
        ));
    }
    let total = local::validate(&entry, &q.spans, local, q.write)?;
    if let Via::Inline { payload, .. } = q.via {
        if q.write && payload != total {
            return Err(Error::invalid(format!(
                "a remote write of {total} bytes came with {payload}"
            )));
        }
    }
    Ok((entry, total, deadline))
}

/// Takes a peer's request off the lane: a write whose bytes follow it is landed here (the
/// bytes must be read off the lane whatever happens to them); the rest go to the answerer.
async fn take_request<R: AsyncRead + Unpin>(
    q: Request,
    r: &mut R,
    staging: &mut Vec<u8>,
    tasks: &mpsc::UnboundedSender<Task>,
    origin: &Origin,
) -> Result<Task, Error> {
    let seq = q.seq;
    let checked = check(&q, Instant::now(), origin);
    let payload = match q.via {
        Via::Inline { payload, .. } if q.write => payload,
        _ => 0,
    };
    if payload == 0 {
        return Ok(match checked {
            Err(e) => Task::Answer(seq, Err(e)),
            Ok((entry, total, deadline)) => Task::Serve {
                revoke: matches!(q.via, Via::Lease).then(|| tasks.downgrade()),
                request: q,
                entry,
                total,
                deadline,
            },
        });
    }
    let (entry, total) = match checked {
        Ok((entry, total, _)) => (entry, total),
        Err(e) => {
            drain(r, payload, staging, origin).await?;
            return Ok(Task::Answer(seq, Err(e)));
        }
    };
    let mut result = Ok(total);
    let mut cursor = Cursor::default();
    let mut left = payload;
    while left > 0 {
        let n = next_chunk(r, &mut left, staging, origin).await?;
        if result.is_ok() {
            let landed = move_chunk(&entry, &q, &mut cursor, staging.as_mut_ptr(), n, true);
            if let Err(e) = landed {
                result = Err(e);
            }
        }
    }
    if result.is_ok() {
        if let Some(data) = q.notify {
            entry.notify(Notification {
                region: q.region.id(),
                write: true,
                data: data.into_vec(),
            });
        }
    }
    Ok(Task::Answer(seq, result))
}

/// Moves the next `n` bytes of a request's stream of span bytes between `staged` (host memory
/// of at least `n` bytes) and the region: into it if `into`. Holds the region for the chunk.
fn move_chunk(
    entry: &Entry,
    q: &Request,
    cursor: &mut Cursor,
    staged: *mut u8,
    n: usize,
    into: bool,
) -> Result<(), Error> {
    entry
        .with_memory(q.region.id(), |base| {
            let mut moved = Ok(());
            cursor.each(&q.spans, n as u64, |s, at, offset, len| {
                if moved.is_ok() {
                    // SAFETY: `check` put every span inside the region, whose memory the lock
                    // held by `with_memory` keeps; `at + len <= n`, inside `staged`.
                    moved = unsafe {
                        entry.move_bytes(
                            base,
                            s.remote + offset,
                            staged.add(at as usize),
                            len as usize,
                            into,
                        )
                    };
                }
            });
            moved
        })
        .and_then(|r| r)
}

/// Reads and drops `n` bytes off the lane.
async fn drain<R: AsyncRead + Unpin>(
    r: &mut R,
    mut n: u64,
    staging: &mut Vec<u8>,
    origin: &Origin,
) -> Result<(), Error> {
    while n > 0 {
        next_chunk(r, &mut n, staging, origin).await?;
    }
    Ok(())
}

/// Reads the next chunk of the `left` bytes that follow on the lane into `staging`; returns its
/// length.
async fn next_chunk<R: AsyncRead + Unpin>(
    r: &mut R,
    left: &mut u64,
    staging: &mut Vec<u8>,
    origin: &Origin,
) -> Result<usize, Error> {
    if staging.len() < CHUNK {
        staging.resize(CHUNK, 0);
    }
    let n = (*left).min(CHUNK as u64) as usize;
    r.read_exact(&mut staging[..n])
        .await
        .map_err(|e| lane_gone(Some(e), origin))?;
    *left -= n as u64;
    Ok(n)
}

/// Where a stream of the spans' bytes, in span order, has got to.
#[derive(Default)]
pub(super) struct Cursor {
    pub(super) span: usize,
    pub(super) offset: u64,
}

impl Cursor {
    /// Walks the next `n` bytes of the stream: calls `f(span, at, offset, len)` for each piece,
    /// `at` counting from the first of the `n` bytes, `offset` within the span.
    pub(super) fn each(&mut self, spans: &[Span], n: u64, mut f: impl FnMut(&Span, u64, u64, u64)) {
        let mut at = 0;
        while at < n && self.span < spans.len() {
            let s = &spans[self.span];
            let len = (s.len - self.offset).min(n - at);
            if len > 0 {
                f(s, at, self.offset, len);
            }
            at += len;
            self.offset += len;
            if self.offset == s.len {
                self.span += 1;
                self.offset = 0;
            }
        }
    }
}

// ----- the answerer ----------------------------------------------------------------------

async fn answer<W: AsyncWrite + Unpin>(
    mut tasks: mpsc::UnboundedReceiver<Task>,
    out: Arc<Out<W>>,
    state: Arc<State>,
) {
    let mut buf = Vec::new();
    let mut stage = Vec::new();
    while let Some(task) = tasks.recv().await {
        let sent = match task {
            Task::Probed(ok) => {
                let mut w = out.write.lock().await;
                async {
                    w.write_all(&[PROBED, u8::from(ok)]).await?;
                    w.flush().await
                }
                .await
            }
            Task::Answer(seq, result) => send_answer(&out, &mut buf, seq, &result, None).await,
            Task::Serve {
                request,
                entry,
                total,
                deadline,
                revoke,
            } => {
                let out = (&*out, &mut buf, &mut stage);
                serve(request, entry, total, deadline, revoke, out, &state).await
            }
            Task::Revoke(id, ack) => {
                state
                    .revoking
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(id)
                    .or_default()
                    .push(ack);
                id_frame(&out, REVOKE, id).await
            }
        };
        if sent.is_err() {
            // The lane broke: the reader sees it too and ends the rest.
            break;
        }
    }
    out.release().await;
}

async fn send_answer<W: AsyncWrite + Unpin>(
    out: &Out<W>,
    buf: &mut Vec<u8>,
    seq: u64,
    result: &Result<u64, Error>,
    lease: Option<serde_bytes::ByteBuf>,
) -> io::Result<()> {
    let answer = Answer {
        seq,
        result: result.as_ref().copied().map_err(Failure::of),
        lease,
    };
    frame(buf, ANSWER, &answer);
    let mut w = out.write.lock().await;
    w.write_all(buf).await?;
    w.flush().await
}

/// Serves a checked request: the copy, or the read's bytes, then the answer.
#[allow(clippy::too_many_arguments)]
async fn serve<W: AsyncWrite + Unpin>(
    mut q: Request,
    entry: Arc<Entry>,
    total: u64,
    deadline: Option<Instant>,
    revoke: Option<mpsc::WeakUnboundedSender<Task>>,
    (out, buf, stage): (&Out<W>, &mut Vec<u8>, &mut Vec<u8>),
    state: &State,
) -> io::Result<()> {
    let seq = q.seq;
    if deadline.is_some_and(|d| Instant::now() > d) {
        let left = Duration::from_micros(q.left_us.unwrap_or(0));
        return send_answer(out, buf, seq, &Err(timeout(left, &state.origin)), None).await;
    }
    let result = match q.via {
        Via::Lease => {
            let leased = lease(&q, &entry, revoke);
            let (result, info) = match leased {
                Ok(info) => (Ok(0), Some(info)),
                Err(e) => (Err(e), None),
            };
            return send_answer(out, buf, seq, &result, info).await;
        }
        Via::Notice => Ok(0),
        Via::Cma { pid, addr, .. } => {
            let (id, write, threads) = (q.region.id(), q.write, state.cma_threads);
            let copy = {
                let entry = entry.clone();
                let spans = std::mem::take(&mut q.spans);
                move || {
                    entry
                        .with_memory(id, |base| {
                            super::cma::copy(pid, base, addr, &spans, write, threads)
                        })
                        .and_then(|r| r)
                }
            };
            let r = if total >= BLOCKING_MIN {
                tokio::task::spawn_blocking(copy).await.unwrap_or_else(|e| {
                    Err(Error::protocol(
                        format!("a cma copy panicked: {e}"),
                        &state.origin,
                    ))
                })
            } else {
                copy()
            };
            r.map(|()| total)
        }
        Via::Inline { .. } => {
            // A read: the answer, its bytes a chunk at a time, the status byte, gathered into
            // writes of up to a chunk (one for a small read) through `stage`, which is never
            // cleared: nothing is zeroed per operation.
            let mut w = out.write.lock().await;
            frame(
                buf,
                ANSWER,
                &Answer {
                    seq,
                    result: Ok(total),
                    lease: None,
                },
            );
            if stage.len() < CHUNK + 1 {
                stage.resize(CHUNK + 1, 0);
            }
            let mut used = 0;
            if buf.len() + (total as usize) < CHUNK {
                stage[..buf.len()].copy_from_slice(buf);
                used = buf.len();
            } else {
                w.write_all(buf).await?;
            }
            let mut cursor = Cursor::default();
            let mut left = total;
            let mut whole = true;
            loop {
                let n = left.min((CHUNK - used) as u64) as usize;
                left -= n as u64;
                let piece = &mut stage[used..used + n];
                let copied = whole
                    && move_chunk(&entry, &q, &mut cursor, piece.as_mut_ptr(), n, false).is_ok();
                if !copied {
                    // Deregistered part-way: zeros from here, and the status byte says so.
                    whole = false;
                    piece.fill(0);
                }
                used += n;
                if left == 0 {
                    // `stage` has a byte past the chunk for it.
                    stage[used] = u8::from(!whole);
                    w.write_all(&stage[..used + 1]).await?;
                    break;
                }
                w.write_all(&stage[..used]).await?;
                used = 0;
            }
            w.flush().await?;
            drop(w);
            if whole {
                notify(&entry, &q);
            }
            return Ok(());
        }
    };
    if result.is_ok() {
        notify(&entry, &q);
    }
    send_answer(out, buf, seq, &result, None).await
}

/// The lane of a peer that mapped a region of ours, as the region's entry holds it: a weak
/// handle on the answerer's queue, so that it does not keep the lane open.
#[cfg(feature = "cuda")]
struct LaneHolder(mpsc::WeakUnboundedSender<Task>);

#[cfg(feature = "cuda")]
impl super::Holder for LaneHolder {
    fn gone(&self) -> bool {
        self.0.strong_count() == 0
    }

    fn revoke(self: Box<Self>, id: u64, ack: tokio::sync::oneshot::Sender<()>) -> bool {
        match self.0.upgrade() {
            Some(to) => to.send(Task::Revoke(id, ack)).is_ok(),
            None => false,
        }
    }
}

/// Hands the peer a lease of `entry` (device memory exported over CUDA IPC), counting it among
/// the region's mappers: its deregistration then sends `REVOKE` through `revoke` and waits.
fn lease(
    q: &Request,
    entry: &Entry,
    revoke: Option<mpsc::WeakUnboundedSender<Task>>,
) -> Result<serde_bytes::ByteBuf, Error> {
    #[cfg(feature = "cuda")]
    {
        // The initiator checks spans against the descriptor's length, so the lease is granted
        // only for the region's own.
        if q.region.len() != entry.len {
            return Err(Error::Unauthenticated {
                reason: format!(
                    "region {}: the descriptor's length is not the region's",
                    q.region.id()
                ),
                origin: Origin::default(),
            });
        }
        let info = super::device::LeaseInfo::of(entry)?;
        let revoke = revoke.ok_or_else(|| Error::invalid("a lease after the peer's close"))?;
        entry.lease(q.region.id(), Box::new(LaneHolder(revoke)))?;
        let bytes = rmp_serde::to_vec(&info).expect("a lease always serialises");
        Ok(serde_bytes::ByteBuf::from(bytes))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, entry, revoke);
        Err(Error::Unavailable {
            backend: "cuda_ipc".into(),
            reason: "the owner was built without the `cuda` feature".into(),
        })
    }
}

fn notify(entry: &Entry, q: &Request) {
    if let Some(data) = &q.notify {
        entry.notify(Notification {
            region: q.region.id(),
            write: q.write,
            data: data.to_vec(),
        });
    }
}
