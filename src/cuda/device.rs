//! Device listing for `actorpipe info`: name, memory, PCIe bus id and NUMA node of each GPU.

use serde::Serialize;

use super::{available, sys};

/// One CUDA device as the driver and sysfs describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// Device ordinal (`cuda:N`).
    pub ordinal: u32,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Total memory in bytes.
    pub memory: u64,
    /// PCIe bus id (`0000:17:00.0`).
    pub pci_bus_id: String,
    /// The NUMA node of its PCIe slot, from sysfs; `None` when the platform does not say.
    pub numa_node: Option<u32>,
}

/// Every CUDA device, or why none can be listed.
pub fn devices() -> Result<Vec<GpuInfo>, String> {
    let n = available()?;
    (0..n).map(info).collect()
}

fn info(ordinal: u32) -> Result<GpuInfo, String> {
    let mut dev = 0;
    // SAFETY: the driver is initialised (`available`); each call writes its out-parameter.
    unsafe {
        let call = |name: &str, r: sys::CUresult| r.result().map_err(|e| format!("{name}: {e}"));
        call("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
        let mut name = [0 as std::ffi::c_char; 256];
        call(
            "cuDeviceGetName",
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
        )?;
        let mut memory = 0usize;
        call(
            "cuDeviceTotalMem",
            sys::cuDeviceTotalMem_v2(&mut memory, dev),
        )?;
        let mut bus = [0 as std::ffi::c_char; 64];
        call(
            "cuDeviceGetPCIBusId",
            sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev),
        )?;
        let text = |b: &[std::ffi::c_char]| {
            std::ffi::CStr::from_ptr(b.as_ptr())
                .to_string_lossy()
                .into_owned()
        };
        let pci_bus_id = text(&bus);
        Ok(GpuInfo {
            ordinal,
            name: text(&name),
            memory: memory as u64,
            numa_node: numa_node(&pci_bus_id),
            pci_bus_id,
        })
    }
}

/// The NUMA node sysfs gives for a PCI device (`-1`, or no file, means unknown).
pub(crate) fn numa_node(pci_bus_id: &str) -> Option<u32> {
    let path = format!(
        "/sys/bus/pci/devices/{}/numa_node",
        pci_bus_id.to_ascii_lowercase()
    );
    parse_numa(&std::fs::read_to_string(path).ok()?)
}

fn parse_numa(s: &str) -> Option<u32> {
    s.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_node_files_parse() {
        assert_eq!(parse_numa("1\n"), Some(1));
        assert_eq!(parse_numa("-1\n"), None);
        assert_eq!(parse_numa("junk"), None);
        assert_eq!(numa_node("ffff:ff:ff.f"), None);
    }

    #[test]
    fn listing_agrees_with_the_host() {
        let listed = devices();
        match crate::cuda::host_has() {
            (false, _) => assert_eq!(
                listed,
                Err(crate::cuda::tests::NO_LIBRARY.to_string()),
                "no driver library loads here"
            ),
            (true, 0) => {
                let why = listed.expect_err("no GPU is listed, yet devices are");
                assert!(why.starts_with("the CUDA driver "), "{why}");
            }
            (true, gpus) => {
                let list = listed.unwrap_or_else(|why| panic!("{gpus} GPUs listed: {why}"));
                assert_eq!(list.len() as u32, available().unwrap());
                for (i, gpu) in list.iter().enumerate() {
                    assert_eq!(gpu.ordinal, i as u32);
                    assert!(!gpu.name.is_empty() && gpu.memory > 0, "{gpu:?}");
                    // A PCI address: domain:bus:device.function, in hexadecimal.
                    let parts: Vec<&str> = gpu.pci_bus_id.split([':', '.']).collect();
                    assert_eq!(parts.len(), 4, "{gpu:?}");
                    assert!(
                        parts.iter().all(|p| u32::from_str_radix(p, 16).is_ok()),
                        "{gpu:?}"
                    );
                }
            }
        }
    }
}
