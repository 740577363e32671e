//! The cma channel: the receiver reads a tensor straight out of the sender's memory.
//!
//! The sender puts a [`RemoteBuffer`] (its pid, the tensor's address and length) in the tensor's
//! channel data; the receiver calls [`read_remote`], which copies the bytes with
//! `process_vm_readv(2)` ("cross-memory attach"): one copy, done by the kernel, nothing to set up
//! per tensor. The sender keeps the buffer alive and unchanged until the receiver says it is done.
//!
//! It works only between processes allowed to ptrace each other: the same kernel (boot id), the
//! same PID namespace (the pid in the channel data must name the same process for both) and the
//! same user, which is what the [`Cma`] domain descriptor says. Yama `ptrace_scope`, seccomp
//! filters and container profiles can still forbid the call: [`probe`] checks at context start,
//! and a read that fails with [`CmaError::NotPermitted`] tells the caller to fall back to another
//! channel.
//!
//! One call moves at most [`max_per_call`] bytes (the kernel's `MAX_RW_COUNT`) and may move fewer;
//! [`plan`] splits a read into shares (one per thread) and each share into per-call pieces.

pub(crate) mod driver;

use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::backend::basic::chunks;
use crate::channel::ChannelBackend;
use crate::copy::{Pool, Work};
use crate::error::{Error, Origin};
use crate::negotiate::DevicePair;

/// What one `process_vm_readv` call moves at most with 4 KiB pages: the kernel's `MAX_RW_COUNT`,
/// `INT_MAX & PAGE_MASK`. [`max_per_call`] gives the value for this machine's page size.
pub const MAX_RW_COUNT_4K: u64 = 0x7fff_f000;

/// Reads shorter than this per thread stay on fewer threads: a share handed to a sleeping reader
/// thread waits for its wake-up (tens of microseconds in a VM), a fraction of the 130–170 µs
/// that reading this many bytes takes at 6–8 GB/s. It was 4 MiB while each read started its
/// own threads (until 2026-11-26).
pub const MIN_SHARE: u64 = 1 << 20;

/// Most threads one read uses, whatever the caller asks for.
pub const MAX_THREADS: usize = 64;

/// The default threads per cma read on a machine whose process may use `cores` CPUs: half of
/// them, at least 2 and at most 8. Only the receiver reads, while the sender waits for its
/// acknowledgement, so a read may take more of the machine than a copy that both sides make at
/// once. On 16 cores a 128 MiB tensor took 37–44 ms a round trip with 2 threads, 22–23 ms with
/// 4 and 13–14 ms with 8 (git history's docs/performance-many-cores.md, "Large copies shared among copy
/// threads").
pub fn default_threads(cores: usize) -> usize {
    (cores / 2).clamp(2, 8)
}

/// Shares start on multiples of this, so that two threads rarely pin the same page.
const SHARE_ALIGN: u64 = 4096;

/// Largest tensor that goes over the pipe's connection instead of cma when that connection is
/// shm. On the 2-core machine of docs/performance.md the shm ring (with non-temporal stores into
/// the destination) moves a tensor at least as fast as `process_vm_readv` plus its
/// acknowledgement at every size measured, 64 B to 64 MiB (`actorpipe bench channel --backend
/// basic --transport shm` against `--backend cma`); above this, cma's reads split across threads
/// and keep the control connection free for other messages.
pub const INLINE_MAX_SHM: u64 = 64 << 20;

/// The same over any other connection (tcp): the kernel's loopback copy is slower than a
/// cross-memory read, so only small tensors, whose cost is the fixed cost of a read, go inline.
pub const INLINE_MAX_OTHER: u64 = 256 << 10;

/// Largest tensor sent inline, on the pipe's connection, rather than by cma, when the pipe's
/// transport is `transport` (see [`INLINE_MAX_SHM`] and [`INLINE_MAX_OTHER`]).
pub fn inline_max(transport: &str) -> u64 {
    match transport {
        "shm" => INLINE_MAX_SHM,
        _ => INLINE_MAX_OTHER,
    }
}

/// Capacity of the buffered reader of each cma side connection: an acknowledgement frame, or a
/// chunk header with the first bytes of its chunk, fits.
pub const SIDE_READ_BUFFER: usize = 512;

/// Encoded size of a [`RemoteBuffer`].
pub const REMOTE_BUFFER_LEN: usize = 20;

/// The cross-memory-attach CPU channel.
///
/// Offer it only after [`probe`] succeeded.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cma;

impl crate::channel::sealed::Sealed for Cma {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::Cma {
            threads: at.cma_threads,
            chunk_size: at.chunk_size,
            inline_max: at
                .cma_inline_max
                .unwrap_or_else(|| inline_max(at.transport)),
        }
    }
}

impl ChannelBackend for Cma {
    fn name(&self) -> &'static str {
        "cma"
    }

    fn priority(&self) -> i32 {
        200
    }

    fn domain(&self) -> String {
        domain()
    }

    fn devices(&self) -> DevicePair {
        DevicePair::CPU
    }

    /// Two side connections: one carries acknowledgements, the other the bytes themselves
    /// when a read is refused at run time (apart, so neither can get in the other's way when
    /// both directions of a pipe move tensors).
    fn connections(&self) -> u32 {
        2
    }

    /// Acknowledgements are small frames, and fallback bytes arrive in chunks far larger than
    /// any read buffer, which tokio reads straight into the tensor: the side connections need
    /// no 8 KiB buffer each ([`SIDE_READ_BUFFER`]).
    fn lane_read_buffer(&self) -> usize {
        SIDE_READ_BUFFER
    }

    fn viable(&self) -> Result<(), String> {
        static PROBE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        PROBE
            .get_or_init(|| probe().map_err(|e| e.to_string()))
            .clone()
    }
}

/// Boot id, PID namespace and user: two processes that may read each other's memory agree on all
/// three. Both the real and the effective uid go in, because the kernel compares the reader's
/// real uid with the target's effective one: a set-uid peer must not look compatible. When
/// `/proc` cannot tell, the descriptor is unique to this process, so that no peer matches it.
fn domain() -> String {
    // SAFETY: getuid and geteuid cannot fail and touch no memory of ours.
    let (uid, euid) = unsafe { (libc::getuid(), libc::geteuid()) };
    match (boot_id(), pid_namespace()) {
        (Some(boot), Some(pidns)) => format!("boot={boot};pidns={pidns};uid={uid}:{euid}"),
        _ => format!(
            "unknown;pid={};token={:016x}",
            std::process::id(),
            process_token()
        ),
    }
}

fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_owned())
}

fn pid_namespace() -> Option<u64> {
    // The link names the namespace (`pid:[4026531836]`); following it gives the namespace's inode.
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// A random number fixed for the life of the process.
fn process_token() -> u64 {
    use std::hash::BuildHasher;
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u8))
}

/// Where a tensor lives in the sender's memory: the channel data of a cma tensor.
///
/// Encoded as 20 bytes, little endian: pid (4), address (8), length (8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteBuffer {
    /// The sender's process id, in the PID namespace both peers share.
    pub pid: u32,
    /// Address of the first byte in the sender's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteBuffer {
    /// Describes a buffer of this process, for a peer to read. The buffer must stay alive and
    /// unchanged until the peer has read it.
    pub fn local(buf: &[u8]) -> Self {
        RemoteBuffer {
            pid: std::process::id(),
            addr: buf.as_ptr() as usize as u64,
            len: buf.len() as u64,
        }
    }

    /// The 20-byte channel data.
    pub fn encode(&self) -> [u8; REMOTE_BUFFER_LEN] {
        let mut out = [0u8; REMOTE_BUFFER_LEN];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..12].copy_from_slice(&self.addr.to_le_bytes());
        out[12..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes channel data; `None` unless it is exactly 20 bytes.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != REMOTE_BUFFER_LEN {
            return None;
        }
        let (pid, rest) = bytes.split_first_chunk::<4>()?;
        let (addr, rest) = rest.split_first_chunk::<8>()?;
        let (len, _) = rest.split_first_chunk::<8>()?;
        Some(RemoteBuffer {
            pid: u32::from_le_bytes(*pid),
            addr: u64::from_le_bytes(*addr),
            len: u64::from_le_bytes(*len),
        })
    }
}

/// Why a cross-memory read failed. Each variant asks the caller for something different.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmaError {
    /// The kernel refused the read (EPERM, EACCES, ENOSYS). Nothing is wrong with the peer: this
    /// host does not let these two processes read each other. Fall back to another channel.
    #[error(
        "cma: not permitted to read the memory of process {pid}: {source}; ptrace rules (Yama \
         ptrace_scope, another user, a non-dumpable peer), a seccomp filter or a container \
         profile forbid process_vm_readv here; use another channel (basic), or allow ptrace \
         between the peers (same user, ptrace_scope 0, or CAP_SYS_PTRACE)"
    )]
    NotPermitted {
        /// The process we tried to read.
        pid: u32,
        /// The operating system's answer.
        source: io::Error,
    },
    /// The process does not exist (ESRCH): the peer exited before its tensor was read.
    #[error(
        "cma: process {pid} is gone (no such process): the peer exited before its tensor was \
         read; this read cannot finish, close the pipe"
    )]
    Gone {
        /// The process we tried to read.
        pid: u32,
    },
    /// The peer's memory has nothing readable in the range (EFAULT), or the range does not fit in
    /// an address space: the peer sent a wrong address or length, or freed the buffer too early.
    #[error(
        "cma: bad address: process {pid} has no readable memory at {addr:#x} (+{len} bytes); \
         the peer sent a wrong address or length or freed the buffer before it was read; treat \
         it as a protocol violation and close the pipe"
    )]
    Fault {
        /// The process we tried to read.
        pid: u32,
        /// Start of the part that could not be read.
        addr: u64,
        /// Bytes asked for from `addr`.
        len: u64,
    },
    /// The peer's buffer and the receive buffer differ in length; nothing was read.
    #[error(
        "cma: the peer offers {remote} bytes but the receive buffer holds {local}; the channel \
         data disagrees with the tensor descriptor, a protocol violation: close the pipe"
    )]
    LengthMismatch {
        /// Length in the channel data.
        remote: u64,
        /// Length of the receive buffer.
        local: u64,
    },
    /// Any other failure (ENOMEM, a thread that could not start, …).
    #[error("cma: reading the memory of process {pid} failed: {source}")]
    Other {
        /// The process we tried to read.
        pid: u32,
        /// The operating system's answer.
        source: io::Error,
    },
}

impl CmaError {
    /// The runtime's error for this failure on a pipe: `NotPermitted` is
    /// [`Error::Unavailable`], `Gone` is [`Error::PeerClosed`], `Fault` and `LengthMismatch` are
    /// [`Error::Protocol`], the rest [`Error::Io`].
    pub fn into_error(self, origin: &Origin) -> Error {
        let reason = self.to_string();
        match self {
            CmaError::NotPermitted { .. } => Error::Unavailable {
                backend: "cma".into(),
                reason,
            },
            CmaError::Gone { .. } => Error::PeerClosed {
                reason,
                graceful: false,
                origin: origin.clone(),
            },
            CmaError::Fault { .. } | CmaError::LengthMismatch { .. } => {
                Error::protocol(reason, origin)
            }
            CmaError::Other { source, .. } => {
                Error::io("reading a tensor with cma", source, origin)
            }
        }
    }

    fn from_os(err: io::Error, pid: u32, addr: u64, len: u64) -> Self {
        match err.raw_os_error() {
            Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => {
                CmaError::NotPermitted { pid, source: err }
            }
            Some(libc::ESRCH) => CmaError::Gone { pid },
            Some(libc::EFAULT) => CmaError::Fault { pid, addr, len },
            _ => CmaError::Other { pid, source: err },
        }
    }
}

/// Bytes one `process_vm_readv` call moves at most here: `INT_MAX` rounded down to a page.
pub fn max_per_call() -> u64 {
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096);
    i32::MAX as u64 & !(page - 1)
}

/// One thread's part of a read: a contiguous range of the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Offset of the range from the start of the buffer.
    pub offset: u64,
    /// Bytes in the range.
    pub len: u64,
    max_per_call: u64,
}

impl Share {
    /// The `(offset, length)` of each call, in order, offsets from the start of the buffer; none
    /// longer than the plan's `max_per_call`.
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64)> {
        let base = self.offset;
        chunks(self.len, self.max_per_call).map(move |(offset, len)| (base + offset, len))
    }
}

/// Splits a read of `len` bytes into at most `threads` contiguous shares (clamped to
/// `1..=`[`MAX_THREADS`], and no more than one per [`MIN_SHARE`] bytes), whose pieces are at most
/// `max_per_call` bytes (0 is taken as 1). Shares and pieces cover `0..len` exactly, in order;
/// zero bytes give no share.
pub fn plan(len: u64, max_per_call: u64, threads: usize) -> impl Iterator<Item = Share> {
    let max_per_call = max_per_call.max(1);
    let wanted = threads.clamp(1, MAX_THREADS) as u64;
    let threads = wanted.min(len.div_ceil(MIN_SHARE)).max(1);
    let share = len
        .div_ceil(threads)
        .div_ceil(SHARE_ALIGN)
        .saturating_mul(SHARE_ALIGN);
    chunks(len, share).map(move |(offset, len)| Share {
        offset,
        len,
        max_per_call,
    })
}

/// Reads `src` from the other process into `dst`, whose length must be `src.len`, with up to
/// `threads` threads (see [`plan`]): the calling thread and the process's cma reader threads,
/// started on the first read that asks for them and kept for the life of the process (idle, they
/// sleep). Each share is claimed by whoever comes first, so a reader thread that is slow to wake
/// costs the caller nothing beyond reading that share itself. Returns once every byte is in
/// `dst`, or with the first failure in buffer order (the shares not yet started are skipped
/// after a failure); after a failure `dst` holds an unspecified mix of old and new bytes.
/// Blocks: an actor runs it off its event loop.
pub fn read_remote(src: &RemoteBuffer, dst: &mut [u8], threads: usize) -> Result<(), CmaError> {
    let refusal = simulated();
    if refusal == Refusal::AtEntry && !dst.is_empty() {
        return Err(refused(src));
    }
    read_remote_with(src, dst, threads, max_per_call(), refusal)
}

/// Where fault injection raises a refusal (see [`simulate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// None: every read goes to the kernel.
    Off,
    /// Every non-empty [`read_remote`] fails at its entry, before any byte is read.
    AtEntry,
    /// Each share a reader thread claims fails instead of being read, after the caller's own
    /// shares may have landed: the read fails part-way, from inside the pool. A read of one
    /// share (the caller's alone) is not refused.
    InReaderShares,
}

static REFUSE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Fault injection: while not [`Refusal::Off`], the reads of this process fail with
/// [`CmaError::NotPermitted`] (EPERM) where `refusal` says, as they would under ptrace
/// restrictions or seccomp.
///
/// This is how the fallback path (the bytes streamed over the channel's side connection
/// instead) is exercised on machines where cma is allowed; it has no other use.
pub fn simulate(refusal: Refusal) {
    let code = match refusal {
        Refusal::Off => 0,
        Refusal::AtEntry => 1,
        Refusal::InReaderShares => 2,
    };
    REFUSE.store(code, std::sync::atomic::Ordering::Relaxed);
}

/// [`simulate`]: `true` is [`Refusal::AtEntry`], `false` [`Refusal::Off`].
pub fn simulate_refusal(on: bool) {
    simulate(if on { Refusal::AtEntry } else { Refusal::Off });
}

/// The refusal fault injection raises now ([`simulate`]).
pub(crate) fn simulated() -> Refusal {
    match REFUSE.load(std::sync::atomic::Ordering::Relaxed) {
        0 => Refusal::Off,
        1 => Refusal::AtEntry,
        _ => Refusal::InReaderShares,
    }
}

/// The error a simulated refusal gives.
fn refused(src: &RemoteBuffer) -> CmaError {
    CmaError::NotPermitted {
        pid: src.pid,
        source: io::Error::from_raw_os_error(libc::EPERM),
    }
}

fn read_remote_with(
    src: &RemoteBuffer,
    dst: &mut [u8],
    threads: usize,
    max_per_call: u64,
    refusal: Refusal,
) -> Result<(), CmaError> {
    if dst.len() as u64 != src.len {
        return Err(CmaError::LengthMismatch {
            remote: src.len,
            local: dst.len() as u64,
        });
    }
    let fits = src
        .addr
        .checked_add(src.len)
        .is_some_and(|end| usize::try_from(end).is_ok());
    if !fits {
        return Err(CmaError::Fault {
            pid: src.pid,
            addr: src.addr,
            len: src.len,
        });
    }
    let shares: Vec<Share> = plan(src.len, max_per_call, threads).collect();
    if shares.len() <= 1 {
        return shares
            .first()
            .map_or(Ok(()), |&share| read_share(src, share, dst));
    }
    read_shared(Some(&READERS), src, dst, shares, refusal)
}

/// The cma reader threads: a read's shares other than the caller's go to them.
static READERS: Pool = Pool::new("actorpipe-cma");

/// The threads that share large cma copies: this channel's reads, and the remote-memory `cma`
/// path's copies (`crate::remote_core`).
pub(crate) fn readers() -> &'static Pool {
    &READERS
}

/// Reads `shares` of `src` into `dst` (`src.len` bytes, covered exactly by the shares) on the
/// calling thread and on `pool`'s threads at once: up to one thread per share, started on the
/// first read that asks for them and kept (see [`crate::copy`]'s pool). Each share is claimed by
/// whoever comes first, so the caller reads alone whatever no thread takes (everything, without
/// a pool). With [`Refusal::InReaderShares`], each share a pool thread claims fails as refused.
fn read_shared(
    pool: Option<&'static Pool>,
    src: &RemoteBuffer,
    dst: &mut [u8],
    shares: Vec<Share>,
    refusal: Refusal,
) -> Result<(), CmaError> {
    let n = shares.len();
    let helpers = pool.map_or(0, |p| p.helpers(n - 1));
    let job = Arc::new(ReadJob {
        src: *src,
        dst: dst.as_mut_ptr(),
        shares,
        next: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
        refuse_readers: refusal == Refusal::InReaderShares,
        state: Mutex::new(ReadState {
            done: 0,
            errors: Vec::new(),
        }),
        finished: Condvar::new(),
    });
    let work: Arc<dyn Work> = job.clone();
    if let Some(pool) = pool {
        pool.offer(&work, (n - 1).min(helpers));
    }
    job.claim(false);
    // What is left was claimed by reader threads, which are reading it now.
    let mut state = job.state.lock().unwrap_or_else(|p| p.into_inner());
    while state.done < n {
        state = job.finished.wait(state).unwrap_or_else(|p| p.into_inner());
    }
    // The first failure in buffer order.
    match state.errors.iter_mut().find_map(Option::take) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One read shared among threads (see [`read_shared`]).
struct ReadJob {
    src: RemoteBuffer,
    /// The start of the caller's buffer, `src.len` bytes.
    dst: *mut u8,
    shares: Vec<Share>,
    /// The next share to claim (may run past the last).
    next: AtomicUsize,
    /// A share failed: the shares claimed after it are skipped (the read fails anyway).
    failed: AtomicBool,
    /// Fault injection ([`Refusal::InReaderShares`]): the pool threads' shares fail as refused.
    refuse_readers: bool,
    state: Mutex<ReadState>,
    /// Signalled when the last share is done.
    finished: Condvar,
}

struct ReadState {
    /// Shares done (read, failed or skipped).
    done: usize,
    /// Each share's failure, by share (empty until one fails).
    errors: Vec<Option<CmaError>>,
}

// SAFETY: `dst` is written only by whoever claimed a share (`next` below the share count), each
// share a disjoint range of the caller's buffer, and `read_shared`, which borrows that buffer
// exclusively for its whole call, returns only once every share is done; a thread that takes
// the job later finds nothing to claim and touches no pointer.
unsafe impl Send for ReadJob {}
// SAFETY: as above; the shared state is atomics and a mutex.
unsafe impl Sync for ReadJob {}

impl Work for ReadJob {
    /// A pool thread's turn.
    fn work(&self) -> usize {
        self.claim(true)
    }
}

impl ReadJob {
    /// Claims and reads shares until none is left, as a pool thread (`reader`) or the caller;
    /// returns how many this call did.
    fn claim(&self, reader: bool) -> usize {
        let mut did = 0;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&share) = self.shares.get(i) else {
                return did;
            };
            let result = if self.failed.load(Ordering::Relaxed) {
                Ok(())
            } else if reader && self.refuse_readers {
                Err(refused(&self.src))
            } else {
                // SAFETY: share `i` is ours alone (claimed above), inside the caller's buffer
                // (the shares cover `src.len` bytes exactly, checked against the buffer), which
                // stays borrowed until every share is done (see `unsafe impl Send`). The plan's
                // offsets fit in a usize: the buffer does.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        self.dst.add(share.offset as usize),
                        share.len as usize,
                    )
                };
                read_share(&self.src, share, dst)
            };
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = result {
                self.failed.store(true, Ordering::Relaxed);
                if state.errors.is_empty() {
                    state.errors.resize_with(self.shares.len(), || None);
                }
                state.errors[i] = Some(e);
            }
            state.done += 1;
            if state.done == self.shares.len() {
                self.finished.notify_all();
            }
            drop(state);
            did += 1;
        }
    }
}

/// `buf` cut after `len` bytes. The plan covers the buffer exactly, so this fails only on a bug
/// here; it reports one instead of panicking.
fn split<'a>(
    src: &RemoteBuffer,
    buf: &'a mut [u8],
    len: u64,
) -> Result<(&'a mut [u8], &'a mut [u8]), CmaError> {
    usize::try_from(len)
        .ok()
        .and_then(|len| buf.split_at_mut_checked(len))
        .ok_or_else(|| CmaError::Other {
            pid: src.pid,
            source: io::Error::other("internal error: cma read plan does not match the buffer"),
        })
}

/// Reads one share into `dst`, which holds exactly the share's bytes.
fn read_share(src: &RemoteBuffer, share: Share, mut dst: &mut [u8]) -> Result<(), CmaError> {
    for (offset, len) in share.pieces() {
        let (piece, rest) = split(src, dst, len)?;
        dst = rest;
        // Cannot overflow: read_remote_with checked that addr + len fits.
        read_piece(src, src.addr + offset, piece)?;
    }
    Ok(())
}

/// Reads `dst.len()` bytes from `addr` in the other process, one call at a time: a call moves
/// fewer bytes than asked when it meets an unreadable page (the next call then fails) or a fatal
/// signal.
fn read_piece(src: &RemoteBuffer, mut addr: u64, mut dst: &mut [u8]) -> Result<(), CmaError> {
    let Ok(pid) = libc::pid_t::try_from(src.pid) else {
        // No process can have this id.
        return Err(CmaError::Gone { pid: src.pid });
    };
    while !dst.is_empty() {
        let asked = dst.len();
        let local = libc::iovec {
            iov_base: dst.as_mut_ptr().cast(),
            iov_len: asked,
        };
        let remote = libc::iovec {
            // Fits: read_remote_with checked that the whole range fits in a usize.
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: asked,
        };
        // SAFETY: `local` describes `dst`, which we borrow exclusively and which is `asked` bytes
        // long, so the kernel writes only memory we own. `remote` is only read, and by the kernel
        // in the other process's address space, which checks it and answers EFAULT for anything
        // unmapped or unreadable; even when that process is this one, no Rust reference is read
        // or written through it. The iovec arrays are one element each, as the counts say.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        let moved = match usize::try_from(n) {
            Ok(moved) => moved,
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(CmaError::from_os(err, src.pid, addr, asked as u64));
            }
        };
        if moved == 0 {
            // The kernel reports a first unreadable page as EFAULT; never loop on nothing.
            return Err(CmaError::Fault {
                pid: src.pid,
                addr,
                len: asked as u64,
            });
        }
        let Some(rest) = std::mem::take(&mut dst).get_mut(moved..) else {
            return Err(CmaError::Other {
                pid: src.pid,
                source: io::Error::other(format!(
                    "process_vm_readv claims {moved} bytes of {asked}"
                )),
            });
        };
        dst = rest;
        addr += moved as u64;
    }
    Ok(())
}

/// Checks that this process may use cross-memory attach: reads a buffer of its own with
/// `process_vm_readv` and compares the bytes. Run it at context start and offer [`Cma`] only if
/// it succeeds.
///
/// Reading oneself is always allowed by ptrace rules, so this catches what forbids the call
/// outright (seccomp, kernels without it) but not what forbids reading one particular peer (Yama
/// `ptrace_scope` 1 or more, a non-dumpable peer): those show up as
/// [`CmaError::NotPermitted`] on the first read, and the caller falls back then.
pub fn probe() -> Result<(), CmaError> {
    // A bit more than two pages, from an odd offset: the kernel walks and pins several pages.
    let src: Vec<u8> = (0..8195u32)
        .map(|i| (i.wrapping_mul(151) >> 3) as u8)
        .collect();
    let src = &src[3..];
    let remote = RemoteBuffer::local(std::hint::black_box(src));
    let mut dst = vec![0u8; src.len()];
    read_remote(&remote, &mut dst, 1)?;
    if dst != src {
        return Err(CmaError::Other {
            pid: remote.pid,
            source: io::Error::other(
                "process_vm_readv of our own memory returned other bytes than were there",
            ),
        });
    }
    Ok(())
}

/// What the trials that read real memory (tests/host/cma.rs) need beyond the functions above:
/// a read with a chosen call size, a read on the caller alone, and reader threads of the trial's
/// own. Those trials need the kernel to allow `process_vm_readv`, which a unit test cannot
/// report as skipped where it does not; the unit tests (`tests.rs`) hold what runs everywhere.
/// Not part of the API.
#[doc(hidden)]
pub mod testing {
    use super::{max_per_call, plan, CmaError, Pool, Refusal, RemoteBuffer, Share};

    /// [`super::read_remote`] with at most `max_per_call` bytes a call, so that a small read
    /// takes many calls.
    pub fn read_remote_with(
        src: &RemoteBuffer,
        dst: &mut [u8],
        threads: usize,
        max_per_call: u64,
    ) -> Result<(), CmaError> {
        super::read_remote_with(src, dst, threads, max_per_call, Refusal::Off)
    }

    /// Reads `shares` of `src` into `dst` on the calling thread alone, in order.
    pub fn read_alone(
        src: &RemoteBuffer,
        dst: &mut [u8],
        shares: Vec<Share>,
    ) -> Result<(), CmaError> {
        super::read_shared(None, src, dst, shares, Refusal::Off)
    }

    /// A pool of reader threads of a trial's own (the process's one is shared by every read),
    /// leaked as the process's is.
    pub struct Readers(&'static Pool);

    impl Readers {
        /// A pool with no thread yet; its threads are called `name`-N.
        pub fn new(name: &'static str) -> Readers {
            Readers(Box::leak(Box::new(Pool::new(name))))
        }

        /// [`super::read_remote`] on this pool, `threads` threads.
        pub fn read(
            &self,
            src: &RemoteBuffer,
            dst: &mut [u8],
            threads: usize,
        ) -> Result<(), CmaError> {
            self.read_with(src, dst, threads, Refusal::Off)
        }

        /// [`Readers::read`], with refusals simulated where `refusal` says (not process-wide:
        /// this read alone).
        pub fn read_with(
            &self,
            src: &RemoteBuffer,
            dst: &mut [u8],
            threads: usize,
            refusal: Refusal,
        ) -> Result<(), CmaError> {
            super::read_shared(
                Some(self.0),
                src,
                dst,
                plan(src.len, max_per_call(), threads).collect(),
                refusal,
            )
        }

        /// Shares this pool's threads have read so far.
        pub fn helped(&self) -> usize {
            self.0.helped()
        }

        /// Runs `work` in a child forked once this pool's threads are idle: panics unless the
        /// child says its result is right and queued nothing for the threads it does not have.
        pub fn check_in_forked_child(&self, work: impl FnOnce() -> bool) {
            crate::copy::check_in_forked_child(self.0, work)
        }
    }
}

#[cfg(test)]
mod tests;
