//! Raw shared-memory ping-pong between two processes, with no actorpipe code on the path: two
//! single-producer single-consumer byte rings in memfds (one per direction) and four eventfd
//! doorbells, driven by plain blocking threads.
//!
//! The parent creates everything before it spawns the server, without `FD_CLOEXEC`, and passes
//! the descriptor numbers in argv (`--shm-fds`); the child inherits them. Each ring is a header
//! page (head, tail and two waiting flags, each on its own 128-byte line) and a data area of the
//! same size as the shm transport's default ring. Parking follows the same rule as the
//! transport: a side with nothing to do spins for `--spin` if asked, sets its waiting flag,
//! checks again, and sleeps on its doorbell; the other side rings only if it finds the flag set.
//! Every message carries an 8-byte length in front, so the server echoes any size.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::measure::{pattern, Counts, Samples};
use crate::report::Progress;

/// Data bytes per ring: the shm transport's default, so both stream large messages alike.
pub const CAPACITY: usize = actorpipe::internal::backend::shm::ring::DEFAULT_CAPACITY;
const HEADER: usize = 4096;

/// How long the client waits on a doorbell before it decides the server is gone (the server
/// waits for ever: the client may be busy measuring something else).
const PEER_LIMIT: Duration = Duration::from_secs(60);

/// Keeps the producer's and the consumer's fields on separate cache-line pairs.
#[repr(C, align(128))]
struct Line<T>(T);

#[repr(C)]
struct Header {
    head: Line<AtomicU64>,
    tail: Line<AtomicU64>,
    reader_waiting: Line<AtomicU32>,
    writer_waiting: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

fn last_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The six descriptors of a ring pair, in argv order: the two memfds (client to server, server
/// to client), then the doorbells: data and space of the first ring, data and space of the
/// second.
pub struct RingFds {
    fds: Vec<OwnedFd>,
}

impl RingFds {
    /// Creates the memfds and eventfds, inheritable by a child process.
    pub fn create() -> io::Result<RingFds> {
        let mut fds = Vec::with_capacity(6);
        for name in [c"baseline-up", c"baseline-down"] {
            // SAFETY: `name` is NUL-terminated; flags 0 leave the descriptor inheritable.
            let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
            if fd < 0 {
                return Err(last_error("memfd_create"));
            }
            // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: plain syscall on a descriptor we own.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), (HEADER + CAPACITY) as libc::off_t) } < 0 {
                return Err(last_error("ftruncate"));
            }
            fds.push(fd);
        }
        for _ in 0..4 {
            // SAFETY: plain syscall; flags 0 leave the descriptor blocking and inheritable.
            let fd = unsafe { libc::eventfd(0, 0) };
            if fd < 0 {
                return Err(last_error("eventfd"));
            }
            // SAFETY: eventfd returned a fresh descriptor that nothing else owns.
            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        Ok(RingFds { fds })
    }

    /// The descriptor numbers, for `--shm-fds`.
    pub fn to_arg(&self) -> String {
        let numbers: Vec<String> = self.fds.iter().map(|f| f.as_raw_fd().to_string()).collect();
        numbers.join(",")
    }

    /// Takes over the descriptors named by `--shm-fds` (inherited from the parent).
    pub fn from_arg(text: &str) -> Result<RingFds, String> {
        let numbers: Vec<RawFd> = text
            .split(',')
            .map(|n| {
                n.trim()
                    .parse::<RawFd>()
                    .map_err(|_| format!("bad --shm-fds {text:?}"))
            })
            .collect::<Result<_, _>>()?;
        if numbers.len() != 6 {
            return Err(format!(
                "--shm-fds wants 6 descriptors, got {}",
                numbers.len()
            ));
        }
        let mut fds = Vec::with_capacity(6);
        for n in numbers {
            // SAFETY: F_GETFD only inspects the descriptor table.
            if n < 3 || unsafe { libc::fcntl(n, libc::F_GETFD) } < 0 {
                return Err(format!(
                    "--shm-fds: descriptor {n} is not open in this process"
                ));
            }
            // SAFETY: the parent passed us this inherited descriptor and nothing else here uses it.
            fds.push(unsafe { OwnedFd::from_raw_fd(n) });
        }
        Ok(RingFds { fds })
    }
}

/// One ring mapped into this process.
struct Ring {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics and raw copies.
unsafe impl Send for Ring {}

impl Ring {
    fn map(fd: &OwnedFd) -> io::Result<Ring> {
        let len = HEADER + CAPACITY;
        // SAFETY: fstat fills `st`, which is plain data.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 || st.st_size as usize != len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "shm baseline: the ring descriptor is not a ring of the expected size",
            ));
        }
        // SAFETY: a fresh shared mapping of the whole file; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(last_error("mmap"));
        }
        Ok(Ring {
            base: base.cast(),
            len,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a page that holds the header, zeroed by ftruncate
        // (a valid state for atomics), and lives as long as `self`.
        unsafe { &*(self.base as *const Header) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: HEADER < len.
        unsafe { self.base.add(HEADER) }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; nothing refers to it any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// An eventfd doorbell.
struct Bell(OwnedFd);

impl Bell {
    fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Sleeps until rung (and resets it), or fails after `limit`.
    fn wait(&self, limit: Option<Duration>) -> io::Result<()> {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let timeout = limit.map_or(-1, |l| l.as_millis() as libc::c_int);
        // SAFETY: one pollfd, alive for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout) };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("shm baseline: the server did not answer within {PEER_LIMIT:?}"),
            ));
        }
        let mut count = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer from our eventfd.
        if unsafe { libc::read(self.0.as_raw_fd(), count.as_mut_ptr().cast(), 8) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }
}

/// How a side waits: spinning first or not, giving up after a while or not.
#[derive(Debug, Clone, Copy)]
struct Pace {
    spin: Option<Duration>,
    limit: Option<Duration>,
}

/// Waits until `ready()`: spin first if asked, then set the flag, check again and sleep.
fn park(flag: &AtomicU32, bell: &Bell, pace: Pace, ready: impl Fn() -> bool) -> io::Result<()> {
    if let Some(spin) = pace.spin {
        let start = Instant::now();
        while start.elapsed() < spin {
            for _ in 0..64 {
                if ready() {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
    }
    flag.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if ready() {
        flag.store(0, Ordering::Relaxed);
        return Ok(());
    }
    bell.wait(pace.limit)
}

/// Rings `bell` if the other side said it is asleep.
fn wake(flag: &AtomicU32, bell: &Bell) {
    fence(Ordering::SeqCst);
    if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::SeqCst) != 0 {
        bell.ring();
    }
}

/// The producing end of a ring.
struct Tx {
    ring: Ring,
    head: u64,
    /// Rung for the consumer when data arrives while it sleeps.
    data: Bell,
    /// Slept on while the ring is full.
    space: Bell,
}

impl Tx {
    /// Copies every part into the ring, publishing as it goes.
    fn send(&mut self, parts: &[&[u8]], pace: Pace) -> io::Result<()> {
        let cap = CAPACITY as u64;
        for part in parts {
            let mut done = 0;
            while done < part.len() {
                let h = self.ring.header();
                let free = cap - (self.head - h.tail.0.load(Ordering::Acquire));
                if free == 0 {
                    self.publish();
                    let (ring, head) = (&self.ring, self.head);
                    park(&h.writer_waiting.0, &self.space, pace, || {
                        cap - (head - ring.header().tail.0.load(Ordering::Acquire)) > 0
                    })?;
                    continue;
                }
                let slot = (self.head % cap) as usize;
                let n = (free as usize).min(part.len() - done).min(CAPACITY - slot);
                // SAFETY: `slot + n <= CAPACITY` lies in the data area, which the consumer does
                // not read until `head` is published.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        part.as_ptr().add(done),
                        self.ring.data().add(slot),
                        n,
                    )
                };
                self.head += n as u64;
                done += n;
            }
        }
        self.publish();
        Ok(())
    }

    fn publish(&self) {
        let h = self.ring.header();
        h.head.0.store(self.head, Ordering::Release);
        wake(&h.reader_waiting.0, &self.data);
    }
}

/// The consuming end of a ring.
struct Rx {
    ring: Ring,
    tail: u64,
    /// Slept on while the ring is empty.
    data: Bell,
    /// Rung for the producer when space frees while it sleeps.
    space: Bell,
}

impl Rx {
    /// Fills `out` from the ring.
    fn recv(&mut self, out: &mut [u8], pace: Pace) -> io::Result<()> {
        let cap = CAPACITY as u64;
        let mut done = 0;
        while done < out.len() {
            let h = self.ring.header();
            let ready = h.head.0.load(Ordering::Acquire) - self.tail;
            if ready == 0 {
                let (ring, tail) = (&self.ring, self.tail);
                park(&h.reader_waiting.0, &self.data, pace, || {
                    ring.header().head.0.load(Ordering::Acquire) != tail
                })?;
                continue;
            }
            let slot = (self.tail % cap) as usize;
            let n = (ready.min(cap) as usize)
                .min(out.len() - done)
                .min(CAPACITY - slot);
            // SAFETY: the producer published these bytes and will not touch them until `tail`
            // moves past them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ring.data().add(slot),
                    out.as_mut_ptr().add(done),
                    n,
                )
            };
            self.tail += n as u64;
            done += n;
            h.tail.0.store(self.tail, Ordering::Release);
            wake(&h.writer_waiting.0, &self.space);
        }
        Ok(())
    }
}

/// One side of the ring pair: it sends on one ring and receives on the other.
pub struct End {
    tx: Tx,
    rx: Rx,
    pace: Pace,
}

impl End {
    fn new(fds: RingFds, client: bool, spin: Option<Duration>) -> io::Result<End> {
        let pace = Pace {
            spin,
            limit: client.then_some(PEER_LIMIT),
        };
        let mut it = fds.fds.into_iter();
        let mut next = || it.next().expect("six descriptors");
        let (up, down) = (Ring::map(&next())?, Ring::map(&next())?);
        let (up_data, up_space) = (Bell(next()), Bell(next()));
        let (down_data, down_space) = (Bell(next()), Bell(next()));
        Ok(if client {
            End {
                tx: Tx {
                    ring: up,
                    head: 0,
                    data: up_data,
                    space: up_space,
                },
                rx: Rx {
                    ring: down,
                    tail: 0,
                    data: down_data,
                    space: down_space,
                },
                pace,
            }
        } else {
            End {
                tx: Tx {
                    ring: down,
                    head: 0,
                    data: down_data,
                    space: down_space,
                },
                rx: Rx {
                    ring: up,
                    tail: 0,
                    data: up_data,
                    space: up_space,
                },
                pace,
            }
        })
    }

    fn send(&mut self, body: &[u8]) -> io::Result<()> {
        let len = (body.len() as u64).to_le_bytes();
        self.tx.send(&[&len, body], self.pace)
    }

    fn recv_len(&mut self) -> io::Result<u64> {
        let mut len = [0u8; 8];
        self.rx.recv(&mut len, self.pace)?;
        Ok(u64::from_le_bytes(len))
    }
}

/// Starts the echo server on its own thread, over descriptors inherited from the client.
pub fn spawn_server(fds: RingFds, spin: Option<Duration>) -> io::Result<()> {
    let mut end = End::new(fds, false, spin)?;
    std::thread::Builder::new()
        .name("shm-baseline".into())
        .spawn(move || {
            let mut buf = Vec::new();
            let result = (|| -> io::Result<()> {
                loop {
                    let len = end.recv_len()?;
                    if len > crate::units::MAX_SIZE {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad length"));
                    }
                    buf.resize(len as usize, 0);
                    end.rx.recv(&mut buf, end.pace)?;
                    end.send(&buf)?;
                }
            })();
            if let Err(e) = result {
                eprintln!("shm baseline server: {e}");
            }
        })?;
    Ok(())
}

/// The client side of the ring pair.
pub struct ShmClient {
    end: End,
    /// The size being measured and its buffers (sent, echoed), kept between calls.
    buffers: Option<(u64, Vec<u8>, Vec<u8>)>,
}

impl ShmClient {
    /// Maps the rings this process created (and handed to the server).
    pub fn new(fds: RingFds, spin: Option<Duration>) -> io::Result<ShmClient> {
        Ok(ShmClient {
            end: End::new(fds, true, spin)?,
            buffers: None,
        })
    }

    /// Round trips of `size` bytes.
    pub fn measure(
        &mut self,
        size: u64,
        counts: Counts,
        progress: &Progress,
    ) -> io::Result<Samples> {
        let (_, out, mut back) = match self.buffers.take() {
            Some(b) if b.0 == size => b,
            _ => (size, pattern(size as usize, size), vec![0u8; size as usize]),
        };
        let mut samples = Samples::with_capacity(counts.iters as usize);
        for i in 0..counts.total() {
            let start = Instant::now();
            self.end.send(&out)?;
            let len = self.end.recv_len()?;
            if len != size {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("shm baseline: echo of {len} bytes for {size}"),
                ));
            }
            self.end.rx.recv(&mut back, self.end.pace)?;
            let took = start.elapsed();
            if i >= counts.warmup {
                samples.push(took);
            }
            progress.inc();
        }
        if back != out {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shm baseline: the echo differs from what was sent",
            ));
        }
        self.buffers = Some((size, out, back));
        Ok(samples)
    }
}
