//! Messages of every shape between two contexts in one process, checked by checksum and order.

use actorpipe::*;

use crate::common::*;

/// 1 000 messages with random counts of payloads and tensors of sizes 0, 1, 31, 32, 4 KiB, 1 MiB
/// and 64 MiB, with up to 8 writes in flight and a small chunk size so tensors are chunked.
#[actix::test]
async fn thousand_random_messages_arrive_intact_and_in_order() {
    let builder = || Context::builder().chunk_size(256 << 10);
    let (tx, rx, _server) = pair(builder(), builder()).await;
    let (done_to, mut done) = inbox::<WriteDone>();
    const N: u64 = 1000;
    const WINDOW: u64 = 8;

    let writer = async {
        let mut rng = Rng(0x5eed);
        let mut in_flight = 0;
        let mut next_done = 0;
        let mut big = 0;
        for i in 0..N {
            let payloads: Vec<usize> = (0..rng.below(4)).map(|_| draw_size(&mut rng)).collect();
            let tensors: Vec<usize> = (0..rng.below(4)).map(|_| draw_size(&mut rng)).collect();
            big += tensors
                .iter()
                .chain(&payloads)
                .filter(|&&s| s == 64 << 20)
                .count();
            let m = checked_message(i, &payloads, &tensors);
            tx.do_send(Write::new(m).notify(done_to.clone()));
            in_flight += 1;
            while in_flight >= WINDOW || (i == N - 1 && in_flight > 0) {
                let d = done.recv().await.expect("write completion");
                assert_eq!(d.id, next_done, "write completions in issue order");
                d.result.expect("write succeeds");
                // The buffers come back whole.
                assert_eq!(verify(&d.message), next_done);
                next_done += 1;
                in_flight -= 1;
            }
        }
        assert_eq!(next_done, N);
        assert!(big > 0, "the plan includes 64 MiB buffers");
    };
    let reader = async {
        for i in 0..N {
            let m = read_one(&rx).await.expect("read succeeds");
            assert_eq!(verify(&m), i, "the n-th read matches the n-th write");
        }
    };
    within(300, "1000 messages", async { tokio::join!(writer, reader) }).await;
}

/// Empty messages, empty payloads and empty tensors are legal.
#[actix::test]
async fn empty_messages_and_buffers() {
    let (tx, rx, _s) = pair(Context::builder(), Context::builder()).await;
    let w = tx.send(Write::new(Message::new()));
    let m = read_one(&rx).await.unwrap();
    assert_eq!(m, Message::new());
    w.await.unwrap().result.unwrap();
    let m = checked_message(7, &[0, 0], &[0, 1, 0]);
    let w = tx.send(Write::new(m.clone()));
    assert_eq!(read_one(&rx).await.unwrap(), m);
    w.await.unwrap().result.unwrap();
}

/// Both directions at once on one pipe.
#[actix::test]
async fn both_directions_concurrently() {
    let (a, b, _s) = pair(Context::builder().chunk_size(4096), Context::builder()).await;
    let one_way = |from: actix::Addr<Pipe>, to: actix::Addr<Pipe>, base: u64| async move {
        for i in 0..50 {
            let m = checked_message(base + i, &[100], &[70_000]);
            let w = from.send(Write::new(m));
            assert_eq!(verify(&read_one(&to).await.unwrap()), base + i);
            w.await.unwrap().result.unwrap();
        }
    };
    within(60, "bidirectional", async {
        tokio::join!(one_way(a.clone(), b.clone(), 0), one_way(b, a, 10_000))
    })
    .await;
}

/// Every metadata field reaches the receiver's descriptor, and the target device says where the
/// tensor lands: a host tensor suggested for a GPU, over a pipe with no cpu->cuda channel, lands
/// in host memory and its descriptor says so.
#[actix::test]
async fn descriptor_carries_everything_needed_to_allocate() {
    // No CUDA channel: with feature `cuda` on a GPU host, cuda_xth would carry it, and on a
    // host with two GPUs or more cuda_basic too (found on four H200s, 2026-11-28).
    let host = || host_only(Context::builder());
    let (tx, rx, _s) = pair(host(), host()).await;
    let mut t = Tensor::cpu(vec![5; 33]);
    t.target_device = Some(Device::Cuda(1));
    t.metadata = b"shape=[33]".to_vec();
    let m = Message::new()
        .with_metadata(b"batch 3".to_vec())
        .with_payload(Payload {
            data: vec![1, 2],
            metadata: b"hdr".to_vec(),
        })
        .with_tensor(t);
    let _w = tx.send(Write::new(m.clone()));
    let d = rx.send(ReadDescriptor).await.unwrap().descriptor.unwrap();
    let mut landing = m.clone();
    landing.tensors[0].target_device = Some(Device::Cpu);
    assert_eq!(d, landing.descriptor());
    assert_eq!(
        m.descriptor().tensors[0].target_device,
        Some(Device::Cuda(1))
    );
    assert_eq!(d.total_bytes(), 35);
    let done = rx
        .send(Read::new(Allocation::for_descriptor(&d).unwrap()))
        .await
        .unwrap();
    done.result.unwrap();
    assert_eq!(done.message, landing);
}

/// A Read whose buffers do not match the descriptor is refused, its buffers come back, and the
/// pipe stays usable: a correct Read then succeeds.
#[actix::test]
async fn mismatched_allocation_is_refused_and_the_pipe_survives() {
    let (tx, rx, _s) = pair(Context::builder(), Context::builder()).await;
    let m = checked_message(1, &[10], &[20]);
    let _w = tx.send(Write::new(m));
    let d = rx.send(ReadDescriptor).await.unwrap().descriptor.unwrap();
    let wrong = Allocation {
        payloads: vec![vec![0; 10]],
        tensors: vec![Buffer::Cpu(vec![0; 19])],
    };
    let done = rx.send(Read::new(wrong)).await.unwrap();
    assert_invalid(&done.result, "tensor 0");
    assert_eq!(
        done.message.tensors[0].buffer.len(),
        19,
        "buffers handed back"
    );
    let done = rx
        .send(Read::new(Allocation::for_descriptor(&d).unwrap()))
        .await
        .unwrap();
    done.result.unwrap();
    assert_eq!(verify(&done.message), 1);
}

/// A Read with no descriptor delivered is an error for that read only.
#[actix::test]
async fn read_without_descriptor_is_refused() {
    let (_tx, rx, _s) = pair(Context::builder(), Context::builder()).await;
    let done = rx.send(Read::new(Allocation::default())).await.unwrap();
    assert!(matches!(done.result, Err(Error::InvalidArgument { .. })));
    assert!(!rx.send(GetInfo).await.unwrap().closed);
}

/// Fired operations: ReadDescriptor then Read issued back to back, without waiting, complete in
/// order through a recipient.
#[actix::test]
async fn fired_reads_complete_in_order() {
    let (tx, rx, _s) = pair(Context::builder(), Context::builder()).await;
    let (desc_to, mut descs) = inbox::<DescriptorReady>();
    let (read_to, mut reads) = inbox::<ReadDone>();
    for i in 0..3 {
        let m = checked_message(i, &[8], &[16]);
        tx.do_send(Write::new(m));
    }
    for _ in 0..3 {
        rx.do_send(ReadDescriptor.notify(desc_to.clone()));
        // The allocation is known in advance here (fixed sizes), so no need to wait.
        rx.do_send(
            Read::new(Allocation {
                payloads: vec![vec![0; 8]],
                tensors: vec![Buffer::Cpu(vec![0; 16])],
            })
            .notify(read_to.clone()),
        );
    }
    for i in 0..3 {
        expect_read(i, &mut descs, &mut reads).await;
    }
}

/// The `i`-th message's descriptor and read, fired with ids `2i` and `2i + 1`, arrive intact.
async fn expect_read(
    i: u64,
    descs: &mut tokio::sync::mpsc::UnboundedReceiver<DescriptorReady>,
    reads: &mut tokio::sync::mpsc::UnboundedReceiver<ReadDone>,
) {
    let d = within(10, "descriptor", descs.recv()).await.unwrap();
    assert_eq!(d.id, 2 * i);
    d.descriptor.unwrap();
    let r = within(10, "read", reads.recv()).await.unwrap();
    assert_eq!(r.id, 2 * i + 1);
    r.result.unwrap();
    assert_eq!(verify(&r.message), i);
}

/// Operations fired with `notify_shared` (one recipient made once) and with `notify`, mixed,
/// complete in issue order, writes and reads alike.
#[actix::test]
async fn shared_recipients_complete_in_order() {
    let (tx, rx, _s) = pair(Context::builder(), Context::builder()).await;
    let (wrote_to, mut wrote) = inbox::<WriteDone>();
    let (desc_to, mut descs) = inbox::<DescriptorReady>();
    let (read_to, mut reads) = inbox::<ReadDone>();
    let (wrote_shared, desc_shared, read_shared) = (
        std::sync::Arc::new(wrote_to.clone()),
        std::sync::Arc::new(desc_to.clone()),
        std::sync::Arc::new(read_to.clone()),
    );
    for i in 0..6 {
        let w = Write::new(checked_message(i, &[8], &[16]));
        if i % 2 == 0 {
            tx.do_send(w.notify_shared(&wrote_shared));
        } else {
            tx.do_send(w.notify(wrote_to.clone()));
        }
    }
    for i in 0..6 {
        let alloc = Allocation {
            payloads: vec![vec![0; 8]],
            tensors: vec![Buffer::Cpu(vec![0; 16])],
        };
        if i % 2 == 0 {
            rx.do_send(ReadDescriptor.notify(desc_to.clone()));
            rx.do_send(Read::new(alloc).notify_shared(&read_shared));
        } else {
            rx.do_send(ReadDescriptor.notify_shared(&desc_shared));
            rx.do_send(Read::new(alloc).notify(read_to.clone()));
        }
    }
    for i in 0..6 {
        let w = within(10, "write", wrote.recv()).await.unwrap();
        assert_eq!(w.id, i);
        w.result.unwrap();
        expect_read(i, &mut descs, &mut reads).await;
    }
}

/// Over the limits on the sending side: the write fails with LimitExceeded, hands its buffers
/// back, and the pipe stays open.
#[actix::test]
async fn write_over_limits_fails_alone() {
    let limits = Limits {
        max_tensors: 2,
        ..Limits::default()
    };
    let (tx, rx, _s) = pair(Context::builder().limits(limits), Context::builder()).await;
    let done = tx
        .send(Write::new(checked_message(0, &[], &[1, 1, 1])))
        .await
        .unwrap();
    assert!(matches!(
        done.result,
        Err(Error::LimitExceeded {
            limit: "tensor count",
            value: 3,
            max: 2,
            ..
        })
    ));
    assert_eq!(done.message.tensors.len(), 3);
    let w = tx.send(Write::new(checked_message(1, &[], &[1, 1])));
    assert_eq!(verify(&read_one(&rx).await.unwrap()), 1);
    w.await.unwrap().result.unwrap();
}

/// Payloads of up to 16 KiB in all are read together with their descriptor, larger ones after
/// it, and after a message with such payloads and no tensors the read loop goes on to the next
/// frame by itself (up to the prefetch bound). Messages on both sides of that boundary, with and
/// without tensors (which travel on the control stream with basic), and runs of small messages
/// longer than the bound, all written before any is read, arrive intact and in order.
#[actix::test]
async fn payloads_around_the_inline_boundary() {
    let shapes: [(&[usize], &[usize]); 8] = [
        (&[16384], &[]),
        (&[16385], &[]),
        (&[8192, 8192], &[100]),
        (&[8192, 8193], &[100]),
        (&[0, 0, 0], &[]),
        (&[1, 2, 3], &[5000, 0]),
        (&[64], &[]),
        (&[100_000, 64], &[64]),
    ];
    for builder in [tcp_basic, Context::builder] {
        let (tx, rx, _s) = pair(builder(), builder()).await;
        let (done_to, mut done) = inbox::<WriteDone>();
        let mut sent = Vec::new();
        for round in 0..3u64 {
            for (i, (p, t)) in shapes.iter().enumerate() {
                let index = round * 100 + i as u64;
                tx.do_send(Write::new(checked_message(index, p, t)).notify(done_to.clone()));
                sent.push(index);
            }
            for i in 0..40 {
                let index = round * 100 + 50 + i;
                let m = checked_message(index, &[(i as usize) % 3 * 64], &[]);
                tx.do_send(Write::new(m).notify(done_to.clone()));
                sent.push(index);
            }
        }
        within(60, "inline boundary", async {
            for index in &sent {
                assert_eq!(verify(&read_one(&rx).await.unwrap()), *index);
            }
            for id in 0..sent.len() as u64 {
                let d = done.recv().await.expect("write completion");
                assert_eq!(d.id, id);
                d.result.unwrap();
            }
        })
        .await;
    }
}

/// Small tensors on the control connection (basic, and cma's inline ones) are read together
/// with their descriptor, chunked or not, while the pipe reads descriptors ahead: 200 messages
/// written before any is read, each with payloads and small tensors (several chunks each with a
/// 1000-byte chunk size), some just over the 16 KiB that can go with the descriptor.
#[actix::test]
async fn small_tensors_arrive_with_their_descriptor_while_reading_ahead() {
    let configs: [Setup; 2] = [
        ("tcp+basic", || tcp_basic().chunk_size(1000)),
        ("default", || Context::builder().chunk_size(1000)),
    ];
    for (name, builder) in configs {
        let (tx, rx, _s) = pair(builder(), builder()).await;
        let (done_to, mut done) = inbox::<WriteDone>();
        let shapes: [(&[usize], &[usize]); 5] = [
            (&[10], &[64]),
            (&[], &[5000, 0, 3000]),
            (&[100, 200], &[16 << 10]),
            (&[1], &[(16 << 10) - 1, 1]),
            (&[], &[]),
        ];
        for i in 0..200u64 {
            let (p, t) = shapes[i as usize % shapes.len()];
            tx.do_send(Write::new(checked_message(i, p, t)).notify(done_to.clone()));
        }
        for i in 0..200u64 {
            let m = if i % 2 == 0 {
                within(10, "a Receive", rx.send(Receive::new()))
                    .await
                    .unwrap()
                    .message
            } else {
                within(10, "a two-step read", read_one(&rx)).await.unwrap()
            };
            assert_eq!(verify(&m), i, "{name}: message {i}");
        }
        for _ in 0..200 {
            done.recv().await.unwrap().result.unwrap();
        }
    }
}

/// mpt sends tensors of 1 B to its inline limit after their descriptor on the pipe's own
/// connection and the larger ones over its lanes, with `mpt_inline_max(0)` every non-empty one
/// over the lanes; either way every tensor arrives intact, the empty one included, and the pipes
/// count where each went.
#[actix::test]
async fn mpt_sends_small_tensors_inline_and_large_ones_over_its_lanes() {
    let limit = actorpipe::internal::backend::mpt::INLINE_MAX as usize;
    let sizes = [0, 1, 4096, limit, limit + 1, 1 << 20];
    for (inline_max, on_control) in [(None, 3), (Some(0), 0), (Some(1 << 20), 5)] {
        let side = || {
            let b = Context::builder()
                .without("shm")
                .only_channels(&["mpt"])
                .lanes(2);
            match inline_max {
                Some(n) => b.mpt_inline_max(n),
                None => b,
            }
        };
        let (tx, rx, _s) = pair(side(), side()).await;
        for (i, &size) in sizes.iter().enumerate() {
            let (to, mut done) = inbox::<WriteDone>();
            tx.do_send(Write::new(checked_message(i as u64, &[], &[size])).notify(to));
            let m = within(30, "read", read_one(&rx)).await.expect("read");
            assert_eq!(verify(&m), i as u64, "{inline_max:?}: tensor of {size} B");
            let d = within(30, "write", done.recv()).await.unwrap();
            d.result.expect("write");
        }
        let info = tx.send(GetInfo).await.unwrap();
        assert_eq!(
            (info.tensors_on_control, info.tensors_by_channel),
            (on_control, sizes.len() as u64 - on_control),
            "{inline_max:?}: tensors on control, by channel"
        );
    }
}
