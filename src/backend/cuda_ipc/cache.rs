//! The CUDA IPC handle cache of one device: what we exported and what we opened from peers
//! ([`IpcCache`]), and its bookkeeping. The actor in `actors/hardware/cuda_ipc.rs` owns one per
//! context and device.
//!
//! Entries are keyed by (peer, allocation, operation): the peer is the pipe, the
//! allocation the *exporting* process's buffer id (unique for the life of that process, so a
//! freed allocation and a new one at the same address never share a key), the operation whether
//! we export (send) or open (receive). Each entry also keeps the handle bytes it was made for: a
//! lookup whose handle differs replaces the entry instead of returning it. The map is bounded;
//! the least recently used entry goes first, and a closing peer takes all of its entries along.

use std::collections::HashMap;
use std::hash::Hash;

use std::sync::Arc;

use super::ipc::{self, Exported, NotExportable, Opened, RemoteEvent, HANDLE_LEN};
use crate::cuda::{gpu, sys, Gpu};

/// Which side of a transfer an entry serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// We export our allocation to the peer.
    Send,
    /// We opened the peer's allocation.
    Recv,
}

/// A cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// The pipe the peer is on.
    pub peer: u64,
    /// The exporting process's buffer id of the allocation.
    pub allocation: u64,
    /// Export or open.
    pub op: Operation,
}

/// Hits, misses and entries of a cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that had to export or open.
    pub misses: u64,
    /// Entries that were found stale (same key, other handle) and replaced.
    pub stale: u64,
    /// Entries evicted by the bound.
    pub evicted: u64,
    /// Entries held now.
    pub entries: usize,
}

struct Entry<V> {
    handle: [u8; HANDLE_LEN],
    value: V,
    used: u64,
}

/// A bounded map from [`Key`] to `V` (an exported handle, an opened mapping), least recently
/// used first out. Dropping a value releases it (closes a mapping).
pub struct Lru<V> {
    map: HashMap<Key, Entry<V>>,
    bound: usize,
    clock: u64,
    stats: Stats,
}

impl<V> Lru<V> {
    /// An empty cache of at most `bound` entries (at least 1).
    pub fn new(bound: usize) -> Self {
        Lru {
            map: HashMap::new(),
            bound: bound.max(1),
            clock: 0,
            stats: Stats::default(),
        }
    }

    /// The value for `key` made for `handle`, or a new one from `make` (a miss). A cached value
    /// made for another handle is stale: it is dropped first. `make` failing leaves the cache
    /// without the key.
    pub fn get_or_try<E>(
        &mut self,
        key: Key,
        handle: &[u8; HANDLE_LEN],
        make: impl FnOnce() -> Result<V, E>,
    ) -> Result<&V, E> {
        self.clock += 1;
        let hit = match self.map.get_mut(&key) {
            Some(e) if &e.handle == handle => {
                e.used = self.clock;
                true
            }
            Some(_) => {
                self.stats.stale += 1;
                self.map.remove(&key);
                false
            }
            None => false,
        };
        if hit {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
            let value = make()?;
            if self.map.len() >= self.bound {
                self.evict_one();
            }
            self.map.insert(
                key,
                Entry {
                    handle: *handle,
                    value,
                    used: self.clock,
                },
            );
        }
        self.stats.entries = self.map.len();
        Ok(&self.map.get(&key).expect("present").value)
    }

    /// The entry for `key`, if cached (a hit): (its handle, its value), marked used. A caller
    /// that finds nothing makes the value and [`Self::insert`]s it (the miss).
    pub fn get(&mut self, key: &Key) -> Option<(&[u8; HANDLE_LEN], &V)> {
        self.clock += 1;
        let clock = self.clock;
        let e = self.map.get_mut(key)?;
        e.used = clock;
        self.stats.hits += 1;
        Some((&e.handle, &e.value))
    }

    /// The value for `key` if it was made for `handle` (a hit). An entry made for another
    /// handle is stale: it is dropped and counted, and `None` returned, as for an absent key.
    pub fn lookup(&mut self, key: &Key, handle: &[u8; HANDLE_LEN]) -> Option<&V> {
        self.clock += 1;
        let stale = self.map.get(key).is_some_and(|e| &e.handle != handle);
        if stale {
            self.map.remove(key);
            self.stats.stale += 1;
            self.stats.entries = self.map.len();
            return None;
        }
        let e = self.map.get_mut(key)?;
        e.used = self.clock;
        self.stats.hits += 1;
        Some(&e.value)
    }

    /// Stores a value made elsewhere (a miss answered by the caller).
    pub fn insert(&mut self, key: Key, handle: [u8; HANDLE_LEN], value: V) {
        self.clock += 1;
        self.stats.misses += 1;
        if !self.map.contains_key(&key) && self.map.len() >= self.bound {
            self.evict_one();
        }
        self.map.insert(
            key,
            Entry {
                handle,
                value,
                used: self.clock,
            },
        );
        self.stats.entries = self.map.len();
    }

    fn evict_one(&mut self) {
        if let Some(k) = self.map.iter().min_by_key(|(_, e)| e.used).map(|(k, _)| *k) {
            self.map.remove(&k);
            self.stats.evicted += 1;
        }
    }

    /// Drops the entries for which `drop` says so; returns how many.
    pub fn evict_where(&mut self, mut drop: impl FnMut(&Key, &V) -> bool) -> usize {
        let before = self.map.len();
        self.map.retain(|k, e| !drop(k, &e.value));
        self.stats.evicted += (before - self.map.len()) as u64;
        self.stats.entries = self.map.len();
        before - self.map.len()
    }

    /// Drops every entry of `peer` (its pipe closed); returns how many.
    pub fn close_peer(&mut self, peer: u64) -> usize {
        let before = self.map.len();
        self.map.retain(|k, _| k.peer != peer);
        self.stats.entries = self.map.len();
        before - self.map.len()
    }

    /// Drops every entry of `allocation` exported by us (the allocation is being freed).
    pub fn forget_allocation(&mut self, allocation: u64) {
        self.map
            .retain(|k, _| !(k.allocation == allocation && k.op == Operation::Send));
        self.stats.entries = self.map.len();
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Entries each map of a cache keeps by default.
pub const DEFAULT_BOUND: usize = 256;

/// An opened allocation and where it lives in the exporting process.
struct Mapped {
    mapping: Arc<Opened>,
    base: u64,
    size: u64,
}

/// The cache of one device.
pub struct IpcCache {
    gpu: Arc<Gpu>,
    exported: Lru<Exported>,
    opened: Lru<Mapped>,
    events: Lru<Arc<RemoteEvent>>,
}

impl IpcCache {
    /// A cache for device `ordinal` with `bound` entries per map.
    pub fn new(ordinal: u32, bound: usize) -> crate::Result<Self> {
        Ok(IpcCache {
            gpu: gpu(ordinal)?,
            exported: Lru::new(bound),
            opened: Lru::new(bound),
            events: Lru::new(bound),
        })
    }
}

impl IpcCache {
    /// Exports the allocation holding `ptr` to `peer` (the `Export` message of the cache actor,
    /// callable without a message: the channel actor runs it on the same thread).
    pub fn export(
        &mut self,
        peer: u64,
        ptr: sys::CUdeviceptr,
    ) -> crate::Result<Result<Exported, NotExportable>> {
        let (base, size, buffer_id) = ipc::allocation_of(&self.gpu, ptr)?;
        let key = Key {
            peer,
            allocation: buffer_id,
            op: Operation::Send,
        };
        if let Some((_, e)) = self.exported.get(&key) {
            crate::metrics::cuda_ipc_lookup("export", true);
            return Ok(Ok(Exported {
                offset: ptr - base,
                ..*e
            }));
        }
        crate::metrics::cuda_ipc_lookup("export", false);
        let e = match ipc::export(&self.gpu, ptr)? {
            Ok(e) => e,
            Err(not) => return Ok(Err(not)),
        };
        debug_assert_eq!((e.buffer_id, e.size), (buffer_id, size));
        self.exported.insert(key, e.handle, e);
        Ok(Ok(e))
    }

    /// Opens `peer`'s exported allocation `e` (the cache actor's `Open`, without a message).
    ///
    /// On a miss, the entries of the same peer whose allocations overlap the new one in the
    /// peer's address space are dropped first: the peer freed them (two live allocations never
    /// overlap), and their mappings would otherwise keep that memory allocated.
    pub fn open(&mut self, peer: u64, e: &Exported) -> crate::Result<Arc<Opened>> {
        let key = Key {
            peer,
            allocation: e.buffer_id,
            op: Operation::Recv,
        };
        if let Some(m) = self.opened.lookup(&key, &e.handle) {
            crate::metrics::cuda_ipc_lookup("open", true);
            return Ok(m.mapping.clone());
        }
        crate::metrics::cuda_ipc_lookup("open", false);
        let (start, end) = (e.base, e.base.saturating_add(e.size));
        self.opened.evict_where(|k, m| {
            k.peer == peer && m.base < end && start < m.base.saturating_add(m.size)
        });
        let mapping = Arc::new(ipc::open(&self.gpu, &e.handle, e.size)?);
        self.opened.insert(
            key,
            e.handle,
            Mapped {
                mapping: mapping.clone(),
                base: e.base,
                size: e.size,
            },
        );
        Ok(mapping)
    }

    /// Opens `peer`'s interprocess event `handle` (the cache actor's `OpenEvent`, without a
    /// message).
    pub fn open_event(
        &mut self,
        peer: u64,
        handle: &[u8; HANDLE_LEN],
    ) -> crate::Result<Arc<RemoteEvent>> {
        let key = Key {
            peer,
            allocation: fnv(handle),
            op: Operation::Recv,
        };
        let gpu = &self.gpu;
        Ok(self
            .events
            .get_or_try(key, handle, || ipc::open_event(gpu, handle).map(Arc::new))?
            .clone())
    }

    /// Drops every entry of `peer` (the cache actor's `ClosePeer`, without a message).
    pub fn close_peer(&mut self, peer: u64) {
        self.exported.close_peer(peer);
        self.opened.close_peer(peer);
        self.events.close_peer(peer);
    }

    /// The counters of the three maps: exports, opened allocations, events (the cache actor's
    /// `GetStats`, without a message).
    pub fn stats(&self) -> (Stats, Stats, Stats) {
        (
            self.exported.stats(),
            self.opened.stats(),
            self.events.stats(),
        )
    }
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    fn key(peer: u64, allocation: u64) -> Key {
        Key {
            peer,
            allocation,
            op: Operation::Recv,
        }
    }

    #[test]
    fn hits_misses_and_stale_handles() {
        let mut c = Lru::new(4);
        let h1 = [1u8; HANDLE_LEN];
        let h2 = [2u8; HANDLE_LEN];
        let mut made = 0;
        let mut get = |c: &mut Lru<u32>, k, h: &[u8; HANDLE_LEN]| {
            *c.get_or_try::<()>(k, h, || {
                made += 1;
                Ok(made)
            })
            .unwrap()
        };
        assert_eq!(get(&mut c, key(1, 10), &h1), 1);
        assert_eq!(get(&mut c, key(1, 10), &h1), 1, "cached");
        // Same key, another handle (an allocation freed and one made at the same place): never
        // the old mapping.
        assert_eq!(get(&mut c, key(1, 10), &h2), 2);
        assert_eq!(
            get(&mut c, key(2, 10), &h2),
            3,
            "another peer, another entry"
        );
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.stale, s.entries), (1, 3, 1, 2));
        assert_eq!(c.lookup(&key(2, 10), &h2), Some(&3));
        assert_eq!(c.lookup(&key(2, 10), &h1), None, "stale: dropped");
        assert_eq!(c.evict_where(|k, _| k.peer == 1), 1);
        assert!(c.is_empty());
    }

    #[test]
    fn bound_evicts_least_recently_used_and_drops_values() {
        let live = Rc::new(());
        let mut c = Lru::new(2);
        let h = [0u8; HANDLE_LEN];
        for a in 0..2 {
            c.get_or_try::<()>(key(1, a), &h, || Ok(live.clone()))
                .unwrap();
        }
        c.get(&key(1, 0)); // 1 is now the least recently used
        c.get_or_try::<()>(key(1, 2), &h, || Ok(live.clone()))
            .unwrap();
        assert!(c.get(&key(1, 1)).is_none());
        assert!(c.get(&key(1, 0)).is_some());
        assert_eq!(Rc::strong_count(&live), 3, "the evicted value was dropped");
        assert_eq!(c.close_peer(1), 2);
        assert_eq!(
            Rc::strong_count(&live),
            1,
            "closing the peer drops its entries"
        );
        assert_eq!(c.stats().evicted, 1);
    }

    #[test]
    fn a_failed_open_caches_nothing() {
        let mut c: Lru<u8> = Lru::new(2);
        let h = [0u8; HANDLE_LEN];
        assert!(c.get_or_try(key(1, 1), &h, || Err("no")).is_err());
        assert!(c.is_empty());
    }
}
