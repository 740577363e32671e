//! Actors that own hardware resources shared by the pipes of a context: one per context and
//! device, so the resource's lifetime and bookkeeping have a single owner on the context's
//! thread.

#[cfg(feature = "cuda")]
pub mod cuda_ipc;
#[cfg(feature = "efa")]
pub mod efa;
#[cfg(feature = "ibv")]
pub(crate) mod queue_pair;
