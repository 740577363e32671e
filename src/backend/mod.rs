//! What this build knows: every backend, whether it can run on this host, and why not.
//!
//! `actorpipe info` prints this; a pipe that picked TCP where shared memory was hoped for is
//! usually explained here (different IPC namespace, ptrace restrictions, …).

pub mod basic;
pub mod cma;
#[cfg(feature = "cuda")]
pub mod cuda_basic;
#[cfg(all(feature = "cuda", feature = "ibv"))]
pub mod cuda_gdr;
#[cfg(feature = "cuda")]
pub mod cuda_ipc;
#[cfg(feature = "cuda")]
pub mod cuda_xth;
#[cfg(feature = "efa")]
pub mod efa;
pub mod ibv;
pub mod mpt;
pub mod shm;
pub mod tcp;
pub mod xth;

use std::sync::Arc;

use serde::Serialize;

use crate::backend::basic::Basic;
use crate::backend::cma::Cma;
use crate::backend::mpt::Mpt;
use crate::backend::shm::Shm;
use crate::backend::tcp::Tcp;
use crate::backend::xth::Xth;
use crate::channel::ChannelBackend;
use crate::transport::Transport;

/// One backend's standing on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendReport {
    /// `transport` or `channel`.
    pub kind: &'static str,
    /// The backend's name.
    pub name: String,
    /// Its default priority (higher wins).
    pub priority: i32,
    /// Whether it can run here.
    pub available: bool,
    /// Why not, when it cannot.
    pub reason: Option<String>,
    /// The domain descriptor it advertises: peers must show the same string to use it.
    pub domain: String,
    /// For channels: the device pair it moves between.
    pub devices: Option<String>,
    /// For channels: connections of its own per pipe.
    pub connections: Option<u32>,
}

/// Every transport this build knows.
pub fn transports() -> Vec<Arc<dyn Transport>> {
    #[allow(unused_mut)]
    let mut v: Vec<Arc<dyn Transport>> = vec![Arc::new(Tcp::default()), Arc::new(Shm::new())];
    #[cfg(feature = "ibv")]
    v.push(Arc::new(crate::backend::ibv::transport::Ibv::hardware()));
    v
}

/// The RDMA devices of this host (real HCAs only: the simulation is not listed), or why there
/// are none.
pub fn rdma_devices() -> Result<Vec<crate::backend::ibv::DeviceInfo>, String> {
    crate::backend::ibv::hw::devices().map_err(|e| e.to_string())
}

/// Every channel this build knows (the CUDA ones once per device pair they serve).
pub fn channels() -> Vec<Arc<dyn ChannelBackend>> {
    #[allow(unused_mut)]
    let mut v: Vec<Arc<dyn ChannelBackend>> = vec![
        Arc::new(Basic),
        Arc::new(Xth),
        Arc::new(Cma),
        Arc::new(Mpt::default()),
    ];
    #[cfg(feature = "cuda")]
    {
        use crate::backend::{cuda_basic::CudaBasic, cuda_ipc::CudaIpc, cuda_xth::CudaXth};
        v.extend(CudaXth::all());
        v.extend(CudaIpc::all());
        v.extend(CudaBasic::all());
    }
    #[cfg(feature = "ibv")]
    v.push(Arc::new(crate::backend::ibv::channel::IbvChannel::new(
        crate::backend::ibv::transport::Ibv::hardware(),
    )));
    // On this host's HCAs (`channel::cuda_gdr::status` says what it lacks).
    #[cfg(all(feature = "cuda", feature = "ibv"))]
    v.extend(crate::backend::cuda_gdr::CudaGdr::all(
        crate::backend::ibv::channel::IbvChannel::new(
            crate::backend::ibv::transport::Ibv::hardware(),
        ),
    ));
    v
}

/// Reports on every backend this build knows.
pub fn report() -> Vec<BackendReport> {
    let mut v: Vec<BackendReport> = transports()
        .iter()
        .map(|t| {
            let viable = t.viable();
            BackendReport {
                kind: "transport",
                name: t.name().into(),
                priority: t.priority(),
                available: viable.is_ok(),
                reason: viable.err(),
                domain: t.domain(),
                devices: None,
                connections: None,
            }
        })
        .collect();
    v.extend(channels().iter().map(|c| {
        let viable = c.viable();
        BackendReport {
            kind: "channel",
            name: c.name().into(),
            priority: c.priority(),
            available: viable.is_ok(),
            reason: viable.err(),
            domain: c.domain(),
            devices: Some(c.devices().to_string()),
            connections: Some(c.connections()),
        }
    }));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_reports_here() {
        let r = report();
        let names: Vec<&str> = r.iter().map(|b| b.name.as_str()).collect();
        let always = ["tcp", "shm", "basic", "xth", "cma", "mpt"];
        assert!(always.iter().all(|n| names.contains(n)), "{names:?}");
        // Hardware backends (ibv) may be unavailable here; they must say why.
        for b in r.iter().filter(|b| !always.contains(&b.name.as_str())) {
            assert!(b.available || b.reason.is_some(), "{b:?}");
        }
        #[cfg(feature = "cuda")]
        {
            // Each CUDA channel once per device pair, all three carried by the pipe and
            // available exactly where CUDA is; the reason says why not.
            let cuda: Vec<_> = r
                .iter()
                .filter(|b| b.name.starts_with("cuda_") && b.name != "cuda_gdr")
                .collect();
            assert_eq!(cuda.len(), 3 + 2 + 3, "{cuda:?}");
            let want = crate::cuda::available().map(drop);
            for b in cuda {
                assert_eq!(b.available, want.is_ok(), "{b:?}");
                assert_eq!(b.reason, want.clone().err(), "{b:?}");
            }
        }
        #[cfg(all(feature = "cuda", feature = "ibv"))]
        {
            // cuda_gdr on the HCAs: once per pair, never available without CUDA.
            let gdr: Vec<_> = r.iter().filter(|b| b.name == "cuda_gdr").collect();
            assert_eq!(gdr.len(), 3, "{gdr:?}");
            for b in gdr {
                assert!(!b.available || crate::cuda::available().is_ok(), "{b:?}");
            }
        }
        for b in r.iter().filter(|b| always.contains(&b.name.as_str())) {
            // Everything can run on the development and CI machines (root, /proc, memfd).
            assert!(b.available, "{b:?}");
            assert_eq!(b.reason, None);
        }
        assert!(
            r[1].domain.contains(':'),
            "shm domain names boot, namespace and user"
        );
    }
}
