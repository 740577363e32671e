//! The `cuda_basic` channel's driver (feature `cuda`): CUDA tensors through pinned host
//! staging buffers over the channel's own connection (the pipe's transport: TCP between hosts),
//! with the legs of [`super`].
//!
//! - **Sending.** A device tensor is copied device-to-host in chunks of [`CHUNK`] bytes into
//!   pinned buffers, on a stream of the channel's per device that first waits on the tensor's
//!   ready event (no CPU wait); each landed chunk (a watcher callback tells the channel) is written
//!   on the connection, in tensor and chunk order whatever order they land in, while the next
//!   chunks copy. A host tensor (cpu->cuda) is written as it is. At most [`DEPTH`] chunks are
//!   staged or being written at once; a pinned buffer goes back to the pool when its write
//!   completes. The write completes once its last chunk has been written.
//! - **Receiving.** Chunks are read in order into pinned buffers (up to [`DEPTH`] at once) and
//!   each is copied host-to-device on the destination's stream as soon as it is read; after the
//!   last one the tensor completes with an event recorded on that stream (or, for a
//!   data-complete read, once the last copy has run (a watcher callback)). Into host memory
//!   (cuda->cpu) the bytes are read in place.
//! - **Failures.** A lane error, or a copy that cannot be queued, fails the channel: its
//!   connection is shut, nothing more is issued, and every tensor completes with the error once
//!   its operations in flight have come back.

use std::collections::{HashMap, VecDeque};

use std::sync::Arc;

use super::{self as engine, CHUNK, DEPTH};
use crate::channel::driver::{post_when_done, CudaDone, Cx, Driver, RecvCuda, SendCuda};
use crate::cuda::{PinnedBuf, StreamLease};
use crate::error::Error;
use crate::message::Buffer;
use crate::transport::stream::{Done, Memory, Region};

/// A `cuda_basic` channel's context.
type Ctx<'a> = Cx<'a, BasicEvent>;

/// The lane the chunks travel on (both ways).
const LANE: usize = 0;

/// The largest chunk frame on the lane (a divisor of [`CHUNK`], so that no frame straddles two
/// staging chunks whatever the other side's buffer kind).
const FRAME: usize = 1 << 20;

/// A tensor being sent.
struct Out {
    seq: u64,
    index: u32,
    buffer: Buffer,
    chunks: usize,
    /// Chunks handed to the GPU (or, for host memory, the one write) so far.
    staged: usize,
    /// Chunks written on the lane so far, and those whose write has completed.
    written: usize,
    completed: usize,
    /// Landed chunks not written yet, by chunk number.
    landed: HashMap<usize, PinnedBuf>,
    /// Device-to-host copies queued whose chunk has not landed yet.
    in_flight: usize,
    ready: Option<crate::cuda::Event>,
    error: Option<Error>,
}

/// A tensor being received.
struct In {
    seq: u64,
    index: u32,
    buffer: Buffer,
    chunks: usize,
    /// Chunk reads issued, and chunks read (and, for device memory, their copies queued).
    issued: usize,
    read: usize,
    data_complete: bool,
    error: Option<Error>,
}

/// One pipe's `cuda_basic` channel.
#[derive(Default)]
pub(crate) struct CudaBasicDriver {
    out: VecDeque<Out>,
    /// Lane writes in flight, oldest first: (seq, index, pinned buffer of a staged chunk).
    writing: VecDeque<(u64, u32, Option<PinnedBuf>)>,
    /// Chunks staged or being written.
    out_chunks: usize,
    inq: VecDeque<In>,
    /// Lane reads in flight, oldest first: (seq, index, chunk, pinned buffer for device memory).
    reading: VecDeque<(u64, u32, usize, Option<PinnedBuf>)>,
    /// Pinned buffers being read into or copied host-to-device.
    in_chunks: usize,
    /// Copies queued whose watcher callback has not come back.
    callbacks: usize,
    streams: Vec<(u32, StreamLease)>,
    failed: Option<Error>,
}

/// What the CUDA watcher's callbacks tell the channel.
pub(crate) enum BasicEvent {
    /// A staged chunk has landed in its pinned buffer.
    Landed {
        seq: u64,
        index: u32,
        chunk: usize,
        buf: PinnedBuf,
    },
    /// A pinned buffer whose host-to-device copy has run.
    Freed(PinnedBuf),
}

fn chunks(len: usize) -> usize {
    len.div_ceil(CHUNK)
}

fn chunk_len(len: usize, k: usize) -> usize {
    CHUNK.min(len - k * CHUNK)
}

impl CudaBasicDriver {
    fn send_cuda_basic(&mut self, m: SendCuda, cx: &mut Ctx<'_>) {
        let SendCuda {
            seq, index, buffer, ..
        } = m;
        let len = buffer.len() as usize;
        if let Some(e) = self.failed.clone() {
            return cx
                .core
                .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Err(e)));
        }
        if len == 0 {
            return cx
                .core
                .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Ok(())));
        }
        // The data-ready point on the tensor's stream, recorded now: the copies wait on it.
        let ready = match &buffer {
            Buffer::Cuda(b) => match b.gpu().recorded(b.stream()) {
                Ok(e) => Some(e),
                Err(e) => {
                    return cx
                        .core
                        .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Err(e)))
                }
            },
            _ => None,
        };
        let chunks = if ready.is_some() { chunks(len) } else { 1 };
        self.out.push_back(Out {
            seq,
            index,
            buffer,
            chunks,
            staged: 0,
            written: 0,
            completed: 0,
            landed: HashMap::new(),
            in_flight: 0,
            ready,
            error: None,
        });
        self.basic_pump(cx);
    }

    fn recv_cuda_basic(&mut self, m: RecvCuda, cx: &mut Ctx<'_>) {
        let RecvCuda {
            seq,
            index,
            buffer,
            data_complete,
            ..
        } = m;
        let len = buffer.len() as usize;
        let failed = self.failed.clone();
        if len == 0 || failed.is_some() {
            return cx.core.cuda_to_pipe(CudaDone::landed(
                seq,
                index,
                buffer,
                failed.map_or(Ok(()), Err),
            ));
        }
        let chunks = match &buffer {
            Buffer::Cuda(_) => chunks(len),
            _ => 1,
        };
        self.inq.push_back(In {
            seq,
            index,
            buffer,
            chunks,
            issued: 0,
            read: 0,
            data_complete,
            error: None,
        });
        self.basic_pump(cx);
    }

    /// The channel's stream on `device` (leased once, kept).
    fn basic_stream(&mut self, device: u32) -> Result<Arc<crate::cuda::CudaStream>, Error> {
        let side = &mut *self;
        if let Some((_, s)) = side.streams.iter().find(|(d, _)| *d == device) {
            return Ok(s.arc().clone());
        }
        let lease = crate::cuda::gpu(device)?.lease_stream()?;
        let s = lease.arc().clone();
        side.streams.push((device, lease));
        Ok(s)
    }

    /// Issues what can be issued: copies out, writes of landed chunks in order, reads in.
    fn basic_pump(&mut self, cx: &mut Ctx<'_>) {
        if cx.core.lanes.is_empty() {
            let e = Error::protocol(
                "cuda_basic was negotiated without its connection",
                &cx.core.origin,
            );
            self.basic_fail(e, cx);
        }
        if let Err(e) = self.basic_stage(cx) {
            self.basic_fail(e, cx);
        }
        self.basic_write(cx);
        if let Err(e) = self.basic_read(cx) {
            self.basic_fail(e, cx);
        }
        self.basic_finish(cx);
    }

    /// Stages chunks device-to-host while fewer than [`DEPTH`] are out.
    fn basic_stage(&mut self, cx: &mut Ctx<'_>) -> Result<(), Error> {
        loop {
            let side = &mut *self;
            if side.failed.is_some() || side.out_chunks >= DEPTH {
                return Ok(());
            }
            let Some(i) = side.out.iter().position(|o| o.staged < o.chunks) else {
                return Ok(());
            };
            let o = &mut side.out[i];
            let (seq, index, k) = (o.seq, o.index, o.staged);
            o.staged += 1;
            side.out_chunks += 1;
            let Buffer::Cuda(b) = &o.buffer else {
                // Host memory (cpu->cuda) goes out as it is: "landed" at once.
                continue;
            };
            let (gpu, src, n, device) = (
                b.gpu().clone(),
                b.device_ptr() + (k * CHUNK) as u64,
                chunk_len(b.len(), k),
                b.device(),
            );
            let ready = o.ready.take();
            let stream = self.basic_stream(device)?;
            if let Some(ev) = ready {
                ev.wait_on(&stream)?;
            }
            let buf = engine::pool().take()?;
            let me = cx.fx.sender();
            let side = &mut *self;
            side.callbacks += 1;
            side.out[i].in_flight += 1;
            // SAFETY: `src` is `n` bytes inside the tensor, which this channel holds until its
            // last chunk has been written (after this copy has landed).
            let queued = unsafe {
                engine::stage_out(&gpu, src, n, buf, &stream, move |buf| {
                    let _ = me.send(BasicEvent::Landed {
                        seq,
                        index,
                        chunk: k,
                        buf,
                    });
                })
            };
            if let Err(e) = queued {
                let side = &mut *self;
                side.callbacks -= 1;
                side.out[i].in_flight -= 1;
                return Err(e);
            }
        }
    }

    /// Writes the landed chunks at the front of the order.
    fn basic_write(&mut self, cx: &mut Ctx<'_>) {
        loop {
            let side = &mut *self;
            if side.failed.is_some() {
                return;
            }
            let Some(o) = side.out.iter_mut().find(|o| o.written < o.chunks) else {
                return;
            };
            let k = o.written;
            let (seq, index) = (o.seq, o.index);
            let (memory, buf, offset) = match &mut o.buffer {
                Buffer::Cuda(b) => {
                    let Some(buf) = o.landed.remove(&k) else {
                        return;
                    };
                    let n = chunk_len(b.len(), k);
                    // SAFETY: the pinned buffer travels in `writing` until this write's `Done`.
                    let r = unsafe { Region::new(buf.as_ptr(), n) };
                    (Memory::Region(r), Some(buf), (k * CHUNK) as u64)
                }
                host => {
                    if o.staged == 0 {
                        return;
                    }
                    (Memory::from(std::mem::take(host)), None, 0)
                }
            };
            o.written += 1;
            side.writing.push_back((seq, index, buf));
            cx.core
                .lane_tensor(LANE, true, seq, index, memory, offset, FRAME);
        }
    }

    /// Issues chunk reads in order while fewer than [`DEPTH`] pinned buffers are out.
    fn basic_read(&mut self, cx: &mut Ctx<'_>) -> Result<(), Error> {
        loop {
            let side = &mut *self;
            if side.failed.is_some() {
                return Ok(());
            }
            let Some(t) = side.inq.iter_mut().find(|t| t.issued < t.chunks) else {
                return Ok(());
            };
            let k = t.issued;
            let (seq, index) = (t.seq, t.index);
            let (memory, buf, offset) = match &mut t.buffer {
                Buffer::Cuda(b) => {
                    if side.in_chunks >= DEPTH {
                        return Ok(());
                    }
                    let n = chunk_len(b.len(), k);
                    let buf = engine::pool().take()?;
                    side.in_chunks += 1;
                    // SAFETY: the pinned buffer travels in `reading` until this read's `Done`.
                    let r = unsafe { Region::new(buf.as_ptr(), n) };
                    (Memory::Region(r), Some(buf), (k * CHUNK) as u64)
                }
                Buffer::Cpu(v) => (Memory::Owned(std::mem::take(v)), None, 0),
                // `Allocation::check` refuses read-only buffers before a read starts; skipping
                // the bytes would put the connection out of step, so the channel fails.
                _ => {
                    return Err(Error::invalid(
                        "cuda_basic: a read into read-only (shared) memory",
                    ))
                }
            };
            t.issued += 1;
            side.reading.push_back((seq, index, k, buf));
            cx.core
                .lane_tensor(LANE, false, seq, index, memory, offset, FRAME);
        }
    }

    /// A completion on the lane.
    fn basic_lane(&mut self, d: Done, cx: &mut Ctx<'_>) {
        match d {
            Done::WroteTensor { memory, result, .. } => {
                let side = &mut *self;
                let Some((seq, index, buf)) = side.writing.pop_front() else {
                    return;
                };
                // Every write is of one staged unit (a chunk, or a whole host tensor).
                side.out_chunks -= 1;
                drop(buf);
                if let Some(o) = side
                    .out
                    .iter_mut()
                    .find(|o| (o.seq, o.index) == (seq, index))
                {
                    o.completed += 1;
                    if let Memory::Owned(_) | Memory::Shared(_) = memory {
                        o.buffer = memory.into_buffer();
                    }
                    if let Err(e) = &result {
                        o.error.get_or_insert(e.clone());
                    }
                }
                if let Err(e) = result {
                    self.basic_fail(e, cx);
                }
            }
            Done::Tensor { memory, result, .. } => {
                let side = &mut *self;
                let Some((seq, index, k, buf)) = side.reading.pop_front() else {
                    return;
                };
                let Some(pos) = side
                    .inq
                    .iter()
                    .position(|t| (t.seq, t.index) == (seq, index))
                else {
                    return;
                };
                let t = &mut side.inq[pos];
                if let (Memory::Owned(v), Buffer::Cpu(dst)) = (memory, &mut t.buffer) {
                    *dst = v;
                }
                match (result, buf) {
                    (Err(e), buf) => {
                        t.read += 1;
                        t.error.get_or_insert(e.clone());
                        if buf.is_some() {
                            side.in_chunks -= 1;
                        }
                        self.basic_fail(e, cx);
                    }
                    (Ok(()), None) => t.read += 1,
                    (Ok(()), Some(buf)) => {
                        if let Err(e) = self.basic_land(pos, k, buf, cx) {
                            self.basic_fail(e, cx);
                        }
                    }
                }
            }
            other => tracing::debug!(?other, "cuda_basic lane completion"),
        }
        self.basic_pump(cx);
    }

    /// Copies a chunk read into `buf` to the device, and completes the tensor after its last.
    fn basic_land(
        &mut self,
        pos: usize,
        k: usize,
        buf: PinnedBuf,
        cx: &mut Ctx<'_>,
    ) -> Result<(), Error> {
        let me = cx.fx.sender();
        let side = &mut *self;
        let t = &mut side.inq[pos];
        t.read += 1;
        let Buffer::Cuda(b) = &t.buffer else {
            side.in_chunks -= 1;
            return Ok(());
        };
        let (n, dst, stream) = (
            chunk_len(b.len(), k),
            b.device_ptr() + (k * CHUNK) as u64,
            b.stream().clone(),
        );
        let gpu = b.gpu().clone();
        side.callbacks += 1;
        let back = me.clone();
        // SAFETY: `dst` is `n` bytes inside the destination, which the pipe does not hand back
        // before the tensor completes (after this copy is queued, ordered by its event).
        let queued = unsafe {
            engine::stage_in(&gpu, dst, n, buf, &stream, move |buf| {
                let _ = back.send(BasicEvent::Freed(buf));
            })
        };
        if let Err(e) = queued {
            let side = &mut *self;
            side.callbacks -= 1;
            side.in_chunks -= 1;
            return Err(e);
        }
        Ok(())
    }

    /// Completes the tensors at the front of both queues that have nothing out any more.
    fn basic_finish(&mut self, cx: &mut Ctx<'_>) {
        loop {
            let side = &mut *self;
            let failed = side.failed.clone();
            let Some(o) = side.out.front() else { break };
            let idle = o.completed == o.written && o.in_flight == 0;
            let over = o.completed == o.chunks || (failed.is_some() && idle);
            if !over {
                break;
            }
            let o = side.out.pop_front().expect("front exists");
            let result = match (o.error, failed) {
                (Some(e), _) => Err(e),
                (None, Some(e)) if o.completed < o.chunks => Err(e),
                _ => Ok(()),
            };
            cx.core
                .cuda_to_pipe(CudaDone::wrote(o.seq, o.index, o.buffer, result));
        }
        loop {
            let side = &mut *self;
            let failed = side.failed.clone();
            let Some(t) = side.inq.front() else { break };
            let over = t.read == t.chunks || (failed.is_some() && t.read == t.issued);
            if !over {
                break;
            }
            let t = side.inq.pop_front().expect("front exists");
            let error = t.error.or(if t.read < t.chunks { failed } else { None });
            self.basic_complete(t.seq, t.index, t.buffer, t.data_complete, error, cx);
        }
    }

    /// Completes a received tensor: with the event after its last copy, or once that copy has
    /// run (a data-complete read), or at once (host memory, or an error).
    fn basic_complete(
        &mut self,
        seq: u64,
        index: u32,
        buffer: Buffer,
        data_complete: bool,
        error: Option<Error>,
        cx: &mut Ctx<'_>,
    ) {
        let done = |buffer, event, result| CudaDone::read(seq, index, buffer, event, result);
        let stream = match (&buffer, &error) {
            (Buffer::Cuda(b), None) => b.stream().clone(),
            _ => {
                return cx
                    .core
                    .cuda_to_pipe(done(buffer, None, error.map_or(Ok(()), Err)))
            }
        };
        let gpu = buffer.as_cuda().expect("matched").gpu().clone();
        if data_complete {
            match cx.core.cuda_reply() {
                Some(tx) => post_when_done(&stream, tx, done(buffer, None, Ok(()))),
                None => tracing::error!("a CUDA completion with no pipe queue to go to"),
            }
            return;
        }
        match gpu.recorded(&stream) {
            Ok(e) => cx
                .core
                .cuda_to_pipe(done(buffer, Some((e, stream)), Ok(()))),
            Err(e) => cx.core.cuda_to_pipe(done(buffer, None, Err(e))),
        }
    }

    /// Stops issuing; the lane is shut, so everything in flight comes back with an error.
    fn basic_fail(&mut self, e: Error, cx: &mut Ctx<'_>) {
        let side = &mut *self;
        if side.failed.is_some() {
            return;
        }
        side.failed = Some(e);
        // Landed chunks that will never be written go back to the pool.
        for o in &mut side.out {
            side.out_chunks -= o.landed.len();
            o.landed.clear();
        }
        cx.core.shutdown_lanes();
    }
}

impl Driver for CudaBasicDriver {
    type Event = BasicEvent;

    fn send_cuda(&mut self, m: SendCuda, cx: &mut Ctx<'_>) {
        self.send_cuda_basic(m, cx);
    }

    fn recv_cuda(&mut self, m: RecvCuda, cx: &mut Ctx<'_>) {
        self.recv_cuda_basic(m, cx);
    }

    fn on_done(&mut self, d: Done, cx: &mut Ctx<'_>) {
        self.basic_lane(d, cx);
    }

    fn on_event(&mut self, e: BasicEvent, cx: &mut Ctx<'_>) {
        match e {
            BasicEvent::Landed {
                seq,
                index,
                chunk,
                buf,
            } => {
                self.callbacks -= 1;
                let failed = self.failed.is_some();
                let o = self
                    .out
                    .iter_mut()
                    .find(|o| (o.seq, o.index) == (seq, index));
                match o {
                    Some(o) if !failed => {
                        o.in_flight -= 1;
                        o.landed.insert(chunk, buf);
                    }
                    o => {
                        if let Some(o) = o {
                            o.in_flight -= 1;
                        }
                        // Never to be written.
                        self.out_chunks -= 1;
                    }
                }
            }
            BasicEvent::Freed(buf) => {
                drop(buf);
                self.callbacks -= 1;
                self.in_chunks -= 1;
            }
        }
        self.basic_pump(cx);
    }

    /// Nothing new is issued and everything out fails.
    fn stop(&mut self, e: Error, cx: &mut Ctx<'_>) {
        self.basic_fail(e.clone(), cx);
        self.basic_pump(cx);
        cx.core.shutdown_lanes();
        cx.core.fail_held(e);
    }

    fn drained(&mut self, _: &mut Ctx<'_>) -> bool {
        self.out.is_empty() && self.inq.is_empty() && self.callbacks == 0
    }
}
