//! A registration cache keyed by address range, and the chunk plan for large RDMA transfers.
//!
//! Registering memory pins its pages and programs the HCA's translation tables: a system call
//! and page-table walk per page, far too slow for every tensor (a set-up step, not a per-transfer one).
//! The cache keeps registrations and hands out the one covering a buffer.
//!
//! # Invalidation rule
//!
//! A registration pins the *physical pages* that backed an address range when it was made. If
//! the application frees that memory and a later allocation reuses the addresses, the old
//! registration still points at the old pages: an RDMA write through it would land where nobody
//! looks. The cache cannot see `free`, so:
//!
//! - An entry is **in use** while a buffer inside it is held by the runtime (a [`Lease`] is
//!   alive). Buffers of one allocation in flight at once share it.
//! - When its last lease is dropped, the entry is **deregistered at once**, unless the cache was
//!   made with a `keep` budget: then it stays, least recently used first out, until the idle
//!   entries exceed the budget. Use a budget only when the buffers given to pipes are never freed
//!   while the context lives (a pool, reused `Receive` allocations): that is the caller's promise.
//! - [`RegCache::invalidate`] drops every idle entry overlapping a range, for a caller that is
//!   about to free memory it promised to keep.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::{Access, Device, GpuMemory, MemoryRegion, VerbsError, MAX_OP_BYTES, MIN_OP_BYTES};

/// Splits `len` bytes into RDMA operations of at most 1 GiB and at least 32 bytes each, as even
/// as possible: `(offset, length)` pairs. Empty for `len` under 32 (send such bytes inline).
pub fn chunks(len: u64) -> Vec<(u64, u64)> {
    chunks_of(len, MAX_OP_BYTES)
}

/// [`chunks`] with operations of at most `max` bytes (clamped to 64 B ..= 1 GiB, so that even
/// pieces never fall under 32 bytes): tests use a small limit to exercise chunking.
pub fn chunks_of(len: u64, max: u64) -> Vec<(u64, u64)> {
    let max = max.clamp(2 * MIN_OP_BYTES, MAX_OP_BYTES);
    if len < MIN_OP_BYTES {
        return Vec::new();
    }
    let n = len.div_ceil(max);
    let base = len / n;
    let extra = len % n;
    let mut off = 0;
    (0..n)
        .map(|i| {
            let l = base + u64::from(i < extra);
            let c = (off, l);
            off += l;
            c
        })
        .collect()
}

struct Entry {
    mr: Arc<dyn MemoryRegion>,
    /// The memory's identity: 0 for host memory, the allocation's buffer id for GPU memory.
    tag: u64,
    leases: usize,
    last_use: u64,
}

struct State {
    /// By start address.
    entries: BTreeMap<u64, Entry>,
    clock: u64,
    idle_bytes: u64,
    registrations: u64,
    stale: u64,
}

/// The cache. Shared by the pipes of one device.
pub struct RegCache {
    device: Arc<dyn Device>,
    access: Access,
    keep: u64,
    state: Mutex<State>,
}

/// A buffer's registration, held while the runtime holds the buffer.
pub struct Lease {
    cache: Arc<RegCache>,
    start: u64,
    /// The registration covering the buffer.
    pub mr: Arc<dyn MemoryRegion>,
}

impl RegCache {
    /// A cache registering with `access`; `keep` bytes of idle registrations stay (0: none, the
    /// safe default; see the module's invalidation rule).
    pub fn new(device: Arc<dyn Device>, access: Access, keep: u64) -> Arc<RegCache> {
        Arc::new(RegCache {
            device,
            access,
            keep,
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                clock: 0,
                idle_bytes: 0,
                registrations: 0,
                stale: 0,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registration covering `len` bytes at `addr`, registering them if none does.
    ///
    /// # Safety
    /// The memory must stay allocated while the lease lives, and (with a `keep` budget) until
    /// it is invalidated or the cache dropped.
    pub unsafe fn lease(self: &Arc<Self>, addr: *mut u8, len: usize) -> Result<Lease, VerbsError> {
        let (device, access) = (&self.device, self.access);
        // SAFETY: forwarded from this function's contract.
        self.lease_with(addr as u64, len as u64, 0, || unsafe {
            device.register(addr, len, access)
        })
    }

    /// The registration covering `len` bytes of GPU memory at `addr`, inside the allocation
    /// `alloc` (base, size, the driver's buffer id): a miss registers the whole allocation
    /// ([`Device::register_gpu`]), so every tensor of it shares one registration. Entries are
    /// keyed by address range (in the process's unified address space a range names one
    /// allocation of one GPU) and carry the buffer id: an idle entry whose id differs belongs to
    /// freed memory and is replaced, never reused.
    ///
    /// # Safety
    /// As [`Self::lease`].
    pub unsafe fn lease_gpu(
        self: &Arc<Self>,
        gpu: Arc<dyn GpuMemory>,
        addr: u64,
        len: u64,
        alloc: (u64, u64, u64),
    ) -> Result<Lease, VerbsError> {
        let (device, access) = (&self.device, self.access);
        let (base, size, id) = alloc;
        // SAFETY: forwarded from this function's contract.
        self.lease_with(addr, len, id, || unsafe {
            device.register_gpu(gpu, base, size as usize, access)
        })
    }

    /// The entry covering `len` bytes at `addr` with identity `tag` (0 for host memory), or a
    /// new one from `register`. An idle entry over the same start with another tag is stale and
    /// goes first; one in use is an error (memory freed while the runtime holds a buffer in it).
    fn lease_with(
        self: &Arc<Self>,
        addr: u64,
        len: u64,
        tag: u64,
        register: impl FnOnce() -> Result<Box<dyn MemoryRegion>, VerbsError>,
    ) -> Result<Lease, VerbsError> {
        let mut s = self.lock();
        s.clock += 1;
        let now = s.clock;
        let covering = s
            .entries
            .range(..=addr)
            .next_back()
            .filter(|(_, e)| e.mr.sge(addr, len).is_some())
            .map(|(k, e)| (*k, e.tag == tag, e.leases));
        let hit = match covering {
            Some((k, true, _)) => Some(k),
            Some((k, false, 0)) => {
                let e = s.entries.remove(&k).expect("present");
                s.idle_bytes -= e.mr.len();
                s.stale += 1;
                None
            }
            Some((_, false, _)) => {
                return Err(VerbsError::Invalid(format!(
                    "memory at {addr:#x} belongs to another allocation than the registration in \
                     use there (freed while a pipe held a buffer in it?)"
                )))
            }
            None => None,
        };
        let start = match hit {
            Some(k) => k,
            None => {
                let mr: Arc<dyn MemoryRegion> = Arc::from(register()?);
                let start = mr.addr();
                if let Some(old) = s.entries.remove(&start) {
                    // Another entry starting there that does not cover this range: replace it
                    // if idle, keep both impossible (one entry per start).
                    if old.leases > 0 {
                        s.entries.insert(start, old);
                        return Err(VerbsError::Invalid(format!(
                            "a registration in use already starts at {start:#x}"
                        )));
                    }
                    s.idle_bytes -= old.mr.len();
                }
                s.registrations += 1;
                s.entries.insert(
                    start,
                    Entry {
                        mr,
                        tag,
                        leases: 0,
                        last_use: now,
                    },
                );
                start
            }
        };
        let e = s.entries.get_mut(&start).expect("present");
        if e.leases == 0 && hit.is_some() {
            let idle = e.mr.len();
            s.idle_bytes -= idle;
        }
        let e = s.entries.get_mut(&start).expect("present");
        e.leases += 1;
        e.last_use = now;
        let mr = e.mr.clone();
        Ok(Lease {
            cache: self.clone(),
            start,
            mr,
        })
    }

    fn release(&self, start: u64) {
        let mut s = self.lock();
        let Some(e) = s.entries.get_mut(&start) else {
            return;
        };
        e.leases -= 1;
        if e.leases > 0 {
            return;
        }
        let len = e.mr.len();
        s.idle_bytes += len;
        // Evict idle entries, oldest first, until the budget holds.
        while s.idle_bytes > self.keep {
            let Some(victim) = s
                .entries
                .iter()
                .filter(|(_, e)| e.leases == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k)
            else {
                break;
            };
            let e = s.entries.remove(&victim).expect("present");
            s.idle_bytes -= e.mr.len();
        }
    }

    /// Deregisters every idle entry overlapping `len` bytes at `addr` (memory about to be
    /// freed). Entries in use stay: the runtime still holds a buffer there.
    pub fn invalidate(&self, addr: u64, len: u64) {
        let mut s = self.lock();
        let end = addr.saturating_add(len);
        let doomed: Vec<u64> = s
            .entries
            .iter()
            .filter(|(k, e)| e.leases == 0 && **k < end && **k + e.mr.len() > addr)
            .map(|(k, _)| *k)
            .collect();
        for k in doomed {
            let e = s.entries.remove(&k).expect("present");
            s.idle_bytes -= e.mr.len();
        }
    }

    /// Registrations made so far (misses).
    pub fn registrations(&self) -> u64 {
        self.lock().registrations
    }

    /// Idle entries replaced because their memory was freed and reallocated (GPU memory: the
    /// buffer id changed).
    pub fn stale_replaced(&self) -> u64 {
        self.lock().stale
    }

    /// Entries alive (in use or idle).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether no entry is alive.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.cache.release(self.start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ibv::sim::SimDevice;

    #[test]
    fn chunks_respect_both_limits() {
        assert!(chunks(31).is_empty());
        assert_eq!(chunks(32), [(0, 32)]);
        assert_eq!(chunks(MAX_OP_BYTES), [(0, MAX_OP_BYTES)]);
        // 1 GiB + 5 bytes: two even halves, not 1 GiB and a 5-byte tail.
        let c = chunks(MAX_OP_BYTES + 5);
        assert_eq!(c.len(), 2);
        assert!(c
            .iter()
            .all(|&(_, l)| (MIN_OP_BYTES..=MAX_OP_BYTES).contains(&l)));
        assert_eq!(c[1].0 + c[1].1, MAX_OP_BYTES + 5);
        let c = chunks(5 * MAX_OP_BYTES - 1);
        assert_eq!(c.len(), 5);
        assert_eq!(c.iter().map(|c| c.1).sum::<u64>(), 5 * MAX_OP_BYTES - 1);
    }

    fn cache(keep: u64) -> Arc<RegCache> {
        RegCache::new(Arc::new(SimDevice::open(0)), Access::REMOTE_WRITE, keep)
    }

    #[test]
    fn buffers_inside_one_registration_share_it_while_in_use() {
        let c = cache(0);
        let mut buf = vec![0u8; 1 << 16];
        let p = buf.as_mut_ptr();
        // SAFETY: `buf` outlives every lease (dropped at the end of the test).
        let whole = unsafe { c.lease(p, buf.len()) }.unwrap();
        // SAFETY: as above.
        let part = unsafe { c.lease(p.wrapping_add(4096), 100) }.unwrap();
        assert_eq!(c.registrations(), 1);
        assert_eq!(part.mr.rkey(), whole.mr.rkey());
        drop(whole);
        drop(part);
        assert!(
            c.is_empty(),
            "no keep budget: deregistered with its last lease"
        );
    }

    #[test]
    fn a_keep_budget_reuses_idle_registrations_and_evicts_the_oldest() {
        let c = cache(2 << 16);
        let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 1 << 16]).collect();
        for b in &mut bufs {
            // SAFETY: the buffers outlive the cache's entries (invalidated below).
            drop(unsafe { c.lease(b.as_mut_ptr(), b.len()) }.unwrap());
        }
        assert_eq!(c.registrations(), 3);
        assert_eq!(c.len(), 2, "budget of two idle entries: the oldest went");
        // SAFETY: as above.
        drop(unsafe { c.lease(bufs[2].as_mut_ptr(), 1000) }.unwrap());
        assert_eq!(c.registrations(), 3, "a hit");
        for b in &bufs {
            c.invalidate(b.as_ptr() as u64, b.len() as u64);
        }
        assert!(c.is_empty());
    }

    /// A GPU that is never touched: registering does not copy.
    struct Untouched;

    impl GpuMemory for Untouched {
        fn ordinal(&self) -> u32 {
            0
        }
        fn dmabuf(&self, _: u64, _: u64) -> Result<std::os::fd::OwnedFd, String> {
            Err("none".into())
        }
        fn copy(&self, _: u64, _: u64, _: u64) -> Result<(), String> {
            Err("none".into())
        }
    }

    #[test]
    fn gpu_entries_cover_their_allocation_and_a_new_buffer_id_is_a_new_registration() {
        let c = cache(1 << 20); // a keep budget: idle entries stay, the dangerous case
        let gpu: Arc<dyn GpuMemory> = Arc::new(Untouched);
        let base = 0x7f00_0000_0000u64; // a device address: the simulation never reads it here
        let lease = |addr, len, id| {
            // SAFETY: nothing is read or written through these registrations.
            unsafe { c.lease_gpu(gpu.clone(), addr, len, (base, 1 << 16, id)) }
        };
        let a = lease(base + 256, 100, 11).unwrap();
        assert_eq!(
            (a.mr.addr(), a.mr.len()),
            (base, 1 << 16),
            "the whole allocation"
        );
        let b = lease(base + 4096, 64, 11).unwrap();
        assert_eq!(a.mr.rkey(), b.mr.rkey(), "one registration per allocation");
        assert!(
            lease(base, 64, 12).is_err(),
            "another allocation under a registration in use is refused"
        );
        let old = a.mr.rkey();
        drop((a, b));
        drop(lease(base, 64, 11).unwrap());
        assert_eq!(
            c.registrations(),
            1,
            "an idle entry of the same allocation is a hit"
        );
        // Freed and reallocated at the same address: the driver gives a new buffer id.
        let fresh = lease(base, 64, 12).unwrap();
        assert_ne!(fresh.mr.rkey(), old, "never the stale registration");
        assert_eq!((c.registrations(), c.stale_replaced()), (2, 1));
    }
}
