//! `Receive`: the next message whole, in one operation, into buffers the pipe fits.

use actorpipe::*;

use crate::common::*;

const CONFIGS: [Setup; 4] = READ_CONFIGS_SPIN;

/// Messages of every shape arrive intact through `Receive`, mixed with `ReadDescriptor` + `Read`
/// on the same pipe, each `Receive` reusing the buffers of the message before it (whatever its
/// shape), over the default pipe (shm + cma), tcp + basic and mpt.
#[actix::test]
async fn receive_reads_every_shape_mixed_with_two_step_reads() {
    for (name, builder) in CONFIGS {
        let (tx, rx, _s) = pair(builder(), builder()).await;
        let mut rng = Rng(0xbeef);
        let mut spare = Allocation::default();
        for i in 0..120u64 {
            // Payloads above 16 KiB travel after their descriptor, not with it.
            let payloads: Vec<usize> = (0..rng.below(3))
                .map(|_| draw_size(&mut rng).min(1 << 20))
                .collect();
            let tensors: Vec<usize> = (0..rng.below(3))
                .map(|_| draw_size(&mut rng).min(4 << 20))
                .collect();
            let sent = checked_message(i, &payloads, &tensors);
            let w = tx.send(Write::new(sent));
            let got = if i % 3 == 2 {
                read_one(&rx).await.expect("two-step read")
            } else {
                let done = within(30, "a Receive", rx.send(Receive::reusing(spare))).await;
                let done = done.unwrap();
                done.result.unwrap_or_else(|e| panic!("{name}: {e}"));
                done.message
            };
            assert_eq!(verify(&got), i, "{name}: message {i}");
            spare = Allocation::from(got);
            w.await.unwrap().result.unwrap();
        }
    }
}

/// Spare buffers whose capacity suffices are used as they are: the message comes back in the
/// very same memory, and its metadata and target devices are those of the descriptor (a host
/// tensor suggested for a GPU lands in host memory over basic, and says so).
#[actix::test]
async fn receive_fills_the_spare_buffers_it_is_given() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let mut t = Tensor::cpu(pattern(2, 70_000));
    t.target_device = Some(Device::Cuda(0));
    t.metadata = b"t".to_vec();
    let m = Message::new()
        .with_metadata(b"whole".to_vec())
        .with_payload(Payload::new(pattern(1, 100)))
        .with_payload(Payload::new(pattern(3, 40_000)))
        .with_tensor(t);
    // Larger buffers than needed, one more of each than the message has.
    let spare = Allocation {
        payloads: vec![vec![9; 200], vec![9; 50_000], vec![9; 10]],
        tensors: vec![Buffer::Cpu(vec![9; 100_000]), Buffer::Cpu(vec![9; 5])],
    };
    let at: Vec<*const u8> = spare.payloads[..2]
        .iter()
        .map(|b| b.as_ptr())
        .chain(
            spare.tensors[..1]
                .iter()
                .map(|b| b.as_cpu().unwrap().as_ptr()),
        )
        .collect();
    let _w = tx.send(Write::new(m.clone()));
    let done = within(10, "a Receive", rx.send(Receive::reusing(spare)))
        .await
        .unwrap();
    done.result.unwrap();
    let mut landing = m.clone();
    landing.tensors[0].target_device = Some(Device::Cpu);
    assert_eq!(done.message, landing);
    let now: Vec<*const u8> = done
        .message
        .payloads
        .iter()
        .map(|p| p.data.as_ptr())
        .chain(
            done.message
                .tensors
                .iter()
                .map(|t| t.buffer.as_cpu().unwrap().as_ptr()),
        )
        .collect();
    assert_eq!(now, at, "the message landed in the spare buffers");
}

/// A `Receive` while a delivered descriptor is unread is refused with its buffers handed back;
/// the pipe goes on: the `Read` and later `Receive`s work.
#[actix::test]
async fn receive_with_an_unread_descriptor_is_refused() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    for i in 0..2 {
        tx.do_send(Write::new(checked_message(i, &[10], &[20])));
    }
    let d = rx.send(ReadDescriptor).await.unwrap().descriptor.unwrap();
    let spare = Allocation {
        payloads: vec![vec![0; 3]],
        tensors: vec![],
    };
    let done = rx.send(Receive::reusing(spare)).await.unwrap();
    assert_invalid(&done.result, "Read");
    assert_eq!(
        done.message.payloads[0].data.len(),
        3,
        "buffers handed back"
    );
    let read = rx
        .send(Read::new(Allocation::for_descriptor(&d).unwrap()))
        .await
        .unwrap();
    read.result.unwrap();
    assert_eq!(verify(&read.message), 0);
    let done = rx.send(Receive::new()).await.unwrap();
    done.result.unwrap();
    assert_eq!(verify(&done.message), 1);
}

/// Fired `Receive`s share the read numbering with `ReadDescriptor` and `Read`, complete in
/// issue order, and those still pending when the peer goes complete with its error, buffers
/// handed back.
#[actix::test]
async fn fired_receives_complete_in_order_and_fail_with_the_pipe() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let (to, mut reads) = inbox::<ReadDone>();
    let to = std::sync::Arc::new(to);
    for _ in 0..5 {
        rx.do_send(Receive::new().notify_shared(&to));
    }
    let spare = Allocation {
        payloads: vec![vec![7; 64]],
        tensors: vec![],
    };
    rx.do_send(Receive::reusing(spare).notify_shared(&to));
    for i in 0..5u64 {
        tx.do_send(Write::new(checked_message(i, &[64], &[i as usize * 1000])));
    }
    for i in 0..5u64 {
        let done = within(10, "a fired Receive", reads.recv()).await.unwrap();
        assert_eq!(done.id, i, "read numbers in issue order");
        done.result.unwrap();
        assert_eq!(verify(&done.message), i);
    }
    tx.send(Close::because("test over")).await.unwrap();
    let done = within(10, "the last Receive", reads.recv()).await.unwrap();
    assert_eq!(done.id, 5);
    assert!(
        matches!(done.result, Err(Error::PeerClosed { .. })),
        "{:?}",
        done.result
    );
    assert_eq!(done.message.payloads[0].data, vec![7; 64], "buffers back");
    // After the failure, a new Receive fails at once with the same error.
    let late = rx.send(Receive::new()).await.unwrap();
    assert!(matches!(late.result, Err(Error::PeerClosed { .. })));
}

/// A `Receive` with a deadline that passes closes the pipe with `Timeout`, like a `Read`.
#[actix::test]
async fn receive_deadline_closes_the_pipe() {
    let (_tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let done = within(
        10,
        "a Receive with a deadline",
        rx.send(Receive::new().within(std::time::Duration::from_millis(100))),
    )
    .await
    .unwrap();
    assert!(
        matches!(done.result, Err(Error::Timeout { .. })),
        "{:?}",
        done.result
    );
    assert!(rx.send(GetInfo).await.unwrap().closed);
}

/// A `Receive` waiting when a self-contained message arrives (payloads and host tensors of at
/// most 16 KiB in all, the tensors on the control stream) is completed by the connection's read
/// loop itself, with the message intact, its metadata, and the spare buffers reused; one whose
/// bytes follow on the stream, or whose tensors take a channel of their own (xth), is completed
/// by the pipe as before. Over shm + xth (the default in one process), tcp + basic and tcp + mpt
/// (whose small tensors travel inline on the control stream, as basic ones do).
#[actix::test]
async fn waiting_receives_of_small_messages_are_completed_by_the_read_loop() {
    for (name, builder) in CONFIGS {
        let (tx, rx, _s) = pair(builder(), builder()).await;
        let shapes: [(&[usize], &[usize], bool); 6] = [
            (&[64], &[], true),
            (&[100, 0, 3], &[], true),
            (&[], &[], true),
            (&[64], &[100, 7], true),
            (&[20 << 10], &[], false),
            (&[10], &[20 << 10], false),
        ];
        let mut spare = Allocation::default();
        let mut caught = 0;
        for i in 0..40u64 {
            let (payloads, tensors, small) = shapes[i as usize % shapes.len()];
            // The Receive reaches the pipe (and waits) before the message is written.
            let receive = rx.send(Receive::reusing(spare));
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            let mut m = checked_message(i, payloads, tensors);
            // Over basic alone (no CUDA channel even where a GPU is), a tensor suggested for a
            // GPU lands, and says it lands, in host memory, as the pipe's own check has it.
            let suggest = name == "tcp+basic";
            if let (true, Some(t)) = (suggest, m.tensors.first_mut()) {
                t.target_device = Some(Device::Cuda(0));
            }
            tx.do_send(Write::new(m));
            let done = within(10, "a Receive", receive).await.unwrap();
            done.result.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(verify(&done.message), i, "{name}: message {i}");
            for (j, p) in done.message.payloads.iter().enumerate() {
                assert_eq!(p.metadata, format!("p{j}").into_bytes(), "{name}: {i}");
            }
            for (j, t) in done.message.tensors.iter().enumerate() {
                assert_eq!(t.metadata, format!("t{j}").into_bytes(), "{name}: {i}");
                let want = (suggest && j == 0).then_some(Device::Cpu);
                assert_eq!(t.target_device, want, "{name}: {i}, tensor {j}");
                assert_eq!(t.buffer.device(), Device::Cpu, "{name}: {i}, tensor {j}");
            }
            // Small tensors ride the control stream over basic and mpt (inline) only: two
            // contexts of one process negotiate xth by default.
            let on_control = matches!(name, "tcp+basic" | "tcp+mpt");
            caught += u64::from(small && (tensors.is_empty() || on_control));
            let info = rx.send(GetInfo).await.unwrap();
            assert_eq!(
                info.received_by_read_loop, caught,
                "{name}: message {i} ({payloads:?}, {tensors:?})"
            );
            spare = Allocation::from(done.message);
        }
    }
}

/// A `Receive` waiting in the read loop's hands fails with the pipe when the peer goes, with its
/// spare buffers handed back, and the `Receive` behind it fails next, in order.
#[actix::test]
async fn a_waiting_receive_fails_with_the_pipe_in_order() {
    let (tx, rx, _s) = pair(tcp_basic(), tcp_basic()).await;
    let (to, mut reads) = inbox::<ReadDone>();
    let to = std::sync::Arc::new(to);
    let spare = Allocation {
        payloads: vec![vec![9; 32]],
        tensors: vec![],
    };
    rx.do_send(Receive::reusing(spare).notify_shared(&to));
    rx.do_send(Receive::new().notify_shared(&to));
    tokio::task::yield_now().await;
    tx.send(Close::because("test over")).await.unwrap();
    for id in 0..2 {
        let done = within(10, "a waiting Receive", reads.recv()).await.unwrap();
        assert_eq!(done.id, id, "in issue order");
        assert!(
            matches!(done.result, Err(Error::PeerClosed { .. })),
            "{:?}",
            done.result
        );
        if id == 0 {
            assert_eq!(done.message.payloads[0].data, vec![9; 32], "buffers back");
        }
    }
    assert_eq!(rx.send(GetInfo).await.unwrap().received_by_read_loop, 0);
}
