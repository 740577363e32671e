//! The bookkeeping of the CUDA IPC handle cache (the actor in `actors/hardware/` drives it).
//!
//! Entries are keyed by (peer, allocation, operation): the peer is the pipe, the
//! allocation the *exporting* process's buffer id (unique for the life of that process, so a
//! freed allocation and a new one at the same address never share a key), the operation whether
//! we export (send) or open (receive). Each entry also keeps the handle bytes it was made for: a
//! lookup whose handle differs replaces the entry instead of returning it. The map is bounded;
//! the least recently used entry goes first, and a closing peer takes all of its entries along.

use std::collections::HashMap;
use std::hash::Hash;

use super::ipc::HANDLE_LEN;

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
