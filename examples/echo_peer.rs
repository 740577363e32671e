//! An echo server written as application actors: it accepts pipes and sends every message it
//! receives straight back, tensors included.
//!
//! ```text
//! cargo run --release --example echo_peer -- tcp://127.0.0.1:0
//! ```
//!
//! It prints `listening on <url>` once ready, then a line per pipe. The tests start it as a
//! separate process to talk to it over loopback.

use actix::prelude::*;
use actorpipe::prelude::*;
use actorpipe::Write;

/// Accepts pipes and starts an [`Echo`] for each.
struct Server;

impl Actor for Server {
    type Context = actix::Context<Self>;
}

impl Handler<Accepted> for Server {
    type Result = ();

    fn handle(&mut self, a: Accepted, _: &mut Self::Context) {
        println!("pipe from {}", a.peer);
        Echo {
            pipe: a.pipe,
            spare: None,
        }
        .start();
    }
}

/// Echoes one pipe: receive a message, write it back, repeat. `Receive` reads each message whole
/// into buffers the pipe fits to it; handing back the buffers of the last echo that completed
/// means nothing is allocated once the sizes settle. (`examples/app_actor.rs` shows the two-step
/// read, `ReadDescriptor` then `Read`, for when the descriptor decides where bytes go.)
struct Echo {
    pipe: Addr<Pipe>,
    spare: Option<Allocation>,
}

impl Echo {
    fn receive(&mut self, ctx: &mut actix::Context<Self>) {
        let op = match self.spare.take() {
            Some(spare) => Receive::reusing(spare),
            None => Receive::new(),
        };
        self.pipe.do_send(op.notify(ctx.address().recipient()));
    }
}

impl Actor for Echo {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.pipe.do_send(Subscribe(ctx.address().recipient()));
        self.receive(ctx);
    }
}

impl Handler<ReadDone> for Echo {
    type Result = ();

    fn handle(&mut self, r: ReadDone, ctx: &mut Self::Context) {
        // An error here means the pipe closed; `Closed` will say why.
        if r.result.is_err() {
            return;
        }
        self.pipe
            .do_send(Write::new(r.message).notify(ctx.address().recipient()));
        // Reads and writes are independent: ask for the next message right away.
        self.receive(ctx);
    }
}

impl Handler<WriteDone> for Echo {
    type Result = ();

    fn handle(&mut self, w: WriteDone, _: &mut Self::Context) {
        self.spare = Some(Allocation::from(w.message));
    }
}

impl Handler<Closed> for Echo {
    type Result = ();

    fn handle(&mut self, c: Closed, ctx: &mut Self::Context) {
        println!("pipe closed: {}", c.error);
        ctx.stop();
    }
}

fn main() -> std::io::Result<()> {
    // `RUST_LOG=actorpipe=info` shows what the listener refuses and why (on stderr).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tcp://127.0.0.1:0".into());
    let system = System::new();
    // The listener runs while its address is held: keep it until the system stops.
    let _listening = system.block_on(async move {
        let ctx = actorpipe::Context::builder().start();
        let server = Server.start();
        match ctx.listen([url], server.recipient()).await {
            Ok(l) => {
                // The tests read this line to find the port.
                println!("listening on {}", l.urls[0]);
                use std::io::Write as _;
                std::io::stdout().flush().ok();
                l
            }
            Err(e) => {
                eprintln!("cannot listen: {e}");
                std::process::exit(2);
            }
        }
    });
    system.run()
}
