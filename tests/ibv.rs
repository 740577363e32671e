//! The ibv transport on the simulated device: negotiation, a queue pair that errors mid-transfer,
//! peer death. (The conformance suite runs it too: `ibv_sim` and `ibv_sim_sq1` in
//! tests/conformance.rs.) Hardware runs are in tests/ibv_hw.rs.
#![cfg(feature = "ibv")]

mod common;

use std::sync::Arc;

use actorpipe::transport::ibv::Ibv;
use actorpipe::transport::Transport;
use actorpipe::verbs::sim;
use actorpipe::*;
use common::*;

/// Fault injection touches every simulated queue pair of the process: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn ibv_sim() -> ContextBuilder {
    Context::builder()
        .without("shm")
        .transport(Arc::new(
            Ibv::simulated()
                .with_capacity(64 << 10)
                .auto_listen("ibv://127.0.0.1:0"),
        ))
        .only_channels(&["basic"])
        .chunk_size(64 << 10)
}

#[test]
fn the_simulated_domain_never_matches_hardware() {
    let sim = Ibv::simulated().domain();
    assert!(sim.starts_with("sim:"), "{sim}");
    let hw = Ibv::hardware();
    // No RDMA device on the machines this runs on: hardware is unavailable and says why, and
    // its domain is unique to this process.
    if let Err(why) = hw.viable() {
        assert!(!why.is_empty());
        assert!(hw.domain().starts_with("none:"));
    }
    assert_ne!(sim, hw.domain());
}

#[actix::test]
async fn two_simulated_contexts_negotiate_ibv_and_one_sided_falls_back_to_tcp() {
    let _g = SERIAL.lock().await;
    let (tx, rx, _s) = pair(ibv_sim(), ibv_sim()).await;
    for p in [&tx, &rx] {
        assert_eq!(p.send(GetInfo).await.unwrap().transport, "ibv");
    }
    let w = tx.send(Write::new(checked_message(1, &[100], &[1 << 20])));
    assert_eq!(verify(&within(20, "read", read_one(&rx)).await.unwrap()), 1);
    w.await.unwrap().result.unwrap();

    // Only the listener has ibv: the connector never offers it, so the pipe stays on tcp.
    let (tx, _rx, _s) = pair(
        Context::builder().without("shm").only_channels(&["basic"]),
        ibv_sim(),
    )
    .await;
    assert_eq!(tx.send(GetInfo).await.unwrap().transport, "tcp");
}

// A pipe has two queue pairs, one per side; the two tests break one each, so between them
// both the writer's and the reader's are broken (which is created first is not fixed).
#[actix::test]
async fn one_sides_queue_pair_errors_mid_transfer() {
    qp_error_mid_transfer(0).await
}

#[actix::test]
async fn the_other_sides_queue_pair_errors_mid_transfer() {
    qp_error_mid_transfer(1).await
}

/// Writes in flight, a reader reading, and one side's queue pair goes to error: every pending
/// write completes in order (a prefix `Ok`, then errors), with its buffer; the reader gets a
/// prefix of the messages whole, then an error. The other side learns it from the bootstrap
/// socket.
async fn qp_error_mid_transfer(which: usize) {
    let _g = SERIAL.lock().await;
    let before = sim::queue_pairs();
    let (tx, rx, _s) = pair(ibv_sim(), ibv_sim()).await;
    let ours: Vec<u32> = sim::queue_pairs()
        .into_iter()
        .filter(|q| !before.contains(q))
        .collect();
    assert_eq!(ours.len(), 2, "one queue pair per side");
    let (done_to, mut done) = inbox::<WriteDone>();
    // Far more than the 64 KiB rings hold: most of it waits in the writer while we break it.
    for i in 0..6u64 {
        tx.do_send(Write::new(checked_message(i, &[], &[4 << 20])).notify(done_to.clone()));
    }
    // The reader reads everything it can, in order, until its first error.
    let reader = actix::spawn(async move {
        let mut got = Vec::new();
        loop {
            match within(20, "read", read_one(&rx)).await {
                Ok(m) => got.push(verify(&m)),
                Err(e) => return (got, e),
            }
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    assert!(sim::inject_error(ours[which]));
    let mut failed = false;
    for i in 0..6 {
        let d = within(20, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i, "in order");
        assert_eq!(d.message.tensors[0].buffer.len(), 4 << 20, "buffer back");
        match d.result {
            Ok(()) => assert!(!failed, "no success after a failure"),
            Err(e) => {
                failed = true;
                assert!(matches!(e.class(), "io" | "peer_closed" | "closed"), "{e}");
            }
        }
    }
    assert!(
        failed,
        "4 MiB x 6 cannot all have gone through 64 KiB before the error"
    );
    // The reader got a prefix of the messages, whole and in order, then an error.
    let (got, e) = within(20, "reader", reader).await.unwrap();
    assert!(got.len() < 6, "{got:?}");
    assert_eq!(got, (0..got.len() as u64).collect::<Vec<_>>());
    assert!(matches!(e.class(), "io" | "peer_closed"), "{e}");
}

#[actix::test]
async fn peer_death_fails_pending_reads_with_peer_closed() {
    let _g = SERIAL.lock().await;
    // The listener's side runs on an arbiter of its own, which we then stop: every actor of
    // that side (pipes, connections, queue-pair actors) is dropped at once, as in a crash.
    let arbiter = actix::Arbiter::new();
    let (url_to, url) = tokio::sync::oneshot::channel();
    let (pipe_to, pipe) = tokio::sync::oneshot::channel();
    arbiter.spawn(async move {
        let mut s = Server::start(ibv_sim(), "tcp://127.0.0.1:0").await;
        let _ = url_to.send(s.url.clone());
        let p = s.next().await;
        let _ = pipe_to.send(());
        // Keep the pipe and the server alive until the arbiter stops.
        std::future::pending::<()>().await;
        drop((p, s));
    });
    let url = url.await.unwrap();
    let tx = Context::builder()
        .without("shm")
        .transport(Arc::new(Ibv::simulated().with_capacity(64 << 10)))
        .only_channels(&["basic"])
        .start()
        .send(Connect::new(&url))
        .await
        .unwrap()
        .expect("connect");
    pipe.await.unwrap();
    assert_eq!(tx.send(GetInfo).await.unwrap().transport, "ibv");
    let (to, mut descs) = inbox::<DescriptorReady>();
    for _ in 0..3 {
        tx.do_send(ReadDescriptor.notify(to.clone()));
    }
    arbiter.stop();
    for i in 0..3 {
        let d = within(20, "descriptor", descs.recv()).await.unwrap();
        assert_eq!(d.id, i);
        let e = d.descriptor.unwrap_err();
        assert!(matches!(e.class(), "peer_closed" | "io"), "{e}");
    }
}
