//! The standing receive (`ReceiveAll`): one recipient gets every message, in order, whether the
//! read loop delivered it (self-contained) or the pipe read it (large, tensors on a channel).

use std::time::Duration;

use actix::Addr;
use actorpipe::*;
use tokio::sync::mpsc::{self, UnboundedReceiver};

use crate::common::*;

const CONFIGS: [Setup; 4] = READ_CONFIGS_SPIN;

/// Message `i` of the mixed plan: 64 B, 1 MiB, 64 B with a 1 KiB tensor, a 1 MiB tensor.
fn mixed(i: u64) -> Message {
    match i % 4 {
        0 => checked_message(i, &[64], &[]),
        1 => checked_message(i, &[1 << 20], &[]),
        2 => checked_message(i, &[64], &[1 << 10]),
        _ => checked_message(i, &[32], &[1 << 20]),
    }
}

/// Writes `messages` at once (`do_send`: an awaited `send` would wait for room in the pipe's
/// mailbox); their completions come out of the returned queue.
fn write_all(
    pipe: &Addr<Pipe>,
    messages: impl Iterator<Item = Message>,
) -> UnboundedReceiver<WriteDone> {
    let (to, done) = actorpipe::inbox::<WriteDone>();
    for m in messages {
        pipe.do_send(Write::new(m).notify(to.clone()));
    }
    done
}

/// How a stand delivers: to a recipient (an actor's mailbox), or to a handler called in place.
#[derive(Debug, Clone, Copy)]
enum How {
    Recipient,
    Handler,
}

/// Both ways, for the tests that hold for each.
const HOWS: [How; 2] = [How::Recipient, How::Handler];

/// A stand that delivers, `how` says, into a queue; the queue's end.
fn stand(how: How) -> (ReceiveAll, UnboundedReceiver<ReadDone>) {
    match how {
        How::Recipient => {
            let (to, inbox) = actorpipe::inbox::<ReadDone>();
            (ReceiveAll::to(to), inbox)
        }
        How::Handler => {
            let (tx, inbox) = mpsc::unbounded_channel();
            (
                ReceiveAll::calling(move |d| {
                    let _ = tx.send(d);
                }),
                inbox,
            )
        }
    }
}

/// A pair of pipes whose receiving side (the second) stands, delivering to the returned queue.
async fn standing(
    builder: fn() -> ContextBuilder,
    how: How,
) -> (Addr<Pipe>, Addr<Pipe>, UnboundedReceiver<ReadDone>, Server) {
    let (tx, rx, s) = pair(builder(), builder()).await;
    let (all, inbox) = stand(how);
    rx.send(all).await.unwrap().unwrap();
    (tx, rx, inbox, s)
}

/// The next `ReadDone`, within 30 s.
async fn next(inbox: &mut UnboundedReceiver<ReadDone>) -> ReadDone {
    within(30, "a ReadDone", inbox.recv())
        .await
        .expect("the inbox is alive")
}

/// Nothing more arrives (the pipe's own work is over once `Close` has answered).
async fn nothing_more(inbox: &mut UnboundedReceiver<ReadDone>, what: &str) {
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(300), inbox.recv()).await {
        panic!(
            "{what}: a ReadDone after the last one: id {} {:?}",
            d.id, d.result
        );
    }
}

/// Small and large messages, with basic tensors and tensors on channels, all written at once:
/// each arrives whole and in order, with ids in order, the small ones from the read loop.
#[actix::test]
async fn every_message_arrives_in_order_across_small_and_large() {
    for ((name, builder), how) in CONFIGS.into_iter().flat_map(|c| HOWS.map(|h| (c, h))) {
        let name = &format!("{name} {how:?}");
        let (tx, rx, inbox, _s) = standing(builder, how).await;
        arrive_in_order(name, &tx, &rx, inbox).await;
    }
}

/// Messages of one small host tensor and nothing else, which the read loop hands over with the
/// frame's bytes as the tensor's buffer (where the channel carries them with the frame): bytes,
/// tensor metadata and message metadata arrive whole on every path.
#[actix::test]
async fn lone_small_tensors_arrive_whole() {
    for ((name, builder), how) in CONFIGS.into_iter().flat_map(|c| HOWS.map(|h| (c, h))) {
        let name = &format!("{name} {how:?}");
        let (tx, rx, mut inbox, _s) = standing(builder, how).await;
        let before = rx.info().await.unwrap().received_by_read_loop;
        for (i, n) in [1usize, 64, 64, 4096].into_iter().enumerate() {
            let mut m = checked_message(i as u64, &[], &[n]);
            if i == 2 {
                m.tensors[0].target_device = Some(Device::Cpu);
            }
            tx.write(m).await.unwrap();
            let d = next(&mut inbox).await;
            d.result
                .unwrap_or_else(|e| panic!("{name}: message {i}: {e}"));
            assert_eq!(verify(&d.message), i as u64, "{name}");
            assert_eq!(d.message.tensors[0].buffer.len(), n as u64, "{name}");
        }
        // Where the channel carries small tensors on the control connection (basic; cma and
        // efa inline too, between processes), the read loop delivers them itself. In one
        // process the default and spinning contexts pick xth, and mpt sends them on its lane.
        if name.starts_with("tcp+basic") {
            let after = rx.info().await.unwrap().received_by_read_loop;
            assert!(after - before >= 3, "{name}: {before} -> {after}");
        }
    }
}

/// The same with each pipe's control loops on the runtime's own queue
/// (`ContextBuilder::loops_on_runtime`): to a recipient actor (from one scheduler to the other)
/// and to a handler, every message whole and in order.
#[actix::test]
async fn loops_on_the_runtime_queue_keep_every_message_in_order() {
    for ((name, builder), how) in CONFIGS.into_iter().flat_map(|c| HOWS.map(|h| (c, h))) {
        let name = &format!("{name} {how:?}, loops on the runtime");
        let runtime = tokio::runtime::Handle::current().metrics();
        let before = runtime.num_alive_tasks();
        let (tx, rx, s) = pair(
            builder().loops_on_runtime(true),
            builder().loops_on_runtime(true),
        )
        .await;
        // Both pipes' read and write loops are tasks of the runtime itself (a `LocalSet`'s
        // are not counted there).
        let loops = runtime.num_alive_tasks() - before;
        assert!(loops >= 4, "{name}: {loops} tasks on the runtime's queue");
        let (all, inbox) = stand(how);
        rx.send(all).await.unwrap().unwrap();
        arrive_in_order(name, &tx, &rx, inbox).await;
        drop(s);
    }
}

/// Writes the mixed plan to `tx` and checks what `rx`'s stand delivers to `inbox`.
async fn arrive_in_order(
    name: &str,
    tx: &Addr<Pipe>,
    rx: &Addr<Pipe>,
    mut inbox: UnboundedReceiver<ReadDone>,
) {
    let mut writes = write_all(tx, (0..48).map(mixed));
    let mut last_id = None;
    for i in 0..48u64 {
        let d = within(30, &format!("{name} {i}"), inbox.recv())
            .await
            .unwrap();
        d.result
            .unwrap_or_else(|e| panic!("{name}: message {i}: {e}"));
        assert_eq!(verify(&d.message), i, "{name}: order");
        assert!(last_id.is_none_or(|l| d.id > l), "{name}: ids in order");
        last_id = Some(d.id);
    }
    for _ in 0..48 {
        let w = within(30, "a write", writes.recv()).await.unwrap();
        w.result.unwrap();
    }
    let before = rx.info().await.unwrap().received_by_read_loop;
    // Written one at a time, each waiting for the one before: the other interleaving.
    for i in 48..64u64 {
        tx.write(mixed(i)).await.unwrap();
        let d = within(30, &format!("{name} {i}"), inbox.recv())
            .await
            .unwrap();
        assert_eq!(verify(&d.message), i, "{name}");
    }
    // Each 64 B message follows a delivered one: the read loop delivers it itself.
    let after = rx.info().await.unwrap().received_by_read_loop;
    assert!(after - before >= 4, "{name}: {before} -> {after}");
}

/// Messages read ahead before the stand began reach the recipient first.
#[actix::test]
async fn messages_read_ahead_go_first() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    for i in 0..3 {
        tx.write(mixed(i)).await.unwrap();
    }
    // The pipe reads descriptors ahead by itself; give it the time to.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (to, mut inbox) = actorpipe::inbox::<ReadDone>();
    rx.receive_all(to).await.unwrap();
    for i in 3..8 {
        tx.write(mixed(i)).await.unwrap();
    }
    for i in 0..8 {
        assert_eq!(verify(&next(&mut inbox).await.message), i);
    }
}

/// The peer goes away in the middle of a stream (it aborts with writes in flight, one of them
/// 16 MiB): what arrived whole arrives in order, then errors only, then nothing; no hang.
#[actix::test]
async fn peer_gone_mid_stream() {
    for ((name, builder), how) in CONFIGS.into_iter().flat_map(|c| HOWS.map(|h| (c, h))) {
        let name = &format!("{name} {how:?}");
        let (tx, rx, mut inbox, _s) = standing(builder, how).await;
        let messages = (0..40u64).map(|i| match i {
            20 => checked_message(i, &[16 << 20], &[]),
            _ => mixed(i),
        });
        let _writes = write_all(&tx, messages);
        // Wait for the first message, then abort the sender mid-stream.
        let first = next(&mut inbox).await;
        assert_eq!(verify(&first.message), 0, "{name}");
        tx.do_send(Close::because("peer death, simulated"));
        let mut expect = 1;
        let mut errors = 0;
        loop {
            let d = next(&mut inbox).await;
            match d.result {
                Ok(()) => {
                    assert_eq!(errors, 0, "{name}: a message after an error");
                    assert_eq!(verify(&d.message), expect, "{name}: order");
                    expect += 1;
                }
                Err(e) => {
                    assert!(
                        matches!(e, Error::PeerClosed { .. }),
                        "{name}: not the peer's close: {e}"
                    );
                    errors += 1;
                    if rx.info().await.unwrap().closed {
                        // The pipe failed: the error that ends the stand may follow.
                        let closed = within(10, "close", rx.close(Close::default())).await;
                        assert!(matches!(closed.unwrap().error, Error::PeerClosed { .. }));
                        while let Ok(d) = inbox.try_recv() {
                            assert!(d.result.is_err(), "{name}: success after an error");
                        }
                        break;
                    }
                }
            }
        }
        assert!(expect <= 40, "{name}");
        nothing_more(&mut inbox, name).await;
    }
}

/// Closing the pipe ends the stand with one error, then nothing.
#[actix::test]
async fn close_while_standing() {
    for how in HOWS {
        let (tx, rx, mut inbox, _s) = standing(tcp_basic, how).await;
        tx.write(mixed(0)).await.unwrap();
        assert_eq!(verify(&next(&mut inbox).await.message), 0);
        let closed = within(10, "close", rx.close(Close::because("done"))).await;
        assert!(matches!(closed.unwrap().error, Error::Closed { .. }));
        let last = next(&mut inbox).await;
        assert!(
            matches!(last.result, Err(Error::Closed { .. })),
            "{how:?}: {:?}",
            last.result
        );
        nothing_more(&mut inbox, "close").await;
        // A stand on a closed pipe is refused with its error.
        let (all, _inbox) = stand(how);
        assert!(matches!(
            rx.send(all).await.unwrap(),
            Err(Error::Closed { .. })
        ));
    }
}

/// While a stand stands, `Read`, `ReadDescriptor`, `Receive` and a second `ReceiveAll` are
/// refused; so is a stand with a read pending. The stand goes on unharmed.
#[actix::test]
async fn conflicting_reads_are_refused() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    // A pending ReadDescriptor: no stand.
    let pending = rx.send(ReadDescriptor);
    tokio::task::yield_now().await;
    let (to, mut inbox) = actorpipe::inbox::<ReadDone>();
    let pending = actix::spawn(pending);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_invalid(&rx.receive_all(to.clone()).await, "reads pending");
    tx.write(mixed(0)).await.unwrap();
    let d = within(10, "descriptor", pending).await.unwrap().unwrap();
    let got = rx
        .read(Allocation::for_descriptor(&d.descriptor.unwrap()).unwrap())
        .await
        .unwrap();
    assert_eq!(verify(&got), 0);

    rx.receive_all(to.clone()).await.unwrap();
    assert_invalid(&rx.receive_all(to).await, "while a standing receive stands");
    let refused = rx.send(Receive::new()).await.unwrap();
    assert_invalid(&refused.result, "standing receive");
    let refused = rx.send(ReadDescriptor).await.unwrap();
    assert_invalid(&refused.descriptor.map(|_| ()), "standing receive");
    let spare = Allocation::for_descriptor(&mixed(1).descriptor()).unwrap();
    let refused = rx.send(Read::new(spare)).await.unwrap();
    assert_invalid(&refused.result, "standing receive");
    assert_eq!(refused.message.payloads.len(), 1, "the buffers come back");
    for i in 1..5 {
        tx.write(mixed(i)).await.unwrap();
        assert_eq!(verify(&next(&mut inbox).await.message), i);
    }
}

/// `StopReceiving` ends the stand: the messages after it wait for a `Receive`, ids go on, and
/// a new stand can begin. Without a stand it is refused.
#[actix::test]
async fn stopping_the_stand() {
    for ((name, builder), how) in CONFIGS.into_iter().flat_map(|c| HOWS.map(|h| (c, h))) {
        let name = &format!("{name} {how:?}");
        let (tx, rx, _s) = pair(builder(), builder()).await;
        assert_invalid(&rx.stop_receiving().await.map(|_| ()), "no standing");
        let (all, mut inbox) = stand(how);
        rx.send(all).await.unwrap().unwrap();
        let mut ids = Vec::new();
        for i in 0..6 {
            tx.write(mixed(i)).await.unwrap();
            let d = next(&mut inbox).await;
            assert_eq!(verify(&d.message), i, "{name}");
            ids.push(d.id);
        }
        let through = rx.stop_receiving().await.unwrap();
        assert!(
            ids.iter().all(|id| *id < through),
            "{name}: {ids:?} {through}"
        );
        for i in 6..10 {
            let id = receive_one(name, &tx, &rx, i).await;
            assert!(id >= through, "{name}: ids go on");
        }
        nothing_more(&mut inbox, name).await;
        // Written before the stand begins again: read ahead, then delivered first.
        let _w = write_all(&tx, std::iter::once(mixed(10)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (all, again) = stand(how);
        inbox = again;
        rx.send(all).await.unwrap().unwrap();
        let _w = write_all(&tx, (11..14).map(mixed));
        for i in 10..14 {
            assert_eq!(verify(&next(&mut inbox).await.message), i, "{name}");
        }
    }
}

/// Writes messages from `tx` until `rx` has failed (or 100 were written), then closes `rx`:
/// the error its pending operations got.
async fn write_until_failed(tx: &Addr<Pipe>, rx: &Addr<Pipe>) -> Error {
    for i in 0..100 {
        if tx.write(mixed(i % 4)).await.is_err() || rx.info().await.unwrap().closed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    within(10, "close", rx.close(Close::default()))
        .await
        .unwrap()
        .error
}

/// A recipient whose actor stopped fails the pipe when the next message comes: nobody would
/// read it.
#[actix::test]
async fn a_recipient_gone_fails_the_pipe() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let (to, inbox) = actorpipe::inbox::<ReadDone>();
    rx.receive_all(to).await.unwrap();
    // The inbox actor stops at the first message it cannot pass on.
    drop(inbox);
    match write_until_failed(&tx, &rx).await {
        Error::Closed { reason, .. } => assert!(reason.contains("recipient"), "{reason}"),
        e => panic!("not the recipient's: {e}"),
    }
}

/// Buffers handed back with `Recycle` are the ones the next large message is read into: no
/// allocation per large message. The spare is told apart by its capacity (3 MiB for a 1 MiB
/// payload), which a fresh allocation would not have.
#[actix::test]
async fn recycled_buffers_take_the_next_large_message() {
    const SPARE: usize = 3 << 20;
    for ((name, builder), how) in CONFIGS.into_iter().flat_map(|c| HOWS.map(|h| (c, h))) {
        let name = &format!("{name} {how:?}");
        let (tx, rx, mut inbox, _s) = standing(builder, how).await;
        let mut spare = Vec::with_capacity(SPARE);
        spare.resize(1 << 20, 0u8);
        // Awaited: handled before the next message's frame can reach the pipe.
        rx.send(Recycle(Allocation {
            payloads: vec![spare],
            tensors: Vec::new(),
        }))
        .await
        .unwrap();
        tx.write(mixed(1)).await.unwrap();
        let d = next(&mut inbox).await;
        assert_eq!(verify(&d.message), 1, "{name}");
        assert_eq!(
            d.message.payloads[0].data.capacity(),
            SPARE,
            "{name}: the 1 MiB payload was read into the recycled buffer"
        );
        // Without a spare, the next one gets buffers of its own.
        tx.write(mixed(5)).await.unwrap();
        let d = next(&mut inbox).await;
        assert_eq!(verify(&d.message), 5, "{name}");
        assert_ne!(d.message.payloads[0].data.capacity(), SPARE, "{name}");
    }
}

/// Writes until the pipe from `tx` to `rx` has failed; the error must be `Closed`, naming a
/// handler that panicked.
async fn fails_for_its_handler(name: &str, tx: &Addr<Pipe>, rx: &Addr<Pipe>) {
    match write_until_failed(tx, rx).await {
        Error::Closed { reason, .. } => assert!(
            reason.contains("handler") && reason.contains("panicked"),
            "{name}: {reason}"
        ),
        e => panic!("{name}: not the handler's: {e}"),
    }
}

/// Writes message `i` of the mixed plan on `tx` and reads it on `rx` with a plain `Receive`:
/// it arrives whole, and the write completes. Returns the read's id.
async fn receive_one(name: &str, tx: &Addr<Pipe>, rx: &Addr<Pipe>, i: u64) -> u64 {
    // Not awaited first: an xth tensor's write completes once it is read.
    let mut w = write_all(tx, std::iter::once(mixed(i)));
    let d = within(30, "a Receive", rx.send(Receive::new()))
        .await
        .unwrap();
    d.result.unwrap();
    assert_eq!(verify(&d.message), i, "{name}");
    within(30, "a write", w.recv())
        .await
        .unwrap()
        .result
        .unwrap();
    d.id
}

/// A handler that panics fails the pipe (`Closed`, naming the handler) when the next message
/// comes, as a recipient that stopped does; the panic goes no further, and nothing hangs.
#[actix::test]
async fn a_panicking_handler_fails_the_pipe() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let (seen, mut calls) = mpsc::unbounded_channel();
    rx.receive_all_calling(move |d| {
        let _ = seen.send(d.id);
        panic!("a handler that panics (on purpose, in a test)");
    })
    .await
    .unwrap();
    fails_for_its_handler("tcp+basic", &tx, &rx).await;
    // Called once: a broken handler is not called again.
    assert!(calls.try_recv().is_ok(), "the handler was called");
    assert!(calls.try_recv().is_err(), "the handler was called again");
}

/// An actor a handler starts: it reports each number it is sent.
struct Relay(mpsc::UnboundedSender<u64>);

impl actix::Actor for Relay {
    type Context = actix::Context<Self>;
}

#[derive(actix::Message)]
#[rtype(result = "()")]
struct Seen(u64);

impl actix::Handler<Seen> for Relay {
    type Result = ();

    fn handle(&mut self, Seen(n): Seen, _: &mut Self::Context) {
        let _ = self.0.send(n);
    }
}

/// Wherever the read loop that calls a handler runs (the arbiter's `LocalSet`, or the
/// runtime's own queue: by default while a handler stands, or for good with
/// `loops_on_runtime`), the handler can spawn with `Arbiter::current().spawn`, `actix::spawn`
/// and `Actor::start` (tokio's `spawn_local` under the last two, which panics outside every
/// `LocalSet`: there the handler runs inside the thread's spare one), and every message reaches
/// what it spawned, in order.
#[actix::test]
async fn handlers_spawn_wherever_the_read_loop_runs() {
    let placements: [Setup; 3] = [
        ("following the handler (the default)", tcp_basic),
        ("on the LocalSet", || {
            tcp_basic().read_loop_follows_handler(false)
        }),
        ("loops on the runtime", || {
            tcp_basic().loops_on_runtime(true)
        }),
    ];
    for (name, b) in placements {
        for how in ["Arbiter::spawn", "actix::spawn", "Actor::start"] {
            let name = format!("{name}, {how}");
            let (tx, rx, _s) = pair(b(), b()).await;
            let (seen, mut got) = mpsc::unbounded_channel();
            rx.receive_all_calling(move |d| {
                let v = d.result.map(|_| verify(&d.message)).unwrap_or(u64::MAX);
                let seen = seen.clone();
                match how {
                    "Arbiter::spawn" => {
                        actix::Arbiter::current().spawn(async move {
                            let _ = seen.send(v);
                        });
                    }
                    "actix::spawn" => {
                        actix::spawn(async move {
                            let _ = seen.send(v);
                        });
                    }
                    _ => actix::Actor::start(Relay(seen)).do_send(Seen(v)),
                }
            })
            .await
            .unwrap();
            for i in 0..8 {
                tx.write(mixed(i)).await.unwrap();
                let v = within(10, &name, got.recv()).await.unwrap();
                assert_eq!(v, i, "{name}");
            }
            let info = rx.info().await.unwrap();
            assert!(
                info.received_by_read_loop >= 2,
                "{name}: the read loop called the handler {} times",
                info.received_by_read_loop
            );
        }
    }
}

/// Handlers that answer in place: each side's handler writes the next message through a
/// `PipeWriter`, from the read loop, for a ping-pong of small and large messages; everything
/// arrives in order, and the small ones went from the read loop straight to the handler, which
/// wrote their answer itself. The read loop that calls them has moved to the runtime's own
/// queue (it follows its handler by default).
#[actix::test]
async fn handlers_answer_in_place() {
    for (name, builder) in CONFIGS {
        let (tx, rx, _s) = pair(builder(), builder()).await;
        echo_in_place(name, &tx, &rx, true).await;
        // The stands end, and the read loop goes back to the `LocalSet` at its next message:
        // plain `Receive`s read what comes next, in order.
        for pipe in [&tx, &rx] {
            within(30, "StopReceiving", pipe.send(StopReceiving))
                .await
                .unwrap()
                .unwrap();
        }
        for i in 0..4 {
            receive_one(&format!("{name}, after the stand"), &tx, &rx, i).await;
        }
    }
}

/// The same with the read loop kept on the `LocalSet` (`read_loop_follows_handler(false)`):
/// no call is made from the runtime's queue.
#[actix::test]
async fn handlers_answer_in_place_on_the_local_set() {
    for (name, builder) in CONFIGS {
        let b = || builder().read_loop_follows_handler(false);
        let (tx, rx, _s) = pair(b(), b()).await;
        echo_in_place(&format!("{name}, on the LocalSet"), &tx, &rx, false).await;
    }
}

/// The same with the pipes' control loops on the runtime's own queue: what the option is for.
#[actix::test]
async fn handlers_answer_in_place_with_loops_on_the_runtime() {
    for (name, builder) in CONFIGS {
        let (tx, rx, _s) = pair(
            builder().loops_on_runtime(true),
            builder().loops_on_runtime(true),
        )
        .await;
        echo_in_place(&format!("{name}, loops on the runtime"), &tx, &rx, true).await;
    }
}

/// `ROUNDS` messages echoed by `rx`'s handler, each next one sent from `tx`'s handler. With
/// `on_runtime`, the read loop that calls the echo's handler must be marked as a loop on the
/// runtime's own queue (which is how a spinning loop there knows to let the actors run); else it
/// must not be.
async fn echo_in_place(name: &str, tx: &Addr<Pipe>, rx: &Addr<Pipe>, on_runtime: bool) {
    const ROUNDS: u64 = 200;
    // The echo: every message goes back as it came.
    let back = rx.writer().await.unwrap();
    let (wrote, _late) = actorpipe::inbox::<WriteDone>();
    let wrote = std::sync::Arc::new(wrote);
    let marked = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let marks = marked.clone();
    rx.receive_all_calling(move |d| {
        if actorpipe::internal::transport::turns::is_on_runtime_queue() {
            marks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if d.result.is_ok() {
            let _ = back.write(Write::new(d.message), &wrote);
        }
    })
    .await
    .unwrap();
    // The client: checks each echo and sends the next message from its handler.
    let out = tx.writer().await.unwrap();
    let (wrote, _late) = actorpipe::inbox::<WriteDone>();
    let wrote = std::sync::Arc::new(wrote);
    let (done, mut finished) = mpsc::unbounded_channel();
    let mut expect = 0;
    let first = out.clone();
    tx.receive_all_calling(move |d| {
        let got = d.result.as_ref().map(|_| verify(&d.message));
        if !matches!(got, Ok(i) if i == expect) {
            let _ = done.send(Err(format!("echo {expect}: {got:?}")));
            return;
        }
        expect += 1;
        if expect == ROUNDS {
            let _ = done.send(Ok(()));
            return;
        }
        let _ = out.write(Write::new(mixed(expect)), &wrote);
    })
    .await
    .unwrap();
    let _ = first.write(
        Write::new(mixed(0)),
        &std::sync::Arc::new(actorpipe::inbox::<WriteDone>().0),
    );
    within(60, name, finished.recv())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let (echo, client) = (rx.info().await.unwrap(), tx.info().await.unwrap());
    let marked = marked.load(std::sync::atomic::Ordering::Relaxed);
    match on_runtime {
        // The read loop's calls: the small messages, at least.
        true => assert!(
            marked >= echo.received_by_read_loop,
            "{name}: {marked} handler calls marked on the runtime's queue, {} by the read loop",
            echo.received_by_read_loop
        ),
        false => assert_eq!(marked, 0, "{name}: calls marked on the runtime's queue"),
    }
    // Half the messages are 64 B payloads, read with their frame and written back at once.
    for (side, info) in [("echo", &echo), ("client", &client)] {
        assert!(
            info.received_by_read_loop >= ROUNDS / 4,
            "{name}: {side} read loop delivered {}",
            info.received_by_read_loop
        );
        assert!(
            info.written_by_caller >= ROUNDS / 8,
            "{name}: {side} wrote {} itself",
            info.written_by_caller
        );
    }
}

/// A handler the pipe calls (a message with a tensor on a channel, which the pipe reads) that
/// writes several messages, large and small, through a `PipeWriter`: the pipe takes those in
/// once the handler returns, not through its mailbox (`Pipe::writers_inside`), and they arrive
/// in the order written, a small one never ahead of a large one written before it.
#[actix::test]
async fn handler_bursts_written_from_the_pipe_arrive_in_order() {
    const ASKS: u64 = 12;
    const EACH: u64 = 3;
    for (name, builder) in CONFIGS {
        let (tx, rx, _s) = pair(builder(), builder()).await;
        let back = rx.writer().await.unwrap();
        let (wrote, _late) = actorpipe::inbox::<WriteDone>();
        let wrote = std::sync::Arc::new(wrote);
        rx.receive_all_calling(move |d| {
            let Ok(()) = d.result else { return };
            let k = verify(&d.message);
            for j in 0..EACH {
                // Large (1 MiB payload), small, large tensor: each after the last.
                let _ = back.write(Write::new(mixed(k * EACH + j)), &wrote);
            }
        })
        .await
        .unwrap();
        let (all, mut inbox) = stand(How::Recipient);
        tx.send(all).await.unwrap().unwrap();
        // Each ask has a 1 MiB tensor: the pipe reads it, and calls the handler itself.
        let _done = write_all(
            &tx,
            (0..ASKS).map(|i| checked_message(i, &[16], &[1 << 20])),
        );
        for want in 0..ASKS * EACH {
            let d = next(&mut inbox).await;
            let got = d.result.as_ref().map(|_| verify(&d.message));
            assert!(
                matches!(got, Ok(i) if i == want),
                "{name}: message {want} expected, got {got:?}"
            );
        }
        nothing_more(&mut inbox, name).await;
    }
}
