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
    /// Sets the bytes (at most `MAX_CHANNEL_DATA`; a channel never sets more, and a longer
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

// The MessagePack these frames use (unsigned ints, arrays, bin, nil), written and read by hand:
// the same bytes as rmp's writers (each value in its smallest form) and the same inputs
// accepted as rmp's readers, without their generic reader and writer and error plumbing, which
// took about a third of a 64 B message's encode and decode (git history's docs/performance-limits.md, "Sixth
// round"). `descriptor_encoders_agree` and `hand_msgpack_matches_rmp` hold them to rmp.

#[inline(always)]
fn put_uint(b: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        b.push(v as u8);
    } else if v <= 0xff {
        b.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        b.push(0xcd);
        b.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        b.push(0xce);
        b.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        b.push(0xcf);
        b.extend_from_slice(&v.to_be_bytes());
    }
}

/// A length too large for its type's smallest form: marker `m16` and 2 bytes, or `m32` and 4.
fn put_wide_len(b: &mut Vec<u8>, n: u32, m16: u8, m32: u8) {
    if n <= 0xffff {
        b.push(m16);
        b.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        b.push(m32);
        b.extend_from_slice(&n.to_be_bytes());
    }
}

#[inline(always)]
fn put_bin(b: &mut Vec<u8>, v: &[u8]) {
    let n = v.len() as u32;
    if n <= 0xff {
        b.extend_from_slice(&[0xc4, n as u8]);
    } else {
        put_wide_len(b, n, 0xc5, 0xc6);
    }
    b.extend_from_slice(v);
}

#[inline(always)]
fn put_array(b: &mut Vec<u8>, n: usize) {
    let n = n as u32;
    if n < 16 {
        b.push(0x90 | n as u8);
    } else {
        put_wide_len(b, n, 0xdc, 0xdd);
    }
}

const NIL: u8 = 0xc0;

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
            None => buf.push(NIL),
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
    #[inline(always)]
    fn byte(&mut self, what: &str) -> Result<u8, WireError> {
        let (&b, rest) = self.rest.split_first().ok_or_else(|| malformed(what))?;
        self.rest = rest;
        Ok(b)
    }

    /// The next `n` bytes (1, 2, 4 or 8) as a big-endian number.
    #[inline(always)]
    fn be(&mut self, n: usize, what: &str) -> Result<u64, WireError> {
        if self.rest.len() < n {
            return Err(malformed(what));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head.iter().fold(0, |v, &b| (v << 8) | b as u64))
    }

    /// Any MessagePack integer that is not negative (as `rmp::decode::read_int::<u64>`).
    #[inline(always)]
    fn uint(&mut self, what: &str) -> Result<u64, WireError> {
        match self.byte(what)? {
            m @ 0x00..=0x7f => Ok(m as u64),
            m @ 0xcc..=0xcf => self.be(1 << (m - 0xcc), what),
            m @ 0xd0..=0xd3 => {
                let n = 1usize << (m - 0xd0);
                let shift = 64 - 8 * n as u32;
                let v = ((self.be(n, what)? << shift) as i64) >> shift;
                u64::try_from(v).map_err(|_| malformed(what))
            }
            _ => Err(malformed(what)),
        }
    }

    #[inline(always)]
    fn array(&mut self, what: &str) -> Result<u32, WireError> {
        match self.byte(what)? {
            m @ 0x90..=0x9f => Ok((m & 0x0f) as u32),
            0xdc => Ok(self.be(2, what)? as u32),
            0xdd => Ok(self.be(4, what)? as u32),
            _ => Err(malformed(what)),
        }
    }

    #[inline(always)]
    fn bin_len(&mut self, what: &str) -> Result<u64, WireError> {
        match self.byte(what)? {
            m @ 0xc4..=0xc6 => self.be(1 << (m - 0xc4), what),
            _ => Err(malformed(what)),
        }
    }

    #[inline(always)]
    fn fixed_array(&mut self, n: u32, what: &str) -> Result<(), WireError> {
        match self.array(what)? {
            got if got == n => Ok(()),
            got => Err(WireError::Malformed(format!(
                "malformed frame: {what} has {got} fields, expected {n}"
            ))),
        }
    }

    /// A bin field; `budget` is what is left of the metadata limit, charged before copying.
    #[inline(always)]
    fn bin(&mut self, what: &str, budget: &mut u64, max: u64) -> Result<Vec<u8>, WireError> {
        let len = self.bin_len(what)?;
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
        Ok(bytes_of(head))
    }

    /// Checks an announced count and returns a capacity that the remaining bytes can justify:
    /// every element takes at least `min_bytes`, so garbage cannot reserve memory.
    #[inline(always)]
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

    #[inline(always)]
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

    #[inline(always)]
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

/// `b` as a `Vec`; empty metadata (the usual case) without a call into the allocator's code.
#[inline(always)]
fn bytes_of(b: &[u8]) -> Vec<u8> {
    if b.is_empty() {
        Vec::new()
    } else {
        b.to_vec()
    }
}

/// A positive int in any of its forms, at `*at` of `b` (for [`small_head`] and [`small_tensors`]).
#[inline(always)]
fn small_uint(b: &[u8], at: &mut usize) -> Option<u64> {
    let m = *b.get(*at)?;
    *at += 1;
    let n = match m {
        0x00..=0x7f => return Some(m as u64),
        0xcc => 1,
        0xcd => 2,
        0xce => 4,
        0xcf => 8,
        _ => return None,
    };
    let v = b.get(*at..*at + n)?;
    *at += n;
    Some(match *v {
        [a] => a as u64,
        [a, b] => u16::from_be_bytes([a, b]) as u64,
        [a, b, c, d] => u32::from_be_bytes([a, b, c, d]) as u64,
        _ => u64::from_be_bytes(v.try_into().ok()?),
    })
}

/// A bin 8 field of at most `budget` bytes, charged to it.
#[inline(always)]
fn small_bin<'a>(b: &'a [u8], at: &mut usize, budget: &mut u64) -> Option<&'a [u8]> {
    let [0xc4, len] = *b.get(*at..*at + 2)? else {
        return None;
    };
    let len = len as usize;
    if len as u64 > *budget {
        return None;
    }
    let v = b.get(*at + 2..*at + 2 + len)?;
    *budget -= len as u64;
    *at += 2 + len;
    Some(v)
}

/// A fixarray count of at most `max` entries.
#[inline(always)]
fn small_count(b: &[u8], at: &mut usize, max: u32) -> Option<u32> {
    let n = match *b.get(*at)? {
        m @ 0x90..=0x9f => (m & 0x0f) as u32,
        _ => return None,
    };
    *at += 1;
    (n <= max).then_some(n)
}

/// An entry's fixarray `marker`, then its size as a positive int of at most `max`.
#[inline(always)]
fn small_sized(b: &[u8], at: &mut usize, marker: u8, max: u64) -> Option<u64> {
    if *b.get(*at)? != marker {
        return None;
    }
    *at += 1;
    small_uint(b, at).filter(|&n| n <= max)
}

/// A descriptor's fields up to its tensor count, when each is in its usual small form: the
/// array header `0x94`, a positive int sequence number, bin 8 metadata, a fixarray of payload
/// entries (`0x92`, a positive int size, bin 8 metadata), all within `limits`. The payloads go
/// into `payloads` (empty); returns the sequence number, the message metadata and the bytes
/// from the tensor count on. `None` for anything else (other forms, truncation, a limit
/// exceeded): the general decoder then decodes the body from its start, and it accepts
/// whatever this accepts, with the same values, and reports the rest.
#[inline(always)]
fn small_head<'a>(
    body: &'a [u8],
    limits: &Limits,
    budget: &mut u64,
    payloads: &mut Vec<PayloadDescriptor>,
) -> Option<(u64, Vec<u8>, &'a [u8])> {
    let mut at = 1;
    if *body.first()? != 0x94 {
        return None;
    }
    let seq = small_uint(body, &mut at)?;
    let metadata = small_bin(body, &mut at, budget)?;
    let np = small_count(body, &mut at, limits.max_payloads)?;
    // The capacity the general decoder reserves (`Cursor::count`).
    reserve(payloads, (np as usize).min((body.len() - at) / 3));
    for _ in 0..np {
        let length = small_sized(body, &mut at, 0x92, limits.max_payload_size)?;
        let metadata = bytes_of(small_bin(body, &mut at, budget)?);
        payloads.push(PayloadDescriptor { length, metadata });
    }
    Some((seq, bytes_of(metadata), &body[at..]))
}

/// Room for `n` entries in the empty `v`, allocated exactly (as `Vec::with_capacity`) when it
/// has less; the capacity check is inline, where a spare's lists usually have the room.
#[inline(always)]
fn reserve<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() < n {
        v.reserve_exact(n);
    }
}

/// Decodes a descriptor body, checking every limit before allocating for it.
pub fn decode_descriptor(body: &[u8], limits: &Limits) -> Result<WireDescriptor, WireError> {
    decode_descriptor_reusing(body, limits, &mut None)
}

/// [`decode_descriptor`], with the lists (payloads, tensors, routes) of `spare`, a descriptor
/// done with, if there is one: cleared and filled again, so that a reader that decodes one
/// descriptor after another allocates them once. `spare` is taken either way.
pub fn decode_descriptor_reusing(
    body: &[u8],
    limits: &Limits,
    spare: &mut Option<WireDescriptor>,
) -> Result<WireDescriptor, WireError> {
    let (mut payloads, mut tensors, mut routes) = match spare.take() {
        Some(wd) => (wd.descriptor.payloads, wd.descriptor.tensors, wd.routes),
        None => Default::default(),
    };
    payloads.clear();
    tensors.clear();
    routes.clear();
    let max_meta = limits.max_metadata_size;
    let mut budget = max_meta;
    let (seq, metadata, mut c) = match small_head(body, limits, &mut budget, &mut payloads) {
        Some((seq, metadata, rest)) => (seq, metadata, Cursor { rest }),
        None => {
            payloads.clear();
            budget = max_meta;
            decode_head(body, limits, &mut budget, &mut payloads)?
        }
    };
    // No tensors and nothing after (the usual small message): what the loop below would accept
    // at once.
    if c.rest != [0x90] {
        let at_count = budget;
        if small_tensors(c.rest, limits, &mut budget, &mut tensors, &mut routes).is_none() {
            tensors.clear();
            routes.clear();
            budget = at_count;
            decode_tensors(&mut c, limits, &mut budget, &mut tensors, &mut routes)?;
        }
    }
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

/// The general decoder of a descriptor's tensor list, from its count to the end of the body
/// (see [`small_tensors`]).
#[inline(never)]
fn decode_tensors(
    c: &mut Cursor<'_>,
    limits: &Limits,
    budget: &mut u64,
    tensors: &mut Vec<TensorDescriptor>,
    routes: &mut Vec<(u8, Vec<u8>)>,
) -> Result<(), WireError> {
    let max_meta = limits.max_metadata_size;
    let (nt, cap) = c.count("tensor count", limits.max_tensors, 7)?;
    reserve(tensors, cap);
    reserve(routes, cap);
    for _ in 0..nt {
        c.fixed_array(6, "tensor entry")?;
        let length = c.size("tensor size", limits.max_tensor_size)?;
        let source_device = device_from(c.uint("source device")?)?;
        let target_device = if c.rest.first() == Some(&NIL) {
            c.rest = &c.rest[1..];
            None
        } else {
            Some(device_from(c.uint("target device")?)?)
        };
        let channel = u8::try_from(c.uint("channel index")?)
            .map_err(|_| WireError::Malformed("malformed frame: channel index over 255".into()))?;
        let data = c.bin("channel data", budget, max_meta)?;
        let metadata = c.bin("tensor metadata", budget, max_meta)?;
        tensors.push(TensorDescriptor {
            length,
            source_device,
            target_device,
            metadata,
        });
        routes.push((channel, data));
    }
    c.done()
}

/// A descriptor's tensor list (`rest`: from its count to the end of the body) when every
/// field is in its usual small form: a fixarray count, each entry `0x96`, a positive int
/// size, device codes and the channel index as positive fixints (the target may be nil),
/// channel data and metadata as bin 8, and nothing after. `None` for anything else (other
/// forms, truncation, a limit exceeded): the general decoder then decodes the list from its
/// count, and it accepts whatever this accepts, with the same values.
#[inline(always)]
fn small_tensors(
    rest: &[u8],
    limits: &Limits,
    budget: &mut u64,
    tensors: &mut Vec<TensorDescriptor>,
    routes: &mut Vec<(u8, Vec<u8>)>,
) -> Option<()> {
    let mut at = 0;
    let nt = small_count(rest, &mut at, limits.max_tensors)?;
    // The capacity the general decoder reserves (`Cursor::count`).
    let cap = (nt as usize).min((rest.len() - at) / 7);
    reserve(tensors, cap);
    reserve(routes, cap);
    let fixint = |at: &mut usize| -> Option<u64> {
        let m = *rest.get(*at)?;
        *at += 1;
        (m <= 0x7f).then_some(m as u64)
    };
    for _ in 0..nt {
        let length = small_sized(rest, &mut at, 0x96, limits.max_tensor_size)?;
        let source_device = device_from(fixint(&mut at)?).ok()?;
        let target_device = if *rest.get(at)? == NIL {
            at += 1;
            None
        } else {
            Some(device_from(fixint(&mut at)?).ok()?)
        };
        let channel = fixint(&mut at)? as u8;
        let data = small_bin(rest, &mut at, budget)?;
        let metadata = bytes_of(small_bin(rest, &mut at, budget)?);
        tensors.push(TensorDescriptor {
            length,
            source_device,
            target_device,
            metadata,
        });
        routes.push((channel, bytes_of(data)));
    }
    (at == rest.len()).then_some(())
}

/// The general decoder of a descriptor's fields up to its tensor count (see [`small_head`]):
/// the sequence number, the message metadata, and a cursor at the tensor count.
#[inline(never)]
fn decode_head<'a>(
    body: &'a [u8],
    limits: &Limits,
    budget: &mut u64,
    payloads: &mut Vec<PayloadDescriptor>,
) -> Result<(u64, Vec<u8>, Cursor<'a>), WireError> {
    let max_meta = limits.max_metadata_size;
    let mut c = Cursor { rest: body };
    c.fixed_array(4, "descriptor")?;
    let seq = c.uint("sequence number")?;
    let metadata = c.bin("message metadata", budget, max_meta)?;
    let (np, cap) = c.count("payload count", limits.max_payloads, 3)?;
    reserve(payloads, cap);
    for _ in 0..np {
        c.fixed_array(2, "payload entry")?;
        let length = c.size("payload size", limits.max_payload_size)?;
        let metadata = c.bin("payload metadata", budget, max_meta)?;
        payloads.push(PayloadDescriptor { length, metadata });
    }
    Ok((seq, metadata, c))
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
mod tests;
