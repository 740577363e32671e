//! Soak: many pipes moving messages of random sizes for a while, over the default backends and
//! over TCP with the basic channel, every message checked by checksum and order. Pipes are
//! opened and closed in rounds; at the end, with every pipe closed and given time to wind down,
//! the process holds no more file descriptors and not much more memory than after a warm-up.
//!
//! The bounded version runs in CI (about 15 s); the long one runs by hand: `ACTORPIPE_SOAK_SECS=3600
//! cargo test --release --test serial soak::long_soak -- --ignored --nocapture`.

use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::*;

use crate::common::*;

/// Pipes per backend configuration in each round.
const PIPES: usize = 8;
/// Writes in flight per pipe.
const WINDOW: usize = 4;
/// RSS may grow this much from the warm-up to the end (allocator caches, actix and tokio
/// internals sized by the peak number of pipes). Measured here: see `bounded_soak`.
const RSS_SLACK: u64 = 64 << 20;
/// Open fds may differ this much from after the warm-up.
const FD_SLACK: usize = 2;

/// A named way to build a context.
type Config = (&'static str, fn() -> ContextBuilder);

/// The backend configurations every round runs side by side.
fn configs() -> [Config; 2] {
    [("default", Context::builder), ("tcp/basic", tcp_basic)]
}

/// Sizes drawn for payloads and tensors; 4 MiB rarely, to bound the run time.
fn soak_size(rng: &mut Rng) -> usize {
    const SIZES: [usize; 7] = [0, 1, 31, 4 << 10, 60_000, 256 << 10, 1 << 20];
    if rng.below(50) == 0 {
        4 << 20
    } else {
        SIZES[rng.below(SIZES.len() as u64) as usize] + rng.below(64) as usize
    }
}

/// What a round moved.
#[derive(Debug, Default, Clone, Copy)]
struct Moved {
    messages: u64,
    bytes: u64,
}

/// A round's outcome: what it moved, the fds open while its pipes were, and per configuration
/// the backends its pipes ran on.
struct Round {
    moved: Moved,
    fds_open: usize,
    backends: Vec<String>,
}

impl std::ops::AddAssign for Moved {
    fn add_assign(&mut self, o: Moved) {
        self.messages += o.messages;
        self.bytes += o.bytes;
    }
}

/// Sends random messages from `tx` to `rx` until `until`, then an end marker; checks that each
/// arrives intact and in order.
async fn exchange(tx: Addr<Pipe>, rx: Addr<Pipe>, seed: u64, until: Instant) -> Moved {
    let (done_to, mut done) = inbox::<WriteDone>();
    let base = seed * 1_000_000;
    let writer = async {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut moved = Moved::default();
        let mut in_flight = 0;
        loop {
            let more = Instant::now() < until;
            if more && in_flight < WINDOW {
                let payloads: Vec<usize> = (0..rng.below(3)).map(|_| soak_size(&mut rng)).collect();
                let tensors: Vec<usize> = (0..rng.below(3)).map(|_| soak_size(&mut rng)).collect();
                let m = checked_message(base + moved.messages, &payloads, &tensors);
                moved.bytes += m.total_bytes();
                moved.messages += 1;
                tx.do_send(Write::new(m).notify(done_to.clone()));
                in_flight += 1;
                continue;
            }
            if in_flight == 0 {
                break;
            }
            let d = done.recv().await.expect("write completion");
            if let Err(e) = d.result {
                panic!("write {} on pipe {seed} failed: {e}", d.id);
            }
            in_flight -= 1;
        }
        let end = tx.send(Write::new(Message::new().with_metadata(b"end".to_vec())));
        end.await.unwrap().result.expect("end marker written");
        moved
    };
    let reader = async {
        let mut n = 0;
        loop {
            let m = read_one(&rx)
                .await
                .unwrap_or_else(|e| panic!("read {n} on pipe {seed}: {e}"));
            if m.metadata == b"end" {
                return n;
            }
            assert_eq!(verify(&m), base + n, "message order on pipe {seed}");
            n += 1;
        }
    };
    let (moved, read) = tokio::join!(writer, reader);
    assert_eq!(read, moved.messages, "pipe {seed} read every message");
    moved
}

/// One round: for each configuration a fresh listening and a fresh dialling context, `PIPES`
/// pipes between them, all exchanging until `until` (half in each direction), then every pipe
/// closed and every address dropped.
async fn round(number: u64, until: Instant) -> Round {
    let mut servers = Vec::new();
    let mut pairs = Vec::new();
    let mut backends = Vec::new();
    for (c, (name, builder)) in configs().iter().enumerate() {
        let mut server = Server::start(builder(), "tcp://127.0.0.1:0").await;
        let client = builder().start();
        for p in 0..PIPES {
            let tx = within(10, "connecting", client.send(Connect::new(&server.url)))
                .await
                .unwrap()
                .expect("connect");
            let rx = server.next().await;
            let seed = number * 1000 + (c * PIPES + p) as u64;
            pairs.push((tx, rx, seed));
        }
        let info = pairs.last().unwrap().0.send(GetInfo).await.unwrap();
        backends.push(format!(
            "{name}: {} + {}",
            info.transport,
            info.channel_list()
        ));
        servers.push(server);
    }
    let fds_open = open_fds();
    let tasks: Vec<_> = pairs
        .iter()
        .map(|(tx, rx, seed)| {
            let (from, to) = if seed % 2 == 0 {
                (tx.clone(), rx.clone())
            } else {
                (rx.clone(), tx.clone())
            };
            actix::spawn(exchange(from, to, *seed, until))
        })
        .collect();
    let mut moved = Moved::default();
    let limit = until.saturating_duration_since(Instant::now()).as_secs() + 60;
    within(limit, "a soak round", async {
        for t in tasks {
            moved += t.await.expect("pipe task");
        }
    })
    .await;
    for (tx, rx, _) in &pairs {
        within(10, "closing", tx.send(Close::because("soak round over")))
            .await
            .unwrap();
        within(10, "closing", rx.send(Close::because("soak round over")))
            .await
            .unwrap();
    }
    Round {
        moved,
        fds_open,
        backends,
    }
}

/// Resource use at one moment.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    rss: u64,
    fds: usize,
}

/// Waits for closed pipes and dropped listeners to wind down (listeners stop about 2 s after
/// their last address is dropped), then measures.
async fn wound_down() -> Footprint {
    let fds = settled_fds(Duration::from_millis(2500), Duration::from_secs(8)).await;
    Footprint {
        rss: rss_bytes(),
        fds,
    }
}

/// Runs rounds of `round_len` until `total` has passed, after a warm-up round, and checks the
/// footprint at the end against the one after the warm-up.
async fn soak(total: Duration, round_len: Duration) {
    let before = Footprint {
        rss: rss_bytes(),
        fds: open_fds(),
    };
    let warm = round(0, Instant::now() + Duration::from_millis(1500)).await;
    let base = wound_down().await;
    println!("backends: {}", warm.backends.join("; "));
    println!(
        "before: {} fds, {} MiB; warm-up moved {} messages, {} MiB with {} fds open; after it: \
         {} fds, {} MiB",
        before.fds,
        before.rss >> 20,
        warm.moved.messages,
        warm.moved.bytes >> 20,
        warm.fds_open,
        base.fds,
        base.rss >> 20
    );
    let start = Instant::now();
    let mut total_moved = Moved::default();
    let mut number = 1;
    while start.elapsed() < total {
        let len = round_len.min(total - start.elapsed());
        let t = Instant::now();
        let r = round(number, Instant::now() + len).await;
        total_moved += r.moved;
        println!(
            "round {number}: {} messages, {} MiB in {:.1} s with {} fds open; now {} fds, {} MiB",
            r.moved.messages,
            r.moved.bytes >> 20,
            t.elapsed().as_secs_f64(),
            r.fds_open,
            open_fds(),
            rss_bytes() >> 20
        );
        number += 1;
    }
    let end = wound_down().await;
    println!(
        "soak: {} rounds, {} messages, {} MiB over {} pipes a round; end: {} fds, {} MiB \
         (after warm-up: {} fds, {} MiB)",
        number - 1,
        total_moved.messages,
        total_moved.bytes >> 20,
        PIPES * configs().len(),
        end.fds,
        end.rss >> 20,
        base.fds,
        base.rss >> 20
    );
    assert!(total_moved.messages > 0, "the soak moved messages");
    assert!(
        end.fds.abs_diff(base.fds) <= FD_SLACK,
        "open fds went from {} after the warm-up to {} at the end (slack {FD_SLACK})",
        base.fds,
        end.fds
    );
    let growth = end.rss.saturating_sub(base.rss);
    assert!(
        growth < RSS_SLACK,
        "RSS grew by {} MiB from the warm-up to the end (slack {} MiB)",
        growth >> 20,
        RSS_SLACK >> 20
    );
}

/// About 15 s: a warm-up round, then 8 s of rounds of 4 s, 16 pipes each.
#[actix::test]
#[allow(clippy::await_holding_lock)]
async fn bounded_soak() {
    let _one = crate::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    soak(Duration::from_secs(8), Duration::from_secs(4)).await;
}

/// The long version: `ACTORPIPE_SOAK_SECS` seconds (default 600) of 30 s rounds.
#[actix::test]
#[ignore = "long soak; run by hand: cargo test --release --test serial soak::long_soak -- --ignored"]
#[allow(clippy::await_holding_lock)]
async fn long_soak() {
    let _one = crate::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let secs = std::env::var("ACTORPIPE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    soak(Duration::from_secs(secs), Duration::from_secs(30)).await;
}
