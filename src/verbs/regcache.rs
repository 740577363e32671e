//! A registration cache keyed by address range, and the chunk plan for large RDMA transfers.
//!
//! Registering memory pins its pages and programs the HCA's translation tables: a system call
//! and page-table walk per page, far too slow for every tensor (seed 001: "a setup step").
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

use super::{Access, Device, MemoryRegion, VerbsError, MAX_OP_BYTES, MIN_OP_BYTES};

/// Splits `len` bytes into RDMA operations of at most 1 GiB and at least 32 bytes each, as even
/// as possible: `(offset, length)` pairs. Empty for `len` under 32 (send such bytes inline).
pub fn chunks(len: u64) -> Vec<(u64, u64)> {
    if len < MIN_OP_BYTES {
        return Vec::new();
    }
    let n = len.div_ceil(MAX_OP_BYTES);
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
    leases: usize,
    last_use: u64,
}

struct State {
    /// By start address.
    entries: BTreeMap<u64, Entry>,
    clock: u64,
    idle_bytes: u64,
    registrations: u64,
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
        let (a, l) = (addr as u64, len as u64);
        let mut s = self.lock();
        s.clock += 1;
        let now = s.clock;
        let hit = s
            .entries
            .range(..=a)
            .next_back()
            .filter(|(_, e)| e.mr.sge(a, l).is_some())
            .map(|(k, _)| *k);
        let start = match hit {
            Some(k) => k,
            None => {
                // SAFETY: forwarded from this function's contract.
                let mr: Arc<dyn MemoryRegion> =
                    Arc::from(unsafe { self.device.register(addr, len, self.access) }?);
                s.registrations += 1;
                s.entries.insert(
                    a,
                    Entry {
                        mr,
                        leases: 0,
                        last_use: now,
                    },
                );
                a
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
    use crate::verbs::sim::SimDevice;

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
}
