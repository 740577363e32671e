//! The read loop's shortcut: a `Receive` waiting for the next message, when that message is
//! self-contained (its payloads and its small host tensors read with its frame), is completed
//! by the connection's read loop itself. The application's `ReadDone` then leaves as soon as the frame
//! is decoded, without waiting for a poll of the pipe's task; the pipe catches up on the frame's
//! bookkeeping (sequence number, prefetch tickets, metrics) when it next runs, which is usually
//! together with the application's next operation.
//!
//! Order is kept: a `Receive` is *parked* here only when it is the pipe's only pending read, with
//! no descriptor read ahead, and only the message with the next expected sequence number can
//! take it. Whenever the pipe could start it itself (a descriptor arrived the usual way) or
//! must fail it (the pipe failed), it takes it back first ([`Catcher::reclaim`]); the lock makes
//! the two sides agree on who completed it, even with the read loop on another thread.

//!
//! The same slot holds a standing receive ([`ReceiveAll`], `stand.rs`): the read loop then
//! delivers every self-contained message that comes next in order to its recipient, and goes
//! on reading by itself without telling the pipe ([`Caught::Silently`]).

use std::sync::{Mutex, MutexGuard};

use super::*;
use crate::transport::stream::{Carried, Catch, Caught};

/// A parked `Receive`.
pub(super) struct Parked {
    pub(super) id: u64,
    /// The sequence number of the only message that may take it.
    pub(super) seq: u64,
    pub(super) since: Option<Instant>,
    pub(super) spare: Option<Allocation>,
    pub(super) data_complete: bool,
    pub(super) completer: Completer<ReadDone>,
}

/// A standing receive, as the read loop sees it.
pub(super) struct Stand {
    pub(super) to: Sink<ReadDone>,
    /// The sequence number of the only message the read loop may deliver next. The loop moves
    /// it on as it delivers; the pipe moves it past the messages it read itself once it holds
    /// none (`Pipe::stand_turn`), so a message never overtakes one the pipe still holds.
    pub(super) seq: u64,
    /// The id of the next `ReadDone`, whoever completes it.
    pub(super) next_id: u64,
    /// Messages the read loop delivered.
    pub(super) delivered: u64,
}

enum Slot {
    Empty,
    Parked(Parked),
    Standing(Stand),
    /// The read loop completed it: (when it was issued, bytes read) for the pipe's metrics,
    /// and the message's sequence number.
    Delivered(Option<Instant>, u64, u64),
}

/// What the pipe finds when it looks for its parked `Receive`.
pub(super) enum Reclaim {
    /// Still waiting: the pipe has it back.
    Parked(Parked),
    /// The read loop completed it (see [`Slot::Delivered`]).
    Delivered(Option<Instant>, u64, u64),
    /// Nothing was parked.
    Nothing,
}

/// One per pipe, shared with its read loop through [`InOp::Frame`]'s `catch`.
pub(super) struct Catcher {
    slot: Mutex<Slot>,
    /// The channel of CPU tensors, and which of them its stream carries: a message whose
    /// tensors all go that way (small `basic` tensors, `cma`'s inline ones) can be caught too.
    cpu_channel: usize,
    carried: Carried,
    /// The pipe's routing table, to check each tensor's route as the pipe does.
    routes: Routes,
    /// The pipe's metrics, counted by the read loop for the messages of a standing receive.
    metrics: Arc<PipeMetrics>,
}

impl Catcher {
    pub(super) fn new(
        routes: Routes,
        cpu_channel: usize,
        carried: Carried,
        metrics: Arc<PipeMetrics>,
    ) -> Catcher {
        Catcher {
            slot: Mutex::new(Slot::Empty),
            cpu_channel,
            carried,
            routes,
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // Nothing panics while holding it (completers only queue a message or fill a slot).
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn park(&self, p: Parked) {
        let mut slot = self.lock();
        debug_assert!(matches!(*slot, Slot::Empty), "a second parked Receive");
        *slot = Slot::Parked(p);
    }

    pub(super) fn reclaim(&self) -> Reclaim {
        let mut slot = self.lock();
        match mem::replace(&mut *slot, Slot::Empty) {
            Slot::Empty => Reclaim::Nothing,
            Slot::Parked(p) => Reclaim::Parked(p),
            Slot::Delivered(since, bytes, seq) => Reclaim::Delivered(since, bytes, seq),
            standing @ Slot::Standing(_) => {
                *slot = standing;
                Reclaim::Nothing
            }
        }
    }

    /// Starts a standing receive.
    pub(super) fn stand(&self, s: Stand) {
        let mut slot = self.lock();
        debug_assert!(
            matches!(*slot, Slot::Empty),
            "a stand over a parked Receive"
        );
        *slot = Slot::Standing(s);
    }

    /// Ends the standing receive, if one stands: what the read loop did with it.
    pub(super) fn unstand(&self) -> Option<Stand> {
        let mut slot = self.lock();
        match mem::replace(&mut *slot, Slot::Empty) {
            Slot::Standing(s) => Some(s),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// Runs `f` on the standing receive (the pipe's side of it).
    pub(super) fn with_stand<T>(&self, f: impl FnOnce(&mut Stand) -> T) -> Option<T> {
        match &mut *self.lock() {
            Slot::Standing(s) => Some(f(s)),
            _ => None,
        }
    }

    /// Whether the read loop completed the parked `Receive` (the pipe then takes the record).
    pub(super) fn delivered(&self) -> Option<(Option<Instant>, u64, u64)> {
        let mut slot = self.lock();
        match *slot {
            Slot::Delivered(since, bytes, seq) => {
                *slot = Slot::Empty;
                Some((since, bytes, seq))
            }
            _ => None,
        }
    }

    /// Whether every tensor of `wd` is on the CPU channel, with the empty channel data of a
    /// tensor the stream carries (so it was read with the frame), and routed as the pipe's
    /// `check_descriptor` accepts.
    fn all_read_with_frame(&self, wd: &WireDescriptor) -> bool {
        let tensors = &wd.descriptor.tensors;
        wd.routes.len() == tensors.len()
            && tensors.iter().zip(&wd.routes).all(|(t, (ch, data))| {
                *ch as usize == self.cpu_channel
                    && data.is_empty()
                    && self.carried.carries(data)
                    && (self.routes)
                        .check(self.cpu_channel, t.source_device, t.target_device)
                        .is_ok()
            })
    }
}

impl Catch for Catcher {
    fn catch(&self, wd: &mut WireDescriptor, bytes: &mut Vec<u8>) -> Caught {
        if !self.all_read_with_frame(wd) {
            return Caught::No;
        }
        let mut slot = self.lock();
        match &mut *slot {
            // A recipient that is gone is the pipe's to notice (it fails the pipe).
            Slot::Standing(s) if s.seq == wd.seq && s.to.connected() => {
                // Its payloads' and tensors' bytes, all read with the frame.
                let total = bytes.len() as u64;
                let Ok(message) = self.take(wd, bytes, None) else {
                    // Sizes that fit no address space: the pipe reports it, in order.
                    return Caught::No;
                };
                debug_assert_eq!(total, message.total_bytes());
                // Sent (or the handler called) under the lock, so the pipe cannot deliver a
                // later message before it.
                s.to.send(read(s.next_id, message));
                s.seq += 1;
                s.next_id += 1;
                s.delivered += 1;
                self.metrics.read_whole(total);
                match s.to {
                    Sink::Call(_) => Caught::Called,
                    Sink::Actor(_) => Caught::Silently,
                }
            }
            Slot::Parked(p) if p.seq == wd.seq => {
                let Slot::Parked(p) = mem::replace(&mut *slot, Slot::Empty) else {
                    unreachable!("matched above")
                };
                let total = bytes.len() as u64;
                let message = match self.take(wd, bytes, p.spare) {
                    Ok(m) => m,
                    Err(e) => {
                        *slot = Slot::Parked(Parked { spare: None, ..p });
                        tracing::debug!(error = %e, "a parked Receive left to the pipe");
                        return Caught::No;
                    }
                };
                debug_assert_eq!(total, message.total_bytes());
                // Completed under the lock, so the pipe cannot complete a later read first.
                p.completer.complete(read(p.id, message));
                *slot = Slot::Delivered(p.since, total, p.seq);
                Caught::Told
            }
            _ => Caught::No,
        }
    }
}

impl Catcher {
    /// The message of `wd` and `bytes` (which `all_read_with_frame` accepted), in `spare`'s
    /// buffers or new ones; on an error both are left as they were.
    fn take(
        &self,
        wd: &mut WireDescriptor,
        bytes: &mut Vec<u8>,
        spare: Option<Allocation>,
    ) -> Result<Message, Error> {
        let descriptor = &mut wd.descriptor;
        for t in &mut descriptor.tensors {
            // Where the tensor lands, as `check_descriptor` sets it (checked before).
            if let Ok(target) =
                self.routes
                    .check(self.cpu_channel, t.source_device, t.target_device)
            {
                t.target_device = target;
            }
        }
        if let (None, [d], []) = (
            &spare,
            &mut descriptor.payloads[..],
            &descriptor.tensors[..],
        ) {
            // The one payload is the bytes read with the frame: no copy (the most common
            // small message, kept apart from `cut`: about 200 instructions fewer).
            return Ok(Message {
                metadata: mem::take(&mut descriptor.metadata),
                payloads: vec![Payload {
                    data: mem::take(bytes),
                    metadata: mem::take(&mut d.metadata),
                }],
                tensors: Vec::new(),
            });
        }
        let host =
            |t: &crate::message::TensorDescriptor| t.landing() == crate::message::Device::Cpu;
        if spare.is_none()
            && descriptor.tensors.iter().all(host)
            && descriptor.total_bytes() == bytes.len() as u64
        {
            return Ok(cut(descriptor, bytes));
        }
        let alloc = fill(spare.unwrap_or_default().refit(descriptor)?, bytes);
        Ok(Message {
            metadata: mem::take(&mut descriptor.metadata),
            payloads: (alloc.payloads.into_iter().zip(&mut descriptor.payloads))
                .map(|(data, d)| Payload {
                    data,
                    metadata: mem::take(&mut d.metadata),
                })
                .collect(),
            tensors: (alloc.tensors.into_iter().zip(&mut descriptor.tensors))
                .map(|(buffer, d)| Tensor {
                    buffer,
                    metadata: mem::take(&mut d.metadata),
                    target_device: d.target_device,
                })
                .collect(),
        })
    }
}

/// A successful read of host memory (nothing for CUDA to wait for).
fn read(id: u64, message: Message) -> ReadDone {
    ReadDone {
        id,
        result: Ok(()),
        message,
        stand_ins: Vec::new(),
        #[cfg(feature = "cuda")]
        cuda: Default::default(),
    }
}

/// The message of `descriptor` whose buffers (payloads, then tensors, all in host memory) are
/// `bytes` in order: each an exact-size copy of its bytes, except the last, which is `bytes`
/// itself with the others' bytes drained from its front. A message of one buffer (a payload,
/// or a tensor) so costs no allocation and no copy; each further buffer one of each, where
/// filling a fresh allocation would cost it zeroed and two lists more.
fn cut(descriptor: &mut Descriptor, bytes: &mut Vec<u8>) -> Message {
    struct Cutter<'a> {
        bytes: &'a mut Vec<u8>,
        at: usize,
        left: usize,
    }
    impl Cutter<'_> {
        fn next(&mut self, len: u64) -> Vec<u8> {
            // The lengths add up to `bytes.len()` (the caller checked): they fit.
            let len = len as usize;
            self.left -= 1;
            if self.left == 0 {
                self.bytes.drain(..self.at);
                debug_assert_eq!(self.bytes.len(), len);
                return mem::take(self.bytes);
            }
            let v = self.bytes[self.at..self.at + len].to_vec();
            self.at += len;
            v
        }
    }
    let left = descriptor.payloads.len() + descriptor.tensors.len();
    let mut c = Cutter { bytes, at: 0, left };
    let payloads = (descriptor.payloads.iter_mut())
        .map(|d| Payload {
            data: c.next(d.length),
            metadata: mem::take(&mut d.metadata),
        })
        .collect();
    let tensors = (descriptor.tensors.iter_mut())
        .map(|d| Tensor {
            buffer: Buffer::Cpu(c.next(d.length)),
            metadata: mem::take(&mut d.metadata),
            target_device: d.target_device,
        })
        .collect();
    Message {
        metadata: mem::take(&mut descriptor.metadata),
        payloads,
        tensors,
    }
}

/// `bytes` (the payloads, then the tensors, one after the other) copied into `a`'s buffers,
/// which `Allocation::refit` sized to match, the tensors' in host memory.
fn fill(mut a: Allocation, bytes: &[u8]) -> Allocation {
    let mut at = 0;
    let mut take = |b: &mut [u8]| {
        b.copy_from_slice(&bytes[at..at + b.len()]);
        at += b.len();
    };
    a.payloads.iter_mut().for_each(|b| take(b));
    // `refit` made each tensor's buffer host memory of its size (they land in host memory).
    for v in a.tensors.iter_mut().filter_map(Buffer::as_cpu_mut) {
        take(v);
    }
    a
}

impl Pipe {
    /// Parks a `Receive` for the read loop if it is the only pending read and nothing is read
    /// ahead; otherwise hands its parts back.
    pub(super) fn try_park(&mut self, p: Parked) -> Result<(), Parked> {
        // The application often asks for the next message before the pipe has taken in the
        // frame of the one the read loop just delivered: settle that one first.
        if matches!(self.reads.front(), Some(PendingRead::Caught { .. })) {
            self.advance_reads();
        }
        let idle = self.error.is_none()
            && self.reads.is_empty()
            && self.current.is_none()
            && self.prefetch.ready.is_empty()
            && self.conn.is_some();
        if !idle {
            return Err(p);
        }
        let id = p.id;
        // Frames the read loop delivered may not have reached the pipe yet.
        let seq = self.expect_seq.max(self.caught_through);
        self.catcher.park(Parked { seq, ..p });
        self.reads.push_back(PendingRead::Caught {
            id,
            delivered: None,
        });
        Ok(())
    }

    /// `try_start` for a parked `Receive`: started once delivered; taken back (and started the
    /// usual way) when the pipe has its descriptor or must fail it; left parked otherwise.
    pub(super) fn try_start_caught(&mut self, op: &mut PendingRead) -> bool {
        let PendingRead::Caught { delivered, .. } = op else {
            unreachable!("only for parked reads")
        };
        if delivered.is_some() {
            return true;
        }
        let found = if self.error.is_none() && self.prefetch.ready.is_empty() {
            match self.catcher.delivered() {
                Some((since, bytes, seq)) => Reclaim::Delivered(since, bytes, seq),
                None => return false,
            }
        } else {
            self.catcher.reclaim()
        };
        match found {
            Reclaim::Delivered(since, bytes, seq) => {
                *delivered = Some((since, bytes));
                self.caught_through = seq + 1;
                true
            }
            Reclaim::Parked(p) => {
                *op = PendingRead::Read {
                    id: p.id,
                    since: p.since,
                    completer: p.completer,
                    message: Message::default(),
                    state: ReadState::Receiving(p.spare),
                    data_complete: p.data_complete,
                };
                self.try_start(op)
            }
            Reclaim::Nothing => unreachable!("a parked read is in the slot until taken"),
        }
    }
}
