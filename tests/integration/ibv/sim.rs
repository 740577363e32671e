//! The ibv transport and the ibv channel on the simulated device: negotiation, a queue pair that
//! errors mid-transfer, peer death; the channel striped over several simulated devices. (The conformance suite runs them too: `ibv_sim`,
//! `ibv_sim_sq1`, `ibv_rdma` and `ibv_rdma_sq1` in conformance.rs.) Hardware runs are in
//! tests/ibv_hw.rs.

use std::sync::Arc;

use actorpipe::channel::IbvChannel;
use actorpipe::internal::backend::ibv::sim;
use actorpipe::transport::Ibv;
use actorpipe::transport::Transport;
use actorpipe::*;

use crate::common::*;

// Fault injection touches every simulated queue pair of the process: one test at a time, and no
// conformance case on the simulated fabric meanwhile.
use super::SIMULATED_FABRIC as SERIAL;

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
    let _g = SERIAL.write().await;
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
    let _g = SERIAL.write().await;
    let before = sim::queue_pairs();
    let (tx, rx, _s) = pair(ibv_sim(), ibv_sim()).await;
    let ours: Vec<u32> = sim::queue_pairs()
        .into_iter()
        .filter(|q| !before.contains(q))
        .collect();
    assert_eq!(ours.len(), 2, "one queue pair per side");
    let (done_to, mut done) = inbox::<WriteDone>();
    // Far more than the 64 KiB rings hold: most of it waits in the writer while we break it.
    let receipts = write_checked_messages(&tx, 6, 4 << 20, &done_to);
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
        receipts[i as usize].check_write(&d.message, &format!("write {i}"));
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
    let _g = SERIAL.write().await;
    let (arbiter, tx) = doomed_peer(ibv_sim, ibv_sim()).await;
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

/// The ibv transport and the ibv channel, on one simulated device.
fn ibv_rdma() -> ContextBuilder {
    let ibv = Ibv::simulated()
        .with_capacity(64 << 10)
        .auto_listen("ibv://127.0.0.1:0");
    Context::builder()
        .without("shm")
        .transport(Arc::new(ibv.clone()))
        .channel(Arc::new(IbvChannel::new(ibv)))
        .only_channels(&["ibv", "basic"])
        .chunk_size(64 << 10)
}

#[actix::test]
async fn the_channel_negotiates_between_simulated_contexts_and_not_with_tcp_only_peers() {
    let _g = SERIAL.write().await;
    let (tx, rx, _s) = pair(ibv_rdma(), ibv_rdma()).await;
    for p in [&tx, &rx] {
        let info = p.send(GetInfo).await.unwrap();
        assert_eq!(info.transport, "ibv");
        assert_eq!(info.channel_list(), "ibv (cpu->cpu)");
    }
    let w = tx.send(Write::new(checked_message(1, &[100], &[31, 32, 5 << 20])));
    assert_eq!(verify(&within(20, "read", read_one(&rx)).await.unwrap()), 1);
    w.await.unwrap().result.unwrap();
    // Shared, read-only bytes are written from too (registered for local access only).
    let bytes = pattern(9, 1 << 20);
    let w = tx.send(Write::new(
        Message::new().with_tensor(Tensor::shared(bytes.clone())),
    ));
    let m = within(20, "read", read_one(&rx)).await.unwrap();
    assert_eq!(m.tensors[0].buffer.as_cpu().unwrap(), &bytes[..]);
    w.await.unwrap().result.unwrap();

    // A peer without the channel: basic.
    let (tx, _rx, _s) = pair(
        Context::builder().without("shm").only_channels(&["basic"]),
        ibv_rdma(),
    )
    .await;
    let info = tx.send(GetInfo).await.unwrap();
    assert_eq!(info.channel_list(), "basic (cpu->cpu)");
}

// The transport's queue pairs are made during the bootstrap, before either side's channel
// exists: of the four new queue pairs, the last two (by number) are the channel's.
#[actix::test]
async fn the_writers_or_readers_channel_queue_pair_errors_mid_transfer() {
    channel_qp_error_mid_transfer(2).await;
    channel_qp_error_mid_transfer(3).await;
}

/// Six writes of 4 MiB tensors, two read, then one side's channel queue pair goes to error:
/// the two read are `Ok`, every other write fails, in order, with its buffer; the reader's next
/// read fails.
async fn channel_qp_error_mid_transfer(which: usize) {
    qp_error_mid_transfer_on(ibv_rdma, sim::queue_pairs, 4, which).await;
}

/// The same with the pipes `builder` makes: of the queue pairs `qps` lists that the pair adds
/// (`count` of them), the `which`-th goes to error.
async fn qp_error_mid_transfer_on(
    builder: fn() -> ContextBuilder,
    qps: fn() -> Vec<u32>,
    count: usize,
    which: usize,
) {
    let _g = SERIAL.write().await;
    let before = qps();
    let (tx, rx, _s) = pair(builder(), builder()).await;
    let ours: Vec<u32> = qps().into_iter().filter(|q| !before.contains(q)).collect();
    assert_eq!(ours.len(), count, "new queue pairs");
    let (done_to, mut done) = inbox::<WriteDone>();
    let receipts = write_checked_messages(&tx, 6, 4 << 20, &done_to);
    for i in 0..2 {
        assert_eq!(verify(&within(20, "read", read_one(&rx)).await.unwrap()), i);
    }
    assert!(sim::inject_error(ours[which]));
    for i in 0..6 {
        let d = within(20, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i, "in order");
        receipts[i as usize].check_write(&d.message, &format!("write {i}"));
        if i < 2 {
            d.result.expect("read before the error");
        } else {
            let e = d.result.unwrap_err();
            assert!(matches!(e.class(), "io" | "peer_closed" | "closed"), "{e}");
        }
    }
    let e = within(20, "read after the error", read_one(&rx))
        .await
        .unwrap_err();
    assert!(matches!(e.class(), "io" | "peer_closed" | "closed"), "{e}");
}

#[actix::test]
async fn peer_death_fails_writes_waiting_in_the_channel() {
    let _g = SERIAL.write().await;
    // Nobody reads on the doomed side: the tensors wait in the writer's channel for requests.
    let (arbiter, tx) = doomed_peer(ibv_rdma, ibv_rdma()).await;
    let info = tx.send(GetInfo).await.unwrap();
    assert_eq!(info.channel_list(), "ibv (cpu->cpu)");
    let (done_to, mut done) = inbox::<WriteDone>();
    let receipts = write_checked_messages(&tx, 3, 1 << 20, &done_to);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    arbiter.stop();
    for i in 0..3 {
        let d = within(20, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i, "in order");
        receipts[i as usize].check_write(&d.message, &format!("write {i}"));
        let e = d.result.unwrap_err();
        assert!(matches!(e.class(), "peer_closed" | "io"), "{e}");
    }
}

/// A pipe to a listener (built by `server`) that runs on an arbiter of its own: stopping the
/// arbiter drops every actor of that side at once (pipes, connections, queue-pair actors,
/// channels), as in a crash. The listener's pipe is kept, unread, until then.
async fn doomed_peer(
    server: fn() -> ContextBuilder,
    client: ContextBuilder,
) -> (actix::Arbiter, actix::Addr<Pipe>) {
    let arbiter = actix::Arbiter::new();
    let (url_to, url) = tokio::sync::oneshot::channel();
    let (pipe_to, pipe) = tokio::sync::oneshot::channel();
    arbiter.spawn(async move {
        let mut s = Server::start(server(), "tcp://127.0.0.1:0").await;
        let _ = url_to.send(s.url.clone());
        let p = s.next().await;
        let _ = pipe_to.send(());
        std::future::pending::<()>().await;
        drop((p, s));
    });
    let url = url.await.unwrap();
    let tx = client
        .start()
        .send(Connect::new(&url))
        .await
        .unwrap()
        .expect("connect");
    pipe.await.unwrap();
    (arbiter, tx)
}

// Several (simulated) devices: the ibv channel on sim0 plus further devices, large tensors
// striped over the devices both peers have. Each test uses further device numbers of its own,
// so that the per-device byte counters (`sim::bytes_moved`) see only its traffic.

/// The ibv transport and channel on sim0, the channel also on `sim<further>`.
fn ibv_rdma_on(further: &[usize]) -> ContextBuilder {
    let ibv = Ibv::simulated()
        .with_capacity(64 << 10)
        .auto_listen("ibv://127.0.0.1:0");
    let devices = further.iter().map(|&i| Ibv::simulated_device(i)).collect();
    Context::builder()
        .without("shm")
        .transport(Arc::new(ibv.clone()))
        .channel(Arc::new(IbvChannel::new(ibv).with_devices(devices)))
        .only_channels(&["ibv", "basic"])
        .chunk_size(64 << 10)
}

/// Random shapes (tensors from 0 B to 6 MiB), 8 writes in flight, both directions at once:
/// every message intact and in order, writes completing in order.
async fn random_both_ways(tx: &actix::Addr<Pipe>, rx: &actix::Addr<Pipe>, n: u64) {
    const TENSORS: [usize; 7] = [0, 31, 32, 65_537, 300_001, 1 << 20, 6 << 20];
    let shape = |rng: &mut Rng| {
        let tensors = (0..1 + rng.below(3))
            .map(|_| TENSORS[rng.below(TENSORS.len() as u64) as usize])
            .collect();
        (vec![rng.below(500) as usize], tensors)
    };
    within(120, "random shapes both ways", async {
        tokio::join!(
            random_stream(tx, rx, n, 8, 3, shape),
            random_stream(rx, tx, n, 8, 4, shape)
        )
    })
    .await;
}

#[actix::test]
async fn simulated_devices_stripe_a_large_tensor_over_each() {
    let _g = SERIAL.write().await;
    let further = [11, 12];
    let (tx, rx, _s) = pair(ibv_rdma_on(&further), ibv_rdma_on(&further)).await;
    assert_eq!(
        tx.send(GetInfo).await.unwrap().channel_list(),
        "ibv (cpu->cpu)"
    );
    let before: Vec<u64> = further.iter().map(|&d| sim::bytes_moved(d)).collect();
    // 24 MiB over three devices: 8 MiB on each further one.
    let big = 24 << 20;
    let w = tx.send(Write::new(checked_message(0, &[], &[big])));
    assert_eq!(verify(&within(30, "read", read_one(&rx)).await.unwrap()), 0);
    w.await.unwrap().result.unwrap();
    for (i, &d) in further.iter().enumerate() {
        let moved = sim::bytes_moved(d) - before[i];
        assert!(
            moved >= big as u64 / 3,
            "simulated device sim{d} moved {moved} bytes, expected its stripe of {}",
            big / 3
        );
    }
    random_both_ways(&tx, &rx, 40).await;
}

#[actix::test]
async fn simulated_devices_the_peer_lacks_are_left_out() {
    let _g = SERIAL.write().await;
    // The client has sim13 and sim14, the server only sim14: they pair sim13 (the client's
    // first further device) with sim14 (the server's first), which reach each other (one
    // simulated fabric); the client's sim14 finds no partner and moves nothing.
    let (tx, rx, _s) = pair(ibv_rdma_on(&[13, 14]), ibv_rdma_on(&[14])).await;
    let before = [sim::bytes_moved(13), sim::bytes_moved(14)];
    let big = 16 << 20;
    let w = tx.send(Write::new(checked_message(0, &[], &[big])));
    assert_eq!(verify(&within(30, "read", read_one(&rx)).await.unwrap()), 0);
    w.await.unwrap().result.unwrap();
    // The client writes half on sim13 (its further link); the server's sim14 queue pair only
    // sends requests (32 B each), so sim14 moved no tensor bytes.
    assert!(sim::bytes_moved(13) - before[0] >= big as u64 / 2);
    assert!(sim::bytes_moved(14) - before[1] < 4096);
    // A peer with no further device: one link, nothing on the further one.
    let (tx, rx, _s) = pair(ibv_rdma_on(&[15]), ibv_rdma()).await;
    let before = sim::bytes_moved(15);
    random_both_ways(&tx, &rx, 10).await;
    assert_eq!(sim::bytes_moved(15), before, "sim15 has no partner");
}

/// Six writes of 4 MiB tensors striped over sim0 and sim16, two read, then one side's queue
/// pair on the further device goes to error: the channel fails as a whole, every other write
/// fails in order with its buffer, and the next read fails.
#[actix::test]
async fn a_further_simulated_devices_queue_pair_errors_mid_transfer() {
    for which in [0, 1] {
        qp_error_mid_transfer_on(|| ibv_rdma_on(&[16]), || sim::queue_pairs_of(16), 2, which).await;
    }
}

#[actix::test]
async fn peer_death_fails_striped_writes_in_order() {
    let _g = SERIAL.write().await;
    let (arbiter, tx) = doomed_peer(|| ibv_rdma_on(&[17]), ibv_rdma_on(&[17])).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    let receipts = write_checked_messages(&tx, 3, 4 << 20, &done_to);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    arbiter.stop();
    for i in 0..3 {
        let d = within(20, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i, "in order");
        receipts[i as usize].check_write(&d.message, &format!("write {i}"));
        let e = d.result.unwrap_err();
        assert!(matches!(e.class(), "peer_closed" | "io"), "{e}");
    }
}
