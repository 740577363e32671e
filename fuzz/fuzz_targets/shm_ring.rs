//! Fuzzes the shm ring against a hostile peer: the input is a sequence of our writes and reads and
//! of the peer's stores into the shared header (`actorpipe::internal::fuzz::shm_ring`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| actorpipe::internal::fuzz::shm_ring(data));
