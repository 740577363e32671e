//! The shared-memory transport: a byte stream between two processes of one host through two
//! rings in shared memory, one per direction.
//!
//! # How a connection is made
//!
//! The listener binds a Unix stream socket; the connecting side creates two sealed memfds (no
//! name in any filesystem) holding one single-producer single-consumer ring each, plus four
//! eventfds used as doorbells, and passes them all over the socket (`SCM_RIGHTS`);
//! `bootstrap.rs` describes the exchange and `ring.rs` the ring. Bytes then move with one
//! `memcpy` in and one out; a doorbell is only rung when the other side has said it is about to
//! sleep, so a busy stream makes no system calls. Waiting goes through tokio's `AsyncFd` on the
//! doorbells; no thread spins unless [`Shm::with_spin`] asks for it.
//!
//! The socket stays open for the life of the connection and carries nothing more: when it hangs
//! up (the peer closed everything, or died), reads return end of stream once the ring is drained
//! and writes fail with `BrokenPipe`, so the shared loops report the peer as closed. Dropping or
//! shutting down a write half marks its ring closed, which the reader sees as end of stream.
//!
//! # Names and who may connect
//!
//! URLs are `shm://<name>`: the name is 1 to 64 characters from `A-Z a-z 0-9 . _ -` and maps to
//! the socket `@actorpipe-<name>` in the *abstract* namespace. `shm://` or `shm://auto` lets the
//! listener pick a unique name (process id and a counter); [`Acceptor::urls`] reports it.
//!
//! The abstract namespace was chosen over a path under a 0700 directory because it needs no
//! directory to create, check and clean up, leaves no stale socket files behind a crash, and does
//! not depend on `/tmp` or `XDG_RUNTIME_DIR` being the same for both processes. Its catch is that
//! any local user can connect to (or squat) an abstract name, so both sides check the other's uid
//! with `SO_PEERCRED` and refuse a different user with a clear error before any memory or
//! descriptor changes hands. Abstract names are scoped by network namespace, so two processes
//! must share one to meet; the domain string includes it (see [`domain`]).
//!
//! URLs are `shm://<name>` (and `shm://` or `shm://auto` to let a listener pick a name), parsed
//! by [`parse_url`]; any other form is refused as an invalid argument.

#![cfg(target_os = "linux")]

pub(crate) mod bootstrap;
pub(crate) mod fd;
pub(crate) mod halves;
pub mod ring;
#[cfg(test)]
mod tests;

use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

use crate::error::{Error, Origin};
use crate::transport::{Acceptor, BoxFuture, Stream, Transport};

/// How long an accepted connection may take to finish the bootstrap before it is dropped.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest name in a `shm://` URL.
const MAX_NAME: usize = 64;
/// The name that asks the listener to pick one.
const AUTO: &str = "auto";

/// The shared-memory transport, for peers on the same host run by the same user.
#[derive(Debug, Clone)]
pub struct Shm {
    capacity: usize,
    spin: Option<Duration>,
}

impl Default for Shm {
    fn default() -> Self {
        Shm {
            capacity: ring::DEFAULT_CAPACITY,
            spin: None,
        }
    }
}

/// The name in a `shm://<name>` URL: `Ok(None)` for `shm://` and `shm://auto` (the listener
/// picks one), an invalid-argument error for anything that is not a `shm` URL with a valid name.
pub fn parse_url(url: &str) -> Result<Option<String>, Error> {
    let bad = |why: &str| Error::invalid(format!("bad shm URL {url:?}: {why}"));
    let name = url
        .strip_prefix("shm://")
        .ok_or_else(|| bad("expected shm://<name>"))?;
    if name.is_empty() || name == AUTO {
        return Ok(None);
    }
    check_name(name).map_err(|why| bad(&why))?;
    Ok(Some(name.to_string()))
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!("the name must have 1 to {MAX_NAME} characters"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "{c:?} is not allowed in a name (A-Z a-z 0-9 . _ -)"
        ));
    }
    Ok(())
}

fn url_of(name: &str) -> String {
    format!("shm://{name}")
}

fn socket_name(name: &str) -> Vec<u8> {
    format!("actorpipe-{name}").into_bytes()
}

/// The domain descriptor: `<boot id>:<IPC namespace inode>:<network namespace inode>:<uid>`.
/// Two processes with equal strings run on the same boot of the same host, in the same IPC
/// namespace (the memory) and network namespace (the abstract Unix socket that bootstraps a
/// connection), as the same user.
///
/// If any part cannot be read (no `/proc`), the string is unique to this process instead, so that
/// shm is never chosen on a guess.
pub fn domain() -> String {
    static DOMAIN: OnceLock<String> = OnceLock::new();
    DOMAIN
        .get_or_init(|| {
            read_domain().unwrap_or_else(|| {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or_default();
                format!("unknown:{}:{nanos}", std::process::id())
            })
        })
        .clone()
}

fn read_domain() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let boot = boot.trim();
    if boot.is_empty() {
        return None;
    }
    let ipc = std::fs::metadata("/proc/self/ns/ipc").ok()?.ino();
    let net = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
    Some(format!("{boot}:{ipc}:{net}:{}", fd::uid()))
}

impl Shm {
    /// The transport with 2 MiB rings and no spinning.
    pub fn new() -> Shm {
        Shm::default()
    }

    /// Ring size per direction for connections this side creates (the connecting side's setting
    /// wins), rounded up to a power of two between 4 KiB and 1 GiB. A write larger than the ring
    /// simply streams through it.
    pub fn with_capacity(mut self, bytes: usize) -> Shm {
        let bytes = bytes.clamp(ring::MIN_CAPACITY, ring::MAX_CAPACITY);
        self.capacity = bytes.next_power_of_two();
        self
    }

    /// Poll the ring for up to `spin` before sleeping on a doorbell: lower latency for a busy
    /// CPU core. Applies to every connection made or accepted through this value.
    pub fn with_spin(mut self, spin: Duration) -> Shm {
        self.spin = Some(spin);
        self
    }

    /// Ring size per direction.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The spin setting.
    pub fn spin(&self) -> Option<Duration> {
        self.spin
    }

    /// Connects to `shm://<name>`.
    pub async fn connect_url(&self, url: &str, timeout: Duration) -> Result<Stream, Error> {
        match parse_url(url)? {
            Some(name) => self.connect_name(&name, timeout).await,
            None => Err(Error::invalid(format!(
                "cannot connect to {url:?}: name the listener (shm://<name>)"
            ))),
        }
    }

    /// Connects to the listener called `name`.
    pub async fn connect_name(&self, name: &str, timeout: Duration) -> Result<Stream, Error> {
        let (read, write) = self.connect_halves(name, timeout).await?;
        let url = url_of(name);
        Ok(Stream {
            read: Box::new(read),
            write: Box::new(write),
            peer: url.clone(),
            local: url,
        })
    }

    async fn connect_halves(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<(halves::ShmRead, halves::ShmWrite), Error> {
        check_name(name).map_err(|why| Error::invalid(format!("bad shm name {name:?}: {why}")))?;
        let url = url_of(name);
        let attempt = async {
            let sock = loop {
                match fd::connect_abstract(&socket_name(name)) {
                    Ok(fd) => break fd,
                    // The listener's backlog is full: it is alive, just busy.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        tokio::time::sleep(Duration::from_millis(2)).await
                    }
                    Err(e) => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!("no shm listener named {name:?} on this host ({e})"),
                        ))
                    }
                }
            };
            let sock = UnixStream::from_std(std::os::unix::net::UnixStream::from(sock))?;
            bootstrap::connect(sock, self.capacity, self.spin).await
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Err(e)) if e.get_ref().is_some_and(|i| i.is::<bootstrap::Refusal>()) => {
                let reason = e
                    .into_inner()
                    .and_then(|i| i.downcast::<bootstrap::Refusal>().ok())
                    .map(|r| r.0)
                    .unwrap_or_default();
                Err(Error::Refused {
                    reason,
                    origin: Origin::new(url, "shm"),
                })
            }
            Ok(r) => r.map_err(|e| Error::Connect {
                url,
                source: Arc::new(e),
            }),
            Err(_) => Err(Error::Timeout {
                what: "connecting",
                after: timeout,
                origin: Origin::new(url, "shm"),
            }),
        }
    }

    /// Listens at `shm://<name>`, or at a fresh name for `shm://` and `shm://auto`.
    pub async fn listen_url(&self, url: &str) -> Result<ShmAcceptor, Error> {
        self.listen_name(parse_url(url)?.as_deref()).await
    }

    /// Listens at `name`, or at a fresh name (process id and a counter) for `None`.
    pub async fn listen_name(&self, name: Option<&str>) -> Result<ShmAcceptor, Error> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let bind = |name: &str| -> io::Result<UnixListener> {
            let fd = fd::listen_abstract(&socket_name(name))?;
            UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
        };
        let (name, listener) = match name {
            Some(n) => {
                check_name(n)
                    .map_err(|why| Error::invalid(format!("bad shm name {n:?}: {why}")))?;
                let l = bind(n).map_err(|e| listen_error(n, e))?;
                (n.to_string(), l)
            }
            None => {
                let mut tries = 0;
                loop {
                    let n = format!(
                        "{}-{}",
                        std::process::id(),
                        NEXT.fetch_add(1, Ordering::Relaxed)
                    );
                    match bind(&n) {
                        Ok(l) => break (n, l),
                        // Another process with our pid in another pid namespace, say.
                        Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < 100 => tries += 1,
                        Err(e) => return Err(listen_error(&n, e)),
                    }
                }
            }
        };
        Ok(ShmAcceptor {
            listener,
            url: url_of(&name),
            spin: self.spin,
            pending: JoinSet::new(),
        })
    }
}

fn listen_error(name: &str, e: io::Error) -> Error {
    let e = if e.kind() == io::ErrorKind::AddrInUse {
        io::Error::new(
            e.kind(),
            format!("the shm name {name:?} is taken by another listener on this host"),
        )
    } else {
        e
    };
    Error::Listen {
        url: url_of(name),
        source: Arc::new(e),
    }
}

/// A bound shm listener. Connections are set up concurrently, so one slow or broken client does
/// not hold up the others; a failed setup is logged and skipped.
pub struct ShmAcceptor {
    listener: UnixListener,
    url: String,
    spin: Option<Duration>,
    pending: JoinSet<io::Result<(halves::ShmRead, halves::ShmWrite)>>,
}

impl std::fmt::Debug for ShmAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmAcceptor")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl ShmAcceptor {
    /// The next connection, as its two halves.
    async fn next(&mut self) -> io::Result<(halves::ShmRead, halves::ShmWrite)> {
        loop {
            tokio::select! {
                r = self.listener.accept() => {
                    let (sock, _) = r?;
                    self.pending.spawn(bootstrap_within_limit(sock, self.spin));
                }
                Some(done) = self.pending.join_next(), if !self.pending.is_empty() => {
                    let e = match done {
                        Ok(Ok(halves)) => return Ok(halves),
                        Ok(Err(e)) => {
                            if crate::fds::is_exhaustion(&e) {
                                crate::metrics::refused(crate::metrics::Refusal::Descriptors);
                            }
                            e.to_string()
                        }
                        Err(e) => format!("bootstrap task failed: {e}"),
                    };
                    tracing::warn!(url = %self.url, error = %e, "shm connection dropped");
                }
            }
        }
    }
}

async fn bootstrap_within_limit(
    sock: UnixStream,
    spin: Option<Duration>,
) -> io::Result<(halves::ShmRead, halves::ShmWrite)> {
    match tokio::time::timeout(BOOTSTRAP_TIMEOUT, bootstrap::accept(sock, spin)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client did not finish the shm bootstrap within {BOOTSTRAP_TIMEOUT:?}"),
        )),
    }
}

impl Acceptor for ShmAcceptor {
    fn urls(&self) -> Vec<String> {
        vec![self.url.clone()]
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        Box::pin(async move {
            let (read, write) = self.next().await?;
            Ok(Stream {
                read: Box::new(read),
                write: Box::new(write),
                peer: self.url.clone(),
                local: self.url.clone(),
            })
        })
    }
}

impl Transport for Shm {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn priority(&self) -> i32 {
        100
    }

    fn domain(&self) -> String {
        domain()
    }

    fn viable(&self) -> Result<(), String> {
        static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
        PROBE
            .get_or_init(|| {
                if domain().starts_with("unknown") {
                    return Err("cannot read the boot id or IPC namespace from /proc".into());
                }
                let name = c"actorpipe-probe";
                // SAFETY: memfd_create with a NUL-terminated name; the fd is closed right away.
                let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
                if fd < 0 {
                    return Err(format!(
                        "memfd_create failed: {}",
                        io::Error::last_os_error()
                    ));
                }
                // SAFETY: `fd` is ours and open.
                unsafe { libc::close(fd) };
                Ok(())
            })
            .clone()
    }

    fn auto_listen_url(&self) -> Option<String> {
        Some(format!("shm://{AUTO}"))
    }

    fn descriptors(&self) -> usize {
        // The socket and six received descriptors while setting up; then the socket twice
        // (one per half, to watch for hang-up) and four eventfds; the memfds are closed once
        // mapped.
        7
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Stream, Error>> {
        Box::pin(self.connect_url(url, timeout))
    }

    fn listen<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Box<dyn Acceptor>, Error>> {
        Box::pin(async move { Ok(Box::new(self.listen_url(url).await?) as Box<dyn Acceptor>) })
    }
}
