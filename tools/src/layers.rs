//! `actorpipe bench layers`: the floor under a 64 B round trip over the shm (or tcp, or efa)
//! transport, one layer at a time, so that a pipe's figure can be split into what the ring costs, what the
//! runtime's task and reactor cost, and what delivering each message to an actor costs.
//!
//! Both sides run in this process, each on a thread of its own with its own actix system (a
//! tokio current-thread runtime), over one connection per round of the transport that
//! `--transport` names (`shm` by default, spinning as `--spin` says; or `tcp`; or `efa` over
//! `--provider`, its endpoint spinning as `--spin` says), through the transport's own halves. The rows:
//!
//! - `halves`: one task per side, `write_all` then `read_exact` (the echo side the reverse). No
//!   actor, no channel, no allocation: the transport's halves under tokio.
//! - `halves + actor`: a reading task per side hands each message (by value, 64 bytes, no
//!   allocation of ours) to an actor with `do_send`; the actor writes the next message (or the
//!   echo) into the write half from its handler with one non-blocking write, as a
//!   `PipeWriter` does. One mailbox hop per message and side: what any design pays that
//!   tells an application actor about each message.
//!
//! `bench transport --backend shm|tcp [--spin US] [--pin]` measures the raw path (blocking threads,
//! no tokio) and the whole pipe; run both to see every layer. For efa, `bench efa --sizes 64
//! --spin US --api handler` has the raw tagged ping-pong and the pipe rows.

use std::io;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use actix::prelude::*;
use std::sync::Arc;

use actorpipe::transport::Shm;
use actorpipe::transport::Tcp;
use actorpipe::transport::Transport;
use actorpipe::transport::{BoxWrite, Stream};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;

use crate::cli::LayersArgs;
use crate::failure::Failure;
use crate::measure::Summary;

/// The message size: the small-message rows of `bench transport`.
const SIZE: usize = 64;

/// The layers, in the order they run.
const LAYERS: [&str; 2] = ["halves", "halves + actor"];

type Block = [u8; SIZE];

pub fn run(args: &LayersArgs) -> Result<(), Failure> {
    // Before pinning: the machine line counts the CPUs this process may run on.
    let here = crate::report::Provenance::here();
    let spin = Duration::from_micros(args.spin);
    let (transport, listen): (Arc<dyn Transport>, &str) = match args.transport.as_str() {
        "shm" => (Arc::new(Shm::new().with_spin(spin)), "shm://"),
        // As a pipe's own: keepalive on.
        "tcp" => (Arc::new(Tcp::default()), "tcp://127.0.0.1:0"),
        // Each side's thread opens its own endpoint actor (one per thread and transport).
        #[cfg(feature = "efa")]
        "efa" => {
            use actorpipe::internal::hardware::efa::{transport::Efa, EndpointConfig};
            let config = EndpointConfig {
                busy_poll: spin,
                ..EndpointConfig::default()
            };
            (
                Arc::new(Efa::new(&args.provider).with_config(config)),
                "efa://127.0.0.1:0",
            )
        }
        other => {
            return Err(crate::failure::bad(format!(
                "bench layers: --transport shm, tcp or efa (feature `efa`), not {other:?}"
            )))
        }
    };
    let name = match args.transport.as_str() {
        "efa" => format!("efa [{}]", args.provider),
        t => t.to_string(),
    };
    let (url_tx, url_rx) = std::sync::mpsc::channel::<Result<String, String>>();
    let pin = args.pin;
    let server_transport = transport.clone();
    let server = std::thread::Builder::new()
        .name("layers-echo".into())
        .spawn(move || {
            if pin {
                crate::run::pin_to(1).map_err(|e| e.to_string())?;
            }
            System::new().block_on(echo_side(server_transport, listen, url_tx))
        })
        .map_err(|e| Failure::Failed(format!("cannot start the echo thread: {e}")))?;
    let url = url_rx
        .recv()
        .map_err(|_| Failure::Failed("the echo thread ended before listening".into()))?
        .map_err(Failure::Failed)?;
    if pin {
        crate::run::pin_to(0)?;
    }
    let mut rows = Vec::new();
    let client = System::new().block_on(async {
        let chosen = |layer: &str| {
            let short = if layer == "halves" { "halves" } else { "actor" };
            args.layers.iter().any(|l| l == short)
        };
        for layer in LAYERS.into_iter().filter(|l| chosen(l)) {
            let mut p50s = Vec::new();
            let mut all = Vec::new();
            for _ in 0..args.rounds {
                let stream = transport
                    .connect(&url, Duration::from_secs(10))
                    .await
                    .map_err(|e| Failure::Failed(format!("connect {url}: {e}")))?;
                // A task, as a pipe's loops are: the future `block_on` runs is polled only
                // between batches of the runtime's tasks, and an endpoint actor's spin (efa)
                // is a task that is always ready.
                let (warmup, iters) = (args.warmup, args.iters);
                let samples = match layer {
                    "halves" => actix::spawn(halves_client(stream, warmup, iters)).await,
                    _ => actix::spawn(actor_client(stream, warmup, iters)).await,
                }
                .unwrap_or_else(|e| Err(io::Error::other(e.to_string())))
                .map_err(|e| Failure::Failed(format!("{layer}: {e}")))?;
                if let Some(s) = Summary::of(&samples) {
                    p50s.push(s.p50);
                }
                all.extend(samples);
            }
            p50s.sort_unstable();
            rows.push((layer, p50s, Summary::of(&all)));
        }
        Ok::<(), Failure>(())
    });
    drop(url);
    client?;
    let speed = straight_line_speed();
    if args.json {
        let rows: Vec<_> = rows
            .iter()
            .filter_map(|(layer, p50s, all)| {
                let all = (*all)?;
                Some(json!({
                    "layer": layer,
                    "round_trips": all.count,
                    "p50_us": micros(p50s[p50s.len() / 2]),
                    "p50_min_us": micros(*p50s.first()?),
                    "p50_max_us": micros(*p50s.last()?),
                    "p99_us": micros(all.p99),
                }))
            })
            .collect();
        let v = json!({
            "machine": here.machine,
            "date": here.date,
            "command": here.command,
            "ns_per_xorshift_step": speed,
            "transport": name,
            "spin_us": args.spin,
            "pinned": pin,
            "rows": rows,
        });
        println!("{v}");
    } else {
        println!(
            "actorpipe bench layers: {SIZE} B round trips over {name}, both sides in this process"
        );
        println!("  machine:  {}", here.machine);
        println!("  date:     {}", here.date);
        println!("  command:  {}", here.command);
        println!("  cpu:      {speed:.2} ns per dependent xorshift64 step (one thread, best of 3)");
        println!(
            "  {}{}; {} rounds of {} round trips each (after {} untimed), a new connection per round",
            match args.transport.as_str() {
                "shm" => format!("spin {} µs", args.spin),
                "efa" if args.spin > 0 => format!("endpoint spin {} µs", args.spin),
                "efa" => "no spin (the endpoint waits on its CQ)".to_string(),
                _ => "no spin (tcp)".to_string(),
            },
            if pin {
                ", client thread on CPU 0, echo thread on CPU 1"
            } else {
                ""
            },
            args.rounds,
            args.iters,
            args.warmup
        );
        println!();
        println!("| layer | round trips | p50 (median of rounds) | p50 range | p99 (all) |");
        println!("| --- | ---: | ---: | --- | ---: |");
        for (layer, p50s, all) in &rows {
            let (Some(lo), Some(hi), Some(all)) = (p50s.first(), p50s.last(), all) else {
                continue;
            };
            println!(
                "| {layer} | {} | {} | {}–{} | {} |",
                all.count,
                us(p50s[p50s.len() / 2]),
                us(*lo),
                us(*hi),
                us(all.p99)
            );
        }
        println!();
        let pinned = if pin { " --pin" } else { "" };
        match args.transport.as_str() {
            "efa" => println!(
                "The raw path and the whole pipe: `actorpipe bench efa --providers '{}' --sizes 64 --spin {} --api handler`.",
                args.provider, args.spin
            ),
            t => {
                let spin = match t {
                    "shm" => format!(" --spin {}", args.spin),
                    _ => String::new(),
                };
                println!(
                    "The raw path and the whole pipe: `actorpipe bench transport --backend {t}{spin} --sizes 64{pinned}`."
                );
            }
        }
    }
    // The echo thread waits for its next connection for ever: it is not joined (the process
    // exits).
    drop(server);
    Ok(())
}

/// How fast one core runs dependent integer steps (xorshift64, each step waiting for the
/// last): a rough measure of the core's speed to set beside the round trips, since per-message
/// work is straight-line code.
fn straight_line_speed() -> f64 {
    const STEPS: u64 = 20_000_000;
    let mut best = Duration::MAX;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..STEPS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        best = best.min(t.elapsed());
    }
    std::hint::black_box(x);
    best.as_secs_f64() * 1e9 / STEPS as f64
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn us(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

/// The echo side: accepts one connection per round and layer; the connection's first block
/// (`hello`) names the layer.
async fn echo_side(
    transport: Arc<dyn Transport>,
    listen: &str,
    url_tx: std::sync::mpsc::Sender<Result<String, String>>,
) -> Result<(), String> {
    let mut acceptor = match transport.listen(listen).await {
        Ok(a) => a,
        Err(e) => {
            let _ = url_tx.send(Err(format!("listen: {e}")));
            return Err(e.to_string());
        }
    };
    let _ = url_tx.send(Ok(acceptor.urls().remove(0)));
    loop {
        let mut s = acceptor.accept().await.map_err(|e| e.to_string())?;
        let mut hello: Block = [0; SIZE];
        if s.read.read_exact(&mut hello).await.is_err() {
            continue;
        }
        // A connection ends when the client drops it: the echo's read fails, and the next
        // round's connection is accepted.
        // On a task of its own, as the client's side (see there).
        let _ = match hello[0] {
            0 => actix::spawn(halves_echo(s)).await,
            _ => actix::spawn(actor_echo(s)).await,
        };
    }
}

/// Names the layer to the echo side.
async fn hello(s: &mut Stream, layer: u8) -> io::Result<()> {
    s.write.write_all(&[layer; SIZE]).await
}

/// `halves`, client side.
async fn halves_client(mut s: Stream, warmup: u32, iters: u32) -> io::Result<Vec<Duration>> {
    hello(&mut s, 0).await?;
    let mut out = Vec::with_capacity(iters as usize);
    let mut msg: Block = [7; SIZE];
    for i in 0..warmup + iters {
        let t = Instant::now();
        s.write.write_all(&msg).await?;
        s.read.read_exact(&mut msg).await?;
        if i >= warmup {
            out.push(t.elapsed());
        }
    }
    Ok(out)
}

/// `halves`, echo side.
async fn halves_echo(mut s: Stream) -> io::Result<()> {
    let mut msg: Block = [0; SIZE];
    loop {
        s.read.read_exact(&mut msg).await?;
        s.write.write_all(&msg).await?;
    }
}

/// One message, by value, from a reading task to its side's actor.
struct Got(Block);

impl actix::Message for Got {
    type Result = ();
}

/// Writes `msg` whole into `w` now, from the caller's handler, as a `PipeWriter` does: the
/// write half is polled with a no-op waker. A 64 B message always fits a ring that holds the
/// one message in flight; a half that is not ready is an error here, not a wait.
fn write_now(w: &mut BoxWrite, msg: &Block) -> io::Result<()> {
    let mut cx = TaskContext::from_waker(Waker::noop());
    let mut done = 0;
    while done < msg.len() {
        match Pin::new(&mut *w).poll_write(&mut cx, &msg[done..]) {
            Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => done += n,
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => {
                return Err(io::Error::other(
                    "the write half was not ready for a 64 B message",
                ))
            }
        }
    }
    match Pin::new(&mut *w).poll_flush(&mut cx) {
        Poll::Ready(r) => r,
        Poll::Pending => Ok(()),
    }
}

/// Reads blocks and hands each to `to`, until the stream ends or the actor is gone.
async fn pump<A>(mut read: actorpipe::transport::BoxRead, to: Addr<A>)
where
    A: Actor<Context = actix::Context<A>> + Handler<Got>,
{
    let mut msg: Block = [0; SIZE];
    while read.read_exact(&mut msg).await.is_ok() {
        if to.try_send(Got(msg)).is_err() {
            break;
        }
    }
}

/// `halves + actor`, echo side: echoes each message from its handler.
struct EchoActor {
    write: BoxWrite,
}

impl Actor for EchoActor {
    type Context = actix::Context<Self>;
}

impl Handler<Got> for EchoActor {
    type Result = ();

    fn handle(&mut self, m: Got, ctx: &mut Self::Context) {
        if write_now(&mut self.write, &m.0).is_err() {
            ctx.stop();
        }
    }
}

async fn actor_echo(s: Stream) -> io::Result<()> {
    let addr = EchoActor { write: s.write }.start();
    pump(s.read, addr).await;
    Ok(())
}

/// `halves + actor`, client side: times each round trip in its handler and writes the next.
struct ClientActor {
    write: BoxWrite,
    sent: Instant,
    left: u32,
    warmup: u32,
    samples: Vec<Duration>,
    done: Option<oneshot::Sender<io::Result<Vec<Duration>>>>,
}

impl ClientActor {
    fn send_next(&mut self, ctx: &mut actix::Context<Self>) {
        self.sent = Instant::now();
        if let Err(e) = write_now(&mut self.write, &[7; SIZE]) {
            self.finish(Err(e), ctx);
        }
    }

    fn finish(&mut self, r: io::Result<Vec<Duration>>, ctx: &mut actix::Context<Self>) {
        if let Some(done) = self.done.take() {
            let _ = done.send(r);
        }
        ctx.stop();
    }
}

impl Actor for ClientActor {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.send_next(ctx);
    }
}

impl Handler<Got> for ClientActor {
    type Result = ();

    fn handle(&mut self, _: Got, ctx: &mut Self::Context) {
        let rtt = self.sent.elapsed();
        if self.warmup > 0 {
            self.warmup -= 1;
        } else {
            self.samples.push(rtt);
            self.left -= 1;
        }
        if self.left == 0 {
            let samples = std::mem::take(&mut self.samples);
            self.finish(Ok(samples), ctx);
        } else {
            self.send_next(ctx);
        }
    }
}

async fn actor_client(mut s: Stream, warmup: u32, iters: u32) -> io::Result<Vec<Duration>> {
    hello(&mut s, 1).await?;
    let (tx, rx) = oneshot::channel();
    let addr = ClientActor {
        write: s.write,
        sent: Instant::now(),
        left: iters.max(1),
        warmup,
        samples: Vec::with_capacity(iters as usize),
        done: Some(tx),
    }
    .start();
    let reader = actix::spawn(pump(s.read, addr));
    let r = rx
        .await
        .unwrap_or_else(|_| Err(io::Error::other("the client actor stopped early")));
    // Dropping the reader drops the read half, and with the actor gone the write half: the
    // echo side sees the connection end.
    reader.abort();
    r
}
