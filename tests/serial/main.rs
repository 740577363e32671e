//! The suites that need the process to themselves while they run, in one binary that runs one
//! test at a time: every test holds [`ONE_AT_A_TIME`] (`cargo test --test serial`).
//!
//! - `peer_death`, `remote_death` and `soak` count the process's file descriptors, memfds and mappings (and
//!   `soak` its memory) before and after, so no other test may open or close any meanwhile;
//! - `io_pool` counts the process's `actix-rt` threads: another test's arbiters or I/O pool
//!   would be counted as its own;
//! - `cma_fallback` switches cma's refusal on for the whole process (`cma::simulate_refusal`):
//!   another test's cma reads would be refused too.
//!
//! In the binary of every other suite (tests/integration/) tests run side by side. A suite that
//! re-runs this binary as a child names the child's trial by its full path here
//! (`peer_death::child_process`); the child runs that trial alone. The trials that need
//! something of the host (root, cma's ptrace rights) are in tests/host/, whose binary reports
//! them skipped where they cannot run.

#[path = "../common/mod.rs"]
mod common;
/// The efa providers under test (`ACTORPIPE_EFA_PROVIDERS`), for `peer_death`'s efa backends.
#[cfg(feature = "efa")]
#[path = "../common/efa.rs"]
#[allow(dead_code)]
mod efa_support;

mod cma_fallback;
mod io_pool;
mod peer_death;
mod remote_death;
mod soak;

/// Held by every test of this binary while it runs. Each `#[actix::test]` runs on its own thread
/// and runtime, so a std mutex held across their awaits only serializes the tests (hence
/// `allow(clippy::await_holding_lock)` on them). A test that fails while holding it poisons it;
/// the others take it all the same.
pub static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
