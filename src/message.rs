//! What moves: messages made of metadata, CPU payloads and tensors.
//!
//! The sender builds a [`Message`] and hands it to a pipe's `Write`; the buffers come back in
//! `WriteDone` (on success and on failure), so they can be reused. The receiver first gets a
//! [`Descriptor`] (counts, sizes, devices, metadata: everything needed to allocate), then hands an
//! [`Allocation`] to `Read` and gets the filled buffers back as a [`Message`] in `ReadDone`.
//!
//! Sizes are `u64`: a tensor over 4 GiB is legal.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// Memory of the CUDA device with this ordinal.
    Cuda(u32),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The memory of one tensor.
///
/// Host memory comes owned ([`Buffer::Cpu`]) or shared and read-only ([`Buffer::Shared`]);
/// CUDA device memory with the `cuda` feature (`Buffer::Cuda`; docs/cuda.md says which
/// channels carry it and when each side may touch it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Buffer {
    /// Host memory; its length is the tensor's size in bytes.
    Cpu(Vec<u8>),
    /// Shared, read-only host memory, for writes only: the same bytes can go to many pipes at
    /// once (one [`Bytes`] clone each, no copy), and come back as they went in `WriteDone`. A
    /// `Read` into one fails with [`crate::Error::InvalidArgument`]: nothing can be written into it.
    Shared(Bytes),
    /// Device memory of a CUDA device, with the stream its data is produced on (sending) or
    /// consumed on (receiving).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaBuffer),
}

impl Buffer {
    /// The device this buffer lives on.
    pub fn device(&self) -> Device {
        match self {
            Buffer::Cpu(_) | Buffer::Shared(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => Device::Cuda(b.device()),
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Buffer::Cpu(v) => v.len() as u64,
            Buffer::Shared(b) => b.len() as u64,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => b.len() as u64,
        }
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host bytes, if this is host memory (owned or shared).
    pub fn as_cpu(&self) -> Option<&[u8]> {
        match self {
            Buffer::Cpu(v) => Some(v),
            Buffer::Shared(b) => Some(b),
            #[cfg(feature = "cuda")]
            Buffer::Cuda(_) => None,
        }
    }

    /// The host bytes, mutably, if this is owned host memory (not [`Buffer::Shared`]).
    pub fn as_cpu_mut(&mut self) -> Option<&mut Vec<u8>> {
        match self {
            Buffer::Cpu(v) => Some(v),
            Buffer::Shared(_) => None,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(_) => None,
        }
    }

    /// Takes the host vector out, if this is owned host memory (not [`Buffer::Shared`]).
    pub fn into_cpu(self) -> Option<Vec<u8>> {
        match self {
            Buffer::Cpu(v) => Some(v),
            Buffer::Shared(_) => None,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(_) => None,
        }
    }

    /// The shared bytes, if this is [`Buffer::Shared`].
    pub fn as_shared(&self) -> Option<&Bytes> {
        match self {
            Buffer::Shared(b) => Some(b),
            _ => None,
        }
    }
}

impl Default for Buffer {
    fn default() -> Self {
        Buffer::Cpu(Vec::new())
    }
}

#[cfg(feature = "cuda")]
impl Buffer {
    /// The device memory, if this is a CUDA buffer.
    pub fn as_cuda(&self) -> Option<&crate::cuda::CudaBuffer> {
        match self {
            Buffer::Cuda(b) => Some(b),
            _ => None,
        }
    }

    /// Takes the device memory out, if this is a CUDA buffer.
    pub fn into_cuda(self) -> Option<crate::cuda::CudaBuffer> {
        match self {
            Buffer::Cuda(b) => Some(b),
            _ => None,
        }
    }
}

#[cfg(feature = "cuda")]
impl From<crate::cuda::CudaBuffer> for Buffer {
    fn from(b: crate::cuda::CudaBuffer) -> Self {
        Buffer::Cuda(b)
    }
}

impl From<Vec<u8>> for Buffer {
    fn from(v: Vec<u8>) -> Self {
        Buffer::Cpu(v)
    }
}

impl From<Bytes> for Buffer {
    fn from(b: Bytes) -> Self {
        Buffer::Shared(b)
    }
}

/// A small CPU buffer sent inline with the message's descriptor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    /// The bytes.
    pub data: Vec<u8>,
    /// Application metadata, delivered in the receiver's descriptor.
    pub metadata: Vec<u8>,
}

impl Payload {
    /// A payload with no metadata.
    pub fn new(data: Vec<u8>) -> Self {
        Payload {
            data,
            metadata: Vec::new(),
        }
    }
}

/// A large buffer moved by a channel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tensor {
    /// The memory; its device is the tensor's source device.
    pub buffer: Buffer,
    /// Application metadata, delivered in the receiver's descriptor.
    pub metadata: Vec<u8>,
    /// Where the sender would like the receiver to put it (a hint the receiver sees in its
    /// descriptor); `None` means "same kind of device as the source".
    pub target_device: Option<Device>,
}

impl Tensor {
    /// A host tensor with no metadata.
    pub fn cpu(data: Vec<u8>) -> Self {
        Tensor {
            buffer: Buffer::Cpu(data),
            metadata: Vec::new(),
            target_device: None,
        }
    }

    /// A host tensor over shared, read-only bytes: write the same bytes to many pipes with a
    /// clone of `data` each (a reference count, not a copy).
    pub fn shared(data: impl Into<Bytes>) -> Self {
        Tensor {
            buffer: Buffer::Shared(data.into()),
            metadata: Vec::new(),
            target_device: None,
        }
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> Device {
        self.buffer.device()
    }

    /// A tensor in CUDA device memory with no metadata, to land on the same kind of device.
    #[cfg(feature = "cuda")]
    pub fn cuda(buffer: crate::cuda::CudaBuffer) -> Self {
        Tensor {
            buffer: Buffer::Cuda(buffer),
            metadata: Vec::new(),
            target_device: None,
        }
    }
}

/// One message: metadata, payloads and tensors, delivered whole and in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    /// Application metadata for the whole message.
    pub metadata: Vec<u8>,
    /// Small CPU buffers.
    pub payloads: Vec<Payload>,
    /// Large buffers.
    pub tensors: Vec<Tensor>,
}

impl Message {
    /// An empty message.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds message metadata.
    pub fn with_metadata(mut self, metadata: Vec<u8>) -> Self {
        self.metadata = metadata;
        self
    }

    /// Appends a payload.
    pub fn with_payload(mut self, payload: Payload) -> Self {
        self.payloads.push(payload);
        self
    }

    /// Appends a tensor.
    pub fn with_tensor(mut self, tensor: Tensor) -> Self {
        self.tensors.push(tensor);
        self
    }

    /// Total bytes of payloads and tensors (metadata not counted).
    pub fn total_bytes(&self) -> u64 {
        let p: u64 = self.payloads.iter().map(|p| p.data.len() as u64).sum();
        let t: u64 = self.tensors.iter().map(|t| t.buffer.len()).sum();
        p + t
    }

    /// The descriptor a receiver of this message will see.
    pub fn descriptor(&self) -> Descriptor {
        Descriptor {
            metadata: self.metadata.clone(),
            payloads: self
                .payloads
                .iter()
                .map(|p| PayloadDescriptor {
                    length: p.data.len() as u64,
                    metadata: p.metadata.clone(),
                })
                .collect(),
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorDescriptor {
                    length: t.buffer.len(),
                    source_device: t.device(),
                    target_device: t.target_device,
                    metadata: t.metadata.clone(),
                })
                .collect(),
        }
    }
}

/// What the receiver learns about a payload before allocating.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PayloadDescriptor {
    /// Size in bytes.
    pub length: u64,
    /// The sender's payload metadata.
    pub metadata: Vec<u8>,
}

/// What the receiver learns about a tensor before allocating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDescriptor {
    /// Size in bytes.
    pub length: u64,
    /// Where the tensor lives on the sender.
    pub source_device: Device,
    /// Where the sender suggests putting it; `None`: the same device as the source. In a
    /// descriptor a pipe delivers, its kind (host or CUDA) is the kind of memory the tensor's
    /// channel lands it in: a suggestion no negotiated channel can follow arrives as the kind
    /// the tensor will land in (a host tensor suggested for a GPU over a pipe with no
    /// cpu->cuda channel arrives as `Some(Device::Cpu)`).
    pub target_device: Option<Device>,
    /// The sender's tensor metadata.
    pub metadata: Vec<u8>,
}

/// Everything a receiver needs to allocate for one incoming message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// Message metadata.
    pub metadata: Vec<u8>,
    /// One entry per payload, in order.
    pub payloads: Vec<PayloadDescriptor>,
    /// One entry per tensor, in order.
    pub tensors: Vec<TensorDescriptor>,
}

impl TensorDescriptor {
    /// Where the tensor lands: its target device, or its source device when none is named.
    pub fn landing(&self) -> Device {
        self.target_device.unwrap_or(self.source_device)
    }
}

impl Descriptor {
    /// Total bytes announced (payloads and tensors).
    pub fn total_bytes(&self) -> u64 {
        self.payloads
            .iter()
            .map(|p| p.length)
            .chain(self.tensors.iter().map(|t| t.length))
            .fold(0u64, u64::saturating_add)
    }
}

/// The buffers a receiver hands to `Read`: one per payload and one per tensor, each exactly the
/// announced size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Payload buffers, in order.
    pub payloads: Vec<Vec<u8>>,
    /// Tensor buffers, in order.
    pub tensors: Vec<Buffer>,
}

/// A received (or sent) message's buffers, for the next read: what
/// [`Receive::reusing`](crate::Receive::reusing) takes. Metadata is dropped.
impl From<Message> for Allocation {
    fn from(m: Message) -> Self {
        Allocation {
            payloads: m.payloads.into_iter().map(|p| p.data).collect(),
            tensors: m.tensors.into_iter().map(|t| t.buffer).collect(),
        }
    }
}

impl Allocation {
    /// Allocates buffers matching a descriptor: zeroed host memory for payloads and for
    /// tensors that land in host memory, and device memory (not zeroed, `cuMemAlloc`) on the
    /// device each CUDA tensor lands on ([`TensorDescriptor::landing`]; feature `cuda`). Without
    /// the `cuda` feature every tensor gets host memory.
    ///
    /// Returns an error instead of aborting when a size does not fit this machine's address
    /// space, or the device cannot allocate.
    pub fn for_descriptor(d: &Descriptor) -> crate::Result<Self> {
        Allocation::default().refit(d)
    }

    /// As [`Allocation::for_descriptor`], with every CUDA tensor on CUDA device `device`
    /// instead of the one the descriptor names (host tensors stay in host memory).
    #[cfg(feature = "cuda")]
    pub fn for_descriptor_on(d: &Descriptor, device: u32) -> crate::Result<Self> {
        Allocation::default().refit_on(d, Some(device))
    }

    /// Turns these buffers into an allocation for `d`, reusing them in order: each buffer is
    /// truncated or grown (with zeros) to its announced size, so no memory is allocated when
    /// every buffer's capacity suffices. Missing buffers are allocated and extra ones dropped.
    /// This is what [`Receive::reusing`](crate::Receive::reusing) does with its spare buffers.
    ///
    /// Returns an error instead of aborting when a size does not fit this machine's address
    /// space.
    /// A CUDA buffer is kept when it has the announced size and is on the device the tensor
    /// lands on; otherwise it is replaced (device memory cannot grow in place).
    pub fn refit(self, d: &Descriptor) -> crate::Result<Self> {
        self.refit_on(d, None)
    }

    /// [`Allocation::refit`], with CUDA tensors on `cuda` when it is given.
    fn refit_on(self, d: &Descriptor, cuda: Option<u32>) -> crate::Result<Self> {
        let _ = cuda;
        let size = |n: u64| {
            usize::try_from(n)
                .map_err(|_| crate::Error::invalid(format!("{n} bytes do not fit in memory")))
        };
        let mut a = self;
        a.payloads
            .reserve_exact(d.payloads.len().saturating_sub(a.payloads.len()));
        a.tensors
            .reserve_exact(d.tensors.len().saturating_sub(a.tensors.len()));
        a.payloads.truncate(d.payloads.len());
        for (i, p) in d.payloads.iter().enumerate() {
            let n = size(p.length)?;
            match a.payloads.get_mut(i) {
                Some(b) => b.resize(n, 0),
                None => a.payloads.push(vec![0; n]),
            }
        }
        a.tensors.truncate(d.tensors.len());
        for (i, t) in d.tensors.iter().enumerate() {
            let n = size(t.length)?;
            #[cfg(feature = "cuda")]
            if let Device::Cuda(device) = t.landing() {
                let device = cuda.unwrap_or(device);
                let fits = |b: &Buffer| {
                    b.as_cuda()
                        .is_some_and(|c| c.device() == device && c.len() == n)
                };
                if !a.tensors.get(i).is_some_and(fits) {
                    let b = Buffer::Cuda(crate::cuda::CudaBuffer::alloc(device, n)?);
                    match a.tensors.get_mut(i) {
                        Some(old) => *old = b,
                        None => a.tensors.push(b),
                    }
                }
                continue;
            }
            match a.tensors.get_mut(i) {
                Some(b) => match b.as_cpu_mut() {
                    Some(v) => v.resize(n, 0),
                    // Shared bytes are read-only, device memory is not host memory: a fresh
                    // buffer takes their place.
                    None => *b = Buffer::Cpu(vec![0; n]),
                },
                None => a.tensors.push(Buffer::Cpu(vec![0; n])),
            }
        }
        Ok(a)
    }

    /// Checks that these buffers match a descriptor exactly.
    pub fn check(&self, d: &Descriptor) -> crate::Result<()> {
        if self.payloads.len() != d.payloads.len() || self.tensors.len() != d.tensors.len() {
            return Err(crate::Error::invalid(format!(
                "allocation has {} payloads and {} tensors, the descriptor announces {} and {}",
                self.payloads.len(),
                self.tensors.len(),
                d.payloads.len(),
                d.tensors.len()
            )));
        }
        for (i, (b, p)) in self.payloads.iter().zip(&d.payloads).enumerate() {
            if b.len() as u64 != p.length {
                return Err(crate::Error::invalid(format!(
                    "payload {i} buffer holds {} bytes, the descriptor announces {}",
                    b.len(),
                    p.length
                )));
            }
        }
        for (i, (b, t)) in self.tensors.iter().zip(&d.tensors).enumerate() {
            if let Buffer::Shared(_) = b {
                return Err(crate::Error::invalid(format!(
                    "tensor {i} buffer is shared, read-only memory (Buffer::Shared): a read needs \
                     a buffer it can write into (Buffer::Cpu)"
                )));
            }
            #[cfg(feature = "cuda")]
            let (have, want) = (
                crate::negotiate::DeviceKind::from(b.device()),
                crate::negotiate::DeviceKind::from(t.landing()),
            );
            #[cfg(feature = "cuda")]
            if have != want {
                return Err(crate::Error::invalid(format!(
                    "tensor {i} buffer is on {}, the tensor lands in {want} memory",
                    b.device(),
                )));
            }
            if b.len() != t.length {
                return Err(crate::Error::invalid(format!(
                    "tensor {i} buffer holds {} bytes, the descriptor announces {}",
                    b.len(),
                    t.length
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_mirrors_message() {
        let m = Message::new()
            .with_metadata(b"m".to_vec())
            .with_payload(Payload::new(vec![1, 2, 3]))
            .with_tensor(Tensor::cpu(vec![0; 10]));
        let d = m.descriptor();
        assert_eq!(d.payloads[0].length, 3);
        assert_eq!(d.tensors[0].length, 10);
        assert_eq!(d.tensors[0].source_device, Device::Cpu);
        assert_eq!(d.total_bytes(), 13);
        assert_eq!(m.total_bytes(), 13);
        let a = Allocation::for_descriptor(&d).unwrap();
        a.check(&d).unwrap();
    }

    #[test]
    fn refit_reuses_grows_shrinks_and_fills_in() {
        let d = Message::new()
            .with_payload(Payload::new(vec![0; 5]))
            .with_payload(Payload::new(vec![0; 300]))
            .with_tensor(Tensor::cpu(vec![0; 2]))
            .descriptor();
        let spare = Allocation {
            payloads: vec![Vec::with_capacity(64), vec![7; 3]],
            tensors: vec![Buffer::Cpu(vec![1; 10]), Buffer::Cpu(vec![2; 10])],
        };
        let kept = spare.payloads[0].as_ptr();
        let a = spare.refit(&d).unwrap();
        a.check(&d).unwrap();
        assert_eq!(
            a.payloads[0].as_ptr(),
            kept,
            "capacity sufficed: same buffer"
        );
        assert_eq!(&a.payloads[1][..4], &[7, 7, 7, 0], "grown with zeros");
        assert_eq!(
            a.tensors,
            vec![Buffer::Cpu(vec![1, 1])],
            "shrunk, extra dropped"
        );
        let none = Allocation::default().refit(&d).unwrap();
        none.check(&d).unwrap();
    }

    #[test]
    fn allocation_mismatch_is_an_error() {
        let d = Message::new()
            .with_tensor(Tensor::cpu(vec![0; 10]))
            .descriptor();
        let bad = Allocation {
            payloads: vec![],
            tensors: vec![Buffer::Cpu(vec![0; 9])],
        };
        let e = bad.check(&d).unwrap_err();
        assert!(
            e.to_string().contains("tensor 0 buffer holds 9 bytes"),
            "{e}"
        );
        let bad = Allocation::default();
        assert!(bad.check(&d).is_err());
    }
}
