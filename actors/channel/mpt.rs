//! The `mpt` side of the channel actor: each tensor in stripes, one per lane, read in place.

use super::*;

impl Channel {
    /// A tensor to read from the lanes, once its channel data (its length) is checked.
    pub(super) fn recv_stripes(&mut self, m: RecvTensor, chunk: usize) {
        if let Err(e) = self.check_length(&m, "mpt") {
            return self.hand_back(false, m.seq, m.index, Memory::Owned(m.buffer), Err(e));
        }
        self.stripe(m.seq, m.index, Memory::Owned(m.buffer), false, chunk)
    }

    pub(super) fn stripe(
        &mut self,
        seq: u64,
        index: u32,
        mut buffer: Memory,
        sending: bool,
        chunk: usize,
    ) {
        let len = buffer.len() as u64;
        let lanes = self.lanes.len() as u32;
        // Shared bytes come only with `sending`: regions of them are written from, never into.
        let base = buffer.base_ptr();
        let mut out = 0;
        for (lane, offset, n) in crate::backend::mpt::stripes(len, lanes) {
            // SAFETY: the stripes are disjoint ranges inside `buffer`, whose heap memory stays
            // in `self.held` untouched until every stripe's operation has completed (`release`
            // waits for `out == 0`, and a stopping channel waits for `held` to empty).
            let region = unsafe { Region::new(base.add(offset as usize), n as usize) };
            let memory = Memory::Region(region);
            self.lane_tensor(lane as usize, sending, seq, index, memory, offset, chunk);
            out += 1;
        }
        self.hold((sending, seq, index), buffer, out);
    }
}
