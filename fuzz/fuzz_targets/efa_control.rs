//! Fuzzes what an efa peer sends outside the data: the channel's domain list and the tags of its
//! messages (`actorpipe::internal::fuzz::efa_control`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| actorpipe::internal::fuzz::efa_control(data));
