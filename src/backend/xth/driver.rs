//! The `xth` channel's driver: buffers parked in the process-wide table of [`super`]; whichever
//! side arrives second copies once.

use crate::channel::driver::{Cx, Driver, RecvTensor, SendTensor};
use crate::error::Error;
use crate::transport::stream::{Done, Memory};

use super::Key;

/// One pipe's `xth` channel.
#[derive(Debug)]
pub(crate) struct XthDriver {
    /// This pipe's id (the sender's part of every key).
    pipe: u64,
    /// Parked tensors, with their direction (`true` when sending).
    keys: Vec<(bool, Key)>,
}

impl XthDriver {
    pub(crate) fn new(pipe: u64) -> Self {
        XthDriver {
            pipe,
            keys: Vec::new(),
        }
    }
}

impl Driver for XthDriver {
    type Event = ();

    fn send(&mut self, m: SendTensor, cx: &mut Cx<'_, ()>) {
        let key = Key {
            sender: self.pipe,
            seq: m.seq,
            index: m.index,
        };
        self.keys.push((true, key));
        super::send(key, m.buffer, cx.core.own());
    }

    fn recv(&mut self, m: RecvTensor, cx: &mut Cx<'_, ()>) {
        let Ok(sender) = <[u8; 8]>::try_from(m.data.as_slice()).map(u64::from_le_bytes) else {
            let e = Error::protocol("xth channel data is not a pipe id", &cx.core.origin);
            let buffer = Memory::Owned(m.buffer);
            return cx.core.hand_back(false, m.seq, m.index, buffer, Err(e));
        };
        let key = Key {
            sender,
            seq: m.seq,
            index: m.index,
        };
        self.keys.push((false, key));
        let reply = cx.core.own();
        super::recv(key, m.buffer, reply, &cx.core.origin);
    }

    /// A completion from the table: the tensor is no longer parked; on to the pipe.
    fn on_done(&mut self, d: Done, cx: &mut Cx<'_, ()>) {
        let key = match &d {
            Done::WroteTensor { seq, index, .. } => (true, *seq, *index),
            Done::Tensor { seq, index, .. } => (false, *seq, *index),
            other => return tracing::error!(?other, "unexpected completion on an xth channel"),
        };
        self.keys.retain(|(out, k)| (*out, k.seq, k.index) != key);
        cx.core.to_pipe(d);
    }

    fn stop(&mut self, e: Error, _: &mut Cx<'_, ()>) {
        for (_, k) in &self.keys {
            // Every key gets exactly one completion through our queue: from the withdrawal,
            // or from the other side if it got there first. Either way `on_done` removes it.
            super::withdraw(*k, &e);
        }
    }

    fn drained(&mut self, _: &mut Cx<'_, ()>) -> bool {
        self.keys.is_empty()
    }
}
