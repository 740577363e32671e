//! The operations the loops execute ([`OutOp`], [`InOp`]), the memory they read from or write
//! into ([`Memory`]), and their completions ([`Done`]).

use super::*;

/// Memory a tensor operation reads from or writes into.
#[derive(Debug)]
pub enum Memory {
    /// A buffer the operation owns and hands back.
    Owned(Vec<u8>),
    /// Shared, read-only bytes the operation holds a reference to: for writes only.
    Shared(bytes::Bytes),
    /// Part of a buffer owned elsewhere (a stripe of a tensor split across lanes).
    Region(Region),
}

impl From<crate::message::Buffer> for Memory {
    fn from(b: crate::message::Buffer) -> Self {
        match b {
            crate::message::Buffer::Cpu(v) => Memory::Owned(v),
            crate::message::Buffer::Shared(b) => Memory::Shared(b),
            // The pipe hands device memory to CUDA channels, never to a stream.
            #[cfg(feature = "cuda")]
            crate::message::Buffer::Cuda(_) => {
                debug_assert!(false, "a CUDA buffer handed to a byte stream");
                Memory::Owned(Vec::new())
            }
        }
    }
}

/// A raw, exclusively borrowed piece of memory; see [`Region::new`].
#[derive(Debug)]
pub struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Region is a borrow of its bytes as `Region::new` describes (exclusive for reads
// into it, shared read-only for writes from it); moving it to another thread moves that borrow,
// as `&mut [u8]` and `&[u8]` may be moved.
unsafe impl Send for Region {}
// SAFETY: as `&mut [u8]` is: through `&Region` only reads are possible (`Memory::as_slice`);
// writing needs `&mut` (`Memory::as_mut_slice`). The loops hold `&OutOp` across awaits, and
// run on an I/O thread of their own when the pool has threads.
unsafe impl Sync for Region {}

impl Region {
    /// A region over `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The bytes must stay allocated until the operation holding the region has completed (its
    /// `Done` has been received). Until then, for a read into the region (an `InOp`), nobody else
    /// may access them; for a write from it (an `OutOp`), nobody may write to them (others may
    /// read: a region of [`Memory::Shared`] bytes serves writes only).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Region {
        Region { ptr, len }
    }
}

impl Memory {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Memory::Owned(v) => v,
            Memory::Shared(b) => b,
            // SAFETY: `Region::new`'s contract: the bytes are alive and ours alone.
            Memory::Region(r) => unsafe { std::slice::from_raw_parts(r.ptr, r.len) },
        }
    }

    /// The bytes to read into; `None` for shared, read-only bytes.
    pub(super) fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match self {
            Memory::Owned(v) => Some(v),
            Memory::Shared(_) => None,
            // SAFETY: `Region::new`'s contract: the bytes are alive and ours alone.
            Memory::Region(r) => Some(unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) }),
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes start, for [`Region`]s over parts of them. Through the pointer of a
    /// [`Memory::Shared`] nothing may be written: make regions of it for writes only.
    pub(crate) fn base_ptr(&mut self) -> *mut u8 {
        match self {
            Memory::Owned(v) => v.as_mut_ptr(),
            Memory::Shared(b) => b.as_ptr().cast_mut(),
            Memory::Region(r) => r.ptr,
        }
    }

    /// The owned buffer, if this is one.
    pub fn into_vec(self) -> Option<Vec<u8>> {
        match self {
            Memory::Owned(v) => Some(v),
            Memory::Shared(_) | Memory::Region(_) => None,
        }
    }

    /// The tensor buffer it was made from ([`Memory::from`]); a region gives an empty one.
    pub fn into_buffer(self) -> crate::message::Buffer {
        match self {
            Memory::Owned(v) => crate::message::Buffer::Cpu(v),
            Memory::Shared(b) => crate::message::Buffer::Shared(b),
            Memory::Region(_) => crate::message::Buffer::default(),
        }
    }
}

/// A write, in ticket order.
#[derive(Debug)]
pub enum OutOp {
    /// A pre-encoded frame followed by raw payload bytes.
    Message {
        /// Position in the write order.
        ticket: u64,
        /// The encoded frame (with its length prefix), handed back for reuse.
        frame: Vec<u8>,
        /// Payloads whose `data` follows the frame, handed back.
        payloads: Vec<Payload>,
        /// Where the completion goes.
        reply: Reply,
    },
    /// A tensor (or a stripe of one), as chunk frames each followed by a piece of the memory.
    Tensor {
        /// Position in the write order.
        ticket: u64,
        /// Message sequence number.
        seq: u64,
        /// Tensor index in the message.
        index: u32,
        /// The bytes, handed back.
        memory: Memory,
        /// Where `memory` starts within the tensor.
        offset: u64,
        /// Largest piece per chunk frame.
        chunk_size: usize,
        /// Where the completion goes.
        reply: Reply,
    },
}

/// A read, in ticket order.
#[derive(Debug)]
pub enum InOp {
    /// The next frame, whatever its kind and size (within limits).
    Frame {
        /// Position in the read order.
        ticket: u64,
        /// Where the completion goes.
        reply: Reply,
        /// After a [`self_contained`] descriptor, the loop goes on to read the next frame by
        /// itself, as `Frame { ticket: ticket + 1, reply, more: more - 1 }`, while `more > 0`:
        /// the owner, seeing the same descriptors, counts those tickets as used. This saves a
        /// round through the queue (and a wake of the loop) per small message.
        more: u32,
        /// Which tensors of a descriptor follow it on this stream (see [`inline_len`]).
        carried: Carried,
        /// Offered each self-contained descriptor before it goes to `reply` (see [`Catch`]).
        catch: Option<Catcher>,
    },
    /// Raw bytes exactly filling each buffer, in order.
    Payloads {
        /// Position in the read order.
        ticket: u64,
        /// The receiver's buffers, handed back filled.
        buffers: Vec<Vec<u8>>,
        /// Where the completion goes.
        reply: Reply,
    },
    /// A tensor (or a stripe of one) sent as chunk frames by [`OutOp::Tensor`].
    Tensor {
        /// Position in the read order.
        ticket: u64,
        /// Expected message sequence number.
        seq: u64,
        /// Expected tensor index.
        index: u32,
        /// The receiver's memory, handed back filled.
        memory: Memory,
        /// Where `memory` starts within the tensor.
        offset: u64,
        /// Where the completion goes.
        reply: Reply,
    },
}

/// A completed operation, with its buffers.
#[derive(Debug)]
pub enum Done {
    /// [`OutOp::Message`] finished.
    Wrote {
        /// Its ticket.
        ticket: u64,
        /// The frame buffer, for reuse.
        frame: Vec<u8>,
        /// The payloads.
        payloads: Vec<Payload>,
        /// Outcome.
        result: Result<(), Error>,
    },
    /// [`OutOp::Tensor`] finished.
    WroteTensor {
        /// Message sequence number.
        seq: u64,
        /// Tensor index.
        index: u32,
        /// The memory.
        memory: Memory,
        /// Outcome.
        result: Result<(), Error>,
        /// `memory` is a copy standing in for the buffer handed in, which a provider still
        /// holds (the `efa` channel's, after a failure: docs/efa.md, "Failure").
        stand_in: bool,
    },
    /// [`InOp::Frame`] finished.
    Frame {
        /// Its ticket.
        ticket: u64,
        /// The frame, or why none came.
        result: Result<Frame, Error>,
        /// For a descriptor whose payloads are [inline](inline_payloads): their bytes, one after
        /// the other, then those of the carried tensors if they were read too
        /// ([`inline_len`]). Empty otherwise.
        payloads: Vec<u8>,
        /// The operation's [`Catch`] took the message: the descriptor holds only what the
        /// catcher left of it (its sequence number at least), and `payloads` is empty.
        caught: bool,
    },
    /// [`InOp::Payloads`] finished.
    Payloads {
        /// Its ticket.
        ticket: u64,
        /// The buffers.
        buffers: Vec<Vec<u8>>,
        /// Outcome.
        result: Result<(), Error>,
    },
    /// [`InOp::Tensor`] finished.
    Tensor {
        /// Message sequence number.
        seq: u64,
        /// Tensor index.
        index: u32,
        /// The memory.
        memory: Memory,
        /// Outcome.
        result: Result<(), Error>,
        /// `memory` is a copy standing in for the buffer handed in, which a provider still
        /// holds (the `efa` channel's, after a failure: docs/efa.md, "Failure").
        stand_in: bool,
    },
}

pub(super) trait Ticketed {
    fn ticket(&self) -> u64;
    fn complete(self, result: Result<(), Error>);
}

pub(super) fn send(reply: &Reply, d: Done) {
    // The owner may be gone already (pipe dropped); then nobody wants the answer.
    let _ = reply.send(d);
}

impl Ticketed for OutOp {
    fn ticket(&self) -> u64 {
        match self {
            OutOp::Message { ticket, .. } | OutOp::Tensor { ticket, .. } => *ticket,
        }
    }

    fn complete(self, result: Result<(), Error>) {
        match self {
            OutOp::Message {
                ticket,
                frame,
                payloads,
                reply,
            } => send(
                &reply,
                Done::Wrote {
                    ticket,
                    frame,
                    payloads,
                    result,
                },
            ),
            OutOp::Tensor {
                seq,
                index,
                memory,
                reply,
                ..
            } => send(
                &reply,
                Done::WroteTensor {
                    seq,
                    index,
                    memory,
                    result,
                    stand_in: false,
                },
            ),
        }
    }
}

impl OutOp {
    /// Completes the write with an error, handing its buffers back.
    pub fn fail(self, e: Error) {
        self.complete(Err(e));
    }
}

impl InOp {
    /// Completes the read with an error, handing its buffers back.
    pub fn fail(self, e: Error) {
        match self {
            InOp::Frame { ticket, reply, .. } => send(
                &reply,
                Done::Frame {
                    ticket,
                    result: Err(e),
                    payloads: Vec::new(),
                    caught: false,
                },
            ),
            op => op.complete(Err(e)),
        }
    }
}

impl Ticketed for InOp {
    fn ticket(&self) -> u64 {
        match self {
            InOp::Frame { ticket, .. }
            | InOp::Payloads { ticket, .. }
            | InOp::Tensor { ticket, .. } => *ticket,
        }
    }

    /// Completes a buffer-carrying read (frames complete through [`InOp::fail`] or directly).
    fn complete(self, result: Result<(), Error>) {
        match self {
            InOp::Frame { ticket, reply, .. } => send(
                &reply,
                Done::Frame {
                    ticket,
                    result: result
                        .and_then(|_| Err(Error::invalid("frame read completed without a frame"))),
                    payloads: Vec::new(),
                    caught: false,
                },
            ),
            InOp::Payloads {
                ticket,
                buffers,
                reply,
            } => send(
                &reply,
                Done::Payloads {
                    ticket,
                    buffers,
                    result,
                },
            ),
            InOp::Tensor {
                seq,
                index,
                memory,
                reply,
                ..
            } => send(
                &reply,
                Done::Tensor {
                    seq,
                    index,
                    memory,
                    result,
                    stand_in: false,
                },
            ),
        }
    }
}
