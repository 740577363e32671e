//! The ibv backend (transport and channel) on the simulated device. The conformance suite runs
//! it too (`conformance::ibv_*`); hardware runs are in tests/ibv_hw.rs (a binary of its own:
//! libtest-mimic, to report them skipped where there is no RDMA device).

mod sim;

/// The simulated fabric is one per process: a test that counts its queue pairs or injects faults
/// into them holds this for writing, so that no other test's queue pairs come and go meanwhile;
/// the conformance suite's ibv cases, which only make queue pairs of their own, hold it for
/// reading (they may run together).
pub static SIMULATED_FABRIC: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());
