//! The hash map of hot lookups keyed by our own numbers: a channel's held tensors by (direction,
//! message, tensor), xth's rendezvous table, the efa endpoint's pipes and its registration cache.
//!
//! Their keys are our own numbers and addresses, or sequence numbers the pipe has checked
//! against the next one it expects, never a peer's free choice, and each map holds only what is
//! in flight; so SipHash's resistance to chosen keys buys nothing here. It cost about 110
//! instructions a lookup: some 3,000 instructions per 64 B round trip of `bench efa`'s
//! `transport` row and 5,800 of its `channel` row (callgrind, git history's docs/efa-measurements.md,
//! "Instruction counts"). This one is a multiply and a rotate per word (the `FxHash` of rustc).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` keyed by our own small integers (see the module docs).
pub type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// The hasher of [`KeyMap`]: a multiply per word; `finish` rotates the well-mixed high bits
/// down, where the table takes its bucket index.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

const SEED: u64 = 0xf135_7aea_2e62_a9c5;

impl KeyHasher {
    fn add(&mut self, word: u64) {
        self.0 = self.0.wrapping_add(word).wrapping_mul(SEED);
    }
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(n as u64);
    }

    fn write_u32(&mut self, n: u32) {
        self.add(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_pipes_and_buffers_like_any_map() {
        let mut pipes: KeyMap<u32, u32> = KeyMap::default();
        for p in 0..5000 {
            pipes.insert(p, p * 2);
        }
        assert!((0..5000).all(|p| pipes.get(&p) == Some(&(p * 2))));
        pipes.retain(|p, _| p % 3 == 0);
        assert_eq!(pipes.len(), 1667);
        let mut regs: KeyMap<(usize, usize), u8> = KeyMap::default();
        regs.insert((0x7f00_0000_1000, 64), 1);
        regs.insert((0x7f00_0000_1000, 128), 2);
        assert_eq!(regs.get(&(0x7f00_0000_1000, 64)), Some(&1));
        assert_eq!(regs.get(&(0x7f00_0000_1000, 128)), Some(&2));
        assert_eq!(regs.get(&(0x7f00_0000_1040, 64)), None);
    }

    #[test]
    fn consecutive_keys_spread_over_buckets_and_control_bytes() {
        // hashbrown takes the bucket from the low bits and a 7-bit tag from the top ones.
        let hash = |p: u32| {
            let mut h = KeyHasher::default();
            h.write_u32(p);
            h.finish()
        };
        let low: std::collections::HashSet<u64> = (0..64).map(|p| hash(p) & 63).collect();
        let top: std::collections::HashSet<u64> = (0..64).map(|p| hash(p) >> 57).collect();
        assert!(low.len() > 32, "{} low-bit buckets", low.len());
        assert!(top.len() > 32, "{} top tags", top.len());
    }
}
