//! The `cma` channel's driver: the receiver reads the sender's memory with `process_vm_readv`
//! on a blocking thread and acknowledges on the side connection; the sender hands the buffer
//! back on the ack. A read refused at run time (EPERM, ENOSYS: ptrace rules, seccomp) falls
//! back to streaming the bytes on the second side connection: the pipe lives on, and the
//! fallback is counted and logged.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{CmaError, RemoteBuffer};
use crate::channel::driver::{Cx, Driver, Held, RecvTensor, SendTensor, ACKS};
use crate::error::Error;
use crate::transport::stream::{Done, Memory, Region};
use crate::wire::Ack;

/// The cma lane carrying fallback bytes (each side's, for the other's refused reads).
const DATA: usize = 1;

/// How long a stopping cma sender waits for its peer to finish reading its buffers.
pub(crate) const GRACE: Duration = Duration::from_secs(5);

/// One pipe's `cma` channel.
#[derive(Debug)]
pub(crate) struct CmaDriver {
    /// Threads per read.
    threads: usize,
    /// The chunk size of fallback transfers.
    chunk: usize,
    /// Reads running on blocking threads.
    reading: usize,
}

/// What comes back to the driver.
#[derive(Debug)]
pub(crate) enum CmaEvent {
    /// A read on a blocking thread has ended.
    Read {
        seq: u64,
        index: u32,
        dst: Vec<u8>,
        result: Result<(), CmaError>,
    },
    /// A stopping channel's grace period is over: its side connections go.
    Grace,
    /// The grace after the acknowledgement connection fell silent is over: the tensors still
    /// waiting for an acknowledgement fail with its error.
    Silent(Error),
}

impl CmaDriver {
    pub(crate) fn new(threads: usize, chunk: usize) -> Self {
        CmaDriver {
            threads,
            chunk,
            reading: 0,
        }
    }

    /// The receiver cannot read our memory (a refused ack): stream the bytes on the data lane.
    fn on_ack(&mut self, ack: Ack, cx: &mut Cx<'_, CmaEvent>) {
        let core = &mut *cx.core;
        let key = (true, ack.seq, ack.tensor);
        let Some(h) = core.held.get_mut(&key).filter(|h| h.awaiting_ack) else {
            let e = Error::protocol(
                format!(
                    "cma acknowledgement for message {} tensor {}, which is not waiting for one",
                    ack.seq, ack.tensor
                ),
                &core.origin,
            );
            return core.fail_held(e);
        };
        h.awaiting_ack = false;
        if ack.ok {
            h.out -= 1;
            return core.release(key);
        }
        let n = h.buffer.len();
        let ptr = h.buffer.base_ptr();
        // SAFETY: the buffer stays in the held tensors, untouched, until this operation
        // completes (its `Done` decrements `out`, which is still 1 for the ack we were waiting
        // for); the operation is a write, so shared bytes are only read through the region.
        let region = unsafe { Region::new(ptr, n) };
        let memory = Memory::Region(region);
        core.lane_tensor(DATA, true, ack.seq, ack.tensor, memory, 0, self.chunk);
    }

    fn on_read(
        &mut self,
        seq: u64,
        index: u32,
        mut dst: Vec<u8>,
        result: Result<(), CmaError>,
        cx: &mut Cx<'_, CmaEvent>,
    ) {
        self.reading -= 1;
        let core = &mut *cx.core;
        match result {
            Ok(()) => {
                core.send_ack(Ack {
                    seq,
                    tensor: index,
                    ok: true,
                });
                core.to_pipe(Done::Tensor {
                    seq,
                    index,
                    memory: Memory::Owned(dst),
                    result: Ok(()),
                    stand_in: false,
                });
            }
            Err(CmaError::NotPermitted { .. }) if core.lanes.len() > DATA => {
                crate::metrics::fallback("cma");
                if core.fallbacks.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(pipe = ?core.origin.pipe, "cma read refused by the kernel; falling back to the side connection");
                }
                core.send_ack(Ack {
                    seq,
                    tensor: index,
                    ok: false,
                });
                let n = dst.len();
                let ptr = dst.as_mut_ptr();
                core.held
                    .insert((false, seq, index), Held::new(Memory::Owned(dst), 1));
                // SAFETY: as for mpt's stripes: `dst` stays held until this read completes.
                let region = unsafe { Region::new(ptr, n) };
                core.lane_tensor(
                    DATA,
                    false,
                    seq,
                    index,
                    Memory::Region(region),
                    0,
                    self.chunk,
                );
            }
            Err(e) => {
                let e = e.into_error(&core.origin);
                core.hand_back(false, seq, index, Memory::Owned(dst), Err(e));
            }
        }
    }
}

impl Driver for CmaDriver {
    type Event = CmaEvent;

    /// Holds the buffer until the receiver acknowledges its read (or asks for the bytes).
    fn send(&mut self, m: SendTensor, cx: &mut Cx<'_, CmaEvent>) {
        let key = (true, m.seq, m.index);
        let empty = m.buffer.is_empty();
        let mut held = Held::new(m.buffer, usize::from(!empty));
        held.awaiting_ack = !empty;
        cx.core.held.insert(key, held);
        if empty {
            cx.core.release(key);
        } else {
            cx.core.arm_ack();
        }
    }

    fn recv(&mut self, m: RecvTensor, cx: &mut Cx<'_, CmaEvent>) {
        let (seq, index, mut dst) = (m.seq, m.index, m.buffer);
        let remote = match RemoteBuffer::decode(&m.data) {
            Some(r) if r.len == dst.len() as u64 => r,
            _ => {
                let e = Error::protocol(
                    "cma channel data does not describe this tensor",
                    &cx.core.origin,
                );
                return cx
                    .core
                    .hand_back(false, seq, index, Memory::Owned(dst), Err(e));
            }
        };
        if dst.is_empty() {
            // Nothing to read, and the sender expects no acknowledgement for it.
            return cx
                .core
                .hand_back(false, seq, index, Memory::Owned(dst), Ok(()));
        }
        self.reading += 1;
        let threads = self.threads;
        cx.fx.spawn(Box::pin(async move {
            let read = tokio::task::spawn_blocking(move || {
                let result = super::read_remote(&remote, &mut dst, threads);
                (dst, result)
            })
            .await;
            // The blocking task cannot panic short of a bug in the read loop; if it did, its
            // buffer is lost and the pipe reports the tensor as failed.
            let (dst, result) = read.unwrap_or_else(|e| {
                (
                    Vec::new(),
                    Err(CmaError::Other {
                        pid: remote.pid,
                        source: std::io::Error::other(e.to_string()),
                    }),
                )
            });
            CmaEvent::Read {
                seq,
                index,
                dst,
                result,
            }
        }));
    }

    fn on_done(&mut self, d: Done, cx: &mut Cx<'_, CmaEvent>) {
        // Fallback transfers of held buffers are counted against them.
        match cx.core.count_piece(d) {
            Some(Done::Frame { result, .. }) => match cx.core.ack_of(result, "cma") {
                Ok(a) => {
                    self.on_ack(a, cx);
                    if cx.core.held.values().any(|h| h.awaiting_ack) {
                        cx.core.arm_ack();
                    }
                }
                // A silent peer (no heartbeat: frozen, or its host unreachable) may still be
                // reading our buffers, and may go on once it runs again: they go back only
                // after the grace. A peer that hung up or died reads nothing more.
                Err(e) if e.kind() == crate::ErrorClass::Timeout => {
                    cx.fx.later(GRACE, CmaEvent::Silent(e));
                }
                Err(e) => cx.core.fail_held(e),
            },
            Some(Done::Wrote { result: Err(e), .. }) => {
                tracing::debug!(error = %e, "channel acknowledgement not sent")
            }
            _ => {}
        }
    }

    fn on_event(&mut self, e: CmaEvent, cx: &mut Cx<'_, CmaEvent>) {
        match e {
            CmaEvent::Read {
                seq,
                index,
                dst,
                result,
            } => self.on_read(seq, index, dst, result, cx),
            CmaEvent::Grace => cx.core.shutdown_lanes(),
            CmaEvent::Silent(e) => cx.core.fail_held(e),
        }
    }

    /// A peer may be reading our buffers right now: they go back to the user only once it
    /// acknowledges or hangs up its side connection (it does when its reads are over), or
    /// after a grace period if it is frozen.
    fn stop(&mut self, _: Error, cx: &mut Cx<'_, CmaEvent>) {
        cx.fx.later(GRACE, CmaEvent::Grace);
    }

    /// Once our reads are over, the acknowledgement connection is half-closed: the acks already
    /// queued still go out, then the peer reads end-of-stream and knows it may hand back the
    /// buffers it was keeping for us. Our read side stays open for its acks.
    fn drained(&mut self, cx: &mut Cx<'_, CmaEvent>) -> bool {
        if self.reading > 0 {
            return false;
        }
        cx.core.close_lane_writes(ACKS);
        cx.core.held.is_empty()
    }
}
