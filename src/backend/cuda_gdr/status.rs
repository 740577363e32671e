//! Whether this host can run `cuda_gdr` on real hardware, and why not (`actorpipe info`).
//!
//! It needs an RDMA device, a GPU, and a way for the HCA to reach GPU memory: a GPU whose driver
//! exports its memory as dma-buf (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`; the NVIDIA open
//! kernel modules), or the peer-memory module loaded (`nvidia_peermem`, formerly MLNX_OFED's
//! `nv_peer_mem`, as `/sys/module` lists it). The simulated device needs only the GPU.

use std::sync::OnceLock;

use crate::cuda::{self, sys};
use crate::topology::{pci_address, Topology};

/// The peer-memory modules, by the name `/sys/module` gives them.
pub const PEERMEM_MODULES: [&str; 2] = ["nvidia_peermem", "nv_peer_mem"];

/// One GPU as `cuda_gdr` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuStatus {
    /// Its CUDA ordinal.
    pub ordinal: u32,
    /// Its PCI address, as sysfs spells it.
    pub pci: String,
    /// Whether its driver exports device memory as dma-buf, or why that could not be asked.
    pub dma_buf: Result<bool, String>,
}

/// What this host offers `cuda_gdr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdrStatus {
    /// The RDMA devices (name, PCI address), or why none could be listed.
    pub rdma: Result<Vec<(String, Option<String>)>, String>,
    /// The GPUs, or why there are none.
    pub gpus: Result<Vec<GpuStatus>, String>,
    /// The peer-memory module loaded, if any.
    pub peermem: Option<&'static str>,
    /// Each GPU's NICs by PCIe topology (ordinal, names: its own first, as
    /// [`Topology::nics_for_gpu`] orders them), when there are both.
    pub nics: Vec<(u32, Vec<String>)>,
}

impl GdrStatus {
    /// This host's.
    pub fn here() -> GdrStatus {
        let rdma = crate::backend::ibv::hw::devices()
            .map(|v| v.into_iter().map(|d| (d.name, d.pci)).collect())
            .map_err(|e| e.to_string());
        let mut s = GdrStatus {
            rdma,
            gpus: gpus_here(),
            peermem: peermem_here(),
            nics: Vec::new(),
        };
        if let Ok(t) = Topology::live() {
            s.nics = s.nics_by(&t);
        }
        s
    }

    /// Each GPU's NICs in `topology`, when there are GPUs and RDMA devices.
    pub fn nics_by(&self, topology: &Topology) -> Vec<(u32, Vec<String>)> {
        let (Ok(gpus), Ok(rdma)) = (&self.gpus, &self.rdma) else {
            return Vec::new();
        };
        if rdma.is_empty() {
            return Vec::new();
        }
        gpus.iter()
            .map(|g| (g.ordinal, topology.nics_for_gpu(&g.pci, rdma.len())))
            .collect()
    }

    /// Whether `cuda_gdr` can run on this host's HCAs; if not, every reason, in one line.
    pub fn verdict(&self) -> Result<(), String> {
        let mut why = Vec::new();
        match &self.rdma {
            Err(e) => why.push(format!(
                "no RDMA device found ({})",
                e.strip_prefix("no RDMA device: ").unwrap_or(e)
            )),
            Ok(v) if v.is_empty() => why.push("no RDMA device found".to_string()),
            Ok(_) => {}
        }
        match &self.gpus {
            Err(e) => why.push(format!("no GPU ({e})")),
            Ok(v) if v.is_empty() => why.push("no GPU".to_string()),
            Ok(gpus) => {
                if let Err(e) = reachable(gpus, self.peermem) {
                    why.push(e);
                }
            }
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.join("; "))
        }
    }

    /// The account `actorpipe info` prints.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = match self.verdict() {
            Ok(()) => writeln!(out, "cuda_gdr: available on this host's HCAs"),
            Err(why) => writeln!(out, "cuda_gdr: not available: {why}"),
        };
        if let Ok(gpus) = &self.gpus {
            for g in gpus {
                let dma = match &g.dma_buf {
                    Ok(true) => "dma-buf: yes".to_string(),
                    Ok(false) => "dma-buf: no".to_string(),
                    Err(e) => format!("dma-buf: unknown ({e})"),
                };
                let _ = writeln!(out, "  cuda:{} at {}: {dma}", g.ordinal, g.pci);
            }
        }
        let _ = writeln!(
            out,
            "  peer-memory module: {}",
            self.peermem
                .map_or("none loaded (nvidia_peermem, nv_peer_mem)".into(), |m| {
                    format!("{m} loaded")
                })
        );
        for (g, nics) in &self.nics {
            let list = if nics.is_empty() {
                "none on its root complex".to_string()
            } else {
                nics.join(", ")
            };
            let _ = writeln!(out, "  cuda:{g} NICs by PCIe distance: {list}");
        }
        out
    }
}

/// Whether the HCA can reach some GPU's memory: a GPU exporting dma-buf, or a peer-memory
/// module.
fn reachable(gpus: &[GpuStatus], peermem: Option<&str>) -> Result<(), String> {
    if peermem.is_some() || gpus.iter().any(|g| g.dma_buf == Ok(true)) {
        return Ok(());
    }
    Err(format!(
        "no GPU supports dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) and no {} module is \
         loaded (/sys/module): the HCA cannot reach GPU memory",
        PEERMEM_MODULES.join(" or ")
    ))
}

/// For a hardware `cuda_gdr` channel's `viable()`: whether the HCA can reach GPU memory here
/// (asked once).
pub(crate) fn gpu_memory_reachable() -> Result<(), String> {
    static ONCE: OnceLock<Result<(), String>> = OnceLock::new();
    ONCE.get_or_init(|| reachable(&gpus_here()?, peermem_here()))
        .clone()
}

/// This host's GPUs, each with its dma-buf answer.
fn gpus_here() -> Result<Vec<GpuStatus>, String> {
    cuda::devices().map(|v| {
        v.into_iter()
            .map(|g| GpuStatus {
                ordinal: g.ordinal,
                pci: pci_address(&g.pci_bus_id),
                dma_buf: dma_buf_supported(g.ordinal),
            })
            .collect()
    })
}

/// The peer-memory module loaded here, if any.
fn peermem_here() -> Option<&'static str> {
    PEERMEM_MODULES
        .into_iter()
        .find(|m| std::path::Path::new("/sys/module").join(m).exists())
}

/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` of GPU `ordinal`.
fn dma_buf_supported(ordinal: u32) -> Result<bool, String> {
    let (mut dev, mut v) = (0, 0);
    // SAFETY: the driver is initialised (`cuda::devices` listed this ordinal); each call writes
    // its out-parameter.
    unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
            .result()
            .map_err(|e| format!("cuDeviceGet: {e}"))?;
        sys::cuDeviceGetAttribute(
            &mut v,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            dev,
        )
        .result()
        .map_err(|e| format!("cuDeviceGetAttribute(DMA_BUF_SUPPORTED): {e}"))?;
    }
    Ok(v != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(dma_buf: Result<bool, String>) -> GpuStatus {
        GpuStatus {
            ordinal: 0,
            pci: "0000:05:00.0".into(),
            dma_buf,
        }
    }

    fn status(
        rdma: Result<Vec<(String, Option<String>)>, String>,
        gpus: Result<Vec<GpuStatus>, String>,
        peermem: Option<&'static str>,
    ) -> GdrStatus {
        GdrStatus {
            rdma,
            gpus,
            peermem,
            nics: Vec::new(),
        }
    }

    #[test]
    fn the_verdict_names_every_missing_piece() {
        let hca = || Ok(vec![("mlx5_0".to_string(), Some("0000:06:00.0".into()))]);
        assert_eq!(
            status(hca(), Ok(vec![gpu(Ok(true))]), None).verdict(),
            Ok(())
        );
        assert_eq!(
            status(hca(), Ok(vec![gpu(Ok(false))]), Some("nvidia_peermem")).verdict(),
            Ok(())
        );
        let why = status(Ok(vec![]), Err("no CUDA driver".into()), None)
            .verdict()
            .unwrap_err();
        assert_eq!(why, "no RDMA device found; no GPU (no CUDA driver)");
        let why = status(
            Err("no RDMA device: ENOSYS".into()),
            Ok(vec![gpu(Ok(true))]),
            None,
        )
        .verdict()
        .unwrap_err();
        assert_eq!(why, "no RDMA device found (ENOSYS)");
        let why = status(
            hca(),
            Ok(vec![gpu(Ok(false)), gpu(Err("old".into()))]),
            None,
        )
        .verdict()
        .unwrap_err();
        assert!(why.starts_with("no GPU supports dma-buf"), "{why}");
        assert!(why.contains("nvidia_peermem or nv_peer_mem"), "{why}");
        let report = status(hca(), Ok(vec![gpu(Ok(false))]), None).report();
        assert!(
            report.contains("cuda_gdr: not available: no GPU supports"),
            "{report}"
        );
        assert!(
            report.contains("cuda:0 at 0000:05:00.0: dma-buf: no"),
            "{report}"
        );
    }

    #[test]
    fn nics_are_listed_only_with_gpus_and_hcas() {
        let t = Topology::default();
        assert!(status(Ok(vec![]), Ok(vec![gpu(Ok(true))]), None)
            .nics_by(&t)
            .is_empty());
        let s = status(
            Ok(vec![("sim0".into(), None)]),
            Ok(vec![gpu(Ok(true))]),
            None,
        );
        // The GPU is not in this (empty) tree: listed, with no NIC.
        assert_eq!(s.nics_by(&t), [(0, vec![])]);
    }

    #[test]
    fn this_host_reports_without_failing() {
        // No GPU and no HCA on the development machine: a reason, not a panic.
        let s = GdrStatus::here();
        let r = s.report();
        assert!(r.starts_with("cuda_gdr: "), "{r}");
        if s.gpus.is_err() || s.rdma.as_ref().map_or(true, Vec::is_empty) {
            assert!(s.verdict().is_err());
        }
    }
}
