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

pub mod core;
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
use super::ChannelBackend;
use crate::error::{Error, Origin};
use crate::handshake::Halves;
use crate::negotiate::DevicePair;
use crate::transport::ibv::bootstrap::{self, Hello};
use crate::transport::ibv::{check_reach, domain_of, Ibv};
use crate::transport::BoxWrite;
use crate::verbs::{Device, MIN_OP_BYTES};

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
            chunk_limit: crate::verbs::MAX_OP_BYTES,
            caches: OnceLock::new(),
        }))
    }

    fn edit(&self, f: impl FnOnce(&mut Inner)) -> IbvChannel {
        let mut inner = Inner {
            ibv: self.0.ibv.clone(),
            inline_max: self.0.inline_max,
            keep: self.0.keep,
            chunk_limit: self.0.chunk_limit,
            caches: OnceLock::new(),
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
    /// invalidation rule of [`crate::verbs::regcache`].
    pub fn with_registration_keep(self, bytes: u64) -> IbvChannel {
        self.edit(|i| i.keep = bytes)
    }

    /// Splits each tensor into RDMA writes of at most `bytes` (default and maximum 1 GiB, the
    /// verbs limit; at least 64 bytes). For tests that exercise chunking with small tensors.
    pub fn with_chunk_limit(self, bytes: u64) -> IbvChannel {
        self.edit(|i| i.chunk_limit = bytes)
    }

    /// The largest tensor sent inline.
    pub fn inline_max(&self) -> u64 {
        self.0.inline_max
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

/// Bootstraps the channel's queue pair over its lane, then returns what to watch: the queue
/// pair's completions and the lane's hang-up (the [`Watch`] shares `rdma`, keeping its queue
/// pair alive while it watches the queue pair's descriptor).
pub(crate) async fn connect(
    rdma: Arc<Mutex<Rdma>>,
    lane: Halves,
    port: (crate::verbs::LinkLayer, u8),
    origin: Origin,
) -> Result<Watch, Error> {
    let io = |op, e| Error::io(op, e, &origin);
    let Halves {
        mut read,
        mut write,
        ..
    } = lane;
    let ours = Hello {
        link_layer: port.0,
        port: port.1,
        endpoint: lock(&rdma).qp.endpoint(),
        inbox_addr: 0,
        inbox_rkey: 0,
        inbox_cap: 0,
    };
    let handshake = async {
        let theirs = bootstrap::exchange(&mut read, &mut write, &ours)
            .await
            .map_err(|e| io("exchanging ibv channel hellos", e))?;
        check_reach(&ours, &theirs).map_err(|e| Error::protocol(e, &origin))?;
        lock(&rdma)
            .qp
            .connect(&theirs.endpoint)
            .map_err(|e| verbs_error("connecting the channel's queue pair", e, &origin))?;
        bootstrap::ready(&mut read, &mut write)
            .await
            .map_err(|e| io("waiting for the ibv channel peer", e))
    };
    tokio::time::timeout(BOOTSTRAP_TIMEOUT, handshake)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Timeout {
                what: "setting up the ibv channel's queue pair",
                after: BOOTSTRAP_TIMEOUT,
                origin: origin.clone(),
            })
        })?;
    let fd = {
        let mut r = lock(&rdma);
        r.qp.arm()
            .map_err(|e| verbs_error("ibv_req_notify_cq", e, &origin))?;
        r.connected();
        r.qp.notify_fd()
    };
    // SAFETY: the descriptor belongs to the queue pair inside `rdma`, which the `Watch` keeps
    // alive and drops after the `AsyncFd` (field order), so it stays open and the same for the
    // registration's whole life.
    let notify =
        unsafe { AsyncFd::register_with_interest(NotifyFd(fd), tokio::io::Interest::READABLE) }
            .map_err(|e| io("watching the completion channel", e.into()))?;
    Ok(Watch {
        notify,
        hangup: Box::pin(read),
        _bootstrap: write,
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
    /// The completion queue signalled: progress it, re-arm, progress again.
    Completions,
    /// The peer hung up the lane (or it failed): the peer is gone.
    PeerGone(String),
    /// The completion channel can no longer be watched (the reactor is going away).
    Broken(String),
}

/// A stream of [`Event`]s: the completion queue's descriptor and the lane's hang-up.
pub(crate) struct Watch {
    notify: AsyncFd<NotifyFd>,
    hangup: Pin<Box<tokio::io::BufReader<crate::transport::BoxRead>>>,
    /// Kept open: dropping it tells the peer we hung up.
    _bootstrap: BoxWrite,
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
                    Event::Completions
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
        if let Poll::Ready(r) = self.hangup.as_mut().poll_read(cx, &mut rb) {
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
