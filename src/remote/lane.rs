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
//! Frames: a tag byte, then for [`REQUEST`] and [`ANSWER`] a `u32` LE length and that many
//! bytes of MessagePack (docs/protocol.md, "The remote lane").

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
}

/// An answer, as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    seq: u64,
    /// Bytes moved, or why not.
    result: Result<u64, Failure>,
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
    /// Called once, with the bytes moved or the error, and the buffer back.
    pub done: Box<dyn FnOnce(Result<u64, Error>, Buffer) + Send + Sync>,
}

impl Job {
    fn finish(self, result: Result<u64, Error>) {
        (self.done)(result, self.buffer)
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
            Box::pin(read_lane(read, sent_rx, tasks, state.clone())),
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
fn lane_gone(e: Option<io::Error>, origin: &Origin) -> Error {
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
    // The pipe let go of the lane: no more requests from this side.
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
    let via = if job.cma {
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
    let result = match answer.result {
        Err(f) => {
            if f.kind == FailureKind::CmaRefused {
                state.cma_refused.store(true, Ordering::Relaxed);
            }
            Err(f.into_error(job.deadline, origin))
        }
        Ok(n) if !job.write && !job.cma => {
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
    },
}

async fn read_lane<R: AsyncRead + Unpin>(
    mut r: R,
    mut sent: mpsc::UnboundedReceiver<Job>,
    tasks: mpsc::UnboundedSender<Task>,
    state: Arc<State>,
) {
    // The job whose answer is being read, for the abandonment to finish.
    let mut current = None;
    let end = tokio::select! {
        end = read_frames(&mut r, &mut sent, tasks, &state, &mut current) => end,
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
    // Every request of this side not answered fails, in issue order, with the lane's end; the
    // sender hands over those issued after, until the pipe lets go of the lane.
    let end = state.dead().unwrap_or(end);
    while let Some(job) = sent.recv().await {
        job.finish(Err(end.clone()));
    }
}

/// Reads the lane until it ends; returns why.
async fn read_frames<R: AsyncRead + Unpin>(
    r: &mut R,
    sent: &mut mpsc::UnboundedReceiver<Job>,
    tasks: mpsc::UnboundedSender<Task>,
    state: &State,
    current: &mut Option<Job>,
) -> Error {
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
                match take_request(request, r, &mut staging, &origin).await {
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
                if let Some(to) = &tasks {
                    let _ = to.send(Task::Probed(super::cma::reaches(pid, addr)));
                }
            }
            PROBED => match r.read_u8().await {
                Ok(ok) => state.cma_refused.store(ok == 0, Ordering::Relaxed),
                Err(e) => break lane_gone(Some(e), &origin),
            },
            other => break Error::protocol(format!("remote-lane frame tag {other}"), &origin),
        }
    }
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
    };
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
            let landed = entry.with_memory(q.region.id(), |base| {
                cursor.each(&q.spans, n as u64, |s, at, offset, len| {
                    // SAFETY: `check` put every span inside the region, whose memory the lock
                    // held by `with_memory` keeps; `at + len <= n`, inside `staging`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            staging.as_ptr().add(at as usize),
                            base.add((s.remote + offset) as usize),
                            len as usize,
                        )
                    }
                })
            });
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
            Task::Answer(seq, result) => send_answer(&out, &mut buf, seq, &result).await,
            Task::Serve {
                request,
                entry,
                total,
                deadline,
            } => {
                let out = (&*out, &mut buf, &mut stage);
                serve(request, entry, total, deadline, out, &state).await
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
) -> io::Result<()> {
    let answer = Answer {
        seq,
        result: result.as_ref().copied().map_err(Failure::of),
    };
    frame(buf, ANSWER, &answer);
    let mut w = out.write.lock().await;
    w.write_all(buf).await?;
    w.flush().await
}

/// Serves a checked request: the copy, or the read's bytes, then the answer.
async fn serve<W: AsyncWrite + Unpin>(
    q: Request,
    entry: Arc<Entry>,
    total: u64,
    deadline: Option<Instant>,
    (out, buf, stage): (&Out<W>, &mut Vec<u8>, &mut Vec<u8>),
    state: &State,
) -> io::Result<()> {
    let seq = q.seq;
    if deadline.is_some_and(|d| Instant::now() > d) {
        let left = Duration::from_micros(q.left_us.unwrap_or(0));
        return send_answer(out, buf, seq, &Err(timeout(left, &state.origin))).await;
    }
    let result = match q.via {
        Via::Cma { pid, addr, .. } => {
            let (id, write, threads) = (q.region.id(), q.write, state.cma_threads);
            let copy = {
                let entry = entry.clone();
                let spans = q.spans.clone();
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
                    && entry
                        .with_memory(q.region.id(), |base| {
                            cursor.each(&q.spans, n as u64, |s, at, offset, len| {
                                // SAFETY: `check` put every span inside the region, whose memory
                                // the lock held by `with_memory` keeps; `at + len <= n`, inside
                                // `piece`.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        base.add((s.remote + offset) as usize),
                                        piece.as_mut_ptr().add(at as usize),
                                        len as usize,
                                    )
                                }
                            })
                        })
                        .is_ok();
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
    send_answer(out, buf, seq, &result).await
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
