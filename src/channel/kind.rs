//! [`ChannelKind`]: which backend a negotiated channel runs (what its backend plans for a new
//! pipe: [`super::sealed::Sealed::plan`]), and what the pipe routes to it.

use crate::transport::stream::Carried;

/// Which channel backend this actor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelKind {
    /// Tensor bytes in chunks over the pipe's connection.
    Basic { chunk_size: usize },
    /// In-process copy.
    Xth { pipe: u64 },
    /// `process_vm_readv`, with a side connection for acks and fallback bytes. Tensors of
    /// 1..=`inline_max` bytes travel like basic ones instead, on the pipe's connection: below
    /// that size the copy through the transport costs less than a cross-memory read and its
    /// acknowledgement.
    Cma {
        threads: usize,
        chunk_size: usize,
        inline_max: u64,
    },
    /// Stripes over several lane connections. Tensors of 1..=`inline_max` bytes travel like
    /// basic ones instead, on the pipe's connection.
    Mpt { chunk_size: usize, inline_max: u64 },
    /// CUDA tensors between two contexts of one process (feature `cuda`).
    #[cfg(feature = "cuda")]
    CudaXth { pipe: u64 },
    /// CUDA tensors between two processes of one host through CUDA IPC handles (feature
    /// `cuda`); `pipe` is this pipe's id, the key of its entries in the handle caches. The
    /// receiver acknowledges each tensor on the channel's side connection once its copy has run.
    #[cfg(feature = "cuda")]
    CudaIpc { pipe: u64 },
    /// CUDA tensors through pinned staging chunks on the channel's own connection (feature
    /// `cuda`): any two peers.
    #[cfg(feature = "cuda")]
    CudaBasic,
    /// RDMA writes into the receiver's registered buffer (feature `ibv`). Tensors of
    /// 1..=`inline_max` bytes (at least the 31 under the verbs minimum) travel like basic ones.
    #[cfg(feature = "ibv")]
    Ibv { chunk_size: usize, inline_max: u64 },
    /// CUDA tensors by RDMA write between registered buffers (features `cuda` and `ibv`): the
    /// ibv channel's queue pair and protocol, GPU memory registered.
    #[cfg(all(feature = "cuda", feature = "ibv"))]
    CudaGdr,
    /// Tagged messages on a libfabric endpoint, in place (its state is in `Channel::fabric`).
    /// Tensors of 1..=`inline_max` bytes travel like basic ones.
    #[cfg(feature = "efa")]
    Efa { chunk_size: usize, inline_max: u64 },
}

impl ChannelKind {
    /// Whether a tensor of `len` bytes that we send travels on the pipe's control connection
    /// (and so takes a ticket there).
    pub fn sends_on_control(&self, len: u64) -> bool {
        match *self {
            ChannelKind::Basic { .. } => true,
            ChannelKind::Cma { inline_max, .. } | ChannelKind::Mpt { inline_max, .. } => {
                len > 0 && len <= inline_max
            }
            #[cfg(feature = "ibv")]
            ChannelKind::Ibv { inline_max, .. } => len > 0 && len <= inline_max,
            #[cfg(feature = "efa")]
            ChannelKind::Efa { inline_max, .. } => len > 0 && len <= inline_max,
            _ => false,
        }
    }

    /// Whether a tensor this channel moves in place has its length as channel data (`mpt`,
    /// `ibv`, `efa`: the receiver checks it against its buffer; an inline tensor's data is
    /// empty).
    pub fn gives_length(&self) -> bool {
        match *self {
            ChannelKind::Mpt { .. } => true,
            #[cfg(feature = "ibv")]
            ChannelKind::Ibv { .. } => true,
            #[cfg(feature = "efa")]
            ChannelKind::Efa { .. } => true,
            _ => false,
        }
    }

    /// Which tensors we receive travel on the pipe's control connection, after their
    /// descriptor. The sender decides ([`Self::sends_on_control`]); an inline cma tensor is the
    /// one whose channel data is empty (a [`RemoteBuffer`] never is), and so is an inline
    /// `mpt`, `ibv` or `efa` one (a tensor on the lanes or the fabric has its length).
    pub fn carried(&self) -> Carried {
        match self {
            // Every basic tensor has empty channel data (the pipe checks it), while a tensor
            // routed to a CUDA channel never does: it travels elsewhere.
            ChannelKind::Basic { .. } | ChannelKind::Cma { .. } | ChannelKind::Mpt { .. } => {
                Carried::NoData
            }
            #[cfg(feature = "ibv")]
            ChannelKind::Ibv { .. } => Carried::NoData,
            ChannelKind::Xth { .. } => Carried::Nothing,
            #[cfg(feature = "cuda")]
            ChannelKind::CudaXth { .. } | ChannelKind::CudaIpc { .. } | ChannelKind::CudaBasic => {
                Carried::Nothing
            }
            #[cfg(all(feature = "cuda", feature = "ibv"))]
            ChannelKind::CudaGdr => Carried::Nothing,
            #[cfg(feature = "efa")]
            ChannelKind::Efa { .. } => Carried::NoData,
        }
    }

    /// The chunk size of tensors on the pipe's connection.
    pub fn control_chunk(&self) -> usize {
        match *self {
            ChannelKind::Basic { chunk_size }
            | ChannelKind::Cma { chunk_size, .. }
            | ChannelKind::Mpt { chunk_size, .. } => chunk_size,
            #[cfg(feature = "ibv")]
            ChannelKind::Ibv { chunk_size, .. } => chunk_size,
            #[cfg(feature = "efa")]
            ChannelKind::Efa { chunk_size, .. } => chunk_size,
            ChannelKind::Xth { .. } => usize::MAX,
            #[cfg(feature = "cuda")]
            ChannelKind::CudaXth { .. } | ChannelKind::CudaIpc { .. } | ChannelKind::CudaBasic => {
                usize::MAX
            }
            #[cfg(all(feature = "cuda", feature = "ibv"))]
            ChannelKind::CudaGdr => usize::MAX,
        }
    }

    /// Whether this kind moves CUDA-routed tensors (those of a device pair other than
    /// cpu->cpu), with [`SendCuda`] and [`RecvCuda`].
    pub fn carries_cuda(&self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            ChannelKind::CudaXth { .. } | ChannelKind::CudaIpc { .. } | ChannelKind::CudaBasic => {
                true
            }
            #[cfg(all(feature = "cuda", feature = "ibv"))]
            ChannelKind::CudaGdr => true,
            _ => false,
        }
    }
}
