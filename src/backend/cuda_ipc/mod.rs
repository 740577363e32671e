//! The `cuda_ipc` channel: two processes of one host that see the same GPUs, through CUDA IPC handles.
//!
//! Sending a tensor of `len` bytes at device pointer `p`:
//!
//! 1. An interprocess event from the device's pool is recorded on the tensor's stream: the
//!    *ready* event. The CPU does not wait for it.
//! 2. The handle cache ([`IpcCache`]) exports the allocation holding `p` (base from
//!    `cuMemGetAddressRange`, offset `p - base`), or finds it exported already for this peer.
//! 3. The descriptor carries [`IpcTensor`]: the allocation's handle, buffer id, size, the offset,
//!    and the ready event's handle.
//!
//! Receiving it into device memory (or host memory, for cuda->cpu):
//!
//! 1. The cache opens the handle (or finds it open: a cached open costs no driver call) and the
//!    event handle.
//! 2. The receiving stream waits on the ready event (`cuStreamWaitEvent`), then copies from the
//!    mapping on the GPU; the receiver records its completion event after the copy.
//! 3. A callback of the device's watcher ([`crate::cuda::on_stream_done`]) acknowledges the
//!    tensor to the sender once the copy has run: only then does the sender hand the buffer back. Neither side
//!    blocks its CPU on the GPU.
//!
//! Memory that cannot be exported (the stream-ordered allocator's pools, which cudarc uses where
//! the device has them) is copied first into an exportable staging allocation of the channel's:
//! one extra device-to-device copy, counted as a fallback.
//!
//! [`IpcCache`]: crate::backend::cuda_ipc::cache::IpcCache

pub mod cache;
pub mod ipc;

use std::sync::{Arc, OnceLock};

use crate::backend::cuda_ipc::ipc::{Exported, HANDLE_LEN};
use crate::channel::ChannelBackend;
use crate::negotiate::{DeviceKind, DevicePair};

/// Bytes of [`IpcTensor`] on the wire.
pub const IPC_TENSOR_LEN: usize = 2 * HANDLE_LEN + 4 * 8 + 4;

/// The channel, for one device pair (cuda->cuda, cuda->cpu: the receiver reads the sender's
/// device memory; a host buffer on the sender has no CUDA handle, so cpu->cuda is left to
/// `cuda_basic`).
#[derive(Debug, Clone, Copy)]
pub struct CudaIpc {
    /// The pair this instance serves.
    pub devices: DevicePair,
}

impl CudaIpc {
    /// One instance per device pair it serves.
    pub fn all() -> Vec<Arc<dyn ChannelBackend>> {
        crate::channel::cuda_pairs()
            .into_iter()
            .filter(|p| p.source == DeviceKind::Cuda)
            .map(|devices| Arc::new(CudaIpc { devices }) as Arc<dyn ChannelBackend>)
            .collect()
    }
}

/// The IPC domain: the boot id (one host) and the PCIe bus ids of the GPUs this process sees,
/// so that two processes use CUDA IPC only when each can open the other's devices (containers
/// that see other GPUs, or none, fall back to `cuda_basic`).
pub fn domain() -> String {
    static DOMAIN: OnceLock<String> = OnceLock::new();
    DOMAIN
        .get_or_init(|| {
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            let mut gpus: Vec<String> = crate::cuda::devices()
                .map(|l| l.into_iter().map(|d| d.pci_bus_id).collect())
                .unwrap_or_default();
            gpus.sort();
            format!("boot={boot};gpus={}", gpus.join(","))
        })
        .clone()
}

impl crate::channel::sealed::Sealed for CudaIpc {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::CudaIpc { pipe: at.pipe }
    }
}

impl ChannelBackend for CudaIpc {
    fn name(&self) -> &'static str {
        "cuda_ipc"
    }

    fn priority(&self) -> i32 {
        200
    }

    fn domain(&self) -> String {
        domain()
    }

    fn devices(&self) -> DevicePair {
        self.devices
    }

    /// One side connection: each side acknowledges the tensors it received on it.
    fn connections(&self) -> u32 {
        1
    }

    /// Acknowledgements only: small frames.
    fn lane_read_buffer(&self) -> usize {
        crate::backend::cma::SIDE_READ_BUFFER
    }

    fn viable(&self) -> Result<(), String> {
        // Carried by its driver (actors/hardware/cuda_ipc/driver.rs), on a host whose boot id can be
        // read.
        crate::cuda::available()?;
        if std::fs::metadata("/proc/sys/kernel/random/boot_id").is_err() {
            return Err("cannot read the boot id: no way to tell peers of this host".into());
        }
        Ok(())
    }
}

/// What a descriptor carries for one cuda_ipc tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcTensor {
    /// The allocation's handle, buffer id, size, and the tensor's offset in it.
    pub memory: Exported,
    /// The handle of the interprocess event recorded when the data was ready.
    pub ready: [u8; HANDLE_LEN],
    /// The sender's device ordinal.
    pub device: u32,
}

impl IpcTensor {
    /// The wire form ([`IPC_TENSOR_LEN`] bytes).
    pub fn encode(&self) -> [u8; IPC_TENSOR_LEN] {
        let mut b = [0u8; IPC_TENSOR_LEN];
        b[..HANDLE_LEN].copy_from_slice(&self.memory.handle);
        let mut at = HANDLE_LEN;
        for v in [
            self.memory.buffer_id,
            self.memory.offset,
            self.memory.size,
            self.memory.base,
        ] {
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            at += 8;
        }
        b[at..at + HANDLE_LEN].copy_from_slice(&self.ready);
        at += HANDLE_LEN;
        b[at..at + 4].copy_from_slice(&self.device.to_le_bytes());
        b
    }

    /// Reads the wire form; `None` if the bytes are not one, or the tensor (`len` bytes) does not
    /// fit in the allocation they describe.
    pub fn decode(b: &[u8], len: u64) -> Option<IpcTensor> {
        if b.len() != IPC_TENSOR_LEN {
            return None;
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let memory = Exported {
            handle: b[..HANDLE_LEN].try_into().ok()?,
            buffer_id: u64_at(HANDLE_LEN),
            offset: u64_at(HANDLE_LEN + 8),
            size: u64_at(HANDLE_LEN + 16),
            base: u64_at(HANDLE_LEN + 24),
        };
        let at = HANDLE_LEN + 32;
        let t = IpcTensor {
            memory,
            ready: b[at..at + HANDLE_LEN].try_into().ok()?,
            device: u32::from_le_bytes(b[at + HANDLE_LEN..].try_into().ok()?),
        };
        let end = t.memory.offset.checked_add(len)?;
        (end <= t.memory.size).then_some(t)
    }
}

// ----- the two halves of a transfer ---------------------------------------------------------

use crate::backend::cuda_ipc::cache::IpcCache;
use crate::cuda::{CudaBuffer, CudaStream, Event};

use crate::backend::cuda_xth::End;

/// A tensor on its way out: what the descriptor carries, and what the sender holds until the
/// receiver's acknowledgement (the ready event, and the staging copy if there is one).
#[derive(Debug)]
pub struct Outgoing {
    /// The descriptor's channel data.
    pub data: IpcTensor,
    /// The ready event (back to its pool when this is dropped: the receiver has waited on it).
    pub ready: Event,
    /// The exportable copy of a tensor whose own memory cannot be exported.
    pub staging: Option<CudaBuffer>,
}

/// Staging allocations of one channel, reused (each keeps its buffer id, so the peer's opened
/// handle stays cached).
#[derive(Debug, Default)]
pub struct Staging {
    free: Vec<CudaBuffer>,
}

impl Staging {
    /// A staging buffer of `len` bytes or more on `device`.
    pub fn take(&mut self, device: u32, len: usize) -> crate::Result<CudaBuffer> {
        match self
            .free
            .iter()
            .position(|b| b.device() == device && b.len() >= len)
        {
            Some(i) => Ok(self.free.swap_remove(i)),
            None => CudaBuffer::alloc(device, len.max(1)),
        }
    }

    /// Gives a staging buffer back (the peer acknowledged it).
    pub fn put(&mut self, b: CudaBuffer) {
        if self.free.len() < 8 {
            self.free.push(b);
        }
    }
}

/// The sender's half: records the ready event on the tensor's stream and exports its allocation
/// through the cache (staging it first if it cannot be exported). The CPU does not wait.
pub fn send(
    cache: &mut IpcCache,
    staging: &mut Staging,
    peer: u64,
    buf: &CudaBuffer,
) -> crate::Result<Outgoing> {
    let gpu = buf.gpu();
    let ready = gpu.event(true)?;
    let (memory, staged) = match cache.export(peer, buf.device_ptr())? {
        Ok(e) => (e, None),
        Err(_) => {
            crate::metrics::fallback("cuda_ipc");
            let s = staging.take(buf.device(), buf.len())?;
            // SAFETY: both ranges hold `len` bytes of this device; the staging buffer is held
            // until the receiver acknowledges, the user's until the write completes.
            unsafe {
                crate::cuda::copy_async(
                    (s.device_ptr(), gpu),
                    (buf.device_ptr(), gpu),
                    buf.len(),
                    buf.stream(),
                )?
            };
            let e = cache
                .export(peer, s.device_ptr())?
                .map_err(|e| crate::Error::Device {
                    detail: e.0,
                    origin: Default::default(),
                })?;
            (e, Some(s))
        }
    };
    ready.record(buf.stream())?;
    Ok(Outgoing {
        data: IpcTensor {
            memory,
            ready: crate::backend::cuda_ipc::ipc::export_event(&ready)?,
            device: buf.device(),
        },
        ready,
        staging: staged,
    })
}

/// The receiver's half: opens the allocation and the ready event through the cache, makes
/// `stream` wait on the event, and queues the copy into `dst` on it. Returns the event recorded
/// after the copy (`None` for host memory, where the bytes have landed on return). `copied` runs
/// on a driver thread once the copy has run: it acknowledges the tensor to the sender.
pub fn receive(
    cache: &mut IpcCache,
    peer: u64,
    t: &IpcTensor,
    dst: End,
    len: usize,
    stream: &Arc<CudaStream>,
    copied: impl FnOnce() + Send + 'static,
) -> crate::Result<Option<Event>> {
    use crate::cuda::{check, sys};
    let mapping = cache.open(peer, &t.memory)?;
    let ready = cache.open_event(peer, &t.ready)?;
    ready.wait_on(stream)?;
    let src = mapping.base() + t.memory.offset;
    let done = match dst {
        End::Device { ptr, gpu } => {
            // SAFETY: the mapping holds `offset + len` bytes (checked at decode) and is unmapped
            // only after a context synchronize (see `Opened`); `dst` is the caller's.
            unsafe { crate::cuda::copy_async((ptr, &gpu), (src, mapping.gpu()), len, stream)? };
            Some(gpu.recorded(stream)?)
        }
        End::Host { ptr } => {
            mapping.gpu().bind()?;
            if len > 0 {
                // SAFETY: as above, and the stream is synchronized before returning.
                check("cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(ptr as *mut _, src, len, stream.cu_stream())
                })?;
            }
            None
        }
    };
    // The mapping needs no holding here: unmapping it (an eviction, the peer's pipe closing)
    // synchronizes the context first, so a queued copy finishes before its source goes.
    crate::cuda::on_stream_done(stream, copied)?;
    if done.is_none() {
        stream
            .synchronize()
            .map_err(|e| crate::cuda::driver_error("cuStreamSynchronize", e))?;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_data_round_trips_and_is_checked() {
        let t = IpcTensor {
            memory: Exported {
                handle: [7; HANDLE_LEN],
                buffer_id: 42,
                offset: 4096,
                size: 1 << 20,
                base: 0x7f00_0000_0000,
            },
            ready: [9; HANDLE_LEN],
            device: 1,
        };
        let b = t.encode();
        assert_eq!(IpcTensor::decode(&b, 100), Some(t));
        assert_eq!(IpcTensor::decode(&b, (1 << 20) - 4096), Some(t));
        assert_eq!(
            IpcTensor::decode(&b, (1 << 20) - 4095),
            None,
            "past the end"
        );
        assert_eq!(IpcTensor::decode(&b[1..], 1), None, "short");
        let mut evil = t;
        evil.memory.offset = u64::MAX;
        assert_eq!(IpcTensor::decode(&evil.encode(), 2), None, "overflow");
    }
}
