//! `--api handler`: both sides read with a standing receive whose handler runs in place
//! (`ReceiveAll::calling`) and write through a `PipeWriter` from inside it. The echo writes each
//! message back from its handler; the pinger records each round trip and writes the next message
//! from its handler, so a small message's round trip runs on the connections' read loops alone,
//! with no actor mailbox on the way (docs/architecture.md, "Read path").

use std::sync::{Arc, Mutex, MutexGuard};

use actix::prelude::*;
use actorpipe::{
    inbox, Allocation, Message, Pipe, PipeWriter, ReadDone, ReceiveAll, Recycle, StopReceiving,
    Write, WriteDone,
};
use tokio::sync::oneshot;

use crate::bench::Buffers;
use crate::failure::Failure;
use crate::fired::RECYCLE_ABOVE;
use crate::measure::{Counts, Samples};
use crate::report::Progress;
use crate::tally::{watch, Next, Tally};

/// A recipient for the `WriteDone`s a `PipeWriter` could not return at once (a large message,
/// which the pipe writes): each goes to `then`, from a task of its own.
fn relay(then: impl FnMut(WriteDone) + 'static) -> Arc<actix::Recipient<WriteDone>> {
    let (to, mut done) = inbox::<WriteDone>();
    let mut then = then;
    actix::spawn(async move {
        while let Some(w) = done.recv().await {
            then(w);
        }
    });
    Arc::new(to)
}

/// Hands a large message's buffers back to the stand (as `fired::Echo` does).
fn recycle(pipe: &Addr<Pipe>, w: WriteDone) {
    if w.result.is_ok() && w.message.total_bytes() > RECYCLE_ABOVE {
        pipe.do_send(Recycle(Allocation::from(w.message)));
    }
}

/// Echoes every message of `pipe` from the standing receive's handler.
pub async fn echo(pipe: Addr<Pipe>, writer: PipeWriter) {
    let p = pipe.clone();
    let wrote = relay(move |w| recycle(&p, w));
    let p = pipe.clone();
    let handler = move |r: ReadDone| {
        // An error means the pipe failed or closed: nothing more comes.
        if r.result.is_err() {
            return;
        }
        if let Some(w) = writer.write(Write::new(r.message), &wrote) {
            recycle(&p, w);
        }
    };
    if let Ok(Err(e)) = pipe.send(ReceiveAll::calling(handler)).await {
        eprintln!("echo server: no standing receive: {e}");
    }
}

/// The pinger's state, shared by its handler and the relay of late `WriteDone`s.
struct Ping {
    pipe: Addr<Pipe>,
    writer: PipeWriter,
    /// Dropped once the run ends, which ends the relay (it would keep the state alive).
    wrote: Option<Arc<actix::Recipient<WriteDone>>>,
    tally: Tally,
    message: Option<Message>,
    sent: Option<Message>,
    back: Option<Message>,
    finish: Option<oneshot::Sender<Result<(Samples, Buffers), Failure>>>,
}

fn lock(ping: &Mutex<Ping>) -> MutexGuard<'_, Ping> {
    ping.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ping {
    fn fire(&mut self) {
        let (Some(message), Some(wrote)) = (self.message.take(), self.wrote.clone()) else {
            return;
        };
        self.tally.start();
        if let Some(w) = self.writer.write(Write::new(message), &wrote) {
            self.wrote(w);
        }
    }

    fn wrote(&mut self, w: WriteDone) {
        match w.result {
            Ok(()) => {
                self.sent = Some(w.message);
                self.maybe_next();
            }
            Err(e) => self.end(Err(e.into())),
        }
    }

    fn read(&mut self, r: ReadDone) {
        match r.result {
            Ok(()) => {
                self.back = Some(r.message);
                self.maybe_next();
            }
            Err(e) => self.end(Err(e.into())),
        }
    }

    /// Once both the write and the read of a round trip are back: record, go on or finish.
    fn maybe_next(&mut self) {
        let Some(next) = self.tally.ended(&mut self.sent, &mut self.back) else {
            return;
        };
        let (sent, back) = match next {
            Next::Again { sent, back } => (sent, back),
            Next::Done(result) => return self.end(result),
        };
        self.message = Some(sent);
        if back.total_bytes() > RECYCLE_ABOVE {
            self.pipe.do_send(Recycle(Allocation::from(back)));
        }
        self.fire();
    }

    /// Ends the run: the stand stops (the next size's pinger stands anew on the same pipe).
    fn end(&mut self, result: Result<(Samples, Buffers), Failure>) {
        self.wrote = None;
        if let Some(f) = self.finish.take() {
            self.pipe.do_send(StopReceiving);
            let _ = f.send(result);
        }
    }
}

/// Measures round trips of one size with handlers on both sides (see the module docs).
pub async fn measure(
    pipe: Addr<Pipe>,
    writer: PipeWriter,
    buffers: Buffers,
    counts: Counts,
    progress: &Progress,
) -> Result<(Samples, Buffers), Failure> {
    let size = buffers.size;
    if counts.total() == 0 {
        return Ok((Samples::new(), buffers));
    }
    let (tx, rx) = oneshot::channel();
    let (tally, trips) = Tally::new(size, counts, progress);
    let ping = Arc::new(Mutex::new(Ping {
        pipe: pipe.clone(),
        writer,
        wrote: None,
        tally,
        message: Some(buffers.message),
        sent: None,
        back: None,
        finish: Some(tx),
    }));
    let p = ping.clone();
    lock(&ping).wrote = Some(relay(move |w| lock(&p).wrote(w)));
    let p = ping.clone();
    let stood = match pipe
        .send(ReceiveAll::calling(move |r| lock(&p).read(r)))
        .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.into()),
        Err(e) => Err(Failure::Failed(e.to_string())),
    };
    if stood.is_ok() {
        lock(&ping).fire();
    }
    let result = match stood {
        Ok(()) => watch(rx, &trips, size).await,
        Err(e) => Err(e),
    };
    // Whatever happened, the relay's recipient goes (it holds the state through its task).
    lock(&ping).wrote = None;
    result
}
