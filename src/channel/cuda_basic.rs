//! The `cuda_basic` channel: CUDA tensors over whatever CPU channel the pipe negotiated.
//!
//! The sender's channel stream waits for the user's stream (an event, no CPU block), copies the
//! tensor device-to-host in chunks into pinned staging buffers, and each chunk goes out on the
//! CPU path as soon as its copy is done, while the next chunk's copy runs: the copy of chunk
//! n + 1 overlaps the transfer of chunk n. The receiver lands each chunk in a pinned buffer and
//! copies it host-to-device on its stream. Staging buffers come from a [`PinnedPool`] and go
//! back after each chunk. It works between any two peers (other hosts included) and is the
//! fallback for every CUDA device pair.
//!
//! [`PinnedPool`]: crate::cuda::PinnedPool

use std::sync::Arc;

use super::ChannelBackend;
use crate::negotiate::{DeviceKind, DevicePair};

/// Bytes per staging chunk.
pub const CHUNK: usize = 4 << 20;
/// Chunks in flight per tensor (staging buffers a transfer holds at once).
pub const DEPTH: usize = 4;

/// The channel, for one device pair.
#[derive(Debug, Clone, Copy)]
pub struct CudaBasic {
    /// The pair this instance serves.
    pub devices: DevicePair,
}

impl CudaBasic {
    /// One instance per device pair it serves (cuda->cuda, cpu->cuda, cuda->cpu).
    pub fn all() -> Vec<Arc<dyn ChannelBackend>> {
        super::cuda_pairs()
            .into_iter()
            .map(|devices| Arc::new(CudaBasic { devices }) as Arc<dyn ChannelBackend>)
            .collect()
    }
}

impl ChannelBackend for CudaBasic {
    fn name(&self) -> &'static str {
        "cuda_basic"
    }

    fn priority(&self) -> i32 {
        0
    }

    fn domain(&self) -> String {
        String::new()
    }

    fn devices(&self) -> DevicePair {
        self.devices
    }

    fn viable(&self) -> Result<(), String> {
        crate::cuda::available().map(drop)
    }
}

/// Which legs a tensor of this pair takes through host memory: (device-to-host on the sender,
/// host-to-device on the receiver).
pub fn legs(pair: DevicePair) -> (bool, bool) {
    (
        pair.source == DeviceKind::Cuda,
        pair.target == DeviceKind::Cuda,
    )
}
