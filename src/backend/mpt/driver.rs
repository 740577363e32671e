//! The `mpt` channel's driver: each tensor in stripes ([`super::stripes`]), one per lane, read
//! in place; the tensor goes back to the pipe with its last stripe.

use crate::channel::driver::{Cx, Driver, RecvTensor, SendTensor};
use crate::transport::stream::{Done, Memory, Region};

/// One pipe's `mpt` channel.
#[derive(Debug)]
pub(crate) struct MptDriver {
    /// The chunk size of the stripes' frames.
    chunk: usize,
}

impl MptDriver {
    pub(crate) fn new(chunk: usize) -> Self {
        MptDriver { chunk }
    }

    fn stripe(&self, seq: u64, index: u32, mut buffer: Memory, sending: bool, cx: &mut Cx<'_, ()>) {
        let len = buffer.len() as u64;
        let lanes = cx.core.lanes.len() as u32;
        // Shared bytes come only with `sending`: regions of them are written from, never into.
        let base = buffer.base_ptr();
        let mut out = 0;
        for (lane, offset, n) in super::stripes(len, lanes) {
            // SAFETY: the stripes are disjoint ranges inside `buffer`, whose heap memory stays
            // in the core's held tensors untouched until every stripe's operation has completed
            // (`release` waits for `out == 0`, and a stopping channel waits for `held` to
            // empty).
            let region = unsafe { Region::new(base.add(offset as usize), n as usize) };
            let memory = Memory::Region(region);
            cx.core.lane_tensor(
                lane as usize,
                sending,
                seq,
                index,
                memory,
                offset,
                self.chunk,
            );
            out += 1;
        }
        cx.core.hold((sending, seq, index), buffer, out);
    }
}

impl Driver for MptDriver {
    type Event = ();

    fn send(&mut self, m: SendTensor, cx: &mut Cx<'_, ()>) {
        self.stripe(m.seq, m.index, m.buffer, true, cx);
    }

    /// A tensor to read from the lanes, once its channel data (its length) is checked.
    fn recv(&mut self, m: RecvTensor, cx: &mut Cx<'_, ()>) {
        if let Err(e) = cx.core.check_length(&m, "mpt") {
            let buffer = Memory::Owned(m.buffer);
            return cx.core.hand_back(false, m.seq, m.index, buffer, Err(e));
        }
        self.stripe(m.seq, m.index, Memory::Owned(m.buffer), false, cx);
    }

    fn on_done(&mut self, d: Done, cx: &mut Cx<'_, ()>) {
        if let Some(other) = cx.core.count_piece(d) {
            tracing::error!(?other, "unexpected completion on an mpt lane");
        }
    }
}
