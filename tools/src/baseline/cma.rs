//! Raw cross-memory attach, with no actorpipe code on the path: the server exposes a buffer
//! (it prints its pid, address and length), the client copies from it with `process_vm_readv`
//! on one thread. A round trip is two reads of the message size: the way there and the way back
//! of an echo, each done by the receiving side, as the `cma` channel does.

use std::io;
use std::time::Instant;

use crate::measure::{pattern, Counts, Samples};
use crate::report::Progress;

/// Where the server's buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exposed {
    /// The server's process id.
    pub pid: u32,
    /// Address of the buffer in the server.
    pub addr: u64,
    /// Its length.
    pub len: u64,
}

impl Exposed {
    /// The `pid addr len` line the server prints.
    pub fn to_line(self) -> String {
        format!("{} {:#x} {}", self.pid, self.addr, self.len)
    }

    /// Parses what [`to_line`](Self::to_line) wrote.
    pub fn parse(line: &str) -> Option<Exposed> {
        let mut words = line.split_whitespace();
        let pid = words.next()?.parse().ok()?;
        let addr = u64::from_str_radix(words.next()?.strip_prefix("0x")?, 16).ok()?;
        let len = words.next()?.parse().ok()?;
        Some(Exposed { pid, addr, len })
    }
}

/// Fills a buffer of `len` bytes and keeps it for the life of the process.
pub fn expose(len: u64) -> Exposed {
    let buf: &'static mut [u8] = Vec::leak(pattern(len as usize, len));
    Exposed {
        pid: std::process::id(),
        addr: buf.as_ptr() as u64,
        len,
    }
}

/// Copies `dst.len()` bytes from `from` into `dst`, in as many calls as the kernel needs.
fn read_remote(from: Exposed, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let local = libc::iovec {
            // SAFETY: stays inside `dst`.
            iov_base: unsafe { dst.as_mut_ptr().add(done) }.cast(),
            iov_len: dst.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (from.addr as usize + done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` points into memory we own exclusively; the kernel validates `remote`.
        let n =
            unsafe { libc::process_vm_readv(from.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("process_vm_readv: {e}")));
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv copied nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// The client side: the server's buffer, and ours (kept between calls of one size).
pub struct CmaClient {
    from: Exposed,
    dst: Vec<u8>,
}

impl CmaClient {
    /// A client of the buffer the server exposed.
    pub fn new(from: Exposed) -> CmaClient {
        CmaClient {
            from,
            dst: Vec::new(),
        }
    }

    /// Round trips (two reads each) of `size` bytes from the server's buffer.
    pub fn measure(
        &mut self,
        size: u64,
        counts: Counts,
        progress: &Progress,
    ) -> io::Result<Samples> {
        if self.dst.len() as u64 != size {
            // Faulted in once, like a reused receive buffer.
            self.dst = vec![1u8; size as usize];
        }
        measure(self.from, &mut self.dst, counts, progress)
    }
}

/// Round trips (two reads each) of `dst.len()` bytes from the server's buffer.
fn measure(
    from: Exposed,
    dst: &mut [u8],
    counts: Counts,
    progress: &Progress,
) -> io::Result<Samples> {
    let size = dst.len() as u64;
    if size > from.len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "cma baseline: the server exposes {} bytes, {size} wanted",
                from.len
            ),
        ));
    }
    let mut samples = Samples::with_capacity(counts.iters as usize);
    for i in 0..counts.total() {
        let start = Instant::now();
        read_remote(from, dst)?;
        read_remote(from, dst)?;
        let took = start.elapsed();
        if i >= counts.warmup {
            samples.push(took);
        }
        progress.inc();
    }
    if dst[..] != pattern(from.len as usize, from.len)[..size as usize] {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "cma baseline: the bytes read differ from the server's",
        ));
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_line_round_trips() {
        let e = Exposed {
            pid: 42,
            addr: 0x7f00_dead_b000,
            len: 64 << 20,
        };
        assert_eq!(Exposed::parse(&e.to_line()), Some(e));
        assert_eq!(Exposed::parse("42 123 9"), None);
    }
}
