//! The integration tests: one binary, one module per suite, so that the crate is linked once
//! (`cargo test --test integration`; one suite: `cargo test --test integration -- messages::`).
//!
//! Suites of one backend are grouped under that backend's module (`ibv::sim`); the others test
//! the pipe over whichever backends they need. The suites that cannot share a process with these
//! are binaries of their own, each with its reason above its `[[test]]` in Cargo.toml:
//! `tests/serial/` (suites that measure the whole process or switch process-wide behaviour, one
//! test at a time), `metrics`, `shared_copies`, and the `harness = false` suites (`cuda`, `gdr`,
//! `efa`, `efa_close`, `efa_domains`, `ibv_hw`).
//!
//! A suite that re-runs this binary as a child names the child's trial by its full path here
//! (`admission::shm_child`, `conformance::efa`).

#[path = "../common/mod.rs"]
mod common;
/// The efa providers under test (`ACTORPIPE_EFA_PROVIDERS`), for the efa conformance suites.
#[cfg(feature = "efa")]
#[path = "../common/efa.rs"]
#[allow(dead_code)]
mod efa_support;

mod admission;
mod api;
mod app_actor;
mod auth;
mod bad_input;
mod close;
mod conformance;
mod examples;
mod fuzz_seeds;
#[cfg(feature = "ibv")]
mod ibv;
mod liveness;
mod many_pipes;
mod messages;
mod negotiation;
mod processes;
mod protocol_doc;
mod receive;
mod remote;
mod standing;
mod topology;
mod wire_props;
mod writer;
