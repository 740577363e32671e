//! The I/O pool: a few threads on which a channel's own connections (mpt's lanes, all but a
//! pipe's first) run their read and write loops, so that a channel striped over several
//! connections uses several cores.
//!
//! Each thread is an actix [`Arbiter`]: one OS thread running a tokio current-thread runtime.
//! Lanes are handed out round robin, so the lanes of one pipe land on different threads, and a
//! lane's two loops stay on the thread it got for its whole life; its socket is registered with
//! that thread's reactor ([`IoThread::runtime`], `transport::tcp::rehome`). Only the loops
//! move: the pipe and channel actors stay on the context's arbiter and remain the single owners
//! of ordering (tickets are taken there, completions come back through their queues).
//!
//! The pool starts its threads on first use and stops them when the last holder (the context's
//! [`Config`](super::context::Config) and every loop running on it) is gone: a loop holds the
//! pool until it has failed or completed every operation it was given, even after its
//! connection actor has stopped. With no threads (`ContextBuilder::io_threads(0)`, and the
//! default on 2 cores or fewer: [`default_threads`]), every loop runs on the context's arbiter.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use actix::{Arbiter, ArbiterHandle};

/// The default number of I/O threads for a machine with `cores` CPUs: none on 2 cores or
/// fewer (a second thread there only adds cross-thread wake-ups to every lane operation), half
/// the cores above that, at most 16.
pub fn default_threads(cores: usize) -> usize {
    if cores <= 2 {
        0
    } else {
        (cores / 2).min(16)
    }
}

/// The CPUs this process may run on.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A fixed set of I/O threads, started on first use.
pub struct IoPool {
    size: usize,
    threads: Mutex<Vec<(Arbiter, tokio::runtime::Handle)>>,
    next: AtomicUsize,
}

/// One thread of the pool: where to spawn, and its runtime (whose reactor a socket can be
/// registered with, so that the thread hears about its readiness itself).
#[derive(Debug, Clone)]
pub struct IoThread {
    /// Spawns onto the thread.
    pub arbiter: ArbiterHandle,
    /// The thread's tokio runtime.
    pub runtime: tokio::runtime::Handle,
}

/// Starts an arbiter and fetches its runtime's handle (waits for the thread to run once).
fn start_thread() -> (Arbiter, tokio::runtime::Handle) {
    let arbiter = Arbiter::new();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    arbiter.spawn_fn(move || {
        let _ = tx.send(tokio::runtime::Handle::current());
    });
    let runtime = rx
        .recv()
        .expect("a new arbiter runs what is spawned on it first");
    (arbiter, runtime)
}

impl std::fmt::Debug for IoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoPool")
            .field("size", &self.size)
            .field("started", &self.started())
            .finish()
    }
}

impl IoPool {
    /// A pool of `size` threads (none started yet).
    pub fn new(size: usize) -> IoPool {
        IoPool {
            size,
            threads: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
        }
    }

    /// The number of threads it runs once started.
    pub fn size(&self) -> usize {
        self.size
    }

    /// How many of its threads have started.
    pub fn started(&self) -> usize {
        self.threads.lock().map_or(0, |t| t.len())
    }

    /// The thread for the next connection, round robin, starting it if needed; `None` when the
    /// pool has no threads (the caller runs the loops on its own arbiter). Must be called
    /// inside an actix `System`.
    pub fn next(&self) -> Option<IoThread> {
        if self.size == 0 {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.size;
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        while threads.len() <= i {
            threads.push(start_thread());
        }
        let (arbiter, runtime) = &threads[i];
        Some(IoThread {
            arbiter: arbiter.handle(),
            runtime: runtime.clone(),
        })
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        let threads = self.threads.get_mut().unwrap_or_else(|p| p.into_inner());
        for (t, _) in threads.drain(..) {
            // Each thread finishes what it is running and exits; its tasks (the loops of
            // connections already stopped) are dropped.
            t.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_machine_gets_no_pool() {
        assert_eq!(default_threads(1), 0);
        assert_eq!(default_threads(2), 0);
        assert_eq!(default_threads(4), 2);
        assert_eq!(default_threads(16), 8);
        assert_eq!(default_threads(192), 16);
    }

    #[test]
    fn threads_are_handed_out_round_robin_and_started_lazily() {
        actix::System::new().block_on(async {
            let none = IoPool::new(0);
            assert!(none.next().is_none());
            let pool = IoPool::new(3);
            assert_eq!(pool.started(), 0);
            let mut ids = Vec::new();
            for _ in 0..6 {
                let (tx, rx) = std::sync::mpsc::channel();
                assert!(pool.next().expect("a thread").arbiter.spawn_fn(move || {
                    let _ = tx.send(std::thread::current().id());
                }));
                ids.push(rx.recv().unwrap());
            }
            assert_eq!(pool.started(), 3);
            assert_ne!(ids[0], ids[1]);
            assert_ne!(ids[1], ids[2]);
            assert_ne!(ids[0], ids[2]);
            assert_eq!(ids[..3], ids[3..]);
            assert!(!ids.contains(&std::thread::current().id()));
        });
    }
}
