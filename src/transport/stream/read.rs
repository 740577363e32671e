//! The read loop: frames, inline payloads and tensor chunks in ticket order, into the caller's
//! buffers.

use super::*;

/// The most payloads, and the most tensors, a descriptor the read loop keeps for its lists
/// ([`read_frame_reusing`]) may have room for.
const SPARE_ENTRIES: usize = 64;

/// Reads one frame's bytes (after the prefix) into `buf`. End of stream before the first byte
/// is a clean close by the peer.
pub async fn read_frame_bytes<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<(), Error> {
    let mut prefix = [0u8; LEN_PREFIX];
    let mut got = 0;
    while got < LEN_PREFIX {
        let n = r
            .read(&mut prefix[got..])
            .await
            .map_err(|e| io_error("reading a frame", e, origin))?;
        if n == 0 {
            let reason = if got == 0 {
                "the peer closed the connection".to_string()
            } else {
                "connection lost in the middle of a frame".to_string()
            };
            return Err(Error::PeerClosed {
                reason,
                graceful: false,
                origin: origin.clone(),
            });
        }
        got += n;
    }
    let len =
        wire::check_frame_len(u32::from_le_bytes(prefix), limits).map_err(|e| e.at(origin))?;
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf)
        .await
        .map_err(|e| io_error("reading a frame", e, origin))?;
    Ok(())
}

/// The length (prefix included) of the frame at the start of `avail`, if all of it is there.
fn whole_frame(avail: &[u8], limits: &Limits, origin: &Origin) -> Result<Option<usize>, Error> {
    let Some(prefix) = avail.first_chunk::<LEN_PREFIX>() else {
        return Ok(None);
    };
    let len =
        wire::check_frame_len(u32::from_le_bytes(*prefix), limits).map_err(|e| e.at(origin))?;
    Ok((avail.len() - LEN_PREFIX >= len).then_some(LEN_PREFIX + len))
}

/// Reads and decodes one frame, skipping heartbeats.
///
/// A frame that is in the read buffer whole (a small frame usually arrives in one read) is
/// decoded where it lies; any other is read into `buf` first.
pub async fn read_frame<R: AsyncBufRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<Frame, Error> {
    read_frame_reusing(r, buf, &mut None, limits, origin).await
}

/// [`read_frame`], decoding a descriptor into the lists of `spare`, a descriptor done with
/// ([`wire::decode_frame_reusing`]).
async fn read_frame_reusing<R: AsyncBufRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut Vec<u8>,
    spare: &mut Option<WireDescriptor>,
    limits: &Limits,
    origin: &Origin,
) -> Result<Frame, Error> {
    loop {
        let avail = r
            .fill_buf()
            .await
            .map_err(|e| io_error("reading a frame", e, origin))?;
        let decoded = match whole_frame(avail, limits, origin)? {
            Some(end) => {
                let f = wire::decode_frame_reusing(&avail[LEN_PREFIX..end], limits, spare);
                r.consume(end);
                f
            }
            None => {
                read_frame_bytes(r, buf, limits, origin).await?;
                let f = wire::decode_frame_reusing(buf, limits, spare);
                if buf.capacity() > 4 * FRAME_BUFFER {
                    // One large frame should not pin its buffer for the life of the pipe.
                    buf.clear();
                    buf.shrink_to(FRAME_BUFFER);
                }
                f
            }
        };
        // Returned from here, not carried out of the loop: fewer copies of the frame.
        match decoded {
            Ok(Frame::Ping) => continue,
            Ok(f) => return Ok(f),
            Err(e) => return Err(e.at(origin)),
        }
    }
}
#[allow(clippy::too_many_arguments)]
async fn read_tensor(
    r: &mut BufReader<BoxRead>,
    seq: u64,
    index: u32,
    buffer: &mut [u8],
    base: u64,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<(), Error> {
    let total = buffer.len() as u64;
    let mut done = 0u64;
    while done < total {
        let h = match read_frame(r, buf, limits, origin).await? {
            Frame::Chunk(h) => h,
            f => return Err(unexpected(f, "a tensor chunk", origin)),
        };
        if h.seq != seq
            || h.tensor != index
            || h.offset != base + done
            || h.length == 0
            || h.length > total - done
        {
            return Err(Error::protocol(
                format!(
                    "chunk for message {} tensor {} at offset {} of {} bytes does not fit: expected message {seq} tensor {index} at offset {}, {} bytes left",
                    h.seq, h.tensor, h.offset, h.length, base + done, total - done
                ),
                origin,
            ));
        }
        let piece = &mut buffer[done as usize..(done + h.length) as usize];
        r.read_exact(piece)
            .await
            .map_err(|e| io_error("reading a tensor", e, origin))?;
        done += h.length;
    }
    Ok(())
}

/// A message's inline bytes taken straight from the read buffer `avail`, when all of them are
/// there in the shape a writer sends them in: `payloads` bytes of payloads, then each tensor the
/// stream carries in one chunk (its frame and its bytes). Returns the `total` bytes, copied once
/// into a buffer of their size (not zeroed first), and how many bytes of `avail` they took.
/// `None` when anything is missing or in another shape (a chunk split in two, a ping between
/// them, a header that does not fit): the general path then reads it, and tells any error.
pub(super) fn buffered_inline(
    avail: &[u8],
    wd: &WireDescriptor,
    carried: Carried,
    payloads: usize,
    total: usize,
    limits: &Limits,
) -> Option<(Vec<u8>, usize)> {
    if avail.len() < total {
        // Not all here (a large one coming in pieces): no allocation for nothing.
        return None;
    }
    let mut bytes = Vec::with_capacity(total);
    bytes.extend_from_slice(avail.get(..payloads)?);
    let mut at = payloads;
    let tensors = wd.descriptor.tensors.iter().zip(&wd.routes);
    for (i, (t, (_, data))) in tensors.enumerate() {
        if !carried.carries(data) || t.length == 0 {
            continue;
        }
        let rest = &avail[at..];
        let prefix = rest.first_chunk::<LEN_PREFIX>()?;
        let end = LEN_PREFIX.checked_add(u32::from_le_bytes(*prefix) as usize)?;
        let Ok(Frame::Chunk(h)) = wire::decode_frame(rest.get(LEN_PREFIX..end)?, limits) else {
            return None;
        };
        if h.seq != wd.seq || h.tensor != i as u32 || h.offset != 0 || h.length != t.length {
            return None;
        }
        bytes.extend_from_slice(rest.get(end..end.checked_add(h.length as usize)?)?);
        at += end + h.length as usize;
    }
    (bytes.len() == total).then_some((bytes, at))
}

pub(super) async fn read_op(
    r: &mut BufReader<BoxRead>,
    op: &mut InOp,
    buf: &mut Vec<u8>,
    spare: &mut Option<WireDescriptor>,
    limits: &Limits,
    origin: &Origin,
) -> Result<Option<(Frame, Vec<u8>)>, Error> {
    match op {
        InOp::Frame { carried, .. } => {
            // `read_frame_reusing`'s usual case here, a frame the read buffer holds whole, without
            // the layer of its future (polled twice a message: once to park, once woken).
            let frame = loop {
                let avail = r
                    .fill_buf()
                    .await
                    .map_err(|e| io_error("reading a frame", e, origin))?;
                let Some(end) = whole_frame(avail, limits, origin)? else {
                    // The rest of it is still to come: read into `buf` (the buffered part
                    // is found again, without a read).
                    break read_frame_reusing(r, buf, spare, limits, origin).await?;
                };
                let f = wire::decode_frame_reusing(&avail[LEN_PREFIX..end], limits, spare);
                r.consume(end);
                match f {
                    Ok(Frame::Ping) => continue,
                    Ok(f) => break f,
                    Err(e) => return Err(e.at(origin)),
                }
            };
            let mut payloads = Vec::new();
            if let Frame::Descriptor(wd) = &frame {
                if let Some(inline) = inline_len(wd, *carried) {
                    let len = inline.total.unwrap_or(inline.payloads);
                    if len == inline.payloads {
                        if let Some(there) = r.buffer().get(..len) {
                            // The usual small message: its payloads (and nothing else) came
                            // with the frame. Copied into a buffer of their exact size, not
                            // zeroed first and not grown into.
                            payloads = there.to_vec();
                            r.consume(len);
                            return Ok(Some((frame, payloads)));
                        }
                    } else if let Some((bytes, used)) =
                        buffered_inline(r.buffer(), wd, *carried, inline.payloads, len, limits)
                    {
                        // The usual small message with tensors: all of it came with the
                        // frame, each tensor in one chunk.
                        r.consume(used);
                        return Ok(Some((frame, bytes)));
                    }
                    payloads = vec![0; len];
                    let (mine, mut rest) = payloads.split_at_mut(inline.payloads);
                    if let Some(there) = r.buffer().get(..mine.len()) {
                        // They came with the frame: no read to wait on.
                        mine.copy_from_slice(there);
                        r.consume(mine.len());
                    } else {
                        r.read_exact(mine)
                            .await
                            .map_err(|e| io_error("reading a payload", e, origin))?;
                    }
                    if inline.whole() {
                        let tensors = wd.descriptor.tensors.iter().zip(&wd.routes);
                        for (i, (t, (_, data))) in tensors.enumerate() {
                            if !carried.carries(data) {
                                continue;
                            }
                            let (tensor, after) = rest.split_at_mut(t.length as usize);
                            read_tensor(r, wd.seq, i as u32, tensor, 0, buf, limits, origin)
                                .await?;
                            rest = after;
                        }
                    }
                }
            }
            Ok(Some((frame, payloads)))
        }
        InOp::Payloads { buffers, .. } => {
            for b in buffers.iter_mut() {
                r.read_exact(b)
                    .await
                    .map_err(|e| io_error("reading a payload", e, origin))?;
            }
            Ok(None)
        }
        InOp::Tensor {
            seq,
            index,
            memory,
            offset,
            ..
        } => {
            let Some(buffer) = memory.as_mut_slice() else {
                return Err(Error::invalid(
                    "a read into shared, read-only bytes (Buffer::Shared)",
                ));
            };
            read_tensor(r, *seq, *index, buffer, *offset, buf, limits, origin).await?;
            Ok(None)
        }
    }
}

/// Files `op`, a frame op the read loop made itself: in `held`, to run next, when its ticket's
/// turn is now (what `next_op` would return first), else in the sequencer. A ticket the owner
/// used itself (a bug on its side) fails it.
#[inline(always)]
fn follow(seq: &mut Sequencer<InOp>, held: &mut Option<InOp>, op: InOp) {
    let ticket = op.ticket();
    if seq.take_turn(ticket) {
        *held = Some(op);
    } else if let Err(op) = seq.push(ticket, op) {
        op.fail(Error::invalid("duplicate or stale connection ticket"));
    }
}

/// Runs a connection's read side until every sender is gone. With a `heartbeat`, a read that
/// waits `timeout` without receiving a byte fails with [`Error::Timeout`].
pub async fn read_loop(
    mut r: BufReader<BoxRead>,
    mut rx: mpsc::UnboundedReceiver<InOp>,
    stop: Stop,
    limits: Limits,
    origin: Origin,
    heartbeat: Option<Heartbeat>,
) {
    let mut seq = Sequencer::default();
    let mut buf = Vec::with_capacity(256);
    // The last descriptor a catcher took the message of: its lists serve the next decode.
    let mut spare = None;
    let mut halted = false;
    let mut halt = Halt::new(stop);
    let pulse = Pulse::new();
    let give_way = crate::backend::shm::halves::spins(&**r.get_ref());
    if heartbeat.is_some() {
        // Count every byte the stream delivers from now on as a sign of life (bytes already
        // buffered by the handshake are not, but they were received just now anyway).
        let inner = std::mem::replace(r.get_mut(), Box::new(tokio::io::empty()));
        *r.get_mut() = Box::new(Stamped::new(inner, pulse.clone()));
    }
    let timeout = heartbeat.map_or(Duration::MAX, |h| h.timeout);
    let sleep = std::pin::pin!(tokio::time::sleep(
        timeout.min(Duration::from_secs(1 << 30))
    ));
    let mut alarm = Alarm::new(sleep);
    // The next op, when the loop made it itself and it took its turn at once (`follow`).
    let mut held = None;
    // The loop just handed a message to its recipient (a standing receive, or a parked
    // `Receive` with the next frame op at hand), and nothing more is buffered.
    let mut handed = false;
    let failure = loop {
        if std::mem::take(&mut handed) {
            // Spin mode: let the recipient (usually a task of this thread, now ready) run
            // before this task looks for the next frame. That look finds nothing in a
            // ping-pong, and the answer waited for it (a 64 B shm round trip: 2.66 -> 2.16 us on
            // 16 cores, docs/performance.md). Not without spin: there the look parks the task
            // at once, and giving way costs a task poll (about 380 instructions) for nothing
            // measurable. On the `LocalSet` the task is woken at once, not as `yield_now` does:
            // that defers the wake-up until the runtime has polled its I/O driver, some 2,000
            // instructions a message. On the runtime's own queue that deferral is what lets the
            // actors run first (`turns`).
            crate::transport::turns::actors_turn().await;
        }
        let mut op = match held.take() {
            Some(op) => op,
            None => match next_op(&mut seq, &mut rx, &mut halt, &mut halted).await {
                Some(op) => op,
                None if !halted => return,
                None => break cancelled(&origin),
            },
        };
        // Silence counts from the start of a wait, not from the last message.
        pulse.beat();
        let result = tokio::select! {
            biased;
            _ = &mut halt => {
                op.fail(cancelled(&origin));
                break cancelled(&origin);
            }
            r = read_op(&mut r, &mut op, &mut buf, &mut spare, &limits, &origin) => r,
            () = alarm.silence(&pulse, timeout), if heartbeat.is_some() => {
                Err(Error::Timeout {
                    what: "waiting for the peer (no heartbeat or data)",
                    after: timeout,
                    origin: origin.clone(),
                })
            }
        };
        // Matched one at a time, not as a pair: no copy of the op and the result into a tuple.
        let (mut frame, mut payloads) = match result {
            Ok(Some(got)) => got,
            Ok(None) => {
                op.complete(Ok(()));
                continue;
            }
            Err(e) => {
                op.fail(e.clone());
                break e;
            }
        };
        let InOp::Frame {
            ticket,
            reply,
            more,
            carried,
            catch,
        } = op
        else {
            // Not reached: only a frame op reads a frame.
            op.complete(Ok(()));
            continue;
        };
        let whole = matches!(&frame, Frame::Descriptor(wd) if self_contained(wd, carried));
        let caught = match (&catch, &mut frame) {
            (Some(c), Frame::Descriptor(wd)) if whole => c.catch(wd, &mut payloads),
            _ => Caught::No,
        };
        if matches!(caught, Caught::Silently | Caught::Called) {
            match frame {
                // Lists of a message of many parts are not worth pinning.
                Frame::Descriptor(wd)
                    if wd.descriptor.payloads.capacity() <= SPARE_ENTRIES
                        && wd.descriptor.tensors.capacity() <= SPARE_ENTRIES =>
                {
                    spare = Some(wd)
                }
                _ => {}
            }
            // The owner counts this ticket as used when its next frame reaches it.
            let next = InOp::Frame {
                ticket: ticket + 1,
                reply,
                more,
                carried,
                catch,
            };
            follow(&mut seq, &mut held, next);
            // A recipient's task is ready now; a handler has already run.
            handed = caught == Caught::Silently && give_way && r.buffer().is_empty();
            continue;
        }
        let caught = caught == Caught::Told;
        let next = (more > 0 && whole).then(|| InOp::Frame {
            ticket: ticket + 1,
            reply: reply.clone(),
            more: more - 1,
            carried,
            catch,
        });
        send(
            &reply,
            Done::Frame {
                ticket,
                result: Ok(frame),
                payloads,
                caught,
            },
        );
        if let Some(next) = next {
            follow(&mut seq, &mut held, next);
            // A `Receive` the loop completed: its caller's task is ready too.
            handed = caught && give_way && r.buffer().is_empty();
        }
    };
    drop(r);
    fail_all(&mut seq, &mut rx, failure, |op, e| op.fail(e)).await;
}
