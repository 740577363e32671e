//! The `ibv` channel: CPU tensors by RDMA write, straight from the sender's buffer into the
//! buffer the receiver allocated, each side's buffer registered through a registration cache.
//! `docs/ibv.md` describes it whole; [`core`] holds the protocol.
//!
//! Each pipe's channel has one connection of its own (a lane, over the transport the pipe was
//! bootstrapped with, usually TCP). It is the channel's bootstrap, like the `ibv` transport's:
//! both sides create a queue pair, exchange a [`Hello`] (queue pair number, LID, GID, PSN),
//! connect, and exchange a ready byte. The connection then stays open, carrying nothing: its
//! hang-up tells a side at once that the peer is gone. Everything else travels on the queue
//! pair.
//!
//! The device comes from an [`Ibv`] (the transport's device choice: hardware, a named port, or
//! the simulation), so [`IbvChannel::new`] with [`Ibv::simulated`] runs on the simulated device.
//! The domain is the transport's: peers on different subnets, link layers or simulations never
//! pick it.
//!
//! **Several devices.** [`IbvChannel::with_devices`] adds further devices (NICs). The channel
//! then creates one queue pair per device; after the first device's hellos, each side sends the
//! count of its further devices and one hello each, and both pair their k-th further device
//! with the peer's k-th where the two can reach each other (`check_reach`, symmetric, so both
//! sides keep the same pairs). Each pair is a link with its own queue pair, registration caches
//! and completion watch; a tensor is cut by mpt's plan ([`crate::backend::mpt::stripes`]: one stripe per
//! link, none under 64 KiB) and each stripe moves on its link as a tensor of its own, in the
//! same order on both sides. A failure on any link fails them all.
//!
//! **GPU tensors** (`cuda_gdr`, which runs on this channel's queue pairs) go through the links of
//! the NICs nearest their GPU instead, where the devices are placed on PCIe ([`placement`],
//! [`IbvChannel::with_topology`]).

mod buf;
pub mod core;
pub(crate) mod driver;
pub mod placement;
#[cfg(test)]
mod tests;

use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, ReadBuf};

use self::core::{verbs_error, Caches, Rdma};
use self::placement::GpuLinks;
use crate::backend::ibv::transport::bootstrap::{self, Hello};
use crate::backend::ibv::transport::{check_reach, domain_of, Ibv};
use crate::backend::ibv::{Device, MIN_OP_BYTES};
use crate::channel::ChannelBackend;
use crate::error::{Error, Origin};
use crate::handshake::Halves;
use crate::negotiate::DevicePair;
use crate::topology::Topology;
use crate::transport::BoxWrite;

/// The largest tensor that always travels inline on the control stream: RDMA operations carry
/// at least 32 bytes.
pub const MIN_INLINE: u64 = MIN_OP_BYTES - 1;
/// How long the channel's bootstrap may take.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(10);

/// The opened device and its registration caches, or why the device did not open.
type Opened = Result<(Arc<dyn Device>, Caches), String>;

struct Inner {
    ibv: Ibv,
    inline_max: u64,
    keep: u64,
    chunk_limit: u64,
    caches: OnceLock<Opened>,
    /// Further devices, each with its caches once opened.
    further: Vec<(Ibv, OnceLock<Opened>)>,
    /// Where the devices sit on PCIe, as given ([`IbvChannel::with_topology`]).
    topology: Option<Arc<Topology>>,
    /// Otherwise this host's, read on first use (`None` where `/sys` cannot be read).
    live: OnceLock<Option<Arc<Topology>>>,
}

/// The `ibv` channel backend. Cheap to clone; clones share the device and its registration
/// caches (one per context, shared by its pipes).
#[derive(Clone)]
pub struct IbvChannel(Arc<Inner>);

impl std::fmt::Debug for IbvChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvChannel")
            .field("ibv", &self.0.ibv)
            .field("inline_max", &self.0.inline_max)
            .field("keep", &self.0.keep)
            .finish()
    }
}

impl IbvChannel {
    /// The channel on `ibv`'s device, with its queue depths.
    pub fn new(ibv: Ibv) -> IbvChannel {
        IbvChannel(Arc::new(Inner {
            ibv,
            inline_max: MIN_INLINE,
            keep: 0,
            chunk_limit: crate::backend::ibv::MAX_OP_BYTES,
            caches: OnceLock::new(),
            further: Vec::new(),
            topology: None,
            live: OnceLock::new(),
        }))
    }

    fn edit(&self, f: impl FnOnce(&mut Inner)) -> IbvChannel {
        let mut inner = Inner {
            ibv: self.0.ibv.clone(),
            inline_max: self.0.inline_max,
            keep: self.0.keep,
            chunk_limit: self.0.chunk_limit,
            caches: OnceLock::new(),
            further: self
                .0
                .further
                .iter()
                .map(|(i, _)| (i.clone(), OnceLock::new()))
                .collect(),
            topology: self.0.topology.clone(),
            live: OnceLock::new(),
        };
        f(&mut inner);
        IbvChannel(Arc::new(inner))
    }

    /// Tensors of 1 to `bytes` bytes travel inline on the control stream instead (at least
    /// [`MIN_INLINE`], the default: RDMA operations carry 32 bytes or more). Raise it where a
    /// copy through the transport costs less than the channel's request round trip.
    pub fn with_inline_max(self, bytes: u64) -> IbvChannel {
        self.edit(|i| i.inline_max = bytes.max(MIN_INLINE))
    }

    /// Keeps up to `bytes` of idle registrations per cache (0, the default, deregisters a
    /// buffer's registration before the buffer goes back to the application). Only for
    /// applications that never free a buffer they gave a pipe while the context lives: see the
    /// invalidation rule of [`crate::backend::ibv::regcache`].
    pub fn with_registration_keep(self, bytes: u64) -> IbvChannel {
        self.edit(|i| i.keep = bytes)
    }

    /// Splits each tensor into RDMA writes of at most `bytes` (default and maximum 1 GiB, the
    /// verbs limit; at least 64 bytes). For tests that exercise chunking with small tensors.
    pub fn with_chunk_limit(self, bytes: u64) -> IbvChannel {
        self.edit(|i| i.chunk_limit = bytes)
    }

    /// Also uses these devices (further NICs of this host: [`Ibv::device`] for hardware,
    /// [`Ibv::simulated_device`] for the simulation), striping large tensors over those the
    /// peer reaches too (see the module docs). A further device that does not open is left
    /// out. GPU tensors (`cuda_gdr`) take the devices nearest their GPU where the devices are
    /// placed ([`Self::with_topology`]).
    pub fn with_devices(self, devices: Vec<Ibv>) -> IbvChannel {
        self.edit(|i| i.further = devices.into_iter().map(|d| (d, OnceLock::new())).collect())
    }

    /// Where this host's devices and GPUs sit on PCIe, for `cuda_gdr` to send each GPU's
    /// tensors through the devices nearest it ([`Topology::devices_for_gpu`]). Devices are
    /// found in it by name: a real HCA as sysfs lists it (`mlx5_0`), a simulated device
    /// (`sim<i>`, which sysfs does not list) only where [`Topology::place`] put it. By default
    /// this host's tree is read (`Topology::live`), which places every real HCA and no
    /// simulated device; `Topology::default()` places none. Where none of the channel's
    /// devices is placed, every tensor uses every device, as host tensors always do.
    pub fn with_topology(self, topology: Topology) -> IbvChannel {
        self.edit(|i| i.topology = Some(Arc::new(topology)))
    }

    /// The topology that places the devices: the one given, else this host's (read once).
    pub fn topology(&self) -> Option<Arc<Topology>> {
        self.0.topology.clone().or_else(|| {
            self.0
                .live
                .get_or_init(|| Topology::live().ok().map(Arc::new))
                .clone()
        })
    }

    /// The first device (the transport's, usually).
    pub fn device(&self) -> &Ibv {
        &self.0.ibv
    }

    /// The largest tensor sent inline.
    pub fn inline_max(&self) -> u64 {
        self.0.inline_max
    }

    /// The further devices that open, with their registration caches, in the order given.
    pub fn further_caches(&self) -> Vec<(Ibv, Arc<dyn Device>, Caches)> {
        self.0
            .further
            .iter()
            .filter_map(|(ibv, cell)| {
                let opened = cell.get_or_init(|| {
                    let device = ibv.open()?;
                    let caches = Caches::new(&device, self.0.keep);
                    Ok((device, caches))
                });
                match opened {
                    Ok((d, c)) => Some((ibv.clone(), d.clone(), c.clone())),
                    Err(e) => {
                        tracing::warn!("ibv channel: a further device left out: {e}");
                        None
                    }
                }
            })
            .collect()
    }

    /// The device and its registration caches, opened on first use.
    pub fn caches(&self) -> Opened {
        self.0
            .caches
            .get_or_init(|| {
                let device = self.0.ibv.open()?;
                let caches = Caches::new(&device, self.0.keep);
                Ok((device, caches))
            })
            .clone()
    }
}

impl crate::channel::sealed::Sealed for IbvChannel {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::Ibv {
            chunk_size: at.chunk_size,
            inline_max: self.inline_max(),
        }
    }
}

impl ChannelBackend for IbvChannel {
    fn name(&self) -> &'static str {
        "ibv"
    }

    fn priority(&self) -> i32 {
        100
    }

    fn domain(&self) -> String {
        domain_of(&self.0.ibv)
    }

    fn devices(&self) -> DevicePair {
        DevicePair::CPU
    }

    fn connections(&self) -> u32 {
        1
    }

    fn viable(&self) -> Result<(), String> {
        self.caches().map(|_| ())
    }

    fn lane_read_buffer(&self) -> usize {
        // The lane carries a hello and a ready byte, then nothing.
        bootstrap::HELLO_LEN + 1
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// Locks the channel state (only the channel actor's thread takes it).
pub(crate) fn lock(rdma: &Mutex<Rdma>) -> MutexGuard<'_, Rdma> {
    rdma.lock().unwrap_or_else(|p| p.into_inner())
}

/// Creates the channel's queue pair (posting its receives), before the bootstrap: tensors can
/// be queued on it at once.
pub(crate) fn create(backend: &IbvChannel, origin: &Origin) -> Result<Rdma, Error> {
    let (device, caches) = backend.caches().map_err(|reason| Error::Unavailable {
        backend: "ibv".into(),
        reason,
    })?;
    let qp = device
        .create_qp(backend.0.ibv.caps())
        .map_err(|e| verbs_error("creating the channel's queue pair", e, origin))?;
    let mut rdma = Rdma::new(&*device, qp, caches, origin.clone())?;
    rdma.set_chunk_limit(backend.0.chunk_limit);
    Ok(rdma)
}

/// A port: its link layer and number.
pub(crate) type Port = (crate::backend::ibv::LinkLayer, u8);

/// A further device's channel state (shared with its watch) and its port.
pub(crate) type FurtherQp = (Arc<Mutex<Rdma>>, Port);

/// Creates a queue pair on each further device that opens (the same way), with its port and
/// the device's name.
pub(crate) fn create_further(backend: &IbvChannel, origin: &Origin) -> Vec<(Rdma, Port, String)> {
    let mut out = Vec::new();
    for (ibv, device, caches) in backend.further_caches() {
        let port = (device.port().link_layer, device.port().port);
        let name = device.info().name.clone();
        let made = device
            .create_qp(ibv.caps())
            .map_err(|e| verbs_error("creating a further queue pair", e, origin))
            .and_then(|qp| Rdma::new(&*device, qp, caches, origin.clone()));
        match made {
            Ok(r) => out.push((r, port, name)),
            Err(e) => tracing::warn!("ibv channel: a further device left out: {e}"),
        }
    }
    out
}

/// The hello of `rdma`'s queue pair on `port`.
fn hello_of(rdma: &Mutex<Rdma>, port: (crate::backend::ibv::LinkLayer, u8)) -> Hello {
    Hello {
        link_layer: port.0,
        port: port.1,
        endpoint: lock(rdma).qp.endpoint(),
        inbox_addr: 0,
        inbox_rkey: 0,
        inbox_cap: 0,
    }
}

/// Sends the count of our further devices and their hellos; reads the peer's.
async fn exchange_further(
    read: &mut (impl tokio::io::AsyncRead + Unpin),
    write: &mut (impl tokio::io::AsyncWrite + Unpin),
    ours: &[Hello],
) -> std::io::Result<Vec<Hello>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut b = vec![ours.len() as u8];
    for h in ours {
        b.extend_from_slice(&h.encode());
    }
    write.write_all(&b).await?;
    write.flush().await?;
    let n = read.read_u8().await?;
    let mut theirs = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let mut h = [0u8; bootstrap::HELLO_LEN];
        read.read_exact(&mut h).await?;
        theirs.push(
            Hello::decode(&h)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?,
        );
    }
    Ok(theirs)
}

/// Which further devices pair: `ours[k]` with `theirs[k]` where they reach each other (the check
/// is symmetric, so the peer keeps the same `k`s).
pub fn pair_further(ours: &[Hello], theirs: &[Hello]) -> Vec<usize> {
    ours.iter()
        .zip(theirs)
        .enumerate()
        .filter(|(_, (a, b))| check_reach(a, b).is_ok())
        .map(|(k, _)| k)
        .collect()
}

/// A bootstrapped channel: which further devices paired with the peer's (indices into the
/// further queue pairs, in order), the peer's [`GpuLinks`], and what to watch: per link (the
/// first device's, then each paired further one) its queue pair's completions, and on the first
/// the lane's hang-up (a [`Watch`] shares its `rdma`, keeping the queue pair alive while it
/// watches its descriptor).
pub(crate) struct Connected {
    pub kept: Vec<usize>,
    pub peer_gpus: GpuLinks,
    pub watches: Vec<Watch>,
}

/// Bootstraps the channel's queue pairs over its lane (the first device's, then the further
/// ones': `further`, with their ports) and exchanges the sides' [`GpuLinks`] (`gpus`, ours).
pub(crate) async fn connect(
    rdma: Arc<Mutex<Rdma>>,
    further: Vec<FurtherQp>,
    gpus: GpuLinks,
    lane: Halves,
    port: (crate::backend::ibv::LinkLayer, u8),
    origin: Origin,
) -> Result<Connected, Error> {
    let io = |op, e| Error::io(op, e, &origin);
    let Halves {
        mut read,
        mut write,
        ..
    } = lane;
    let ours = hello_of(&rdma, port);
    let further_hellos: Vec<Hello> = further
        .iter()
        .take(u8::MAX as usize)
        .map(|(r, p)| hello_of(r, *p))
        .collect();
    let handshake = async {
        let theirs = bootstrap::exchange(&mut read, &mut write, &ours)
            .await
            .map_err(|e| io("exchanging ibv channel hellos", e))?;
        check_reach(&ours, &theirs).map_err(|e| Error::protocol(e, &origin))?;
        let theirs_further = exchange_further(&mut read, &mut write, &further_hellos)
            .await
            .map_err(|e| io("exchanging the ibv channel's further devices", e))?;
        let kept = pair_further(&further_hellos, &theirs_further);
        let peer_gpus = gpus
            .exchange(&mut read, &mut write)
            .await
            .map_err(|e| io("exchanging the ibv channel's GPU placement", e))?;
        lock(&rdma)
            .qp
            .connect(&theirs.endpoint)
            .map_err(|e| verbs_error("connecting the channel's queue pair", e, &origin))?;
        for &k in &kept {
            lock(&further[k].0)
                .qp
                .connect(&theirs_further[k].endpoint)
                .map_err(|e| verbs_error("connecting a further queue pair", e, &origin))?;
        }
        bootstrap::ready(&mut read, &mut write)
            .await
            .map_err(|e| io("waiting for the ibv channel peer", e))?;
        Ok((kept, peer_gpus))
    };
    let (kept, peer_gpus) = tokio::time::timeout(BOOTSTRAP_TIMEOUT, handshake)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Timeout {
                what: "setting up the ibv channel's queue pair",
                after: BOOTSTRAP_TIMEOUT,
                origin: origin.clone(),
            })
        })?;
    let mut watches = vec![watch(rdma, 0, Some((read, write)), &origin)?];
    for (link, &k) in kept.iter().enumerate() {
        watches.push(watch(further[k].0.clone(), link + 1, None, &origin)?);
    }
    Ok(Connected {
        kept,
        peer_gpus,
        watches,
    })
}

/// Arms `rdma`'s completion queue, marks it connected and watches its descriptor (and the
/// lane's hang-up, given the lane).
fn watch(
    rdma: Arc<Mutex<Rdma>>,
    link: usize,
    lane: Option<(tokio::io::BufReader<crate::transport::BoxRead>, BoxWrite)>,
    origin: &Origin,
) -> Result<Watch, Error> {
    let fd = {
        let mut r = lock(&rdma);
        r.qp.arm()
            .map_err(|e| verbs_error("ibv_req_notify_cq", e, origin))?;
        r.connected();
        r.qp.notify_fd()
    };
    // SAFETY: the descriptor belongs to the queue pair inside `rdma`, which the `Watch` keeps
    // alive and drops after the `AsyncFd` (field order), so it stays open and the same for the
    // registration's whole life.
    let notify =
        unsafe { AsyncFd::register_with_interest(NotifyFd(fd), tokio::io::Interest::READABLE) }
            .map_err(|e| Error::io("watching the completion channel", e.into(), origin))?;
    let (hangup, bootstrap) = match lane {
        Some((read, write)) => (Some(Box::pin(read)), Some(write)),
        None => (None, None),
    };
    Ok(Watch {
        notify,
        link,
        hangup,
        _bootstrap: bootstrap,
        gone: false,
        _rdma: rdma,
    })
}

/// The queue pair's notification descriptor, borrowed (the queue pair owns it, and the
/// [`Watch`] keeps the queue pair alive for as long as it watches it).
struct NotifyFd(RawFd);

impl AsRawFd for NotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What the channel actor is woken for.
#[derive(Debug)]
pub(crate) enum Event {
    /// Link `.0`'s completion queue signalled: progress it, re-arm, progress again.
    Completions(usize),
    /// The peer hung up the lane (or it failed): the peer is gone.
    PeerGone(String),
    /// The completion channel can no longer be watched (the reactor is going away).
    Broken(String),
}

/// A stream of [`Event`]s: the completion queue's descriptor and the lane's hang-up.
pub(crate) struct Watch {
    notify: AsyncFd<NotifyFd>,
    /// The link whose queue pair it watches (0: the first device's).
    link: usize,
    /// The lane (the first link's watch only).
    hangup: Option<Pin<Box<tokio::io::BufReader<crate::transport::BoxRead>>>>,
    /// Kept open: dropping it tells the peer we hung up.
    _bootstrap: Option<BoxWrite>,
    gone: bool,
    // Declared last: the queue pair outlives the `AsyncFd` watching its descriptor.
    _rdma: Arc<Mutex<Rdma>>,
}

impl futures_core::Stream for Watch {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        if self.gone {
            return Poll::Ready(None);
        }
        if let Poll::Ready(r) = self.notify.poll_read_ready(cx) {
            return Poll::Ready(Some(match r {
                Ok(mut guard) => {
                    guard.clear_ready();
                    Event::Completions(self.link)
                }
                Err(e) => {
                    // Reported once: the stream ends after it rather than spin.
                    self.gone = true;
                    Event::Broken(format!("watching the completion channel: {e}"))
                }
            }));
        }
        let mut byte = [0u8; 1];
        let mut rb = ReadBuf::new(&mut byte);
        let Some(hangup) = self.hangup.as_mut() else {
            return Poll::Pending;
        };
        if let Poll::Ready(r) = hangup.as_mut().poll_read(cx, &mut rb) {
            self.gone = true;
            let why = match r {
                Ok(()) if rb.filled().is_empty() => "the peer hung up the ibv channel".into(),
                Ok(()) => "unexpected bytes on the ibv channel's bootstrap connection".into(),
                Err(e) => format!("the ibv channel's bootstrap connection failed: {e}"),
            };
            return Poll::Ready(Some(Event::PeerGone(why)));
        }
        Poll::Pending
    }
}

/// Handles a completion-queue signal: acknowledge, progress, re-arm, and progress again for
/// what raced with the arming.
pub(crate) fn on_completions(rdma: &mut Rdma) {
    let _ = rdma.qp.ack_notifications();
    rdma.progress();
    if let Err(e) = rdma.qp.arm() {
        let e = verbs_error("ibv_req_notify_cq", e, rdma.origin());
        rdma.fail(e);
    }
    rdma.progress();
}
