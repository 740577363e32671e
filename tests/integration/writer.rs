//! `PipeWriter`: small messages written from the caller's task, everything else through the
//! pipe, one order for both.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Addr, Recipient};
use actorpipe::*;

use crate::common::*;

/// The default pipe (shm and, in one process, xth; cma's small tensors inline) and tcp + basic.
const CONFIGS: [Setup; 2] = [("default", Context::builder), ("tcp+basic", tcp_basic)];

/// What became of the writes of a test: the completions returned by `write`, and those the
/// pipe sent to the recipient, by write index.
struct Outcomes {
    done: Vec<Option<WriteDone>>,
    direct: usize,
}

impl Outcomes {
    fn new(n: usize) -> Outcomes {
        Outcomes {
            done: (0..n).map(|_| None).collect(),
            direct: 0,
        }
    }

    /// Records write `i`'s completion, returned by `write` if `Some`.
    fn returned(&mut self, i: usize, done: Option<WriteDone>) {
        if let Some(d) = done {
            self.direct += 1;
            self.put(i, d);
        }
    }

    fn put(&mut self, i: usize, d: WriteDone) {
        assert!(self.done[i].is_none(), "write {i} completed twice");
        self.done[i] = Some(d);
    }

    /// Takes the completions the pipe sent to the recipient: they come in issue order, and fill
    /// exactly the writes that did not complete at once.
    async fn collect(&mut self, rx: &mut tokio::sync::mpsc::UnboundedReceiver<WriteDone>) {
        let mut last = None;
        for i in 0..self.done.len() {
            if self.done[i].is_some() {
                continue;
            }
            let d = within(30, "a WriteDone from the pipe", rx.recv())
                .await
                .expect("inbox alive");
            if let Some(last) = last {
                assert!(d.id > last, "WriteDone {} after {last}", d.id);
            }
            last = Some(d.id);
            self.put(i, d);
        }
        // (`None`: every recipient is gone, and the inbox with them.)
        if let Ok(Some(extra)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
            panic!("a completion for no write: {} {:?}", extra.id, extra.result);
        }
    }

    /// Every write has one completion; ids follow issue order; the buffers came back; and the
    /// results are a run of `Ok` then only errors (one clean cut). Returns how many succeeded.
    fn check(&self, what: &str) -> usize {
        let mut ok = 0;
        let mut last_id = None;
        for (i, d) in self.done.iter().enumerate() {
            let d = d
                .as_ref()
                .unwrap_or_else(|| panic!("{what}: write {i} never completed"));
            if let Some(last) = last_id {
                assert!(
                    d.id > last,
                    "{what}: write {i} has id {} after {last}",
                    d.id
                );
            }
            last_id = Some(d.id);
            assert_eq!(verify(&d.message), i as u64, "{what}: write {i}'s buffers");
            if d.result.is_ok() {
                assert_eq!(ok, i, "{what}: write {i} succeeded after a failure");
                ok += 1;
            }
        }
        ok
    }
}

/// The shapes of a write: small ones a writer writes itself, and ones it must leave to the
/// pipe (a large payload, a large tensor that the channel carries, an empty tensor, too many
/// pieces for one vectored write).
fn shape(i: u64) -> (Vec<usize>, Vec<usize>) {
    match i % 7 {
        0 | 1 | 3 => (vec![64], vec![]),
        2 => (vec![100, 3000], vec![64]),
        4 => (vec![200_000], vec![]),
        5 => (vec![10], vec![1 << 20, 0]),
        _ => (vec![1; 20], vec![]),
    }
}

/// A connected pair over `builder`'s contexts (writing side, reading side), the writing side's
/// writer, and an inbox for the completions the writer leaves to the pipe; keep the server.
async fn writing(
    builder: fn() -> ContextBuilder,
) -> (
    Addr<Pipe>,
    Addr<Pipe>,
    PipeWriter,
    Arc<Recipient<WriteDone>>,
    tokio::sync::mpsc::UnboundedReceiver<WriteDone>,
    Server,
) {
    let (tx, rx, server) = pair(builder(), builder()).await;
    let writer = tx.send(GetWriter).await.unwrap();
    let (to, completions) = inbox::<WriteDone>();
    (tx, rx, writer, Arc::new(to), completions, server)
}

async fn receive_all(rx: &Addr<Pipe>, n: u64, what: &str) {
    receive_range(rx, 0, n, what).await
}

/// Receives messages `from..to` (checked, in order) on `rx`.
async fn receive_range(rx: &Addr<Pipe>, from: u64, to: u64, what: &str) {
    let mut spare = Allocation::default();
    for i in from..to {
        let done = within(30, "a Receive", rx.send(Receive::reusing(spare)))
            .await
            .unwrap();
        done.result
            .unwrap_or_else(|e| panic!("{what}: message {i}: {e}"));
        assert_eq!(verify(&done.message), i, "{what}: message {i} out of order");
        spare = Allocation::from(done.message);
    }
}

/// Writes through a writer, mixing those it writes itself with those it hands to the pipe,
/// arrive in issue order, complete in issue order with their buffers, and the small ones were
/// written by the caller.
#[actix::test]
async fn direct_and_handed_over_writes_keep_one_order() {
    for (name, builder) in CONFIGS {
        let (tx, rx, writer, to, mut completions, _keep) = writing(builder).await;
        const N: u64 = 140;
        let reader = actix::spawn({
            let rx = rx.clone();
            async move { receive_all(&rx, N, name).await }
        });
        let mut out = Outcomes::new(N as usize);
        for i in 0..N {
            let (p, t) = shape(i);
            let done = writer.write(Write::new(checked_message(i, &p, &t)), &to);
            out.returned(i as usize, done);
            if i % 10 == 9 {
                // Let the pipe complete what it holds, so that later small writes go direct.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        out.collect(&mut completions).await;
        assert_eq!(out.check(name), N as usize, "{name}: every write succeeded");
        within(30, "the reader", reader).await.unwrap();
        let info = tx.send(GetInfo).await.unwrap();
        assert_eq!(info.written_by_caller, out.direct as u64, "{name}");
        assert!(out.direct > 0, "{name}: no write went direct");
        assert!(out.direct < N as usize, "{name}: every write went direct");
    }
}

/// Writes sent to the pipe's address and through a writer interleave in the order the pipe
/// took them in: a writer's write waits behind a `Write` the pipe holds.
#[actix::test]
async fn a_writer_waits_behind_writes_sent_to_the_address() {
    let (tx, rx, writer, to, mut completions, _keep) = writing(tcp_basic).await;
    const N: u64 = 60;
    let mut out = Outcomes::new(N as usize);
    let mut awaited = Vec::new();
    // The large tensors need a reader: they complete once written to the stream.
    let reader = actix::spawn({
        let rx = rx.clone();
        async move { receive_all(&rx, N, "mixed").await }
    });
    for i in 0..N {
        if i % 3 == 0 {
            // A large one the pipe holds until its tensor is written: the writer's next writes
            // must go behind it.
            let (p, t) = if i % 2 == 0 {
                (vec![64], vec![2 << 20])
            } else {
                (vec![64], vec![])
            };
            let w = tx.send(Write::new(checked_message(i, &p, &t)));
            // Issued once the pipe has handled it (awaiting the send's answer would also wait
            // for its completion): a GetInfo behind it in the mailbox says it has been.
            tx.send(GetInfo).await.unwrap();
            awaited.push((i as usize, w));
        } else {
            let done = writer.write(Write::new(checked_message(i, &[64], &[16])), &to);
            out.returned(i as usize, done);
        }
    }
    for (i, w) in awaited {
        let d = within(30, "an awaited write", w).await.unwrap();
        out.put(i, d);
    }
    out.collect(&mut completions).await;
    assert_eq!(out.check("mixed"), N as usize);
    within(30, "the reader", reader).await.unwrap();
}

/// A receiver that does not read fills the stream: the writer's writes then go to the pipe
/// (the stream would block, or takes part of a message), and stay in order behind the ones it
/// wrote itself; once the receiver reads, everything arrives and completes in order. Then the
/// same again with the receiver reading meanwhile, so that the stream fills and drains over and
/// over (and the writer writes part of a message now and then, which the pipe completes).
#[actix::test]
async fn a_full_stream_sends_writes_through_the_pipe_in_order() {
    for (name, builder) in CONFIGS {
        let (_tx, rx, writer, to, mut completions, _keep) = writing(builder).await;
        // 16 KiB messages (the most a writer writes itself), 48 MiB per phase: more than any
        // socket buffer or ring holds.
        const N: u64 = 3000;
        let message = |i: u64| {
            let (p, t): (&[usize], &[usize]) = match i % 3 {
                0 => (&[16 << 10], &[]),
                1 => (&[8 << 10], &[8 << 10]),
                _ => (&[4 << 10, 4 << 10], &[4 << 10, 4 << 10]),
            };
            Write::new(checked_message(i, p, t))
        };
        let mut out = Outcomes::new(2 * N as usize);
        let mut handed = 0;
        for i in 0..N {
            let done = writer.write(message(i), &to);
            if done.is_none() {
                handed += 1;
            }
            out.returned(i as usize, done);
            if i % 50 == 0 {
                // Let the pipe's thread run its loops (and the reader's prefetch fill up).
                tokio::task::yield_now().await;
            }
        }
        assert!(handed > 0, "{name}: the stream never filled up");
        assert!(out.direct > 0, "{name}: no write went direct");
        let reader = actix::spawn({
            let rx = rx.clone();
            async move { receive_all(&rx, 2 * N, name).await }
        });
        for i in N..2 * N {
            out.returned(i as usize, writer.write(message(i), &to));
            if i % 20 == 0 {
                tokio::task::yield_now().await;
            }
        }
        out.collect(&mut completions).await;
        assert_eq!(out.check(name), 2 * N as usize);
        within(60, "the reader", reader).await.unwrap();
    }
}

/// How a racing writer's pipe ends.
#[derive(Clone, Copy, Debug)]
enum End {
    /// The writing side closes its pipe.
    Close,
    /// The reading side closes: the writer's peer goes away.
    PeerCloses,
    /// The reading side's whole context is stopped (its arbiter thread ends).
    PeerStops,
}

/// A writer on a plain thread (no actix, no tokio runtime) writes as fast as it can while the
/// pipe closes or its peer goes away, and on after the pipe has closed: every write completes
/// once, in issue order, with its buffers; the ones that fail come after every one that
/// succeeded (at least every one the reader read, and not the last ones).
#[actix::test]
async fn a_writer_on_another_thread_races_the_end_of_its_pipe() {
    for end in [End::Close, End::PeerCloses, End::PeerStops] {
        for (name, builder) in CONFIGS {
            let what = format!("{name}, {end:?}");
            let peer = actix::Arbiter::new();
            let (tx, rx, _s) = match end {
                End::PeerStops => {
                    // The server's context runs on an arbiter of its own, stopped below.
                    let ctx = builder().start_in(&peer.handle());
                    let (r, mut accepted) = inbox::<Accepted>();
                    let l = ctx
                        .send(Listen::new(["tcp://127.0.0.1:0"], r))
                        .await
                        .unwrap()
                        .expect("listen");
                    let c = builder().start();
                    let tx = (c.send(Connect::new(&l.urls[0])).await.unwrap()).expect("connect");
                    let rx = within(10, "accepting", accepted.recv()).await.unwrap().pipe;
                    (tx, rx, None)
                }
                _ => {
                    let (tx, rx, s) = pair(builder(), builder()).await;
                    (tx, rx, Some(s))
                }
            };
            let writer = tx.send(GetWriter).await.unwrap();
            let (to, mut completions) = inbox::<WriteDone>();
            let to: Arc<Recipient<WriteDone>> = Arc::new(to);
            let (closed_to, mut closed) = inbox::<Closed>();
            tx.do_send(Subscribe(closed_to));
            let ended = Arc::new(AtomicBool::new(false));
            let thread = std::thread::spawn({
                let (ended, to) = (ended.clone(), to.clone());
                move || {
                    let mut returned = Vec::new();
                    let mut after = 0;
                    // (A bound, in case the pipe never closed: the test then fails below.)
                    for i in 0..2_000_000u64 {
                        if ended.load(Ordering::Relaxed) {
                            after += 1;
                            if after > 200 {
                                break;
                            }
                        }
                        let m = checked_message(i, &[64], &[32]);
                        let done = writer.write(Write::new(m), &to);
                        if done.is_none() {
                            // Handed to the pipe: let it keep up.
                            std::thread::sleep(Duration::from_micros(20));
                        }
                        returned.push(done);
                    }
                    returned
                }
            });
            // Read some, then end the pipe while the thread writes.
            let read = 300;
            receive_all(&rx, read, &what).await;
            match end {
                End::Close => tx.do_send(Close::because("the test ends it")),
                End::PeerCloses => rx.do_send(Close::because("the test ends it")),
                End::PeerStops => {
                    peer.stop();
                }
            }
            // The writing side has closed; the thread writes on a little.
            let bye = within(30, "the writing side's Closed", closed.recv()).await;
            assert!(bye.is_some(), "{what}");
            ended.store(true, Ordering::Relaxed);
            let returned = within(30, "the writing thread", async {
                loop {
                    if thread.is_finished() {
                        break thread.join().expect("the writing thread panicked");
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            let mut out = Outcomes::new(returned.len());
            for (i, d) in returned.into_iter().enumerate() {
                out.returned(i, d);
            }
            out.collect(&mut completions).await;
            let ok = out.check(&what);
            assert!(ok >= read as usize, "{what}: {ok} succeeded, {read} read");
            assert!(
                ok + 200 <= out.done.len(),
                "{what}: a write after the close succeeded"
            );
            let info = tx.send(GetInfo).await.unwrap();
            assert!(info.closed, "{what}");
        }
    }
}

/// A writer used from an actor's task on another arbiter writes in order with the pipe's own
/// writes, and goes direct there too.
#[actix::test]
async fn a_writer_works_from_another_arbiter() {
    for (name, builder) in CONFIGS {
        let (_tx, rx, writer, to, mut completions, _keep) = writing(builder).await;
        const N: u64 = 200;
        let other = actix::Arbiter::new();
        let (back_tx, back_rx) = tokio::sync::oneshot::channel();
        other.spawn(async move {
            let mut returned = Vec::new();
            for i in 0..N {
                let (p, t) = shape(i);
                returned.push(writer.write(Write::new(checked_message(i, &p, &t)), &to));
                if i % 10 == 9 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            let _ = back_tx.send(returned);
        });
        receive_all(&rx, N, name).await;
        let returned = within(30, "the other arbiter", back_rx).await.unwrap();
        let mut out = Outcomes::new(N as usize);
        for (i, d) in returned.into_iter().enumerate() {
            out.returned(i, d);
        }
        out.collect(&mut completions).await;
        assert_eq!(out.check(name), N as usize);
        assert!(
            out.direct > 0,
            "{name}: no write went direct from the other arbiter"
        );
        other.stop();
    }
}

/// A writer of a closed pipe writes nothing itself: its writes fail with the pipe's error, in
/// order, with their buffers.
#[actix::test]
async fn a_writer_of_a_closed_pipe_hands_everything_to_it() {
    let (tx, _rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let writer = tx.send(GetWriter).await.unwrap();
    let closed = tx.send(Close::because("done")).await.unwrap();
    assert!(matches!(closed.error, Error::Closed { .. }));
    let (to, mut completions) = inbox::<WriteDone>();
    let to = Arc::new(to);
    let mut out = Outcomes::new(20);
    for i in 0..20 {
        let done = writer.write(Write::new(checked_message(i, &[64], &[])), &to);
        assert!(done.is_none(), "write {i} went direct on a closed pipe");
        out.returned(i as usize, done);
    }
    out.collect(&mut completions).await;
    assert_eq!(out.check("closed"), 0);
    for d in out.done.iter().flatten() {
        assert!(
            matches!(d.result, Err(Error::Closed { .. })),
            "{:?}",
            d.result
        );
    }
}

/// A deadline travels with a write the writer hands to the pipe: to a receiver that never
/// reads, the large writes miss it, the pipe closes with a timeout, and every write behind them
/// (the small ones too, which could not go direct behind them) fails with it, in order, with its
/// buffers.
#[actix::test]
async fn a_handed_over_write_keeps_its_deadline() {
    let (_tx, _rx, writer, to, mut completions, _keep) = writing(tcp_basic).await;
    let mut out = Outcomes::new(6);
    for i in 0..6u64 {
        let tensors: &[usize] = if i < 3 { &[32 << 20] } else { &[16] };
        let op = Write::new(checked_message(i, &[8], tensors)).within(Duration::from_millis(300));
        let done = writer.write(op, &to);
        assert!(done.is_none(), "write {i} went direct behind a pending one");
        out.returned(i as usize, done);
    }
    out.collect(&mut completions).await;
    assert_eq!(out.check("deadline"), 0);
    for d in out.done.iter().flatten() {
        match &d.result {
            Err(Error::Timeout { after, .. }) => assert_eq!(*after, Duration::from_millis(300)),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}

/// A write the writer could write only in part (the stream filled up under it) keeps its
/// deadline: with the peer reading nothing, it fails the pipe with a timeout instead of waiting
/// for ever. The first writes the stream cannot take whole may still complete once the peer's
/// read loop has read ahead; the writes go on until one is stuck for good.
#[actix::test]
async fn a_partly_written_write_keeps_its_deadline() {
    for (what, builder) in CONFIGS {
        let (_tx, _rx, writer, to, mut completions, _keep) = writing(builder).await;
        let deadline = Duration::from_millis(300);
        let mut timed_out = None;
        // At most 1 GiB of 16000-byte payloads: the stream (a socket or a 2 MiB ring) fills long
        // before that, and the peer's read loop stops reading ahead at 16 descriptors.
        for i in 0..65_536u64 {
            let op = Write::new(checked_message(i, &[16_000], &[])).within(deadline);
            let done = match writer.write(op, &to) {
                Some(done) => done,
                None => within(30, "a handed-over write's WriteDone", completions.recv())
                    .await
                    .expect("inbox alive"),
            };
            assert_eq!(verify(&done.message), i, "{what}: write {i}'s buffers");
            if let Err(e) = done.result {
                timed_out = Some((i, e));
                break;
            }
        }
        let (i, e) = timed_out.unwrap_or_else(|| panic!("{what}: no write was ever stuck"));
        match e {
            Error::Timeout { after, .. } => assert_eq!(after, deadline, "{what}: write {i}"),
            other => panic!("{what}: write {i}: expected a timeout, got {other:?}"),
        }
    }
}

/// Once the writes handed to the pipe have completed, the writer writes by itself again: the
/// ledger's count of writes the pipe holds goes back to 0 after each hand-over (a large
/// message, and a small write behind it).
#[actix::test]
async fn the_writer_writes_again_after_each_hand_over() {
    for (name, builder) in CONFIGS {
        let (tx, rx, writer, to, mut completions, _keep) = writing(builder).await;
        let small = |i| Write::new(checked_message(i, &[64], &[]));
        let mut i = 0u64;
        for round in 0..3 {
            // Hand-overs: a large payload, then a small write behind it.
            let large = Write::new(checked_message(i, &[200_000], &[1 << 20]));
            assert!(
                writer.write(large, &to).is_none(),
                "{name}: a large write went direct"
            );
            assert!(
                writer.write(small(i + 1), &to).is_none(),
                "{name}: overtook"
            );
            // Read first: over xth and cma a write completes only once the peer has read it.
            receive_range(&rx, i, i + 2, name).await;
            for j in [i, i + 1] {
                let d = within(30, "a handed-over WriteDone", completions.recv())
                    .await
                    .expect("inbox alive");
                d.result
                    .unwrap_or_else(|e| panic!("{name}: write {j}: {e}"));
                assert_eq!(verify(&d.message), j, "{name}: write {j}'s buffers");
            }
            // Nothing is pending and the peer has read everything: the next one goes direct.
            let d = writer.write(small(i + 2), &to);
            let d = d.unwrap_or_else(|| panic!("{name}: round {round}: handed over, not direct"));
            d.result.unwrap();
            receive_range(&rx, i + 2, i + 3, name).await;
            i += 3;
        }
        let info = tx.send(GetInfo).await.unwrap();
        assert_eq!(info.written_by_caller, 3, "{name}");
    }
}

/// A write over the writing side's limits goes to the pipe, which refuses it alone and in
/// order (LimitExceeded, its buffers back), whichever limit it is over: the metadata limit
/// with the others roomy (the writer then checks that one only), and each count and size limit
/// set low. The writes within the limits, before and after it, arrive.
#[actix::test]
async fn a_writer_leaves_writes_over_the_limits_to_the_pipe() {
    let small = |i| checked_message(i, &[64], &[16]);
    let metadata = |m: &Message| {
        m.metadata.len()
            + m.payloads.iter().map(|p| p.metadata.len()).sum::<usize>()
            + m.tensors.iter().map(|t| t.metadata.len()).sum::<usize>()
    };
    let most = metadata(&small(0)).max(metadata(&small(2))) as u64;
    let more_metadata = checked_message(1, &[64, 64, 64], &[]);
    assert!(metadata(&more_metadata) as u64 > most);
    let d = Limits::default;
    let cases = [
        (
            Limits {
                max_metadata_size: most,
                ..d()
            },
            more_metadata,
            "metadata size",
        ),
        (
            Limits {
                max_payloads: 2,
                ..d()
            },
            checked_message(1, &[8, 8, 8], &[]),
            "payload count",
        ),
        (
            Limits {
                max_payload_size: 100,
                ..d()
            },
            checked_message(1, &[200], &[]),
            "payload size",
        ),
        (
            Limits {
                max_tensors: 1,
                ..d()
            },
            checked_message(1, &[8], &[16, 16]),
            "tensor count",
        ),
        (
            Limits {
                max_tensor_size: 32,
                ..d()
            },
            checked_message(1, &[8], &[64]),
            "tensor size",
        ),
    ];
    for (limits, over, limit) in cases {
        let (tx, rx, _keep) = pair(tcp_basic().limits(limits), tcp_basic()).await;
        let writer = tx.send(GetWriter).await.unwrap();
        let (to, mut completions) = inbox::<WriteDone>();
        let to = Arc::new(to);
        let mut out = Outcomes::new(3);
        out.returned(0, writer.write(Write::new(small(0)), &to));
        let done = writer.write(Write::new(over), &to);
        assert!(done.is_none(), "{limit}: written direct");
        out.returned(2, writer.write(Write::new(small(2)), &to));
        out.collect(&mut completions).await;
        let [first, refused, last] = &out.done[..] else {
            unreachable!("three writes")
        };
        first.as_ref().unwrap().result.as_ref().unwrap();
        let refused = refused.as_ref().unwrap();
        match &refused.result {
            Err(Error::LimitExceeded { limit: l, .. }) => assert_eq!(*l, limit),
            other => panic!("{limit}: expected LimitExceeded, got {other:?}"),
        }
        assert_eq!(verify(&refused.message), 1, "{limit}: its buffers");
        last.as_ref().unwrap().result.as_ref().unwrap();
        assert_eq!(verify(&read_one(&rx).await.unwrap()), 0, "{limit}");
        assert_eq!(verify(&read_one(&rx).await.unwrap()), 2, "{limit}");
    }
}
