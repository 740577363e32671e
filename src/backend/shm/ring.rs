//! The single-producer single-consumer byte ring that carries one direction of a shm connection.
//!
//! The ring lives in memory shared with the peer: a header page, then `capacity` data bytes
//! (a power of two). Positions are free-running `u64` byte counts; a position's slot is
//! `position & (capacity - 1)`. The producer alone writes `head`, the consumer alone writes
//! `tail`, each on its own pair of cache lines so neither side's stores evict the other's loads.
//!
//! The peer is a different process and may be buggy, so nothing read from the header is trusted:
//! each side keeps its own position and its own copy of the capacity, and a peer position that
//! would put more than `capacity` bytes in flight is refused as corruption. Every copy is bounded
//! by the local capacity, so garbage in the header can never make us touch memory outside the
//! mapping.
//!
//! Parking: a side that finds nothing to do sets its *waiting* flag, then checks again; the other
//! side, after publishing, checks the flag and clears it, and only then pays for a wake-up (an
//! eventfd write, done by the caller). Both sides put a `SeqCst` fence between their store and
//! their load, so at least one of them sees the other: no lost wake-ups, no signal per message in
//! steady state.
//!
//! Public for benchmarks and experiments: [`in_memory`] builds a ring in this process's heap and
//! hands back both ends, so the copy and bookkeeping costs can be measured without a peer,
//! sockets or a runtime. The transport itself only uses rings in shared mappings.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::io;
use std::mem::MaybeUninit;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::copy::{copy_one, copy_spans, Span, MAX_SPANS, SHARED_MIN};

/// Bytes reserved for the header in front of the data; one page keeps the data page-aligned.
pub(crate) const HEADER: usize = 4096;
/// Smallest ring accepted (one page).
pub const MIN_CAPACITY: usize = 4096;
/// Largest ring accepted (1 GiB).
pub const MAX_CAPACITY: usize = 1 << 30;
/// The default ring size, in data bytes (the shm transport's default per direction).
pub const DEFAULT_CAPACITY: usize = 2 << 20;

/// Reads into a destination at least this long copy with non-temporal stores
/// ([`crate::copy::copy_nt`]). Only tensor reads ask for this much at once (frames and small
/// payloads go through the connection's read buffer), and only tensors larger than 1 MiB: a
/// tensor of 1 MiB or less stays in the cache for whoever reads it next.
pub const NT_READ_MIN: usize = (1 << 20) + 1;

/// Large reads and writes publish their progress every this many bytes (and wake a parked
/// peer), so that the producer's copy into the ring and the consumer's copy out of it overlap
/// instead of taking turns a ring at a time. The consumer starts one piece behind the producer,
/// so the smaller the piece, the closer a message's time is to one copy's; publishing is one
/// atomic store. 64 KiB measured best here (git history's docs/performance-limits.md, "Second round").
pub const PIECE: usize = 64 << 10;

/// How many bytes a large read or write copies before it publishes them, when the process
/// shares large copies among copy threads ([`crate::copy::threads`]): half the ring (at most 1
/// MiB, at least a [`PIECE`]), so that one side fills one half while the other empties the
/// other. A piece is the batch otherwise.
const BATCH: usize = 1 << 20;

/// The bytes to copy between two publications, for a call that moves `len` bytes through a ring
/// of `capacity`, and whether they are shared among the copy threads.
fn batch(len: usize, capacity: usize) -> (usize, bool) {
    if len >= SHARED_MIN && crate::copy::threads() > 1 {
        (BATCH.min(capacity / 2).max(PIECE), true)
    } else {
        (PIECE, false)
    }
}

/// How a read or write copies its bytes: [`Direct`]ly on the caller's thread, or gathered into
/// batches of [`Spans`] that the copy threads share. The copy loops are generic over it, so the
/// direct one (every small message) carries no batch bookkeeping.
trait Copier {
    /// Copies `len` bytes from `src` to `dst`, now or at the next [`Copier::flush`].
    ///
    /// # Safety
    ///
    /// As `std::ptr::copy_nonoverlapping(src, dst, len)`, until the next `flush` returns.
    unsafe fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize);

    /// Completes every copy asked for so far.
    fn flush(&mut self);
}

/// Copies at once, on the caller's thread; `nt`: with non-temporal stores.
struct Direct {
    nt: bool,
}

impl Copier for Direct {
    #[inline(always)]
    unsafe fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize) {
        if len > 0 {
            // SAFETY: the caller's guarantees, passed on.
            unsafe { copy_one(src, dst, len, self.nt) }
        }
    }

    #[inline(always)]
    fn flush(&mut self) {}
}

/// Gathers spans into one batch that [`copy_spans`] shares among the copy threads.
struct Spans {
    spans: [MaybeUninit<Span>; MAX_SPANS],
    /// Spans gathered (the first `count` are initialized).
    count: usize,
    /// Non-temporal stores.
    nt: bool,
}

impl Spans {
    fn new(nt: bool) -> Spans {
        Spans {
            spans: [const { MaybeUninit::uninit() }; MAX_SPANS],
            count: 0,
            nt,
        }
    }
}

impl Copier for Spans {
    /// A full list flushes itself; an empty span is left out.
    unsafe fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize) {
        if len == 0 {
            return;
        }
        self.spans[self.count].write(Span { src, dst, len });
        self.count += 1;
        if self.count == MAX_SPANS {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.count == 0 {
            return;
        }
        // SAFETY: the first `count` spans were written by `copy`, and `MaybeUninit<Span>` has
        // the layout of `Span`; each span's memory is valid until now (`copy`'s contract).
        unsafe {
            let spans = std::slice::from_raw_parts(self.spans.as_ptr().cast::<Span>(), self.count);
            copy_spans(spans, self.nt);
        }
        self.count = 0;
    }
}

const MAGIC: u64 = u64::from_le_bytes(*b"APSHMRG1");

/// Two cache lines: adjacent-line prefetchers pull lines in pairs, so 64 bytes is not enough to
/// keep the producer's and the consumer's fields apart.
#[repr(C, align(128))]
struct Line<T>(T);

#[repr(C)]
struct Header {
    magic: Line<AtomicU64>,
    capacity: AtomicU64,
    /// Written once each, read often: set by the producer / consumer when its half is dropped.
    writer_closed: Line<AtomicU32>,
    reader_closed: AtomicU32,
    head: Line<AtomicU64>,
    tail: Line<AtomicU64>,
    reader_waiting: Line<AtomicU32>,
    writer_waiting: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);
const _: () = assert!(std::mem::align_of::<Header>() <= HEADER);

/// Memory a ring lives in.
///
/// # Safety
///
/// `as_ptr()` must be valid for reads and writes of `len()` bytes, aligned to [`HEADER`], and
/// stay valid and in place for as long as the value lives. The memory may be written by others
/// concurrently (it is shared with the peer), so it is only ever accessed through raw pointers
/// and atomics, never through references to plain bytes.
pub(crate) unsafe trait Region: Send + Sync {
    /// Start of the memory.
    fn as_ptr(&self) -> *mut u8;
    /// Its length in bytes.
    fn len(&self) -> usize;
}

fn corrupt(what: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("shm ring corrupted by the peer: {what}"),
    )
}

/// Whether `capacity` is a size this module accepts.
pub(crate) fn valid_capacity(capacity: usize) -> bool {
    capacity.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity)
}

/// One ring's memory with its validated geometry, shared by whichever ends this process holds.
struct Shared {
    /// Keeps the memory alive; the pointers below point into it.
    _region: Arc<dyn Region>,
    header: *const Header,
    data: *mut u8,
    capacity: u64,
}

// SAFETY: the pointers point into `_region`, which is `Send + Sync` and outlives them; all
// accesses through them are atomics or raw copies that tolerate concurrent writers.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    fn new(region: Arc<dyn Region>) -> io::Result<Shared> {
        let len = region.len();
        let capacity = len.saturating_sub(HEADER);
        if !valid_capacity(capacity) || region.as_ptr() as usize % HEADER != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "shm ring of {len} bytes: want a page of header plus a power of two \
                     between {MIN_CAPACITY} and {MAX_CAPACITY}"
                ),
            ));
        }
        let base = region.as_ptr();
        Ok(Shared {
            header: base as *const Header,
            // SAFETY: `HEADER < len`, so the result stays inside the region.
            data: unsafe { base.add(HEADER) },
            capacity: capacity as u64,
            _region: region,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the region is at least HEADER bytes, aligned to HEADER (checked in `new`),
        // alive as long as `self`, and `Header` is only atomics, for which concurrent writes by
        // the peer are fine; any bit pattern is a valid atomic integer.
        unsafe { &*self.header }
    }

    fn mask(&self, pos: u64) -> usize {
        (pos & (self.capacity - 1)) as usize
    }
}

/// Formats a fresh ring in `region` (the creator does this before handing the memory over).
pub(crate) fn create(region: Arc<dyn Region>) -> io::Result<(Producer, Consumer)> {
    let s = Shared::new(region)?;
    let h = s.header();
    h.head.0.store(0, Ordering::Relaxed);
    h.tail.0.store(0, Ordering::Relaxed);
    h.writer_closed.0.store(0, Ordering::Relaxed);
    h.reader_closed.store(0, Ordering::Relaxed);
    h.reader_waiting.0.store(0, Ordering::Relaxed);
    h.writer_waiting.0.store(0, Ordering::Relaxed);
    h.capacity.store(s.capacity, Ordering::Relaxed);
    h.magic.0.store(MAGIC, Ordering::Release);
    let s = Arc::new(s);
    Ok((Producer::new(s.clone()), Consumer::new(s)))
}

/// Checks a ring the peer formatted and returns both of its ends (the caller keeps one).
pub(crate) fn attach(region: Arc<dyn Region>) -> io::Result<(Producer, Consumer)> {
    let s = Shared::new(region)?;
    let h = s.header();
    if h.magic.0.load(Ordering::Acquire) != MAGIC {
        return Err(corrupt("bad magic in the ring header".into()));
    }
    let announced = h.capacity.load(Ordering::Relaxed);
    if announced != s.capacity {
        return Err(corrupt(format!(
            "header says {announced} bytes, the mapping holds {}",
            s.capacity
        )));
    }
    let s = Arc::new(s);
    Ok((Producer::new(s.clone()), Consumer::new(s)))
}

/// A fresh ring of `capacity` data bytes in this process's heap, with both of its ends.
///
/// Nothing is shared with another process: this is the ring's copy and bookkeeping cost alone,
/// for benchmarks and experiments. `capacity` must be a power of two between [`MIN_CAPACITY`]
/// and [`MAX_CAPACITY`]; anything else is an `InvalidInput` error.
pub fn in_memory(capacity: usize) -> io::Result<(Producer, Consumer)> {
    if !valid_capacity(capacity) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "shm ring of {capacity} bytes: want a power of two between {MIN_CAPACITY} and \
                 {MAX_CAPACITY}"
            ),
        ));
    }
    create(Heap::new(capacity))
}

/// Ordinary heap memory standing in for a mapping (see [`in_memory`]).
struct Heap {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the allocation is owned by the value and only accessed through raw pointers.
unsafe impl Send for Heap {}
// SAFETY: as above.
unsafe impl Sync for Heap {}

impl Heap {
    /// `capacity` must be valid (a power of two, at most [`MAX_CAPACITY`]).
    fn new(capacity: usize) -> Arc<Heap> {
        let layout = Layout::from_size_align(HEADER + capacity, HEADER)
            .expect("a valid ring capacity makes a valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        Arc::new(Heap { ptr, layout })
    }

    #[cfg(test)]
    fn header(&self) -> &Header {
        // SAFETY: the allocation is HEADER-aligned and larger than a Header of atomics.
        unsafe { &*(self.ptr as *const Header) }
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

// SAFETY: `ptr` is valid for `layout.size()` bytes, HEADER-aligned, for the value's life.
unsafe impl Region for Heap {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
}

/// The writing end of a ring: copies bytes in and publishes them to the [`Consumer`].
pub struct Producer {
    s: Arc<Shared>,
    /// Our own position; the copy in the header is only ever written.
    head: u64,
    /// The consumer's position as last seen (validated).
    tail: u64,
}

impl Producer {
    fn new(s: Arc<Shared>) -> Self {
        Producer {
            s,
            head: 0,
            tail: 0,
        }
    }

    fn reload_tail(&mut self) -> io::Result<()> {
        let t = self.s.header().tail.0.load(Ordering::Acquire);
        let used = self.head.wrapping_sub(t);
        // The tail may only move forward, up to our head.
        if used > self.s.capacity || t.wrapping_sub(self.tail) > self.s.capacity {
            return Err(corrupt(format!(
                "tail {t} with head {} and capacity {}",
                self.head, self.s.capacity
            )));
        }
        self.tail = t;
        Ok(())
    }

    fn free(&self) -> u64 {
        self.s.capacity - self.head.wrapping_sub(self.tail)
    }

    /// Free space now (re-reads the consumer's position). An error means the consumer's
    /// position in the header is impossible (a corrupt or hostile peer).
    pub fn space(&mut self) -> io::Result<usize> {
        self.reload_tail()?;
        Ok(self.free() as usize)
    }

    /// Copies as much of `bufs` as fits, in order, and publishes it. Returns the bytes taken;
    /// 0 means full (or nothing to write). Errors as [`Producer::space`].
    pub fn write(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.write_waking(bufs, || {})
    }

    /// [`Producer::write`], publishing every [`PIECE`] bytes (every batch, for a large write
    /// shared among the copy threads) on the way and calling `wake` (once at most) when the
    /// consumer is parked at that point: a large write then overlaps with the consumer's copy
    /// instead of preceding it.
    pub(crate) fn write_waking(
        &mut self,
        bufs: &[io::IoSlice<'_>],
        wake: impl FnMut(),
    ) -> io::Result<usize> {
        let want: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        if self.free() < want {
            self.reload_tail()?;
        }
        let room = self.free().min(want);
        if room == 0 {
            return Ok(0);
        }
        // A large write is copied a batch at a time, shared among the copy threads, then
        // published; anything else a piece at a time, by this thread.
        Ok(match batch(room as usize, self.s.capacity as usize) {
            (step, true) => self.write_with(bufs, room, step, &mut Spans::new(false), wake),
            (step, false) => self.write_with(bufs, room, step, &mut Direct { nt: false }, wake),
        })
    }

    /// [`Producer::write_waking`]'s copy of `room` bytes of `bufs`, publishing every `step`.
    #[inline(always)]
    fn write_with(
        &mut self,
        bufs: &[io::IoSlice<'_>],
        mut room: u64,
        step: usize,
        copier: &mut impl Copier,
        mut wake: impl FnMut(),
    ) -> usize {
        let start = self.head;
        let mut pos = self.head;
        let mut unpublished = 0;
        // One early wake-up per call at most: a consumer that catches up and parks again is
        // woken by the caller at the end, not once per piece (on a busy machine each wake-up is
        // a context switch that competes with this copy).
        let mut woke = false;
        for b in bufs {
            if room == 0 {
                break;
            }
            let take = (b.len() as u64).min(room) as usize;
            let mut off = 0;
            while off < take {
                let n = (take - off).min(step - unpublished);
                let at = self.s.mask(pos);
                let first = n.min(self.s.capacity as usize - at);
                let src = b[off..].as_ptr();
                // SAFETY: `at + first <= capacity` and `n - first <= capacity`, so both stay in
                // the data area; `b` holds at least `off + n` bytes and outlives the call (and
                // so the flush); the ring memory and the caller's buffer cannot overlap (one is
                // a fresh mapping), and the consumer does not touch unpublished bytes.
                unsafe {
                    copier.copy(src, self.s.data.add(at), first);
                    copier.copy(src.add(first), self.s.data, n - first);
                }
                pos = pos.wrapping_add(n as u64);
                off += n;
                unpublished += n;
                if unpublished == step {
                    copier.flush();
                    unpublished = 0;
                    self.head = pos;
                    self.s.header().head.0.store(pos, Ordering::Release);
                    if !woke && self.take_reader_waiting() {
                        woke = true;
                        wake();
                    }
                }
            }
            room -= take as u64;
        }
        copier.flush();
        let n = pos.wrapping_sub(start);
        self.head = pos;
        self.s.header().head.0.store(pos, Ordering::Release);
        n as usize
    }

    /// After publishing: whether the consumer is parked and must be woken. Clears its flag, so
    /// only one wake-up is sent per park.
    pub(crate) fn take_reader_waiting(&self) -> bool {
        fence(Ordering::SeqCst);
        let w = &self.s.header().reader_waiting.0;
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }

    /// Announces that we are about to park for space; returns `true` if there is a reason not to
    /// (space appeared, or the consumer is gone).
    pub(crate) fn prepare_park(&mut self) -> io::Result<bool> {
        let h = self.s.header();
        h.writer_waiting.0.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.reload_tail()?;
        Ok(self.free() > 0 || self.reader_closed())
    }

    /// Whether the consumer has dropped its end.
    pub(crate) fn reader_closed(&self) -> bool {
        self.s.header().reader_closed.load(Ordering::Acquire) != 0
    }

    /// Marks the end of the stream; the consumer sees it once it has read everything before it.
    pub(crate) fn close(&self) {
        self.s.header().writer_closed.0.store(1, Ordering::Release);
    }
}

/// The reading end of a ring: copies published bytes out and frees their space.
pub struct Consumer {
    s: Arc<Shared>,
    /// Our own position; the copy in the header is only ever written.
    tail: u64,
    /// The producer's position as last seen (validated).
    head: u64,
}

impl Consumer {
    fn new(s: Arc<Shared>) -> Self {
        Consumer {
            s,
            tail: 0,
            head: 0,
        }
    }

    fn reload_head(&mut self) -> io::Result<()> {
        let h = self.s.header().head.0.load(Ordering::Acquire);
        let avail = h.wrapping_sub(self.tail);
        if avail > self.s.capacity || avail < self.head.wrapping_sub(self.tail) {
            return Err(corrupt(format!(
                "head {h} with tail {} and capacity {}",
                self.tail, self.s.capacity
            )));
        }
        self.head = h;
        Ok(())
    }

    /// Bytes ready to read now (re-reads the producer's position). An error means the
    /// producer's position in the header is impossible (a corrupt or hostile peer).
    pub fn available(&mut self) -> io::Result<usize> {
        self.reload_head()?;
        Ok(self.head.wrapping_sub(self.tail) as usize)
    }

    /// Copies up to `dst.len()` bytes out and frees their space. Returns 0 when empty.
    pub(crate) fn read_uninit(&mut self, dst: &mut [MaybeUninit<u8>]) -> io::Result<usize> {
        self.read_waking(dst, || {})
    }

    /// [`Consumer::read_uninit`], freeing space every [`PIECE`] bytes (every batch, for a large
    /// read shared among the copy threads) on the way and calling `wake` (once at most) when the
    /// producer is parked for space at that point, so that it refills the ring while we copy. A
    /// destination of at least [`NT_READ_MIN`] bytes is written with non-temporal stores.
    pub(crate) fn read_waking(
        &mut self,
        dst: &mut [MaybeUninit<u8>],
        wake: impl FnMut(),
    ) -> io::Result<usize> {
        if self.head == self.tail {
            self.reload_head()?;
        }
        let total = (self.head.wrapping_sub(self.tail) as usize).min(dst.len());
        // A large read goes straight to its destination (a tensor) with non-temporal stores:
        // it will not stay in the cache anyway.
        let nt = dst.len() >= NT_READ_MIN;
        let out = dst.as_mut_ptr() as *mut u8;
        // SAFETY: `dst` has room for `total` bytes at `out`, and is not the ring's memory.
        Ok(unsafe {
            match batch(total, self.s.capacity as usize) {
                (step, true) => self.read_with(out, total, step, &mut Spans::new(nt), wake),
                (step, false) => self.read_with(out, total, step, &mut Direct { nt }, wake),
            }
        })
    }

    /// [`Consumer::read_waking`]'s copy of `total` bytes to `out`, freeing space every `step`.
    ///
    /// # Safety
    ///
    /// `out` is valid for writes of `total` bytes and does not overlap the ring.
    #[inline(always)]
    unsafe fn read_with(
        &mut self,
        out: *mut u8,
        total: usize,
        step: usize,
        copier: &mut impl Copier,
        mut wake: impl FnMut(),
    ) -> usize {
        let mut done = 0;
        // One early wake-up per call at most, as in `write_waking`.
        let mut woke = false;
        while done < total {
            let n = (total - done).min(step);
            let at = self.s.mask(self.tail);
            let first = n.min(self.s.capacity as usize - at);
            // SAFETY: `at + first <= capacity` and `n - first <= capacity` keep both in the data
            // area, `out` has room for `done + n <= total` bytes (the caller's word), and the
            // mapping cannot overlap it; both outlive the flush below. The bytes may be changed
            // concurrently by a misbehaving peer: we copy whatever is there, which is garbage
            // in, garbage out for the framing layer, never out of bounds.
            unsafe {
                let to = out.add(done);
                copier.copy(self.s.data.add(at), to, first);
                copier.copy(self.s.data, to.add(first), n - first);
            }
            copier.flush();
            done += n;
            self.tail = self.tail.wrapping_add(n as u64);
            self.s.header().tail.0.store(self.tail, Ordering::Release);
            if !woke && done < total && self.take_writer_waiting() {
                woke = true;
                wake();
            }
        }
        total
    }

    /// Copies up to `dst.len()` bytes out and frees their space. Returns 0 when empty. Errors as
    /// [`Consumer::available`].
    pub fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `read_uninit` only writes initialized bytes, so `dst` stays initialized.
        let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
        self.read_uninit(dst)
    }

    /// After reading: whether the producer is parked for space and must be woken. Clears its
    /// flag.
    pub(crate) fn take_writer_waiting(&self) -> bool {
        fence(Ordering::SeqCst);
        let w = &self.s.header().writer_waiting.0;
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }

    /// Announces that we are about to park for data; returns `true` if there is a reason not to
    /// (data arrived, or the producer closed).
    pub(crate) fn prepare_park(&mut self) -> io::Result<bool> {
        let h = self.s.header();
        h.reader_waiting.0.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        Ok(self.available()? > 0 || self.writer_closed())
    }

    /// Whether the producer has closed its end. Data published before the close is still
    /// readable: check [`Consumer::available`] again after seeing `true`.
    pub(crate) fn writer_closed(&self) -> bool {
        self.s.header().writer_closed.0.load(Ordering::Acquire) != 0
    }

    /// Tells the producer nobody will read any more.
    pub(crate) fn close(&self) {
        self.s.header().reader_closed.store(1, Ordering::Release);
    }
}

/// A ring driven by `ops` with a hostile peer, for the fuzz target `shm_ring` and its seeds'
/// replay: each op byte (mod 6) is our write, our read, or the peer storing an arbitrary value
/// into a header field (its position, the other side's position, a flag). Nothing may panic, no
/// call may report more bytes than it was given room for, and while the peer has stored nothing
/// the bytes read are the bytes written, in order.
pub(crate) fn hostile_peer(ops: &[u8]) {
    let (mut p, mut c) = in_memory(MIN_CAPACITY).expect("a ring of the minimum size");
    let shared = p.s.clone();
    let h: &Header = shared.header();
    let capacity = shared.capacity;
    let mut it = ops.iter().copied();
    let word = |it: &mut dyn Iterator<Item = u8>| {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = it.next().unwrap_or(0);
        }
        u64::from_le_bytes(b)
    };
    let (mut written, mut read) = (Vec::new(), Vec::new());
    let mut tampered = false;
    let mut counter = 0u8;
    while let Some(op) = it.next() {
        let n = usize::from(it.next().unwrap_or(0)) * 37;
        match op % 6 {
            0 => {
                let src: Vec<u8> = (0..n)
                    .map(|_| {
                        counter = counter.wrapping_add(1);
                        counter
                    })
                    .collect();
                if let Ok(k) = p.write(&[io::IoSlice::new(&src)]) {
                    assert!(k <= n, "wrote {k} of {n} bytes");
                    written.extend_from_slice(&src[..k]);
                }
            }
            1 => {
                let mut dst = vec![0u8; n];
                if let Ok(k) = c.read(&mut dst) {
                    assert!(k <= n, "read {k} bytes into {n}");
                    read.extend_from_slice(&dst[..k]);
                }
            }
            2 => {
                tampered = true;
                h.head.0.store(word(&mut it), Ordering::Release);
            }
            3 => {
                tampered = true;
                h.tail.0.store(word(&mut it), Ordering::Release);
            }
            4 => {
                tampered = true;
                let v = word(&mut it);
                h.writer_closed.0.store(v as u32, Ordering::Release);
                h.reader_closed.store((v >> 32) as u32, Ordering::Release);
            }
            _ => {
                if let Ok(k) = c.available() {
                    assert!(
                        k as u64 <= capacity,
                        "{k} bytes available in a ring of {capacity}"
                    );
                }
                if let Ok(k) = p.space() {
                    assert!(
                        k as u64 <= capacity,
                        "{k} bytes free in a ring of {capacity}"
                    );
                }
            }
        }
        if !tampered {
            assert_eq!(
                read[..],
                written[..read.len()],
                "bytes read differ from those written"
            );
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::IoSlice;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn bytes_wrap_around_in_order() {
        let (mut p, mut c) = create(Heap::new(4096)).unwrap();
        let data = pattern(10_000, 7);
        let mut out = Vec::new();
        let mut sent = 0;
        let mut buf = [0u8; 1000];
        while out.len() < data.len() {
            sent += p.write(&[IoSlice::new(&data[sent..])]).unwrap();
            assert!(sent - out.len() <= 4096);
            let n = c.read(&mut buf[..333]).unwrap();
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out, data);
        assert_eq!(c.read(&mut buf).unwrap(), 0);
    }

    /// Reads into a large destination take the non-temporal copy; they must move the same
    /// bytes, across the wrap-around and at odd offsets of the destination.
    #[test]
    fn large_reads_wrap_around_in_order() {
        let (mut p, mut c) = create(Heap::new(1 << 20)).unwrap();
        let data = pattern(5 << 20, 9);
        let mut out = vec![0u8; data.len() + 3];
        let (mut sent, mut got) = (0, 3);
        assert!(
            out.len() - got >= 4 * NT_READ_MIN,
            "most reads take the NT path"
        );
        let mut step = 0;
        while got < out.len() {
            // Uneven writes, so the reads start and end anywhere in the ring.
            let w = (data.len() - sent).min(300_001 + step * 4097);
            sent += p.write(&[IoSlice::new(&data[sent..sent + w])]).unwrap();
            got += c.read(&mut out[got..]).unwrap();
            step += 1;
        }
        assert_eq!(&out[3..], &data[..]);
    }

    /// Large writes and reads publish every `PIECE` bytes and wake a parked peer at the first
    /// piece (once per park), and move the same bytes across slice and piece boundaries.
    #[test]
    fn pieces_wake_a_parked_peer_once_and_keep_the_bytes() {
        let (mut p, mut c) = create(Heap::new(2 << 20)).unwrap();
        let a = pattern(PIECE / 3, 1);
        let b = pattern(PIECE + 17, 2);
        let d = pattern(PIECE * 2 + 5, 3);
        let want: Vec<u8> = [&a[..], &b[..], &d[..]].concat();
        let mut got = vec![0u8; want.len()];
        // The consumer parks on an empty ring: the writer's first published piece wakes it.
        assert!(!c.prepare_park().unwrap());
        let mut wakes = 0;
        let bufs = [IoSlice::new(&a), IoSlice::new(&b), IoSlice::new(&d)];
        assert_eq!(p.write_waking(&bufs, || wakes += 1).unwrap(), want.len());
        assert_eq!(wakes, 1, "one wake-up per park");
        assert!(!p.take_reader_waiting());
        // Fill the ring; the producer parks; the reader's first freed piece wakes it.
        let fill = pattern((2 << 20) - want.len(), 4);
        assert_eq!(p.write(&[IoSlice::new(&fill)]).unwrap(), fill.len());
        assert!(!p.prepare_park().unwrap());
        let mut wakes = 0;
        let mut all = vec![0u8; 2 << 20];
        // SAFETY: viewing initialized bytes as `MaybeUninit` is always sound.
        let dst = unsafe { &mut *(&mut all[..] as *mut [u8] as *mut [MaybeUninit<u8>]) };
        assert_eq!(c.read_waking(dst, || wakes += 1).unwrap(), 2 << 20);
        assert_eq!(wakes, 1, "one wake-up per park");
        got.copy_from_slice(&all[..want.len()]);
        assert_eq!(got, want);
        assert_eq!(&all[want.len()..], &fill[..]);
    }

    #[test]
    fn a_full_ring_takes_what_fits_across_slices() {
        let (mut p, mut c) = create(Heap::new(4096)).unwrap();
        let a = pattern(3000, 1);
        let b = pattern(3000, 2);
        let n = p.write(&[IoSlice::new(&a), IoSlice::new(&b)]).unwrap();
        assert_eq!(n, 4096);
        assert_eq!(p.write(&[IoSlice::new(&b)]).unwrap(), 0);
        let mut out = vec![0u8; 5000];
        assert_eq!(c.read(&mut out).unwrap(), 4096);
        assert_eq!(&out[..3000], &a[..]);
        assert_eq!(&out[3000..4096], &b[..1096]);
        assert_eq!(p.space().unwrap(), 4096);
    }

    #[test]
    fn in_memory_checks_the_capacity_and_works() {
        for bad in [0, 3000, MIN_CAPACITY / 2, MAX_CAPACITY * 2] {
            let e = in_memory(bad).err().expect("bad capacity accepted");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        }
        let (mut p, mut c) = in_memory(DEFAULT_CAPACITY).unwrap();
        assert_eq!(p.space().unwrap(), DEFAULT_CAPACITY);
        assert_eq!(p.write(&[IoSlice::new(b"abc")]).unwrap(), 3);
        assert_eq!(c.available().unwrap(), 3);
        let mut b = [0u8; 8];
        assert_eq!(c.read(&mut b).unwrap(), 3);
        assert_eq!(&b[..3], b"abc");
    }

    #[test]
    fn attach_checks_the_header() {
        let heap = Heap::new(8192);
        assert!(attach(heap.clone()).is_err(), "unformatted memory accepted");
        let (mut p, _) = create(heap.clone()).unwrap();
        let (_, mut c) = attach(heap.clone()).unwrap();
        p.write(&[IoSlice::new(b"hello")]).unwrap();
        let mut b = [0u8; 8];
        assert_eq!(c.read(&mut b).unwrap(), 5);
        heap.header().capacity.store(1 << 20, Ordering::Relaxed);
        assert!(
            attach(heap).is_err(),
            "capacity beyond the mapping accepted"
        );
    }

    #[test]
    fn garbage_positions_are_refused_not_followed() {
        let heap = Heap::new(4096);
        let (mut p, mut c) = create(heap.clone()).unwrap();
        let mut b = vec![0u8; 8192];
        for garbage in [u64::MAX, 1 << 40, 4097, 9999] {
            heap.header().head.0.store(garbage, Ordering::Relaxed);
            let e = c.read(&mut b).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            heap.header().head.0.store(0, Ordering::Relaxed);
            heap.header().tail.0.store(garbage, Ordering::Relaxed);
            let e = p.write(&[IoSlice::new(&b)]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            heap.header().tail.0.store(0, Ordering::Relaxed);
        }
        // A tail that moves backwards is refused too.
        p.write(&[IoSlice::new(&b[..100])]).unwrap();
        assert_eq!(c.read(&mut b[..60]).unwrap(), 60);
        heap.header().tail.0.store(10, Ordering::Relaxed);
        assert!(
            p.space().is_ok(),
            "a tail behind the last seen one is plausible until seen"
        );
        assert_eq!(c.read(&mut b).unwrap(), 40);
    }

    #[test]
    fn waiting_flags_ask_for_one_wake_up_per_park() {
        let (mut p, mut c) = create(Heap::new(4096)).unwrap();
        assert!(!c.prepare_park().unwrap());
        p.write(&[IoSlice::new(b"x")]).unwrap();
        assert!(p.take_reader_waiting());
        assert!(!p.take_reader_waiting(), "second wake-up for the same park");
        assert!(c.prepare_park().unwrap(), "parked with data ready");
        let mut b = [0u8; 4096];
        c.read(&mut b).unwrap();
        p.write(&[IoSlice::new(&b)]).unwrap();
        assert!(!p.prepare_park().unwrap());
        assert_eq!(c.read(&mut b[..1]).unwrap(), 1);
        assert!(c.take_writer_waiting());
        assert!(!c.take_writer_waiting());
        p.close();
        assert!(c.writer_closed());
        c.close();
        assert!(p.reader_closed());
        assert!(
            p.prepare_park().unwrap(),
            "parked although the reader is gone"
        );
    }

    /// Two threads spinning on a 64 KiB ring: checks ordering under real concurrency and prints
    /// the raw copy throughput (`--nocapture` to see it).
    #[test]
    fn threads_stream_through_a_small_ring() {
        let (mut p, mut c) = create(Heap::new(64 << 10)).unwrap();
        let total = 64usize << 20;
        let chunk = pattern(1 << 20, 3);
        let start = std::time::Instant::now();
        let writer = std::thread::spawn(move || {
            let mut sent = 0;
            while sent < total {
                let at = sent % chunk.len();
                let n = p.write(&[IoSlice::new(&chunk[at..])]).unwrap();
                if n == 0 {
                    std::thread::yield_now();
                }
                sent += n;
            }
            p.close();
        });
        let expect = pattern(1 << 20, 3);
        let mut got = 0usize;
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = c.read(&mut buf).unwrap();
            if n == 0 {
                if c.writer_closed() && c.available().unwrap() == 0 {
                    break;
                }
                std::thread::yield_now();
                continue;
            }
            for (i, b) in buf[..n].iter().enumerate() {
                assert_eq!(*b, expect[(got + i) % expect.len()], "byte {}", got + i);
            }
            got += n;
        }
        writer.join().unwrap();
        assert_eq!(got, total);
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "ring: {} MiB through 64 KiB in {:.3} s: {:.2} GiB/s (with content check)",
            total >> 20,
            secs,
            total as f64 / secs / (1u64 << 30) as f64
        );
    }
}
