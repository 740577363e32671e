//! Admission at the machine's limits: `Connect` means accepted, a listener refuses what it cannot
//! serve at once and with a reason, and a burst of connects against a listener short of file
//! descriptors ends with every pipe that fits working and every other one refused fast.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use actorpipe::internal::handshake;
use actorpipe::internal::negotiate::{Brochure, ChannelOffer, DevicePair, Offer};
use actorpipe::transport::Tcp;
use actorpipe::transport::Transport;
use actorpipe::*;

use crate::common::*;

const CHILD_ENV: &str = "ACTORPIPE_ADMISSION_CHILD";

fn offer(name: &str, addresses: Vec<String>) -> Offer {
    Offer {
        name: name.into(),
        priority: 0,
        domain: String::new(),
        addresses,
    }
}

fn channel(name: &str, priority: i32, connections: u32) -> ChannelOffer {
    ChannelOffer {
        name: name.into(),
        priority,
        domain: String::new(),
        devices: DevicePair::CPU,
        connections,
    }
}

/// What a hand-driven listener does once the handshake is over.
#[derive(Clone, Copy, Debug)]
enum Then {
    Confirm,
    Refuse,
    Nothing,
}

/// A listener driven by hand with the library's handshake steps: it takes one pipe (tcp, basic,
/// no joins), then does `then`, and keeps the connection open for a while.
async fn hand_listener(then: Then) -> String {
    let mut acceptor = Tcp::default()
        .listen("tcp://127.0.0.1:0")
        .await
        .expect("listen");
    let url = acceptor.urls()[0].clone();
    let ours = Brochure {
        transports: vec![offer("tcp", vec![url.clone()])],
        channels: vec![channel("basic", 0, 0)],
        remote: false,
    };
    actix::spawn(async move {
        let stream = acceptor.accept().await.expect("accept");
        let limits = Limits::default();
        let t = Duration::from_secs(5);
        let handshake::Greeting::Hello(h, hello) =
            handshake::greet(stream, &limits, t).await.expect("greet")
        else {
            panic!("expected a hello");
        };
        let mut hs = handshake::accept(h, hello, &ours, None, &limits, t)
            .await
            .expect("handshake");
        match then {
            Then::Confirm => handshake::confirm(&mut hs.halves, t)
                .await
                .expect("confirm"),
            Then::Refuse => handshake::refuse_pending(hs.halves, "busy", t).await,
            Then::Nothing => {}
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(acceptor);
    });
    url
}

#[actix::test]
async fn connect_resolves_only_once_the_listener_confirms() {
    let dialer = || {
        tcp_basic()
            .handshake_timeout(Duration::from_millis(600))
            .start()
    };
    let url = hand_listener(Then::Confirm).await;
    let r = within(5, "connect", dialer().send(Connect::new(&url))).await;
    assert!(r.unwrap().is_ok(), "a confirmed pipe connects");

    let url = hand_listener(Then::Refuse).await;
    let r = within(5, "connect", dialer().send(Connect::new(&url))).await;
    match r.unwrap() {
        Err(Error::Refused { reason, .. }) => assert_eq!(reason, "busy"),
        other => panic!("expected Refused, got {other:?}"),
    }

    let url = hand_listener(Then::Nothing).await;
    let started = Instant::now();
    let r = within(5, "connect", dialer().send(Connect::new(&url))).await;
    match r.unwrap() {
        Err(Error::Timeout { what, .. }) => {
            assert_eq!(what, "waiting for the listener to accept the pipe")
        }
        other => panic!("a pipe never confirmed must not connect, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(600));
}

fn refusals(reason: &str) -> u64 {
    let text = actorpipe::metrics::render().expect("exporter installed");
    let key = format!("actorpipe_listener_refusals_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse().expect("a count"))
}

/// The listener's handshake timeout in the test below: long enough that a refusal on a loaded
/// 2-core machine still comes well before it.
const HANDSHAKE: Duration = Duration::from_secs(4);

#[actix::test]
async fn a_listener_with_every_slot_taken_refuses_at_once_then_recovers() {
    actorpipe::metrics::serve("127.0.0.1:0".parse().unwrap()).expect("metrics exporter");
    let before = (refusals("pending_handshakes"), refusals("join_timeout"));
    let server = Server::start(
        Context::builder()
            .without("shm")
            .max_pending_pipes(1)
            .handshake_timeout(HANDSHAKE),
        "tcp://127.0.0.1:0",
    )
    .await;
    // A peer that handshakes for an mpt pipe (two lanes to join) and never joins: it holds the
    // listener's only slot.
    let stream = Tcp::default()
        .connect(&server.url, Duration::from_secs(5))
        .await
        .expect("dial");
    let ours = Brochure {
        transports: vec![offer("tcp", vec![])],
        channels: vec![channel("basic", 0, 0), channel("mpt", 10, 2)],
        remote: false,
    };
    let limits = Limits::default();
    let t = Duration::from_secs(5);
    let mut stuck = handshake::connect(stream, &ours, None, &limits, t)
        .await
        .expect("handshake");
    assert_eq!(stuck.choice.joins("tcp").len(), 2);

    let client = tcp_basic().start();
    let started = Instant::now();
    let r = within(5, "connect", client.send(Connect::new(&server.url))).await;
    match r.unwrap() {
        Err(Error::Refused { reason, .. }) => assert_eq!(reason, "too many pending handshakes"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(
        started.elapsed() < HANDSHAKE - Duration::from_secs(1),
        "refused fast, not after the handshake timeout: {:?}",
        started.elapsed()
    );

    // The stuck pipe is dropped after the handshake timeout, and its peer told why.
    match within(
        HANDSHAKE.as_secs() + 10,
        "the stuck pipe's verdict",
        handshake::accepted(&mut stuck.halves, &limits, t),
    )
    .await
    {
        Err(Error::Refused { reason, .. }) => assert!(reason.contains("join"), "{reason}"),
        other => panic!("expected a refusal of the stuck pipe, got {other:?}"),
    }
    // The slot is free again.
    let pipe = within(5, "connect", client.send(Connect::new(&server.url)))
        .await
        .unwrap()
        .expect("connects once the slot is free");
    let done = pipe.send(Write::new(Message::new().with_metadata(b"hi".to_vec())));
    let mut server = server;
    let theirs = server.next().await;
    assert_eq!(read_one(&theirs).await.expect("read").metadata, b"hi");
    done.await.unwrap().result.expect("write");
    assert_eq!(refusals("pending_handshakes"), before.0 + 1);
    assert_eq!(refusals("join_timeout"), before.1 + 1);
}

/// `echo_peer` with its descriptor limit lowered to `limit`.
fn echo_peer_with_limit(limit: u64) -> ChildProcess {
    let mut cmd = Command::new(example("echo_peer"));
    cmd.arg("tcp://127.0.0.1:0").stderr(Stdio::null());
    // SAFETY: setrlimit is async-signal-safe and touches only the child's own limits.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    ChildProcess::spawn(cmd)
}

/// What a listener tells a pipe it has no descriptors for (`metrics::Refusal::Descriptors`, and
/// the shm bootstrap's refusal at its limit).
const OUT_OF_DESCRIPTORS: &str = "listener out of file descriptors";

#[actix::test]
async fn a_burst_against_a_listener_short_of_descriptors_ends_fast_and_every_pipe_works() {
    const LIMIT: u64 = 200;
    const PIPES: usize = 48;
    // Default pipes between two processes (shm, cma) take about 10 descriptors each on the
    // peer, so the burst needs more than twice the peer's limit: some pipes must be refused for
    // descriptors. Nothing else may refuse them: the peer's `max_pending_pipes` (128 by default)
    // is more than the burst.
    let handshake_timeout = Duration::from_secs(10);
    let mut peer = echo_peer_with_limit(LIMIT);
    let (_, url) = peer
        .line("listening on ", Duration::from_secs(20))
        .expect("echo_peer starts");
    let ctx = Context::builder().start();
    let dials: Vec<_> = (0..PIPES)
        .map(|_| {
            let ctx = ctx.clone();
            let url = url.clone();
            actix::spawn(async move {
                let started = Instant::now();
                let r = ctx.send(Connect::new(url)).await.expect("context");
                (r, started.elapsed())
            })
        })
        .collect();
    let mut pipes = Vec::new();
    let mut refused = Vec::new();
    for d in dials {
        match within(30, "a connect", d).await.expect("task") {
            (Ok(p), _) => pipes.push(p),
            (Err(Error::Refused { reason, .. }), took) => refused.push((reason, took)),
            (Err(e), _) => panic!("expected Ok or Refused, got {e}"),
        }
    }
    tell_ci(&format!(
        "{PIPES} pipes at once against RLIMIT_NOFILE {LIMIT}: {} accepted, {} refused (the \
         slowest refusal in {:?})",
        pipes.len(),
        refused.len(),
        refused.iter().map(|(_, took)| *took).max()
    ));
    assert!(!pipes.is_empty(), "the pipes that fit are accepted");
    assert!(
        !refused.is_empty(),
        "{PIPES} default pipes do not fit in {LIMIT} descriptors, yet none was refused"
    );
    for (reason, took) in &refused {
        assert_eq!(
            reason, OUT_OF_DESCRIPTORS,
            "every refusal is for descriptors"
        );
        // Refused at once, not starved until the handshake timeout (generous: the machine may
        // be loaded).
        assert!(
            *took < handshake_timeout,
            "a refusal came only after {took:?}, the handshake timeout is {handshake_timeout:?}"
        );
    }
    // Every accepted pipe works.
    let writes: Vec<_> = pipes
        .iter()
        .enumerate()
        .map(|(i, p)| p.send(Write::new(checked_message(i as u64, &[64], &[4096]))))
        .collect();
    for (i, p) in pipes.iter().enumerate() {
        let back = within(20, "an echo", read_one(p)).await.expect("echo");
        assert_eq!(verify(&back), i as u64);
    }
    for w in writes {
        w.await.unwrap().result.expect("write");
    }
}

// ----- shm bootstrap at the listener's descriptor limit ------------------------------------

/// The child: an shm listener whose process has only two descriptors left, so it can accept a
/// connection but not take the six descriptors that come with it. Run alone, it does nothing.
#[test]
#[ignore = "helper: the listener process of shm_refuses_with_a_reason_at_the_descriptor_limit"]
fn shm_child() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    die_with_parent();
    tracing_subscriber::fmt()
        .with_writer(std::io::stdout)
        .with_ansi(false)
        .init();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let shm = actorpipe::transport::Shm::new();
        let mut acceptor = shm.listen_name(Some(&name)).await.expect("listen");
        let r = libc::rlimit {
            rlim_cur: 64,
            rlim_max: 64,
        };
        // SAFETY: setrlimit on our own process with a valid struct.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
        let mut hog = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hog.push(f);
        }
        hog.truncate(hog.len() - 2);
        tell_parent("ready");
        use actorpipe::transport::Acceptor;
        let _ = acceptor.accept().await;
    });
}

#[actix::test]
async fn shm_refuses_with_a_reason_at_the_descriptor_limit() {
    let name = format!("admission-{}", std::process::id());
    let mut cmd = reexec("admission::shm_child");
    cmd.env(CHILD_ENV, &name);
    let mut child = ChildProcess::spawn(cmd);
    child
        .line("ready", Duration::from_secs(20))
        .expect("the child is ready");
    let shm = actorpipe::transport::Shm::new();
    match shm.connect_name(&name, Duration::from_secs(5)).await {
        Err(Error::Refused { reason, .. }) => {
            assert_eq!(reason, "listener out of file descriptors")
        }
        other => panic!("expected a refusal with a reason, got {other:?}"),
    }
    // The listener's log says that it, not the peer, is at its limit.
    let said = child.line("out of file descriptors", Duration::from_secs(5));
    assert!(said.is_some(), "child log: {:?}", child.log);
    assert!(
        child
            .log
            .iter()
            .any(|l| l.contains("this process is out of file descriptors")),
        "{:?}",
        child.log
    );
}
