//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use actix::Addr;
use actorpipe::*;

/// Deterministic bytes for a seed: xorshift64 words.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for b in chunks.into_remainder() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    v
}

/// A 64-bit checksum (FNV-1a over 8-byte words, then the tail and the length).
pub fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        h ^= u64::from_le_bytes(c.try_into().unwrap());
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ data.len() as u64
}

/// Bounds a test step so a bug shows up as a failure, never as a hung suite.
pub async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {secs} s"),
    }
}

/// A context restricted to TCP and the basic channel: for tests of the pipe's own logic that
/// assert what happens on a byte stream (other backends have their conformance suites).
pub fn tcp_basic() -> ContextBuilder {
    Context::builder().without("shm").only_channels(&["basic"])
}

/// The default context with its shm transport in spin mode (20 µs): the read loop of a
/// spinning connection gives its thread a turn after each message it hands over.
pub fn shm_spin() -> ContextBuilder {
    Context::builder().transport(std::sync::Arc::new(
        actorpipe::transport::Shm::new().with_spin(Duration::from_micros(20)),
    ))
}

/// [`READ_CONFIGS`] and the default context in spin mode.
pub const READ_CONFIGS_SPIN: [Setup; 4] = [
    READ_CONFIGS[0],
    READ_CONFIGS[1],
    READ_CONFIGS[2],
    ("shm spin", shm_spin),
];

/// A context restricted to TCP and the mpt channel, with 64 KiB chunks.
pub fn tcp_mpt() -> ContextBuilder {
    Context::builder()
        .without("shm")
        .only_channels(&["mpt"])
        .chunk_size(64 << 10)
}

/// The default pipe (shm and, in one process, xth), tcp + basic and tcp + mpt (64 KiB chunks):
/// the read paths a test of reads runs over.
pub const READ_CONFIGS: [Setup; 3] = [
    ("default", Context::builder),
    ("tcp+basic", tcp_basic),
    ("tcp+mpt", tcp_mpt),
];

/// Asserts that an operation was refused with `InvalidArgument` saying `what`.
pub fn assert_invalid(result: &Result<()>, what: &str) {
    match result {
        Err(Error::InvalidArgument { detail }) => assert!(detail.contains(what), "{detail}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// A named way to build a context, for tests that run over several configurations.
pub type Setup = (&'static str, fn() -> ContextBuilder);

/// A listening context: its address, its URL, and the queue of accepted pipes.
pub struct Server {
    pub ctx: Addr<Context>,
    pub url: String,
    pub listener: Addr<Listener>,
    pub accepted: tokio::sync::mpsc::UnboundedReceiver<Accepted>,
    /// The transports this listener could not listen on, and why.
    pub not_listening: Vec<NotListening>,
}

impl Server {
    pub async fn start(builder: ContextBuilder, url: &str) -> Server {
        let ctx = builder.start();
        let (r, accepted) = inbox::<Accepted>();
        let l = ctx
            .send(Listen::new([url], r))
            .await
            .unwrap()
            .expect("listen");
        Server {
            ctx,
            url: l.urls[0].clone(),
            listener: l.listener,
            accepted,
            not_listening: l.not_listening,
        }
    }

    /// `client` dials this server: both ends of the new pipe, the dialer's first.
    pub async fn dial(&mut self, client: &Addr<Context>) -> (Addr<Pipe>, Addr<Pipe>) {
        let tx = client
            .send(Connect::new(&self.url))
            .await
            .unwrap()
            .expect("connect");
        (tx, self.next().await)
    }

    pub async fn next(&mut self) -> Addr<Pipe> {
        within(10, "accepting a pipe", self.accepted.recv())
            .await
            .expect("listener alive")
            .pipe
    }
}

/// A connected pair of pipes over loopback TCP: (client side, server side).
pub async fn pair(
    client: ContextBuilder,
    server: ContextBuilder,
) -> (Addr<Pipe>, Addr<Pipe>, Server) {
    let mut s = Server::start(server, "tcp://127.0.0.1:0").await;
    let (tx, rx) = s.dial(&client.start()).await;
    (tx, rx, s)
}

/// The channels that move CUDA tensors. With feature `cuda` on a GPU host a default context
/// offers them, and a pipe between two such contexts lists them next to its host channels.
pub const CUDA_CHANNELS: [&str; 4] = ["cuda_xth", "cuda_ipc", "cuda_basic", "cuda_gdr"];

/// `b` without any channel that moves CUDA tensors: what a host without a GPU offers, on any
/// host (a test of host paths must not depend on how many GPUs the machine has).
pub fn host_only(b: ContextBuilder) -> ContextBuilder {
    CUDA_CHANNELS.iter().fold(b, |b, c| b.without(c))
}

/// Reads one whole message: descriptor, allocation, read.
pub async fn read_one(pipe: &Addr<Pipe>) -> Result<Message> {
    let d = pipe.send(ReadDescriptor).await.unwrap().descriptor?;
    let alloc = Allocation::for_descriptor(&d)?;
    let done = pipe.send(Read::new(alloc)).await.unwrap();
    done.result.map(|_| done.message)
}

/// A message whose metadata records the checksums of its contents.
pub fn checked_message(index: u64, payload_sizes: &[usize], tensor_sizes: &[usize]) -> Message {
    let mut m = Message::new();
    let mut sums = Vec::new();
    for (j, &n) in payload_sizes.iter().enumerate() {
        let data = pattern(index * 1000 + j as u64, n);
        sums.push(checksum(&data).to_string());
        m.payloads.push(Payload {
            data,
            metadata: format!("p{j}").into_bytes(),
        });
    }
    sums.push("|".into());
    for (j, &n) in tensor_sizes.iter().enumerate() {
        let data = pattern(index * 1000 + 500 + j as u64, n);
        sums.push(checksum(&data).to_string());
        let mut t = Tensor::cpu(data);
        t.metadata = format!("t{j}").into_bytes();
        m.tensors.push(t);
    }
    m.metadata = format!("{index};{}", sums.join(",")).into_bytes();
    m
}

/// Checks a received message against the checksums in its metadata; returns its index.
pub fn verify(m: &Message) -> u64 {
    let meta = String::from_utf8(m.metadata.clone()).expect("utf8 metadata");
    let (index, sums) = meta.split_once(';').expect("index;sums");
    let sums: Vec<&str> = sums.split(',').collect();
    let split = sums.iter().position(|s| *s == "|").expect("separator");
    assert_eq!(split, m.payloads.len(), "payload count of message {index}");
    assert_eq!(
        sums.len() - split - 1,
        m.tensors.len(),
        "tensor count of message {index}"
    );
    for (j, p) in m.payloads.iter().enumerate() {
        assert_eq!(p.metadata, format!("p{j}").into_bytes());
        assert_eq!(
            checksum(&p.data).to_string(),
            sums[j],
            "payload {j} of message {index}"
        );
    }
    for (j, t) in m.tensors.iter().enumerate() {
        assert_eq!(t.metadata, format!("t{j}").into_bytes());
        let data = t.buffer.as_cpu().expect("cpu tensor");
        assert_eq!(
            checksum(data).to_string(),
            sums[split + 1 + j],
            "tensor {j} of message {index}"
        );
    }
    index.parse().expect("index")
}

/// Where a host buffer's bytes live, how many there are, and their checksum: what a buffer was
/// when it was handed in, to check that what comes back is that same buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferPrint {
    pub ptr: usize,
    pub len: usize,
    pub sum: u64,
}

impl BufferPrint {
    /// `buffer`'s print (host memory only: the suites that check buffers move no other).
    pub fn of(buffer: &Buffer) -> BufferPrint {
        BufferPrint::of_bytes(buffer.as_cpu().expect("a host buffer"))
    }

    /// The print of host bytes (a `Vec`'s or a `Bytes`'s).
    pub fn of_bytes(bytes: &[u8]) -> BufferPrint {
        BufferPrint {
            ptr: bytes.as_ptr() as usize,
            len: bytes.len(),
            sum: checksum(bytes),
        }
    }
}

/// The buffers of a message handed to a `Write` or a `Read`, recorded before it goes: "every
/// buffer you hand in comes back" means the same allocations, and for a write the same bytes,
/// whether the operation succeeds or fails. A length alone would pass for a fresh buffer of the
/// same size.
#[derive(Debug, Clone)]
pub struct Receipt {
    pub tensors: Vec<BufferPrint>,
    pub payloads: Vec<BufferPrint>,
}

impl Receipt {
    /// The receipt of a message about to be written.
    pub fn of(m: &Message) -> Receipt {
        Receipt {
            tensors: m
                .tensors
                .iter()
                .map(|t| BufferPrint::of(&t.buffer))
                .collect(),
            payloads: m
                .payloads
                .iter()
                .map(|p| BufferPrint::of_bytes(&p.data))
                .collect(),
        }
    }

    /// The receipt of an allocation about to be read into.
    pub fn of_allocation(a: &Allocation) -> Receipt {
        Receipt {
            tensors: a.tensors.iter().map(BufferPrint::of).collect(),
            payloads: a
                .payloads
                .iter()
                .map(|p| BufferPrint::of_bytes(p))
                .collect(),
        }
    }

    /// A written message came back: the same allocations with the same bytes, succeeded or not.
    pub fn check_write(&self, back: &Message, what: &str) {
        self.check(back, what, true, true)
    }

    /// A read's buffers came back: the same allocations (their bytes are the read's, whole only
    /// if it succeeded).
    pub fn check_read(&self, back: &Message, what: &str) {
        self.check(back, what, true, false)
    }

    /// A write's completion: its buffers back as [`Receipt::check_back`] says; stand-ins only
    /// for a failed write, and only where `may_stand_in` (the `efa` channel).
    pub fn check_write_done(&self, d: &WriteDone, may_stand_in: bool, what: &str) {
        Self::stand_ins_allowed(&d.stand_ins, d.result.is_err() && may_stand_in, what);
        self.check_back(&d.message, &d.stand_ins, what, true);
    }

    /// A read's completion, as [`Receipt::check_write_done`] (its bytes unchecked).
    pub fn check_read_done(&self, r: &ReadDone, may_stand_in: bool, what: &str) {
        Self::stand_ins_allowed(&r.stand_ins, r.result.is_err() && may_stand_in, what);
        self.check_back(&r.message, &r.stand_ins, what, false);
    }

    fn stand_ins_allowed(stand_ins: &[usize], allowed: bool, what: &str) {
        assert!(
            allowed || stand_ins.is_empty(),
            "{what}: stand-ins {stand_ins:?}"
        );
    }

    /// What an operation hands back when the runtime says some tensors are stand-ins
    /// (`WriteDone::stand_ins`, `ReadDone::stand_ins`: the `efa` channel's copies of tensors a
    /// provider still held after a failure, docs/efa.md, "Failure"). Every tensor named there
    /// is a copy of the same length (for a write, `same_bytes`, the same bytes) in another
    /// allocation; every other buffer is the one handed in (for a write, with the same bytes).
    pub fn check_back(&self, back: &Message, stand_ins: &[usize], what: &str, same_bytes: bool) {
        if stand_ins.is_empty() {
            return self.check(back, what, true, same_bytes);
        }
        let mut named = stand_ins.to_vec();
        named.sort_unstable();
        named.dedup();
        assert_eq!(
            named.len(),
            stand_ins.len(),
            "{what}: a stand-in named twice"
        );
        assert_eq!(
            back.tensors.len(),
            self.tensors.len(),
            "{what}: tensors back"
        );
        for (j, (s, t)) in self.tensors.iter().zip(&back.tensors).enumerate() {
            let g = BufferPrint::of(&t.buffer);
            assert_eq!(g.len, s.len, "{what}: tensor {j} back with another length");
            if named.contains(&j) {
                assert_ne!(
                    g.ptr, s.ptr,
                    "{what}: tensor {j} is called a stand-in but is the buffer handed in"
                );
            } else if s.len > 0 {
                assert_eq!(
                    g.ptr, s.ptr,
                    "{what}: tensor {j} back is not the buffer handed in"
                );
            }
            if same_bytes {
                assert_eq!(g.sum, s.sum, "{what}: tensor {j} came back changed");
            }
        }
        // Payloads never go by a channel: always the buffers handed in.
        assert_eq!(
            back.payloads.len(),
            self.payloads.len(),
            "{what}: payloads back"
        );
        for (j, (s, p)) in self.payloads.iter().zip(&back.payloads).enumerate() {
            let g = BufferPrint::of_bytes(&p.data);
            assert_eq!(g.len, s.len, "{what}: payload {j} back with another length");
            if s.len > 0 {
                assert_eq!(
                    g.ptr, s.ptr,
                    "{what}: payload {j} back is not the buffer handed in"
                );
            }
            if same_bytes {
                assert_eq!(g.sum, s.sum, "{what}: payload {j} came back changed");
            }
        }
    }

    fn check(&self, back: &Message, what: &str, same_allocation: bool, same_bytes: bool) {
        let tensors: Vec<BufferPrint> = back
            .tensors
            .iter()
            .map(|t| BufferPrint::of(&t.buffer))
            .collect();
        let payloads: Vec<BufferPrint> = back
            .payloads
            .iter()
            .map(|p| BufferPrint::of_bytes(&p.data))
            .collect();
        for (kind, sent, got) in [
            ("tensor", &self.tensors, &tensors),
            ("payload", &self.payloads, &payloads),
        ] {
            assert_eq!(sent.len(), got.len(), "{what}: {kind}s back");
            for (j, (s, g)) in sent.iter().zip(got).enumerate() {
                assert_eq!(g.len, s.len, "{what}: {kind} {j} back with another length");
                // An empty buffer has no allocation to compare (a dangling pointer).
                if same_allocation && s.len > 0 {
                    assert_eq!(
                        g.ptr, s.ptr,
                        "{what}: {kind} {j} back is not the buffer handed in"
                    );
                }
                if same_bytes {
                    assert_eq!(g.sum, s.sum, "{what}: {kind} {j} came back changed");
                }
            }
        }
    }
}

/// Writes `checked_message(i, &[], &[size])` for each `i` of `0..n` on `pipe`, each to `done`:
/// the messages' receipts, in order.
pub fn write_checked_messages(
    pipe: &Addr<Pipe>,
    n: u64,
    size: usize,
    done: &actix::Recipient<WriteDone>,
) -> Vec<Receipt> {
    (0..n)
        .map(|i| {
            let m = checked_message(i, &[], &[size]);
            let receipt = Receipt::of(&m);
            pipe.do_send(Write::new(m).notify(done.clone()));
            receipt
        })
        .collect()
}

/// A small seeded generator for test plans.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The sizes the conformance plans draw from; 64 MiB is drawn rarely to bound the run time.
pub fn draw_size(rng: &mut Rng) -> usize {
    const SIZES: [usize; 6] = [0, 1, 31, 32, 4 << 10, 1 << 20];
    if rng.below(100) == 0 {
        64 << 20
    } else {
        SIZES[rng.below(SIZES.len() as u64) as usize]
    }
}

// ----- child processes (peer_death.rs, host/netns.rs, host/shm.rs) ----------------------------

/// A command that re-runs this test binary as a child, running only the ignored test `name`
/// (a child mode selected by the environment the caller adds). `name` is the test's full path in
/// the binary, as `--exact` wants it: `peer_death::child_process`, not `child_process`.
pub fn reexec(name: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().expect("test binary path"));
    c.args(reexec_args(name));
    c
}

/// The arguments that make this test binary run only the ignored test `name`.
pub fn reexec_args(name: &str) -> [&str; 6] {
    [
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
        "--quiet",
    ]
}

/// Runs this test binary again with `args` (a filter first), with rxm's passthru on
/// (`FI_OFI_RXM_ENABLE_PASSTHRU=1`: rxm reads it once, as libfabric loads, so it takes a
/// process of its own) and `tcp;ofi_rxm` its only provider (`ACTORPIPE_EFA_PROVIDERS`, the
/// variable tests/common/efa.rs reads). `Err` with the child's output unless it passed, and ran
/// at least `at_least` tests (so a filter that matches nothing does not pass).
#[cfg(feature = "efa")]
#[allow(dead_code)] // not every test binary that includes this module calls it
pub fn rerun_under_passthru(args: &[&str], at_least: usize) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(exe)
        .args(args)
        .env(actorpipe::internal::backend::efa::PASSTHRU, "1")
        .env("ACTORPIPE_EFA_PROVIDERS", "tcp;ofi_rxm")
        .output()
        .map_err(|e| e.to_string())?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let passed = text
        .lines()
        .filter_map(|l| l.strip_prefix("test result: ok. "))
        .filter_map(|l| l.split(' ').next()?.parse::<usize>().ok())
        .sum::<usize>();
    if out.status.success() && passed >= at_least {
        return Ok(());
    }
    Err(format!(
        "under passthru, {args:?}: {} with {passed} passed (at least {at_least} wanted):\n{text}",
        out.status
    ))
}

/// In a child started by [`reexec`]: die with the test thread that started us, so a parent that
/// is killed (or times out) leaves no orphan behind.
pub fn die_with_parent() {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    }
}

/// Prints one line for the parent on stdout, flushed at once.
pub fn tell_parent(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Writes straight to stderr, past the test harness's capture, so that CI logs show it even for
/// a passing test (`eprintln!` output of passing tests is swallowed).
pub fn tell_ci(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A child process whose stdout lines are collected (each stamped when it arrived), and which is
/// killed and reaped however the test ends.
pub struct ChildProcess {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<(std::time::Instant, String)>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Every line read so far, for failure messages.
    pub log: Vec<String>,
}

impl ChildProcess {
    /// Spawns `cmd` with stdout piped (stdin closed, stderr inherited).
    pub fn spawn(mut cmd: std::process::Command) -> ChildProcess {
        use std::io::BufRead as _;
        let mut child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let out = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        let (tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send((std::time::Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        ChildProcess {
            child,
            lines,
            reader: Some(reader),
            log: Vec::new(),
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The next line and when it arrived; `None` if the child closed its stdout or `timeout`
    /// passed first.
    pub fn next_line(&mut self, timeout: Duration) -> Option<(std::time::Instant, String)> {
        let (at, line) = self.lines.recv_timeout(timeout).ok()?;
        self.log.push(line.clone());
        Some((at, line))
    }

    /// The next line containing `tag`, with what follows the tag and when it arrived; `None` if
    /// the child closed its stdout or `timeout` passed first.
    pub fn line(&mut self, tag: &str, timeout: Duration) -> Option<(std::time::Instant, String)> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            let (at, line) = self.next_line(left)?;
            if let Some((_, rest)) = line.split_once(tag) {
                return Some((at, rest.trim().to_string()));
            }
        }
    }

    /// Every line that has arrived and not been taken yet, with when it arrived.
    pub fn drain(&mut self) -> Vec<(std::time::Instant, String)> {
        let mut v = Vec::new();
        while let Ok((at, l)) = self.lines.try_recv() {
            self.log.push(l.clone());
            v.push((at, l));
        }
        v
    }

    /// The last lines the child printed, for failure messages.
    pub fn tail(&mut self) -> String {
        self.drain();
        let from = self.log.len().saturating_sub(40);
        self.log[from..].join("\n")
    }

    /// Sends SIGKILL.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill -9 the child");
    }

    /// Waits for the child to exit, up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().expect("wait for the child") {
                return Some(s);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A child killed with SIGKILL never unlinks the regions libfabric's shm provider made
        // for it (`/dev/shm/PID:N:M`, 16 MiB each; docs/efa.md): remove them once it is reaped.
        let prefix = format!("{}:", self.child.id());
        if let Ok(dir) = std::fs::read_dir("/dev/shm") {
            for e in dir.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        // Its stdout is closed now, so the reader ends and our end of the pipe is closed.
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

// ----- file descriptors and shared memory (peer_death.rs) -------------------------------------

/// This process's open file descriptors and shared-memory mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdCount {
    /// Entries of `/proc/self/fd`.
    pub all: usize,
    /// Of which memfds (`/memfd:...`): shm rings.
    pub memfd: usize,
    /// Of which eventfds (`anon_inode:[eventfd]`): shm doorbells (and each runtime's waker).
    pub eventfd: usize,
    /// Mappings of memfds in `/proc/self/maps`: shm rings still mapped.
    pub memfd_maps: usize,
}

impl FdCount {
    /// Whether nothing here exceeds `baseline`.
    pub fn within(&self, baseline: &FdCount) -> bool {
        self.all <= baseline.all
            && self.memfd <= baseline.memfd
            && self.eventfd <= baseline.eventfd
            && self.memfd_maps <= baseline.memfd_maps
    }
}

/// The link targets of this process's open file descriptors.
pub fn fd_targets() -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
    {
        // The directory handle itself shows up and vanishes: an unreadable link is skipped.
        if let Ok(t) = std::fs::read_link(e.path()) {
            v.push(t.to_string_lossy().into_owned());
        }
    }
    v
}

/// Counts this process's descriptors and memfd mappings.
pub fn fd_count() -> FdCount {
    let t = fd_targets();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    FdCount {
        all: t.len(),
        memfd: t.iter().filter(|t| t.starts_with("/memfd:")).count(),
        eventfd: t.iter().filter(|t| *t == "anon_inode:[eventfd]").count(),
        memfd_maps: maps.lines().filter(|l| l.contains("/memfd:")).count(),
    }
}

/// Polls until the counts are back to `baseline` (pipes, connections and listeners wind down
/// asynchronously); returns how long it took, or the counts still open after `limit`.
pub async fn fds_back_to(baseline: &FdCount, limit: Duration) -> Result<Duration, FdCount> {
    let start = std::time::Instant::now();
    loop {
        let now = fd_count();
        if now.within(baseline) {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= limit {
            return Err(now);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// This process's resident set size, in bytes (`VmRSS` in /proc/self/status).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line");
    kib << 10
}

/// How many file descriptors this process has open (entries of /proc/self/fd, less the one
/// used to list them).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
        .saturating_sub(1)
}

/// Waits, up to `max`, until the open fd count has not changed for `quiet`; returns it.
pub async fn settled_fds(quiet: Duration, max: Duration) -> usize {
    let start = tokio::time::Instant::now();
    let mut last = open_fds();
    let mut since = tokio::time::Instant::now();
    while start.elapsed() < max {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = open_fds();
        if now != last {
            last = now;
            since = tokio::time::Instant::now();
        } else if since.elapsed() >= quiet {
            break;
        }
    }
    last
}

/// The path of an example binary: next to the test binary's folder (`cargo test` builds the
/// examples).
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test`, which builds the examples",
        path.display()
    );
    path
}

/// `n` checked messages from `tx` to `rx`, their (payload sizes, tensor sizes) drawn by `shape`
/// from an `Rng` seeded with `seed`, up to `window` writes in flight: each arrives intact and in
/// order, and writes complete in order (their ids counted from the first completion, so `tx`
/// may have written before). Returns the tensor bytes sent.
pub async fn random_stream(
    tx: &Addr<Pipe>,
    rx: &Addr<Pipe>,
    n: u64,
    window: u64,
    seed: u64,
    mut shape: impl FnMut(&mut Rng) -> (Vec<usize>, Vec<usize>),
) -> u64 {
    let (done_to, mut done) = inbox::<WriteDone>();
    let mut total = 0;
    let writer = async {
        let mut rng = Rng(seed);
        let mut next = 0;
        let mut base = None;
        for i in 0..n {
            let (payloads, tensors) = shape(&mut rng);
            total += tensors.iter().sum::<usize>() as u64;
            tx.do_send(Write::new(checked_message(i, &payloads, &tensors)).notify(done_to.clone()));
            while i + 1 - next >= window || (i == n - 1 && next < n) {
                let d = done.recv().await.unwrap();
                let base = *base.get_or_insert(d.id);
                assert_eq!(d.id - base, next, "write completions in order");
                d.result.expect("write");
                next += 1;
            }
        }
    };
    let reader = async {
        for i in 0..n {
            assert_eq!(verify(&read_one(rx).await.expect("read")), i);
        }
    };
    tokio::join!(writer, reader);
    total
}

/// Asserts that `p` runs on `transport` and has negotiated `channel`.
pub async fn check_backends(p: &Addr<Pipe>, transport: &str, channel: &str) {
    let info = p.send(GetInfo).await.unwrap();
    assert_eq!(info.transport, transport);
    assert!(
        info.channels.iter().any(|c| c.name == channel),
        "{:?}",
        info.channels
    );
}

/// A region descriptor's fields, in order (its MessagePack form): version, owner, context, id,
/// token, length, writable, memory.
pub type DescriptorFields = (u8, String, u64, u64, [u64; 2], u64, bool, DescriptorMemory);

/// Where a region's memory is, as a descriptor holds it.
#[derive(serde::Serialize, serde::Deserialize)]
pub enum DescriptorMemory {
    Host,
    Cuda { device: u32, ipc: bool },
}

/// `d` with its fields changed by `edit`: a forged descriptor, as a peer could make one.
pub fn forge(
    d: &actorpipe::remote::RegionDescriptor,
    edit: impl FnOnce(&mut DescriptorFields),
) -> actorpipe::remote::RegionDescriptor {
    let mut f: DescriptorFields =
        rmp_serde::from_slice(&d.to_bytes()).expect("the descriptor's fields");
    edit(&mut f);
    actorpipe::remote::RegionDescriptor::from_bytes(&rmp_serde::to_vec(&f).unwrap()).unwrap()
}
