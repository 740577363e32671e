//! The `Connection` actor: owns one transport connection.
//!
//! It alone reads and writes its stream, through the two I/O loops of
//! [`crate::transport::stream`], which it starts and stops. Operations do not pass through its
//! mailbox: the pipe and its channels submit them straight into the loops' queues (a handle
//! holding two senders) and completions go straight to the submitter's queue, so a message costs
//! no extra mailbox hop here. The actor's mailbox is for the connection's life: stop, with or
//! without a farewell frame.
//!
//! A channel's own connection ([`Connection::start_lane`]) starts its read loop with the first
//! read submitted: a connection nobody reads from (cma's side connections, until a tensor needs
//! them) costs no task, no queue and no loop state. Its read half waits in the [`Link`] until
//! then, and is dropped when the connection stops. The control connection, which the pipe reads
//! at once, starts both loops together ([`Connection::start`]).

use std::cell::RefCell;
use std::rc::Rc;

use actix::{Actor, Context, Handler, Message};
use tokio::io::BufReader;
use tokio::sync::{mpsc, watch};

use crate::actors::placement::{spawn_roaming, Wanted};
use crate::error::{Error, Origin};
use crate::transport::liveness::Heartbeat;
use std::future::Future;
use std::sync::Arc;

use super::pool::{IoPool, IoThread};

use crate::transport::stream::{read_loop, write_loop, Farewell, InOp, OutOp, Parking, Stop};
use crate::transport::{BoxRead, BoxWrite};
use crate::wire::Limits;

/// Where to submit operations to a connection's loops.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    pub out: mpsc::UnboundedSender<OutOp>,
    inp: Rc<RefCell<Reader>>,
    /// The write half while the write loop is idle (see [`Link::write_now`]).
    pub parking: Arc<Parking>,
}

/// Everything the read loop needs, kept until the first read.
struct ReadParts {
    read: BufReader<BoxRead>,
    stop: Stop,
    limits: Limits,
    origin: Origin,
    heartbeat: Option<Heartbeat>,
    /// The I/O thread the loops run on; `None`: the current arbiter.
    on: Option<OnThread>,
    /// Without `on`: which queue of the current thread.
    queue: Queue,
}

/// An I/O thread of the pool, and the pool itself: each loop holds the pool, so that its
/// threads stop only once the last loop on them has finished (a connection actor may stop
/// before its loops have failed their queued operations).
#[derive(Clone)]
struct OnThread(IoThread, Arc<IoPool>);

/// Which queue of the current arbiter's thread a loop runs on (see
/// [`crate::actors::placement`]).
#[derive(Debug, Clone)]
pub(crate) enum Queue {
    /// The arbiter's `LocalSet`, where its actors run.
    LocalSet,
    /// The thread's runtime's own queue (`ContextBuilder::loops_on_runtime`).
    Runtime,
    /// Wherever the shared [`Wanted`] says, moving when it changes.
    Roaming(Arc<Wanted>),
}

/// Which queues a connection's two loops run on.
#[derive(Debug, Clone)]
pub(crate) struct Queues {
    pub(crate) read: Queue,
    pub(crate) write: Queue,
}

impl Queues {
    /// Both loops on the arbiter's `LocalSet`.
    pub(crate) const LOCAL_SET: Queues = Queues {
        read: Queue::LocalSet,
        write: Queue::LocalSet,
    };
}

/// Runs a loop on `on` (an I/O thread of the pool), or on the current arbiter, on `queue`.
fn spawn_loop(
    on: Option<&OnThread>,
    queue: &Queue,
    task: impl Future<Output = ()> + Send + 'static,
) {
    match (on, queue) {
        (Some(OnThread(thread, pool)), _) => {
            let pool = pool.clone();
            // A stopped thread drops the loop: its queue closes, and every op submitted to
            // it fails at once (`Link::write`, `Link::read`).
            let _ = thread.arbiter.spawn(async move {
                task.await;
                drop(pool);
            });
        }
        // The arbiter's runtime is a current-thread runtime: the task stays on this thread.
        (None, Queue::Runtime) => drop(tokio::spawn(crate::transport::turns::on_runtime_queue(
            task,
        ))),
        (None, Queue::Roaming(wanted)) => spawn_roaming(wanted.clone(), task),
        (None, Queue::LocalSet) => drop(actix::spawn(task)),
    }
}

/// The read side of a connection: not started yet, running, or stopped before it started.
enum Reader {
    Idle(Box<ReadParts>),
    Running(mpsc::UnboundedSender<InOp>),
    Stopped,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reader::Idle(_) => "Idle",
            Reader::Running(_) => "Running",
            Reader::Stopped => "Stopped",
        })
    }
}

impl Reader {
    /// The read loop's queue, starting the loop (on the connection's I/O thread, or else on the
    /// actor system's current arbiter) if it has not started; `None` once stopped.
    fn queue(&mut self) -> Option<&mpsc::UnboundedSender<InOp>> {
        if matches!(self, Reader::Idle(_)) {
            let Reader::Idle(p) = std::mem::replace(self, Reader::Stopped) else {
                unreachable!("checked above")
            };
            let (tx, rx) = mpsc::unbounded_channel();
            spawn_loop(
                p.on.as_ref(),
                &p.queue,
                read_loop(p.read, rx, p.stop, p.limits, p.origin, p.heartbeat),
            );
            *self = Reader::Running(tx);
        }
        match self {
            Reader::Running(tx) => Some(tx),
            _ => None,
        }
    }
}

impl Link {
    /// Submits a write; if the loop is gone, the op completes with `err` at once.
    pub fn write(&self, op: OutOp, err: impl FnOnce() -> Error) {
        if let Err(mpsc::error::SendError(op)) = self.out.send(op) {
            op.fail(err());
        }
    }

    /// Writes a run of ops with consecutive tickets (a message and its small tensors) at once
    /// when the write loop is idle and the first is next in ticket order (see
    /// [`Parking::try_write_batch`]): those written stay at the front of `ops`, for the caller
    /// to complete itself, and their count is returned; the others are submitted as
    /// [`Link::write`] does, and removed.
    pub fn write_batch(&self, ops: &mut Vec<OutOp>, err: impl Fn() -> Error) -> usize {
        let n = self.parking.try_write_batch(ops);
        for op in ops.drain(n..) {
            self.write(op, &err);
        }
        n
    }

    /// Submits a read (the first one starts the read loop); if the loop is gone, or the
    /// connection stopped before anything was read, the op completes with `err` at once.
    pub fn read(&self, op: InOp, err: impl FnOnce() -> Error) {
        let refused = match self.inp.borrow_mut().queue() {
            Some(tx) => tx.send(op).err().map(|mpsc::error::SendError(op)| op),
            None => Some(op),
        };
        if let Some(op) = refused {
            op.fail(err());
        }
    }
}

/// Owns one transport connection and its I/O loops.
pub struct Connection {
    stop: watch::Sender<Option<Farewell>>,
    parking: Arc<Parking>,
    /// The read side, to drop the read half if the loop never started.
    reader: Rc<RefCell<Reader>>,
}

/// Stops the connection: the operation in progress is interrupted and every queued one fails;
/// `farewell`, if not empty, is written first when the stream is at a frame boundary.
#[derive(Debug, Default)]
pub(crate) struct Shutdown {
    pub farewell: Farewell,
}

impl Message for Shutdown {
    type Result = ();
}

impl Connection {
    /// Starts both loops over a handshaken stream and returns the actor and the submit handle.
    pub(crate) fn start(
        read: BufReader<BoxRead>,
        write: BoxWrite,
        limits: Limits,
        origin: Origin,
        heartbeat: Option<Heartbeat>,
        queues: Queues,
    ) -> (actix::Addr<Connection>, Link) {
        Self::start_with(read, write, limits, origin, heartbeat, false, None, queues)
    }

    /// Like [`Connection::start`], for a channel's own connection: the read loop starts with
    /// the first read, and with a `pool` that has threads both loops run on its next thread
    /// (the actor itself stays on the current arbiter).
    pub(crate) fn start_lane(
        read: BufReader<BoxRead>,
        write: BoxWrite,
        limits: Limits,
        origin: Origin,
        heartbeat: Option<Heartbeat>,
        pool: Option<&Arc<IoPool>>,
    ) -> (actix::Addr<Connection>, Link) {
        Self::start_with(
            read,
            write,
            limits,
            origin,
            heartbeat,
            true,
            pool,
            Queues::LOCAL_SET,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn start_with(
        read: BufReader<BoxRead>,
        write: BoxWrite,
        limits: Limits,
        origin: Origin,
        heartbeat: Option<Heartbeat>,
        lazy_read: bool,
        pool: Option<&Arc<IoPool>>,
        queues: Queues,
    ) -> (actix::Addr<Connection>, Link) {
        let on = pool.and_then(|p| Some(OnThread(p.next()?, p.clone())));
        // A lane's socket tells its own thread when it is ready, not the one it came from.
        let (read, write) = match &on {
            Some(OnThread(thread, _)) => crate::backend::tcp::rehome(read, write, &thread.runtime),
            None => (read, write),
        };
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(None);
        let parking = Arc::new(Parking::default());
        spawn_loop(
            on.as_ref(),
            &queues.write,
            write_loop(
                write,
                out_rx,
                stop_rx.clone(),
                origin.clone(),
                heartbeat,
                parking.clone(),
            ),
        );
        let reader = Rc::new(RefCell::new(Reader::Idle(Box::new(ReadParts {
            read,
            stop: stop_rx,
            limits,
            origin,
            heartbeat,
            on: on.clone(),
            queue: queues.read,
        }))));
        if !lazy_read {
            reader.borrow_mut().queue();
        }
        let addr = Connection {
            stop: stop_tx,
            parking: parking.clone(),
            reader: reader.clone(),
        }
        .start();
        (
            addr,
            Link {
                out: out_tx,
                inp: reader,
                parking,
            },
        )
    }
}

impl Connection {
    /// A read half whose loop never started is dropped with the connection, as the loop would
    /// have dropped it; later reads fail at once.
    fn drop_idle_reader(&mut self) {
        let mut r = self.reader.borrow_mut();
        if matches!(*r, Reader::Idle(_)) {
            *r = Reader::Stopped;
        }
    }
}

impl Actor for Connection {
    type Context = Context<Self>;

    fn stopped(&mut self, _: &mut Self::Context) {
        self.drop_idle_reader();
        // Dropped without a Shutdown (the pipe vanished): stop the loops anyway.
        self.parking.halt();
        self.stop.send_if_modified(|s| {
            let was_running = s.is_none();
            if was_running {
                *s = Some(Farewell::default());
            }
            was_running
        });
    }
}

impl Handler<Shutdown> for Connection {
    type Result = ();

    fn handle(&mut self, msg: Shutdown, ctx: &mut Self::Context) {
        self.parking.halt();
        let _ = self.stop.send(Some(msg.farewell));
        self.drop_idle_reader();
        actix::ActorContext::stop(ctx);
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::transport::stream::{Carried, Done};
    use crate::wire::{self, Ack, Frame, FrameKind};
    use actix::Addr;

    /// A connection over one end of an in-memory pipe; the other end is returned.
    fn over_duplex() -> (Addr<Connection>, Link, tokio::io::DuplexStream) {
        over_duplex_on(&Arc::new(IoPool::new(0)))
    }

    /// [`over_duplex`] with the loops on `pool`.
    fn over_duplex_on(pool: &Arc<IoPool>) -> (Addr<Connection>, Link, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(4096);
        let (r, w) = tokio::io::split(ours);
        let (conn, link) = Connection::start_lane(
            BufReader::with_capacity(512, Box::new(r)),
            Box::new(w),
            Limits::default(),
            Origin::default(),
            None,
            Some(pool),
        );
        (conn, link, theirs)
    }

    fn gone() -> Error {
        Error::Closed {
            reason: "gone".into(),
            origin: Origin::default(),
        }
    }

    /// Submits the connection's first read (a frame) and returns where it completes.
    fn read_first_frame(link: &Link) -> mpsc::UnboundedReceiver<Done> {
        let (reply, done) = mpsc::unbounded_channel();
        link.read(
            InOp::Frame {
                ticket: 0,
                reply,
                more: 0,
                carried: Carried::Nothing,
                catch: None,
            },
            gone,
        );
        done
    }

    fn is_idle(link: &Link) -> bool {
        matches!(*link.inp.borrow(), Reader::Idle(_))
    }

    #[test]
    fn the_read_loop_starts_with_the_first_read() {
        actix::System::new().block_on(async {
            let (_conn, link, mut peer) = over_duplex();
            let ack = Ack {
                seq: 7,
                tensor: 1,
                ok: true,
            };
            let mut frame = Vec::new();
            wire::encode_frame(&mut frame, FrameKind::Ack, |b| wire::encode_ack(b, &ack));
            // Written before anyone reads: it waits in the stream.
            peer.write_all(&frame).await.unwrap();
            tokio::task::yield_now().await;
            assert!(is_idle(&link), "no read yet, no read loop");
            let mut done = read_first_frame(&link);
            assert!(matches!(*link.inp.borrow(), Reader::Running(_)));
            match done.recv().await.unwrap() {
                Done::Frame {
                    ticket: 0,
                    result: Ok(Frame::Ack(a)),
                    ..
                } => assert_eq!((a.seq, a.tensor, a.ok), (7, 1, true)),
                other => panic!("expected the ack frame, got {other:?}"),
            }
        });
    }

    #[test]
    fn a_connection_stopped_before_any_read_fails_reads_and_drops_its_read_half() {
        actix::System::new().block_on(async {
            let (conn, link, mut peer) = over_duplex();
            conn.send(Shutdown::default()).await.unwrap();
            assert!(matches!(*link.inp.borrow(), Reader::Stopped));
            let mut done = read_first_frame(&link);
            match done.recv().await.unwrap() {
                Done::Frame {
                    result: Err(Error::Closed { reason, .. }),
                    ..
                } => assert_eq!(reason, "gone"),
                other => panic!("expected a failed read, got {other:?}"),
            }
            // Both halves are gone (the write loop shut its half down): end of stream.
            let mut rest = Vec::new();
            tokio::time::timeout(
                std::time::Duration::from_secs(5),
                tokio::io::AsyncReadExt::read_to_end(&mut peer, &mut rest),
            )
            .await
            .expect("the peer sees the connection close")
            .unwrap();
        });
    }
}
