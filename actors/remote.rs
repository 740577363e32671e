//! The remote-memory messages: registration on a [`Context`], one-sided reads and writes on a
//! [`Pipe`] to the region's owner, and the owner's notifications (docs/remote.md).

use std::time::{Duration, Instant};

use actix::{Handler, Message as ActixMessage, MessageResult, Recipient};

use super::messages::{Notify, NotifyShared, Op};
use super::{Context, Pipe};
use crate::error::Error;
use crate::message::Buffer;
use crate::remote::{Notification, Region, RegionDescriptor, Span};

/// Registers memory with the context: host memory as `Buffer::Cpu` (reads and writes) or
/// `Buffer::Shared` (reads only). The runtime holds the buffer until the [`Region`] is
/// deregistered ([`Region::deregister`] hands it back) or dropped.
#[derive(Debug)]
pub struct Register {
    /// The memory.
    pub buffer: Buffer,
}

impl Register {
    /// Registers `buffer`.
    pub fn new(buffer: impl Into<Buffer>) -> Register {
        Register {
            buffer: buffer.into(),
        }
    }
}

impl ActixMessage for Register {
    type Result = Result<Region, Error>;
}

/// Sends every [`Notification`] a peer leaves on the context's regions to `0`, from now on.
/// Several subscribers each get every notification.
#[derive(Debug)]
pub struct SubscribeNotifications(pub Recipient<Notification>);

impl ActixMessage for SubscribeNotifications {
    type Result = ();
}

impl Handler<Register> for Context {
    type Result = Result<Region, Error>;

    fn handle(&mut self, m: Register, _: &mut Self::Context) -> Self::Result {
        Region::register(m.buffer, self.remote_owner())
    }
}

impl ActixMessage for Notification {
    type Result = ();
}

impl Handler<SubscribeNotifications> for Context {
    type Result = ();

    fn handle(&mut self, m: SubscribeNotifications, _: &mut Self::Context) {
        let to = m.0;
        // `do_send` ignores the mailbox's capacity: no notification is lost to a full one.
        self.remote_owner().subscribe(Box::new(move |n| {
            to.do_send(n);
            to.connected()
        }));
    }
}

/// Which one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteOp {
    /// Region to local memory.
    Read,
    /// Local memory to region.
    Write,
}

impl RemoteOp {
    /// The metrics label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            RemoteOp::Read => "remote_read",
            RemoteOp::Write => "remote_write",
        }
    }
}

/// A one-sided operation on a pipe to a region's owner: [`RemoteRead`] copies each [`Span`]'s
/// `len` bytes at `remote` in the region to `local` in `buffer`, [`RemoteWrite`] the other
/// way. The buffer comes back in [`RemoteDone`], filled or not.
#[derive(Debug)]
pub struct Remote<K: Direction> {
    /// The region (its owner's descriptor).
    pub region: RegionDescriptor,
    /// What to copy.
    pub spans: Vec<Span>,
    /// The local memory: host memory (`Buffer::Cpu`; a write may also copy from
    /// `Buffer::Shared`).
    pub buffer: Buffer,
    /// Bytes delivered to the owner's subscribers once the operation is done (a write's bytes
    /// in place).
    pub notify: Option<Vec<u8>>,
    /// If set, the operation must complete within this time of being issued.
    pub deadline: Option<Duration>,
    direction: std::marker::PhantomData<K>,
}

/// Reads spans of a remote region into a local buffer (see [`Remote`]).
pub type RemoteRead = Remote<FromRegion>;
/// Writes spans of a local buffer into a remote region (see [`Remote`]).
pub type RemoteWrite = Remote<IntoRegion>;

/// Which way a [`Remote`] operation copies: [`FromRegion`] or [`IntoRegion`].
pub trait Direction: std::fmt::Debug + Send + 'static {
    /// The operation.
    const OP: RemoteOp;
}

/// [`RemoteRead`]'s direction.
#[derive(Debug)]
pub struct FromRegion;
/// [`RemoteWrite`]'s direction.
#[derive(Debug)]
pub struct IntoRegion;

impl Direction for FromRegion {
    const OP: RemoteOp = RemoteOp::Read;
}

impl Direction for IntoRegion {
    const OP: RemoteOp = RemoteOp::Write;
}

impl<K: Direction> Remote<K> {
    /// Copies `spans` between `region` and `buffer`.
    pub fn new(region: &RegionDescriptor, spans: Vec<Span>, buffer: impl Into<Buffer>) -> Self {
        Remote {
            region: region.clone(),
            spans,
            buffer: buffer.into(),
            notify: None,
            deadline: None,
            direction: std::marker::PhantomData,
        }
    }

    /// Leaves `data` for the owner, delivered after the operation.
    pub fn notify_owner(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.notify = Some(data.into());
        self
    }

    /// Sets a deadline.
    pub fn within(mut self, d: Duration) -> Self {
        self.deadline = Some(d);
        self
    }
}

/// A remote read or write finished.
#[derive(Debug)]
pub struct RemoteDone {
    /// Per-pipe number of the operation, from 0, counted per kind (reads and writes apart).
    pub id: u64,
    /// Which operation.
    pub op: RemoteOp,
    /// `Ok` once every span has been copied (for a read: the bytes are in `buffer`; for a
    /// write: they are in the region, visible to its owner).
    pub result: Result<(), Error>,
    /// The local buffer, back.
    pub buffer: Buffer,
    /// The path chosen (`xth`: both ends in this process); empty if there was none.
    pub path: &'static str,
    /// Bytes moved (the spans' total) when it succeeded.
    pub bytes: u64,
}

impl ActixMessage for RemoteDone {
    type Result = ();
}

impl<K: Direction> ActixMessage for Remote<K> {
    type Result = RemoteDone;
}

impl<K: Direction> Op for Remote<K> {
    type Done = RemoteDone;
    fn lost(id: u64) -> RemoteDone {
        RemoteDone {
            id,
            op: K::OP,
            result: Err(super::messages::vanished()),
            buffer: Buffer::Cpu(Vec::new()),
            path: "",
            bytes: 0,
        }
    }
}

/// A pipe's remote operations: the next number of each kind.
#[derive(Debug, Default)]
pub(crate) struct PipeRemote {
    next: [u64; 2],
}

impl Pipe {
    /// Runs a remote operation: on the in-process path (the only one built so far), a copy
    /// made here, so it completes before the next operation starts.
    fn remote<K: Direction>(&mut self, job: Remote<K>) -> RemoteDone {
        let op = K::OP;
        let kind = op as usize;
        let id = self.remote_ops.next[kind];
        self.remote_ops.next[kind] += 1;
        let started = Instant::now();
        let Remote {
            region,
            spans,
            mut buffer,
            notify,
            deadline,
            ..
        } = job;
        let chosen = self.remote_path(&region);
        let path = *chosen.as_ref().unwrap_or(&"");
        let result = chosen.and_then(|_| match (op, &mut buffer) {
            (RemoteOp::Read, Buffer::Cpu(v)) => {
                crate::remote_core::local::read(&region, &spans, v, notify)
            }
            (RemoteOp::Write, b @ (Buffer::Cpu(_) | Buffer::Shared(_))) => {
                let src = b.as_cpu().expect("host memory");
                crate::remote_core::local::write(&region, &spans, src, notify)
            }
            (RemoteOp::Read, Buffer::Shared(_)) => Err(Error::invalid(
                "a remote read into Buffer::Shared: nothing can be written into it",
            )),
            #[cfg(feature = "cuda")]
            (_, Buffer::Cuda(_)) => Err(Error::Unavailable {
                backend: "remote".into(),
                reason: "remote operations on CUDA memory are not built yet".into(),
            }),
        });
        let elapsed = started.elapsed();
        // A copy cannot be interrupted: past its deadline it fails, its bytes copied.
        let result = result.and_then(|n| match deadline {
            Some(d) if elapsed > d => Err(Error::Timeout {
                what: "a remote operation",
                after: d,
                origin: self.origin().clone(),
            }),
            _ => Ok(n),
        });
        crate::metrics::remote_finished(op.label(), path, elapsed, result.as_ref().copied());
        RemoteDone {
            id,
            op,
            bytes: *result.as_ref().unwrap_or(&0),
            result: result.map(|_| ()),
            buffer,
            path,
        }
    }

    /// The path to `region` from this pipe, or why there is none.
    fn remote_path(&self, region: &RegionDescriptor) -> Result<&'static str, Error> {
        if let Some(e) = self.failure() {
            return Err(e.clone());
        }
        let in_process = self.has_channel("xth");
        if region.is_local() && in_process {
            return Ok("xth");
        }
        Err(Error::Unavailable {
            backend: "remote".into(),
            reason: if region.is_local() {
                "the region lives in this process, but the pipe did not negotiate `xth` (both \
                 ends in one process), the only remote-memory path built so far"
                    .into()
            } else {
                "remote memory across processes is not built yet: only between contexts of \
                 one process (docs/remote.md)"
                    .into()
            },
        })
    }
}

impl<K: Direction> Handler<Remote<K>> for Pipe {
    type Result = MessageResult<Remote<K>>;

    fn handle(&mut self, op: Remote<K>, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.remote(op))
    }
}

impl<K: Direction> Handler<Notify<Remote<K>>> for Pipe {
    type Result = ();

    fn handle(&mut self, n: Notify<Remote<K>>, _: &mut Self::Context) {
        n.to.do_send(self.remote(n.op));
    }
}

impl<K: Direction> Handler<NotifyShared<Remote<K>>> for Pipe {
    type Result = ();

    fn handle(&mut self, n: NotifyShared<Remote<K>>, _: &mut Self::Context) {
        n.to.do_send(self.remote(n.op));
    }
}
