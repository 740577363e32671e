//! Prints this machine's GPUs, RDMA NICs and network controllers from sysfs, the PCIe distance
//! between each GPU and each NIC, and the NIC each GPU would use (`actorpipe::internal::topology`).
//! `cargo run --example gpu_nics [-- SYSFS_ROOT]` (default `/sys`).

fn main() -> std::io::Result<()> {
    let root = std::env::args().nth(1).unwrap_or_else(|| "/sys".into());
    print!(
        "{}",
        actorpipe::internal::topology::Topology::read(&root)?.report()
    );
    Ok(())
}
