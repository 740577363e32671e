//! Peer death: the peer process is killed with SIGKILL in the middle of large transfers both
//! ways, on every transport and channel two processes can negotiate, or frozen with SIGSTOP (a
//! hung host: nothing is closed, only heartbeats can tell). The surviving side's
//! pending operations must all complete, with an error, in order, with their buffers, within a
//! bound; nothing may hang or panic, and no descriptor, memfd or mapping may be left behind.
//!
//! The peer is this test binary run again in a child mode (`child_process`, selected by
//! `ACTORPIPE_PEER_DEATH_CHILD`), so that it can build the same restricted context as the
//! survivor and negotiation has only the backend under test to pick. Each backend runs
//! [`TRIALS`] trials; in every other one the child dials the survivor's listener instead of
//! listening itself, so both an accepted and a dialed pipe survive a death.
//!
//! Every trial checks that its tensors moved by the channel it names (`PipeInfo`'s counts), and
//! that every buffer it handed in came back: the same allocation, and for a write the same bytes.
//! The efa backends run on each provider of `ACTORPIPE_EFA_PROVIDERS` (tests/common/efa.rs); a
//! provider libfabric lacks here is reported skipped. `cma_buffers_of_a_frozen_reader_*` checks
//! the cma sender's grace period: the buffers a frozen reader may still be reading stay held,
//! whether the writer closes or the keepalive fails the pipe.
//! `peer_killed_beside_live_pipes_on_its_endpoint_efa_efa` kills a child while a pipe to a second
//! child shares the survivor's efa endpoint, and checks that the live pipe's writes go on
//! completing (docs/efa.md, "A dead peer's sends on `shm`").
//!
//! The tests of this file hold the binary's lock ([`ONE_AT_A_TIME`]): descriptor counts are per
//! process, so no other test may run alongside them.

use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::*;

use crate::common::*;

/// Selects the child mode: `<backend> <provider> <kill|freeze|live> listen` or `<backend>
/// <provider> <kill|freeze|live> dial <url>` (`-` for the provider of a backend without one;
/// `live`: a peer that is not killed, echoing without [`ECHO_PAUSE`]).
const CHILD_ENV: &str = "ACTORPIPE_PEER_DEATH_CHILD";
/// The child's word for a peer that stays alive ([`CHILD_ENV`]).
const LIVE: &str = "live";
/// Starts the child's lines on stdout (the harness prints its own lines around them).
const CHILD_TAG: &str = "peer-death-child:";
/// Trials per backend (`ACTORPIPE_PEER_DEATH_TRIALS` overrides it, for a longer run by hand).
const TRIALS: u32 = 4;
/// Tensor bytes per message: large enough that a kill lands inside a transfer.
const SIZE: usize = 16 << 20;
/// Writes (and echoed reads) in flight when the kill comes.
const IN_FLIGHT: u64 = 6;
/// The child's pause after each echo: the batch takes at least `IN_FLIGHT` of them, longer
/// than the survivor waits between the first echo and the kill (at most 12 ms), with room for a
/// loaded 2-core machine that holds the survivor off the CPU for tens of milliseconds (at
/// 15 ms a pause, once in 9 runs of this suite beside other suites and builds at a load of 10,
/// a kill came after every echo).
const ECHO_PAUSE: Duration = Duration::from_millis(50);
/// Every pending operation must complete within this long after the kill.
const BOUND: Duration = Duration::from_secs(5);
/// The keepalive of both sides when the peer is frozen (SIGSTOP) instead: nothing closes, only
/// the silence gives it away.
const FROZEN_INTERVAL: Duration = Duration::from_millis(250);
const FROZEN_TIMEOUT: Duration = Duration::from_secs(2);
/// Every pending operation fails within 3 s after the keepalive timeout (a loaded 2-core
/// machine can hold a thread off the CPU for a second; without the keepalive nothing would
/// fail at all)...
const FROZEN_BOUND: Duration = Duration::from_secs(5);
/// ...except a cma write: a sending cma channel keeps the buffers a frozen peer may still be
/// reading for its grace period (`backend::cma::driver::GRACE`, 5 s) after the pipe failed, or
/// after its acknowledgement connection fell silent
/// (`cma_buffers_of_a_reader_frozen_until_the_keepalive_come_back_after_the_grace`).
const CMA_GRACE: Duration = Duration::from_secs(5);
/// Trials per backend with a frozen peer: each waits out the timeout.
const FROZEN_TRIALS: u32 = 2;

/// How the peer dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Death {
    /// SIGKILL: its kernel closes everything.
    Kill,
    /// SIGSTOP: a frozen host, as far as the survivor can tell (it is killed afterwards).
    Freeze,
}

impl Death {
    fn builder(self, b: &Backend, provider: &str) -> ContextBuilder {
        match self {
            Death::Kill => (b.builder)(provider),
            Death::Freeze => (b.builder)(provider).keepalive(FROZEN_INTERVAL, FROZEN_TIMEOUT),
        }
    }

    fn bound(self, b: &Backend) -> Duration {
        match self {
            Death::Kill => BOUND,
            Death::Freeze if b.channel == "cma" => FROZEN_BOUND + CMA_GRACE,
            Death::Freeze => FROZEN_BOUND,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Death::Kill => "kill",
            Death::Freeze => "freeze",
        }
    }
}

use crate::ONE_AT_A_TIME;

/// A transport and channel pair, forced on both sides.
struct Backend {
    name: &'static str,
    transport: &'static str,
    channel: &'static str,
    /// Whether it runs on a libfabric provider (each of `ACTORPIPE_EFA_PROVIDERS`).
    fabric: bool,
    /// The context of either side; its argument is the provider (unused without `fabric`).
    builder: fn(&str) -> ContextBuilder,
}

const BACKENDS: &[Backend] = &[
    Backend {
        name: "tcp_basic",
        transport: "tcp",
        channel: "basic",
        fabric: false,
        builder: |_| Context::builder().without("shm").only_channels(&["basic"]),
    },
    Backend {
        name: "shm_basic",
        transport: "shm",
        channel: "basic",
        fabric: false,
        builder: |_| Context::builder().only_channels(&["basic"]),
    },
    Backend {
        name: "tcp_cma",
        transport: "tcp",
        channel: "cma",
        fabric: false,
        builder: |_| {
            Context::builder()
                .without("shm")
                .only_channels(&["cma", "basic"])
        },
    },
    Backend {
        name: "tcp_mpt",
        transport: "tcp",
        channel: "mpt",
        fabric: false,
        builder: |_| {
            Context::builder()
                .without("shm")
                .only_channels(&["mpt", "basic"])
                .lanes(3)
        },
    },
    // What two processes of one user negotiate when nobody restricts anything, with one
    // change: over shm, cma sends tensors of up to 64 MiB inline on the ring by default
    // (`backend::cma::INLINE_MAX_SHM`), so the [`SIZE`] tensors would never be read by cma.
    Backend {
        name: "default",
        transport: "shm",
        channel: "cma",
        fabric: false,
        builder: |_| Context::builder().cma_inline_max(1 << 20),
    },
    // The efa transport over a libfabric provider; basic tensors ride it.
    #[cfg(feature = "efa")]
    Backend {
        name: "efa_basic",
        transport: "efa",
        channel: "basic",
        fabric: true,
        builder: |p| {
            Context::builder()
                .without("shm")
                .efa(p)
                .only_channels(&["basic"])
        },
    },
    // The efa transport and the efa channel together (tensors in place over the fabric).
    #[cfg(feature = "efa")]
    Backend {
        name: "efa_efa",
        transport: "efa",
        channel: "efa",
        fabric: true,
        builder: |p| {
            Context::builder()
                .without("shm")
                .efa(p)
                .only_channels(&["efa", "basic"])
        },
    },
    // The efa channel striped over every domain of the provider (tcp;ofi_rxm: lo and eth0
    // here).
    #[cfg(feature = "efa")]
    Backend {
        name: "efa_efa_domains",
        transport: "efa",
        channel: "efa",
        fabric: true,
        builder: |p| {
            Context::builder()
                .without("shm")
                .efa_domains(p, &[])
                .only_channels(&["efa", "basic"])
        },
    },
];

fn backend(name: &str) -> &'static Backend {
    BACKENDS
        .iter()
        .find(|b| b.name == name)
        .unwrap_or_else(|| panic!("no backend {name:?}"))
}

// ----- the child -------------------------------------------------------------------------------

/// The peer process: opens one pipe (listening or dialing, as `CHILD_ENV` says) and echoes every
/// message until it is killed. Run alone, it does nothing.
#[test]
#[ignore = "helper: the peer process that the peer-death tests start and kill"]
fn child_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    die_with_parent();
    let words: Vec<String> = spec.split_whitespace().map(String::from).collect();
    let b = backend(&words[0]);
    let provider = words[1].clone();
    let death = if words[2] == "freeze" {
        Death::Freeze
    } else {
        Death::Kill
    };
    // A peer that stays alive beside the one killed echoes flat out.
    let pause = if words[2] == LIVE {
        Duration::ZERO
    } else {
        ECHO_PAUSE
    };
    actix::System::new().block_on(async move {
        let builder = death.builder(b, &provider);
        let (pipe, _server) = match words[3].as_str() {
            "listen" => {
                let mut server = Server::start(builder, "tcp://127.0.0.1:0").await;
                tell_parent(&format!("{CHILD_TAG} url {}", server.url));
                (server.next().await, Some(server))
            }
            "dial" => {
                let ctx = builder.start();
                let pipe = ctx
                    .send(Connect::new(&words[4]))
                    .await
                    .unwrap()
                    .expect("the child dials the survivor");
                (pipe, None)
            }
            other => panic!("unknown child mode {other:?}"),
        };
        // Echo until killed; a read failing means the survivor went away first. The pause
        // after each echo keeps the batch in flight when the kill comes: same-host paths move
        // the whole batch in a few milliseconds, so a child echoing flat out could be done
        // before the survivor's kill lands.
        while let Ok(m) = read_one(&pipe).await {
            pipe.do_send(Write::new(m));
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
        }
    });
}

struct Peer {
    process: ChildProcess,
}

impl Peer {
    fn start(b: &Backend, provider: &str, death: Death, mode: &str) -> Peer {
        Peer::start_as(b, provider, death.word(), mode)
    }

    /// A child that `word` (`kill`, `freeze`, [`LIVE`]) describes.
    fn start_as(b: &Backend, provider: &str, word: &str, mode: &str) -> Peer {
        let mut cmd = reexec("peer_death::child_process");
        cmd.env(CHILD_ENV, format!("{} {provider} {word} {mode}", b.name));
        Peer {
            process: ChildProcess::spawn(cmd),
        }
    }

    fn url(&mut self) -> String {
        match self.process.line(CHILD_TAG, Duration::from_secs(10)) {
            Some((_, l)) => l.strip_prefix("url ").expect("url line").to_string(),
            None => panic!(
                "the child printed no URL; its output:\n{}",
                self.process.tail()
            ),
        }
    }
}

// ----- the survivor ----------------------------------------------------------------------------

/// What a trial observed, for the report.
#[derive(Debug, Default)]
struct Trial {
    writes_failed: u64,
    reads_failed: u64,
    /// Kill to the last pending operation's completion.
    last_completion: Duration,
    /// Kill to `Closed`.
    closed_after: Duration,
    classes: Vec<&'static str>,
    /// Tensors handed back as stand-ins (the efa channel's, `WriteDone::stand_ins`): written,
    /// read.
    stand_ins: [u64; 2],
    /// Descriptors open just before the kill.
    peak: Option<FdCount>,
}

fn allowed(e: &Error) -> bool {
    matches!(e.class(), "peer_closed" | "timeout")
}

/// An allocation for an echoed `checked_message(i, &[], &[SIZE])`.
fn allocation() -> Allocation {
    Allocation {
        payloads: Vec::new(),
        tensors: vec![Buffer::Cpu(vec![0; SIZE])],
    }
}

/// Opens a pipe to a fresh child (the child listens, or dials us when `dial` is set).
async fn open(
    b: &Backend,
    provider: &str,
    death: Death,
    dial: bool,
) -> (Peer, Addr<Pipe>, Option<Server>) {
    if dial {
        let mut server = Server::start(death.builder(b, provider), "tcp://127.0.0.1:0").await;
        let peer = Peer::start(b, provider, death, &format!("dial {}", server.url));
        let pipe = server.next().await;
        (peer, pipe, Some(server))
    } else {
        let mut peer = Peer::start(b, provider, death, "listen");
        let url = peer.url();
        let ctx = death.builder(b, provider).start();
        let pipe = within(10, "connect", ctx.send(Connect::new(&url)))
            .await
            .unwrap()
            .expect("connect to the child");
        (peer, pipe, None)
    }
}

/// Checks that the tensors `pipe` wrote so far went as `b` says: by its channel (at least one,
/// and no cma fallback), or on the control connection for `basic`.
async fn assert_moved_by_channel(b: &Backend, pipe: &Addr<Pipe>) {
    let info = pipe.send(GetInfo).await.unwrap();
    if b.channel == "basic" {
        assert!(
            info.tensors_on_control > 0 && info.tensors_by_channel == 0,
            "{}: basic tensors go on the control connection: {info:?}",
            b.name
        );
    } else {
        assert!(
            info.tensors_by_channel > 0 && info.fallbacks == 0,
            "{}: no tensor moved by {}: {info:?}",
            b.name,
            b.channel
        );
    }
}

async fn trial(b: &Backend, provider: &str, death: Death, t: u32) -> Trial {
    let (mut peer, pipe, server) = open(b, provider, death, t % 2 == 1).await;
    let info = pipe.send(GetInfo).await.unwrap();
    assert_eq!(
        info.transport, b.transport,
        "negotiated transport: {info:?}"
    );
    assert!(
        info.channels.iter().any(|c| c.name == b.channel),
        "negotiated channels {:?}, expected {}",
        info.channels,
        b.channel
    );
    let (closed_to, mut closed) = inbox::<Closed>();
    pipe.send(Subscribe(closed_to)).await.unwrap();

    // One echo first: the path works and is warm, and its tensor went by the channel.
    let m = checked_message(0, &[], &[SIZE]);
    let receipt = Receipt::of(&m);
    let w = pipe.send(Write::new(m));
    let back = within(20, "first echo", read_one(&pipe)).await.unwrap();
    assert_eq!(verify(&back), 0);
    let d = w.await.unwrap();
    d.result.unwrap();
    receipt.check_write(&d.message, "the first write");
    assert_moved_by_channel(b, &pipe).await;

    // Writes 1..=N and, pipelined behind them, a descriptor read and a read per echo. Read ids
    // go on from the warm-up's 0 (descriptor) and 1 (read): 2, 3 for message 1, and so on.
    // Every buffer handed in is recorded, to check that the same one comes back.
    let (w_to, mut writes) = inbox::<WriteDone>();
    let (d_to, mut descs) = inbox::<DescriptorReady>();
    let (r_to, mut reads) = inbox::<ReadDone>();
    let mut written = Vec::new();
    for i in 1..=IN_FLIGHT {
        let m = checked_message(i, &[], &[SIZE]);
        written.push(Receipt::of(&m));
        pipe.do_send(Write::new(m).notify(w_to.clone()));
    }
    let mut allocated = Vec::new();
    for _ in 1..=IN_FLIGHT {
        let a = allocation();
        allocated.push(Receipt::of_allocation(&a));
        pipe.do_send(ReadDescriptor.notify(d_to.clone()));
        pipe.do_send(Read::new(a).notify(r_to.clone()));
    }
    // Kill once the first echo of the batch is back: the others are on their way both ways.
    let mut report = Trial::default();
    let first = within(20, "first echo of the batch", reads.recv())
        .await
        .unwrap();
    let d = descs.recv().await.unwrap();
    assert_eq!((d.id, first.id), (2, 3));
    first.result.expect("the first echo, before the kill");
    assert_eq!(verify(&first.message), 1);
    allocated[0].check_read(&first.message, "read 1");
    tokio::time::sleep(Duration::from_millis(t as u64 % 4 * 4)).await;
    report.peak = Some(fd_count());
    match death {
        Death::Kill => peer.process.kill(),
        Death::Freeze => {
            // SAFETY: kill(2) with a pid of our own child process, which has not been reaped.
            let r = unsafe { libc::kill(peer.process.id() as libc::pid_t, libc::SIGSTOP) };
            assert_eq!(r, 0, "SIGSTOP: {}", std::io::Error::last_os_error());
        }
    }
    let killed = Instant::now();
    let bound = death.bound(b);
    // Only the efa channel hands back a failed tensor as a copy, and says so (`stand_ins`).
    let stand_ins = b.channel == "efa";

    within(
        bound.as_secs() + 10,
        "pending operations after the kill",
        async {
            let mut history = Vec::new();
            let mut failed = false;
            for i in 1..=IN_FLIGHT {
                let d = writes.recv().await.unwrap();
                assert_eq!(d.id, i, "write completions in order");
                let what = format!("{}: write {i}", b.name);
                report.stand_ins[0] += d.stand_ins.len() as u64;
                written[i as usize - 1].check_write_done(&d, stand_ins, &what);
                history.push(format!(
                    "write {i}: {:?}",
                    d.result.as_ref().map_err(|e| e.to_string())
                ));
                match d.result {
                    Ok(()) => assert!(
                        !failed,
                        "write {i} succeeded after an earlier one failed: {history:#?}"
                    ),
                    Err(e) => {
                        assert!(allowed(&e), "write {i}: {e}");
                        failed = true;
                        report.writes_failed += 1;
                        report.classes.push(e.class());
                    }
                }
            }
            report.last_completion = killed.elapsed();
            let mut failed = false;
            for i in 2..=IN_FLIGHT {
                let d = descs.recv().await.unwrap();
                assert_eq!(d.id, 2 * i, "descriptor completions in order");
                let r = reads.recv().await.unwrap();
                assert_eq!(r.id, 2 * i + 1, "read completions in order");
                let what = format!("{}: read {i}", b.name);
                // A receive is cancelled, and its own buffer comes back (efa: within
                // `STAND_IN_AFTER`), so no read hands back a stand-in.
                report.stand_ins[1] += r.stand_ins.len() as u64;
                allocated[i as usize - 1].check_read_done(&r, false, &what);
                history.push(format!(
                    "read {i}: descriptor {:?}, read {:?}",
                    d.descriptor.as_ref().map(|_| ()).map_err(|e| e.to_string()),
                    r.result.as_ref().map_err(|e| e.to_string())
                ));
                match (d.descriptor, r.result) {
                    (Ok(_), Ok(())) => {
                        assert_eq!(verify(&r.message), i);
                        // Even a message whose bytes had landed before the death (cma reads
                        // of consecutive messages run concurrently) must not succeed after an
                        // earlier failure: the reader would see a gap.
                        assert!(
                            !failed,
                            "{}: read {i} succeeded (intact) after an earlier one failed: \
                             {history:#?}",
                            b.name
                        );
                    }
                    (Ok(_), Err(e)) | (Err(e), Err(_)) => {
                        assert!(allowed(&e), "read {i}: {e}");
                        failed = true;
                        report.reads_failed += 1;
                        report.classes.push(e.class());
                    }
                    (Err(e), Ok(())) => panic!("read {i} succeeded without its descriptor: {e}"),
                }
            }
            report.last_completion = report.last_completion.max(killed.elapsed());
            let c = closed.recv().await.unwrap();
            assert!(allowed(&c.error), "Closed: {}", c.error);
            report.closed_after = killed.elapsed();
        },
    )
    .await;
    assert!(
        report.last_completion <= bound,
        "{}: the last pending operation completed {:?} after the {death:?} (bound {bound:?})",
        b.name,
        report.last_completion
    );
    assert!(
        report.reads_failed > 0,
        "{}: the child died before echoing everything, yet every read succeeded",
        b.name
    );

    // The pipe stays failed: later operations fail at once, with their buffers, and Close
    // resolves.
    let m = checked_message(99, &[], &[1]);
    let receipt = Receipt::of(&m);
    let w = within(5, "write after death", pipe.send(Write::new(m)))
        .await
        .unwrap();
    receipt.check_write(&w.message, "the write after the death");
    assert!(allowed(&w.result.unwrap_err()));
    within(5, "close after death", pipe.send(Close::because("done")))
        .await
        .unwrap();
    if let Some(s) = server {
        s.listener.send(StopListening).await.unwrap();
    }
    if death == Death::Freeze {
        // Only now that the survivor gave up: a stopped process dies of SIGKILL too.
        peer.process.kill();
    }
    report
}

/// A standing receive (`ReceiveAll`) when the peer is killed with large messages in flight both
/// ways: what arrived whole arrives in order, then only errors (the last one the stand's own
/// ending), each within the bound, then nothing; the pipe closes.
async fn standing_trial(b: &Backend, t: u32) -> Duration {
    let (mut peer, pipe, server) = open(b, "-", Death::Kill, t % 2 == 1).await;
    let (r_to, mut reads) = inbox::<ReadDone>();
    pipe.send(ReceiveAll::to(r_to)).await.unwrap().unwrap();
    let (closed_to, mut closed) = inbox::<Closed>();
    pipe.send(Subscribe(closed_to)).await.unwrap();
    let (w_to, mut writes) = inbox::<WriteDone>();
    let mut written = Vec::new();
    for i in 1..=IN_FLIGHT {
        let m = checked_message(i, &[], &[SIZE]);
        written.push(Receipt::of(&m));
        pipe.do_send(Write::new(m).notify(w_to.clone()));
    }
    let first = within(20, "first echo", reads.recv()).await.unwrap();
    first.result.expect("the first echo, before the kill");
    assert_eq!(verify(&first.message), 1);
    assert_moved_by_channel(b, &pipe).await;
    tokio::time::sleep(Duration::from_millis(t as u64 % 4 * 4)).await;
    peer.process.kill();
    let killed = Instant::now();
    let (mut last_id, mut next_ok, mut failed) = (first.id, 2, 0);
    let last = within(BOUND.as_secs() + 10, "the stand after the kill", async {
        loop {
            let r = reads
                .recv()
                .await
                .expect("the stand ends with an error, then closes");
            assert!(
                r.id > last_id,
                "{}: ids in order: {} after {last_id}",
                b.name,
                r.id
            );
            last_id = r.id;
            match r.result {
                Ok(()) => {
                    assert_eq!(failed, 0, "{}: a message after an error", b.name);
                    assert_eq!(verify(&r.message), next_ok, "{}: order", b.name);
                    next_ok += 1;
                }
                Err(e) => {
                    assert!(allowed(&e), "{}: {e}", b.name);
                    failed += 1;
                    // The stand's own last `ReadDone` carries no buffers; a message the pipe
                    // was reading comes back with its own.
                    if r.message.tensors.is_empty() {
                        break killed.elapsed();
                    }
                }
            }
        }
    })
    .await;
    assert!(
        last <= BOUND,
        "{}: the stand ended {last:?} after the kill",
        b.name
    );
    assert!(
        next_ok <= IN_FLIGHT + 1,
        "{}: more echoes than writes",
        b.name
    );
    for i in 1..=IN_FLIGHT {
        let w = within(10, "writes after the kill", writes.recv())
            .await
            .unwrap();
        // Write ids count from 0 (no warm-up write here); messages from 1.
        assert_eq!(w.id, i - 1, "{}: write completions in order", b.name);
        written[i as usize - 1].check_write(&w.message, &format!("{}: write {i}", b.name));
    }
    let c = within(10, "Closed", closed.recv()).await.unwrap();
    assert!(allowed(&c.error), "Closed: {}", c.error);
    if let Ok(Some(r)) = tokio::time::timeout(Duration::from_millis(300), reads.recv()).await {
        panic!(
            "{}: a ReadDone after the stand's last: {:?}",
            b.name, r.result
        );
    }
    if let Some(s) = server {
        s.listener.send(StopListening).await.unwrap();
    }
    last
}

/// [`standing_trial`] on one backend, twice (the child listening, then dialing), then the
/// descriptor check.
fn survive_standing(name: &str) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    actix::System::new().block_on(async {
        let b = backend(name);
        warm_process(b, "-", Death::Kill).await;
        let baseline = fd_count();
        let mut ends = Vec::new();
        for t in 0..2 {
            ends.push(standing_trial(b, t).await);
        }
        if let Err(now) = fds_back_to(&baseline, Duration::from_secs(6)).await {
            panic!("{name}: descriptors leaked: before {baseline:?}, after {now:?}");
        }
        eprintln!("{name}: standing receive, 2 kills, the stand ended {ends:?} after each");
    });
}

#[test]
fn peer_killed_while_standing_tcp_basic() {
    survive_standing("tcp_basic")
}

#[test]
fn peer_killed_while_standing_default_shm_cma() {
    survive_standing("default")
}

/// Builds and drops one context of `b` before a test counts its descriptors: what the first
/// context of a process opens for the life of the process is then part of the baseline, not a
/// leak of the trials. On a machine with a GPU and feature `cuda`, the default builder lists the
/// CUDA devices, and the driver keeps about a dozen descriptors open from then on (`/dev/nvidia*`,
/// pipes, an eventfd): `peer_frozen_mid_transfer_default_shm_cma`, the first test of the binary
/// to build a default context, failed on them on the GPU machine until 2026-11-27. A context
/// that leaked per pipe or per context would still show: every trial builds its own.
async fn warm_process(b: &Backend, provider: &str, death: Death) {
    drop(death.builder(b, provider).start());
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// Every trial of one backend, then the descriptor check, on a system of its own that exists
/// only while this test holds the lock (a runtime has descriptors too). A backend on a fabric
/// does so on each provider of `ACTORPIPE_EFA_PROVIDERS`, reporting each one libfabric lacks
/// here as skipped.
fn survive(name: &str, death: Death) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let b = backend(name);
    if !b.fabric {
        return actix::System::new().block_on(trials(b, "-", death));
    }
    #[cfg(feature = "efa")]
    for provider in crate::efa_support::providers() {
        match crate::efa_support::missing(&provider) {
            Some(why) => tell_ci(&format!("peer_death {name} on {provider}: {why}")),
            None => actix::System::new().block_on(trials(b, &provider, death)),
        }
    }
}

async fn trials(b: &Backend, provider: &str, death: Death) {
    let name = if b.fabric {
        format!("{} on {provider}", b.name)
    } else {
        b.name.to_string()
    };
    warm_process(b, provider, death).await;
    let started = Instant::now();
    let baseline = fd_count();
    let n = std::env::var("ACTORPIPE_PEER_DEATH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(match death {
            Death::Kill => TRIALS,
            Death::Freeze => FROZEN_TRIALS,
        });
    let mut trials = Vec::new();
    for t in 0..n {
        trials.push(trial(b, provider, death, t).await);
    }
    let wind_down = match fds_back_to(&baseline, Duration::from_secs(6)).await {
        Ok(d) => d,
        Err(now) => {
            let mut open = fd_targets();
            open.sort();
            panic!(
                "{name}: descriptors leaked: before {baseline:?}, after {now:?}; open now: {open:?}"
            )
        }
    };
    let worst = trials.iter().map(|t| t.last_completion).max().unwrap();
    let mut classes: Vec<_> = trials.iter().flat_map(|t| t.classes.clone()).collect();
    classes.sort();
    classes.dedup();
    let peak = trials
        .iter()
        .filter_map(|t| t.peak)
        .max_by_key(|p| p.all)
        .unwrap();
    eprintln!(
        "{name}: {n} {death:?} trials, writes failed {:?}, reads failed {:?}, stand-ins (written, read) {:?}, \
         last completion <= {worst:?} after the kill, Closed after {:?}, classes {classes:?}, \
         fds {peak:?} before a kill, back to {baseline:?} in {wind_down:?}, {:?} in all",
        trials.iter().map(|t| t.writes_failed).collect::<Vec<_>>(),
        trials.iter().map(|t| t.reads_failed).collect::<Vec<_>>(),
        trials.iter().map(|t| t.stand_ins).collect::<Vec<_>>(),
        trials.iter().map(|t| t.closed_after).collect::<Vec<_>>(),
        started.elapsed()
    );
}

#[test]
fn peer_killed_mid_transfer_tcp_basic() {
    survive("tcp_basic", Death::Kill)
}

#[test]
fn peer_killed_mid_transfer_shm_basic() {
    survive("shm_basic", Death::Kill)
}

#[test]
fn peer_killed_mid_transfer_tcp_cma() {
    survive("tcp_cma", Death::Kill)
}

#[test]
fn peer_killed_mid_transfer_tcp_mpt() {
    survive("tcp_mpt", Death::Kill)
}

#[test]
fn peer_killed_mid_transfer_default_shm_cma() {
    survive("default", Death::Kill)
}

#[cfg(feature = "efa")]
#[test]
fn peer_killed_mid_transfer_efa_basic() {
    survive("efa_basic", Death::Kill)
}

#[cfg(feature = "efa")]
#[test]
fn peer_killed_mid_transfer_efa_efa() {
    survive("efa_efa", Death::Kill)
}

#[cfg(feature = "efa")]
#[test]
fn peer_killed_mid_transfer_efa_efa_domains() {
    survive("efa_efa_domains", Death::Kill)
}

// ----- a killed peer beside live pipes on one endpoint ---------------------------------------

/// The efa channel's pipes beside a killed peer (feature `efa`).
#[cfg(feature = "efa")]
mod beside_live {
    use super::*;

    /// Tensors of the live pipes' messages: one in place (over the efa channel's 8 KiB inline
    /// limit, and over `shm`'s 4 KiB inject size, so its send waits for the receiver's answer) and
    /// one inline.
    const LIVE_TENSORS: [usize; 2] = [64 << 10, 4000];
    /// Writes of a live pipe in flight at a time.
    const LIVE_WINDOW: usize = 4;
    /// Rounds (each [`LIVE_WINDOW`] writes and their echoes) every live pipe must complete after
    /// the kill, within [`BOUND`].
    const LIVE_ROUNDS: usize = 25;

    /// Round trips on `pipe` (to an echoing child) until `stop` is set: [`LIVE_WINDOW`] writes of
    /// [`LIVE_TENSORS`] at a time, then their echoes, each intact and in order, every write
    /// completing without error. Pushes the instant each round ended to `rounds`.
    async fn live_rounds(
        pipe: Addr<Pipe>,
        what: String,
        stop: std::rc::Rc<std::cell::Cell<bool>>,
        rounds: std::rc::Rc<std::cell::RefCell<Vec<Instant>>>,
    ) {
        let (w_to, mut writes) = inbox::<WriteDone>();
        let mut id = 0u64;
        let mut base = None;
        while !stop.get() {
            for k in 0..LIVE_WINDOW as u64 {
                let m = checked_message(id + k, &[], &LIVE_TENSORS);
                pipe.do_send(Write::new(m).notify(w_to.clone()));
            }
            for k in 0..LIVE_WINDOW as u64 {
                let m = read_one(&pipe)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: echo {}: {e}", id + k));
                assert_eq!(verify(&m), id + k, "{what}: echoes in order");
            }
            for k in 0..LIVE_WINDOW as u64 {
                let d = writes.recv().await.expect("a write's end");
                let base = *base.get_or_insert(d.id);
                assert_eq!(d.id - base, id + k, "{what}: write completions in order");
                d.result
                    .unwrap_or_else(|e| panic!("{what}: write {}: {e}", id + k));
            }
            id += LIVE_WINDOW as u64;
            rounds.borrow_mut().push(Instant::now());
        }
    }

    /// A live pipe's load, running on its own task.
    struct Live {
        stop: std::rc::Rc<std::cell::Cell<bool>>,
        rounds: std::rc::Rc<std::cell::RefCell<Vec<Instant>>>,
        done: tokio::task::JoinHandle<()>,
    }

    impl Live {
        fn start(pipe: Addr<Pipe>, what: String) -> Live {
            let stop = std::rc::Rc::new(std::cell::Cell::new(false));
            let rounds = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
            let done = actix::spawn(live_rounds(pipe, what, stop.clone(), rounds.clone()));
            Live { stop, rounds, done }
        }

        /// Rounds completed after `t`.
        fn after(&self, t: Instant) -> usize {
            self.rounds.borrow().iter().filter(|r| **r > t).count()
        }

        /// Waits until [`LIVE_ROUNDS`] rounds have completed after `t`; how long after `t` that
        /// was, or `Err` with the rounds done if not within [`BOUND`] (or the load failed).
        async fn rounds_after(&mut self, t: Instant) -> Result<Duration, usize> {
            while t.elapsed() <= BOUND {
                if self.after(t) >= LIVE_ROUNDS {
                    return Ok(t.elapsed());
                }
                if self.done.is_finished() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(self.after(t))
        }

        async fn stop(self) {
            self.stop.set(true);
            if let Err(e) = within(20, "the live load's end", self.done).await {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }

    /// The efa backend with in-place tensors: a survivor context with pipes to two child processes
    /// on its one endpoint; the child `doomed` is killed while large in-place writes to it are in
    /// flight, and the pipe to the child `live` carries a steady load of in-place and inline tensors
    /// all the while. The live pipe's writes must keep completing: [`LIVE_ROUNDS`] rounds of them
    /// within [`BOUND`] of the kill (on libfabric 1.17's `shm`, a send that the dead peer never
    /// answered used to hold back every later send completion of the endpoint, docs/efa.md, "A dead
    /// peer's sends on `shm`": the live pipe's echoes kept coming, its writes never ended). The
    /// dead peer's pipe fails within the bound; then a pipe to a third child, on the same endpoint,
    /// works too. Either pipe is made first (the endpoint sends to its first peer itself).
    async fn beside_live_trial(b: &Backend, provider: &str, t: u32) -> (Duration, Duration) {
        use actorpipe::internal::hardware::efa::FabricStats;
        let transport = actorpipe::transport::Efa::new(provider);
        let channel = actorpipe::channel::Efa::over(&transport);
        let survivor = Context::builder()
            .without("shm")
            .transport(std::sync::Arc::new(transport.clone()))
            .channel(std::sync::Arc::new(channel))
            .only_channels(&["efa", "basic"])
            .start();
        let connect = |url: String| {
            let survivor = survivor.clone();
            async move {
                within(10, "connect", survivor.send(Connect::new(&url)))
                    .await
                    .unwrap()
                    .expect("connect to a child")
            }
        };
        let mut live = Peer::start_as(b, provider, LIVE, "listen");
        let mut doomed = Peer::start(b, provider, Death::Kill, "listen");
        let (live_url, doomed_url) = (live.url(), doomed.url());
        // Pipes on the survivor's endpoint (control streams and the channel's links): after
        // the first connection, and after the second, which must share the endpoint.
        let ep = transport.endpoint_actor().expect("the survivor's endpoint");
        let on_endpoint = || async { ep.send(FabricStats).await.unwrap().pipes };
        let (live_pipe, doomed_pipe, one, both) = if t % 2 == 0 {
            let l = connect(live_url).await;
            let one = on_endpoint().await;
            (l, connect(doomed_url).await, one, on_endpoint().await)
        } else {
            let d = connect(doomed_url).await;
            let one = on_endpoint().await;
            (connect(live_url).await, d, one, on_endpoint().await)
        };
        for p in [&live_pipe, &doomed_pipe] {
            check_backends(p, "efa", "efa").await;
        }
        assert!(
            one > 0 && both > one,
            "{provider}: both pipes on the one endpoint: {one} pipes on it after the first, \
             {both} after the second"
        );
        // The doomed pipe works, and its tensors go in place.
        let m = checked_message(0, &[], &[SIZE]);
        doomed_pipe.do_send(Write::new(m));
        let back = within(20, "the doomed pipe's first echo", read_one(&doomed_pipe))
            .await
            .unwrap();
        assert_eq!(verify(&back), 0);
        assert_moved_by_channel(b, &doomed_pipe).await;

        let mut load = Live::start(live_pipe.clone(), format!("{provider}: the live pipe"));
        let warm = Instant::now();
        load.rounds_after(warm)
            .await
            .unwrap_or_else(|n| panic!("{provider}: the live pipe before the kill: {n} rounds"));
        assert_moved_by_channel(b, &live_pipe).await;

        // Large in-place writes to the doomed child, and reads of its echoes; kill it once the
        // first echo is back: the others are in flight both ways.
        let (w_to, mut writes) = inbox::<WriteDone>();
        let (r_to, mut reads) = inbox::<ReadDone>();
        for i in 1..=IN_FLIGHT {
            doomed_pipe.do_send(Write::new(checked_message(i, &[], &[SIZE])).notify(w_to.clone()));
            doomed_pipe.do_send(ReadDescriptor);
            doomed_pipe.do_send(Read::new(allocation()).notify(r_to.clone()));
        }
        let first = within(
            20,
            "the doomed pipe's first echo of the batch",
            reads.recv(),
        )
        .await
        .unwrap();
        first.result.expect("the first echo, before the kill");
        tokio::time::sleep(Duration::from_millis(t as u64 % 4 * 4)).await;
        doomed.process.kill();
        let killed = Instant::now();

        let live_after = match load.rounds_after(killed).await {
            Ok(d) => d,
            Err(n) => {
                let stats = ep.send(FabricStats).await.unwrap();
                panic!(
                    "{provider}: the live pipe completed {n} rounds of writes in the {BOUND:?} after \
                     the kill, fewer than {LIVE_ROUNDS}: its writes stopped completing behind the \
                     dead peer (the endpoint: {stats:?})"
                )
            }
        };
        // The dead peer's pipe: every pending write and read ends, with an error once one failed.
        within(BOUND.as_secs() + 10, "the doomed pipe's ends", async {
            for _ in 1..=IN_FLIGHT {
                writes.recv().await.expect("a write's end");
            }
            for _ in 2..=IN_FLIGHT {
                reads.recv().await.expect("a read's end");
            }
        })
        .await;
        let doomed_after = killed.elapsed();
        assert!(
            doomed_after <= BOUND,
            "{provider}: the dead peer's pipe ended {doomed_after:?} after the kill"
        );
        // A new pipe on the same endpoint, to a third child, beside the live one.
        let mut third = Peer::start_as(b, provider, LIVE, "listen");
        let third_pipe = connect(third.url()).await;
        check_backends(&third_pipe, "efa", "efa").await;
        let mut next = Live::start(
            third_pipe.clone(),
            format!("{provider}: a pipe after the kill"),
        );
        let after = Instant::now();
        next.rounds_after(after)
            .await
            .unwrap_or_else(|n| panic!("{provider}: a new pipe after the kill: {n} rounds"));
        let now = Instant::now();
        load.rounds_after(now)
            .await
            .unwrap_or_else(|n| panic!("{provider}: the live pipe beside the new one: {n} rounds"));
        next.stop().await;
        load.stop().await;
        for p in [&live_pipe, &doomed_pipe, &third_pipe] {
            within(5, "close", p.send(Close::because("done")))
                .await
                .unwrap();
        }
        live.process.kill();
        third.process.kill();
        (live_after, doomed_after)
    }

    /// [`beside_live_trial`], [`TRIALS`] times on each provider.
    #[test]
    fn peer_killed_beside_live_pipes_on_its_endpoint_efa_efa() {
        let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let b = backend("efa_efa");
        for provider in crate::efa_support::providers() {
            if let Some(why) = crate::efa_support::missing(&provider) {
                tell_ci(&format!(
                    "peer_death beside live pipes on {provider}: {why}"
                ));
                continue;
            }
            actix::System::new().block_on(async {
                warm_process(b, &provider, Death::Kill).await;
                let mut results = Vec::new();
                for t in 0..TRIALS {
                    results.push(beside_live_trial(b, &provider, t).await);
                }
                eprintln!(
                    "efa_efa on {provider}: {TRIALS} kills beside a live pipe: {LIVE_ROUNDS} live \
                     rounds done (kill to the last, dead pipe ended): {results:?}"
                );
            });
        }
    }
}

// A frozen peer (SIGSTOP: a hung host, as seen from here) closes nothing; the heartbeats find it.

#[test]
fn peer_frozen_mid_transfer_tcp_basic() {
    survive("tcp_basic", Death::Freeze)
}

#[test]
fn peer_frozen_mid_transfer_tcp_mpt() {
    survive("tcp_mpt", Death::Freeze)
}

#[test]
fn peer_frozen_mid_transfer_default_shm_cma() {
    survive("default", Death::Freeze)
}

// ----- a frozen cma reader: the sender's grace period ------------------------------------------

/// Selects the reader child of [`cma_buffers_of_a_frozen_reader_come_back_after_the_grace`].
const GRACE_CHILD_ENV: &str = "ACTORPIPE_CMA_GRACE_CHILD";
/// Starts that child's lines on stdout.
const GRACE_TAG: &str = "cma-grace-child:";
/// The tensor the frozen reader is reading: above the 64 MiB a default shm pipe sends inline, so
/// the default context sends it by cma, and large enough that reading it (into fresh pages)
/// takes tens of milliseconds, in which the freeze lands.
const GRACE_SIZE: usize = 256 << 20;
/// Tries of the trial whose reader finished before the freeze landed (it then proves nothing).
const GRACE_TRIES: u32 = 5;

/// The reader: listens, then reads every message, saying `reading` before each `Read` (the
/// parent freezes it on that line, while its cma read runs) and `read` after. Run alone, it does
/// nothing.
#[test]
#[ignore = "helper: the reader that the cma grace test freezes"]
fn cma_grace_child() {
    let Ok(end) = std::env::var(GRACE_CHILD_ENV) else {
        return;
    };
    die_with_parent();
    let end = if end == "keepalive" {
        GraceEnd::Keepalive
    } else {
        GraceEnd::Close
    };
    actix::System::new().block_on(async move {
        let mut server = Server::start(end.builder(), "tcp://127.0.0.1:0").await;
        tell_parent(&format!("{GRACE_TAG} url {}", server.url));
        let pipe = server.next().await;
        while let Ok(d) = pipe.send(ReadDescriptor).await.unwrap().descriptor {
            let alloc = Allocation::for_descriptor(&d).expect("an allocation");
            tell_parent(&format!("{GRACE_TAG} reading"));
            if pipe.send(Read::new(alloc)).await.unwrap().result.is_err() {
                break;
            }
            tell_parent(&format!("{GRACE_TAG} read"));
        }
    });
}

/// How the writer's pipe to the frozen reader ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GraceEnd {
    /// The writer closes it.
    Close,
    /// The keepalive finds the reader silent ([`FROZEN_TIMEOUT`]) and fails it.
    Keepalive,
}

impl GraceEnd {
    /// Both sides' context: the default one (shm + cma), with the short keepalive for
    /// [`GraceEnd::Keepalive`].
    fn builder(self) -> ContextBuilder {
        match self {
            GraceEnd::Close => Context::builder(),
            GraceEnd::Keepalive => Context::builder().keepalive(FROZEN_INTERVAL, FROZEN_TIMEOUT),
        }
    }

    /// From the freeze to the pipe's failure, at least.
    fn failing_after(self) -> Duration {
        match self {
            GraceEnd::Close => Duration::ZERO,
            // The keepalive counts its timeout from the last bytes it got, which may be the
            // reader's heartbeat up to an interval before the freeze (under three suites at
            // once on 2 cores, buffers came back 2 ms and 21 ms short of freeze + timeout +
            // grace, in two of 13 runs).
            GraceEnd::Keepalive => FROZEN_TIMEOUT - FROZEN_INTERVAL,
        }
    }

    /// The class of the pipe's error.
    fn class(self) -> &'static str {
        match self {
            GraceEnd::Close => "closed",
            GraceEnd::Keepalive => "timeout",
        }
    }
}

/// What one try of the grace trial found: the write's end after the pipe failed, or that the
/// reader finished before it was frozen.
enum GraceTry {
    Held {
        back_after: Duration,
        class: &'static str,
    },
    ReadBeforeFreeze,
}

/// A default pipe (shm + cma) to a reader process, which gets a [`GRACE_SIZE`] tensor's
/// descriptor, starts reading it by cma, and is frozen (SIGSTOP) there; then the writer closes
/// its pipe. The reader might still be reading the writer's memory (a frozen process is not a
/// dead one: its side connection stays open), so the tensor's buffer must stay held for cma's
/// grace period (5 s), and come back after it: the same buffer, unchanged, with an error; the
/// close and `Closed` resolve too, and no descriptor is left behind.
#[test]
fn cma_buffers_of_a_frozen_reader_come_back_after_the_grace() {
    frozen_reader_grace(GraceEnd::Close)
}

/// The same when nobody closes the pipe, and the keepalive finds the frozen reader (no byte for
/// 2 s) and fails it: the reader is just as likely to be reading still, so the buffer stays held
/// for the grace after the failure (the acknowledgement connection's silence starts it).
#[test]
fn cma_buffers_of_a_reader_frozen_until_the_keepalive_come_back_after_the_grace() {
    frozen_reader_grace(GraceEnd::Keepalive)
}

fn frozen_reader_grace(end: GraceEnd) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    actix::System::new().block_on(async {
        drop(end.builder().start());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let baseline = fd_count();
        let mut tries = 0;
        let (back_after, class) = loop {
            tries += 1;
            match grace_try(end).await {
                GraceTry::Held { back_after, class } => break (back_after, class),
                GraceTry::ReadBeforeFreeze if tries < GRACE_TRIES => {}
                GraceTry::ReadBeforeFreeze => panic!(
                    "in {tries} tries the reader always finished its {GRACE_SIZE}-byte read \
                     before the freeze landed"
                ),
            }
        };
        // `back_after` counts from the freeze, or from the close; the grace from the failure.
        let at_least = end.failing_after() + CMA_GRACE;
        assert!(
            back_after >= at_least,
            "{end:?}: the buffer came back {back_after:?} after the freeze or close, before the \
             grace ({at_least:?}): the frozen reader may still be reading it"
        );
        // Generous for a loaded 2-core machine; a buffer kept for good would hang the trial.
        assert!(
            back_after <= at_least + Duration::from_secs(10),
            "{end:?}: the buffer came back only {back_after:?} after the freeze or close"
        );
        if let Err(now) = fds_back_to(&baseline, Duration::from_secs(6)).await {
            panic!("descriptors leaked: before {baseline:?}, after {now:?}");
        }
        eprintln!(
            "cma grace, {end:?}: the held buffer came back {back_after:?} after the freeze or \
             close ({class}), try {tries}"
        );
    });
}

async fn grace_try(end: GraceEnd) -> GraceTry {
    let mut cmd = reexec("peer_death::cma_grace_child");
    cmd.env(
        GRACE_CHILD_ENV,
        match end {
            GraceEnd::Close => "close",
            GraceEnd::Keepalive => "keepalive",
        },
    );
    let mut child = ChildProcess::spawn(cmd);
    let url = match child.line(GRACE_TAG, Duration::from_secs(10)) {
        Some((_, l)) => l.strip_prefix("url ").expect("url line").to_string(),
        None => panic!("the reader printed no URL; its output:\n{}", child.tail()),
    };
    let ctx = end.builder().start();
    let pipe = within(10, "connect", ctx.send(Connect::new(&url)))
        .await
        .unwrap()
        .expect("connect to the reader");
    let info = pipe.send(GetInfo).await.unwrap();
    // The host pair's channel (on a host with GPUs the pipe lists CUDA channels too).
    let host: Vec<String> = info
        .channels
        .iter()
        .map(|c| c.to_string())
        .filter(|c| c.ends_with("(cpu->cpu)"))
        .collect();
    assert_eq!(
        (info.transport.as_str(), host),
        ("shm", vec!["cma (cpu->cpu)".to_string()]),
        "{info:?}"
    );
    let (closed_to, mut closed) = inbox::<Closed>();
    pipe.send(Subscribe(closed_to)).await.unwrap();
    let (w_to, mut writes) = inbox::<WriteDone>();
    let m = Message::new().with_tensor(Tensor::cpu(pattern(7, GRACE_SIZE)));
    let receipt = Receipt::of(&m);
    pipe.do_send(Write::new(m).notify(w_to));
    // Freeze the reader the moment it starts reading. The lines are polled, not waited for:
    // this thread runs our pipe, which must send the write and answer the reader meanwhile.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !child.drain().iter().any(|(_, l)| l.ends_with(" reading")) {
        if Instant::now() > deadline {
            panic!(
                "the reader did not start reading; its output:\n{}",
                child.tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // SAFETY: kill(2) with a pid of our own child process, which has not been reaped.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) };
    assert_eq!(r, 0, "SIGSTOP: {}", std::io::Error::last_os_error());
    let frozen = Instant::now();
    let info = pipe.send(GetInfo).await.unwrap();
    assert_eq!(
        (info.tensors_by_channel, info.tensors_on_control),
        (1, 0),
        "the tensor goes by cma: {info:?}"
    );
    // Let anything the reader did before the freeze arrive: an ack means it finished first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.drain();
    let read_first = child.log.iter().any(|l| l.ends_with(" read"));
    if read_first || writes.try_recv().is_ok() {
        return GraceTry::ReadBeforeFreeze;
    }
    let (from, close) = match end {
        GraceEnd::Close => (
            Instant::now(),
            Some(actix::spawn(pipe.send(Close::because("the reader froze")))),
        ),
        GraceEnd::Keepalive => (frozen, None),
    };
    let d = within(
        (CMA_GRACE + Duration::from_secs(20)).as_secs(),
        "the held buffer",
        writes.recv(),
    )
    .await
    .expect("the write's end");
    let back_after = from.elapsed();
    receipt.check_write(&d.message, "the write the frozen reader held");
    let e = d
        .result
        .expect_err("a write the reader never acknowledged fails");
    assert_eq!(e.class(), end.class(), "{e}");
    let close = close.unwrap_or_else(|| actix::spawn(pipe.send(Close::because("done"))));
    let closed_as = within(10, "the close", close).await.unwrap().unwrap();
    assert_eq!(closed_as.error.class(), end.class(), "{}", closed_as.error);
    let c = within(10, "Closed", closed.recv()).await.unwrap();
    assert_eq!(c.error.class(), end.class(), "{}", c.error);
    child.kill();
    drop(child);
    GraceTry::Held {
        back_after,
        class: e.class(),
    }
}
