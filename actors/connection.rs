//! The `Connection` actor: owns one transport connection.
//!
//! It alone reads and writes its stream, through the two I/O loops of
//! [`crate::transport::stream`], which it starts and stops. Operations do not pass through its
//! mailbox: the pipe and its channels submit them straight into the loops' queues (a handle
//! holding two senders) and completions go straight to the submitter's queue, so a message costs
//! no extra mailbox hop here. The actor's mailbox is for the connection's life: stop, with or
//! without a farewell frame.

use actix::{Actor, Context, Handler, Message};
use tokio::io::BufReader;
use tokio::sync::{mpsc, watch};

use crate::error::{Error, Origin};
use crate::transport::liveness::Heartbeat;
use std::sync::Arc;

use crate::transport::stream::{read_loop, write_loop, Farewell, InOp, OutOp, Parking};
use crate::transport::{BoxRead, BoxWrite};
use crate::wire::Limits;

/// Where to submit operations to a connection's loops.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    pub out: mpsc::UnboundedSender<OutOp>,
    pub inp: mpsc::UnboundedSender<InOp>,
    /// The write half while the write loop is idle (see [`Link::write_now`]).
    pub parking: Arc<Parking>,
}

impl Link {
    /// Submits a write; if the loop is gone, the op completes with `err` at once.
    pub fn write(&self, op: OutOp, err: impl FnOnce() -> Error) {
        if let Err(mpsc::error::SendError(op)) = self.out.send(op) {
            op.fail(err());
        }
    }

    /// Writes a message at once when the write loop is idle and the message is next in ticket
    /// order (see [`Parking::try_write`]): `Some(op)` is written, and the caller completes it
    /// itself. Otherwise it is submitted as [`Link::write`] does, and `None` comes back.
    pub fn write_now(&self, op: OutOp, err: impl FnOnce() -> Error) -> Option<OutOp> {
        match self.parking.try_write(op) {
            Ok(op) => Some(op),
            Err(op) => {
                self.write(op, err);
                None
            }
        }
    }

    /// Submits a read; if the loop is gone, the op completes with `err` at once.
    pub fn read(&self, op: InOp, err: impl FnOnce() -> Error) {
        if let Err(mpsc::error::SendError(op)) = self.inp.send(op) {
            op.fail(err());
        }
    }
}

/// Owns one transport connection and its I/O loops.
pub struct Connection {
    stop: watch::Sender<Option<Farewell>>,
    parking: Arc<Parking>,
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
    /// Starts the loops over a handshaken stream and returns the actor and the submit handle.
    pub(crate) fn start(
        read: BufReader<BoxRead>,
        write: BoxWrite,
        limits: Limits,
        origin: Origin,
        heartbeat: Option<Heartbeat>,
    ) -> (actix::Addr<Connection>, Link) {
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (in_tx, in_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(None);
        let parking = Arc::new(Parking::default());
        actix::spawn(write_loop(
            write,
            out_rx,
            stop_rx.clone(),
            origin.clone(),
            heartbeat,
            parking.clone(),
        ));
        actix::spawn(read_loop(read, in_rx, stop_rx, limits, origin, heartbeat));
        let addr = Connection {
            stop: stop_tx,
            parking: parking.clone(),
        }
        .start();
        (
            addr,
            Link {
                out: out_tx,
                inp: in_tx,
                parking,
            },
        )
    }
}

impl Actor for Connection {
    type Context = Context<Self>;

    fn stopped(&mut self, _: &mut Self::Context) {
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
        actix::ActorContext::stop(ctx);
    }
}
