//! The owner's side of the `cma` path: copies between a region and an initiator's buffer in
//! another process with `process_vm_writev` (a read) or `process_vm_readv` (a write). A large
//! batch is cut into shares of about equal bytes, each copied by its own call on the cma
//! channel's reader threads (`crate::backend::cma`), as the channel splits a large tensor: one
//! call moves 4–6 GB/s, whatever the machine (the kernel pins and copies page by page).

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::lane::Cursor;
use super::Span;
use crate::backend::cma::MIN_SHARE;
use crate::copy::Work;
use crate::error::Error;

/// Whether this process may reach the memory of process `pid` with cma: a read of its byte at
/// `addr` (the peer's `PROBE`). The cma channel's fault injection refuses it too.
pub(super) fn reaches(pid: i32, addr: u64) -> bool {
    if crate::backend::cma::simulated() != crate::backend::cma::Refusal::Off {
        return false;
    }
    let mut byte = 0u8;
    let ours = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let theirs = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: `ours` names `byte`, alive across the call; the kernel checks `theirs` against
    // process `pid` (a bad address fails, it cannot touch our memory).
    let n = unsafe { libc::process_vm_readv(pid, &ours, 1, &theirs, 1, 0) };
    n == 1
}

/// Copies `spans` between the region at `base` and `addr` in process `pid` (see the module
/// docs), on up to `threads` threads: the caller's, and the reader threads.
pub(super) fn copy(
    pid: i32,
    base: *mut u8,
    addr: u64,
    spans: &[Span],
    write: bool,
    threads: usize,
) -> Result<(), Error> {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let n = (total / MIN_SHARE).clamp(1, threads.max(1) as u64) as usize;
    if n == 1 {
        return vm_copy(pid, base, addr, spans, write);
    }
    let shares = shares(spans, total, n);
    let pool = crate::backend::cma::readers();
    let helpers = pool.helpers(shares.len() - 1);
    let job = Arc::new(VmJob {
        pid,
        base,
        addr,
        write,
        shares,
        next: AtomicUsize::new(0),
        state: Mutex::new((0, None)),
        finished: Condvar::new(),
    });
    let work: Arc<dyn Work> = job.clone();
    pool.offer(&work, (job.shares.len() - 1).min(helpers));
    job.claim();
    let mut state = job.state.lock().unwrap_or_else(|p| p.into_inner());
    while state.0 < job.shares.len() {
        state = job.finished.wait(state).unwrap_or_else(|p| p.into_inner());
    }
    match state.1.take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Cuts `spans` (`total` bytes) into `n` batches of about `total / n` bytes each, on page
/// boundaries of the stream.
fn shares(spans: &[Span], total: u64, n: usize) -> Vec<Vec<Span>> {
    let each = total.div_ceil(n as u64).next_multiple_of(4096);
    let mut out = vec![Vec::new()];
    let mut room = each;
    for s in spans {
        let mut done = 0;
        while done < s.len {
            if room == 0 {
                out.push(Vec::new());
                room = each;
            }
            let len = (s.len - done).min(room);
            out.last_mut().expect("one batch at least").push(Span::new(
                s.remote + done,
                s.local + done,
                len,
            ));
            done += len;
            room -= len;
        }
    }
    out
}

/// One copy shared among threads.
struct VmJob {
    pid: i32,
    base: *mut u8,
    addr: u64,
    write: bool,
    shares: Vec<Vec<Span>>,
    /// The next share to claim (may run past the last).
    next: AtomicUsize,
    /// Shares done, and the first error.
    state: Mutex<(usize, Option<Error>)>,
    /// Signalled when the last share is done.
    finished: Condvar,
}

// SAFETY: `base` points into a region whose memory the caller of `copy` holds (the region's
// lock) until every share is done, which `copy` waits for before it returns; the shares are
// disjoint pieces of the batch, whose spans `check` put inside the region; a thread that takes
// the job after the last share finds nothing to claim and touches no pointer.
unsafe impl Send for VmJob {}
// SAFETY: as above; the shared state is an atomic and a mutex.
unsafe impl Sync for VmJob {}

impl Work for VmJob {
    fn work(&self) -> usize {
        self.claim()
    }
}

impl VmJob {
    /// Claims and copies shares until none is left; returns how many this call did.
    fn claim(&self) -> usize {
        let mut did = 0;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(share) = self.shares.get(i) else {
                return did;
            };
            let failed = self
                .state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .1
                .is_some();
            let result = if failed {
                Ok(())
            } else {
                vm_copy(self.pid, self.base, self.addr, share, self.write)
            };
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = result {
                state.1.get_or_insert(e);
            }
            state.0 += 1;
            if state.0 == self.shares.len() {
                self.finished.notify_all();
            }
            did += 1;
        }
    }
}

/// Copies `spans` between the region at `base` and the initiator's buffer at `addr` in process
/// `pid`: into the region (`write`, `process_vm_readv`) or out of it (`process_vm_writev`).
pub(super) fn vm_copy(
    pid: i32,
    base: *mut u8,
    addr: u64,
    spans: &[Span],
    write: bool,
) -> Result<(), Error> {
    const IOV_MAX: usize = 1024;
    let max = crate::backend::cma::max_per_call();
    let mut ours: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX.min(spans.len()));
    let mut theirs: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX.min(spans.len()));
    let mut at = Cursor::default();
    loop {
        ours.clear();
        theirs.clear();
        let mut batch = 0u64;
        let mut walk = Cursor {
            span: at.span,
            offset: at.offset,
        };
        while walk.span < spans.len() && ours.len() < IOV_MAX && batch < max {
            let s = &spans[walk.span];
            let len = (s.len - walk.offset).min(max - batch);
            if len > 0 {
                ours.push(libc::iovec {
                    // SAFETY: the caller checked the span inside the region at `base`.
                    iov_base: unsafe { base.add((s.remote + walk.offset) as usize) }.cast(),
                    iov_len: len as usize,
                });
                theirs.push(libc::iovec {
                    iov_base: (addr + s.local + walk.offset) as *mut libc::c_void,
                    iov_len: len as usize,
                });
                batch += len;
            }
            walk.offset += len;
            if walk.offset == s.len {
                walk.span += 1;
                walk.offset = 0;
            }
        }
        if batch == 0 {
            return Ok(());
        }
        // SAFETY: `ours` names memory of the region, held by the caller's lock; `theirs` names
        // the initiator's memory, which the kernel checks (a bad address fails with EFAULT, it
        // cannot touch ours); both vectors live across the call.
        let n = unsafe {
            if write {
                libc::process_vm_readv(
                    pid,
                    ours.as_ptr(),
                    ours.len() as u64,
                    theirs.as_ptr(),
                    theirs.len() as u64,
                    0,
                )
            } else {
                libc::process_vm_writev(
                    pid,
                    ours.as_ptr(),
                    ours.len() as u64,
                    theirs.as_ptr(),
                    theirs.len() as u64,
                    0,
                )
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            let call = if write {
                "process_vm_readv"
            } else {
                "process_vm_writev"
            };
            return Err(match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EPERM) => Error::Unavailable {
                    backend: "cma".into(),
                    reason: format!("{call} towards process {pid}: {e} (ptrace restrictions)"),
                },
                _ => Error::invalid(format!("{call} towards process {pid}: {e}")),
            });
        }
        if n == 0 {
            return Err(Error::invalid(format!(
                "cma towards process {pid} moved nothing: its buffer is not mapped"
            )));
        }
        at.each(spans, n as u64, |_, _, _, _| {});
    }
}
