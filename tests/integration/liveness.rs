//! Graceful close versus abort, and per-operation deadlines.

use std::time::Duration;

use actorpipe::*;

use crate::common::*;

#[actix::test]
async fn graceful_close_drains_writes_and_the_peer_can_tell() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    for i in 0..3 {
        let m = checked_message(i, &[10], &[4 << 20]);
        tx.do_send(Write::new(m).notify(done_to.clone()));
    }
    let closing = tx.send(Close::graceful("shift over"));
    // A write issued after the close is refused (in order, after the earlier ones, which
    // the pipe still drains).
    let late = tx.send(Write::new(checked_message(9, &[], &[1])));
    // The reader takes its time: the close waits for it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..3 {
        assert_eq!(verify(&within(20, "read", read_one(&rx)).await.unwrap()), i);
    }
    let late = within(20, "late write", late).await.unwrap();
    assert!(
        matches!(late.result, Err(Error::Closed { .. })),
        "{:?}",
        late.result
    );
    for i in 0..3 {
        let d = within(20, "write", done.recv()).await.unwrap();
        assert_eq!(d.id, i);
        d.result.expect("drained writes succeed");
    }
    let closed = within(20, "graceful close", closing).await.unwrap();
    assert_eq!(closed.error.class(), "closed");
    match within(20, "next descriptor", rx.send(ReadDescriptor))
        .await
        .unwrap()
        .descriptor
    {
        Err(Error::PeerClosed {
            graceful, reason, ..
        }) => {
            assert!(graceful, "the peer can tell a graceful close");
            assert!(reason.contains("shift over"), "{reason}");
        }
        other => panic!("expected PeerClosed, got {other:?}"),
    }
}

#[actix::test]
async fn abort_is_not_graceful() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    tx.send(Close::because("abort")).await.unwrap();
    match within(20, "descriptor", rx.send(ReadDescriptor))
        .await
        .unwrap()
        .descriptor
    {
        Err(Error::PeerClosed { graceful, .. }) => assert!(!graceful),
        other => panic!("expected PeerClosed, got {other:?}"),
    }
}

/// Writes to a receiver that never reads miss their deadline: the pipe closes with a timeout,
/// and every pending operation completes with it, in order, with its buffers.
#[actix::test]
async fn a_missed_deadline_closes_the_pipe_with_a_timeout() {
    let (tx, _rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    for i in 0..3u8 {
        let m = Message::new().with_tensor(Tensor::cpu(vec![i; 32 << 20]));
        tx.do_send(
            Write::new(m)
                .within(Duration::from_millis(300))
                .notify(done_to.clone()),
        );
    }
    for i in 0..3 {
        let d = within(10, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i);
        assert_eq!(d.message.tensors[0].buffer.len(), 32 << 20);
        match d.result {
            Err(Error::Timeout { after, .. }) => assert_eq!(after, Duration::from_millis(300)),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    assert!(tx.send(GetInfo).await.unwrap().closed);
}

/// A deadline that is met changes nothing.
#[actix::test]
async fn a_met_deadline_is_harmless() {
    let (tx, rx, _s) = pair(Context::builder(), Context::builder()).await;
    let w = tx.send(Write::new(checked_message(1, &[3], &[5000])).within(Duration::from_secs(5)));
    let d = rx.send(ReadDescriptor).await.unwrap().descriptor.unwrap();
    let r = rx
        .send(Read::new(Allocation::for_descriptor(&d).unwrap()).within(Duration::from_secs(5)))
        .await
        .unwrap();
    r.result.unwrap();
    assert_eq!(verify(&r.message), 1);
    w.await.unwrap().result.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!tx.send(GetInfo).await.unwrap().closed);
}

/// The heartbeat timeout of the test below: short, so that it waits out more than a timeout of
/// silence quickly, and long enough that a loaded 2-core machine holding a thread off the CPU
/// (hundreds of milliseconds at worst seen) does not pass for it.
const BEAT_TIMEOUT: Duration = Duration::from_secs(2);

/// Short heartbeats, so that the test below runs more than a timeout's worth of silence quickly.
fn beating(b: ContextBuilder) -> ContextBuilder {
    b.keepalive(Duration::from_millis(250), BEAT_TIMEOUT)
}

/// Every transport and channel two contexts of one process can pick.
type Named = (&'static str, fn() -> ContextBuilder);

fn heartbeat_backends() -> [Named; 5] {
    [
        ("tcp+basic", tcp_basic),
        ("shm+basic", || Context::builder().only_channels(&["basic"])),
        ("tcp+mpt", || {
            Context::builder()
                .without("shm")
                .only_channels(&["mpt", "basic"])
                .lanes(2)
        }),
        ("shm+cma", || {
            Context::builder().only_channels(&["cma", "basic"])
        }),
        ("default (xth)", Context::builder),
    ]
}

/// An idle pipe stays open through more than a heartbeat timeout (the pings keep it alive), and a
/// receiver whose application stops reading, with megabytes stuck in flight, is not declared
/// dead either: only a wait for bytes counts as silence. The backends run at once, each with
/// its own pair.
#[actix::test]
async fn heartbeats_keep_idle_and_stalled_pipes_alive() {
    const SIZE: usize = 16 << 20;
    let quiet = BEAT_TIMEOUT * 3 / 2;
    let trials: Vec<_> = heartbeat_backends()
        .into_iter()
        .map(|(name, b)| {
            tokio::task::spawn_local(async move {
                let (tx, rx, _s) = pair(beating(b()), beating(b())).await;
                // Idle: longer than a timeout without a message either way.
                tokio::time::sleep(quiet).await;
                assert!(!tx.send(GetInfo).await.unwrap().closed, "{name}: idle pipe");
                assert!(!rx.send(GetInfo).await.unwrap().closed, "{name}: idle pipe");
                // Stalled: more than the socket buffers can hold, and nobody reads for longer
                // than a timeout.
                let (done_to, mut done) = inbox::<WriteDone>();
                for i in 0..4 {
                    tx.do_send(
                        Write::new(checked_message(i, &[16], &[SIZE])).notify(done_to.clone()),
                    );
                }
                tokio::time::sleep(quiet).await;
                for i in 0..4 {
                    let m = within(20, "read after the stall", read_one(&rx))
                        .await
                        .unwrap_or_else(|e| panic!("{name}: read {i} after the stall: {e}"));
                    assert_eq!(verify(&m), i, "{name}");
                }
                for i in 0..4 {
                    let d = within(20, "write", done.recv()).await.unwrap();
                    assert_eq!(d.id, i);
                    d.result
                        .unwrap_or_else(|e| panic!("{name}: write {i} after the stall: {e}"));
                }
                assert!(!tx.send(GetInfo).await.unwrap().closed, "{name}");
            })
        })
        .collect();
    for t in trials {
        if let Err(e) = t.await {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}
