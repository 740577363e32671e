//! The `efa` channel (feature `efa`): tensors move from the sender's buffer into the buffer the
//! receiver allocated, with no copy, as tagged messages on the context's libfabric endpoint
//! (the one its `efa` transport uses, when both are on: one endpoint per domain).
//!
//! - **Set-up.** The channel has one connection of its own (a lane). When the pipe starts, each
//!   side sends on it its endpoint's address and its largest message, then, once it has the
//!   peer's address in its address vector, its pipe number on the endpoint (see
//!   `actors/channel/efa.rs`). The lane then stays open, idle: its end (the peer closed or died)
//!   fails the channel's pending operations, in order.
//! - **Data.** The sender posts tagged sends straight from its buffer; the receiver posts tagged
//!   receives straight into its buffer when the pipe's `Read` reaches the channel. Tensors larger
//!   than the chunk (the smaller of the two sides' limits: the provider's maximum message size, or
//!   [`Efa::max_message`]) go as several messages, cut at the same offsets on both sides.
//! - **Order.** Both sides number the chunks they move in the order the pipe hands them tensors;
//!   the tag carries that number and the receiving pipe's, so the n-th chunk posted by the
//!   receiver can only match the n-th chunk sent.
//! - **Registration.** Only where the provider requires it (`FI_MR_LOCAL`), through the
//!   endpoint's registration cache ([`crate::fabric::regcache`]), whose invalidation rule keeps a
//!   registration no longer than the runtime holds the buffer.
//!
//! Negotiation: the channel's domain descriptor is the transport's (`provider/fabric`, with the
//! host's identity for `shm`), so two peers pick it only if they reach the same fabric.

use actix::Addr;

use super::ChannelBackend;
use crate::actors::fabric::transport::Efa as EfaTransport;
use crate::actors::fabric::FabricEndpoint;
use crate::error::Error;
use crate::negotiate::DevicePair;

/// What a new pipe's `efa` channel is given: its context's endpoint actor (or why there is
/// none) and its chunk limit.
pub struct ChannelPort {
    /// The endpoint actor the channel posts on.
    pub endpoint: Result<Addr<FabricEndpoint>, Error>,
    /// The largest message it sends (the provider's maximum may be smaller).
    pub max_message: usize,
}

/// The `efa` channel backend. See the module docs.
#[derive(Debug, Clone)]
pub struct Efa {
    port: EfaTransport,
    max_message: usize,
}

impl Efa {
    /// The channel over `provider` (`efa`, `tcp;ofi_rxm`, `shm`), with an endpoint of its own.
    pub fn new(provider: &str) -> Efa {
        Efa::over(&EfaTransport::new(provider))
    }

    /// The channel on the same endpoint actor as `transport` (same provider, domain and
    /// settings): what [`crate::ContextBuilder::efa`] sets up.
    pub fn over(transport: &EfaTransport) -> Efa {
        Efa {
            port: transport.clone(),
            max_message: usize::MAX,
        }
    }

    /// Chunks tensors at `bytes` (at least 1) when that is below the provider's maximum message
    /// size. The two sides use the smaller of their limits.
    pub fn max_message(mut self, bytes: usize) -> Efa {
        self.max_message = bytes.max(1);
        self
    }
}

impl ChannelBackend for Efa {
    fn name(&self) -> &'static str {
        "efa"
    }

    fn priority(&self) -> i32 {
        50
    }

    fn domain(&self) -> String {
        crate::transport::Transport::domain(&self.port)
    }

    fn devices(&self) -> DevicePair {
        DevicePair::CPU
    }

    fn connections(&self) -> u32 {
        1
    }

    fn viable(&self) -> Result<(), String> {
        crate::transport::Transport::viable(&self.port)
    }

    fn lane_read_buffer(&self) -> usize {
        // The lane carries two small frames at set-up, then nothing.
        4 << 10
    }

    fn fabric_port(&self) -> Option<ChannelPort> {
        Some(ChannelPort {
            endpoint: self.port.endpoint(),
            max_message: self.max_message,
        })
    }
}

/// Splits `len` bytes into `(offset, length)` chunks of at most `chunk` bytes (see
/// [`super::basic::chunks`]); both sides cut a tensor the same way.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    super::basic::chunks(len as u64, chunk as u64).map(|(o, n)| (o as usize, n as usize))
}
