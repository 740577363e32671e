//! The multi-socket TCP baseline with one thread per socket on each side, so that it shows
//! what the machine can do over N sockets, not what one thread can do.
//!
//! Each socket gets a plain blocking thread. Client: per round trip every lane thread writes
//! its stripe and reads it back. Server: every lane thread reads its stripe, all meet at a gate
//! (the whole message is in), then each writes its stripe back.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A barrier that can be called off, so that one lane's failure frees the others.
struct Gate {
    lanes: usize,
    /// Arrived at this generation, the generation, called off.
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Gate {
    fn new(lanes: usize) -> Gate {
        Gate {
            lanes,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// Waits for every lane; `false` if the gate was called off.
    fn pass(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.2 {
            return false;
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.lanes {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return true;
        }
        while s.1 == generation && !s.2 {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.1 != generation
    }

    fn call_off(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

fn blocking(sock: tokio::net::TcpStream) -> io::Result<TcpStream> {
    let s = sock.into_std()?;
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Serves one session over `socks` (one stripe each) until the client hangs up.
pub fn echo(socks: Vec<tokio::net::TcpStream>, plan: &[(usize, usize)]) -> io::Result<()> {
    let gate = Arc::new(Gate::new(socks.len()));
    let mut threads = Vec::new();
    for (sock, &(_, len)) in socks.into_iter().zip(plan) {
        let mut sock = blocking(sock)?;
        let gate = gate.clone();
        threads.push(std::thread::spawn(move || -> io::Result<()> {
            let mut buf = vec![0u8; len];
            let r = (|| loop {
                match sock.read_exact(&mut buf) {
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                    r => r?,
                }
                if !gate.pass() {
                    return Ok(());
                }
                sock.write_all(&buf)?;
            })();
            gate.call_off();
            r
        }));
    }
    let mut result = Ok(());
    for t in threads {
        let r = t
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("lane thread panicked")));
        result = result.and(r);
    }
    result
}

enum Command {
    /// One round trip of this lane's stripe.
    Trip,
    /// Compare what came back with what went out.
    Verify,
}

/// The client's lane threads, each with its socket and its stripe.
pub struct LaneThreads {
    go: Vec<mpsc::Sender<Command>>,
    done: mpsc::Receiver<io::Result<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl LaneThreads {
    /// One thread per socket; `out` is the whole message, cut along `plan`.
    pub fn start(
        socks: Vec<tokio::net::TcpStream>,
        plan: &[(usize, usize)],
        out: &[u8],
    ) -> io::Result<LaneThreads> {
        let (done_tx, done) = mpsc::channel();
        let mut go = Vec::new();
        let mut threads = Vec::new();
        for (sock, &(offset, len)) in socks.into_iter().zip(plan) {
            let mut sock = blocking(sock)?;
            let stripe = out[offset..offset + len].to_vec();
            let (tx, rx) = mpsc::channel();
            let done_tx = done_tx.clone();
            go.push(tx);
            threads.push(std::thread::spawn(move || {
                let mut back = vec![0u8; stripe.len()];
                while let Ok(c) = rx.recv() {
                    let r = match c {
                        Command::Trip => sock
                            .write_all(&stripe)
                            .and_then(|()| sock.read_exact(&mut back)),
                        Command::Verify if back == stripe => Ok(()),
                        Command::Verify => Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "tcp baseline: the echo differs from what was sent",
                        )),
                    };
                    if done_tx.send(r).is_err() {
                        return;
                    }
                }
            }));
        }
        Ok(LaneThreads { go, done, threads })
    }

    fn all(&self, command: fn() -> Command, limit: Duration) -> io::Result<()> {
        for g in &self.go {
            g.send(command())
                .map_err(|_| io::Error::other("tcp baseline: a lane thread stopped"))?;
        }
        let mut result = Ok(());
        for _ in &self.go {
            let r = self.done.recv_timeout(limit).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("tcp baseline: no echo within {limit:?}"),
                )
            })?;
            result = result.and(r);
        }
        result
    }

    /// One round trip on every lane at once.
    pub fn trip(&self, limit: Duration) -> io::Result<()> {
        self.all(|| Command::Trip, limit)
    }

    /// Whether every lane got back what it sent.
    pub fn verify(&self, limit: Duration) -> io::Result<()> {
        self.all(|| Command::Verify, limit)
    }
}

impl Drop for LaneThreads {
    fn drop(&mut self) {
        // Closing the command queues ends each thread after its current round trip; a thread
        // stuck on a dead server is left to the process's end rather than waited for.
        self.go.clear();
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}
