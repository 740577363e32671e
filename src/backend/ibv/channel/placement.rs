//! Which links a GPU's tensors take (`cuda_gdr` over several devices): plain logic, no GPU.
//!
//! A channel with several devices (NICs) has one link per device that paired with the peer's
//! (link 0: the first devices', link `j`: the `j`-th further pair that reaches each other). A
//! host tensor is striped over every link. A GPU tensor should go through the NICs nearest its
//! GPU on PCIe ([`crate::topology::Topology::devices_for_gpu`]: the GPU's own NIC, then the
//! others of its root complex), so each side computes, per GPU ordinal, which of its devices
//! those are ([`GpuLinks`]) and sends the table to the peer at the channel's bootstrap.
//!
//! **The sender decides.** Both sides must cut a tensor into the same stripes on the same
//! links, in order, and only the sender knows its tensor's GPU: the descriptor's channel data
//! names it ([`gpu_tag`]), and the receiver looks it up in the sender's table. Both then pick
//! the links with [`GpuLinks::links`] from the same table and the same pairs, so they agree.
//! The receiving GPU's placement plays no part (with devices paired by position, a peer set up
//! the same way has its k-th NIC next to its k-th GPU too).

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The channel data of a host tensor: no GPU.
const HOST: u64 = u64::MAX;

/// Per GPU ordinal, the devices its tensors use, by position (0: the channel's first device,
/// `k + 1`: its `k`-th further device), nearest first. An empty table, or an empty entry, means
/// "no placement known": every link, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuLinks(pub Vec<Vec<u8>>);

impl GpuLinks {
    /// The table for GPUs at PCI addresses `gpus` (by ordinal), on a channel whose devices are
    /// `devices` (names, the first device's first), placed by `topology`.
    pub fn compute(
        topology: &crate::topology::Topology,
        devices: &[String],
        gpus: &[String],
    ) -> GpuLinks {
        let entry = |gpu: &String| -> Vec<u8> {
            topology
                .devices_for_gpu(gpu, devices)
                .into_iter()
                .filter_map(|d| u8::try_from(d).ok())
                .collect()
        };
        GpuLinks(gpus.iter().map(entry).collect())
    }

    /// The links a tensor on `gpu` (`None`: host memory) takes, in stripe order, given which
    /// further devices paired with the peer's (`kept`: positions in the further list, as
    /// [`super::pair_further`] returns them). Every link (`0..=kept.len()`) for host memory,
    /// for a GPU without an entry, or where none of the GPU's devices paired.
    pub fn links(&self, gpu: Option<u32>, kept: &[usize]) -> Vec<usize> {
        let chosen: Vec<usize> = gpu
            .and_then(|g| self.0.get(g as usize))
            .map(|devices| {
                devices
                    .iter()
                    .filter_map(|&d| match d {
                        0 => Some(0),
                        d => kept
                            .iter()
                            .position(|&k| k + 1 == d as usize)
                            .map(|j| j + 1),
                    })
                    .collect()
            })
            .unwrap_or_default();
        if chosen.is_empty() {
            (0..=kept.len()).collect()
        } else {
            chosen
        }
    }

    /// The wire form: the number of GPUs (at most 255), then per GPU the number of devices and
    /// their positions, one byte each.
    pub fn encode(&self) -> Vec<u8> {
        let gpus = &self.0[..self.0.len().min(u8::MAX as usize)];
        let mut b = vec![gpus.len() as u8];
        for devices in gpus {
            let devices = &devices[..devices.len().min(u8::MAX as usize)];
            b.push(devices.len() as u8);
            b.extend_from_slice(devices);
        }
        b
    }

    /// Reads the wire form.
    pub async fn read(r: &mut (impl AsyncRead + Unpin)) -> io::Result<GpuLinks> {
        let n = r.read_u8().await?;
        let mut gpus = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let m = r.read_u8().await?;
            let mut devices = vec![0u8; m as usize];
            r.read_exact(&mut devices).await?;
            gpus.push(devices);
        }
        Ok(GpuLinks(gpus))
    }

    /// Sends ours, reads the peer's.
    pub async fn exchange(
        &self,
        read: &mut (impl AsyncRead + Unpin),
        write: &mut (impl AsyncWrite + Unpin),
    ) -> io::Result<GpuLinks> {
        write.write_all(&self.encode()).await?;
        write.flush().await?;
        GpuLinks::read(read).await
    }
}

/// The descriptor's channel data of a `cuda_gdr` tensor: the GPU it is sent from (`None`: host
/// memory), 8 bytes.
pub fn gpu_tag(gpu: Option<u32>) -> [u8; 8] {
    gpu.map_or(HOST, u64::from).to_le_bytes()
}

/// The sender's GPU from a tensor's channel data ([`gpu_tag`]).
pub fn sender_gpu(data: &[u8]) -> Result<Option<u32>, String> {
    let bytes: [u8; 8] = data
        .try_into()
        .map_err(|_| format!("cuda_gdr channel data of {} bytes, not 8", data.len()))?;
    match u64::from_le_bytes(bytes) {
        HOST => Ok(None),
        g => u32::try_from(g)
            .map(Some)
            .map_err(|_| format!("cuda_gdr channel data names GPU {g}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpus_devices_map_to_the_links_that_paired() {
        // Devices: 0 (first), 1..=3 (further 0..=2). Further 0 and 2 paired: links 1 and 2.
        let kept = [0, 2];
        let t = GpuLinks(vec![vec![3, 0], vec![2], vec![], vec![1, 2, 3]]);
        assert_eq!(
            t.links(Some(0), &kept),
            [2, 0],
            "device 3 is link 2, then the first"
        );
        // GPU 1's only device did not pair: every link.
        assert_eq!(t.links(Some(1), &kept), [0, 1, 2]);
        // No entry, an empty one, or host memory: every link.
        assert_eq!(t.links(Some(2), &kept), [0, 1, 2]);
        assert_eq!(t.links(Some(9), &kept), [0, 1, 2]);
        assert_eq!(t.links(None, &kept), [0, 1, 2]);
        assert_eq!(t.links(Some(3), &kept), [1, 2]);
        // One device, nothing further: link 0 whatever the table says.
        assert_eq!(t.links(Some(3), &[]), [0]);
        assert_eq!(GpuLinks::default().links(Some(0), &[]), [0]);
    }

    #[test]
    fn the_table_round_trips_on_the_wire() {
        let t = GpuLinks(vec![vec![1, 0], vec![], vec![2]]);
        let b = t.encode();
        assert_eq!(b, [3, 2, 1, 0, 0, 1, 2]);
        let back = block_on(GpuLinks::read(&mut &b[..])).expect("parses");
        assert_eq!(back, t);
        assert!(block_on(GpuLinks::read(&mut &b[..4])).is_err());
        assert_eq!(GpuLinks::default().encode(), [0]);
    }

    #[test]
    fn channel_data_names_the_senders_gpu() {
        assert_eq!(sender_gpu(&gpu_tag(Some(3))), Ok(Some(3)));
        assert_eq!(sender_gpu(&gpu_tag(None)), Ok(None));
        assert!(sender_gpu(&[0; 4]).is_err());
        assert!(sender_gpu(&(1u64 << 40).to_le_bytes()).is_err());
    }

    /// Runs a future that never waits (reading from a slice).
    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }
}
