//! Fuzzes what an ibv peer sends outside the data: the transport's bootstrap hello and the
//! channel's write requests (`actorpipe::internal::fuzz::ibv_control`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| actorpipe::internal::fuzz::ibv_control(data));
