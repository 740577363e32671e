//! The `ibv` transport: the control stream over InfiniBand verbs (RDMA writes with immediate
//! into the peer's inbox ring), bootstrapped over TCP. `docs/ibv.md` describes it whole.
//!
//! URLs are `ibv://host:port`: the TCP address of the bootstrap. A connection is one RC queue
//! pair with one completion queue, an inbox the peer writes into and an outbox it writes from
//! (`conn.rs`), driven by a task of its own on the connecting thread (`halves.rs`'s `Drive`:
//! one per connection, so each queue pair fails, drains and stops on its own) that waits for
//! completions. The device is chosen when the transport is made: [`Ibv::hardware`] (the first
//! active port of the first HCA, with the `ibv` feature), [`Ibv::device`], or
//! [`Ibv::simulated`], the in-process simulation of [`crate::backend::ibv::sim`], which is never chosen
//! by itself.

pub mod bootstrap;
pub mod conn;
pub(crate) mod halves;
#[cfg(test)]
mod tests;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use self::bootstrap::Hello;
use self::conn::{Core, RemoteRing, Ring, MAX_CAPACITY, MIN_CAPACITY, SLACK};
use self::halves::{Drive, IbvRead, IbvWrite, Shared};
use crate::backend::ibv::{self as verbs, Access, Device, LinkLayer, QpCaps};
use crate::backend::tcp::{self, Bootstrap, BootstrapAcceptor, TcpAcceptor};
use crate::error::Error;
use crate::transport::{Acceptor, BoxFuture, Stream, Transport, Url};

/// Default inbox ring size per connection and direction.
pub const DEFAULT_CAPACITY: usize = 1 << 20;
/// How long the bootstrap (hello, queue-pair connection, ready byte) may take.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(10);

/// Which device a transport uses.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// The in-process simulation, device `sim<index>`.
    Simulated(usize),
    /// A real HCA: by name (`None`: the first with an active port), port, GID index.
    Hardware {
        name: Option<String>,
        port: u8,
        gid_index: u8,
    },
}

struct Inner {
    source: Source,
    capacity: usize,
    caps: QpCaps,
    auto_listen: Option<String>,
    device: OnceLock<Result<Arc<dyn Device>, String>>,
}

/// The ibv transport. Cheap to clone; clones share the opened device.
#[derive(Clone)]
pub struct Ibv(Arc<Inner>);

impl std::fmt::Debug for Ibv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ibv")
            .field("source", &self.0.source)
            .field("capacity", &self.0.capacity)
            .field("caps", &self.0.caps)
            .finish()
    }
}

impl Ibv {
    fn with_source(source: Source) -> Ibv {
        Ibv(Arc::new(Inner {
            source,
            capacity: DEFAULT_CAPACITY,
            caps: QpCaps::default(),
            auto_listen: None,
            device: OnceLock::new(),
        }))
    }

    fn edit(self, f: impl FnOnce(&mut Inner)) -> Ibv {
        let mut inner = Arc::try_unwrap(self.0).unwrap_or_else(|shared| Inner {
            source: shared.source.clone(),
            capacity: shared.capacity,
            caps: shared.caps,
            auto_listen: shared.auto_listen.clone(),
            device: OnceLock::new(),
        });
        f(&mut inner);
        Ibv(Arc::new(inner))
    }

    /// Real hardware: port 1 (GID index 0) of the first RDMA device with an active port.
    pub fn hardware() -> Ibv {
        Ibv::with_source(Source::Hardware {
            name: None,
            port: 1,
            gid_index: 0,
        })
    }

    /// Real hardware: `port` of the device called `name` (`mlx5_0`), using GID `gid_index`
    /// (RoCE v2 usually needs the index of an IPv4-mapped GID; `show_gids` lists them).
    pub fn device(name: &str, port: u8, gid_index: u8) -> Ibv {
        Ibv::with_source(Source::Hardware {
            name: Some(name.into()),
            port,
            gid_index,
        })
    }

    /// The simulated device `sim0` of this process (see [`crate::backend::ibv::sim`]). Only two
    /// contexts of one process can talk through it; its domain makes sure of that.
    pub fn simulated() -> Ibv {
        Ibv::with_source(Source::Simulated(0))
    }

    /// The simulated device `sim<index>` of this process (a host with several HCAs: the `ibv`
    /// channel's further devices, [`crate::backend::ibv::channel::IbvChannel::with_devices`]).
    pub fn simulated_device(index: usize) -> Ibv {
        Ibv::with_source(Source::Simulated(index))
    }

    /// Inbox ring size for connections of this side, a power of two between 4 KiB and 256 MiB.
    pub fn with_capacity(self, bytes: usize) -> Ibv {
        let bytes = bytes.clamp(MIN_CAPACITY, MAX_CAPACITY).next_power_of_two();
        self.edit(|i| i.capacity = bytes)
    }

    /// Send- and receive-queue depths of each queue pair.
    pub fn with_queue_depths(self, send: u32, recv: u32) -> Ibv {
        self.edit(|i| {
            i.caps.max_send_wr = send.max(1);
            i.caps.max_recv_wr = recv.max(1);
        })
    }

    /// Makes listeners also listen here (`ibv://10.0.0.1:0`), so that pipes bootstrapped over
    /// another transport can move to ibv.
    pub fn auto_listen(self, url: &str) -> Ibv {
        let url = url.to_string();
        self.edit(|i| i.auto_listen = Some(url))
    }

    /// Send- and receive-queue depths of each queue pair.
    pub(crate) fn caps(&self) -> QpCaps {
        self.0.caps
    }

    /// Whether this transport uses the simulated device.
    pub fn is_simulated(&self) -> bool {
        matches!(self.0.source, Source::Simulated(_))
    }

    /// The opened device, or why there is none.
    pub fn open(&self) -> Result<Arc<dyn Device>, String> {
        self.0
            .device
            .get_or_init(|| match &self.0.source {
                Source::Simulated(i) => Ok(Arc::new(verbs::sim::SimDevice::open(*i)) as _),
                Source::Hardware {
                    name,
                    port,
                    gid_index,
                } => {
                    let name = match name {
                        Some(n) => n.clone(),
                        None => verbs::hw::devices()
                            .map_err(|e| e.to_string())?
                            .into_iter()
                            .find(|d| d.ports.iter().any(|p| p.active))
                            .map(|d| d.name)
                            .ok_or("no RDMA device has an active port")?,
                    };
                    let dev =
                        verbs::hw::open(&name, *port, *gid_index).map_err(|e| e.to_string())?;
                    if !dev.port().active {
                        return Err(format!("{name} port {port} is not active"));
                    }
                    Ok(Arc::from(dev))
                }
            })
            .clone()
    }

    fn unavailable(&self, reason: String) -> Error {
        Error::Unavailable {
            backend: "ibv".into(),
            reason,
        }
    }

    /// Turns a bootstrap TCP connection into an ibv connection.
    async fn setup(&self, stream: Stream) -> Result<Stream, Error> {
        let device = self.open().map_err(|e| self.unavailable(e))?;
        let peer_url = stream.peer.replacen("tcp://", "ibv://", 1);
        let local_url = stream.local.replacen("tcp://", "ibv://", 1);
        let origin = crate::error::Origin::new(peer_url.clone(), "ibv");
        let io = |op, e| Error::io(op, e, &origin);
        let vfail = |e: verbs::VerbsError| {
            Error::io(
                "setting up the queue pair",
                std::io::Error::other(e),
                &origin,
            )
        };
        let Stream {
            mut read,
            mut write,
            ..
        } = stream;
        let port = device.port().clone();
        let mut qp = device.create_qp(self.0.caps).map_err(vfail)?;
        let inbox = ring(&*device, self.0.capacity, Access::REMOTE_WRITE).map_err(vfail)?;
        let ours = Hello {
            link_layer: port.link_layer,
            port: port.port,
            endpoint: qp.endpoint(),
            inbox_addr: inbox.mr.addr(),
            inbox_rkey: inbox.mr.rkey(),
            inbox_cap: inbox.cap as u64,
        };
        let theirs = bootstrap::exchange(&mut read, &mut write, &ours)
            .await
            .map_err(|e| io("exchanging ibv hellos", e))?;
        check_peer(&ours, &theirs).map_err(|e| Error::protocol(e, &origin))?;
        let outbox = ring(&*device, theirs.inbox_cap as usize, Access::LOCAL).map_err(vfail)?;
        qp.connect(&theirs.endpoint).map_err(vfail)?;
        let core = Core::new(
            qp,
            inbox,
            outbox,
            RemoteRing {
                addr: theirs.inbox_addr,
                rkey: theirs.inbox_rkey,
                cap: theirs.inbox_cap as usize,
            },
        )
        .map_err(vfail)?;
        bootstrap::ready(&mut read, &mut write)
            .await
            .map_err(|e| io("waiting for the ibv peer", e))?;
        let shared = Shared::new(core);
        let drive = Drive::new(shared.clone(), read, write)
            .map_err(|e| io("arming the completion queue", e))?;
        // The queue pair's driver runs on this thread until both halves are gone and their
        // last writes have completed, or the peer hung up.
        drop(tokio::task::spawn_local(drive));
        Ok(Stream {
            read: Box::new(IbvRead(shared.clone())),
            write: Box::new(IbvWrite(shared)),
            peer: peer_url,
            local: local_url,
        })
    }
}

/// A zeroed ring of `cap` bytes plus the slack, registered.
fn ring(device: &dyn Device, cap: usize, access: Access) -> Result<Ring, verbs::VerbsError> {
    let mut mem = vec![0u8; cap + SLACK].into_boxed_slice();
    // SAFETY: `Ring` keeps `mem` (a boxed slice: it never moves) and drops the registration
    // first (field order).
    let mr = unsafe { device.register(mem.as_mut_ptr(), mem.len(), access) }?;
    Ok(Ring { mr, mem, cap })
}

/// Whether the two sides can talk: they can reach each other ([`check_reach`]), and a sane ring.
pub(crate) fn check_peer(ours: &Hello, theirs: &Hello) -> Result<(), String> {
    check_reach(ours, theirs)?;
    let cap = theirs.inbox_cap;
    if !cap.is_power_of_two() || !(MIN_CAPACITY as u64..=MAX_CAPACITY as u64).contains(&cap) {
        return Err(format!(
            "the peer's inbox size {cap} is not a power of two in range"
        ));
    }
    Ok(())
}

/// Whether two ports can reach each other: the same link layer and, simulated, the same
/// process's fabric. (The `ibv` channel's bootstrap checks the same.)
pub(crate) fn check_reach(ours: &Hello, theirs: &Hello) -> Result<(), String> {
    if ours.link_layer != theirs.link_layer {
        return Err(format!(
            "the peer's port is {}, ours is {}",
            theirs.link_layer, ours.link_layer
        ));
    }
    if ours.link_layer == LinkLayer::Simulated && ours.endpoint.gid[..8] != theirs.endpoint.gid[..8]
    {
        return Err("the peer's simulated device belongs to another process".into());
    }
    Ok(())
}

/// The bootstrap URL: `ibv://h:p` as `tcp://h:p`.
fn tcp_url(url: &str) -> Result<Url, Error> {
    let mut u = Url::parse(url)?;
    if u.scheme != "ibv" {
        return Err(Error::invalid(format!("not an ibv URL: {url:?}")));
    }
    u.scheme = "tcp".into();
    Ok(u)
}

/// The domain descriptor: peers must show the same string. InfiniBand ports must share a subnet
/// prefix; RoCE ports are reachable when IP routes them (the connect fails otherwise); the
/// simulation is reachable only inside this process. A device that cannot be opened gets a
/// string unique to this process.
pub fn domain_of(ibv: &Ibv) -> String {
    match ibv.open() {
        Ok(d) => {
            let p = d.port();
            match p.link_layer {
                LinkLayer::InfiniBand => format!("ib:{:016x}", p.subnet_prefix()),
                LinkLayer::Ethernet => "roce".into(),
                LinkLayer::Simulated => format!("sim:{:016x}", p.subnet_prefix()),
            }
        }
        Err(_) => format!("none:{}", std::process::id()),
    }
}

impl Transport for Ibv {
    fn name(&self) -> &'static str {
        "ibv"
    }

    fn priority(&self) -> i32 {
        50
    }

    fn domain(&self) -> String {
        domain_of(self)
    }

    fn viable(&self) -> Result<(), String> {
        self.open().map(|_| ())
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Stream, Error>> {
        Box::pin(async move {
            let stream = tcp::connect(&tcp_url(url)?, timeout, None).await?;
            within(self.setup(stream), url).await
        })
    }

    fn listen<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Box<dyn Acceptor>, Error>> {
        Box::pin(async move {
            self.open().map_err(|e| self.unavailable(e))?;
            let inner = TcpAcceptor::bind(&tcp_url(url)?, None).await?;
            Ok(Box::new(BootstrapAcceptor {
                tcp: inner,
                scheme: "ibv",
                timeout: BOOTSTRAP_TIMEOUT,
                transport: self.clone(),
            }) as Box<dyn Acceptor>)
        })
    }

    fn auto_listen_url(&self) -> Option<String> {
        self.0.auto_listen.clone()
    }
}

async fn within(
    f: impl std::future::Future<Output = Result<Stream, Error>>,
    url: &str,
) -> Result<Stream, Error> {
    tokio::time::timeout(BOOTSTRAP_TIMEOUT, f)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Timeout {
                what: "setting up an ibv queue pair",
                after: BOOTSTRAP_TIMEOUT,
                origin: crate::error::Origin::new(url, "ibv"),
            })
        })
}

impl Bootstrap for Ibv {
    fn set_up(&self, tcp: Stream, _peer: String) -> BoxFuture<'_, Result<Stream, Error>> {
        Box::pin(self.setup(tcp))
    }
}
