//! Remote memory across processes, with a peer killed (SIGKILL) mid-batch, on each lane path
//! (`cma`, and `tcp` whose bytes travel on the lane):
//!
//! - the owner killed: every pending operation of the initiator completes, with an error after
//!   the first error, in issue order per kind, each with its own buffer, within a bound; and no
//!   descriptor is left behind;
//! - the initiator killed: the owner's region is untouched once the owner's pipe has failed
//!   (no write lands after), deregistration does not wait on anything, and no descriptor is left
//!   behind.
//!
//! - pipes closed gracefully: their lanes' connections close too (both sides);
//! - the owner frozen (SIGSTOP): every pending operation fails once the keepalive has failed
//!   the pipe and the lane's grace (`ABANDON_AFTER`) has passed.
//!
//! The peer is this test binary run again in a child mode (`remote_death::child`, selected by
//! `ACTORPIPE_REMOTE_DEATH_CHILD`).

use std::time::{Duration, Instant};

use actorpipe::remote::{
    Notification, RegionDescriptor, RemoteDone, RemoteOp, RemoteRead, RemoteWrite, Span,
    SubscribeNotifications,
};
use actorpipe::*;

use crate::common::*;

/// Selects the child mode: `<path> owner` (listens, registers a region, prints its URL and the
/// descriptor) or `<path> initiator <url> <descriptor hex>` (writes into the region until
/// killed).
const CHILD_ENV: &str = "ACTORPIPE_REMOTE_DEATH_CHILD";
/// Starts the child's lines on stdout.
const TAG: &str = "remote-death-child:";
/// The region's size, and each operation's.
const REGION: usize = 64 << 20;
const EACH: usize = 8 << 20;
/// Operations in flight when the kill comes.
const IN_FLIGHT: u64 = 16;
/// Every pending operation must complete within this long after the kill.
const BOUND: Duration = Duration::from_secs(5);
/// Both sides' keepalive (interval, timeout) in the frozen-owner trial.
const KEEPALIVE: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(2));

/// Both sides' context on a path: only what it needs, so negotiation picks it.
fn builder(path: &str) -> ContextBuilder {
    // `tcp+keepalive`: the same path, with a short keepalive (the frozen-owner trial).
    let (path, b) = match path.strip_suffix("+keepalive") {
        Some(p) => (p, Context::builder().keepalive(KEEPALIVE.0, KEEPALIVE.1)),
        None => (path, Context::builder()),
    };
    let b = b.only_transports(&["tcp"]);
    match path {
        "cma" => b.only_channels(&["cma", "basic"]),
        _ => b.only_channels(&["basic"]),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

#[test]
#[ignore = "helper: the peer that remote_death's trials kill"]
fn child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    die_with_parent();
    let words: Vec<String> = spec.split_whitespace().map(String::from).collect();
    let path = words[0].clone();
    actix::System::new().block_on(async move {
        match words[1].as_str() {
            "owner" => {
                let mut server = Server::start(builder(&path), "tcp://127.0.0.1:0").await;
                let region = server
                    .ctx
                    .register(Buffer::Cpu(vec![7; REGION]))
                    .await
                    .unwrap();
                tell_parent(&format!(
                    "{TAG} url {} {}",
                    server.url,
                    hex(&region.descriptor().to_bytes())
                ));
                let _pipe = server.next().await;
                std::future::pending::<()>().await;
            }
            "initiator" => {
                let d = RegionDescriptor::from_bytes(&unhex(&words[3])).unwrap();
                let ctx = builder(&path).start();
                let pipe = ctx.send(Connect::new(&words[2])).await.unwrap().unwrap();
                for i in 0u64.. {
                    let span = vec![Span::new((i % 8) * EACH as u64, 0, EACH as u64)];
                    let w = RemoteWrite::new(&d, span, vec![(i % 250) as u8 + 1; EACH])
                        .notify_owner(i.to_le_bytes());
                    if pipe.remote_write(w).await.is_err() {
                        break;
                    }
                }
            }
            other => panic!("unknown child mode {other:?}"),
        }
    });
}

/// Runs `trial` alone in the process (holding [`crate::ONE_AT_A_TIME`]), then checks that every
/// descriptor it opened is closed again.
fn alone(path: &str, trial: impl std::future::Future<Output = ()>) {
    let _serial = crate::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    actix::System::new().block_on(async {
        // A context of the path first, so that what it opens once per process is in the baseline.
        drop(builder(path).start());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let baseline = fd_count();
        trial.await;
        if let Err(now) = fds_back_to(&baseline, Duration::from_secs(6)).await {
            panic!("{path}: descriptors leaked: before {baseline:?}, after {now:?}");
        }
    });
}

/// An owner child on `path`, a context of ours, our pipe to the child, and its region.
async fn owner_child(
    path: &str,
) -> (
    ChildProcess,
    actix::Addr<Context>,
    actix::Addr<Pipe>,
    RegionDescriptor,
) {
    let mut child = spawn_child(&format!("{path} owner"));
    let line = match child.line(TAG, Duration::from_secs(20)) {
        Some((_, l)) => l,
        None => panic!("the owner printed nothing; its output:\n{}", child.tail()),
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let (url, d) = (
        words[1],
        RegionDescriptor::from_bytes(&unhex(words[2])).unwrap(),
    );
    let ctx = builder(path).start();
    let pipe = within(10, "connect", ctx.send(Connect::new(url)))
        .await
        .unwrap()
        .expect("connect to the owner");
    (child, ctx, pipe, d)
}

fn spawn_child(spec: &str) -> ChildProcess {
    let mut cmd = reexec("remote_death::child");
    cmd.env(CHILD_ENV, spec);
    ChildProcess::spawn(cmd)
}

/// The owner is killed while `IN_FLIGHT` reads and writes of `EACH` bytes are pending.
fn owner_killed(path: &str) {
    alone(path, async {
        let (mut child, ctx, pipe, d) = owner_child(path).await;
        let probe = pipe
            .remote_read(RemoteRead::new(&d, vec![Span::whole(8)], vec![0; 8]))
            .await
            .expect("a first read");
        assert_eq!(probe.path, path, "{:?}", pipe.send(GetInfo).await);
        assert_eq!(probe.buffer.as_cpu().unwrap(), &[7; 8]);
        let (to, mut done) = inbox::<RemoteDone>();
        let mut addresses = Vec::new();
        for i in 0..IN_FLIGHT {
            let span = vec![Span::new((i % 8) * EACH as u64, 0, EACH as u64)];
            let buf = vec![i as u8; EACH];
            addresses.push(buf.as_ptr() as usize);
            if i % 2 == 0 {
                pipe.do_send(RemoteRead::new(&d, span, buf).notify(to.clone()));
            } else {
                pipe.do_send(RemoteWrite::new(&d, span, buf).notify(to.clone()));
            }
        }
        let first = within(20, "the first completion", done.recv())
            .await
            .unwrap();
        child.kill();
        let killed = Instant::now();
        let mut all = vec![first];
        while all.len() < IN_FLIGHT as usize {
            let d = tokio::time::timeout(BOUND, done.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{path}: {} of {IN_FLIGHT} operations completed {BOUND:?} after the kill",
                        all.len()
                    )
                })
                .unwrap();
            all.push(d);
        }
        let took = killed.elapsed();
        // In issue order per kind; after the first failure, only failures.
        let mut next = [1u64, 0];
        let mut failed = 0;
        for r in &all {
            let k = (r.op == RemoteOp::Write) as usize;
            assert_eq!(r.id, next[k], "{path}: {:?} completions in order", r.op);
            next[k] += 1;
            // The operation issued i-th (reads even, writes odd) has its own buffer back.
            let i = if k == 0 { 2 * (r.id - 1) } else { 2 * r.id + 1 } as usize;
            let b = r.buffer.as_cpu().unwrap();
            assert_eq!(b.len(), EACH, "{path}: the buffer comes back whole");
            assert_eq!(b.as_ptr() as usize, addresses[i], "{path}: its own buffer");
            match &r.result {
                Ok(()) => assert_eq!(failed, 0, "{path}: a success after a failure"),
                Err(e) => {
                    failed += 1;
                    assert_eq!(e.kind(), ErrorClass::PeerClosed, "{path}: {e}");
                }
            }
        }
        assert!(failed > 0, "{path}: the kill landed after the batch");
        tell_ci(&format!(
            "remote, owner killed ({path}): {failed} of {IN_FLIGHT} operations failed, the last \
             {took:?} after the kill"
        ));
        // Later operations fail at once.
        let after = pipe
            .send(RemoteRead::new(&d, vec![Span::whole(8)], vec![0; 8]))
            .await
            .unwrap();
        assert!(after.result.is_err());
        drop(pipe);
        drop(ctx);
    });
}

/// The initiator is killed while it writes into the owner's region, notifying each write.
fn initiator_killed(path: &str) {
    alone(path, async {
        let mut server = Server::start(builder(path), "tcp://127.0.0.1:0").await;
        let region = server
            .ctx
            .register(Buffer::Cpu(vec![0; REGION]))
            .await
            .unwrap();
        let (to, mut notes) = inbox::<Notification>();
        server.ctx.send(SubscribeNotifications(to)).await.unwrap();
        let spec = format!(
            "{path} initiator {} {}",
            server.url,
            hex(&region.descriptor().to_bytes())
        );
        let mut child = spawn_child(&spec);
        let pipe = within(20, "the initiator's pipe", server.next()).await;
        for _ in 0..3 {
            within(20, "a write's notification", notes.recv())
                .await
                .unwrap();
        }
        child.kill();
        // The owner's pipe fails; from then on no byte of the region changes.
        within(10, "the owner's pipe to fail", async {
            while pipe.send(GetInfo).await.is_ok_and(|i| !i.closed) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        let snapshot = |r: &actorpipe::remote::Region| {
            let mut v = vec![0u8; REGION];
            r.read_at(0, &mut v).unwrap();
            v
        };
        let before = snapshot(&region);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            snapshot(&region) == before,
            "{path}: the region changed after the owner's pipe failed"
        );
        // Every write landed whole, chunk by chunk in span order: each 8 MiB block holds one
        // fill (a cut write leaves a prefix of its fill on the older one's).
        let started = Instant::now();
        let back = region.deregister().await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{path}: deregistration waited {:?}",
            started.elapsed()
        );
        assert_eq!(back.len(), REGION as u64);
        tell_ci(&format!(
            "remote, initiator killed ({path}): the region unchanged 300 ms after the owner's \
             pipe failed"
        ));
        drop(pipe);
        drop(server);
    });
}

#[test]
fn remote_owner_killed_mid_batch_cma() {
    owner_killed("cma")
}

#[test]
fn remote_owner_killed_mid_batch_tcp() {
    owner_killed("tcp")
}

#[test]
fn remote_initiator_killed_mid_batch_cma() {
    initiator_killed("cma")
}

#[test]
fn remote_initiator_killed_mid_batch_tcp() {
    initiator_killed("tcp")
}

/// Pipes closed gracefully, after remote operations both ways, leave no lane connection behind
/// (each side sends `CLOSE`, answers what it was asked, and lets go of its write half).
fn closed_pipes_leave_no_lane(path: &str) {
    alone(path, async {
        for _ in 0..4 {
            let mut server = Server::start(builder(path), "tcp://127.0.0.1:0").await;
            let ctx = builder(path).start();
            let (tx, rx) = server.dial(&ctx).await;
            let here = ctx.register(Buffer::Cpu(vec![1; 1 << 20])).await.unwrap();
            let there = server
                .ctx
                .register(Buffer::Cpu(vec![2; 1 << 20]))
                .await
                .unwrap();
            let read = RemoteRead::new(
                there.descriptor(),
                vec![Span::whole(1 << 20)],
                vec![0; 1 << 20],
            );
            assert_eq!(tx.remote_read(read).await.unwrap().path, path);
            let write = RemoteWrite::new(here.descriptor(), vec![Span::whole(8)], vec![3; 8]);
            assert_eq!(rx.remote_write(write).await.unwrap().path, path);
            tx.send(Close::because("done")).await.unwrap();
            let _ = rx.send(Close::because("done")).await;
            drop((tx, rx, here, there, ctx, server));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

#[test]
fn remote_lanes_of_closed_pipes_are_closed_cma() {
    closed_pipes_leave_no_lane("cma")
}

#[test]
fn remote_lanes_of_closed_pipes_are_closed_tcp() {
    closed_pipes_leave_no_lane("tcp")
}

/// The owner is frozen (SIGSTOP: its connections stay open, it answers nothing) while reads are
/// pending: the keepalive fails the pipe, and the lane gives up on the owner `ABANDON_AFTER`
/// (5 s) later, so every pending operation fails, in order, each with its own buffer, within the
/// keepalive timeout, that grace and some slack. Nothing hangs.
#[test]
fn remote_owner_frozen_mid_batch_tcp() {
    let path = "tcp+keepalive";
    alone(path, async {
        let (mut child, ctx, pipe, d) = owner_child(path).await;
        let (to, mut done) = inbox::<RemoteDone>();
        let mut addresses = Vec::new();
        for i in 0..IN_FLIGHT {
            let span = vec![Span::new((i % 8) * EACH as u64, 0, EACH as u64)];
            let buf = vec![0u8; EACH];
            addresses.push(buf.as_ptr() as usize);
            pipe.do_send(RemoteRead::new(&d, span, buf).notify(to.clone()));
        }
        // SAFETY: kill(2) with a pid of our own child and a signal number touches no memory.
        let r = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) };
        assert_eq!(r, 0, "SIGSTOP: {}", std::io::Error::last_os_error());
        let frozen = std::time::Instant::now();
        let limit = KEEPALIVE.1 + Duration::from_secs(5) + Duration::from_secs(5);
        let mut failed = 0;
        for i in 0..IN_FLIGHT {
            let r = tokio::time::timeout(limit, done.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("{i} of {IN_FLIGHT} reads completed {limit:?} after the freeze")
                })
                .unwrap();
            assert_eq!(r.id, i, "completions in order");
            assert_eq!(
                r.buffer.as_cpu().unwrap().as_ptr() as usize,
                addresses[i as usize]
            );
            if r.result.is_err() {
                failed += 1;
            } else {
                assert_eq!(failed, 0, "a success after a failure");
            }
        }
        assert!(failed > 0, "the freeze landed after the batch");
        tell_ci(&format!(
            "remote, owner frozen (tcp): {failed} of {IN_FLIGHT} reads failed, the last {:?} \
             after the freeze",
            frozen.elapsed()
        ));
        child.kill();
        drop(pipe);
        drop(ctx);
    });
}
