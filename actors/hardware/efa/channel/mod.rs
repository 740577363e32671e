//! The `efa` channel (feature `efa`): tensors move from the sender's buffer into the buffer the
//! receiver allocated, with no copy, as tagged messages on the context's libfabric endpoint
//! (the one its `efa` transport uses, when both are on: one endpoint per domain).
//!
//! - **Set-up.** The channel has one connection of its own (a lane). When the pipe starts, each
//!   side sends on it its endpoint's address and its largest message, then, once it has the
//!   peer's address in its address vector, its pipe number on the endpoint (see
//!   `driver.rs`). The lane then stays open, idle: its end (the peer closed or died)
//!   fails the channel's pending operations, in order.
//! - **Data.** The sender posts tagged sends straight from its buffer; the receiver posts tagged
//!   receives straight into its buffer when the pipe's `Read` reaches the channel. Tensors larger
//!   than the chunk (the smaller of the two sides' limits: the provider's maximum message size, or
//!   [`Efa::max_message`]) go as several messages, cut at the same offsets on both sides.
//! - **Small tensors** (1 to [`Efa::inline_max`] bytes, [`INLINE_MAX`] by default) travel
//!   inline instead, like basic ones, after their descriptor on the pipe's control stream (the
//!   `efa` transport's bounce buffers): one message a direction instead of two, and no receive
//!   that must wait for the pipe's `Read`. Their channel data is empty; every other tensor's is
//!   its length (8 bytes, little-endian), which the receiver checks.
//! - **Order.** Both sides number the chunks they move in the order the pipe hands them tensors;
//!   the tag carries that number and the receiving pipe's, so the n-th chunk posted by the
//!   receiver can only match the n-th chunk sent.
//! - **Registration.** Only where the provider requires it (`FI_MR_LOCAL`), through the
//!   endpoint's registration cache ([`crate::backend::efa::regcache`]), whose invalidation rule keeps a
//!   registration no longer than the runtime holds the buffer.
//!
//! - **Several domains (NICs).** With [`Efa::domains`] or [`Efa::all_domains`] the channel also
//!   uses the context's endpoints on further domains of the provider (one shared endpoint actor
//!   per domain). At set-up each side lists its domains (fabric and endpoint address); both
//!   pair them the same way ([`pair_domains`]: the transport's own domain with the peer's, then
//!   equal fabrics in order) and stripe each large tensor over the pairs with mpt's plan
//!   ([`crate::backend::mpt::stripes`]: one stripe per pair, none under 64 KiB, so small tensors stay
//!   whole on the first). Peers with no further domain in common use one, as before.
//!
//! Negotiation: the channel's domain descriptor is the transport's (`provider/fabric`, with the
//! host's identity for `shm`), so two peers pick it only if they reach the same fabric.

use actix::Addr;

pub(crate) mod driver;
pub(crate) mod path;

use crate::actors::hardware::efa::transport::Efa as EfaTransport;
use crate::actors::hardware::efa::FabricEndpoint;
use crate::channel::ChannelBackend;
use crate::error::Error;
use crate::negotiate::DevicePair;

/// What a new pipe's `efa` channel is given: its context's endpoint actor (or why there is
/// none), the endpoints on its further domains, and its chunk limit.
pub struct ChannelPort {
    /// The endpoint actor the channel posts on (the transport's domain).
    pub endpoint: Result<Addr<FabricEndpoint>, Error>,
    /// Endpoint actors on further domains of the provider, to stripe large tensors over
    /// (empty: one domain).
    pub extra: Vec<Addr<FabricEndpoint>>,
    /// The largest message it sends (the provider's maximum may be smaller).
    pub max_message: usize,
}

/// Which domains of the provider an `efa` channel uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Domains {
    /// The transport's one (the default).
    One,
    /// The transport's, then these (names as `fi_info` shows them: `lo`, `rdmap0s6-rdm`);
    /// names the provider does not list here are left out.
    Named(Vec<String>),
    /// Every RDM domain the provider lists here.
    All,
}

/// The largest tensor that travels inline on the control stream by default (see
/// [`Efa::inline_max`]). Measured on the development VM (git history's docs/efa-measurements.md, "Small
/// tensors inline"): an 8 KiB tensor's round trip in spin mode took 18.1 µs through the
/// transport against 29.0 µs in place on `tcp;ofi_rxm`, and 8.3 against 11.2 µs on `shm`. At 16
/// KiB a message no longer reads whole with its frame (16 KiB in all), and in place is faster on
/// `tcp;ofi_rxm`.
pub const INLINE_MAX: u64 = 8 << 10;

/// How long a failed `efa` channel waits for the provider to let go of the tensors it holds
/// before it hands each back as a stand-in copy ([`crate::WriteDone::stand_ins`]). The
/// originals come back themselves whenever the provider ends their operations in time: a
/// cancelled receive (within a few milliseconds on both providers of libfabric 1.17), a send
/// a live peer completes. A send to a killed peer never ends on either provider until the
/// endpoint closes, so its tensor comes back as a stand-in, this long after the failure.
pub const STAND_IN_AFTER: std::time::Duration = std::time::Duration::from_millis(200);

/// The `efa` channel backend. See the module docs.
#[derive(Debug, Clone)]
pub struct Efa {
    port: EfaTransport,
    max_message: usize,
    inline_max: u64,
    domains: Domains,
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
            inline_max: INLINE_MAX,
            domains: Domains::One,
        }
    }

    /// Tensors of 1 to `bytes` bytes travel inline, after their descriptor on the pipe's
    /// control stream, instead of as tagged messages of their own ([`INLINE_MAX`] by default; 0:
    /// every tensor in place). Inline costs a copy on each side; in place costs a second message
    /// and a receive posted only once the pipe's `Read` reaches the channel. The peers need
    /// not agree: the sender decides, and the receiver reads a tensor inline exactly when its
    /// channel data is empty.
    pub fn inline_max(mut self, bytes: u64) -> Efa {
        self.inline_max = bytes;
        self
    }

    /// The transport whose endpoint actors the channel posts on.
    pub(crate) fn transport(&self) -> &EfaTransport {
        &self.port
    }

    /// See [`Efa::inline_max`].
    pub fn inline_limit(&self) -> u64 {
        self.inline_max
    }

    /// Also uses these domains of the provider (beside the transport's), striping large tensors
    /// over those the peer reaches too. See the module docs.
    pub fn domains(mut self, names: &[&str]) -> Efa {
        self.domains = Domains::Named(names.iter().map(|n| n.to_string()).collect());
        self
    }

    /// Uses every RDM domain the provider lists here, striping large tensors over those the
    /// peer reaches too.
    pub fn all_domains(mut self) -> Efa {
        self.domains = Domains::All;
        self
    }

    /// Uses `domains` ([`Efa::domains`] and [`Efa::all_domains`] in one).
    pub fn with_domains(mut self, domains: Domains) -> Efa {
        self.domains = domains;
        self
    }

    /// The further domains' names (not the transport's), in the order given or listed.
    fn extra_domains(&self) -> Vec<String> {
        let own = self.port.domain_name().ok();
        let listed: Vec<String> = match self.port.domains() {
            Ok(l) => l.into_iter().map(|(_, d)| d).collect(),
            Err(_) => return Vec::new(),
        };
        let wanted: Vec<String> = match &self.domains {
            Domains::One => return Vec::new(),
            Domains::All => listed.clone(),
            Domains::Named(names) => names.clone(),
        };
        let mut out: Vec<String> = Vec::new();
        for d in wanted {
            if listed.contains(&d) && own.as_ref() != Some(&d) && !out.contains(&d) {
                out.push(d);
            }
        }
        out
    }

    /// Chunks tensors at `bytes` (at least 1) when that is below the provider's maximum message
    /// size. The two sides use the smaller of their limits.
    pub fn max_message(mut self, bytes: usize) -> Efa {
        self.max_message = bytes.max(1);
        self
    }
}

impl crate::channel::sealed::Sealed for Efa {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::Efa {
            chunk_size: at.chunk_size,
            inline_max: self.inline_limit(),
        }
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
        // The lane carries two small frames at set-up, then nothing, or (rendezvous, under
        // rxm's passthru) one small frame per in-place tensor.
        4 << 10
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl Efa {
    /// The endpoints a new pipe's channel posts on, and its chunk limit.
    pub(crate) fn fabric_port(&self) -> Option<ChannelPort> {
        let extra = self
            .extra_domains()
            .into_iter()
            .filter_map(|d| match self.port.endpoint_on(&d) {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::warn!("efa channel: domain {d} left out: {e}");
                    None
                }
            })
            .collect();
        Some(ChannelPort {
            endpoint: self.port.endpoint(),
            extra,
            max_message: self.max_message,
        })
    }
}

/// Pairs our domains with the peer's, the same way on both sides: `(ours, theirs)` indices
/// into the two lists of fabrics, each side's first (its transport's domain, which negotiation
/// matched) with the other's first, then, fabric by fabric in sorted order, the k-th further
/// domain on a fabric with the peer's k-th on the same fabric. The result's order is the
/// stripe order; swapping the arguments swaps each pair and keeps the order.
pub fn pair_domains(ours: &[String], theirs: &[String]) -> Vec<(usize, usize)> {
    if ours.is_empty() || theirs.is_empty() {
        return Vec::new();
    }
    let mut pairs = vec![(0, 0)];
    let mut fabrics: Vec<&String> = ours[1..]
        .iter()
        .filter(|f| theirs[1..].contains(f))
        .collect();
    fabrics.sort();
    fabrics.dedup();
    for f in fabrics {
        let a = (1..ours.len()).filter(|&i| ours[i] == *f);
        let b = (1..theirs.len()).filter(|&i| theirs[i] == *f);
        pairs.extend(a.zip(b));
    }
    pairs
}

/// Splits `len` bytes into `(offset, length)` chunks of at most `chunk` bytes (see
/// [`crate::backend::basic::chunks`]); both sides cut a tensor the same way.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    crate::backend::basic::chunks(len as u64, chunk as u64).map(|(o, n)| (o as usize, n as usize))
}

#[cfg(test)]
mod tests {
    use super::pair_domains;

    fn v(x: &[&str]) -> Vec<String> {
        x.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn pairs_are_the_same_from_both_sides() {
        let a = v(&["net", "lo", "net", "x"]);
        let b = v(&["net", "net", "y", "lo", "net"]);
        let ab = pair_domains(&a, &b);
        let ba: Vec<_> = pair_domains(&b, &a)
            .into_iter()
            .map(|(x, y)| (y, x))
            .collect();
        assert_eq!(ab, ba);
        // First with first; then "lo"; then the further "net"s in order; "x"/"y" unmatched.
        assert_eq!(ab, vec![(0, 0), (1, 3), (2, 1)]);
    }

    #[test]
    fn no_common_further_domain_leaves_the_first() {
        assert_eq!(pair_domains(&v(&["a", "b"]), &v(&["a", "c"])), vec![(0, 0)]);
        assert_eq!(pair_domains(&v(&["a"]), &v(&["a", "a"])), vec![(0, 0)]);
        assert!(pair_domains(&[], &v(&["a"])).is_empty());
    }
}
