//! The raw baseline of `bench channel --backend cuda_ipc` between the same two processes: the
//! driver's copy through CUDA IPC handles, with the same GPU-side ordering as the channel, and no
//! actorpipe code on the path.
//!
//! Each side exports one buffer and one interprocess event and opens the other's, once per size.
//! A round trip: the parent records its event and sends one byte on a Unix socket; the child makes
//! its stream wait on that event, copies the parent's buffer into its own through the mapping,
//! records its event and answers one byte; the parent's stream waits on the child's event, copies
//! back, and the parent synchronizes. So it pays what any two processes sharing a GPU pay: two
//! turns of GPU work in two contexts, which the GPU time-slices unless MPS runs.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actorpipe::cuda::{self, CudaBuffer, Event, Gpu, StreamLease};
use actorpipe::internal::backend::cuda_ipc::ipc::{self, Opened, RemoteEvent, HANDLE_LEN};

use crate::failure::Failure;

fn failed<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> Failure {
    move |e| Failure::Failed(format!("raw cross-process copy: {what}: {e}"))
}

/// One side's buffer and event, as the other side needs them.
struct Offer {
    handle: [u8; HANDLE_LEN],
    offset: u64,
    size: u64,
    event: [u8; HANDLE_LEN],
}

const OFFER_LEN: usize = 2 * HANDLE_LEN + 16;

impl Offer {
    fn of(gpu: &Gpu, buf: &CudaBuffer, event: &Event) -> Result<Offer, Failure> {
        let e = ipc::export(gpu, buf.device_ptr())
            .map_err(failed("cuIpcGetMemHandle"))?
            .map_err(|e| failed("exporting")(e.0))?;
        Ok(Offer {
            handle: e.handle,
            offset: e.offset,
            size: e.size,
            event: ipc::export_event(event).map_err(failed("cuIpcGetEventHandle"))?,
        })
    }

    fn send(&self, s: &mut UnixStream) -> std::io::Result<()> {
        let mut b = Vec::with_capacity(OFFER_LEN);
        b.extend_from_slice(&self.handle);
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.event);
        s.write_all(&b)
    }

    fn recv(s: &mut UnixStream) -> std::io::Result<Offer> {
        let mut b = [0u8; OFFER_LEN];
        s.read_exact(&mut b)?;
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Ok(Offer {
            handle: b[..HANDLE_LEN].try_into().expect("64 bytes"),
            offset: u64_at(HANDLE_LEN),
            size: u64_at(HANDLE_LEN + 8),
            event: b[HANDLE_LEN + 16..].try_into().expect("64 bytes"),
        })
    }

    /// Opens the other side's buffer and event here.
    fn open(&self, gpu: &Arc<Gpu>) -> Result<(Opened, RemoteEvent), Failure> {
        let m = ipc::open(gpu, &self.handle, self.size).map_err(failed("cuIpcOpenMemHandle"))?;
        let e = ipc::open_event(gpu, &self.event).map_err(failed("cuIpcOpenEventHandle"))?;
        Ok((m, e))
    }
}

/// This side's half of one size: its buffer, its event, the other side's opened.
struct Half {
    gpu: Arc<Gpu>,
    stream: StreamLease,
    mine: CudaBuffer,
    ready: Event,
    theirs: Opened,
    offset: u64,
    their_ready: RemoteEvent,
}

impl Half {
    /// This side's buffer and event, with the other side's (described by `theirs`) opened here.
    fn new(
        gpu: &Arc<Gpu>,
        mine: CudaBuffer,
        ready: Event,
        theirs: &Offer,
    ) -> Result<Half, Failure> {
        let (mapping, their_ready) = theirs.open(gpu)?;
        Ok(Half {
            gpu: gpu.clone(),
            stream: gpu.lease_stream().map_err(failed("a stream"))?,
            mine,
            ready,
            theirs: mapping,
            offset: theirs.offset,
            their_ready,
        })
    }

    /// Waits for the other side's event on the GPU, then copies its buffer into ours.
    fn pull(&self) -> Result<(), Failure> {
        self.their_ready
            .wait_on(&self.stream)
            .map_err(failed("cuStreamWaitEvent"))?;
        // SAFETY: the mapping holds `offset + len` bytes (the other side's buffer, alive until
        // it hears 'Q'), ours holds `len`; the parent synchronizes before either goes.
        unsafe {
            cuda::copy_async(
                (self.mine.device_ptr(), &self.gpu),
                (self.theirs.base() + self.offset, self.theirs.gpu()),
                self.mine.len(),
                &self.stream,
            )
        }
        .map_err(failed("cuMemcpyDtoDAsync"))
    }
}

/// The parent's side: a Unix socket the echoing child connects to.
pub struct RawPeer {
    listener: UnixListener,
    path: std::path::PathBuf,
    conn: Option<UnixStream>,
    half: Option<Half>,
}

impl RawPeer {
    /// Listens at a fresh path, which the child is told through the environment.
    pub fn listen() -> Result<RawPeer, Failure> {
        let path = std::env::temp_dir().join(format!("actorpipe-raw-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        Ok(RawPeer {
            listener,
            path,
            conn: None,
            half: None,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn conn(&mut self) -> Result<&mut UnixStream, Failure> {
        if self.conn.is_none() {
            self.listener.set_nonblocking(true)?;
            let deadline = Instant::now() + Duration::from_secs(30);
            let s = loop {
                match self.listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            return Err(Failure::Failed(
                                "the echoing side did not open the raw baseline's socket".into(),
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            s.set_nonblocking(false)?;
            self.conn = Some(s);
        }
        Ok(self.conn.as_mut().expect("set above"))
    }

    /// Sets up a buffer of `len` bytes on `gpu` here and on the child's device there.
    pub fn size(&mut self, gpu: &Arc<Gpu>, len: usize) -> Result<(), Failure> {
        self.end_size()?;
        let mine = CudaBuffer::alloc(gpu.ordinal(), len).map_err(failed("allocating"))?;
        let ready = gpu.event(true).map_err(failed("an interprocess event"))?;
        let offer = Offer::of(gpu, &mine, &ready)?;
        let s = self.conn()?;
        s.write_all(b"S")?;
        s.write_all(&(len as u64).to_le_bytes())?;
        offer.send(s)?;
        let theirs = Offer::recv(s)?;
        self.half = Some(Half::new(gpu, mine, ready, &theirs)?);
        Ok(())
    }

    /// One round trip: there (the child pulls) and back (this side pulls), then synchronize.
    pub fn round_trip(&mut self) -> Result<Duration, Failure> {
        let t = Instant::now();
        let half = self.half.as_ref().expect("size() first");
        half.ready
            .record(&half.stream)
            .map_err(failed("cuEventRecord"))?;
        let s = self.conn.as_mut().expect("connected by size()");
        s.write_all(b"T")?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        let half = self.half.as_ref().expect("size() first");
        half.pull()?;
        half.stream
            .synchronize()
            .map_err(failed("cuStreamSynchronize"))?;
        Ok(t.elapsed())
    }

    /// Ends the current size: the child drops its mappings and buffer.
    fn end_size(&mut self) -> Result<(), Failure> {
        if let Some(half) = self.half.take() {
            half.stream
                .synchronize()
                .map_err(failed("cuStreamSynchronize"))?;
            let s = self.conn.as_mut().expect("connected by size()");
            s.write_all(b"Q")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
        }
        Ok(())
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        let _ = self.end_size();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The child's side: serves the parent's requests on its own thread until the socket closes.
pub fn serve(path: String, device: u32) {
    let run = || -> Result<(), Failure> {
        let gpu = cuda::gpu(device).map_err(failed("the GPU"))?;
        let mut s = UnixStream::connect(&path)?;
        let mut half: Option<Half> = None;
        let mut op = [0u8; 1];
        while s.read_exact(&mut op).is_ok() {
            match op[0] {
                b'S' => {
                    let mut n = [0u8; 8];
                    s.read_exact(&mut n)?;
                    let len = u64::from_le_bytes(n) as usize;
                    let theirs = Offer::recv(&mut s)?;
                    let mine = CudaBuffer::alloc(device, len).map_err(failed("allocating"))?;
                    let ready = gpu.event(true).map_err(failed("an interprocess event"))?;
                    let offer = Offer::of(&gpu, &mine, &ready)?;
                    half = Some(Half::new(&gpu, mine, ready, &theirs)?);
                    offer.send(&mut s)?;
                }
                b'T' => {
                    let h = half
                        .as_ref()
                        .ok_or_else(|| failed("protocol")("T before S"))?;
                    h.pull()?;
                    h.ready.record(&h.stream).map_err(failed("cuEventRecord"))?;
                    s.write_all(b"T")?;
                }
                b'Q' => {
                    if let Some(h) = half.take() {
                        h.stream
                            .synchronize()
                            .map_err(failed("cuStreamSynchronize"))?;
                    }
                    s.write_all(b"q")?;
                }
                other => return Err(failed("protocol")(format!("unknown request {other}"))),
            }
        }
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("error: cuda_ipc raw baseline (echoing side): {e}");
    }
}
