//! Threads that take shares of a job: the pool behind the shared copies ([`super::copy_spans`])
//! and the cma channel's multithreaded reads ([`crate::backend::cma::read_remote`]).
//!
//! A job is cut into shares that are claimed with one atomic increment each, by whoever comes
//! first: the caller, which posts the job and then works on it itself, and the pool's threads,
//! which take the job from a queue. The caller waits only for the shares a thread had already
//! claimed, so a busy pool (several callers at once) or a slow wake-up costs it nothing beyond
//! doing its shares alone.
//!
//! - **Threads** are started on demand, up to the most any caller asked for, and kept for the
//!   life of the process (as a global pool is: none is started per job). Idle, they sleep on a
//!   condition variable and cost nothing.
//! - **Fork.** A process forked from one whose threads had started has none of them (`fork`
//!   copies only the calling thread): its callers work alone and queue nothing.
//! - **Jobs** must not panic: a thread that panics in [`Work::work`] leaves its claimed share
//!   undone, and the caller waiting for it would wait for ever.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// A job that can be worked on by several threads at once.
pub(crate) trait Work: Send + Sync {
    /// Claims and does shares until none is left; returns how many this call did. Must not
    /// panic.
    fn work(&self) -> usize;
}

/// Threads that take shares of jobs (see the module docs).
pub(crate) struct Pool {
    /// The threads' name, followed by their number.
    name: &'static str,
    queue: Mutex<VecDeque<Arc<dyn Work>>>,
    ready: Condvar,
    /// Held while threads are started, so two callers do not both start the missing ones.
    starting: Mutex<()>,
    /// Threads that did start (a spawn can fail): jobs are queued only for them.
    running: AtomicUsize,
    /// The process that started them (0: none started yet): a child forked later has none of
    /// them, and queues nothing.
    owner: AtomicU32,
    /// Shares the threads have done (the tests' evidence that they take part).
    helped: AtomicUsize,
}

impl Pool {
    /// A pool with no thread yet; `name` names its threads.
    pub(crate) const fn new(name: &'static str) -> Pool {
        Pool {
            name,
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            starting: Mutex::new(()),
            running: AtomicUsize::new(0),
            owner: AtomicU32::new(0),
            helped: AtomicUsize::new(0),
        }
    }

    /// How many of this pool's threads may help a job of this process, after starting threads
    /// until `wanted` run (none are stopped when fewer are wanted): 0 in a child forked after
    /// they started, and fewer than `wanted` where a thread could not start.
    pub(crate) fn helpers(&'static self, wanted: usize) -> usize {
        let me = std::process::id();
        let owner = self.owner.load(Ordering::Acquire);
        if owner != 0 && owner != me {
            return 0;
        }
        let running = self.running.load(Ordering::Acquire);
        if running >= wanted {
            return running;
        }
        let _starting = self.starting.lock().unwrap_or_else(|p| p.into_inner());
        self.owner.store(me, Ordering::Release);
        let mut running = self.running.load(Ordering::Acquire);
        while running < wanted {
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{running}", self.name))
                .spawn(move || loop {
                    let n = self.take().work();
                    self.helped.fetch_add(n, Ordering::Relaxed);
                });
            match spawned {
                Ok(_) => {
                    running += 1;
                    self.running.store(running, Ordering::Release);
                }
                // Callers do every share no thread takes: fewer threads only slow jobs down,
                // and no job is queued for a thread that is not there.
                Err(e) => {
                    tracing::warn!("could not start {} thread {running}: {e}", self.name);
                    break;
                }
            }
        }
        running
    }

    /// Queues `job` for `threads` of the pool's threads (at most [`Pool::helpers`] of them),
    /// which then work on it as the caller does.
    pub(crate) fn offer(&self, job: &Arc<dyn Work>, threads: usize) {
        if threads == 0 {
            return;
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.extend(std::iter::repeat_n(job, threads).cloned());
        drop(q);
        for _ in 0..threads {
            self.ready.notify_one();
        }
    }

    /// Shares this pool's threads have done so far.
    pub(crate) fn helped(&self) -> usize {
        self.helped.load(Ordering::Relaxed)
    }

    /// Jobs queued and not yet taken by a thread.
    pub(crate) fn queued(&self) -> Option<usize> {
        self.queue.lock().ok().map(|q| q.len())
    }

    /// Whether the queue's lock is free (`None` where it is held), and if so how many jobs it
    /// holds: for a forked child, which must not wait on a lock a vanished thread held.
    pub(crate) fn try_queued(&self) -> Option<usize> {
        self.queue.try_lock().ok().map(|q| q.len())
    }

    /// Takes the next job, sleeping until there is one.
    fn take(&self) -> Arc<dyn Work> {
        // A thread panics only inside a job, which must not panic; a poisoned queue is still a
        // valid queue.
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(job) = q.pop_front() {
                return job;
            }
            q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Runs `work` in a child forked from this process once `pool`'s threads have taken every job
/// (and sleep): panics unless the child's `work` says its result is right and the child queued
/// no job for the threads it does not have. The tests of the pool's users call it after a job
/// of theirs has started the threads (and tests/host.rs's cma trials, through
/// `backend::cma::testing`).
pub(crate) fn check_in_forked_child(pool: &Pool, work: impl FnOnce() -> bool) {
    while pool.queued().unwrap_or(1) > 0 {
        std::thread::yield_now();
    }
    // SAFETY: the child only runs `work`, checks and exits (`_exit`, no unwinding or atexit).
    match unsafe { libc::fork() } {
        0 => {
            let code = if !work() {
                1
            } else {
                match pool.try_queued() {
                    Some(0) => 0,
                    Some(_) => 2,
                    // A thread held the lock at the fork (a spurious wake-up): the queue cannot
                    // be read here.
                    None => 3,
                }
            };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) }
        }
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        child => {
            let mut status = 0;
            // SAFETY: waits for our own child; `status` outlives the call.
            let r = unsafe { libc::waitpid(child, &mut status, 0) };
            assert_eq!(r, child);
            assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
            match libc::WEXITSTATUS(status) {
                0 => {}
                3 => eprintln!("the queue's lock was held at the fork: not checked"),
                1 => panic!("the child's work went wrong"),
                c => panic!("the child queued jobs for threads it does not have ({c})"),
            }
        }
    }
}
