//! The cross-thread channel: both ends in one process (two contexts), one copy straight from the
//! sender's buffer into the receiver's.
//!
//! The sender parks its buffer in a process-wide table under (sender pipe id, message, tensor);
//! the receiver learns the sender's pipe id from the descriptor and parks its destination under
//! the same key. Whoever arrives second copies and completes both sides, so neither waits on the
//! other's mailbox. Either side can withdraw what it parked when its pipe closes.

pub(crate) mod driver;

use crate::keymap::KeyMap;
use std::sync::{Mutex, OnceLock};

use crate::channel::ChannelBackend;
use crate::error::{Error, Origin};
use crate::negotiate::DevicePair;
use crate::transport::stream::{Done, Memory, Reply};

/// The cross-thread channel backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct Xth;

/// A token unique to this process: the xth domain descriptor.
pub fn process_token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        format!("pid={};token={:016x}", std::process::id(), h.finish())
    })
}

impl crate::channel::sealed::Sealed for Xth {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::Xth { pipe: at.pipe }
    }
}

impl ChannelBackend for Xth {
    fn name(&self) -> &'static str {
        "xth"
    }

    fn priority(&self) -> i32 {
        300
    }

    fn domain(&self) -> String {
        process_token().to_string()
    }

    fn devices(&self) -> DevicePair {
        DevicePair::CPU
    }
}

/// Names one tensor in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// The sending pipe's process-local id.
    pub sender: u64,
    /// Message sequence number.
    pub seq: u64,
    /// Tensor index.
    pub index: u32,
}

enum Slot {
    Sent {
        buffer: Memory,
        reply: Reply,
    },
    Wanted {
        dst: Vec<u8>,
        reply: Reply,
        origin: Origin,
    },
}

fn table() -> &'static Mutex<KeyMap<Key, Slot>> {
    static TABLE: OnceLock<Mutex<KeyMap<Key, Slot>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, KeyMap<Key, Slot>> {
    // A panic while holding the lock cannot leave the map inconsistent (each operation is one
    // insert or remove), so a poisoned lock is still usable.
    table().lock().unwrap_or_else(|p| p.into_inner())
}

/// Copies `src` into `dst` and completes both sides.
fn finish(
    key: Key,
    src: Memory,
    src_reply: &Reply,
    mut dst: Vec<u8>,
    dst_reply: &Reply,
    origin: &Origin,
) {
    let result = if src.len() == dst.len() {
        crate::copy::copy_large(&mut dst, src.as_slice());
        Ok(())
    } else {
        Err(Error::protocol(
            format!(
                "xth tensor {} of message {}: the sender has {} bytes, the receiver {}",
                key.index,
                key.seq,
                src.len(),
                dst.len()
            ),
            origin,
        ))
    };
    let _ = src_reply.send(Done::WroteTensor {
        seq: key.seq,
        index: key.index,
        memory: src,
        result: result.clone(),
        stand_in: false,
    });
    let _ = dst_reply.send(Done::Tensor {
        seq: key.seq,
        index: key.index,
        memory: Memory::Owned(dst),
        result,
        stand_in: false,
    });
}

/// The sender parks `buffer`; completes at once if the receiver is already waiting.
pub fn send(key: Key, buffer: Memory, reply: Reply) {
    let mut t = lock();
    match t.remove(&key) {
        Some(Slot::Wanted {
            dst,
            reply: r,
            origin,
        }) => {
            drop(t);
            finish(key, buffer, &reply, dst, &r, &origin);
        }
        Some(other) => {
            // A second send under the same key is a bug on our side; keep the first.
            t.insert(key, other);
            let _ = reply.send(Done::WroteTensor {
                seq: key.seq,
                index: key.index,
                memory: buffer,
                result: Err(Error::invalid("xth: tensor sent twice")),
                stand_in: false,
            });
        }
        None => {
            t.insert(key, Slot::Sent { buffer, reply });
        }
    }
}

/// The receiver parks `dst`; completes at once if the sender's buffer is already there.
pub fn recv(key: Key, dst: Vec<u8>, reply: Reply, origin: &Origin) {
    let mut t = lock();
    match t.remove(&key) {
        Some(Slot::Sent { buffer, reply: r }) => {
            drop(t);
            finish(key, buffer, &r, dst, &reply, origin);
        }
        Some(other) => {
            t.insert(key, other);
            let _ = reply.send(Done::Tensor {
                seq: key.seq,
                index: key.index,
                memory: Memory::Owned(dst),
                result: Err(Error::protocol("xth: tensor received twice", origin)),
                stand_in: false,
            });
        }
        None => {
            t.insert(
                key,
                Slot::Wanted {
                    dst,
                    reply,
                    origin: origin.clone(),
                },
            );
        }
    }
}

/// Takes back whatever is still parked under `key` and completes it with `error`. Returns
/// whether anything was there (if not, the other side already completed it).
pub fn withdraw(key: Key, error: &Error) -> bool {
    let slot = lock().remove(&key);
    match slot {
        Some(Slot::Sent { buffer, reply }) => {
            let _ = reply.send(Done::WroteTensor {
                seq: key.seq,
                index: key.index,
                memory: buffer,
                result: Err(error.clone()),
                stand_in: false,
            });
            true
        }
        Some(Slot::Wanted { dst, reply, .. }) => {
            let _ = reply.send(Done::Tensor {
                seq: key.seq,
                index: key.index,
                memory: Memory::Owned(dst),
                result: Err(error.clone()),
                stand_in: false,
            });
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    fn key(seq: u64) -> Key {
        Key {
            sender: u64::MAX - 7,
            seq,
            index: 0,
        }
    }

    fn bytes(d: Done) -> (Vec<u8>, Result<(), Error>) {
        match d {
            Done::WroteTensor { memory, result, .. } | Done::Tensor { memory, result, .. } => {
                (memory.as_slice().to_vec(), result)
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn whichever_side_arrives_second_copies() {
        for sender_first in [true, false] {
            let (stx, mut srx) = mpsc::unbounded_channel();
            let (rtx, mut rrx) = mpsc::unbounded_channel();
            let k = key(sender_first as u64);
            if sender_first {
                send(k, Memory::Owned(vec![1, 2, 3]), stx);
                assert!(srx.try_recv().is_err(), "waits for the receiver");
                recv(k, vec![0; 3], rtx, &Origin::default());
            } else {
                recv(k, vec![0; 3], rtx, &Origin::default());
                send(k, Memory::Owned(vec![1, 2, 3]), stx);
            }
            let (src, r) = bytes(srx.try_recv().unwrap());
            r.unwrap();
            assert_eq!(src, vec![1, 2, 3], "sender's buffer handed back");
            let (dst, r) = bytes(rrx.try_recv().unwrap());
            r.unwrap();
            assert_eq!(dst, vec![1, 2, 3]);
        }
    }

    #[test]
    fn size_mismatch_fails_both_and_withdraw_returns_buffers() {
        let (stx, mut srx) = mpsc::unbounded_channel();
        let (rtx, mut rrx) = mpsc::unbounded_channel();
        send(key(10), Memory::Owned(vec![1; 4]), stx.clone());
        recv(key(10), vec![0; 5], rtx, &Origin::default());
        assert!(bytes(srx.try_recv().unwrap()).1.is_err());
        assert!(bytes(rrx.try_recv().unwrap()).1.is_err());

        send(key(11), Memory::Shared(vec![9; 4].into()), stx);
        let e = Error::invalid("closing");
        assert!(withdraw(key(11), &e));
        let (b, r) = bytes(srx.try_recv().unwrap());
        assert_eq!(b, vec![9; 4]);
        assert!(r.is_err());
        assert!(!withdraw(key(11), &e), "nothing left");
    }
}
