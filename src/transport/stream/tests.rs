use super::*;
use std::sync::Arc;

fn wire(payloads: &[u64], tensors: &[(u64, &[u8])]) -> WireDescriptor {
    let mut m = crate::message::Message::new();
    for &n in payloads {
        m = m.with_payload(Payload::new(vec![0; n as usize]));
    }
    for &(n, _) in tensors {
        m = m.with_tensor(crate::message::Tensor::cpu(vec![0; n as usize]));
    }
    WireDescriptor {
        seq: 0,
        descriptor: m.descriptor(),
        routes: tensors.iter().map(|&(_, d)| (0, d.to_vec())).collect(),
    }
}

#[test]
fn what_is_read_with_the_frame() {
    let k16 = INLINE_PAYLOADS;
    let inline = |payloads, total| Some(Inline { payloads, total });
    // Payloads alone, at and over the limit.
    let wd = wire(&[k16], &[]);
    assert_eq!(inline_len(&wd, Carried::All), inline(16384, Some(16384)));
    assert!(self_contained(&wd, Carried::All));
    assert_eq!(inline_len(&wire(&[k16 + 1], &[]), Carried::All), None);
    // Carried tensors join them while everything fits in 16 KiB.
    let wd = wire(&[100], &[(5000, b""), (0, b""), (3000, b"")]);
    assert_eq!(inline_len(&wd, Carried::All), inline(100, Some(8100)));
    assert!(self_contained(&wd, Carried::All));
    let wd = wire(&[1], &[(k16 - 1, b""), (1, b"")]);
    assert_eq!(inline_len(&wd, Carried::All), inline(1, None));
    assert!(!self_contained(&wd, Carried::All));
    // cma: only tensors without channel data are on the stream; xth and mpt: none.
    let wd = wire(&[10], &[(1 << 20, b"remote"), (64, b"")]);
    assert_eq!(inline_len(&wd, Carried::NoData), inline(10, Some(74)));
    assert_eq!(inline_len(&wd, Carried::Nothing), inline(10, Some(10)));
    assert_eq!(inline_len(&wd, Carried::All), inline(10, None));
}

/// A write loop over an in-memory stream that takes `room` bytes at a time, started on the
/// current `LocalSet` and idle: its queue, its stop signal, its parking, the loop's task
/// and the stream's other end.
struct Writer {
    tx: mpsc::UnboundedSender<OutOp>,
    stop: watch::Sender<Option<Farewell>>,
    parking: Arc<Parking>,
    task: tokio::task::JoinHandle<()>,
    r: tokio::io::DuplexStream,
}

async fn writer(room: usize) -> Writer {
    let (w, r) = tokio::io::duplex(room);
    let (tx, rx) = mpsc::unbounded_channel();
    let (stop, stopped) = watch::channel(None);
    let parking = Arc::new(Parking::default());
    let task = tokio::task::spawn_local(write_loop(
        Box::new(w),
        rx,
        stopped,
        Origin::new("test", "test"),
        None,
        parking.clone(),
    ));
    tokio::task::yield_now().await;
    Writer {
        tx,
        stop,
        parking,
        task,
        r,
    }
}

/// One op through [`Parking::try_write_batch`]: `Ok` if written whole.
fn try_write(parking: &Parking, op: OutOp) -> Result<OutOp, OutOp> {
    match parking.try_write_batch(std::slice::from_ref(&op)) {
        1 => Ok(op),
        _ => Err(op),
    }
}

fn message(ticket: u64, bytes: &[u8], reply: &Reply) -> OutOp {
    OutOp::Message {
        ticket,
        frame: bytes[..2].to_vec(),
        payloads: vec![Payload::new(bytes[2..].to_vec())],
        reply: reply.clone(),
    }
}

fn tensor(ticket: u64, index: u32, len: usize, reply: &Reply) -> OutOp {
    OutOp::Tensor {
        ticket,
        seq: 7,
        index,
        memory: Memory::Owned(vec![index as u8 + 1; len]),
        offset: 0,
        chunk_size: 1 << 20,
        reply: reply.clone(),
    }
}

/// A message and its small tensors go out in one write while the loop is idle. One that
/// tears inside a tensor: the whole ops written stay with the owner, the loop writes the
/// rest of the torn one first, then the others; the stream carries exactly what the loop
/// alone would have written.
#[tokio::test]
async fn owner_writes_a_message_and_its_tensors_in_one_go() {
    tokio::task::LocalSet::new()
        .run_until(owner_writes_batches())
        .await;
}

async fn owner_writes_batches() {
    // What the loop writes for these ops: the frame and payloads, then each tensor as one
    // chunk frame (header, body).
    fn reference(ops: Vec<OutOp>) -> Vec<u8> {
        let mut out = Vec::new();
        for op in ops {
            match op {
                OutOp::Message {
                    frame, payloads, ..
                } => {
                    out.extend_from_slice(&frame);
                    for p in payloads {
                        out.extend_from_slice(&p.data);
                    }
                }
                OutOp::Tensor {
                    seq, index, memory, ..
                } => {
                    let body = memory.as_slice();
                    let h = ChunkHeader {
                        seq,
                        tensor: index,
                        offset: 0,
                        length: body.len() as u64,
                    };
                    wire::encode_frame(&mut out, FrameKind::Chunk, |b| wire::encode_chunk(b, &h));
                    out.extend_from_slice(body);
                }
            }
        }
        out
    }
    let (reply, mut done) = mpsc::unbounded_channel();
    let ops = || {
        vec![
            message(0, b"hd-payload", &reply),
            tensor(1, 0, 100, &reply),
            tensor(2, 1, 50, &reply),
        ]
    };
    let want = reference(ops());
    // The loop writes the ops the owner did not write whole (from `whole` on); the stream
    // then carries `want`, and each op the loop wrote completes.
    async fn rest(
        w: &mut Writer,
        whole: usize,
        want: &[u8],
        ops: Vec<OutOp>,
        done: &mut mpsc::UnboundedReceiver<Done>,
    ) {
        let left = ops.len() - whole;
        for op in ops.into_iter().skip(whole) {
            w.tx.send(op).unwrap();
        }
        let mut got = vec![0u8; want.len()];
        w.r.read_exact(&mut got).await.unwrap();
        assert_eq!(got, want);
        for i in 0..left {
            let d = done.recv().await.unwrap();
            assert!(
                matches!(d, Done::WroteTensor { result: Ok(()), .. }),
                "op {i} of the loop's: {d:?}"
            );
        }
    }
    // The stream takes 40 bytes at once: the message and part of the first tensor.
    let mut w = writer(40).await;
    let batch = ops();
    let whole = w.parking.try_write_batch(&batch);
    assert_eq!(whole, 1, "the message went whole, the first tensor in part");
    rest(&mut w, whole, &want, batch, &mut done).await;
    // With room: all three in one write, nothing for the loop.
    let mut w = writer(4096).await;
    assert_eq!(w.parking.try_write_batch(&ops()), 3);
    rest(&mut w, 3, &want, ops(), &mut done).await;
    // The same bytes from the message's own parts, with no op built (a `PipeWriter`'s way).
    // Torn: the loop writes the rest from the ops built then, from the first one not whole.
    let payloads = [Payload::new(b"-payload".to_vec())];
    let tensors = [
        crate::message::Tensor::cpu(vec![1; 100]),
        crate::message::Tensor::cpu(vec![2; 50]),
    ];
    let parts = |w: &Writer, ticket| {
        w.parking
            .try_write_parts(ticket, 7, b"hd", &payloads, &tensors)
    };
    let mut w = writer(40).await;
    let whole = parts(&w, 0);
    assert_eq!(
        whole,
        Some(1),
        "the message whole, the first tensor in part"
    );
    rest(&mut w, 1, &want, ops(), &mut done).await;
    // Whole; then a ticket that is not next writes nothing.
    let mut w = writer(4096).await;
    assert_eq!(parts(&w, 1), None, "ticket 1 before 0");
    assert_eq!(parts(&w, 0), Some(3));
    rest(&mut w, 3, &want, ops(), &mut done).await;
    assert_eq!(parts(&w, 0), None, "ticket 0 again");
}

/// The owner writes while the loop is idle: whole, in part (the loop finishes it, and no
/// farewell cuts into it), or not at all (the loop is busy, or the ticket is not next).
#[tokio::test]
async fn owner_writes_while_the_loop_is_idle() {
    // The loops run on one thread, as on an arbiter (an `OutOp` is not `Sync`).
    tokio::task::LocalSet::new()
        .run_until(owner_writes_while_idle())
        .await;
}

async fn owner_writes_while_idle() {
    let Writer {
        tx,
        stop: stop_tx,
        parking,
        task: lp,
        mut r,
    } = writer(8).await;
    let (reply, mut done) = mpsc::unbounded_channel();
    // Not next in ticket order: refused.
    assert!(try_write(&parking, message(1, b"zzzz", &reply)).is_err());
    // Ticket 0 fits the stream's 8 bytes: written here.
    assert!(try_write(&parking, message(0, b"abcdef", &reply)).is_ok());
    // Ticket 1 does not fit: 2 bytes go now, the loop writes the rest.
    let op = try_write(&parking, message(1, b"0123456789", &reply)).expect_err("only part fits");
    // While torn, nothing more is written here.
    assert!(try_write(&parking, message(2, b"xy", &reply)).is_err());
    tx.send(op).unwrap();
    let mut got = vec![0u8; 16];
    r.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"abcdef0123456789");
    assert!(matches!(
        done.recv().await,
        Some(Done::Wrote {
            ticket: 1,
            result: Ok(()),
            ..
        })
    ));
    // Idle again: ticket 2 goes out here, ticket 3 through the loop.
    tokio::task::yield_now().await;
    assert!(try_write(&parking, message(2, b"ghij", &reply)).is_ok());
    tx.send(message(3, b"klmn", &reply)).unwrap();
    let mut got = vec![0u8; 8];
    r.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ghijklmn");
    assert!(matches!(
        done.recv().await,
        Some(Done::Wrote {
            ticket: 3,
            result: Ok(()),
            ..
        })
    ));
    // Stopped: nothing more is written here, and the farewell goes out.
    tokio::task::yield_now().await;
    parking.halt();
    assert!(try_write(&parking, message(4, b"nope", &reply)).is_err());
    stop_tx
        .send(Some(Farewell {
            frame: b"bye".to_vec(),
            patience: Duration::from_secs(1),
        }))
        .unwrap();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await.unwrap();
    assert_eq!(rest, b"bye");
    drop(tx);
    lp.await.unwrap();
}

#[test]
fn sequencer_restores_ticket_order() {
    let mut s = Sequencer::default();
    s.push(2, "c").unwrap();
    s.push(1, "b").unwrap();
    assert_eq!(s.pop(), None);
    s.push(0, "a").unwrap();
    assert_eq!(s.pop(), Some("a"));
    assert_eq!(s.pop(), Some("b"));
    assert_eq!(s.pop(), Some("c"));
    assert_eq!(s.pop(), None);
    assert_eq!(s.push(1, "stale"), Err("stale"));
    s.push(3, "d").unwrap();
    assert_eq!(s.push(3, "dup"), Err("dup"));
    s.push(5, "f").unwrap();
    let mut left: Vec<_> = s.drain().collect();
    left.sort();
    assert_eq!(left, vec!["d", "f"]);
}

#[test]
fn sequencer_take_turn_is_push_then_pop() {
    let mut s = Sequencer::default();
    // The next ticket with nothing filed: its turn is taken.
    assert!(s.take_turn(0));
    assert!(s.take_turn(1));
    assert_eq!(s.push(1, "stale"), Err("stale"));
    assert!(!s.take_turn(0));
    // Later tickets filed already do not stop it, and stay in order behind it.
    s.push(3, "d").unwrap();
    assert!(s.take_turn(2));
    assert_eq!(s.pop(), Some("d"));
    assert_eq!(s.pop(), None);
    // The next ticket filed already: not taken; the filed one comes next.
    s.push(4, "e").unwrap();
    assert!(!s.take_turn(4));
    assert_eq!(s.pop(), Some("e"));
    // A ticket past the next one: not taken (it is the sequencer's to file).
    assert!(!s.take_turn(6));
    s.push(6, "g").unwrap();
    assert!(s.take_turn(5));
    assert_eq!(s.pop(), Some("g"));
    assert!(s.is_empty());
}

/// A reader that hands out its bytes `piece` at a time, then ends.
struct Pieces {
    data: Vec<u8>,
    at: usize,
    piece: usize,
}

impl AsyncRead for Pieces {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let n = self
            .piece
            .min(buf.remaining())
            .min(self.data.len() - self.at);
        let at = self.at;
        buf.put_slice(&self.data[at..at + n]);
        self.at += n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// `read_frame` decodes a frame the read buffer holds whole in place and reads any other into
/// its own buffer: every way the stream may cut frames (inside the prefix, inside the body,
/// several frames in one read, frames larger than the read buffer) gives the same frames, with
/// heartbeats skipped, then the right error at the end.
#[tokio::test]
async fn frames_read_the_same_however_the_stream_cuts_them() {
    let farewells: Vec<_> = [0usize, 1, 10, 300, 5000]
        .iter()
        .map(|&n| wire::Farewell {
            reason: "r".repeat(n),
            graceful: n % 2 == 0,
        })
        .collect();
    let mut stream = Vec::new();
    for f in &farewells {
        stream.extend_from_slice(&wire::PING_FRAME);
        let mut frame = Vec::new();
        wire::encode_serde(&mut frame, FrameKind::Close, f);
        stream.extend_from_slice(&frame);
    }
    let limits = Limits::default();
    let origin = Origin::new("test://pieces", "test");
    for capacity in [8, 16, 512, 8192] {
        for piece in [1, 3, 4, 5, 64, 1000, stream.len()] {
            for cut in [stream.len(), stream.len() - 2] {
                let data = stream[..cut].to_vec();
                let mut r = BufReader::with_capacity(capacity, Pieces { data, at: 0, piece });
                let mut buf = Vec::new();
                let what = format!("capacity {capacity}, piece {piece}, cut at {cut}");
                let last = if cut == stream.len() { 5 } else { 4 };
                for f in &farewells[..last] {
                    let got = read_frame(&mut r, &mut buf, &limits, &origin).await;
                    assert_eq!(got.unwrap(), Frame::Close(f.clone()), "{what}");
                }
                let e = read_frame(&mut r, &mut buf, &limits, &origin)
                    .await
                    .unwrap_err();
                // Cut inside the last frame: the end of stream surfaces from inside a read.
                assert_eq!(e.class(), "peer_closed", "{what}: {e}");
                let clean = matches!(&e, Error::PeerClosed { reason, .. }
                    if reason == "the peer closed the connection");
                assert_eq!(clean, cut == stream.len(), "{what}: {e}");
            }
        }
    }
    // A length over the limit fails as a limit error, whether or not its body is there.
    let small = Limits {
        max_frame_size: 100,
        ..Limits::default()
    };
    for piece in [2, 5000] {
        let mut frame = Vec::new();
        wire::encode_serde(&mut frame, FrameKind::Close, &farewells[3]);
        let mut r = BufReader::new(Pieces {
            data: frame,
            at: 0,
            piece,
        });
        let e = read_frame(&mut r, &mut Vec::new(), &small, &origin)
            .await
            .unwrap_err();
        assert_eq!(e.class(), "limit", "piece {piece}: {e}");
    }
}

/// The bytes of a message with a payload and three tensors (the second empty) as a writer
/// sends them: descriptor frame, payload, each tensor's chunks (`split`: the first tensor's
/// in two), a ping between the tensors if `ping`, then a close frame. Returns them with the
/// message's inline bytes.
fn small_message(split: bool, ping: bool, index: u32) -> (Vec<u8>, Vec<u8>) {
    let t0 = vec![1u8; 64];
    let t2 = vec![2u8; 5];
    let msg = crate::message::Message::new()
        .with_payload(Payload::new(b"pay".to_vec()))
        .with_tensor(crate::message::Tensor::cpu(t0.clone()))
        .with_tensor(crate::message::Tensor::cpu(Vec::new()))
        .with_tensor(crate::message::Tensor::cpu(t2.clone()));
    let mut s = Vec::new();
    wire::encode_frame(&mut s, FrameKind::Descriptor, |b| {
        wire::encode_descriptor(b, 3, &msg, |_, _| 0)
    });
    s.extend_from_slice(b"pay");
    if split {
        encode_chunk_header(&mut s, 3, index, 0, 32);
        s.extend_from_slice(&t0[..32]);
        encode_chunk_header(&mut s, 3, index, 32, 32);
        s.extend_from_slice(&t0[32..]);
    } else {
        encode_chunk_header(&mut s, 3, index, 0, 64);
        s.extend_from_slice(&t0);
    }
    if ping {
        s.extend_from_slice(&wire::PING_FRAME);
    }
    encode_chunk_header(&mut s, 3, 2, 0, 5);
    s.extend_from_slice(&t2);
    wire::encode_serde(
        &mut s,
        FrameKind::Close,
        &wire::Farewell {
            reason: "bye".into(),
            graceful: true,
        },
    );
    (s, [&b"pay"[..], &t0, &t2].concat())
}

/// A read loop's buffered reader over `stream`, delivered `piece` bytes at a time.
fn pieces(stream: &[u8], piece: usize) -> BufReader<BoxRead> {
    let data = stream.to_vec();
    BufReader::with_capacity(8192, Box::new(Pieces { data, at: 0, piece }))
}

/// The op for the next frame, on a stream that carries every tensor (basic).
fn frame_op(reply: &Reply) -> InOp {
    InOp::Frame {
        ticket: 0,
        reply: reply.clone(),
        more: 0,
        carried: Carried::All,
        catch: None,
    }
}

/// A small message's tensors come out of the read buffer with its frame (`buffered_inline`)
/// when they lie there whole, one chunk each; cut any other way (chunks split, a ping between
/// them, a stream that delivers a few bytes at a time) the general path reads the same bytes,
/// and a chunk for the wrong tensor fails the read either way.
#[tokio::test]
async fn a_small_messages_tensors_read_the_same_from_the_buffer_or_not() {
    let limits = Limits::default();
    let origin = Origin::new("test://inline", "test");
    let (reply, _done) = mpsc::unbounded_channel();
    for (split, ping) in [(false, false), (true, false), (false, true)] {
        let (stream, want) = small_message(split, ping, 0);
        // Straight from the buffer only in the writer's usual shape.
        let at = LEN_PREFIX + u32::from_le_bytes(stream[..4].try_into().unwrap()) as usize;
        let wd = match wire::decode_frame(&stream[LEN_PREFIX..at], &limits).unwrap() {
            Frame::Descriptor(wd) => wd,
            f => panic!("{f:?}"),
        };
        let fast = buffered_inline(&stream[at..], &wd, Carried::All, 3, want.len(), &limits);
        assert_eq!(
            fast.is_some(),
            !split && !ping,
            "split {split}, ping {ping}"
        );
        if let Some((bytes, used)) = fast {
            assert_eq!(bytes, want);
            // Up to the close frame, which the read loop's next frame op decodes in place.
            let rest = &stream[at + used..];
            let end = LEN_PREFIX + u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            let close = wire::decode_frame(&rest[LEN_PREFIX..end], &limits);
            assert!(matches!(close, Ok(Frame::Close(_))), "{close:?}");
        }
        assert!(buffered_inline(&stream[at..at + 80], &wd, Carried::All, 3, 72, &limits).is_none());
        for piece in [1, 7, 70, stream.len()] {
            let what = format!("split {split}, ping {ping}, piece {piece}");
            let (mut r, mut op) = (pieces(&stream, piece), frame_op(&reply));
            let (mut buf, mut spare) = (Vec::new(), None);
            let got = read_op(&mut r, &mut op, &mut buf, &mut spare, &limits, &origin).await;
            let (frame, bytes) = got.unwrap().expect("a frame op reads a frame");
            assert!(
                matches!(frame, Frame::Descriptor(ref wd) if wd.seq == 3),
                "{what}"
            );
            assert_eq!(bytes, want, "{what}");
            let next = read_frame(&mut r, &mut buf, &limits, &origin)
                .await
                .unwrap();
            assert!(matches!(next, Frame::Close(_)), "{what}: {next:?}");
        }
    }
    // The first tensor's chunk names tensor 1: a protocol error, from the buffer or not.
    let (stream, _) = small_message(false, false, 1);
    for piece in [7, stream.len()] {
        let (mut r, mut op) = (pieces(&stream, piece), frame_op(&reply));
        let e = read_op(
            &mut r,
            &mut op,
            &mut Vec::new(),
            &mut None,
            &limits,
            &origin,
        )
        .await
        .unwrap_err();
        assert_eq!(e.class(), "protocol", "piece {piece}: {e}");
    }
}
