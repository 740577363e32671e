//! Raw TCP ping-pong over N sockets on tokio, with no actorpipe code on the path.
//!
//! N = 1 is the single-stream baseline of the `tcp` transport and the `basic` channel; N = lanes
//! is the baseline of `mpt`, each socket carrying one stripe of every message. As in `mpt`,
//! messages under 64 KiB per stripe use fewer sockets (a 64 B message goes whole over one).
//!
//! A session opens with a 16-byte hello on every socket: lanes (u32), lane index (u32) and
//! message size (u64), little endian. Then, per round trip, the client writes every stripe at
//! once; the server reads every stripe, then writes every stripe back; the client reads them.
//! One socket runs on a current-thread runtime on each side, as an actorpipe context does;
//! several run one blocking thread per socket on each side ([`super::lanes`]), so that the
//! baseline of `mpt` shows what the machine can do over N sockets, not what one thread can.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

use crate::measure::{pattern, Counts, Samples};
use crate::report::Progress;

/// Stripes below this size are not split further (the same rule as the `mpt` channel).
pub const MIN_STRIPE: u64 = 64 << 10;

const HELLO: usize = 16;

/// How long one round trip may take before the baseline gives up on the server.
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(60);

/// Contiguous `(offset, length)` stripes of a `size`-byte message over at most `lanes` sockets.
pub fn stripes(size: u64, lanes: u32) -> Vec<(usize, usize)> {
    let lanes = (lanes.max(1) as u64).min(size.div_ceil(MIN_STRIPE)).max(1);
    let per = size.div_ceil(lanes).max(1);
    (0..lanes)
        .map(|i| i * per)
        .filter(|&offset| offset < size)
        .map(|offset| (offset as usize, per.min(size - offset) as usize))
        .collect()
}

/// Splits `buf` into the disjoint pieces named by `stripes` (which are contiguous, in order).
fn pieces<'a>(mut buf: &'a mut [u8], stripes: &[(usize, usize)]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(stripes.len());
    for &(_, len) in stripes {
        let (piece, rest) = std::mem::take(&mut buf).split_at_mut(len);
        out.push(piece);
        buf = rest;
    }
    out
}

/// Polls every future until all are done or one fails.
async fn join_all<F: Future<Output = io::Result<()>>>(futures: Vec<F>) -> io::Result<()> {
    let mut futures: Vec<Option<Pin<Box<F>>>> =
        futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for slot in futures.iter_mut() {
            let Some(f) = slot else { continue };
            match f.as_mut().poll(cx) {
                Poll::Ready(Ok(())) => *slot = None,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    })
    .await
}

/// Reads every stripe of `buf`, one per socket, concurrently (directly when there is one).
async fn read_stripes(
    socks: &mut [TcpStream],
    buf: &mut [u8],
    stripes: &[(usize, usize)],
) -> io::Result<()> {
    if let [sock] = socks {
        return sock.read_exact(buf).await.map(drop);
    }
    let reads = socks
        .iter_mut()
        .zip(pieces(buf, stripes))
        .map(|(s, piece)| async move { s.read_exact(piece).await.map(drop) })
        .collect();
    join_all(reads).await
}

/// Writes every stripe of `buf`, one per socket, concurrently (directly when there is one).
async fn write_stripes(
    socks: &mut [TcpStream],
    buf: &mut [u8],
    stripes: &[(usize, usize)],
) -> io::Result<()> {
    if let [sock] = socks {
        return sock.write_all(buf).await;
    }
    let writes = socks
        .iter_mut()
        .zip(pieces(buf, stripes))
        .map(|(s, piece)| async move { s.write_all(piece).await })
        .collect();
    join_all(writes).await
}

fn runtime() -> io::Result<Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// Starts the echo server on its own thread; returns the address it is bound to.
pub fn spawn_server(bind: SocketAddr) -> io::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(bind)?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let rt = runtime()?;
    std::thread::Builder::new()
        .name("tcp-baseline".into())
        .spawn(move || {
            rt.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(l) => serve(l).await,
                    Err(e) => eprintln!("tcp baseline server: {e}"),
                }
            })
        })?;
    Ok(addr)
}

async fn accept_lane(listener: &TcpListener) -> io::Result<(TcpStream, u32, u64)> {
    let (mut sock, _) = listener.accept().await?;
    sock.set_nodelay(true)?;
    let mut hello = [0u8; HELLO];
    sock.read_exact(&mut hello).await?;
    let lanes = u32::from_le_bytes(hello[..4].try_into().expect("4 bytes"));
    let size = u64::from_le_bytes(hello[8..].try_into().expect("8 bytes"));
    Ok((sock, lanes, size))
}

/// Serves one session at a time, for ever.
async fn serve(listener: TcpListener) {
    loop {
        let session = async {
            let (first, lanes, size) = accept_lane(&listener).await?;
            if !(1..=1024).contains(&lanes) || size == 0 || size > crate::units::MAX_SIZE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad hello: {lanes} lanes, {size} bytes"),
                ));
            }
            let mut socks = vec![first];
            while socks.len() < lanes as usize {
                socks.push(accept_lane(&listener).await?.0);
            }
            echo(socks, size).await
        };
        if let Err(e) = session.await {
            eprintln!("tcp baseline server: session ended: {e}");
        }
    }
}

/// Echoes round trips until the client hangs up.
async fn echo(mut socks: Vec<TcpStream>, size: u64) -> io::Result<()> {
    let plan = stripes(size, socks.len() as u32);
    if socks.len() > 1 {
        // This thread serves one session at a time: it waits for the lane threads.
        return super::lanes::echo(socks, &plan);
    }
    let mut buf = vec![0u8; size as usize];
    loop {
        match read_stripes(&mut socks, &mut buf, &plan).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        write_stripes(&mut socks, &mut buf, &plan).await?;
    }
}

/// The client side: a runtime of its own and the server's address.
pub struct TcpClient {
    rt: Runtime,
    addr: SocketAddr,
    lanes: u32,
    /// The sockets and buffers of the size being measured, kept between calls.
    session: Option<Session>,
}

/// Connected sockets for one message size, with their buffers.
struct Session {
    size: u64,
    plan: Vec<(usize, usize)>,
    socks: Vec<TcpStream>,
    /// With more than one socket: a thread each, holding the sockets.
    threads: Option<super::lanes::LaneThreads>,
    out: Vec<u8>,
    back: Vec<u8>,
}

impl Session {
    async fn open(addr: SocketAddr, size: u64, lanes: u32) -> io::Result<Session> {
        let plan = stripes(size, lanes);
        let mut socks = Vec::with_capacity(plan.len());
        for index in 0..plan.len() as u32 {
            let mut s = TcpStream::connect(addr).await.map_err(|e| {
                io::Error::new(e.kind(), format!("tcp baseline server at {addr}: {e}"))
            })?;
            s.set_nodelay(true)?;
            let mut hello = [0u8; HELLO];
            hello[..4].copy_from_slice(&(plan.len() as u32).to_le_bytes());
            hello[4..8].copy_from_slice(&index.to_le_bytes());
            hello[8..].copy_from_slice(&size.to_le_bytes());
            s.write_all(&hello).await?;
            socks.push(s);
        }
        let out = pattern(size as usize, size);
        let threads = if socks.len() > 1 {
            Some(super::lanes::LaneThreads::start(
                std::mem::take(&mut socks),
                &plan,
                &out,
            )?)
        } else {
            None
        };
        Ok(Session {
            size,
            plan,
            socks,
            threads,
            back: vec![0u8; size as usize],
            out,
        })
    }

    /// The round trips of a session with a thread per socket.
    fn run_threaded(
        threads: &super::lanes::LaneThreads,
        counts: Counts,
        progress: &Progress,
    ) -> io::Result<Samples> {
        let mut samples = Samples::with_capacity(counts.iters as usize);
        for i in 0..counts.total() {
            let start = Instant::now();
            threads.trip(ROUND_TRIP_LIMIT)?;
            let took = start.elapsed();
            if i >= counts.warmup {
                samples.push(took);
            }
            progress.inc();
        }
        threads.verify(ROUND_TRIP_LIMIT)?;
        Ok(samples)
    }

    /// The round trips, with no timer on their path; `trips` counts them for the watchdog.
    async fn run(
        mut self,
        counts: Counts,
        progress: Progress,
        trips: Arc<AtomicU32>,
    ) -> (Session, io::Result<Samples>) {
        let mut samples = Samples::with_capacity(counts.iters as usize);
        for i in 0..counts.total() {
            let start = Instant::now();
            let trip = async {
                write_stripes(&mut self.socks, &mut self.out, &self.plan).await?;
                read_stripes(&mut self.socks, &mut self.back, &self.plan).await
            };
            if let Err(e) = trip.await {
                return (self, Err(e));
            }
            let took = start.elapsed();
            if i >= counts.warmup {
                samples.push(took);
            }
            trips.fetch_add(1, Ordering::Relaxed);
            progress.inc();
        }
        if self.back != self.out {
            let e = io::Error::new(
                io::ErrorKind::InvalidData,
                "tcp baseline: the echo differs from what was sent",
            );
            return (self, Err(e));
        }
        (self, Ok(samples))
    }
}

impl TcpClient {
    /// A client of the server at `addr`, striping over up to `lanes` sockets.
    pub fn new(addr: SocketAddr, lanes: u32) -> io::Result<TcpClient> {
        Ok(TcpClient {
            rt: runtime()?,
            addr,
            lanes,
            session: None,
        })
    }

    /// Round trips of `size` bytes, on the sockets of the last call if it had the same size.
    pub fn measure(
        &mut self,
        size: u64,
        counts: Counts,
        progress: &Progress,
    ) -> io::Result<Samples> {
        let (addr, lanes) = (self.addr, self.lanes);
        let kept = self.session.take().filter(|s| s.size == size);
        let session = match kept {
            Some(s) => s,
            None => self.rt.block_on(Session::open(addr, size, lanes))?,
        };
        if let Some(threads) = &session.threads {
            let result = Session::run_threaded(threads, counts, progress);
            if result.is_ok() {
                self.session = Some(session);
            }
            return result;
        }
        let progress = progress.clone();
        let (session, result) = self.rt.block_on(async move {
            // The round trips run as a task of their own; this one only wakes up now and
            // then to check that they are moving.
            let trips = Arc::new(AtomicU32::new(0));
            let mut work = tokio::spawn(session.run(counts, progress, trips.clone()));
            let mut seen = 0;
            loop {
                tokio::select! {
                    done = &mut work => {
                        return done.map_err(|e| io::Error::other(format!("tcp baseline task: {e}")));
                    }
                    _ = tokio::time::sleep(ROUND_TRIP_LIMIT) => {
                        let now = trips.load(Ordering::Relaxed);
                        if now == seen {
                            work.abort();
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("tcp baseline: no echo within {ROUND_TRIP_LIMIT:?}"),
                            ));
                        }
                        seen = now;
                    }
                }
            }
        })?;
        if result.is_ok() {
            self.session = Some(session);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_follow_the_mpt_rule() {
        assert_eq!(stripes(64, 4), vec![(0, 64)]);
        assert_eq!(stripes(1 << 20, 2), vec![(0, 1 << 19), (1 << 19, 1 << 19)]);
        let s = stripes(3 * MIN_STRIPE + 1, 8);
        assert_eq!(s.len(), 4);
        assert_eq!(
            s.iter().map(|p| p.1 as u64).sum::<u64>(),
            3 * MIN_STRIPE + 1
        );
    }
}
