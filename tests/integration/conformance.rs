//! Conformance suites: the same cases run over every transport and every channel.
//!
//! `transport_suite!` instantiates the transport cases for one transport (with the basic
//! channel), `channel_suite!` the channel cases for one channel (over TCP, so the channel alone
//! is under test). Each instance first checks that negotiation picked the backend it names, so a
//! suite cannot silently run over another backend. A new backend is done when it passes.
//!
//! Every buffer a case hands in must come back: the same allocation, and for a write the same
//! bytes ([`Receipt`]), on success and on every error path. The efa suites run each case on
//! every provider of `ACTORPIPE_EFA_PROVIDERS` in turn (tests/common/efa.rs).
//!
//! Everything here runs in one process: cross-process runs of the same backends are in
//! `processes.rs` (shm + cma are what two processes of one user negotiate).

use std::sync::Arc;

use actix::Addr;
use actorpipe::transport::Shm;
use actorpipe::*;

use crate::common::*;

/// A small chunk and ring so that "larger than any internal ring or chunk" is cheap to reach.
const CHUNK: usize = 64 << 10;
const RING: usize = 64 << 10;

/// Sizes that are unaligned, tiny, empty, and larger than the chunk and the ring.
const SIZES: [usize; 9] = [0, 1, 7, 31, 4097, 65_537, 200_003, 1 << 20, (3 << 20) + 5];

async fn connected(
    builder: &dyn Fn() -> ContextBuilder,
    transport: &str,
    channel: &str,
) -> (Addr<Pipe>, Addr<Pipe>, Server) {
    let (tx, rx, s) = pair(builder(), builder()).await;
    for p in [&tx, &rx] {
        let info = p.send(GetInfo).await.unwrap();
        assert_eq!(info.transport, transport, "negotiated transport");
        assert!(
            info.channels.iter().any(|c| c.name == channel),
            "negotiated channels {:?}, expected {channel}",
            info.channels
        );
    }
    (tx, rx, s)
}

/// Writes `m` on `pipe` now; the future ends with the write's result, once it has checked that
/// the buffers came back the same and unchanged.
fn checked_write(pipe: &Addr<Pipe>, m: Message) -> impl std::future::Future<Output = Result<()>> {
    let receipt = Receipt::of(&m);
    let w = pipe.send(Write::new(m));
    async move {
        let d = w.await.unwrap();
        receipt.check_write(&d.message, &format!("write {}", d.id));
        d.result
    }
}

/// Many messages, up to 16 writes in flight, every size: order and content preserved.
async fn order_of_many_ops(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (tx, rx, _s) = connected(b, t, c).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    const N: u64 = 150;
    let writer = async {
        let mut rng = Rng(11);
        let mut next = 0;
        let mut receipts = Vec::new();
        for i in 0..N {
            let pick = |rng: &mut Rng| SIZES[rng.below(SIZES.len() as u64) as usize];
            let payloads: Vec<usize> = (0..rng.below(3)).map(|_| pick(&mut rng) % 70_000).collect();
            let tensors: Vec<usize> = (0..rng.below(4)).map(|_| pick(&mut rng)).collect();
            let m = checked_message(i, &payloads, &tensors);
            receipts.push(Receipt::of(&m));
            tx.do_send(Write::new(m).notify(done_to.clone()));
            while i + 1 - next >= 16 || (i == N - 1 && next < N) {
                let d = done.recv().await.unwrap();
                assert_eq!(d.id, next, "write completions in order");
                d.result.expect("write");
                assert_eq!(verify(&d.message), next, "buffers handed back whole");
                receipts[next as usize].check_write(&d.message, &format!("write {next}"));
                next += 1;
            }
        }
    };
    let reader = async {
        for i in 0..N {
            assert_eq!(verify(&read_one(&rx).await.expect("read")), i);
        }
    };
    within(120, "many ops", async { tokio::join!(writer, reader) }).await;
}

/// Empty messages, empty and one-byte payloads and tensors.
async fn empty_and_one_byte(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (tx, rx, _s) = connected(b, t, c).await;
    for (i, (p, ts)) in [
        (vec![], vec![]),
        (vec![0], vec![0]),
        (vec![1], vec![1]),
        (vec![0, 1, 0], vec![1, 0, 1]),
    ]
    .into_iter()
    .enumerate()
    {
        let w = checked_write(&tx, checked_message(i as u64, &p, &ts));
        assert_eq!(verify(&read_one(&rx).await.unwrap()), i as u64);
        within(10, "write", w).await.unwrap();
    }
}

/// A tensor and a payload each larger than every ring and chunk, with unaligned sizes.
async fn larger_than_rings_and_chunks(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (tx, rx, _s) = connected(b, t, c).await;
    let m = checked_message(5, &[(1 << 20) + 3], &[(9 << 20) + 1, RING * 3 + 1]);
    let w = checked_write(&tx, m);
    assert_eq!(verify(&within(60, "read", read_one(&rx)).await.unwrap()), 5);
    within(60, "write", w).await.unwrap();
}

/// Both directions of one pipe at once.
async fn both_directions(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (x, y, _s) = connected(b, t, c).await;
    let one_way = |from: Addr<Pipe>, to: Addr<Pipe>, base: u64| async move {
        for i in 0..20 {
            let w = checked_write(&from, checked_message(base + i, &[33], &[70_001, 5]));
            assert_eq!(verify(&read_one(&to).await.unwrap()), base + i);
            w.await.unwrap();
        }
    };
    within(60, "both directions", async {
        tokio::join!(one_way(x.clone(), y.clone(), 0), one_way(y, x, 1000))
    })
    .await;
}

/// Large tensors both ways at once, several in flight each way (stripes, acks and fallback
/// streams of the two directions must not mix).
async fn both_directions_large(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (x, y, _s) = connected(b, t, c).await;
    let one_way = |from: Addr<Pipe>, to: Addr<Pipe>, base: u64| async move {
        let writes: Vec<_> = (0..4)
            .map(|i| checked_write(&from, checked_message(base + i, &[], &[(8 << 20) + 3])))
            .collect();
        for i in 0..4 {
            assert_eq!(verify(&read_one(&to).await.unwrap()), base + i);
        }
        for w in writes {
            w.await.unwrap();
        }
    };
    within(120, "large both directions", async {
        tokio::join!(one_way(x.clone(), y.clone(), 0), one_way(y, x, 1000))
    })
    .await;
}

/// Sixteen pipes of one context pair, all busy at once.
async fn concurrent_pipes(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let mut server = Server::start(b(), "tcp://127.0.0.1:0").await;
    let client = b().start();
    let mut tasks = Vec::new();
    for p in 0..16u64 {
        let (tx, rx) = server.dial(&client).await;
        let info = tx.send(GetInfo).await.unwrap();
        assert_eq!(info.transport, t);
        assert!(info.channels.iter().any(|x| x.name == c));
        tasks.push(actix::spawn(async move {
            for i in 0..6 {
                let id = p * 100 + i;
                let w = checked_write(&tx, checked_message(id, &[10], &[100_000 + p as usize]));
                assert_eq!(verify(&read_one(&rx).await.unwrap()), id);
                w.await.unwrap();
            }
        }));
    }
    within(120, "concurrent pipes", async {
        for t in tasks {
            t.await.expect("pipe task");
        }
    })
    .await;
}

/// Writes `n` messages of one `size`-byte tensor on `pipe`, each filled with its index, to
/// `done`: their receipts.
fn write_filled(
    pipe: &Addr<Pipe>,
    n: u64,
    size: usize,
    done: &actix::Recipient<WriteDone>,
) -> Vec<Receipt> {
    (0..n)
        .map(|i| {
            let m = Message::new().with_tensor(Tensor::cpu(vec![i as u8; size]));
            let receipt = Receipt::of(&m);
            pipe.do_send(Write::new(m).notify(done.clone()));
            receipt
        })
        .collect()
}

/// Checks a run of write completions: in order, buffers back (those of `receipts`, unchanged,
/// but for the stand-ins each names, `Receipt::check_back`; only `channel` `efa` may return
/// any, and only for a failed write), no success after a failure.
async fn writes_complete_in_order(
    done: &mut tokio::sync::mpsc::UnboundedReceiver<WriteDone>,
    receipts: &[Receipt],
    channel: &str,
) -> bool {
    let mut failed = false;
    for (i, receipt) in (0..).zip(receipts) {
        let d = within(20, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i, "in order");
        receipt.check_write_done(&d, channel == "efa", &format!("write {i}"));
        match d.result {
            Ok(()) => assert!(!failed, "no success after a failure"),
            Err(e) => {
                failed = true;
                assert!(
                    matches!(e.class(), "closed" | "peer_closed"),
                    "a close error, got {e}"
                );
            }
        }
    }
    failed
}

/// The writer closes while its writes are in flight and the reader reads one message.
async fn close_mid_operation_by_writer(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (tx, rx, _s) = connected(b, t, c).await;
    let (rx_closed_to, mut rx_closed) = inbox::<Closed>();
    rx.send(Subscribe(rx_closed_to)).await.unwrap();
    let (done_to, mut done) = inbox::<WriteDone>();
    const SIZE: usize = 16 << 20;
    let receipts = write_filled(&tx, 4, SIZE, &done_to);
    let d = within(10, "descriptor", rx.send(ReadDescriptor))
        .await
        .unwrap();
    let alloc = Allocation::for_descriptor(&d.descriptor.unwrap()).unwrap();
    let allocated = Receipt::of_allocation(&alloc);
    let read = rx.send(Read::new(alloc));
    let closed = within(10, "close", tx.send(Close::because("writer done")))
        .await
        .unwrap();
    assert_eq!(closed.error.class(), "closed");
    writes_complete_in_order(&mut done, &receipts, c).await;
    let r = within(20, "read", read).await.unwrap();
    allocated.check_read_done(&r, c == "efa", "the read");
    if r.result.is_ok() {
        assert!(r.message.tensors[0]
            .buffer
            .as_cpu()
            .unwrap()
            .iter()
            .all(|&b| b == 0));
    }
    let c = within(20, "Closed", rx_closed.recv()).await.unwrap();
    assert_eq!(c.error.class(), "peer_closed");
}

/// The reader closes while a large tensor is landing and more writes are queued.
async fn close_mid_operation_by_reader(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (tx, rx, _s) = connected(b, t, c).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    const SIZE: usize = 16 << 20;
    let receipts = write_filled(&tx, 4, SIZE, &done_to);
    let d = within(10, "descriptor", rx.send(ReadDescriptor))
        .await
        .unwrap();
    let alloc = Allocation::for_descriptor(&d.descriptor.unwrap()).unwrap();
    let allocated = Receipt::of_allocation(&alloc);
    let read = rx.send(Read::new(alloc));
    rx.do_send(Close::because("reader gives up"));
    let r = within(20, "read", read).await.unwrap();
    allocated.check_read_done(&r, c == "efa", "the read");
    assert!(
        writes_complete_in_order(&mut done, &receipts, c).await,
        "4 x 16 MiB cannot all be delivered to a reader that closed after one"
    );
}

/// Both sides have writes in flight and nobody reads; one side closes: every write on both
/// sides completes, in order, with its buffer, and the close resolves.
async fn close_with_both_directions_in_flight(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (x, y, _s) = connected(b, t, c).await;
    const SIZE: usize = 8 << 20;
    let (x_to, mut x_done) = inbox::<WriteDone>();
    let (y_to, mut y_done) = inbox::<WriteDone>();
    let x_receipts = write_filled(&x, 3, SIZE, &x_to);
    let y_receipts = write_filled(&y, 3, SIZE, &y_to);
    within(20, "close", x.send(Close::because("both busy")))
        .await
        .unwrap();
    writes_complete_in_order(&mut x_done, &x_receipts, c).await;
    writes_complete_in_order(&mut y_done, &y_receipts, c).await;
}

/// Pending reads all fail, in order, when the peer goes away before sending anything.
async fn error_reaches_every_pending_op(b: &dyn Fn() -> ContextBuilder, t: &str, c: &str) {
    let (tx, rx, _s) = connected(b, t, c).await;
    let (to, mut descs) = inbox::<DescriptorReady>();
    for _ in 0..5 {
        rx.do_send(ReadDescriptor.notify(to.clone()));
    }
    tx.send(Close::because("nothing to say")).await.unwrap();
    for i in 0..5 {
        let d = within(10, "descriptor", descs.recv()).await.unwrap();
        assert_eq!(d.id, i);
        assert_eq!(d.descriptor.unwrap_err().class(), "peer_closed");
    }
}

macro_rules! cases {
    // Each case holding `$hold` (a guard, taken in the case's own runtime) while it runs.
    (hold $hold:expr; $builder:expr, $transport:expr, $channel:expr; $($case:ident),* $(,)?) => {
        $(
            #[actix::test]
            async fn $case() {
                let _hold = $hold;
                super::$case(&$builder, $transport, $channel).await
            }
        )*
    };
    ($builder:expr, $transport:expr, $channel:expr; $($case:ident),* $(,)?) => {
        $(
            #[actix::test]
            async fn $case() {
                super::$case(&$builder, $transport, $channel).await
            }
        )*
    };
}

/// Every case over the efa transport and `$channel`, on each provider of
/// `ACTORPIPE_EFA_PROVIDERS` in turn (`$builder` makes a context of a provider). A provider
/// libfabric lacks here, and a case [`efa_skip`] names, are reported skipped on stderr, past the
/// harness's capture.
#[cfg(feature = "efa")]
macro_rules! efa_suite {
    ($name:ident, $channel:expr, $builder:expr) => {
        mod $name {
            use super::*;
            efa_cases!($builder, $channel;
                order_of_many_ops, empty_and_one_byte, larger_than_rings_and_chunks,
                both_directions, both_directions_large, concurrent_pipes, close_mid_operation_by_writer,
                close_mid_operation_by_reader, close_with_both_directions_in_flight,
                error_reaches_every_pending_op);
        }
    };
}

#[cfg(feature = "efa")]
macro_rules! efa_cases {
    ($builder:expr, $channel:expr; $($case:ident),* $(,)?) => {
        $(
            #[actix::test]
            async fn $case() {
                let builder: fn(&str) -> ContextBuilder = $builder;
                for provider in crate::efa_support::providers() {
                    if let Some(why) = efa_skip(&provider, $channel, stringify!($case)) {
                        tell_ci(&format!(
                            "{}::{} on {provider}: {why}",
                            module_path!(),
                            stringify!($case)
                        ));
                        continue;
                    }
                    super::$case(&|| builder(&provider), "efa", $channel).await
                }
            }
        )*
    };
}

/// Why `case` of the efa suite on `channel` does not run on `provider` here, if it does not:
/// the provider is absent, or the case closes a pipe while large tensors are on the fabric on
/// the efa channel over `ofi_rxm` without its passthru. With real traffic in flight, libfabric
/// 1.17's `ofi_rxm` crashes the process when the endpoint closes (the test's runtime drops it at
/// its end): docs/efa.md, "A crash at close in `ofi_rxm`". The shm provider runs those cases,
/// and so does `under_rxm_passthru_the_efa_suites_on_tcp`.
#[cfg(feature = "efa")]
fn efa_skip(provider: &str, channel: &str, case: &str) -> Option<String> {
    const CLOSE_MID_TRANSFER: [&str; 3] = [
        "close_mid_operation_by_writer",
        "close_mid_operation_by_reader",
        "close_with_both_directions_in_flight",
    ];
    if let Some(why) = crate::efa_support::missing(provider) {
        return Some(why);
    }
    let passthru = std::env::var_os(actorpipe::internal::backend::efa::PASSTHRU).is_some();
    (channel == "efa"
        && provider.contains("ofi_rxm")
        && !passthru
        && CLOSE_MID_TRANSFER.contains(&case))
    .then(|| {
        "skipped: libfabric 1.17's ofi_rxm crashes closing an endpoint mid-transfer \
         (docs/efa.md, \"A crash at close in ofi_rxm\")"
            .to_string()
    })
}

/// The transport suite for one transport, with the basic channel.
macro_rules! transport_suite {
    ($name:ident, $transport:expr, $builder:expr) => {
        pair_suite!($name, $transport, "basic", $builder);
    };
}

/// The channel suite for one channel, over TCP.
macro_rules! channel_suite {
    ($name:ident, $builder:expr) => {
        channel_suite!($name, stringify!($name), $builder);
    };
    ($name:ident, $channel:expr, $builder:expr) => {
        pair_suite!($name, "tcp", $channel, $builder);
    };
}

/// Every case over one transport and one channel.
macro_rules! pair_suite {
    ($name:ident, $transport:expr, $channel:expr, $builder:expr) => {
        mod $name {
            use super::*;
            cases!($builder, $transport, $channel;
                order_of_many_ops, empty_and_one_byte, larger_than_rings_and_chunks,
                both_directions, both_directions_large, concurrent_pipes, close_mid_operation_by_writer,
                close_mid_operation_by_reader, close_with_both_directions_in_flight,
                error_reaches_every_pending_op);
        }
    };
}

fn base() -> ContextBuilder {
    Context::builder().chunk_size(CHUNK)
}

transport_suite!(tcp, "tcp", || base()
    .without("shm")
    .only_channels(&["basic"]));
// The efa transport with basic tensors, on each provider of `ACTORPIPE_EFA_PROVIDERS`
// (`tcp;ofi_rxm` and `shm` by default; no EFA device here).
#[cfg(feature = "efa")]
efa_suite!(efa, "basic", |p| base()
    .without("shm")
    .efa(p)
    .only_channels(&["basic"]));
// The efa transport and the efa channel together. The channel's chunk is lowered to 256 KiB so
// that tensors of the suite go as several fabric messages.
#[cfg(feature = "efa")]
fn efa_both(provider: &str) -> ContextBuilder {
    let t = actorpipe::transport::Efa::new(provider);
    let c = actorpipe::channel::Efa::over(&t).max_message(256 << 10);
    base()
        .without("shm")
        .transport(Arc::new(t))
        .channel(Arc::new(c))
        .only_channels(&["efa", "basic"])
}
#[cfg(feature = "efa")]
efa_suite!(efa_efa, "efa", efa_both);
// The efa channel on every domain of the provider (`lo` and `eth0` for `tcp;ofi_rxm` on the
// development VM): tensors over 64 KiB striped over the domains both sides have
// (tests/efa_domains.rs checks that each domain carries its share).
#[cfg(feature = "efa")]
efa_suite!(efa_efa_domains, "efa", |p| {
    let t = actorpipe::transport::Efa::new(p);
    let c = actorpipe::channel::Efa::over(&t)
        .max_message(256 << 10)
        .all_domains();
    base()
        .without("shm")
        .transport(Arc::new(t))
        .channel(Arc::new(c))
        .only_channels(&["efa", "basic"])
});
/// The efa suites on `tcp;ofi_rxm` again, with rxm's passthru on (docs/efa.md, "Providers"):
/// the tcp provider's own RDM endpoint, which reports received tags as 0 and keeps no large
/// unexpected message. The stream's credits ride CQ data, and the efa channel sends a tensor
/// only to receives the peer has posted; without that, `order_of_many_ops` on the efa channel
/// stalls there. The cases skipped above for rxm's crash at close run too: the passthru path
/// does not crash (development VM, 2026-11-28: seven runs of all six). Only where
/// `ACTORPIPE_EFA_PROVIDERS` lists `tcp;ofi_rxm` (the child runs on it alone).
#[cfg(feature = "efa")]
#[test]
fn under_rxm_passthru_the_efa_suites_on_tcp() {
    if !crate::efa_support::listed("tcp;ofi_rxm") {
        return tell_ci(&format!(
            "under_rxm_passthru_the_efa_suites_on_tcp: skipped: tcp;ofi_rxm is not in {}",
            crate::efa_support::PROVIDERS_VAR
        ));
    }
    if let Some(why) = crate::efa_support::missing("tcp;ofi_rxm") {
        return tell_ci(&format!("under_rxm_passthru_the_efa_suites_on_tcp: {why}"));
    }
    if let Err(e) = crate::common::rerun_under_passthru(&["conformance::efa"], 30) {
        panic!("{e}");
    }
}
transport_suite!(shm, "shm", || {
    base()
        .transport(Arc::new(Shm::new().with_capacity(RING)))
        .only_channels(&["basic"])
});
// Spin mode: the halves poll their rings in bursts, and the read loop gives way after each
// message it hands to a standing receive.
transport_suite!(shm_spin, "shm", || {
    base()
        .transport(Arc::new(
            Shm::new()
                .with_capacity(RING)
                .with_spin(std::time::Duration::from_micros(20)),
        ))
        .only_channels(&["basic"])
});

channel_suite!(basic, || base().without("shm").only_channels(&["basic"]));
channel_suite!(xth, || base()
    .without("shm")
    .only_channels(&["xth", "basic"]));
channel_suite!(cma, || base()
    .without("shm")
    .only_channels(&["cma", "basic"]));
// Every tensor by cross-memory read, however small (by default small ones go inline).
channel_suite!(cma_no_inline, "cma", || base()
    .without("shm")
    .only_channels(&["cma", "basic"])
    .cma_inline_max(0));
// A threshold inside the sizes the cases use: one message (`larger_than_rings_and_chunks`) mixes
// an inline tensor (a ticket on the control connection) and a cma one.
channel_suite!(cma_mixed, "cma", || base()
    .without("shm")
    .only_channels(&["cma", "basic"])
    .cma_inline_max(1 << 20));
channel_suite!(mpt, || base()
    .without("shm")
    .only_channels(&["mpt", "basic"])
    .lanes(3));

/// Every case over one transport and one channel on the simulated RDMA fabric, each case holding
/// the fabric for reading: the ibv suite counts the fabric's queue pairs, and must not see ours
/// come and go (`crate::ibv::SIMULATED_FABRIC`).
#[cfg(feature = "ibv")]
macro_rules! ibv_suite {
    ($name:ident, $transport:expr, $channel:expr, $builder:expr) => {
        mod $name {
            use super::*;
            cases!(hold crate::ibv::SIMULATED_FABRIC.read().await;
                $builder, $transport, $channel;
                order_of_many_ops, empty_and_one_byte, larger_than_rings_and_chunks,
                both_directions, both_directions_large, concurrent_pipes, close_mid_operation_by_writer,
                close_mid_operation_by_reader, close_with_both_directions_in_flight,
                error_reaches_every_pending_op);
        }
    };
}

// ibv on the simulated device (no machine here has an RDMA device; docs/ibv.md): the control
// stream in RDMA writes with immediate through 64 KiB inbox rings, and again with a send queue of
// depth 1, so that nearly every work request goes through the backlog.
#[cfg(feature = "ibv")]
fn ibv_sim(send_queue: u32) -> ContextBuilder {
    use actorpipe::transport::Ibv;
    base()
        .without("shm")
        .transport(Arc::new(
            Ibv::simulated()
                .with_capacity(RING)
                .with_queue_depths(send_queue, 256)
                .auto_listen("ibv://127.0.0.1:0"),
        ))
        .only_channels(&["basic"])
}
#[cfg(feature = "ibv")]
ibv_suite!(ibv_sim, "ibv", "basic", || ibv_sim(128));
#[cfg(feature = "ibv")]
ibv_suite!(ibv_sim_sq1, "ibv", "basic", || ibv_sim(1));

// The ibv channel (RDMA writes into the receiver's registered buffer) over the ibv transport,
// both on the simulated device; then with send queues of depth 1 (the channel's requests and
// chunk writes through the backlog too).
#[cfg(feature = "ibv")]
fn ibv_rdma(send_queue: u32) -> ContextBuilder {
    use actorpipe::channel::IbvChannel;
    use actorpipe::transport::Ibv;
    let ibv = Ibv::simulated()
        .with_capacity(RING)
        .with_queue_depths(send_queue, 256)
        .auto_listen("ibv://127.0.0.1:0");
    base()
        .without("shm")
        .transport(Arc::new(ibv.clone()))
        .channel(Arc::new(IbvChannel::new(ibv)))
        .only_channels(&["ibv", "basic"])
}

#[cfg(feature = "ibv")]
ibv_suite!(ibv_rdma, "ibv", "ibv", || ibv_rdma(128));
#[cfg(feature = "ibv")]
ibv_suite!(ibv_rdma_sq1, "ibv", "ibv", || ibv_rdma(1));
// The channel on three simulated devices (sim0, sim1, sim2): large tensors striped over them.
#[cfg(feature = "ibv")]
ibv_suite!(ibv_rdma_devices, "ibv", "ibv", || {
    use actorpipe::channel::IbvChannel;
    use actorpipe::transport::Ibv;
    let ibv = Ibv::simulated()
        .with_capacity(RING)
        .auto_listen("ibv://127.0.0.1:0");
    let further = vec![Ibv::simulated_device(1), Ibv::simulated_device(2)];
    base()
        .without("shm")
        .transport(Arc::new(ibv.clone()))
        .channel(Arc::new(IbvChannel::new(ibv).with_devices(further)))
        .only_channels(&["ibv", "basic"])
});
// The same lanes with their loops on I/O threads of the context's pool (`io_threads`, off by
// default), and more lanes than threads.
channel_suite!(mpt_pool, "mpt", || base()
    .without("shm")
    .only_channels(&["mpt", "basic"])
    .lanes(3)
    .io_threads(2));
channel_suite!(mpt_pool_many_lanes, "mpt", || base()
    .without("shm")
    .only_channels(&["mpt", "basic"])
    .lanes(8)
    .io_threads(3));
