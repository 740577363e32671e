//! The remote-memory messages: registration on a [`Context`], one-sided reads and writes on a
//! [`Pipe`] to the region's owner, and the owner's notifications (docs/remote.md).

use std::time::{Duration, Instant};

use actix::{Handler, Message as ActixMessage, Recipient};

use super::messages::{Notify, NotifyShared, Op};
use super::{Context, Pipe};
use crate::error::Error;
use crate::message::Buffer;
use crate::remote::{Notification, Region, RegionDescriptor, Span};

/// Registers memory with the context: host memory as `Buffer::Cpu` (reads and writes) or
/// `Buffer::Shared` (reads only), or device memory as `Buffer::Cuda` (feature `cuda`; memory
/// from `cuMemAlloc`, as `CudaBuffer::alloc` makes, is exported over CUDA IPC here, once, so
/// that peers of this host map it). The runtime holds the buffer until the [`Region`] is
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

/// A pipe's path for remote-memory operations, in [`PipeInfo::remote`](crate::PipeInfo::remote).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteInfo {
    /// The path a host-memory operation takes now (as `RemoteDone::path`): `xth` (both ends in
    /// this process), `cma`, or the remote lane's transport (`tcp`, `shm`, …) when the bytes
    /// travel on the lane. Operations on device memory name theirs in `RemoteDone::path`:
    /// `cuda_xth`, `cuda_ipc`, or `cuda_basic` (the owner serves it through the lane).
    pub path: String,
    /// The remote lane's addresses (ours, the peer's); `None` for `xth`, which needs none.
    pub lane: Option<(String, String)>,
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
    /// `Buffer::Shared`) or device memory (`Buffer::Cuda`: copies into it or out of it follow
    /// the work queued on its stream when the operation is issued; a read's bytes are in place
    /// when it completes).
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
    /// The path chosen (`xth`, `cuda_xth`: both ends in this process; `cma`, `cuda_ipc`, or
    /// the lane's transport, `cuda_basic` for device memory, when the owner serves it); empty
    /// if there was none.
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

/// A pipe's remote operations: the next number of each kind, and the lane to the peer.
#[derive(Debug, Default)]
pub(crate) struct PipeRemote {
    pub(crate) next: [u64; 2],
    /// The metrics' `peer` label (empty until the first operation).
    pub(crate) peer: &'static str,
    /// Completions held back until those issued before them of their kind are out.
    pub(crate) order: std::sync::Arc<std::sync::Mutex<Order>>,
    /// The remote lane (both sides offered one), until the pipe fails or stops.
    pub(crate) lane: Option<crate::remote_core::lane::Lane>,
    /// The name of the lane's transport: the path of operations whose bytes travel on it.
    pub(crate) transport: &'static str,
    /// The lane's addresses (ours, the peer's), for `PipeInfo`.
    pub(crate) addresses: Option<(String, String)>,
}

/// Where a finished operation goes.
enum Reply {
    Await(tokio::sync::oneshot::Sender<RemoteDone>),
    To(Recipient<RemoteDone>),
    Shared(std::sync::Arc<Recipient<RemoteDone>>),
}

impl Reply {
    fn send(self, done: RemoteDone) {
        match self {
            Reply::Await(tx) => {
                let _ = tx.send(done);
            }
            Reply::To(to) => to.do_send(done),
            Reply::Shared(to) => to.do_send(done),
        }
    }
}

/// The operations finished out of turn, per kind: an operation through a mapping
/// (`cuda_ipc`) completes when its copies have run, one served by the owner when its answer
/// comes, so a later one may finish first; each kind's completions leave in issue order.
#[derive(Debug, Default)]
pub(crate) struct Order {
    next: [u64; 2],
    held: [std::collections::BTreeMap<u64, Held>; 2],
}

struct Held(Reply, RemoteDone);

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.1.fmt(f)
    }
}

impl Order {
    /// Sends `done` once every operation of its kind issued before it has been sent.
    fn release(order: &std::sync::Mutex<Order>, reply: Reply, done: RemoteDone) {
        let kind = done.op as usize;
        let mut ready = Vec::new();
        {
            let mut o = order.lock().unwrap_or_else(|e| e.into_inner());
            if done.id != o.next[kind] {
                o.held[kind].insert(done.id, Held(reply, done));
                return;
            }
            ready.push(Held(reply, done));
            o.next[kind] += 1;
            loop {
                let next = o.next[kind];
                match o.held[kind].remove(&next) {
                    Some(h) => {
                        ready.push(h);
                        o.next[kind] += 1;
                    }
                    None => break,
                }
            }
        }
        for Held(reply, done) in ready {
            reply.send(done);
        }
    }
}

/// How an operation will run.
enum Route {
    /// Both ends in this process: a copy made now.
    Here,
    /// Over the pipe's remote lane, the owner serving it.
    Lane(&'static str),
    /// Through this process's mapping of the owner's device memory (`cuda_ipc`), after its
    /// lease over the lane.
    #[cfg(feature = "cuda")]
    Mapped,
}

impl Pipe {
    /// Runs a remote operation: on the in-process path, a copy made here (so it completes
    /// before the next operation starts); otherwise handed to the remote lane, which completes
    /// it in issue order.
    fn remote<K: Direction>(&mut self, job: Remote<K>, reply: Reply) {
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
        let order = self.remote_ops.order.clone();
        if self.remote_ops.peer.is_empty() {
            self.remote_ops.peer = crate::metrics::peer_label(self.peer());
        }
        let peer = self.remote_ops.peer;
        let finish = move |result: Result<u64, Error>, buffer: Buffer, path: &'static str| {
            crate::metrics::remote_finished(
                op.label(),
                path,
                peer,
                started.elapsed(),
                result.as_ref().copied(),
            );
            let done = RemoteDone {
                id,
                op,
                bytes: *result.as_ref().unwrap_or(&0),
                result: result.map(|_| ()),
                buffer,
                path,
            };
            Order::release(&order, reply, done);
        };
        let checked = self.remote_route(&region, &buffer).and_then(|route| {
            if op == RemoteOp::Read && matches!(buffer, Buffer::Shared(_)) {
                return Err(Error::invalid(
                    "a remote read into Buffer::Shared: nothing can be written into it",
                ));
            }
            Ok(route)
        });
        let route = match checked {
            Ok(r) => r,
            Err(e) => return finish(Err(e), buffer, ""),
        };
        let path = match route {
            Route::Here => crate::remote_core::local::path(&region, &buffer),
            Route::Lane(path) => path,
            #[cfg(feature = "cuda")]
            Route::Mapped => "cuda_ipc",
        };
        // Bounds are checked here too, so that a bad batch fails before it travels.
        let local = buffer.len();
        if let Err(e) = crate::remote_core::check_spans(&spans, region.len(), local) {
            return finish(Err(e), buffer, path);
        }
        match route {
            Route::Here => {
                let write = op == RemoteOp::Write;
                let local = crate::remote_core::local::Local::of(&mut buffer);
                let result =
                    crate::remote_core::local::operate(&region, &spans, local, write, notify);
                // A copy cannot be interrupted: past its deadline it fails, its bytes copied.
                let result = result.and_then(|n| match deadline {
                    Some(d) if started.elapsed() > d => {
                        Err(crate::remote_core::lane::timeout(d, self.origin()))
                    }
                    _ => Ok(n),
                });
                finish(result, buffer, path);
            }
            _ => {
                let lane = self.remote_ops.lane.as_ref().expect("routed to the lane");
                // Device memory of ours that the owner serves through the lane travels through
                // host memory (an allocation per operation: this is the fallback).
                #[cfg(feature = "cuda")]
                let (buffer, device) = match buffer {
                    Buffer::Cuda(b) if path != "cuda_ipc" => {
                        let staged = if op == RemoteOp::Write {
                            b.to_vec()
                        } else {
                            Ok(vec![0; b.len()])
                        };
                        match staged {
                            Ok(v) => (Buffer::Cpu(v), Some(b)),
                            Err(e) => return finish(Err(e), Buffer::Cuda(b), path),
                        }
                    }
                    other => (other, None),
                };
                // A read lands only its spans' bytes in the device buffer.
                #[cfg(feature = "cuda")]
                let spans_back = if device.is_some() && op == RemoteOp::Read {
                    spans.clone()
                } else {
                    Vec::new()
                };
                let done = move |result: Result<u64, Error>, buffer: Buffer| {
                    #[cfg(feature = "cuda")]
                    if let Some(b) = device {
                        let landed = match (&result, op, buffer.as_cpu()) {
                            (Ok(_), RemoteOp::Read, Some(v)) => land(&b, v, &spans_back),
                            _ => Ok(()),
                        };
                        return finish(
                            result.and_then(|n| landed.map(|()| n)),
                            Buffer::Cuda(b),
                            path,
                        );
                    }
                    finish(result, buffer, path)
                };
                let job = crate::remote_core::lane::Job {
                    seq: id * 2 + kind as u64,
                    write: op == RemoteOp::Write,
                    region,
                    spans,
                    buffer,
                    notify,
                    deadline,
                    issued: started,
                    cma: path == "cma",
                    #[cfg(feature = "cuda")]
                    lease: None,
                    notice: false,
                    done: Box::new(done),
                };
                match route {
                    #[cfg(feature = "cuda")]
                    Route::Mapped => lane.submit_mapped(job),
                    _ => lane.submit(job),
                }
            }
        }
    }

    /// What `PipeInfo::remote` says now.
    pub(crate) fn remote_info(&self) -> Option<RemoteInfo> {
        let path = if self.has_channel("xth") {
            "xth"
        } else {
            match self.remote_route_for_host()? {
                Route::Lane(p) => p,
                _ => "xth",
            }
        };
        Some(RemoteInfo {
            path: path.into(),
            lane: self.remote_ops.addresses.clone(),
        })
    }

    /// The lane route a host-memory operation to another process takes now, if any.
    fn remote_route_for_host(&self) -> Option<Route> {
        match &self.remote_ops.lane {
            Some(lane) if self.has_channel("cma") && !lane.cma_refused() => {
                Some(Route::Lane("cma"))
            }
            Some(_) => Some(Route::Lane(self.remote_ops.transport)),
            None => None,
        }
    }

    /// The route to `region` from this pipe for an operation on `local`, or why there is none.
    fn remote_route(&self, region: &RegionDescriptor, local: &Buffer) -> Result<Route, Error> {
        if let Some(e) = self.failure() {
            return Err(e.clone());
        }
        if self.has_channel("xth") {
            // Both ends in this process: the region must be too.
            return if region.is_local() {
                Ok(Route::Here)
            } else {
                Err(crate::remote_core::gone(region.id()))
            };
        }
        let device = region.cuda_device().is_some() || local.device() != crate::Device::Cpu;
        match self.remote_route_for_host() {
            #[cfg(feature = "cuda")]
            Some(_)
                if self.has_channel("cuda_ipc")
                    && matches!(
                        region.memory(),
                        crate::remote_core::Memory::Cuda { ipc: true, .. }
                    ) =>
            {
                Ok(Route::Mapped)
            }
            // Device memory the peer serves: through host memory, on the lane.
            Some(_) if device => Ok(Route::Lane("cuda_basic")),
            Some(route) => Ok(route),
            None => Err(Error::Unavailable {
                backend: "remote".into(),
                reason: "the pipe has no remote-memory lane: one side was built with \
                         `ContextBuilder::remote_lane(false)` or predates remote memory"
                    .into(),
            }),
        }
    }
}

/// Copies each span's bytes of `staged` (host memory) to the same place of `b`.
#[cfg(feature = "cuda")]
fn land(b: &crate::cuda::CudaBuffer, staged: &[u8], spans: &[Span]) -> Result<(), Error> {
    for s in spans.iter().filter(|s| s.len > 0) {
        let at = s.local as usize;
        // SAFETY: the spans were checked against the local buffer's length, which `staged`
        // and `b` share; `b` holds its memory for the call, and the copy returns once done.
        unsafe {
            crate::remote_core::device::copy_sync(
                b.gpu(),
                b.device_ptr() + s.local,
                staged[at..].as_ptr() as u64,
                s.len as usize,
            )?
        };
    }
    Ok(())
}

impl<K: Direction> Handler<Remote<K>> for Pipe {
    type Result = actix::ResponseFuture<RemoteDone>;

    fn handle(&mut self, op: Remote<K>, _: &mut Self::Context) -> Self::Result {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let id = self.remote_ops.next[K::OP as usize];
        self.remote(op, Reply::Await(tx));
        Box::pin(async move { rx.await.unwrap_or_else(|_| <Remote<K> as Op>::lost(id)) })
    }
}

impl<K: Direction> Handler<Notify<Remote<K>>> for Pipe {
    type Result = ();

    fn handle(&mut self, n: Notify<Remote<K>>, _: &mut Self::Context) {
        self.remote(n.op, Reply::To(n.to));
    }
}

impl<K: Direction> Handler<NotifyShared<Remote<K>>> for Pipe {
    type Result = ();

    fn handle(&mut self, n: NotifyShared<Remote<K>>, _: &mut Self::Context) {
        self.remote(n.op, Reply::Shared(n.to));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(op: RemoteOp, id: u64) -> RemoteDone {
        RemoteDone {
            id,
            op,
            result: Ok(()),
            buffer: Buffer::Cpu(Vec::new()),
            path: "test",
            bytes: 0,
        }
    }

    /// Completions that finish out of turn (a `cuda_ipc` copy behind a lane operation, say)
    /// leave in issue order per kind, and one kind never waits for the other.
    #[test]
    fn order_releases_each_kind_in_issue_order() {
        let order = std::sync::Mutex::new(Order::default());
        let mut rx = Vec::new();
        let mut replies = Vec::new();
        for _ in 0..4 {
            let (tx, r) = tokio::sync::oneshot::channel();
            replies.push(Some(Reply::Await(tx)));
            rx.push(r);
        }
        let (wtx, mut wrx) = tokio::sync::oneshot::channel();
        // Reads 2, 1 and 3 finish before read 0; write 0 finishes meanwhile.
        for id in [2u64, 1, 3] {
            let reply = replies[id as usize].take().unwrap();
            Order::release(&order, reply, done(RemoteOp::Read, id));
        }
        Order::release(&order, Reply::Await(wtx), done(RemoteOp::Write, 0));
        assert_eq!(
            wrx.try_recv().map(|d| d.id).ok(),
            Some(0),
            "the write waited"
        );
        for r in &mut rx {
            assert!(r.try_recv().is_err(), "a read left before read 0");
        }
        Order::release(&order, replies[0].take().unwrap(), done(RemoteOp::Read, 0));
        for (i, r) in rx.iter_mut().enumerate() {
            assert_eq!(r.try_recv().map(|d| d.id).ok(), Some(i as u64));
        }
        assert!(order.lock().unwrap().held.iter().all(|h| h.is_empty()));
    }
}
