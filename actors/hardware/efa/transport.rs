//! The `efa` transport: a pipe's control stream over a libfabric endpoint (the `efa` provider by
//! default; `tcp;ofi_rxm` or `shm` run the same code, for other fabrics and for tests).
//!
//! **Bootstrap.** A listener binds a TCP socket for its `efa://host:port` URL; that URL is what
//! its brochure lists for `efa`. The connecting side dials it and both sides exchange, over that
//! TCP connection, a small hello: the provider and fabric they use, their endpoint address, and
//! the numbers of their two stream pipes. Each inserts the other's address into its endpoint's
//! address vector (`fi_av_insert`), and from then on every byte goes over the fabric
//! ([`super::stream`]); the TCP connection stays open, idle, to tell when the peer is gone.
//!
//! **Sharing.** One endpoint actor per (transport instance, provider, domain) on each thread:
//! every pipe of a context on one NIC shares it (a context's transports are its own `Arc`s).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use actix::{Addr, WeakAddr};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::stream::{FabricRead, FabricWrite, Shared, Wiring, BOUNCE};
use super::{
    fabric_error, EndpointConfig, FabricAttach, FabricDescribe, FabricDetach, FabricEndpoint,
    FabricShare,
};
use crate::backend::efa::InfoList;
use crate::backend::tcp::{Bootstrap, BootstrapAcceptor, TcpAcceptor};
use crate::error::{Error, Origin};
use crate::transport::{Acceptor, BoxFuture, Stream, Transport, Url};

/// The provider used when none is chosen: AWS's Elastic Fabric Adapter.
pub const DEFAULT_PROVIDER: &str = "efa";

/// How long a stream waits, once the bootstrap connection is gone, before failing: messages
/// already on the fabric (the peer's farewell) are read first.
const GRACE: Duration = Duration::from_millis(200);

/// The byte a side writes on the bootstrap connection when its stream is dropped, before the
/// connection closes: an end without it is a peer that died.
const GOODBYE: u8 = 0x47;

/// How long an accepted bootstrap connection may take to say hello. Hellos are served one at a
/// time (each is two small messages on a TCP connection).
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// What `fi_getinfo` found for one provider: its (fabric, domain) pairs, or why none.
type Probe = Result<Vec<(String, String)>, String>;

/// Which endpoint actor serves a transport: (transport instance, provider, domain).
type EndpointKey = (u64, String, Option<String>);

thread_local! {
    // Each thread's endpoint actors, by transport instance, provider and domain. Weak: an
    // endpoint lives as long as pipes use it (and stops by itself after).
    static ENDPOINTS: RefCell<HashMap<EndpointKey, WeakAddr<FabricEndpoint>>> =
        RefCell::new(HashMap::new());
}

/// The `efa` transport. See the module docs. A clone shares the original's endpoint actors.
#[derive(Clone)]
pub struct Efa {
    provider: String,
    domain: Option<String>,
    config: EndpointConfig,
    id: u64,
    bootstrap_host: Option<std::net::IpAddr>,
}

/// Its settings; the instance number (which endpoint actors it shares) is left out.
impl std::fmt::Debug for Efa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Efa")
            .field("provider", &self.provider)
            .field("domain", &self.domain)
            .field("config", &self.config)
            .field("bootstrap_host", &self.bootstrap_host)
            .finish()
    }
}

impl Efa {
    /// The transport over `provider` (`efa`, `tcp;ofi_rxm`, `shm`), on its first domain.
    pub fn new(provider: &str) -> Efa {
        Efa {
            provider: provider.into(),
            domain: None,
            config: EndpointConfig::default(),
            id: super::next_instance(),
            bootstrap_host: None,
        }
    }

    /// The address a listener binds its bootstrap socket to when it enables `efa` by itself
    /// (a `Listen` that did not name an `efa://` URL). Default: the host's first IPv4 address
    /// that is up and not loopback, else 127.0.0.1
    /// ([`ContextBuilder::efa_bootstrap_host`](crate::ContextBuilder::efa_bootstrap_host) sets
    /// it for the context's own `efa` transport).
    pub fn bootstrap_host(mut self, ip: std::net::IpAddr) -> Efa {
        self.bootstrap_host = Some(ip);
        self
    }

    /// Uses the domain (NIC) named `domain` (`lo`, `rdmap0s6-rdm`) instead of the first.
    pub fn on_domain(mut self, domain: &str) -> Efa {
        self.domain = Some(domain.into());
        self
    }

    /// Progress and fault settings of the endpoint actor.
    pub fn with_config(mut self, config: EndpointConfig) -> Efa {
        self.config = config;
        self
    }

    /// The provider.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Every (fabric, domain) pair `fi_getinfo` lists for the provider, or why none.
    fn probe_all(&self) -> Probe {
        static CACHE: OnceLock<std::sync::Mutex<HashMap<String, Probe>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry(self.provider.clone())
            .or_insert_with(|| match InfoList::get(Some(&self.provider)) {
                Ok(list) => Ok(list
                    .iter()
                    .map(|i| {
                        let a = i.attributes();
                        (a.fabric, a.domain)
                    })
                    .collect()),
                Err(e) => Err(format!(
                    "libfabric offers no {} endpoint here: {e}",
                    self.provider
                )),
            })
            .clone()
    }

    /// The (fabric, domain) this transport would open, or why it cannot.
    fn probe(&self) -> Result<(String, String), String> {
        self.probe_all()?
            .into_iter()
            .find(|(_, d)| self.domain.as_ref().is_none_or(|want| want == d))
            .ok_or_else(|| {
                format!(
                    "provider {} has no domain {:?}",
                    self.provider,
                    self.domain.as_deref().unwrap_or_default()
                )
            })
    }

    /// This thread's endpoint actor for this transport (and its clones: the `efa` channel),
    /// opened on first use.
    pub(crate) fn endpoint(&self) -> Result<Addr<FabricEndpoint>, Error> {
        let key = (self.id, self.provider.clone(), self.domain.clone());
        ENDPOINTS.with(|m| {
            let mut m = m.borrow_mut();
            if let Some(a) = m
                .get(&key)
                .and_then(|a| a.upgrade())
                .filter(|a| a.connected())
            {
                return Ok(a);
            }
            m.retain(|_, a| a.upgrade().is_some());
            let a = FabricEndpoint::open_for(
                self.id,
                &self.provider,
                self.domain.as_deref(),
                self.config,
            )?;
            m.insert(key, a.downgrade());
            Ok(a)
        })
    }

    /// This thread's endpoint actors of this transport (and its clones) that are open now, one
    /// per domain, each with its domain's name: the transport's own domain first, then the
    /// further ones by name. None is opened.
    pub(crate) fn open_endpoints(&self) -> Vec<(String, Addr<FabricEndpoint>)> {
        let own = self.domain_name().ok();
        let mut found: Vec<(bool, String, Addr<FabricEndpoint>)> = ENDPOINTS.with(|m| {
            m.borrow()
                .iter()
                .filter(|((id, provider, _), _)| *id == self.id && *provider == self.provider)
                .filter_map(|((_, _, domain), a)| {
                    let a = a.upgrade().filter(|a| a.connected())?;
                    let name = domain.clone().or_else(|| own.clone()).unwrap_or_default();
                    Some((own.as_ref() != Some(&name), name, a))
                })
                .collect()
        });
        found.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        found.dedup_by(|a, b| a.1 == b.1);
        found.into_iter().map(|(_, d, a)| (d, a)).collect()
    }

    /// The number of this transport instance (shared by its clones): the `endpoint` label of
    /// its endpoints' metrics.
    pub fn instance(&self) -> u64 {
        self.id
    }

    /// This thread's endpoint actor of this transport (opened if it is not yet): for its
    /// counters (`FabricStats`) and description.
    pub fn endpoint_actor(&self) -> Result<Addr<FabricEndpoint>, Error> {
        self.endpoint()
    }

    /// The provider's RDM domains here, each once, in `fi_getinfo`'s order: `(fabric, domain)`
    /// (a domain listed on several fabrics, as `eth0` on IPv4 and IPv6, counts with its first,
    /// the one an endpoint opened by name gets).
    pub fn domains(&self) -> Result<Vec<(String, String)>, String> {
        let mut seen: Vec<(String, String)> = Vec::new();
        for (fabric, domain) in self.probe_all()? {
            if !seen.iter().any(|(_, d)| *d == domain) {
                seen.push((fabric, domain));
            }
        }
        Ok(seen)
    }

    /// The domain this transport's own endpoint is on (the one it names, or the provider's
    /// first).
    pub fn domain_name(&self) -> Result<String, String> {
        self.probe().map(|(_, d)| d)
    }

    /// This thread's endpoint actor of this transport's provider on `domain`, shared like the
    /// transport's own (the same actor when `domain` is the transport's): the `efa` channel's
    /// further domains. Opened on first use.
    pub fn endpoint_on(&self, domain: &str) -> Result<Addr<FabricEndpoint>, Error> {
        if self.domain_name().is_ok_and(|d| d == domain) {
            return self.endpoint();
        }
        let mut other = self.clone();
        other.domain = Some(domain.into());
        other.endpoint()
    }

    /// Runs the hello over the bootstrap connection and wires the two halves.
    async fn bootstrap(&self, tcp: Stream, url: String) -> Result<Stream, Error> {
        let origin = Origin::new(url.clone(), format!("efa[{}]", self.provider));
        let ep = self.endpoint()?;
        let info = ep.send(FabricDescribe).await.map_err(|_| gone(&origin))?;
        let (fabric, _) = self.probe().map_err(|reason| Error::Unavailable {
            backend: "efa".into(),
            reason,
        })?;
        let Stream {
            mut read,
            mut write,
            peer,
            local,
        } = tcp;
        let io = |op: &'static str| {
            let origin = origin.clone();
            move |e| Error::io(op, e, &origin)
        };
        // Hello: provider (as peers compare it: `wire_name`), fabric, endpoint address (each
        // u16 length + bytes).
        let provider = crate::backend::efa::wire_name(&self.provider);
        let mut hello = Vec::new();
        for part in [provider.as_bytes(), fabric.as_bytes(), &info.name] {
            hello.extend_from_slice(&(part.len() as u16).to_le_bytes());
            hello.extend_from_slice(part);
        }
        write
            .write_all(&hello)
            .await
            .map_err(io("sending the efa hello"))?;
        let mut parts = Vec::new();
        for _ in 0..3 {
            let len = read
                .read_u16_le()
                .await
                .map_err(io("reading the efa hello"))?;
            let mut b = vec![0; len as usize];
            read.read_exact(&mut b)
                .await
                .map_err(io("reading the efa hello"))?;
            parts.push(b);
        }
        if parts[0] != provider.as_bytes() || parts[1] != fabric.as_bytes() {
            return Err(Error::Unavailable {
                backend: "efa".into(),
                reason: format!(
                    "the peer's endpoint is on {}/{}, ours on {provider}/{fabric}",
                    String::from_utf8_lossy(&parts[0]),
                    String::from_utf8_lossy(&parts[1]),
                ),
            });
        }
        let peer_name = parts.pop().unwrap_or_default();
        let (rs, mut rd) = tokio::sync::mpsc::unbounded_channel();
        let (ws, mut wd) = tokio::sync::mpsc::unbounded_channel();
        let attach = |sink| FabricAttach {
            peer: peer_name.clone(),
            sink,
        };
        // Kept for the first word's wait, which hands back what came before it.
        let (rs_early, ws_early) = (rs.clone(), ws.clone());
        // An endpoint that serves its most pipes refuses the attach: the peer hears it (pipe
        // numbers `REFUSED`) and both sides fail the connect with `Refused`.
        let r = ep.send(attach(rs)).await.map_err(|_| gone(&origin))?;
        let w = match &r {
            Ok(_) => ep.send(attach(ws)).await.map_err(|_| gone(&origin))?,
            Err(e) => Err(e.clone()),
        };
        let (r, w) = match (r, w) {
            (Ok(r), Ok(w)) => (r, w),
            (r, w) => {
                if let Ok(pipe) = r {
                    ep.do_send(FabricDetach {
                        pipe,
                        reason: "refused".into(),
                    });
                }
                let e = w.err().unwrap_or_else(|| gone(&origin));
                let _ = write.write_all(&REFUSED).await;
                return Err(e);
            }
        };
        // The halves post straight into the endpoint's engine (no mailbox hop per op). Where
        // the endpoint has an inbox, both pipes take their messages from it before the peer
        // learns their numbers: nothing it sends can land there unclaimed.
        let poster = ep.send(FabricShare).await.map_err(|_| gone(&origin))?;
        poster.use_inbox(r);
        poster.use_inbox(w);
        let mut numbers = [0u8; 8];
        numbers[..4].copy_from_slice(&r.to_le_bytes());
        numbers[4..].copy_from_slice(&w.to_le_bytes());
        let exchanged = async {
            write.write_all(&numbers).await?;
            let mut theirs = [0u8; 8];
            read.read_exact(&mut theirs).await?;
            Ok::<_, std::io::Error>(theirs)
        }
        .await;
        let theirs = match exchanged {
            Ok(t) if t == REFUSED => {
                for pipe in [r, w] {
                    ep.do_send(FabricDetach {
                        pipe,
                        reason: "refused by the peer".into(),
                    });
                }
                return Err(Error::Refused {
                    reason: "the peer's efa endpoint serves its most pipes".into(),
                    origin: origin.clone(),
                });
            }
            Ok(t) => t,
            Err(e) => {
                for pipe in [r, w] {
                    ep.do_send(FabricDetach {
                        pipe,
                        reason: "bootstrap failed".into(),
                    });
                }
                return Err(Error::io("exchanging efa pipe numbers", e, &origin));
            }
        };
        let wiring = Wiring {
            read: r,
            write: w,
            peer_read: u32::from_le_bytes(theirs[..4].try_into().unwrap_or_default()),
            peer_write: u32::from_le_bytes(theirs[4..].try_into().unwrap_or_default()),
        };
        if connection_based(&self.provider) {
            let lead = info.name < peer_name;
            // The first word's end comes on the queue of the pipe it was posted for.
            let (queue, again) = if lead {
                (&mut wd, &ws_early)
            } else {
                (&mut rd, &rs_early)
            };
            if let Err(e) = first_word(&poster, wiring, lead, queue, again, &origin).await {
                for pipe in [r, w] {
                    ep.do_send(FabricDetach {
                        pipe,
                        reason: e.to_string(),
                    });
                }
                return Err(e);
            }
        }
        let bounce = BOUNCE.min(info.attributes.max_msg_size.max(1) as usize);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let shared = Shared::new(stop);
        // The watcher: the bootstrap connection ends when the peer closes or dies.
        let watcher_ep = ep.downgrade();
        let watcher_poster = poster.clone();
        actix::spawn(async move {
            let mut byte = [0u8; 1];
            let mut write = write; // kept open until the stream is dropped
            tokio::select! {
                _ = stopped => {
                    // Our stream is dropped: say goodbye before the connection closes, so the
                    // peer can tell this from a death. Nothing else travels on it, so the byte
                    // goes out at once.
                    let bye = write.write_all(&[GOODBYE]);
                    let _ = tokio::time::timeout(GRACE, bye).await;
                }
                r = read.read(&mut byte) => {
                    let goodbye = matches!(r, Ok(1)) && byte[0] == GOODBYE;
                    let why = match r {
                        Ok(_) if goodbye => "the peer closed its endpoint connection".to_string(),
                        Ok(_) => "the peer ended without closing its endpoint connection (its \
                            process died?): sends to it are refused"
                            .to_string(),
                        Err(e) => format!("the peer's endpoint connection failed: {e}"),
                    };
                    // Ended without a goodbye: the peer's process died (or its runtime stopped
                    // under the stream). Nothing sent to it can arrive, and a send into the
                    // `shm` provider's region of a peer killed while it held the region's lock
                    // would hang: its sends end now, its receives read on for the grace
                    // (docs/efa.md, "A peer that ends without a goodbye").
                    if !goodbye {
                        watcher_poster.refuse_sends(&[wiring.read, wiring.write], &why);
                    }
                    tokio::time::sleep(GRACE).await;
                    if let Some(ep) = watcher_ep.upgrade() {
                        for pipe in [wiring.read, wiring.write] {
                            ep.do_send(FabricDetach { pipe, reason: why.clone() });
                        }
                    }
                }
            }
        });
        let read = FabricRead::new(poster.clone(), wiring, rd, bounce, shared.clone());
        let write = FabricWrite::new(poster, wiring, wd, bounce, shared);
        Ok(Stream {
            read: Box::new(read),
            write: Box::new(write),
            peer: peer.replacen("tcp://", "efa://", 1),
            local: local.replacen("tcp://", "efa://", 1),
        })
    }
}

/// The pipe numbers a side sends instead of its own when its endpoint refused the pipes (no
/// pipe number has every bit set: they fit in `tag::PIPE_BITS`).
const REFUSED: [u8; 8] = [0xff; 8];

/// Whether `provider` opens connections under its reliable datagrams (`ofi_rxm` over `tcp` or
/// `verbs`): then the two sides of a pipe must not both send first (see [`first_word`]).
fn connection_based(provider: &str) -> bool {
    provider.contains("ofi_rxm")
}

/// One side speaks first on a new stream, and the other sends nothing on the fabric before it
/// has heard it: the side whose endpoint address sorts first sends an empty message
/// (`FirstWord`) to the peer's read pipe; the other waits (up to [`HELLO_TIMEOUT`]) for it on
/// its own.
///
/// Why: `ofi_rxm` (libfabric 1.17 here) opens a connection to a peer at the first send to it.
/// When both endpoints send first at the same moment, both open one, and its handling of the
/// crossed requests can tear down a connection that the peer has already sent on: those
/// messages are lost, and their sends had completed (libfabric issue 7396 describes the race).
/// Measured here (libfabric's raw calls, three pairs of threads opening fresh endpoints, ten
/// rounds): 15 of 180 round-sides lost a small message when both sides sent at once, none of
/// 540 when one side waited for the other's first message (docs/efa.md, "The efa transport").
/// The order is the same for every pipe between two endpoints, so pipes set up at once in both
/// directions (A dials B while B dials A) agree on it too.
///
/// Where the endpoint has an inbox, the peer's first messages after its first word may be
/// handed out before the first word's own end (they land in the inbox at once, the first word
/// in its receive once that is posted): they go back on the queue (`again`) for the stream's
/// half, which puts them in sequence.
async fn first_word(
    poster: &super::Poster,
    wiring: Wiring,
    lead: bool,
    queue: &mut tokio::sync::mpsc::UnboundedReceiver<crate::backend::efa::engine::Finished>,
    again: &tokio::sync::mpsc::UnboundedSender<crate::backend::efa::engine::Finished>,
    origin: &Origin,
) -> Result<(), Error> {
    use crate::backend::efa::engine::{Kind, Op};
    use crate::backend::efa::tag::{self, Stream as TagStream};
    const ID: u64 = u64::MAX;
    let (pipe, op) = match lead {
        true => (
            wiring.write,
            Op {
                kind: Kind::Send,
                tag: tag::make(TagStream::FirstWord, wiring.peer_read, 0),
                // Empty: a send with a context, never an inject (the engine injects 1 byte and
                // up). rxm 1.17 crashes at `fi_close` on a canceled send without a context
                // (docs/efa.md, "A crash at close in `ofi_rxm`"), and an inject queued behind a
                // connection not yet open is one.
                mem: Vec::new(),
                id: ID,
            },
        ),
        false => (
            wiring.read,
            Op {
                kind: Kind::Recv,
                tag: tag::make(TagStream::FirstWord, wiring.read, 0),
                mem: vec![0],
                id: ID,
            },
        ),
    };
    poster.post(pipe, std::iter::once(op));
    let what = match lead {
        true => "sending the first word on the fabric",
        false => "waiting for the peer's first word on the fabric",
    };
    let deadline = tokio::time::Instant::now() + HELLO_TIMEOUT;
    let mut early = Vec::new();
    let result = loop {
        let end = tokio::time::timeout_at(deadline, queue.recv()).await;
        match end {
            Ok(Some(f)) if f.id == ID => {
                break f.result.map(drop).map_err(|e| fabric_error(e, origin))
            }
            Ok(Some(f)) if f.kind == Kind::Recv && f.result.is_ok() && poster.has_inbox() => {
                early.push(f)
            }
            Ok(Some(f)) => {
                break Err(Error::protocol(
                    format!("{what}: an unexpected end (op {}) came first", f.id),
                    origin,
                ))
            }
            Ok(None) => break Err(gone(origin)),
            Err(_) => {
                break Err(Error::io(
                    what,
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("nothing within {} s", HELLO_TIMEOUT.as_secs()),
                    ),
                    origin,
                ))
            }
        }
    };
    for f in early {
        let _ = again.send(f);
    }
    result
}

/// The host's first IPv4 address that is up and not loopback; 127.0.0.1 if none.
fn first_ipv4() -> std::net::IpAddr {
    let mut found = std::net::IpAddr::from([127, 0, 0, 1]);
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return found;
    }
    let mut p = list;
    while !p.is_null() {
        // SAFETY: p is an entry of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        if ifa.ifa_addr.is_null() || !up || lo {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points to a sockaddr of the family it names.
        if unsafe { (*ifa.ifa_addr).sa_family } as i32 == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = std::net::IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes());
            break;
        }
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

fn gone(origin: &Origin) -> Error {
    Error::Closed {
        reason: "the fabric endpoint actor stopped".into(),
        origin: origin.clone(),
    }
}

/// `efa://h:p` as the `tcp://h:p` of its bootstrap socket.
fn bootstrap_url(url: &str) -> Result<Url, Error> {
    let mut u = Url::parse(url)?;
    if u.scheme != "efa" {
        return Err(Error::invalid(format!(
            "bad URL {url:?}: expected efa://host:port"
        )));
    }
    u.scheme = "tcp".into();
    Ok(u)
}

impl Bootstrap for Efa {
    fn set_up(&self, tcp: Stream, peer: String) -> BoxFuture<'_, Result<Stream, Error>> {
        Box::pin(self.bootstrap(tcp, peer))
    }
}

impl Transport for Efa {
    fn name(&self) -> &'static str {
        "efa"
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn priority(&self) -> i32 {
        50
    }

    fn domain(&self) -> String {
        match self.probe() {
            // The shm provider reaches only this host (and this IPC namespace, this user).
            Ok((fabric, _)) if self.provider == "shm" => {
                format!("shm/{fabric}/{}", crate::backend::shm::domain())
            }
            // rxm with and without its passthru do not talk: the name says which.
            Ok((fabric, _)) => format!(
                "{}/{fabric}",
                crate::backend::efa::wire_name(&self.provider)
            ),
            Err(_) => format!("{}/unavailable", self.provider),
        }
    }

    fn viable(&self) -> Result<(), String> {
        self.probe().map(|_| ())
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Stream, Error>> {
        Box::pin(async move {
            let tcp = crate::backend::tcp::connect(&bootstrap_url(url)?, timeout, None).await?;
            match tokio::time::timeout(timeout, self.bootstrap(tcp, url.to_string())).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    what: "bootstrapping the efa endpoint",
                    after: timeout,
                    origin: Origin::new(url, "efa"),
                }),
            }
        })
    }

    fn auto_listen_url(&self) -> Option<String> {
        let ip = self.bootstrap_host.unwrap_or_else(first_ipv4);
        Some(Url::from_socket("efa", std::net::SocketAddr::new(ip, 0)).to_string())
    }

    fn listen<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Box<dyn Acceptor>, Error>> {
        Box::pin(async move {
            self.viable().map_err(|reason| Error::Unavailable {
                backend: "efa".into(),
                reason,
            })?;
            let tcp = TcpAcceptor::bind(&bootstrap_url(url)?, None).await?;
            let transport = Efa {
                provider: self.provider.clone(),
                domain: self.domain.clone(),
                config: self.config,
                id: self.id,
                bootstrap_host: self.bootstrap_host,
            };
            Ok(Box::new(BootstrapAcceptor {
                tcp,
                scheme: "efa",
                timeout: HELLO_TIMEOUT,
                transport,
            }) as Box<dyn Acceptor>)
        })
    }
}
