//! Raw baselines: the same round trips with no actorpipe code on their path, measured in the
//! same run as the runtime, so that every figure sits next to the limit of the same machine.
//!
//! | actorpipe path | baseline |
//! | --- | --- |
//! | `tcp` transport, `basic` channel over tcp | tokio TCP ping-pong, one socket |
//! | `mpt` channel | TCP ping-pong over `lanes` sockets, a stripe each, one thread per socket |
//! | `shm` transport, `basic` channel over shm | two memfd rings + eventfds between two processes |
//! | `cma` channel | `process_vm_readv` of the size, twice per round trip |
//! | `xth` channel, and the same-host ceiling | single-thread `memcpy`, twice per round trip |

pub mod cma;
mod lanes;
pub mod shm;
pub mod tcp;

use std::io;
use std::time::{Duration, Instant};

use crate::measure::{pattern, Counts, Samples};
use crate::report::Progress;

/// Which raw path a run is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// TCP ping-pong over this many sockets.
    Tcp {
        /// Sockets (1: a single stream).
        lanes: u32,
    },
    /// The memfd ring pair.
    ShmRing,
    /// `process_vm_readv`.
    Cma,
    /// `memcpy` in one thread.
    Memcpy,
}

impl Baseline {
    /// The baseline of a channel carried by a pipe on `transport`.
    pub fn for_channel(channel: &str, transport: &str, lanes: u32) -> Baseline {
        match channel {
            "mpt" => Baseline::Tcp { lanes },
            "cma" => Baseline::Cma,
            "xth" => Baseline::Memcpy,
            _ => Baseline::for_transport(transport),
        }
    }

    /// The baseline of a transport.
    pub fn for_transport(transport: &str) -> Baseline {
        match transport {
            "shm" => Baseline::ShmRing,
            _ => Baseline::Tcp { lanes: 1 },
        }
    }

    /// What it measures, in a few words.
    pub fn describe(&self) -> String {
        match self {
            Baseline::Tcp { lanes: 1 } => "tokio TCP ping-pong, 1 socket".into(),
            Baseline::Tcp { lanes } => {
                format!("TCP ping-pong, {lanes} sockets in parallel (1/{lanes} of the bytes each, one thread per socket)")
            }
            Baseline::ShmRing => {
                "memfd ring + eventfd ping-pong between two processes (blocking threads)".into()
            }
            Baseline::Cma => "process_vm_readv of the size, 2 per round trip, 1 thread".into(),
            Baseline::Memcpy => "memcpy of the size, 2 per round trip, 1 thread".into(),
        }
    }

    /// A short name for JSON.
    pub fn name(&self) -> String {
        match self {
            Baseline::Tcp { lanes } => format!("tcp-{lanes}"),
            Baseline::ShmRing => "shm-ring".into(),
            Baseline::Cma => "process_vm_readv".into(),
            Baseline::Memcpy => "memcpy".into(),
        }
    }
}

/// The client side of a baseline, ready to measure.
pub enum BaselineClient {
    /// TCP ping-pong.
    Tcp(tcp::TcpClient),
    /// The memfd ring pair.
    Shm(shm::ShmClient),
    /// Reads from the server's exposed buffer.
    Cma(cma::CmaClient),
    /// In-process copies.
    Memcpy(Memcpy),
}

impl BaselineClient {
    /// Round trips of `size` bytes.
    pub fn measure(
        &mut self,
        size: u64,
        counts: Counts,
        progress: &Progress,
    ) -> io::Result<Samples> {
        match self {
            BaselineClient::Tcp(c) => c.measure(size, counts, progress),
            BaselineClient::Shm(c) => c.measure(size, counts, progress),
            BaselineClient::Cma(c) => c.measure(size, counts, progress),
            BaselineClient::Memcpy(m) => Ok(m.measure(size, counts, progress)),
        }
    }
}

/// Two buffers for single-thread copies, kept between calls of one size.
#[derive(Debug, Default)]
pub struct Memcpy {
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Memcpy {
    /// Round trips of two copies of `size` bytes (there and back), after faulting both buffers
    /// in.
    pub fn measure(&mut self, size: u64, counts: Counts, progress: &Progress) -> Samples {
        if self.a.len() as u64 != size {
            self.a = pattern(size as usize, size);
            self.b = vec![1u8; size as usize];
        }
        let (a, b) = (&mut self.a, &mut self.b);
        let mut samples = Samples::with_capacity(counts.iters as usize);
        for i in 0..counts.total() {
            let start = Instant::now();
            b.copy_from_slice(std::hint::black_box(a));
            a.copy_from_slice(std::hint::black_box(b));
            std::hint::black_box((&a, &b));
            let took = start.elapsed();
            if i >= counts.warmup {
                samples.push(took);
            }
            progress.inc();
        }
        samples
    }
}

/// The same-host ceiling for one size: the p50 of memcpy round trips, not on the progress bar.
pub fn ceiling(size: u64, counts: Counts) -> Duration {
    let samples = Memcpy::default().measure(size, counts, &Progress::hidden());
    crate::measure::Summary::of(&samples).map_or(Duration::ZERO, |s| s.p50)
}
