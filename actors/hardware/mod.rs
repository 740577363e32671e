//! Actors that own hardware resources shared by the pipes of a context: one per context and
//! device, so the resource's lifetime and bookkeeping have a single owner on the context's
//! thread. Beside each is the code of its backend that talks to it: the CUDA IPC handle cache's
//! `cuda_ipc` channel driver, and the EFA endpoint's transport, channel backend and channel
//! driver. Every other backend is in `src/backend/<name>/` whole.

#[cfg(feature = "cuda")]
pub mod cuda_ipc;
#[cfg(feature = "efa")]
pub mod efa;
