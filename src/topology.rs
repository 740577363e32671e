//! PCIe topology: which NIC each GPU should use.
//!
//! On a machine with several GPUs and several RDMA NICs, a GPU should send through the NIC
//! nearest to it on PCIe: usually the one behind the same PCIe switch. A GPU whose traffic
//! crosses the host bridge, or the link between CPU sockets, shares that link with everyone
//! else's, and one NIC used by every GPU is a bottleneck while the others idle (hence "GPU to
//! NIC matching"). This module reads the PCI tree from sysfs, measures the distance between two
//! devices by their deepest common ancestor, and assigns GPUs to NICs nearest first while
//! spreading them evenly.
//!
//! It is plain data and file reading, with no dependency on any RDMA backend, so the `ibv` and
//! `efa` backends (and anything else) share it.
//!
//! # The tree
//!
//! `/sys/bus/pci/devices/<address>` is a symbolic link into `/sys/devices`, whose path lists
//! every bridge above the device, from its root complex down:
//! `../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:04:00.0`. Two devices
//! below the same PCIe switch share the switch's ports in their paths; two devices of different
//! CPU sockets share nothing but the root (`/sys/devices`). The distance is the number of links
//! from each device up to their deepest common ancestor, added; devices of different root
//! complexes get [`CROSS_ROOT`] instead, which is more than any path within one.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// The distance between two devices of different root complexes (different host bridges,
/// usually different CPU sockets): larger than any distance within one tree.
pub const CROSS_ROOT: u32 = 1000;

/// PCI vendor id of NVIDIA.
pub const VENDOR_NVIDIA: u32 = 0x10de;

/// One PCI function, as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// Its address, `0000:17:00.0`.
    pub address: String,
    /// Its class code (`0x030200` for a 3D controller, `0x020700` for InfiniBand).
    pub class: u32,
    /// Its vendor id.
    pub vendor: u32,
    /// Its ancestors from the root complex (`pci0000:00`) down, then itself.
    pub path: Vec<String>,
}

impl PciDevice {
    /// Whether it is an NVIDIA display or 3D controller (a GPU).
    pub fn is_gpu(&self) -> bool {
        self.vendor == VENDOR_NVIDIA && matches!(self.class >> 8, 0x0300 | 0x0302)
    }
}

/// How far apart two devices are on PCIe: links up to the deepest common ancestor, both sides
/// added; [`CROSS_ROOT`] for devices of different root complexes.
pub fn distance(a: &PciDevice, b: &PciDevice) -> u32 {
    let common = a
        .path
        .iter()
        .zip(&b.path)
        .take_while(|(x, y)| x == y)
        .count();
    if common == 0 {
        return CROSS_ROOT;
    }
    (a.path.len() - common + b.path.len() - common) as u32
}

/// The PCI devices of a machine and its RDMA NICs, read from a sysfs tree.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// Every PCI function, by address.
    pub devices: BTreeMap<String, PciDevice>,
    /// RDMA devices (`/sys/class/infiniband/<name>`) and their PCI addresses, by name.
    pub rdma: BTreeMap<String, String>,
}

fn read_hex(path: &Path) -> Option<u32> {
    let s = std::fs::read_to_string(path).ok()?;
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

/// The bridges above a device, from the link target of `/sys/bus/pci/devices/<address>`.
fn ancestry(target: &Path) -> Vec<String> {
    let parts: Vec<String> = target
        .components()
        .filter_map(|c| match c {
            std::path::Component::Normal(s) => s.to_str().map(str::to_string),
            _ => None,
        })
        .collect();
    match parts.iter().position(|p| p == "devices") {
        Some(i) => parts[i + 1..].to_vec(),
        None => parts,
    }
}

impl Topology {
    /// Reads the tree under `sysfs` (`/sys` on a live machine, a recorded copy in tests).
    pub fn read(sysfs: impl AsRef<Path>) -> io::Result<Topology> {
        let sysfs = sysfs.as_ref();
        let mut devices = BTreeMap::new();
        for entry in std::fs::read_dir(sysfs.join("bus/pci/devices"))? {
            let entry = entry?;
            let Some(address) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let link = entry.path();
            let target = std::fs::read_link(&link).unwrap_or_else(|_| link.clone());
            devices.insert(
                address.clone(),
                PciDevice {
                    class: read_hex(&link.join("class")).unwrap_or(0),
                    vendor: read_hex(&link.join("vendor")).unwrap_or(0),
                    path: ancestry(&target),
                    address,
                },
            );
        }
        let mut rdma = BTreeMap::new();
        if let Ok(dir) = std::fs::read_dir(sysfs.join("class/infiniband")) {
            for entry in dir.flatten() {
                let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                let dev = std::fs::read_link(entry.path().join("device")).ok();
                if let Some(addr) = dev.as_deref().and_then(Path::file_name) {
                    rdma.insert(name, addr.to_string_lossy().into_owned());
                }
            }
        }
        Ok(Topology { devices, rdma })
    }

    /// The live machine's tree (`/sys`).
    pub fn live() -> io::Result<Topology> {
        Topology::read("/sys")
    }

    /// The GPUs, in PCI address order (CUDA's order with `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub fn gpus(&self) -> Vec<&PciDevice> {
        self.devices.values().filter(|d| d.is_gpu()).collect()
    }

    /// The RDMA NICs as `(name, device)`, in name order.
    pub fn nics(&self) -> Vec<(&str, &PciDevice)> {
        self.rdma
            .iter()
            .filter_map(|(n, a)| self.devices.get(a).map(|d| (n.as_str(), d)))
            .collect()
    }

    /// Each GPU's NIC (see [`assign`]), as `(GPU address, NIC name)`, in GPU order.
    pub fn gpu_nics(&self) -> Vec<(String, String)> {
        let gpus = self.gpus();
        let nics = self.nics();
        let devs: Vec<&PciDevice> = nics.iter().map(|(_, d)| *d).collect();
        assign(&gpus, &devs)
            .into_iter()
            .enumerate()
            .filter_map(|(g, n)| Some((gpus[g].address.clone(), nics[n?].0.to_string())))
            .collect()
    }

    /// The NICs from nearest to farthest from `gpu`, for striping a large tensor over several:
    /// `(name, distance)`.
    pub fn nics_by_distance(&self, gpu: &PciDevice) -> Vec<(String, u32)> {
        let mut v: Vec<(String, u32)> = self
            .nics()
            .into_iter()
            .map(|(n, d)| (n.to_string(), distance(gpu, d)))
            .collect();
        v.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        v
    }

    /// The NICs for the GPU at PCI address `gpu`, in the order a channel should use them
    /// (its first device, then further ones to stripe over): the GPU's own NIC by [`assign`]
    /// (so GPUs spread over the NICs), then the other NICs of its root complex, nearest first
    /// (a NIC across the root complexes would send the GPU's bytes over the CPUs'
    /// interconnect), at most `max` in all. Empty for an unknown GPU or no NIC.
    pub fn nics_for_gpu(&self, gpu: &str, max: usize) -> Vec<String> {
        let Some(dev) = self.devices.get(gpu) else {
            return Vec::new();
        };
        let own = self
            .gpu_nics()
            .into_iter()
            .find(|(g, _)| g == gpu)
            .map(|(_, n)| n);
        let rest: Vec<String> = self
            .nics_by_distance(dev)
            .into_iter()
            .filter(|(n, d)| *d < CROSS_ROOT && Some(n) != own.as_ref())
            .map(|(n, _)| n)
            .collect();
        own.into_iter().chain(rest).take(max).collect()
    }

    /// Places the RDMA device `name` at PCI address `pci` (any spelling [`pci_address`]
    /// accepts): what `/sys/class/infiniband/<name>/device` says for a real HCA, and the only
    /// way a simulated device (`sim<i>`, which sysfs does not list) gets a place. The address
    /// should be one of [`Self::devices`]; a device placed elsewhere is as good as unplaced.
    pub fn place(mut self, name: &str, pci: &str) -> Topology {
        self.rdma.insert(name.to_string(), pci_address(pci));
        self
    }

    /// For the GPU at PCI address `gpu`, which of a channel's RDMA devices (`devices`, by name,
    /// in the channel's order) its tensors should use: their positions in `devices`, in
    /// [`Self::nics_for_gpu`] order (its own NIC first, then the others of its root complex),
    /// chosen among those devices only (the tree's other NICs are not the channel's to use,
    /// and GPUs spread over the channel's). Empty where the GPU is not in the tree or none of
    /// the devices is placed: the caller then uses every device.
    pub fn devices_for_gpu(&self, gpu: &str, devices: &[String]) -> Vec<usize> {
        let mut mine = self.clone();
        mine.rdma.retain(|name, _| devices.contains(name));
        mine.nics_for_gpu(&pci_address(gpu), devices.len())
            .iter()
            .filter_map(|n| devices.iter().position(|d| d == n))
            .collect()
    }
}

/// A PCI address as sysfs spells it: lower case, a 4-digit domain (`cuDeviceGetPCIBusId` and
/// `nvidia-smi` may give `00000000:1B:00.0`; sysfs names it `0000:1b:00.0`).
pub fn pci_address(s: &str) -> String {
    let s = s.trim().to_ascii_lowercase();
    match s.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => s,
    }
}

impl Topology {
    /// A plain-text account of the tree: GPUs, RDMA NICs, network controllers, and each GPU's
    /// NIC with its distance to every NIC. With no RDMA NIC, the GPUs are also matched to the
    /// network controllers (class `02xxxx`), to show the assignment on a real tree.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let gpus = self.gpus();
        let _ = writeln!(
            out,
            "{} PCI functions, {} GPUs",
            self.devices.len(),
            gpus.len()
        );
        for g in &gpus {
            let _ = writeln!(out, "gpu {} at {}", g.address, g.path.join("/"));
        }
        let rdma: Vec<(String, &PciDevice)> = self
            .nics()
            .into_iter()
            .map(|(n, d)| (n.to_string(), d))
            .collect();
        let net: Vec<(String, &PciDevice)> = self
            .devices
            .values()
            .filter(|d| d.class >> 16 == 0x02)
            .map(|d| {
                (
                    format!("{} ({:06x} {:04x})", d.address, d.class, d.vendor),
                    d,
                )
            })
            .collect();
        for (label, nics) in [("rdma", &rdma), ("net", &net)] {
            for (n, d) in nics.iter() {
                let _ = writeln!(out, "{label} {n} at {}", d.path.join("/"));
            }
            if nics.is_empty() || gpus.is_empty() {
                let _ = writeln!(out, "{label}: nothing to match");
                continue;
            }
            let devs: Vec<&PciDevice> = nics.iter().map(|(_, d)| *d).collect();
            for (g, n) in gpus.iter().zip(assign(&gpus, &devs)) {
                let dist: Vec<String> = devs.iter().map(|d| distance(g, d).to_string()).collect();
                let chosen = n.map_or("-", |i| nics[i].0.as_str());
                let _ = writeln!(
                    out,
                    "{label}: gpu {} -> {chosen} (distances {})",
                    g.address,
                    dist.join(" ")
                );
            }
        }
        out
    }
}

/// Assigns each GPU a NIC: nearest first, and no NIC takes more than `⌈gpus / nics⌉` GPUs, so
/// that GPUs spread over every NIC. Pairs are taken in order of distance (ties: the GPU and NIC
/// that come first); a GPU whose nearest NICs are full gets the nearest with room. Returns, per
/// GPU, the index of its NIC in `nics` (`None` only when there is no NIC).
pub fn assign(gpus: &[&PciDevice], nics: &[&PciDevice]) -> Vec<Option<usize>> {
    let mut out = vec![None; gpus.len()];
    if nics.is_empty() {
        return out;
    }
    let cap = gpus.len().div_ceil(nics.len()).max(1);
    let mut pairs: Vec<(u32, usize, usize)> = Vec::with_capacity(gpus.len() * nics.len());
    for (g, gpu) in gpus.iter().enumerate() {
        for (n, nic) in nics.iter().enumerate() {
            pairs.push((distance(gpu, nic), g, n));
        }
    }
    pairs.sort_unstable();
    let mut load = vec![0usize; nics.len()];
    for (_, g, n) in pairs {
        if out[g].is_none() && load[n] < cap {
            out[g] = Some(n);
            load[n] += 1;
        }
    }
    out
}

/// Writes a sysfs tree under `root` from a recorded listing (see `tests/fixtures/topology/`):
/// one line per PCI function, `pci <address> <class> <vendor> <path below /sys/devices>`, and
/// one per RDMA device, `rdma <name> <address>`. Used by tests and by `actorpipe` to replay a
/// machine's tree.
pub fn materialize(listing: &str, root: &Path) -> io::Result<()> {
    let bad = |line: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad line {line:?}"));
    let bus = root.join("bus/pci/devices");
    std::fs::create_dir_all(&bus)?;
    for line in listing.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["pci", address, class, vendor, path] => {
                let dir: PathBuf = root.join("devices").join(path);
                std::fs::create_dir_all(&dir)?;
                std::fs::write(dir.join("class"), format!("{class}\n"))?;
                std::fs::write(dir.join("vendor"), format!("{vendor}\n"))?;
                std::os::unix::fs::symlink(
                    Path::new("../../../devices").join(path),
                    bus.join(address),
                )?;
            }
            ["rdma", name, address] => {
                let dir = root.join("class/infiniband").join(name);
                std::fs::create_dir_all(&dir)?;
                std::os::unix::fs::symlink(
                    Path::new("../../../bus/pci/devices").join(address),
                    dir.join("device"),
                )?;
            }
            _ => return Err(bad(line)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(path: &str) -> PciDevice {
        let path: Vec<String> = path.split('/').map(str::to_string).collect();
        PciDevice {
            address: path.last().unwrap().clone(),
            class: 0x030200,
            vendor: VENDOR_NVIDIA,
            path,
        }
    }

    #[test]
    fn distance_counts_links_to_the_common_ancestor() {
        let a = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0");
        let b = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0");
        let c = dev("pci0000:00/0000:00:03.0/0000:05:00.0");
        let d = dev("pci0000:80/0000:80:01.0/0000:81:00.0");
        assert_eq!(distance(&a, &b), 4); // same switch
        assert_eq!(distance(&a, &c), 6); // same host bridge
        assert_eq!(distance(&a, &d), CROSS_ROOT); // another socket
        assert_eq!(distance(&a, &a), 0);
    }

    #[test]
    fn pci_addresses_are_spelled_as_sysfs_does() {
        assert_eq!(pci_address("00000000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(pci_address("0000:1b:00.0\n"), "0000:1b:00.0");
        assert_eq!(pci_address("0001:C0:00.1"), "0001:c0:00.1");
    }

    #[test]
    fn assign_spreads_when_every_nic_is_equally_far() {
        let gpus: Vec<PciDevice> = (0..4)
            .map(|i| dev(&format!("pci0000:00/0000:00:0{i}.0/0000:0{i}:00.0")))
            .collect();
        let nic = dev("pci0000:80/0000:80:01.0/0000:81:00.0");
        let nic2 = dev("pci0000:80/0000:80:02.0/0000:82:00.0");
        let g: Vec<&PciDevice> = gpus.iter().collect();
        let out = assign(&g, &[&nic, &nic2]);
        assert_eq!(out, [Some(0), Some(0), Some(1), Some(1)]);
        assert_eq!(assign(&g, &[]), [None, None, None, None]);
    }
}
