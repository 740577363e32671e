//! Channels: bulk movers for tensors.
//!
//! A channel moves tensor bytes between one device pair (CPU->CPU, CUDA->CUDA, …). It may carry
//! its data over the pipe's control connection (as `basic` does) or over its own path (shared
//! memory, `process_vm_readv`, several sockets, CUDA IPC), and may send small control messages
//! over the pipe's connection. Whatever the path, it preserves the pipe's order: the n-th tensor
//! the receiver asks for is the n-th tensor the sender sent through that channel.
//!
//! This module holds the trait every channel backend implements, and (internal) the driver
//! a backend's data path implements, which the generic `Channel` actor in `actors/channel/`
//! runs.

pub(crate) mod driver;
pub(crate) mod kind;

#[cfg(feature = "efa")]
pub use crate::actors::hardware::efa::channel::{Domains as EfaDomains, Efa};
pub use crate::backend::basic::Basic;
pub use crate::backend::cma::Cma;
#[cfg(feature = "cuda")]
pub use crate::backend::cuda_basic::CudaBasic;
#[cfg(all(feature = "cuda", feature = "ibv"))]
pub use crate::backend::cuda_gdr::CudaGdr;
#[cfg(feature = "cuda")]
pub use crate::backend::cuda_ipc::CudaIpc;
#[cfg(feature = "cuda")]
pub use crate::backend::cuda_xth::CudaXth;
#[cfg(feature = "ibv")]
pub use crate::backend::ibv::channel::IbvChannel;
pub use crate::backend::mpt::Mpt;
pub use crate::backend::xth::Xth;
pub use crate::negotiate::{ChannelOffer, DeviceKind, DevicePair};

/// The device pairs a CUDA channel can serve: cuda->cuda, cpu->cuda, cuda->cpu.
#[cfg(feature = "cuda")]
pub fn cuda_pairs() -> [DevicePair; 3] {
    use crate::negotiate::DeviceKind::{Cpu, Cuda};
    [
        DevicePair {
            source: Cuda,
            target: Cuda,
        },
        DevicePair {
            source: Cpu,
            target: Cuda,
        },
        DevicePair {
            source: Cuda,
            target: Cpu,
        },
    ]
}

/// Keeps [`ChannelBackend`] implemented only here: the pipe runs each channel by a driver of its
/// own, which a backend defined outside the crate would not have. Each backend plans what a new
/// pipe's channel of it runs as ([`sealed::Sealed::plan`]).
pub(crate) mod sealed {
    use super::kind::ChannelKind;

    /// Implemented by every channel backend of this crate, and by nothing else.
    pub trait Sealed {
        /// What a new pipe's channel of this backend runs as.
        fn plan(&self, at: &Plan) -> ChannelKind;
    }

    /// What a backend's [`Sealed::plan`] is told of the new pipe and its context.
    pub struct Plan<'a> {
        /// The pipe's id.
        pub pipe: u64,
        /// The pipe's transport (`tcp`, `shm`, ...).
        pub transport: &'a str,
        /// The chunk size of tensors on the pipe's connection.
        pub chunk_size: usize,
        /// Threads per cma read.
        pub cma_threads: usize,
        /// The context's cma inline limit, if it set one.
        pub cma_inline_max: Option<u64>,
    }
}

/// A channel backend, as a context offers it. Its `Debug` output shows its settings (a
/// [`ContextBuilder`](crate::ContextBuilder)'s `Debug` lists every backend so).
///
/// The trait is sealed: the crate's backends are the only ones. Each runs by a driver of its
/// own in the pipe's channel actor (an internal trait, which gives the driver the channel's
/// lanes, the pipe's completion queues and the actor's timers and tasks), so a backend written
/// elsewhere could be negotiated but not run. Pick, configure and prioritise the crate's backends with
/// [`crate::ContextBuilder::channel`] and [`crate::ContextBuilder::priority`].
pub trait ChannelBackend: sealed::Sealed + std::fmt::Debug + Send + Sync + 'static {
    /// Name in brochures (`basic`).
    fn name(&self) -> &'static str;
    /// Default priority; higher wins.
    fn priority(&self) -> i32;
    /// Domain descriptor: both peers must advertise the same string to use it.
    fn domain(&self) -> String;
    /// What it moves between.
    fn devices(&self) -> DevicePair;
    /// Connections of its own it needs per pipe.
    fn connections(&self) -> u32 {
        0
    }
    /// Whether it can run here; `Err` says why not.
    fn viable(&self) -> Result<(), String> {
        Ok(())
    }
    /// The local address connection `lane` of this channel leaves from, when the dialing side
    /// opens it (`None`: wherever the routing table says).
    fn lane_source(&self, lane: u32) -> Option<std::net::IpAddr> {
        let _ = lane;
        None
    }

    /// Capacity of the buffered reader of each of its own connections (see
    /// [`crate::transport::stream::READ_BUFFER`]). A connection that carries little, and mostly
    /// small frames, can do with less: every idle pipe pays for it.
    fn lane_read_buffer(&self) -> usize {
        crate::transport::stream::READ_BUFFER
    }

    /// The backend itself, for the pipe that needs its concrete type (the `ibv` channel's
    /// device and registration caches, the `mpt` and `efa` channels' inline limits) and for the
    /// context builder's changes to a known one ([`lanes`](crate::ContextBuilder::lanes) on
    /// [`Mpt`]). `None` by default.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// This backend's entry in a brochure, at `priority`.
    fn offer(&self, priority: i32) -> ChannelOffer {
        ChannelOffer {
            name: self.name().into(),
            priority,
            domain: self.domain(),
            devices: self.devices(),
            connections: self.connections(),
        }
    }
}
