//! `bench channel --backend cuda_gdr` (features `cuda` and `ibv`): the `cuda_gdr` channel on
//! the SIMULATED verbs device, both sides in this process, with a real GPU. The simulated
//! NIC's "DMA" is a CUDA driver copy, so the rows measure this code's own overhead per tensor
//! (requests, registrations of GPU memory, completions, the actors' wake-ups, stream
//! ordering) next to the driver's copy of the same path, not an HCA. A second pair of pipes
//! stripes each tensor over two simulated devices (tensors over 64 KiB: one stripe per device).

use actorpipe::channel::CudaGdr;
use actorpipe::channel::IbvChannel;
use actorpipe::internal::topology::Topology;
use actorpipe::transport::Ibv;
use actorpipe::ContextBuilder;

/// The simulated device of the one-device pipes.
pub const ONE: [usize; 1] = [0];
/// The simulated devices of the striped pipes.
pub const STRIPED: [usize; 2] = [1, 2];

/// What the table says about the device, on its own line.
pub const DEVICE_LINE: &str = "  device:   SIMULATED verbs device (sim0; the striped column: sim1 + sim2), both sides in this process: the NIC's DMA is a CUDA driver copy, so this measures actorpipe's own overhead, not an HCA\n";

/// The header of the striped column.
pub const STRIPED_LABEL: &str = "2 SIMULATED devices";

/// `b` with `cuda_gdr` on the simulated devices `devices` (the first, then further ones,
/// placed nowhere: every tensor over every device) and without the CUDA channels that would
/// win over it (`cuda_xth`, `cuda_ipc`).
pub fn with_gdr(b: ContextBuilder, devices: &[usize]) -> ContextBuilder {
    let further = devices[1..]
        .iter()
        .map(|&d| Ibv::simulated_device(d))
        .collect();
    let chan = IbvChannel::new(Ibv::simulated_device(devices[0]))
        .with_devices(further)
        .with_topology(Topology::default());
    CudaGdr::all(chan)
        .into_iter()
        .fold(b.without("cuda_xth").without("cuda_ipc"), |b, c| {
            b.channel(c)
        })
}
