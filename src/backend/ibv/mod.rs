//! InfiniBand verbs, as much as the `ibv` backends need, behind one small trait.
//!
//! Two implementations:
//!
//! - [`hw`]: real HCAs through `sideway` (which loads `libibverbs` at run time). With no RDMA
//!   device, listing devices fails with `ENOSYS`; that is reported as "no devices", not as an
//!   error.
//! - [`sim`]: a simulated device and fabric in this process, for tests and for measuring the
//!   code's own overhead. It enforces what hardware enforces (see its module documentation), and
//!   its devices are named `sim*` with a link layer of their own ([`LinkLayer::Simulated`]), so
//!   a simulated endpoint never negotiates with a real one.
//!
//! The model is the verbs one, reduced: a [`Device`] is one opened port of one HCA with its
//! protection domain; it registers memory ([`MemoryRegion`]) and creates reliable-connected
//! [`QueuePair`]s. Each queue pair here has one completion queue of its own for both its send
//! and receive queues, and a notification descriptor (a completion channel on hardware, an
//! eventfd in the simulation) that becomes readable once a completion arrives on an armed queue.

#[cfg(feature = "ibv")]
pub mod channel;
pub mod hw;
pub mod regcache;
pub mod sendq;
pub mod sim;
#[cfg(test)]
mod sim_tests;
#[cfg(feature = "ibv")]
pub mod transport;

use std::fmt;
use std::os::fd::RawFd;

/// The most bytes one work request may move (1 GiB: RDMA hardware's usual limit).
pub const MAX_OP_BYTES: u64 = 1 << 30;
/// The fewest bytes a data-carrying work request may move (smaller ones fail on hardware "with
/// odd errors"). Zero-length write-with-immediate, which carries only its 32-bit value, is
/// allowed.
pub const MIN_OP_BYTES: u64 = 32;
/// `rnr_retry` value meaning "retry for ever" on RC queue pairs.
pub const RNR_RETRY_INFINITE: u8 = 7;

/// What went wrong in a verbs call (not a completion: see [`Status`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA device on this host (listing devices failed with ENOSYS, or found none).
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// The send queue or the receive queue has no free slot (`ENOMEM` from `ibv_post_*`).
    #[error("{0} queue full")]
    QueueFull(&'static str),
    /// The request does not fit the queue pair's state or limits (`EINVAL`).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Another error from the verbs library, with its call.
    #[error("{call}: {detail}")]
    Library {
        /// The verbs call.
        call: &'static str,
        /// What it said.
        detail: String,
    },
}

/// A port's link layer. Peers with different link layers cannot reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID within a subnet (and by GID across subnets).
    InfiniBand,
    /// RoCE: addressed by GID (an IP address).
    Ethernet,
    /// The simulated fabric of this crate: reachable only from the same simulated fabric.
    Simulated,
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "ib",
            LinkLayer::Ethernet => "roce",
            LinkLayer::Simulated => "sim",
        })
    }
}

/// One port of one device, as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number, from 1.
    pub port: u8,
    /// Its link layer.
    pub link_layer: LinkLayer,
    /// Whether the port is ACTIVE (links up, subnet manager done on IB).
    pub active: bool,
    /// Local identifier (IB), 0 on RoCE.
    pub lid: u16,
    /// The GID at `gid_index`.
    pub gid: [u8; 16],
    /// The GID table index used.
    pub gid_index: u8,
    /// Active MTU in bytes.
    pub mtu: u32,
}

impl PortInfo {
    /// The upper 64 bits of the GID: the subnet prefix on InfiniBand.
    pub fn subnet_prefix(&self) -> u64 {
        u64::from_be_bytes(self.gid[..8].try_into().expect("8 bytes"))
    }
}

/// One RDMA device, as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its name (`mlx5_0`, `sim0`).
    pub name: String,
    /// Its node GUID.
    pub guid: u64,
    /// Its PCI address (`0000:17:00.0`), read from sysfs, when it has one.
    pub pci: Option<String>,
    /// Its ports.
    pub ports: Vec<PortInfo>,
}

/// Sizes of a queue pair's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth: work requests posted and not yet completed (polled).
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Receiver-not-ready retries: [`RNR_RETRY_INFINITE`] waits for a receive for ever.
    pub rnr_retry: u8,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 256,
            rnr_retry: RNR_RETRY_INFINITE,
        }
    }
}

/// What the peer needs to connect its queue pair to ours (exchanged over the TCP bootstrap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Port LID (IB).
    pub lid: u16,
    /// Port GID.
    pub gid: [u8; 16],
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
}

/// A queue pair's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created, not connected.
    Init,
    /// Connected: ready to send and receive.
    ReadyToSend,
    /// In error: every request completes with [`Status::Flushed`].
    Error,
}

/// Access rights of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// The peer may write into it.
    pub remote_write: bool,
    /// The peer may read from it.
    pub remote_read: bool,
}

impl Access {
    /// Local use only (source of writes, target of receives and reads).
    pub const LOCAL: Access = Access {
        remote_write: false,
        remote_read: false,
    };
    /// The peer may write into it.
    pub const REMOTE_WRITE: Access = Access {
        remote_write: true,
        remote_read: false,
    };
    /// The peer may read from it.
    pub const REMOTE_READ: Access = Access {
        remote_write: false,
        remote_read: true,
    };
}

/// A local piece of registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The registration's local key.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Send into the peer's next posted receive.
    Send,
    /// RDMA write into the peer's registered memory.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA write, then the peer's next receive completes with `imm`.
    WriteImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// The 32-bit immediate value.
        imm: u32,
    },
    /// RDMA read from the peer's registered memory into `local`.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
}

/// A send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local memory (source, or destination of a read). Length 0: no memory.
    pub local: Sge,
}

/// A receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// Where a `Send` lands. Length 0 for receives that only take immediates.
    pub local: Sge,
}

/// The outcome of a work request (`ibv_wc_status`, reduced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Done.
    Success,
    /// Local length error: an operation over 1 GiB, under 32 B, or a send larger than the
    /// receive it landed in.
    LocalLength,
    /// The local memory is not registered (wrong lkey, out of bounds).
    LocalProtection,
    /// The remote key or bounds were refused by the peer.
    RemoteAccess,
    /// The peer had no receive posted, and the retries ran out.
    RnrRetryExceeded,
    /// The peer did not answer (gone, not connected).
    RetryExceeded,
    /// The queue pair went to error before this request ran.
    Flushed,
    /// Any other status, with its `ibv_wc_status` number.
    Other(u32),
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Success => f.write_str("success"),
            Status::LocalLength => f.write_str("local length error"),
            Status::LocalProtection => f.write_str("local protection error"),
            Status::RemoteAccess => f.write_str("remote access error"),
            Status::RnrRetryExceeded => f.write_str("receiver not ready, retries exceeded"),
            Status::RetryExceeded => f.write_str("transport retries exceeded (peer gone?)"),
            Status::Flushed => f.write_str("flushed: the queue pair is in error"),
            Status::Other(n) => write!(f, "ibv_wc_status {n}"),
        }
    }
}

/// Which queue a completion belongs to and what it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// A send work request of this kind.
    Send,
    /// An RDMA write (with or without immediate).
    Write,
    /// An RDMA read.
    Read,
    /// A receive, consumed by a `Send` (`imm` None) or a write with immediate (`imm` Some).
    Recv,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// Its outcome.
    pub status: Status,
    /// Its kind. For a flushed request, the kind it was posted as.
    pub opcode: Opcode,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// The immediate value, for a receive consumed by a write with immediate.
    pub imm: Option<u32>,
}

/// A registration. The memory it covers must stay valid until it is dropped.
pub trait MemoryRegion: Send + Sync {
    /// Start address.
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether it covers no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// `len` bytes at `addr`, if inside this registration.
    fn sge(&self, addr: u64, len: u64) -> Option<Sge> {
        let end = addr.checked_add(len)?;
        (addr >= self.addr() && end <= self.addr() + self.len()).then_some(Sge {
            addr,
            len,
            lkey: self.lkey(),
        })
    }
}

/// A reliable-connected queue pair with its completion queue.
pub trait QueuePair: Send {
    /// What the peer needs to connect to it.
    fn endpoint(&self) -> Endpoint;
    /// Its queue sizes.
    fn caps(&self) -> QpCaps;
    /// Its state.
    fn state(&self) -> QpState;
    /// INIT → RTR → RTS towards `remote`.
    fn connect(&mut self, remote: &Endpoint) -> Result<(), VerbsError>;
    /// Moves it to the error state: every outstanding request completes with
    /// [`Status::Flushed`], in order.
    fn set_error(&mut self);
    /// Posts one send work request; [`VerbsError::QueueFull`] when the send queue is full.
    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError>;
    /// Posts one receive; [`VerbsError::QueueFull`] when the receive queue is full.
    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError>;
    /// Takes up to `max` completions, oldest first, appending them to `out`.
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError>;
    /// Requests a notification for the next completion (`ibv_req_notify_cq`).
    fn arm(&mut self) -> Result<(), VerbsError>;
    /// The descriptor that becomes readable once an armed queue gets a completion.
    fn notify_fd(&self) -> RawFd;
    /// Consumes the notifications pending on [`notify_fd`](Self::notify_fd).
    fn ack_notifications(&mut self) -> Result<(), VerbsError>;
}

/// What the verbs layer needs from the GPU side to register device memory (implemented by
/// the `cuda_gdr` channel with the CUDA driver; the verbs layer itself has no CUDA dependency).
pub trait GpuMemory: Send + Sync {
    /// The device's ordinal.
    fn ordinal(&self) -> u32;
    /// A dma-buf file descriptor for `len` bytes of device memory at `addr` (page-aligned: an
    /// allocation's base, its size rounded up to whole pages), for `ibv_reg_dmabuf_mr`.
    fn dmabuf(&self, addr: u64, len: u64) -> Result<std::os::fd::OwnedFd, String>;
    /// Copies `len` bytes from `src` to `dst`, either of them device memory (unified
    /// addressing), and returns once they have landed: the simulated device's DMA engine.
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<(), String>;
}

/// One opened port of one device, with its protection domain.
pub trait Device: Send + Sync {
    /// The device.
    fn info(&self) -> &DeviceInfo;
    /// The port in use.
    fn port(&self) -> &PortInfo;
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay allocated (and, for remote access, not be moved) until the returned
    /// registration is dropped.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>, VerbsError>;
    /// Registers `len` bytes of GPU memory at `addr` (a whole allocation: its base and size),
    /// for GPUDirect RDMA. Hardware tries a dma-buf registration first (the range exported by
    /// `gpu` as a dma-buf descriptor, `ibv_reg_dmabuf_mr`), then a plain `ibv_reg_mr` of the
    /// device pointer, which works where the `nvidia-peermem` kernel module is loaded. The
    /// simulated device moves the bytes of such a registration with `gpu`'s copies.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned registration is dropped.
    unsafe fn register_gpu(
        &self,
        gpu: std::sync::Arc<dyn GpuMemory>,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>, VerbsError> {
        let _ = (gpu, addr, len, access);
        Err(VerbsError::Invalid(
            "this device does not register GPU memory".into(),
        ))
    }
    /// Creates an RC queue pair in the INIT state with its own completion queue.
    fn create_qp(&self, caps: QpCaps) -> Result<Box<dyn QueuePair>, VerbsError>;
}

/// A random 24-bit packet sequence number.
pub fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    (h.finish() as u32) & 0x00ff_ffff
}
