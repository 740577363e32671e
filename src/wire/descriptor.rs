//! The per-message frames, encoded by hand in MessagePack.
//!
//! Descriptor body:
//!
//! ```text
//! [seq, metadata: bin, payloads: [[length, metadata: bin]...],
//!  tensors: [[length, source, target|nil, channel, channel_data: bin, metadata: bin]...]]
//! ```
//!
//! A device is an unsigned int: 0 for the CPU, n + 1 for CUDA device n.
//!
//! Chunk header body: `[seq, tensor, offset, length]`.

use super::{Limits, WireError};
use crate::message::{Descriptor, Device, Message, PayloadDescriptor, TensorDescriptor};

/// A decoded descriptor frame: the user-visible [`Descriptor`] plus what the pipe needs to route
/// each tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireDescriptor {
    /// The message's sequence number on this pipe, starting at 0.
    pub seq: u64,
    /// What the receiver sees.
    pub descriptor: Descriptor,
    /// Per tensor: index of its channel in the negotiated list, and channel-specific bytes.
    pub routes: Vec<(u8, Vec<u8>)>,
}

/// Header in front of each piece of a tensor moved over the control connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Message sequence number.
    pub seq: u64,
    /// Tensor index within the message.
    pub tensor: u32,
    /// Offset of this piece in the tensor.
    pub offset: u64,
    /// Bytes that follow the header.
    pub length: u64,
}

/// The most channel data one tensor carries in a descriptor (`cuda_ipc`'s 164 bytes: two
/// CUDA IPC handles, the allocation's identity and offset, the device).
pub const MAX_CHANNEL_DATA: usize = 192;

/// A channel's per-tensor bytes in a descriptor, kept inline so encoding allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelData {
    len: u8,
    bytes: [u8; MAX_CHANNEL_DATA],
}

impl Default for ChannelData {
    fn default() -> Self {
        ChannelData {
            len: 0,
            bytes: [0; MAX_CHANNEL_DATA],
        }
    }
}

impl ChannelData {
    /// Sets the bytes (at most [`MAX_CHANNEL_DATA`]; a channel never sets more, and a longer
    /// slice is a bug that the debug build catches rather than a truncation the peer sees).
    pub fn set(&mut self, b: &[u8]) {
        debug_assert!(
            b.len() <= MAX_CHANNEL_DATA,
            "channel data of {} bytes",
            b.len()
        );
        let n = b.len().min(self.bytes.len());
        self.bytes[..n].copy_from_slice(&b[..n]);
        self.len = n as u8;
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

fn device_code(d: Device) -> u64 {
    match d {
        Device::Cpu => 0,
        Device::Cuda(i) => i as u64 + 1,
    }
}

fn device_from(code: u64) -> Result<Device, WireError> {
    match code {
        0 => Ok(Device::Cpu),
        n if n - 1 <= u32::MAX as u64 => Ok(Device::Cuda((n - 1) as u32)),
        n => Err(WireError::Malformed(format!(
            "device code {n} out of range"
        ))),
    }
}

// Writing into a Vec<u8> cannot fail; the results are ignored on purpose.
fn put_uint(b: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(b, v);
}

fn put_bin(b: &mut Vec<u8>, v: &[u8]) {
    let _ = rmp::encode::write_bin(b, v);
}

fn put_array(b: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(b, n as u32);
}

/// Appends a descriptor body for `msg` to `buf`. `route(i)` names tensor `i`'s channel index and
/// writes its channel-specific bytes (none for most channels) into the scratch it is given.
pub fn encode_descriptor(
    buf: &mut Vec<u8>,
    seq: u64,
    msg: &Message,
    mut route: impl FnMut(usize, &mut ChannelData) -> u8,
) {
    put_array(buf, 4);
    put_uint(buf, seq);
    put_bin(buf, &msg.metadata);
    put_array(buf, msg.payloads.len());
    for p in &msg.payloads {
        put_array(buf, 2);
        put_uint(buf, p.data.len() as u64);
        put_bin(buf, &p.metadata);
    }
    put_array(buf, msg.tensors.len());
    for (i, t) in msg.tensors.iter().enumerate() {
        let mut data = ChannelData::default();
        let channel = route(i, &mut data);
        put_array(buf, 6);
        put_uint(buf, t.buffer.len());
        put_uint(buf, device_code(t.device()));
        match t.target_device {
            Some(d) => put_uint(buf, device_code(d)),
            None => {
                let _ = rmp::encode::write_nil(buf);
            }
        }
        put_uint(buf, channel as u64);
        put_bin(buf, data.as_slice());
        put_bin(buf, &t.metadata);
    }
}

/// Appends a chunk header body to `buf`.
pub fn encode_chunk(buf: &mut Vec<u8>, h: &ChunkHeader) {
    put_array(buf, 4);
    put_uint(buf, h.seq);
    put_uint(buf, h.tensor as u64);
    put_uint(buf, h.offset);
    put_uint(buf, h.length);
}

/// A cursor over a frame body that turns rmp's errors into [`WireError`]s.
struct Cursor<'a> {
    rest: &'a [u8],
}

fn malformed(what: &str) -> WireError {
    WireError::Malformed(format!("malformed frame: bad {what}"))
}

impl<'a> Cursor<'a> {
    fn uint(&mut self, what: &str) -> Result<u64, WireError> {
        rmp::decode::read_int(&mut self.rest).map_err(|_| malformed(what))
    }

    fn array(&mut self, what: &str) -> Result<u32, WireError> {
        rmp::decode::read_array_len(&mut self.rest).map_err(|_| malformed(what))
    }

    fn fixed_array(&mut self, n: u32, what: &str) -> Result<(), WireError> {
        match self.array(what)? {
            got if got == n => Ok(()),
            got => Err(WireError::Malformed(format!(
                "malformed frame: {what} has {got} fields, expected {n}"
            ))),
        }
    }

    /// A bin field; `budget` is what is left of the metadata limit, charged before copying.
    fn bin(&mut self, what: &str, budget: &mut u64, max: u64) -> Result<Vec<u8>, WireError> {
        let len = rmp::decode::read_bin_len(&mut self.rest).map_err(|_| malformed(what))? as u64;
        if len > *budget {
            return Err(WireError::Limit {
                limit: "metadata size",
                value: max - *budget + len,
                max,
            });
        }
        if len > self.rest.len() as u64 {
            return Err(WireError::Malformed(format!(
                "malformed frame: {what} announces {len} bytes, {} remain",
                self.rest.len()
            )));
        }
        *budget -= len;
        let (head, tail) = self.rest.split_at(len as usize);
        self.rest = tail;
        Ok(head.to_vec())
    }

    /// Checks an announced count and returns a capacity that the remaining bytes can justify:
    /// every element takes at least `min_bytes`, so garbage cannot reserve memory.
    fn count(
        &mut self,
        what: &'static str,
        max: u32,
        min_bytes: usize,
    ) -> Result<(u32, usize), WireError> {
        let n = self.array(what)?;
        if n > max {
            return Err(WireError::Limit {
                limit: what,
                value: n as u64,
                max: max as u64,
            });
        }
        Ok((n, (n as usize).min(self.rest.len() / min_bytes)))
    }

    fn size(&mut self, what: &'static str, max: u64) -> Result<u64, WireError> {
        let v = self.uint(what)?;
        if v > max {
            return Err(WireError::Limit {
                limit: what,
                value: v,
                max,
            });
        }
        Ok(v)
    }

    fn done(&self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError::Malformed(format!(
                "malformed frame: {} trailing bytes",
                self.rest.len()
            )))
        }
    }
}

/// Decodes a descriptor body, checking every limit before allocating for it.
pub fn decode_descriptor(body: &[u8], limits: &Limits) -> Result<WireDescriptor, WireError> {
    let mut c = Cursor { rest: body };
    let max_meta = limits.max_metadata_size;
    let mut budget = max_meta;
    c.fixed_array(4, "descriptor")?;
    let seq = c.uint("sequence number")?;
    let metadata = c.bin("message metadata", &mut budget, max_meta)?;
    let (np, cap) = c.count("payload count", limits.max_payloads, 3)?;
    let mut payloads = Vec::with_capacity(cap);
    for _ in 0..np {
        c.fixed_array(2, "payload entry")?;
        let length = c.size("payload size", limits.max_payload_size)?;
        let metadata = c.bin("payload metadata", &mut budget, max_meta)?;
        payloads.push(PayloadDescriptor { length, metadata });
    }
    let (nt, cap) = c.count("tensor count", limits.max_tensors, 7)?;
    let mut tensors = Vec::with_capacity(cap);
    let mut routes = Vec::with_capacity(cap);
    for _ in 0..nt {
        c.fixed_array(6, "tensor entry")?;
        let length = c.size("tensor size", limits.max_tensor_size)?;
        let source_device = device_from(c.uint("source device")?)?;
        let target_device = if c.rest.first() == Some(&0xc0) {
            c.rest = &c.rest[1..];
            None
        } else {
            Some(device_from(c.uint("target device")?)?)
        };
        let channel = u8::try_from(c.uint("channel index")?)
            .map_err(|_| WireError::Malformed("malformed frame: channel index over 255".into()))?;
        let data = c.bin("channel data", &mut budget, max_meta)?;
        let metadata = c.bin("tensor metadata", &mut budget, max_meta)?;
        tensors.push(TensorDescriptor {
            length,
            source_device,
            target_device,
            metadata,
        });
        routes.push((channel, data));
    }
    c.done()?;
    Ok(WireDescriptor {
        seq,
        descriptor: Descriptor {
            metadata,
            payloads,
            tensors,
        },
        routes,
    })
}

/// A channel's acknowledgement of one tensor, sent by the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    /// Message sequence number.
    pub seq: u64,
    /// Tensor index within the message.
    pub tensor: u32,
    /// `true`: the receiver has the bytes; `false`: it could not take them this way and asks the
    /// sender to send them over the channel's connection instead.
    pub ok: bool,
}

/// Appends an ack body (`[seq, tensor, ok]`) to `buf`.
pub fn encode_ack(buf: &mut Vec<u8>, a: &Ack) {
    put_array(buf, 3);
    put_uint(buf, a.seq);
    put_uint(buf, a.tensor as u64);
    let _ = rmp::encode::write_bool(buf, a.ok);
}

/// Decodes an ack body.
pub fn decode_ack(body: &[u8]) -> Result<Ack, WireError> {
    let mut c = Cursor { rest: body };
    c.fixed_array(3, "ack")?;
    let seq = c.uint("ack sequence number")?;
    let tensor = u32::try_from(c.uint("ack tensor index")?)
        .map_err(|_| WireError::Malformed("malformed frame: tensor index over u32".into()))?;
    let ok = rmp::decode::read_bool(&mut c.rest).map_err(|_| malformed("ack flag"))?;
    c.done()?;
    Ok(Ack { seq, tensor, ok })
}

/// Decodes a chunk header body.
pub fn decode_chunk(body: &[u8]) -> Result<ChunkHeader, WireError> {
    let mut c = Cursor { rest: body };
    c.fixed_array(4, "chunk header")?;
    let seq = c.uint("chunk sequence number")?;
    let tensor = u32::try_from(c.uint("chunk tensor index")?)
        .map_err(|_| WireError::Malformed("malformed frame: tensor index over u32".into()))?;
    let offset = c.uint("chunk offset")?;
    let length = c.uint("chunk length")?;
    c.done()?;
    Ok(ChunkHeader {
        seq,
        tensor,
        offset,
        length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Payload, Tensor};

    fn sample() -> Message {
        let mut t = Tensor::cpu(vec![7; 33]);
        t.metadata = b"tm".to_vec();
        t.target_device = Some(Device::Cuda(3));
        Message::new()
            .with_metadata(b"hello".to_vec())
            .with_payload(Payload {
                data: vec![1; 5],
                metadata: b"pm".to_vec(),
            })
            .with_payload(Payload::new(vec![]))
            .with_tensor(t)
            .with_tensor(Tensor::cpu(vec![]))
    }

    #[test]
    fn descriptor_round_trip() {
        let m = sample();
        let mut buf = Vec::new();
        encode_descriptor(&mut buf, 42, &m, |i, d| {
            d.set(b"cd");
            i as u8
        });
        let d = decode_descriptor(&buf, &Limits::default()).unwrap();
        assert_eq!(d.seq, 42);
        assert_eq!(d.descriptor, m.descriptor());
        assert_eq!(d.routes, vec![(0, b"cd".to_vec()), (1, b"cd".to_vec())]);
    }

    #[test]
    fn limits_refuse_before_allocation() {
        let m = sample();
        let mut buf = Vec::new();
        encode_descriptor(&mut buf, 1, &m, |_, _| 0);
        let tight = Limits {
            max_tensors: 1,
            ..Limits::default()
        };
        assert_eq!(
            decode_descriptor(&buf, &tight),
            Err(WireError::Limit {
                limit: "tensor count",
                value: 2,
                max: 1
            })
        );
        let tight = Limits {
            max_metadata_size: 6,
            ..Limits::default()
        };
        assert!(matches!(
            decode_descriptor(&buf, &tight),
            Err(WireError::Limit {
                limit: "metadata size",
                ..
            })
        ));
        let tight = Limits {
            max_tensor_size: 32,
            ..Limits::default()
        };
        assert!(matches!(
            decode_descriptor(&buf, &tight),
            Err(WireError::Limit {
                limit: "tensor size",
                value: 33,
                ..
            })
        ));
    }

    #[test]
    fn truncation_and_trailing_bytes_are_malformed() {
        let mut buf = Vec::new();
        encode_descriptor(&mut buf, 1, &sample(), |_, _| 0);
        for cut in 0..buf.len() {
            assert!(decode_descriptor(&buf[..cut], &Limits::default()).is_err());
        }
        buf.push(0);
        assert!(matches!(
            decode_descriptor(&buf, &Limits::default()),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn huge_sizes_are_legal_below_the_limit() {
        let m = Message::new();
        let mut buf = Vec::new();
        encode_descriptor(&mut buf, 0, &m, |_, _| 0);
        // Hand-build a tensor entry of 5 GiB: sizes are u64.
        let mut buf = Vec::new();
        put_array(&mut buf, 4);
        put_uint(&mut buf, 0);
        put_bin(&mut buf, b"");
        put_array(&mut buf, 0);
        put_array(&mut buf, 1);
        put_array(&mut buf, 6);
        put_uint(&mut buf, 5 << 30);
        put_uint(&mut buf, 0);
        let _ = rmp::encode::write_nil(&mut buf);
        put_uint(&mut buf, 0);
        put_bin(&mut buf, b"");
        put_bin(&mut buf, b"");
        let d = decode_descriptor(&buf, &Limits::default()).unwrap();
        assert_eq!(d.descriptor.tensors[0].length, 5 << 30);
    }

    #[test]
    fn ack_round_trip() {
        let a = Ack {
            seq: 3,
            tensor: 1,
            ok: false,
        };
        let mut buf = Vec::new();
        encode_ack(&mut buf, &a);
        assert_eq!(decode_ack(&buf).unwrap(), a);
        assert!(decode_ack(&buf[..buf.len() - 1]).is_err());
    }

    #[test]
    fn chunk_round_trip() {
        let h = ChunkHeader {
            seq: u64::MAX,
            tensor: 9,
            offset: 1 << 33,
            length: 12,
        };
        let mut buf = Vec::new();
        encode_chunk(&mut buf, &h);
        assert_eq!(decode_chunk(&buf).unwrap(), h);
        assert!(decode_chunk(&buf[..buf.len() - 1]).is_err());
    }
}
