//! The `xth` side of the channel actor: buffers parked in the process-wide table of
//! [`crate::backend::xth`]; whichever side arrives second copies once.

use super::*;

impl Channel {
    pub(super) fn send_xth(&mut self, pipe: u64, m: SendTensor) {
        let key = crate::backend::xth::Key {
            sender: pipe,
            seq: m.seq,
            index: m.index,
        };
        self.xth_keys.push((true, key));
        let reply = self.own();
        crate::backend::xth::send(key, m.buffer, reply);
    }

    pub(super) fn recv_xth(&mut self, m: RecvTensor) {
        let sender = match <[u8; 8]>::try_from(m.data.as_slice()) {
            Ok(b) => u64::from_le_bytes(b),
            Err(_) => {
                return self.to_pipe(Done::Tensor {
                    seq: m.seq,
                    index: m.index,
                    memory: Memory::Owned(m.buffer),
                    result: Err(Error::protocol(
                        "xth channel data is not a pipe id",
                        &self.origin,
                    )),
                })
            }
        };
        let key = crate::backend::xth::Key {
            sender,
            seq: m.seq,
            index: m.index,
        };
        self.xth_keys.push((false, key));
        let reply = self.own();
        crate::backend::xth::recv(key, m.buffer, reply, &self.origin);
    }
}
