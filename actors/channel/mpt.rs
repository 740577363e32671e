//! The `mpt` side of the channel actor: each tensor in stripes, one per lane, read in place.

use super::*;

impl Channel {
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
        for (lane, offset, n) in crate::channel::mpt::stripes(len, lanes) {
            // SAFETY: the stripes are disjoint ranges inside `buffer`, whose heap memory stays
            // in `self.held` untouched until every stripe's operation has completed (`release`
            // waits for `out == 0`, and a stopping channel waits for `held` to empty).
            let region = unsafe { Region::new(base.add(offset as usize), n as usize) };
            let reply = self.own();
            let l = &mut self.lanes[lane as usize];
            let origin = &self.origin;
            let gone = || Error::Closed {
                reason: "lane already stopped".into(),
                origin: origin.clone(),
            };
            if sending {
                let ticket = l.out_ticket;
                l.out_ticket += 1;
                l.link.write(
                    OutOp::Tensor {
                        ticket,
                        seq,
                        index,
                        memory: Memory::Region(region),
                        offset,
                        chunk_size: chunk,
                        reply,
                    },
                    gone,
                );
            } else {
                let ticket = l.in_ticket;
                l.in_ticket += 1;
                l.link.read(
                    InOp::Tensor {
                        ticket,
                        seq,
                        index,
                        memory: Memory::Region(region),
                        offset,
                        reply,
                    },
                    gone,
                );
            }
            out += 1;
        }
        self.hold((sending, seq, index), buffer, out);
    }
}
