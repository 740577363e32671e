//! A byte stream over a shared fabric endpoint: what the `efa` transport hands to the shared
//! read and write loops (`transport::stream`), as any other transport's halves.
//!
//! Each direction is a pipe of its own on the endpoint actor (so each half gets its own ordered
//! queue of ends). The writing half may have at most `WINDOW` messages unconsumed at the
//! receiver (its credits). Where the endpoint has an inbox (its shared receives: every provider
//! but rxm's passthru, `Engine::set_inbox`) a message lands in one of the inbox's `bounce`-byte
//! receives, whichever pipe it is for, and the engine hands it to the pipe its tag names; the
//! reader puts the messages back in sequence (a small one, injected, may overtake a larger one
//! still on its way) and hands each buffer back to the inbox once read. So a pipe holds none of
//! the provider's receives, and an endpoint serves as many pipes as its memory allows, not
//! `rx_size / WINDOW`. Otherwise the reader keeps `WINDOW` receives of its own posted, tagged
//! with consecutive sequence numbers (TensorPipe's ibv inbox, over tagged messages), and
//! reposts each once read. Each
//! message is one write's bytes (a vectored write gathers its slices). One that fits the
//! provider's inject size goes out with `fi_tinject` straight from the writer's bytes
//! ([`Poster::inject`]: the provider copies them, and no op or end is made for it); a larger
//! one is copied into a pooled bounce buffer and posted. One copy in, one copy out, as the shm
//! rings cost. A message read frees a credit of the peer's writer. Freed credits ride the next message the same side's writer sends, in its
//! tag's credits field ([`tag::with_credits`]: the engine sends them as the message's remote CQ
//! data and hands them back with the receive's end, and the peer's reader gives them to its
//! writer); only when `WINDOW / 2` are owed and no message has taken them (a
//! stream that flows one way) does the reader send them in a small message of their own, a
//! control-stream message to the peer's writing half. A
//! zero-length message is the end of the stream (`shutdown`). Both halves post
//! through the endpoint's [`Poster`], straight into its engine from the half's own poll (no
//! mailbox hop); the actor reads the CQ and hands the ends to the halves' queues, and while it
//! spins a reader with nothing to read reads it too (`Poster::spin_pass`), keeping its own ends
//! out of its queue ([`Claim`]).
//!
//! The TCP connection that bootstrapped the stream stays open and carries nothing: its end (the
//! peer closed or died: the kernel closes it either way) fails both halves' pending operations,
//! after a short grace so that messages already on the fabric (a farewell frame) are read
//! first.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use atomic_waker::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;

use super::{Claim, FabricDetach, Poster};
use crate::backend::efa::engine::{Finished, Kind, Op};
use crate::backend::efa::tag::{self, Stream as TagStream};

/// The writer's credits: messages it may have unconsumed at the reader (and the receives a
/// reader keeps posted where the endpoint has no inbox).
pub const WINDOW: u32 = 16;
/// Largest message (before the provider's maximum).
pub const BOUNCE: usize = 64 << 10;
/// The shared receives of an endpoint's inbox, by default (`EndpointConfig::inbox`): 16 MiB of
/// `BOUNCE`-byte buffers, enough for sixteen streams sending their whole window at once.
pub const INBOX: usize = 256;

/// How long a reader waiting in spin mode keeps reading the CQ within one poll, on each poll of
/// a wait but the first ([`FabricRead`]'s `look`). What a task made ready meanwhile waits for, at
/// most, plus one pass.
pub const READER_BURST: Duration = Duration::from_micros(2);

/// A waiting reader bursts ([`READER_BURST`]) only while its stream is in a quick exchange:
/// this wait began less than this after the one before it (the default of
/// `EndpointConfig::quick_exchange`). Every other wait, a stream's first included, makes one
/// CQ pass a poll. A burst holds up every other task of the thread, and a reader in spin mode that
/// gives way wakes itself at once, so a burst comes on every turn of the executor while it
/// waits: a reader that waits long (a channel's lane, which carries nothing after its set-up;
/// a stream whose peer is busy elsewhere) cost each hand-over between the tasks that do the
/// work up to 2 µs. An in-place tensor makes several such hand-overs (the pipe, the channel
/// actor, the endpoint's ends): on 16 cores its 64 B to 16 KiB round trips on `shm` took
/// 1.7–1.8 times as long as with no bursts at all, and under the channel's rendezvous 2.6–2.9
/// times (on `tcp;ofi_rxm` 1.1–1.2 and 1.6 times; git history's docs/efa-measurements.md, "A reader's burst
/// only in a quick exchange").
pub const READER_HOT: Duration = Duration::from_micros(25);

/// What a waiting reader's look at the CQ found.
enum Look {
    /// An end (`None`: the queue closed).
    Got(Option<Finished>),
    /// Nothing yet: wake the task and give way, then look again.
    Later,
    /// Readers do not spin now: wait for the queue's wake-up.
    Sleep,
}

/// What both halves share: the credits they trade, and a guard dropped with the second half,
/// which ends the bootstrap connection's watcher (and closes it).
pub struct Shared {
    credits: Credits,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Shared {
    /// A guard whose drop sends nothing through `stop` (the receiver then sees it closed).
    pub fn new(stop: tokio::sync::oneshot::Sender<()>) -> Arc<Shared> {
        Arc::new(Shared {
            credits: Credits::default(),
            _stop: stop,
        })
    }
}

/// The credits one side's two halves hand each other. A message's tag carries what its
/// sender's reader freed, so a stream that flows both ways (a ping-pong, a request and its
/// answer) sends no credit message at all: each credit message cost its sender a post and a
/// send completion, and its receiver a completion, a repost and its writer's turn to take them
/// (measured in git history's docs/efa-measurements.md, "Credits on the reverse stream's tags").
///
/// A credit is owed once its message has been read (its buffer back to the inbox, or its
/// receive handed to the engine again). Where that receive waits in the engine's backlog
/// (`-FI_EAGAIN`), a message of the writer's, on another pipe, can take the credit out first,
/// and the peer's next message may then reach the provider before the receive: the provider
/// keeps it as an unexpected message until the receive is posted. The window still bounds what
/// the peer has unconsumed here, posted or not: `WINDOW`.
#[derive(Default)]
struct Credits {
    /// Freed by our reader (its buffer reposted), not yet returned to the peer's writer.
    owed: AtomicU32,
    /// Returned by the peer on the messages our reader took, not yet taken by our writer.
    granted: AtomicU32,
    /// Our writer, while it waits for credits.
    waiter: AtomicWaker,
}

// A tag carries what is owed, and the reader sends it on its own at `WINDOW / 2`.
const _: () = assert!(WINDOW / 2 <= tag::MAX_CREDITS);

impl Credits {
    /// Takes everything in `cell`: a load first, as it is usually zero.
    fn take(cell: &AtomicU32) -> u32 {
        if cell.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        cell.swap(0, Ordering::AcqRel)
    }
}

fn broken(f: &Finished) -> io::Error {
    let text = match &f.result {
        Err(e) => e.to_string(),
        Ok(_) => "unexpected end".into(),
    };
    io::Error::new(io::ErrorKind::ConnectionReset, text)
}

fn stopped() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the fabric endpoint actor stopped",
    )
}

/// The numbers that wire two halves to their peer's.
#[derive(Debug, Clone, Copy)]
pub struct Wiring {
    /// Our read pipe (receives data, sends credits).
    pub read: u32,
    /// Our write pipe (sends data, receives credits).
    pub write: u32,
    /// The peer's read pipe (our data goes there).
    pub peer_read: u32,
    /// The peer's write pipe (our credits go there).
    pub peer_write: u32,
}

/// The reading half.
pub struct FabricRead {
    ep: Poster,
    wiring: Wiring,
    done: mpsc::UnboundedReceiver<Finished>,
    /// Ends its own passes took for it ([`Claim`]): they come before any in `done`.
    claimed: VecDeque<Finished>,
    bounce: usize,
    current: Option<(Vec<u8>, usize, usize)>,
    /// A buffer read out, to repost at the next poll (see `poll_read`).
    emptied: Option<Vec<u8>>,
    next_seq: u32,
    credit_seq: u32,
    /// Messages come through the endpoint's inbox (see the module docs), in any order.
    inbox: bool,
    /// Inbox: the sequence number of the next message to read, and the messages that came
    /// before it (slot `i` holds `expect + i`; at most `2 * WINDOW` ahead).
    expect: u32,
    early: VecDeque<Option<Finished>>,
    spare: Vec<Vec<u8>>,
    eof: bool,
    error: Option<io::Error>,
    /// This wait (spin mode) has given way to the executor once (see `look`).
    gave_way: bool,
    /// When the last wait began (its first poll in spin mode), and whether this one bursts
    /// ([`READER_HOT`]).
    wait_began: Option<Instant>,
    burst: bool,
    shared: Arc<Shared>,
}

/// Posts receives `0..n` of `size` bytes, tagged for `stream` of `pipe` (sequence = op id).
fn post_receives(ep: &Poster, stream: TagStream, pipe: u32, n: u32, size: usize) {
    let ops = (0..n).map(|seq| Op {
        kind: Kind::Recv,
        tag: tag::make(stream, pipe, seq),
        mem: vec![0; size],
        id: seq as u64,
    });
    ep.post(pipe, ops);
}

impl FabricRead {
    /// The half, its messages through the endpoint's inbox, or with its `WINDOW` receives
    /// posted where it has none.
    pub fn new(
        ep: Poster,
        wiring: Wiring,
        done: mpsc::UnboundedReceiver<Finished>,
        bounce: usize,
        shared: Arc<Shared>,
    ) -> FabricRead {
        let inbox = ep.use_inbox(wiring.read);
        if !inbox {
            post_receives(&ep, TagStream::Control, wiring.read, WINDOW, bounce);
        }
        FabricRead {
            inbox,
            expect: 0,
            early: VecDeque::new(),
            ep,
            wiring,
            done,
            claimed: VecDeque::with_capacity(WINDOW as usize),
            bounce,
            current: None,
            emptied: None,
            next_seq: WINDOW,
            credit_seq: 0,
            spare: Vec::new(),
            eof: false,
            error: None,
            gave_way: false,
            wait_began: None,
            burst: false,
            shared,
        }
    }

    /// While the endpoint spins (spin mode), a reader whose queue of ends is empty reads the CQ
    /// itself (`Poster::spin_pass`), so that a message that lands is read on this task's own
    /// turn instead of on the spin task's turn that then wakes this one; the spin task skips its
    /// read on a turn after a reader's pass (`Progress::turn`):
    ///
    /// - the first poll of a wait does not read it: it gives way at once. Whatever answers the
    ///   message just read (a recipient actor, the write loop) is usually ready then, and a
    ///   pass (on `tcp;ofi_rxm`, reads of its sockets) would come before it;
    /// - each later poll reads it, again and again for up to [`READER_BURST`] until its own end
    ///   comes: a message that lands meanwhile is read a pass later, not a trip through the
    ///   executor later (the read loop's future polled from the top, the other tasks). Only in
    ///   a quick exchange ([`READER_HOT`]); otherwise once a poll.
    ///
    /// Measured in git history's docs/efa-measurements.md, "A reader that keeps looking" and "A recipient
    /// actor's turn without a pass before it".
    fn look(&mut self) -> Look {
        if !self.gave_way {
            if !self.ep.readers_spin() {
                return Look::Sleep;
            }
            let now = Instant::now();
            let quick = self.ep.quick_exchange();
            self.burst = self
                .wait_began
                .is_some_and(|t| now.duration_since(t) < quick);
            self.wait_began = Some(now);
            self.gave_way = true;
            return Look::Later;
        }
        let end = self.burst.then(|| Instant::now() + READER_BURST);
        loop {
            let claim = Claim {
                pipe: self.wiring.read,
                queue: &self.done,
                into: &mut self.claimed,
            };
            if !self.ep.spin_pass(claim) {
                self.gave_way = false;
                return Look::Sleep;
            }
            if let Some(f) = self.claimed.pop_front() {
                return Look::Got(Some(f));
            }
            match self.done.try_recv() {
                Ok(f) => return Look::Got(Some(f)),
                Err(mpsc::error::TryRecvError::Disconnected) => return Look::Got(None),
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            if end.is_none_or(|end| Instant::now() >= end) {
                return Look::Later;
            }
        }
    }

    /// Inbox: `f` (a message) if it is the next in sequence; otherwise keeps it for its turn
    /// and says `None` (a sequence number outside the window is the peer's protocol error).
    fn in_sequence(&mut self, f: Finished) -> Option<Finished> {
        let ahead = (f.id as u32).wrapping_sub(self.expect) as usize;
        if ahead == 0 {
            self.expect = self.expect.wrapping_add(1);
            self.early.pop_front();
            return Some(f);
        }
        if ahead >= 2 * WINDOW as usize {
            self.error = Some(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "efa stream: message {} arrived while {} was next, outside the window of {WINDOW}",
                    f.id, self.expect
                ),
            ));
            return None;
        }
        if self.early.len() <= ahead {
            self.early.resize_with(ahead + 1, || None);
        }
        self.early[ahead] = Some(f);
        None
    }

    /// Inbox: the next message in sequence, if it came early.
    fn take_early(&mut self) -> Option<Finished> {
        if !matches!(self.early.front(), Some(Some(_))) {
            return None;
        }
        self.expect = self.expect.wrapping_add(1);
        self.early.pop_front().flatten()
    }

    /// Gives a read buffer back (to the inbox, or as a receive posted again), which frees a
    /// credit; sends what is owed in a message of its own once `WINDOW / 2` are (the writer has
    /// sent nothing that took them).
    fn recycle(&mut self, mut mem: Vec<u8>) {
        let recv = if self.inbox {
            None
        } else {
            mem.resize(self.bounce, 0);
            let seq = self.next_seq;
            self.next_seq = self.next_seq.wrapping_add(1);
            Some(Op {
                kind: Kind::Recv,
                tag: tag::make(TagStream::Control, self.wiring.read, seq),
                mem: std::mem::take(&mut mem),
                id: seq as u64,
            })
        };
        let owed = &self.shared.credits.owed;
        let mut credit = None;
        let n = if owed.fetch_add(1, Ordering::AcqRel) + 1 >= WINDOW / 2 {
            owed.swap(0, Ordering::AcqRel)
        } else {
            0
        };
        if n > 0 {
            let mut m = self.spare.pop().unwrap_or_default();
            m.clear();
            m.extend_from_slice(&n.to_le_bytes());
            credit = Some(Op {
                kind: Kind::Send,
                tag: tag::make(TagStream::Control, self.wiring.peer_write, self.credit_seq),
                mem: m,
                id: self.credit_seq as u64,
            });
            self.credit_seq = self.credit_seq.wrapping_add(1);
        }
        if self.inbox {
            self.ep.recycle_inbox(mem, self.wiring.read, credit);
        } else {
            self.ep
                .post(self.wiring.read, recv.into_iter().chain(credit));
        }
    }
}

impl AsyncRead for FabricRead {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        // The buffer the last call emptied is reposted now, not then: between the two calls
        // the reader handles what it read (a small message's frame: the pipe's read loop
        // decodes it and may answer it, through a standing receive's handler), and a post
        // there (the provider's `fi_trecv`) would delay that answer. The window stays `WINDOW`
        // receives, one of them late (and its credit rides the answer after next).
        if let Some(mem) = this.emptied.take() {
            this.recycle(mem);
        }
        loop {
            if let Some((mem, pos, len)) = this.current.as_mut() {
                let n = (*len - *pos).min(buf.remaining());
                buf.put_slice(&mem[*pos..*pos + n]);
                *pos += n;
                if *pos == *len {
                    let (mem, _, _) = this.current.take().expect("checked");
                    this.emptied = Some(mem);
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = &this.error {
                return Poll::Ready(Err(io::Error::new(e.kind(), e.to_string())));
            }
            // A message that came early, now in sequence; then claimed ends (they came before
            // any in `done`). The waker stays registered either way, for an end another pass
            // hands out.
            let early = if this.inbox { this.take_early() } else { None };
            let in_turn = early.is_some();
            let f = match early.or_else(|| this.claimed.pop_front()) {
                Some(f) => Some(f),
                None => match this.done.poll_recv(cx) {
                    Poll::Ready(f) => f,
                    Poll::Pending => match this.look() {
                        Look::Got(f) => f,
                        Look::Later => {
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                        Look::Sleep => return Poll::Pending,
                    },
                },
            };
            this.gave_way = false;
            let Some(f) = f else {
                this.error = Some(stopped());
                continue;
            };
            // (A message taken early is in its turn already.)
            let f = match (this.inbox && !in_turn, f.kind, &f.result) {
                (true, Kind::Recv, Ok(_)) => match this.in_sequence(f) {
                    Some(f) => f,
                    None => continue,
                },
                _ => f,
            };
            if let (Kind::Recv, Ok(_)) = (f.kind, &f.result) {
                let n = tag::credits(f.tag);
                if n > 0 {
                    let c = &this.shared.credits;
                    c.granted.fetch_add(n, Ordering::AcqRel);
                    c.waiter.wake();
                }
            }
            match (f.kind, &f.result) {
                (Kind::Recv, Ok(0)) => this.eof = true,
                (Kind::Recv, Ok(n)) => this.current = Some((f.mem, 0, *n)),
                (Kind::Send, Ok(_)) => this.spare.push(f.mem),
                (_, Err(_)) => this.error = Some(broken(&f)),
            }
        }
    }
}

impl Drop for FabricRead {
    fn drop(&mut self) {
        self.ep.endpoint().do_send(FabricDetach {
            pipe: self.wiring.read,
            reason: "stream closed".into(),
        });
    }
}

/// The writing half.
pub struct FabricWrite {
    ep: Poster,
    wiring: Wiring,
    done: mpsc::UnboundedReceiver<Finished>,
    bounce: usize,
    credits: u32,
    seq: u32,
    credit_recv_seq: u32,
    pool: Vec<Vec<u8>>,
    /// Sends of 1 to this many bytes try [`Poster::inject`] first (the engine's inject limit).
    inject_limit: usize,
    /// Where the slices of a vectored write that goes out as an inject are gathered.
    gather: Vec<u8>,
    in_flight: u32,
    shut: bool,
    error: Option<io::Error>,
    /// Credit messages come through the endpoint's inbox (no receives of its own).
    inbox: bool,
    shared: Arc<Shared>,
}

/// Credit receives kept posted by a writer where the endpoint has no inbox.
const CREDIT_RECVS: u32 = 2;

impl FabricWrite {
    /// The half, its credit messages through the endpoint's inbox, or with its credit
    /// receives posted where it has none.
    pub fn new(
        ep: Poster,
        wiring: Wiring,
        done: mpsc::UnboundedReceiver<Finished>,
        bounce: usize,
        shared: Arc<Shared>,
    ) -> FabricWrite {
        let inbox = ep.use_inbox(wiring.write);
        if !inbox {
            post_receives(&ep, TagStream::Control, wiring.write, CREDIT_RECVS, 4);
        }
        let inject_limit = ep.inject_limit().min(bounce);
        FabricWrite {
            inbox,
            inject_limit,
            gather: Vec::new(),
            ep,
            wiring,
            done,
            bounce,
            credits: WINDOW,
            seq: 0,
            credit_recv_seq: CREDIT_RECVS,
            pool: Vec::new(),
            in_flight: 0,
            shut: false,
            error: None,
            shared,
        }
    }

    /// Takes every end that has arrived. With `cx`, registers its waker when none is left (the
    /// next end wakes the task); without, takes what is there and registers nothing.
    ///
    /// Only a writer about to return `Pending` (no credit, or a shutdown waiting for its sends)
    /// registers: the writer is polled from whoever writes, often the application's own handler
    /// through a `PipeWriter`, and a waker left registered by a write that went through made
    /// every send's completion wake that task for nothing (one more turn of the application
    /// actor per message).
    fn reap(&mut self, cx: Option<&mut TaskContext<'_>>) -> io::Result<()> {
        if let Some(e) = &self.error {
            return Err(io::Error::new(e.kind(), e.to_string()));
        }
        // Nothing there, the usual case of a send (a direct inject has no end, and credit
        // messages come only to a stream that flows one way): two loads, where `try_recv` on
        // the empty queue costs about ten times that. A closed queue still goes the way that
        // reports it.
        if cx.is_none() && self.done.is_empty() && !self.done.is_closed() {
            return Ok(());
        }
        let mut cx = cx;
        loop {
            let f = match cx.as_deref_mut() {
                Some(cx) => match self.done.poll_recv(cx) {
                    Poll::Ready(f) => f,
                    Poll::Pending => break,
                },
                None => match self.done.try_recv() {
                    Ok(f) => Some(f),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => None,
                },
            };
            let Some(f) = f else {
                self.error = Some(stopped());
                return Err(stopped());
            };
            if f.result.is_err() {
                let e = broken(&f);
                self.error = Some(io::Error::new(e.kind(), e.to_string()));
                return Err(e);
            }
            match f.kind {
                Kind::Send => {
                    self.in_flight -= 1;
                    self.pool.push(f.mem);
                }
                Kind::Recv => {
                    let (Ok(4), Some(n)) = (&f.result, f.mem.first_chunk::<4>()) else {
                        let e = io::Error::new(
                            io::ErrorKind::InvalidData,
                            "efa stream: a credit message that is not 4 bytes",
                        );
                        self.error = Some(io::Error::new(e.kind(), e.to_string()));
                        return Err(e);
                    };
                    self.credits += u32::from_le_bytes(*n);
                    if self.inbox {
                        self.ep.recycle_inbox(f.mem, self.wiring.write, None);
                        continue;
                    }
                    let seq = self.credit_recv_seq;
                    self.credit_recv_seq = seq.wrapping_add(1);
                    self.ep.post(
                        self.wiring.write,
                        [Op {
                            kind: Kind::Recv,
                            tag: tag::make(TagStream::Control, self.wiring.write, seq),
                            mem: f.mem,
                            id: seq as u64,
                        }],
                    );
                }
            }
        }
        Ok(())
    }

    /// Whether a credit is left, after taking those the peer returned (on its messages, which
    /// our reader took, or in credit messages). When none is, registers the task: a credit
    /// message's end or our reader's next credits wake it.
    fn credit(&mut self, cx: &mut TaskContext<'_>) -> io::Result<bool> {
        self.reap(None)?;
        let shared = &self.shared.credits;
        self.credits += Credits::take(&shared.granted);
        if self.credits == 0 {
            shared.waiter.register(cx.waker());
            self.reap(Some(cx))?;
            self.credits += Credits::take(&self.shared.credits.granted);
        }
        Ok(self.credits > 0)
    }

    /// Sends `bufs` (gathered, at most `bounce` bytes) as one message; needs a credit. The
    /// message carries the credits our reader owes the peer.
    fn send(
        &mut self,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if !self.credit(cx)? {
            return Poll::Pending;
        }
        let tag = tag::with_credits(
            tag::make(TagStream::Control, self.wiring.peer_read, self.seq),
            Credits::take(&self.shared.credits.owed),
        );
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total <= self.inject_limit {
            // Straight from the caller's bytes (gathered only if in pieces): no bounce buffer,
            // no op, no end to reap.
            let bytes: &[u8] = match bufs {
                [one] => one,
                _ => {
                    self.gather.clear();
                    for b in bufs {
                        self.gather.extend_from_slice(b);
                    }
                    &self.gather
                }
            };
            if self.ep.inject(self.wiring.write, tag, bytes) {
                self.seq = self.seq.wrapping_add(1);
                self.credits -= 1;
                return Poll::Ready(Ok(total));
            }
        }
        let mut m = self
            .pool
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.bounce));
        m.clear();
        for b in bufs {
            let room = self.bounce - m.len();
            if room == 0 {
                break;
            }
            m.extend_from_slice(&b[..b.len().min(room)]);
        }
        let n = m.len();
        let seq = self.seq;
        self.seq = seq.wrapping_add(1);
        self.credits -= 1;
        self.in_flight += 1;
        self.ep.post(
            self.wiring.write,
            [Op {
                kind: Kind::Send,
                tag,
                mem: m,
                id: seq as u64,
            }],
        );
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for FabricWrite {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.send(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        self.send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, _: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        // Every message has been handed to the endpoint, which delivers it reliably.
        self.reap(None)?;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        if !self.shut {
            if !self.credit(cx)? {
                return Poll::Pending;
            }
            // The end-of-stream marker: an empty message.
            let seq = self.seq;
            self.seq = seq.wrapping_add(1);
            self.credits -= 1;
            self.in_flight += 1;
            self.shut = true;
            self.ep.post(
                self.wiring.write,
                [Op {
                    kind: Kind::Send,
                    tag: tag::make(TagStream::Control, self.wiring.peer_read, seq),
                    mem: Vec::new(),
                    id: seq as u64,
                }],
            );
        }
        self.reap(Some(cx))?;
        if self.in_flight == 0 {
            Poll::Ready(Ok(()))
        } else {
            // reap registered the waker: the next end wakes us.
            Poll::Pending
        }
    }
}

impl Drop for FabricWrite {
    fn drop(&mut self) {
        self.ep.endpoint().do_send(FabricDetach {
            pipe: self.wiring.write,
            reason: "stream closed".into(),
        });
    }
}
