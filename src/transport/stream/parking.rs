//! The write half parked while the write loop idles, so the owner can write a message itself.

use super::*;

/// A connection's write half, parked here while its write loop is idle, so that the owner can
/// write a message itself ([`Parking::try_write_batch`]) instead of queueing it and waking the loop:
/// a small message then goes out in the owner's own poll.
#[derive(Default)]
pub struct Parking(std::sync::Mutex<Parked>);

#[derive(Default)]
struct Parked {
    /// The write half, while the loop waits for work with nothing held.
    w: Option<BoxWrite>,
    /// The loop's next ticket, advanced by each message written here.
    next: u64,
    /// The last write made here, a [`Coarse`] reading (the loop's heartbeat counts it).
    last_write: Option<u64>,
    /// A message written here only in part (ticket, bytes written): the loop writes the rest.
    torn: Option<(u64, usize)>,
    /// The connection is stopping: write nothing more here.
    halted: bool,
    /// A chunk header being written here.
    header: Vec<u8>,
}

impl std::fmt::Debug for Parking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parking").finish_non_exhaustive()
    }
}

impl Parking {
    fn lock(&self) -> std::sync::MutexGuard<'_, Parked> {
        // Nothing panics while holding it; a poisoned lock still holds consistent state.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The parked half, when the owner may write ticket `ticket` into it now: the loop idle
    /// with its half parked, nothing torn, not halted, and `ticket` next. The loop holds the
    /// lock only for moments, never across a poll; the owner's writes (the pipe's, a
    /// `PipeWriter`'s, on any thread) are serialised by the owner's own lock, so a failed try
    /// means the loop is taking its half back: let it have the write.
    fn ready(&self, ticket: u64) -> Option<std::sync::MutexGuard<'_, Parked>> {
        let p = self.0.try_lock().ok()?;
        (!p.halted && p.torn.is_none() && p.w.is_some() && p.next == ticket).then_some(p)
    }

    /// From now on, nothing is written here: everything goes through the loop, which stops.
    pub fn halt(&self) {
        self.lock().halted = true;
    }

    /// Writes ops of consecutive tickets (a message and its small tensors) at once, with one
    /// non-blocking vectored write, if the write loop is idle and the first op is the next in
    /// ticket order. It takes the longest run from the front that qualifies (an
    /// [`OutOp::Message`], an [`OutOp::Tensor`] of at most [`DIRECT_TENSOR_MAX`] bytes in one
    /// chunk) and fits one system call, and returns how many ops of it were written whole. The
    /// caller completes those and submits the rest to the loop as usual; if the write stopped
    /// inside an op, the loop writes the rest of that one first (and nothing goes in between).
    pub fn try_write_batch(&self, ops: &[OutOp]) -> usize {
        self.try_write(ops).unwrap_or(0)
    }

    /// [`Parking::try_write`] for one message without tensors (its frame and its payloads,
    /// ticket `ticket`), without building its [`OutOp`]: `None` when nothing was written, else
    /// whether the message was written whole (if not, its first bytes were, and the loop must
    /// write the rest of it: the caller hands it over as the op `try_write` would have had).
    pub fn try_write_message(
        &self,
        ticket: u64,
        frame: &[u8],
        payloads: &[Payload],
    ) -> Option<bool> {
        if 1 + payloads.len() > IOV_BATCH {
            return None;
        }
        let mut p = self.ready(ticket)?;
        let p = &mut *p;
        let w = p.w.as_mut()?;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut write = |iov: &[IoSlice<'_>]| Pin::new(&mut **w).poll_write_vectored(&mut cx, iov);
        let written = match payloads {
            [] => write(&[IoSlice::new(frame)]),
            [one] => write(&[IoSlice::new(frame), IoSlice::new(&one.data)]),
            _ => {
                let mut iov = [IoSlice::new(&[]); IOV_BATCH];
                iov[0] = IoSlice::new(frame);
                for (slot, pl) in iov[1..].iter_mut().zip(payloads) {
                    *slot = IoSlice::new(&pl.data);
                }
                write(&iov[..1 + payloads.len()])
            }
        };
        let k = match written {
            std::task::Poll::Ready(Ok(k)) if k > 0 => k,
            // Not ready, or an error the loop will meet again and report.
            _ => return None,
        };
        p.last_write = Some(Coarse::now_ns());
        let len = frame.len() + payloads.iter().map(|pl| pl.data.len()).sum::<usize>();
        if k >= len {
            p.next += 1;
            Some(true)
        } else {
            p.torn = Some((ticket, k));
            Some(false)
        }
    }

    /// [`Parking::try_write_batch`], telling "nothing written" (`None`: the stream is as it
    /// was, the ops may go anywhere) from "bytes written, this many ops whole" (`Some`: the
    /// ops are committed to this stream's order, and the loop must write what is left of them).
    pub fn try_write(&self, ops: &[OutOp]) -> Option<usize> {
        let mut p = self.ready(ops.first()?.ticket())?;
        let p = &mut *p;
        // The run: each op next in ticket order, qualified, and with room for its slices.
        let mut slices = 0;
        let mut run = 0;
        for (i, op) in ops.iter().enumerate() {
            if op.ticket() != p.next + i as u64 {
                break;
            }
            match op {
                OutOp::Message { payloads, .. } if slices + 1 + payloads.len() <= IOV_BATCH => {
                    slices += 1 + payloads.len();
                }
                OutOp::Tensor {
                    memory,
                    offset: 0,
                    chunk_size,
                    ..
                } if slices + 2 <= IOV_BATCH
                    && (1..=DIRECT_TENSOR_MAX.min(*chunk_size))
                        .contains(&memory.as_slice().len()) =>
                {
                    slices += 2;
                }
                _ => break,
            }
            run += 1;
        }
        if run == 0 {
            return None;
        }
        write_run(p, ops[..run].iter().map(Part::of))
    }

    /// [`Parking::try_write`] for one message and its tensors (the message at `ticket`, tensor
    /// `i` at `ticket + 1 + i`, each in one chunk of message `seq`), without building their
    /// [`OutOp`]s: the same bytes in the same one write. The caller has checked that each
    /// tensor is in host memory, of 1 to [`DIRECT_TENSOR_MAX`] bytes within its chunk size, and
    /// that the frame, the payloads and two slices a tensor fit `IOV_BATCH`. The answer is
    /// `try_write`'s: on a torn write the caller builds the ops from the first not written
    /// whole on, for the loop.
    pub fn try_write_parts(
        &self,
        ticket: u64,
        seq: u64,
        frame: &[u8],
        payloads: &[Payload],
        tensors: &[crate::message::Tensor],
    ) -> Option<usize> {
        if 1 + payloads.len() + 2 * tensors.len() > IOV_BATCH {
            return None;
        }
        let mut p = self.ready(ticket)?;
        let p = &mut *p;
        // What the caller checked, the two things that would write other bytes than the loop.
        if tensors
            .iter()
            .any(|t| t.buffer.as_cpu().is_none_or(|b| b.is_empty()))
        {
            return None;
        }
        let tensors = tensors.iter().enumerate().map(|(i, t)| Part::Tensor {
            seq,
            index: i as u32,
            bytes: t.buffer.as_cpu().unwrap_or_default(),
        });
        write_run(
            p,
            std::iter::once(Part::Message { frame, payloads }).chain(tensors),
        )
    }
}

/// What [`Parking::try_write`] writes of one op, borrowed from it (or from the message it
/// would have been built from).
#[derive(Clone, Copy)]
enum Part<'a> {
    Message {
        frame: &'a [u8],
        payloads: &'a [Payload],
    },
    /// A tensor's bytes, in one chunk at offset 0.
    Tensor {
        seq: u64,
        index: u32,
        bytes: &'a [u8],
    },
}

impl<'a> Part<'a> {
    /// An op's part (a tensor op as one chunk: [`Parking::try_write`] checked it is one).
    fn of(op: &'a OutOp) -> Part<'a> {
        match op {
            OutOp::Message {
                frame, payloads, ..
            } => Part::Message { frame, payloads },
            OutOp::Tensor {
                seq, index, memory, ..
            } => Part::Tensor {
                seq: *seq,
                index: *index,
                bytes: memory.as_slice(),
            },
        }
    }
}

/// Writes `parts`, the ops of tickets `p.next`, `p.next + 1`, ... (at most [`IOV_BATCH`]
/// slices in all), with one non-blocking vectored write: `None` when nothing was written, else
/// how many were written whole (a torn one is left in `p.torn` for the loop).
fn write_run<'a>(p: &mut Parked, parts: impl Iterator<Item = Part<'a>> + Clone) -> Option<usize> {
    // The same bytes as the loop's `write_op` would write: a tensor's chunk header, then it.
    p.header.clear();
    let mut headers = [(0usize, 0usize); IOV_BATCH / 2];
    let mut nh = 0;
    for part in parts.clone() {
        if let Part::Tensor { seq, index, bytes } = part {
            let at = p.header.len();
            encode_chunk_header(&mut p.header, seq, index, 0, bytes.len() as u64);
            *headers.get_mut(nh)? = (at, p.header.len());
            nh += 1;
        }
    }
    let mut iov = [IoSlice::new(&[]); IOV_BATCH];
    let mut lens = [0usize; IOV_BATCH];
    let mut n = 0;
    let mut h = 0;
    let mut ops = 0;
    for (i, part) in parts.enumerate() {
        ops = i + 1;
        match part {
            Part::Message { frame, payloads } => {
                iov[n] = IoSlice::new(frame);
                n += 1;
                lens[i] = frame.len();
                for pl in payloads {
                    iov[n] = IoSlice::new(&pl.data);
                    n += 1;
                    lens[i] += pl.data.len();
                }
            }
            Part::Tensor { bytes, .. } => {
                let (a, b) = headers[h];
                h += 1;
                iov[n] = IoSlice::new(&p.header[a..b]);
                iov[n + 1] = IoSlice::new(bytes);
                n += 2;
                lens[i] = b - a + bytes.len();
            }
        }
    }
    let w = p.w.as_mut()?;
    // A waker that does nothing: if the stream is not ready, the loop takes the ops over and
    // polls with its own.
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut k = match Pin::new(&mut **w).poll_write_vectored(&mut cx, &iov[..n]) {
        std::task::Poll::Ready(Ok(k)) if k > 0 => k,
        // Not ready, or an error the loop will meet again and report.
        _ => return None,
    };
    p.last_write = Some(Coarse::now_ns());
    let mut whole = 0;
    for &len in &lens[..ops] {
        if k >= len {
            k -= len;
            whole += 1;
        } else {
            if k > 0 {
                p.torn = Some((p.next + whole as u64, k));
            }
            break;
        }
    }
    p.next += whole as u64;
    Some(whole)
}

/// The write loop's hold on its write half: in hand while working, parked while idle.
pub(super) struct Pen<'a> {
    pub(super) w: Option<BoxWrite>,
    pub(super) parking: &'a Parking,
    /// Taken over from the parking: a message partly written by the owner.
    pub(super) torn: Option<(u64, usize)>,
    /// The last write, a [`Coarse`] reading: a ping only needs to be about on time.
    pub(super) last_write: u64,
}

impl Pen<'_> {
    /// Parks the write half while the loop waits with nothing held.
    pub(super) fn park(&mut self, next: u64) {
        if self.torn.is_some() {
            return;
        }
        if let Some(w) = self.w.take() {
            let mut p = self.parking.lock();
            p.w = Some(w);
            p.next = next;
        }
    }

    /// Takes the write half back, with what was written meanwhile.
    pub(super) fn unpark(&mut self, seq: &mut Sequencer<OutOp>) {
        if self.w.is_some() {
            return;
        }
        let mut p = self.parking.lock();
        self.w = p.w.take();
        seq.skip_to(p.next);
        self.torn = p.torn.take();
        if let Some(t) = p.last_write.take() {
            self.last_write = self.last_write.max(t);
        }
    }

    pub(super) fn get(&mut self) -> &mut BoxWrite {
        self.w
            .as_mut()
            .expect("the write loop holds its write half")
    }
}
