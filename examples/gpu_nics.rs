//! Prints this machine's GPUs, RDMA NICs and network controllers from sysfs, the PCIe distance
//! between each GPU and each NIC, and the NIC each GPU would use (`actorpipe::topology`).
//! With no RDMA NIC it also matches the GPUs to the plain network controllers, to show the
//! assignment on the real tree. `cargo run --example gpu_nics [-- SYSFS_ROOT]`.

use actorpipe::topology::{assign, distance, PciDevice, Topology};

fn main() -> std::io::Result<()> {
    let root = std::env::args().nth(1).unwrap_or_else(|| "/sys".into());
    let t = Topology::read(&root)?;
    let gpus = t.gpus();
    println!("{} PCI functions under {root}", t.devices.len());
    for g in &gpus {
        println!("gpu {} path {}", g.address, g.path.join("/"));
    }
    let rdma: Vec<(String, &PciDevice)> = t
        .nics()
        .into_iter()
        .map(|(n, d)| (n.to_string(), d))
        .collect();
    for (n, d) in &rdma {
        println!("rdma {n} at {} path {}", d.address, d.path.join("/"));
    }
    // Network controllers (class 02xxxx), for a machine without RDMA NICs.
    let net: Vec<(String, &PciDevice)> = t
        .devices
        .values()
        .filter(|d| d.class >> 16 == 0x02)
        .map(|d| (d.address.clone(), d))
        .collect();
    for (_, d) in &net {
        println!(
            "net {} class {:06x} vendor {:04x} path {}",
            d.address,
            d.class,
            d.vendor,
            d.path.join("/")
        );
    }
    for (label, nics) in [("rdma", &rdma), ("net", &net)] {
        if nics.is_empty() || gpus.is_empty() {
            println!(
                "{label}: nothing to match ({} GPUs, {} NICs)",
                gpus.len(),
                nics.len()
            );
            continue;
        }
        let devs: Vec<&PciDevice> = nics.iter().map(|(_, d)| *d).collect();
        for (g, n) in gpus.iter().zip(assign(&gpus, &devs)) {
            let dist: Vec<String> = devs.iter().map(|d| distance(g, d).to_string()).collect();
            let chosen = n.map_or("-".to_string(), |i| nics[i].0.clone());
            println!(
                "{label}: gpu {} -> {chosen} (distances {})",
                g.address,
                dist.join(" ")
            );
        }
    }
    Ok(())
}
