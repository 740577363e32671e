//! Metric names, the per-pipe handles, and the Prometheus exporter.
//!
//! Metrics go through the `metrics` facade. [`serve`] installs a Prometheus recorder for the
//! process and serves it over HTTP from a thread of its own (with its own single-threaded
//! runtime), so a busy pipe cannot stall a scrape. Without a recorder every metric is a no-op.
//!
//! Labels stay bounded: backend names (a handful), error classes (a dozen), operation kinds. No
//! label ever carries a peer address, a pipe id or a message number. docs/operations.md lists
//! every metric.

use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::Error;

/// Pipes currently open in this process (gauge).
pub const PIPES_OPEN: &str = "actorpipe_pipes_open";
/// Pipes opened, by negotiated transport and channel (counter).
pub const PIPES_OPENED: &str = "actorpipe_pipes_opened_total";
/// Pipes closed, by reason (the error class that closed them) (counter).
pub const PIPES_CLOSED: &str = "actorpipe_pipes_closed_total";
/// Messages written successfully, by transport and channel (counter).
pub const MESSAGES_WRITTEN: &str = "actorpipe_messages_written_total";
/// Payload and tensor bytes of those messages (counter).
pub const BYTES_WRITTEN: &str = "actorpipe_bytes_written_total";
/// Messages read successfully, by transport and channel (counter).
pub const MESSAGES_READ: &str = "actorpipe_messages_read_total";
/// Payload and tensor bytes of those messages (counter).
pub const BYTES_READ: &str = "actorpipe_bytes_read_total";
/// Time from issuing an operation to its completion, by operation, transport and channel
/// (histogram, seconds).
pub const OPERATION_SECONDS: &str = "actorpipe_operation_seconds";
/// Operations that completed with an error, by operation and error class (counter).
pub const OPERATION_ERRORS: &str = "actorpipe_operation_errors_total";
/// Handshakes, by outcome: the chosen transport and channel, or the error class (counter).
pub const NEGOTIATIONS: &str = "actorpipe_negotiations_total";
/// Operations issued and not yet completed, by operation (gauge).
pub const BACKLOG: &str = "actorpipe_backlog_operations";
/// Tensors that fell back from their channel's fast path, by channel (counter).
pub const FALLBACKS: &str = "actorpipe_fallbacks_total";
/// Pipes a listener turned away, by reason (counter; `reason` is `pending_handshakes`,
/// `descriptors` or `join_timeout`).
pub const REFUSALS: &str = "actorpipe_listener_refusals_total";

/// Remote-memory operations completed, by operation (`remote_read`, `remote_write`), path
/// and outcome (`ok` or the error class) (counter).
pub const REMOTE_OPERATIONS: &str = "actorpipe_remote_operations_total";
/// Bytes moved by successful remote operations, by operation and path (counter).
pub const REMOTE_BYTES: &str = "actorpipe_remote_bytes_total";
/// Time a remote operation took, issue to completion, by operation and path (histogram,
/// seconds).
pub const REMOTE_SECONDS: &str = "actorpipe_remote_operation_seconds";
/// Regions registered in this process now (gauge).
pub const REMOTE_REGIONS: &str = "actorpipe_remote_regions";
/// Notifications delivered to regions' owners (counter).
pub const REMOTE_NOTIFICATIONS: &str = "actorpipe_remote_notifications_total";

/// CUDA events, streams and pinned buffers created (not taken from a pool), by kind (counter).
/// Flat in steady state.
pub const CUDA_CREATED: &str = "actorpipe_cuda_created_total";
/// CUDA IPC handle cache lookups, by side (`export`, `open`) and outcome (`hit`, `miss`)
/// (counter).
pub const CUDA_IPC_LOOKUPS: &str = "actorpipe_cuda_ipc_lookups_total";
/// CUDA IPC memory handles currently opened from peers (gauge).
pub const CUDA_IPC_OPEN: &str = "actorpipe_cuda_ipc_open_handles";

/// libfabric posts the provider accepted, by provider (counter; feature `efa`).
pub const EFA_POSTS: &str = "actorpipe_efa_posts_total";
/// libfabric posts refused with `-FI_EAGAIN` (and retried from the backlog), by provider
/// (counter; feature `efa`).
pub const EFA_EAGAIN: &str = "actorpipe_efa_eagain_total";
/// libfabric sends that went out as injects (`fi_tinject`: no completion), by provider; also
/// counted in [`EFA_POSTS`] (counter; feature `efa`).
pub const EFA_INJECTS: &str = "actorpipe_efa_injects_total";
/// Completions read from libfabric completion queues, by provider (counter; feature `efa`).
pub const EFA_COMPLETIONS: &str = "actorpipe_efa_completions_total";
/// Failed libfabric posts and error completions, by provider (counter; feature `efa`).
pub const EFA_ERRORS: &str = "actorpipe_efa_errors_total";
/// Operations waiting in an endpoint's `-FI_EAGAIN` backlog, by provider, domain and endpoint
/// (the `efa` transport instance it serves) (gauge; feature `efa`).
pub const EFA_BACKLOG: &str = "actorpipe_efa_backlog_operations";
/// Bytes moved by successful libfabric operations (sends and receives), by provider and domain
/// (counter; feature `efa`): a channel striped over domains shows on each.
pub const EFA_BYTES: &str = "actorpipe_efa_bytes_total";

/// Histogram buckets for operation latencies: 1 µs to 10 s.
pub const LATENCY_BUCKETS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

fn describe() {
    describe_gauge!(PIPES_OPEN, "Pipes currently open in this process.");
    describe_counter!(
        PIPES_OPENED,
        "Pipes opened, by negotiated transport and channel."
    );
    describe_counter!(PIPES_CLOSED, "Pipes closed, by reason (error class).");
    describe_counter!(MESSAGES_WRITTEN, "Messages written successfully.");
    describe_counter!(
        BYTES_WRITTEN,
        Unit::Bytes,
        "Payload and tensor bytes written."
    );
    describe_counter!(MESSAGES_READ, "Messages read successfully.");
    describe_counter!(BYTES_READ, Unit::Bytes, "Payload and tensor bytes read.");
    describe_histogram!(
        OPERATION_SECONDS,
        Unit::Seconds,
        "Time from issuing an operation to its completion."
    );
    describe_counter!(
        OPERATION_ERRORS,
        "Operations completed with an error, by class."
    );
    describe_counter!(NEGOTIATIONS, "Handshakes, by outcome.");
    describe_gauge!(BACKLOG, "Operations issued and not yet completed.");
    describe_counter!(
        FALLBACKS,
        "Tensors that fell back from their channel's fast path."
    );
    describe_counter!(REFUSALS, "Pipes a listener turned away, by reason.");
    describe_counter!(REMOTE_OPERATIONS, "Remote-memory operations completed.");
    describe_counter!(
        REMOTE_BYTES,
        Unit::Bytes,
        "Bytes moved by remote-memory operations."
    );
    describe_histogram!(
        REMOTE_SECONDS,
        Unit::Seconds,
        "Time from issuing a remote-memory operation to its completion."
    );
    describe_gauge!(REMOTE_REGIONS, "Regions registered in this process.");
    describe_counter!(REMOTE_NOTIFICATIONS, "Notifications delivered to owners.");
    describe_counter!(
        CUDA_CREATED,
        "CUDA events, streams and pinned buffers created rather than reused."
    );
    describe_counter!(CUDA_IPC_LOOKUPS, "CUDA IPC handle cache lookups.");
    describe_gauge!(CUDA_IPC_OPEN, "CUDA IPC memory handles opened from peers.");
    describe_counter!(EFA_POSTS, "libfabric posts accepted, by provider.");
    describe_counter!(EFA_EAGAIN, "libfabric posts refused with -FI_EAGAIN.");
    describe_counter!(EFA_INJECTS, "libfabric sends injected (no completion).");
    describe_counter!(EFA_COMPLETIONS, "libfabric completions read.");
    describe_counter!(EFA_ERRORS, "libfabric failed posts and error completions.");
    describe_gauge!(EFA_BACKLOG, "Operations in libfabric -FI_EAGAIN backlogs.");
    describe_counter!(
        EFA_BYTES,
        "Bytes moved by libfabric operations, by provider and domain."
    );
}

struct Exporter {
    addr: SocketAddr,
    handle: PrometheusHandle,
}

static EXPORTER: OnceLock<Mutex<Option<Exporter>>> = OnceLock::new();

/// Parses `host:port` or a bare port (loopback): what `ACTORPIPE_METRICS_ADDR` holds
/// ([`ContextBuilder::from_env`](crate::ContextBuilder::from_env)).
pub fn parse_addr(v: &str) -> Result<SocketAddr, Error> {
    if let Ok(port) = v.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    v.parse().map_err(|_| {
        Error::invalid(format!(
            "bad metrics address {v:?}: expected host:port or a port"
        ))
    })
}

/// Serves this process's metrics at `http://addr/metrics` (any path answers), from a thread of
/// its own. Port 0 picks a free port. Returns the address served.
///
/// One exporter per process: asking again for the same address (or port 0) returns the
/// running one; asking for another address is an error.
pub fn serve(addr: SocketAddr) -> Result<SocketAddr, Error> {
    let mut slot = EXPORTER
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(e) = slot.as_ref() {
        if addr.port() == 0 || addr == e.addr {
            return Ok(e.addr);
        }
        return Err(Error::invalid(format!(
            "metrics are already served at {}; one exporter per process",
            e.addr
        )));
    }
    let addr = if addr.port() == 0 {
        // The exporter does not report the port it bound; pick a free one first.
        let l = std::net::TcpListener::bind(addr).map_err(|e| listen_error(addr, e))?;
        l.local_addr().map_err(|e| listen_error(addr, e))?
    } else {
        addr
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("actorpipe-metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(listen_error(addr, e)));
                    return;
                }
            };
            rt.block_on(async move {
                let built = PrometheusBuilder::new()
                    .with_http_listener(addr)
                    .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
                    .and_then(|b| b.build());
                let (recorder, exporter) = match built {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = tx.send(Err(listen_error(addr, std::io::Error::other(e))));
                        return;
                    }
                };
                let handle = recorder.handle();
                if metrics::set_global_recorder(recorder).is_err() {
                    let _ = tx.send(Err(Error::invalid(
                        "another metrics recorder is already installed in this process",
                    )));
                    return;
                }
                describe();
                let _ = tx.send(Ok(handle));
                if let Err(e) = exporter.await {
                    tracing::warn!(error = ?e, "metrics exporter stopped");
                }
            });
        })
        .map_err(|e| listen_error(addr, e))?;
    let handle = rx
        .recv()
        .map_err(|_| Error::invalid("the metrics thread died while starting"))??;
    *slot = Some(Exporter { addr, handle });
    tracing::info!(%addr, "serving metrics");
    Ok(addr)
}

fn listen_error(addr: SocketAddr, e: std::io::Error) -> Error {
    Error::Listen {
        url: format!("http://{addr}/metrics"),
        source: std::sync::Arc::new(e),
    }
}

/// The current scrape text, if [`serve`] is running (what an HTTP scrape would return).
pub fn render() -> Option<String> {
    let slot = EXPORTER.get()?.lock().unwrap_or_else(|p| p.into_inner());
    slot.as_ref().map(|e| e.handle.render())
}

/// Which operation a measurement belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    /// `Write`.
    Write,
    /// `ReadDescriptor`.
    ReadDescriptor,
    /// `Read`.
    Read,
}

impl OpKind {
    fn label(self) -> &'static str {
        match self {
            OpKind::Write => "write",
            OpKind::ReadDescriptor => "read_descriptor",
            OpKind::Read => "read",
        }
    }
}

/// One pipe's metric handles, resolved once so that recording costs atomic adds.
pub(crate) struct PipeMetrics {
    messages_written: Counter,
    bytes_written: Counter,
    messages_read: Counter,
    bytes_read: Counter,
    latency: [Histogram; 3],
    backlog: [Gauge; 3],
    open: Gauge,
    /// A recorder was in place when the handles were made: operations are timed. Without one
    /// the histograms are no-ops, and a precise clock read per operation start and completion
    /// (about 1.4 k instructions per 64 B round trip) would be spent for nothing.
    timed: bool,
}

impl std::fmt::Debug for PipeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipeMetrics").finish_non_exhaustive()
    }
}

const KINDS: [OpKind; 3] = [OpKind::Write, OpKind::ReadDescriptor, OpKind::Read];

impl PipeMetrics {
    /// Handles for a pipe on `transport` with `channel`; counts the pipe as opened.
    pub fn open(transport: &str, channel: &str) -> Self {
        let (t, c) = (transport.to_string(), channel.to_string());
        counter!(NEGOTIATIONS, "outcome" => "ok", "transport" => t.clone(), "channel" => c.clone())
            .increment(1);
        counter!(PIPES_OPENED, "transport" => t.clone(), "channel" => c.clone()).increment(1);
        let open = gauge!(PIPES_OPEN);
        open.increment(1.0);
        let labels = [("transport", t.clone()), ("channel", c.clone())];
        PipeMetrics {
            timed: recording(),
            messages_written: counter!(MESSAGES_WRITTEN, &labels),
            bytes_written: counter!(BYTES_WRITTEN, &labels),
            messages_read: counter!(MESSAGES_READ, &labels),
            bytes_read: counter!(BYTES_READ, &labels),
            latency: KINDS.map(|k| {
                histogram!(OPERATION_SECONDS, "op" => k.label(), "transport" => t.clone(), "channel" => c.clone())
            }),
            backlog: KINDS.map(|k| gauge!(BACKLOG, "op" => k.label())),
            open,
        }
    }

    /// An operation was issued.
    pub fn issued(&self, k: OpKind) {
        self.backlog[k as usize].increment(1.0);
    }

    /// When an operation issued now started, for [`PipeMetrics::finished`]: `None` when
    /// latencies are not recorded (no recorder was in place when the pipe opened).
    pub fn start(&self) -> Option<Instant> {
        self.timed.then(Instant::now)
    }

    /// An operation that started at `since` (from [`PipeMetrics::start`]) completed; `bytes`
    /// counts for successful writes and reads.
    pub fn finished(&self, k: OpKind, since: Option<Instant>, result: Result<u64, &Error>) {
        self.backlog[k as usize].decrement(1.0);
        if let Some(since) = since {
            self.latency[k as usize].record(since.elapsed().as_secs_f64());
        }
        match (k, result) {
            (OpKind::Write, Ok(b)) => {
                self.messages_written.increment(1);
                self.bytes_written.increment(b);
            }
            (OpKind::Read, Ok(b)) => {
                self.messages_read.increment(1);
                self.bytes_read.increment(b);
            }
            (_, Ok(_)) => {}
            (k, Err(e)) => {
                counter!(OPERATION_ERRORS, "op" => k.label(), "class" => e.class()).increment(1)
            }
        }
    }

    /// A message a standing receive's read loop delivered itself: counted as read, never
    /// pending (no backlog) and not timed (it had no start).
    pub fn read_whole(&self, bytes: u64) {
        self.messages_read.increment(1);
        self.bytes_read.increment(bytes);
    }

    /// The pipe closed because of `e`.
    pub fn closed(&self, e: &Error) {
        self.open.decrement(1.0);
        counter!(PIPES_CLOSED, "reason" => e.class()).increment(1);
    }
}

/// Whether a metrics recorder (global, or local to this thread) is in place.
///
/// The `metrics` facade falls back on its no-op recorder, a zero-sized type, when none is
/// installed; every recorder that keeps metrics has state. A zero-sized recorder of your own
/// is therefore taken for the no-op one: it gets every metric but the latency histograms.
fn recording() -> bool {
    metrics::with_recorder(|r| std::mem::size_of_val(r) != 0)
}

/// A handshake failed (either side), with this error.
pub(crate) fn negotiation_failed(e: &Error) {
    counter!(NEGOTIATIONS, "outcome" => e.class()).increment(1);
}

/// Why a listener turned a pipe away (the `reason` label of [`REFUSALS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Refusal {
    /// As many pipes as `ContextBuilder::max_pending_pipes` are being set up already.
    PendingHandshakes,
    /// The listener's process lacks the file descriptors the pipe's connections need.
    Descriptors,
    /// The pipe's extra connections did not all join within the handshake timeout.
    JoinTimeout,
}

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::PendingHandshakes => "pending_handshakes",
            Refusal::Descriptors => "descriptors",
            Refusal::JoinTimeout => "join_timeout",
        }
    }

    /// What the connecting side is told.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::PendingHandshakes => "too many pending handshakes",
            Refusal::Descriptors => "listener out of file descriptors",
            Refusal::JoinTimeout => "the pipe's connections did not all join in time",
        }
    }
}

/// A listener turned a pipe away.
pub(crate) fn refused(why: Refusal) {
    counter!(REFUSALS, "reason" => why.label()).increment(1);
}

/// A remote operation `op` on `path` (empty: it found none) took `elapsed`; `bytes` on success.
pub(crate) fn remote_finished(
    op: &'static str,
    path: &'static str,
    peer: &'static str,
    elapsed: std::time::Duration,
    result: Result<u64, &Error>,
) {
    let path = if path.is_empty() { "none" } else { path };
    let outcome = match result {
        Ok(bytes) => {
            counter!(REMOTE_BYTES, "op" => op, "path" => path, "peer" => peer).increment(bytes);
            "ok"
        }
        Err(e) => e.class(),
    };
    counter!(REMOTE_OPERATIONS, "op" => op, "path" => path, "peer" => peer, "outcome" => outcome)
        .increment(1);
    histogram!(REMOTE_SECONDS, "op" => op, "path" => path, "peer" => peer)
        .record(elapsed.as_secs_f64());
}

/// Distinct `peer` label values a process gives out; later peers share `other`.
pub const PEER_LABELS: usize = 64;

/// The `peer` label of a pipe's remote operations: the peer's address without its port
/// (`tcp://10.0.0.7`; a connection's own port would make a series per connection), at most
/// [`PEER_LABELS`] distinct values per process, then `other`, so that the label stays bounded.
pub(crate) fn peer_label(peer: &str) -> &'static str {
    static SEEN: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let host = match peer.rsplit_once(':') {
        // `scheme://host:port`, `scheme://[v6]:port`: drop a numeric port.
        Some((head, port))
            if head.contains("://")
                && !head.ends_with('/')
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            head
        }
        _ => peer,
    };
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = seen.iter().find(|l| **l == host) {
        return l;
    }
    if seen.len() >= PEER_LABELS {
        return "other";
    }
    // Bounded: at most PEER_LABELS strings are kept for the life of the process.
    let l: &'static str = Box::leak(host.to_string().into_boxed_str());
    seen.push(l);
    l
}

/// Regions registered (`delta` 1) or deregistered (-1).
pub(crate) fn remote_regions(delta: f64) {
    gauge!(REMOTE_REGIONS).increment(delta);
}

/// A notification was delivered.
pub(crate) fn remote_notification() {
    counter!(REMOTE_NOTIFICATIONS).increment(1);
}

/// A tensor fell back from `channel`'s fast path.
pub(crate) fn fallback(channel: &'static str) {
    counter!(FALLBACKS, "channel" => channel).increment(1);
}

/// A CUDA resource of `kind` (`event`, `stream`, `pinned`) was created rather than reused.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_created(kind: &'static str) {
    counter!(CUDA_CREATED, "kind" => kind).increment(1);
}

/// A CUDA IPC handle cache lookup on `side` (`export`, `open`): a hit or a miss.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_ipc_lookup(side: &'static str, hit: bool) {
    let outcome = if hit { "hit" } else { "miss" };
    counter!(CUDA_IPC_LOOKUPS, "side" => side, "outcome" => outcome).increment(1);
}

/// The number of CUDA IPC memory handles this process holds open changed by `delta`.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_ipc_open(delta: f64) {
    gauge!(CUDA_IPC_OPEN).increment(delta);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_labels_drop_ports_and_stay_bounded() {
        assert_eq!(peer_label("tcp://10.9.8.7:41234"), "tcp://10.9.8.7");
        assert_eq!(peer_label("tcp://10.9.8.7:5000"), "tcp://10.9.8.7");
        assert_eq!(
            peer_label("tcp://[fe80::1%eth0]:99"),
            "tcp://[fe80::1%eth0]"
        );
        assert_eq!(peer_label("shm://actorpipe-1234"), "shm://actorpipe-1234");
        // Past the bound, every new peer is `other`; the ones seen keep their label.
        for i in 0..PEER_LABELS {
            peer_label(&format!("tcp://10.1.{}.{}:1", i / 256, i % 256));
        }
        assert_eq!(peer_label("tcp://192.0.2.1:7"), "other");
        assert_eq!(peer_label("tcp://10.9.8.7:1"), "tcp://10.9.8.7");
    }

    #[test]
    fn addresses_default_to_loopback() {
        assert_eq!(
            parse_addr("9100").unwrap(),
            "127.0.0.1:9100".parse().unwrap()
        );
        assert_eq!(
            parse_addr("0.0.0.0:1").unwrap(),
            "0.0.0.0:1".parse().unwrap()
        );
        assert!(parse_addr("nope").is_err());
    }

    #[test]
    fn recording_without_a_recorder_is_harmless() {
        let m = PipeMetrics::open("tcp", "basic");
        m.issued(OpKind::Write);
        m.finished(OpKind::Write, Some(Instant::now()), Ok(10));
        m.finished(
            OpKind::Read,
            Some(Instant::now()),
            Err(&Error::invalid("x")),
        );
        m.closed(&Error::invalid("x"));
    }

    #[test]
    fn operations_are_timed_only_with_a_recorder() {
        assert!(PipeMetrics::open("tcp", "basic").start().is_none());
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        metrics::with_local_recorder(&recorder, || {
            let m = PipeMetrics::open("tcp", "basic");
            let since = m.start();
            assert!(since.is_some());
            m.finished(OpKind::Write, since, Ok(1));
        });
        let text = recorder.handle().render();
        assert!(text.contains(OPERATION_SECONDS), "{text}");
    }
}
