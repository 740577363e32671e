//! The write loop: operations in ticket order, vectored writes, heartbeats, the farewell.

use super::parking::Pen;
use super::*;

/// Writes every slice completely (after the first `skip` bytes), in one system call when the
/// stream allows.
async fn write_all_vectored<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
    skip: usize,
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, skip);
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Writes `op`, less its first `skip` bytes (written already; only ever within its first batch
/// of slices).
async fn write_op(
    w: &mut BoxWrite,
    op: &OutOp,
    scratch: &mut Vec<u8>,
    mut skip: usize,
) -> std::io::Result<()> {
    match op {
        OutOp::Message {
            frame, payloads, ..
        } => {
            let mut iov = [IoSlice::new(&[]); IOV_BATCH];
            iov[0] = IoSlice::new(frame);
            let mut n = 1;
            for p in payloads {
                if n == IOV_BATCH {
                    write_all_vectored(w, &mut iov[..n], mem::take(&mut skip)).await?;
                    n = 0;
                }
                iov[n] = IoSlice::new(&p.data);
                n += 1;
            }
            write_all_vectored(w, &mut iov[..n], skip).await
        }
        OutOp::Tensor {
            seq,
            index,
            memory,
            offset: base,
            chunk_size,
            ..
        } => {
            let buffer = memory.as_slice();
            for (offset, len) in
                crate::backend::basic::chunks(buffer.len() as u64, *chunk_size as u64)
            {
                scratch.clear();
                encode_chunk_header(scratch, *seq, *index, base + offset, len);
                let body = &buffer[offset as usize..(offset + len) as usize];
                // A first chunk the owner wrote in part ([`Parking::try_write_batch`]): the rest.
                let skip = mem::take(&mut skip);
                write_all_vectored(w, &mut [IoSlice::new(scratch), IoSlice::new(body)], skip)
                    .await?;
            }
            Ok(())
        }
    }
}

/// What an idle writer does: nothing, or a ping after each `interval` of silence.
enum Idle {
    /// The write loop waits for the next operation.
    Op(Option<OutOp>),
    /// The heartbeat is due; the failure if it could not be sent.
    Ping(Result<(), Error>),
}

/// Waits for the next write in ticket order, its write half parked meanwhile while nothing is
/// held. Returns `None` when the queue is closed and nothing is left, or when stopped (then
/// `*halted` is set). The write half is back in hand when it returns.
async fn next_out(
    seq: &mut Sequencer<OutOp>,
    rx: &mut mpsc::UnboundedReceiver<OutOp>,
    stop: &mut Halt,
    halted: &mut bool,
    pen: &mut Pen<'_>,
) -> Option<OutOp> {
    loop {
        if let Some(op) = seq.pop() {
            return Some(op);
        }
        if seq.is_empty() {
            pen.park(seq.next);
        }
        let got = tokio::select! {
            biased;
            _ = &mut *stop => None,
            op = rx.recv() => Some(op),
        };
        pen.unpark(seq);
        let Some(op) = got else {
            *halted = true;
            return None;
        };
        let op = op?;
        if let Err(op) = seq.push(op.ticket(), op) {
            // A duplicate ticket is a bug in the caller; fail the op, keep the loop.
            op.complete(Err(Error::invalid("duplicate or stale connection ticket")));
        }
    }
}

/// Waits for the next operation in ticket order, sending pings while none comes.
async fn next_write(
    seq: &mut Sequencer<OutOp>,
    rx: &mut mpsc::UnboundedReceiver<OutOp>,
    stop: &mut Halt,
    halted: &mut bool,
    beat: Option<(&Heartbeat, Pin<&mut Sleep>)>,
    pen: &mut Pen<'_>,
    origin: &Origin,
) -> Idle {
    let Some((hb, mut alarm)) = beat else {
        return Idle::Op(next_out(seq, rx, stop, halted, pen).await);
    };
    loop {
        tokio::select! {
            biased;
            op = next_out(seq, rx, stop, halted, pen) => return Idle::Op(op),
            () = alarm.as_mut() => {}
        }
        // Interrupted while parked: take the write half back (and what was written meanwhile).
        pen.unpark(seq);
        let clock = Coarse::get();
        if Instant::now() >= clock.instant(pen.last_write) + hb.interval && pen.torn.is_none() {
            let w = pen.w.as_mut().expect("the write loop holds its write half");
            let sent = tokio::select! {
                biased;
                _ = &mut *stop => Err(cancelled(origin)),
                r = w.write_all(&wire::PING_FRAME) => r.map_err(|e| io_error("writing", e, origin)),
            };
            if sent.is_err() {
                return Idle::Ping(sent);
            }
            pen.last_write = Coarse::now_ns();
        }
        alarm
            .as_mut()
            .reset((clock.instant(pen.last_write) + hb.interval).into());
    }
}

/// Runs a connection's write side until every sender is gone. With a `heartbeat`, an idle
/// writer sends a ping after each `interval` without writing. While it waits for work with
/// nothing held, its write half is parked in `parking`, where the owner may write a message
/// itself ([`Parking::try_write_batch`]).
pub async fn write_loop(
    w: BoxWrite,
    mut rx: mpsc::UnboundedReceiver<OutOp>,
    stop: Stop,
    origin: Origin,
    heartbeat: Option<Heartbeat>,
    parking: std::sync::Arc<Parking>,
) {
    let mut seq = Sequencer::default();
    let mut scratch = Vec::with_capacity(64);
    let mut halted = false;
    let mut halt = Halt::new(stop.clone());
    let mut alarm = std::pin::pin!(tokio::time::sleep(
        heartbeat.map_or(Duration::ZERO, |h| h.interval)
    ));
    let mut pen = Pen {
        w: Some(w),
        parking: &parking,
        torn: None,
        last_write: Coarse::now_ns(),
    };
    let failure = loop {
        let beat = heartbeat.as_ref().map(|h| (h, alarm.as_mut()));
        let next = next_write(
            &mut seq,
            &mut rx,
            &mut halt,
            &mut halted,
            beat,
            &mut pen,
            &origin,
        );
        let op = match next.await {
            Idle::Op(op) => op,
            Idle::Ping(r) => break r.err().unwrap_or_else(|| cancelled(&origin)),
        };
        let Some(op) = op else {
            if !halted {
                // Every sender is gone: nothing more to write.
                let _ = pen.get().shutdown().await;
                parking.halt();
                return;
            }
            // Stopped at a frame boundary (unless the owner wrote part of a message the loop
            // has not finished): say goodbye if there is something to say.
            let farewell = stop.borrow().clone().unwrap_or_default();
            if !farewell.frame.is_empty() && pen.torn.is_none() {
                let w = pen.get();
                let bye = async {
                    w.write_all(&farewell.frame).await?;
                    w.shutdown().await
                };
                let _ = tokio::time::timeout(farewell.patience, bye).await;
            }
            break cancelled(&origin);
        };
        // The rest of a message the owner wrote in part.
        let skip = match pen.torn {
            Some((ticket, k)) if ticket == op.ticket() => {
                pen.torn = None;
                k
            }
            _ => 0,
        };
        let result = tokio::select! {
            biased;
            _ = &mut halt => {
                op.complete(Err(cancelled(&origin)));
                break cancelled(&origin);
            }
            r = write_op(pen.w.as_mut().expect("in hand"), &op, &mut scratch, skip) => r,
        };
        pen.last_write = Coarse::now_ns();
        match result {
            Ok(()) => op.complete(Ok(())),
            Err(e) => {
                let e = io_error("writing", e, &origin);
                op.complete(Err(e.clone()));
                break e;
            }
        }
    };
    parking.halt();
    drop(pen);
    fail_all(&mut seq, &mut rx, failure, |op, e| op.complete(Err(e))).await;
}
