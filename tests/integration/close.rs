//! Closing: locally, by the peer, mid-transfer in both directions, and by dropping the pipe.
//! Every pending operation completes with the error, in order, with its buffers; subscribers get
//! `Closed`.

use actix::Addr;
use actorpipe::*;

use crate::common::*;

fn big_message(i: u64, size: usize) -> Message {
    Message::new()
        .with_metadata(i.to_le_bytes().to_vec())
        .with_tensor(Tensor::cpu(vec![i as u8; size]))
}

async fn subscribe(pipe: &Addr<Pipe>) -> tokio::sync::mpsc::UnboundedReceiver<Closed> {
    let (to, rx) = inbox::<Closed>();
    pipe.send(Subscribe(to)).await.unwrap();
    rx
}

/// Writes stuck behind a receiver that does not read are all failed by a local Close, in
/// order, with their buffers; the receiver's pending read fails with PeerClosed.
#[actix::test]
async fn local_close_fails_pending_writes_in_order_with_their_buffers() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let mut tx_closed = subscribe(&tx).await;
    let mut rx_closed = subscribe(&rx).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    for i in 0..6 {
        tx.do_send(Write::new(big_message(i, 32 << 20)).notify(done_to.clone()));
    }
    // The receiver takes the first descriptor and starts reading it, then stalls on the rest.
    let d = within(10, "descriptor", rx.send(ReadDescriptor))
        .await
        .unwrap();
    let alloc = Allocation::for_descriptor(&d.descriptor.unwrap()).unwrap();
    let pending_read = rx.send(Read::new(alloc));
    let pending_desc = rx.send(ReadDescriptor);

    let closed = within(10, "close", tx.send(Close::because("test over")))
        .await
        .unwrap();
    assert!(
        matches!(closed.error, Error::Closed { .. }),
        "{:?}",
        closed.error
    );
    let mut failed = false;
    for i in 0..6 {
        let d = within(10, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i, "in order");
        assert_eq!(d.message.metadata, i.to_le_bytes().to_vec());
        assert_eq!(
            d.message.tensors[0].buffer.len(),
            32 << 20,
            "buffer handed back"
        );
        match d.result {
            Ok(()) => assert!(!failed, "no success after a failure"),
            Err(e) => {
                failed = true;
                assert!(matches!(e, Error::Closed { .. }), "{e}");
            }
        }
    }
    assert!(
        failed,
        "6 x 32 MiB cannot all be written while the peer does not read"
    );
    let c = within(10, "Closed", tx_closed.recv()).await.unwrap();
    assert_eq!(c.error.class(), "closed");

    // The receiver: its read dies with the connection, its descriptor read after it.
    let r = within(10, "read", pending_read).await.unwrap();
    assert!(
        matches!(r.result, Err(Error::PeerClosed { .. })),
        "{:?}",
        r.result
    );
    assert_eq!(
        r.message.tensors[0].buffer.len(),
        32 << 20,
        "buffer handed back"
    );
    let d = within(10, "descriptor", pending_desc).await.unwrap();
    assert!(matches!(d.descriptor, Err(Error::PeerClosed { .. })));
    let c = within(10, "Closed", rx_closed.recv()).await.unwrap();
    assert_eq!(c.error.class(), "peer_closed");

    // Operations after the close fail at once, with the same error.
    let late = tx.send(Write::new(big_message(9, 10))).await.unwrap();
    assert!(matches!(late.result, Err(Error::Closed { .. })));
    assert_eq!(late.message.tensors[0].buffer.len(), 10);
    let late = rx.send(ReadDescriptor).await.unwrap();
    assert!(matches!(late.descriptor, Err(Error::PeerClosed { .. })));
}

/// The receiver closes while a large tensor is landing in its buffer: its read fails with its
/// buffer back, and the writer's pending writes complete, in order, failing from some point on.
#[actix::test]
async fn receiver_closes_mid_transfer() {
    let (tx, rx, _s) = pair(tcp_basic().chunk_size(64 << 10), tcp_basic()).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    for i in 0..4 {
        tx.do_send(Write::new(big_message(i, 64 << 20)).notify(done_to.clone()));
    }
    let d = within(10, "descriptor", rx.send(ReadDescriptor))
        .await
        .unwrap();
    let alloc = Allocation::for_descriptor(&d.descriptor.unwrap()).unwrap();
    let read = rx.send(Read::new(alloc));
    rx.do_send(Close::because("receiver gives up"));
    let r = within(10, "read", read).await.unwrap();
    // Either the 64 MiB landed before the close was handled, or the read was cut off.
    if let Err(e) = &r.result {
        assert!(matches!(e, Error::Closed { .. }), "{e}");
    }
    assert_eq!(r.message.tensors[0].buffer.len(), 64 << 20);
    let mut failed = false;
    for i in 0..4 {
        let d = within(10, "write completion", done.recv()).await.unwrap();
        assert_eq!(d.id, i);
        assert_eq!(d.message.tensors[0].buffer.len(), 64 << 20);
        match d.result {
            Ok(()) => assert!(!failed, "no success after a failure"),
            Err(e) => {
                failed = true;
                assert!(matches!(e, Error::PeerClosed { .. }), "{e}");
            }
        }
    }
    assert!(
        failed,
        "4 x 64 MiB cannot all be written once the receiver is gone"
    );
}

/// A peer that closes while nothing is pending is noticed; its reason is reported.
#[actix::test]
async fn idle_peer_close_is_noticed_with_its_reason() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let mut rx_closed = subscribe(&rx).await;
    tx.send(Close::because("maintenance")).await.unwrap();
    let c = within(10, "Closed", rx_closed.recv()).await.unwrap();
    match &c.error {
        Error::PeerClosed { reason, .. } => assert!(reason.contains("maintenance"), "{reason}"),
        e => panic!("expected PeerClosed, got {e}"),
    }
    // Close twice is harmless and reports the first error; a late subscriber hears at once.
    let again = tx.send(Close::because("again")).await.unwrap();
    match again.error {
        Error::Closed { reason, .. } => assert_eq!(reason, "maintenance"),
        e => panic!("{e}"),
    }
    let mut late = subscribe(&tx).await;
    within(10, "late Closed", late.recv()).await.unwrap();
    let info = tx.send(GetInfo).await.unwrap();
    assert!(info.closed);
}

/// Dropping every address of a pipe closes it; the peer notices.
#[actix::test]
async fn dropping_a_pipe_closes_it() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let mut rx_closed = subscribe(&rx).await;
    drop(tx);
    let c = within(10, "Closed after drop", rx_closed.recv())
        .await
        .unwrap();
    match &c.error {
        Error::PeerClosed { reason, .. } => assert!(reason.contains("dropped"), "{reason}"),
        e => panic!("expected PeerClosed, got {e}"),
    }
}
