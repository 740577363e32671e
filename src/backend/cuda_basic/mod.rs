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

pub(crate) mod driver;

use std::sync::Arc;

use crate::channel::ChannelBackend;
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
        crate::channel::cuda_pairs()
            .into_iter()
            .map(|devices| Arc::new(CudaBasic { devices }) as Arc<dyn ChannelBackend>)
            .collect()
    }
}

impl crate::channel::sealed::Sealed for CudaBasic {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        {
            let _ = at;
            ChannelKind::CudaBasic
        }
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

    /// One connection of its own: the chunks travel on it, both ways.
    fn connections(&self) -> u32 {
        1
    }

    fn viable(&self) -> Result<(), String> {
        // Carried by its driver (driver.rs).
        crate::cuda::available().map(drop)
    }
}

/// The process's pool of pinned staging chunks ([`CHUNK`] bytes; up to 4 × [`DEPTH`] idle).
pub fn pool() -> &'static Arc<crate::cuda::PinnedPool> {
    static POOL: std::sync::OnceLock<Arc<crate::cuda::PinnedPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| crate::cuda::PinnedPool::new(CHUNK, 4 * DEPTH))
}

/// Which legs a tensor of this pair takes through host memory: (device-to-host on the sender,
/// host-to-device on the receiver).
pub fn legs(pair: DevicePair) -> (bool, bool) {
    (
        pair.source == DeviceKind::Cuda,
        pair.target == DeviceKind::Cuda,
    )
}

// ----- the two legs through host memory ---------------------------------------------------------

use crate::cuda::{check, sys, CudaStream, Gpu, PinnedBuf};

/// Sender's leg for one chunk: queues the device-to-host copy of `n` bytes at `src` into the
/// pinned buffer `chunk` on `stream`; `landed` gets the buffer back on a driver thread once the
/// bytes are in it (or never, if the stream fails: the caller's own error path then returns
/// it). `landed` must not call the CUDA API (nor drop the buffer there: hand it to a thread
/// that may).
///
/// # Safety
/// `src` must be `n` bytes of `gpu`'s memory, alive until `landed` runs; `n <= chunk.len()`.
pub unsafe fn stage_out(
    gpu: &Gpu,
    src: sys::CUdeviceptr,
    n: usize,
    chunk: PinnedBuf,
    stream: &CudaStream,
    landed: impl FnOnce(PinnedBuf) + Send + 'static,
) -> crate::Result<()> {
    debug_assert!(n <= chunk.len());
    gpu.bind()?;
    // SAFETY: the caller's contract; the pinned buffer travels with the callback, so it lives
    // until the copy has run.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(chunk.as_ptr().cast(), src, n, stream.cu_stream())
    })?;
    crate::cuda::on_stream_done(stream, move || landed(chunk))
}

/// Receiver's leg for one chunk: queues the host-to-device copy of `n` bytes from the pinned
/// buffer `chunk` to `dst` on `stream`; `free` gets the buffer back on a driver thread once the
/// copy has read it (same rules as [`stage_out`]).
///
/// # Safety
/// `dst` must be `n` bytes of `gpu`'s memory, alive until the copy has run; `n <= chunk.len()`.
pub unsafe fn stage_in(
    gpu: &Gpu,
    dst: sys::CUdeviceptr,
    n: usize,
    chunk: PinnedBuf,
    stream: &CudaStream,
    free: impl FnOnce(PinnedBuf) + Send + 'static,
) -> crate::Result<()> {
    debug_assert!(n <= chunk.len());
    gpu.bind()?;
    // SAFETY: as in `stage_out`.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, chunk.as_ptr().cast(), n, stream.cu_stream())
    })?;
    crate::cuda::on_stream_done(stream, move || free(chunk))
}
