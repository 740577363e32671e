//! The `cuda_gdr` channel (features `ibv` and `cuda`): CUDA tensors by RDMA write between
//! registered buffers (GPUDirect RDMA), the NIC reading the sender's GPU memory and writing the
//! receiver's. The protocol is the `ibv` channel's ([`crate::backend::ibv::channel::core`]), unchanged:
//! the receiver registers the buffer it allocated and asks for the tensor, the sender writes it
//! in chunks of at most 1 GiB, the last write with immediate. What this module adds:
//!
//! - **Registering GPU memory**: the whole allocation holding a tensor (its base and size from
//!   `cuMemGetAddressRange`), through [`Device::register_gpu`](crate::backend::ibv::Device::register_gpu):
//!   a dma-buf of the range (`cuMemGetHandleForAddressRange`) on hardware, else the device
//!   pointer itself (`nvidia-peermem`); on the **simulated** device, the CUDA driver's copies
//!   stand in for the NIC's DMA ([`GpuDma::copy`]).
//! - **The registration cache** ([`crate::backend::ibv::regcache::RegCache::lease_gpu`]): entries keyed
//!   by (GPU, allocation range) with the allocation's buffer id, so memory freed and reallocated
//!   at the same address is a new registration (docs/ibv.md states the invalidation rule).
//! - **Streams** (`driver.rs`): writes are posted once the tensor's stream has
//!   run the work queued before the write; a read completes with an event, as the other CUDA
//!   channels' reads do.
//!
//! - **NICs per GPU**: with several devices ([`IbvChannel::with_devices`]) placed on PCIe
//!   ([`IbvChannel::with_topology`]; real HCAs are placed by sysfs), a tensor on GPU `g` goes
//!   through the links of `g`'s NICs (its own first), striped over them when large; the
//!   descriptor names `g` so the receiver picks the same links ([`crate::backend::ibv::channel::placement`]).
//!   Unplaced devices: every link, as for host tensors.
//!
//! One backend per device pair it serves (cuda->cuda, cpu->cuda, cuda->cpu), all sharing one
//! [`IbvChannel`] (devices, protection domains, caches). Not offered by default: add
//! [`CudaGdr::all`] with the ibv transport (docs/ibv.md). The domain is the ibv channel's plus
//! `+gpu`, so it is chosen only between peers that reach each other over verbs and both offer
//! GPU memory. [`status`] says whether this host can run it (`actorpipe info`).

#[cfg(feature = "ibv")]
pub(crate) mod driver;
pub mod status;

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use crate::backend::ibv::channel::placement::GpuLinks;
use crate::backend::ibv::channel::IbvChannel;
use crate::backend::ibv::regcache::{Lease, RegCache};
use crate::backend::ibv::{GpuMemory, VerbsError};
use crate::channel::ChannelBackend;
use crate::cuda::{self, sys, Gpu};
use crate::negotiate::DevicePair;

/// The channel, for one device pair.
#[derive(Debug, Clone)]
pub struct CudaGdr {
    devices: DevicePair,
    chan: IbvChannel,
}

impl CudaGdr {
    /// One instance per device pair it serves, sharing `chan`'s device and caches: add each to a
    /// [`ContextBuilder`](crate::ContextBuilder) with `.channel(..)`.
    pub fn all(chan: IbvChannel) -> Vec<Arc<dyn ChannelBackend>> {
        crate::channel::cuda_pairs()
            .into_iter()
            .map(|devices| {
                Arc::new(CudaGdr {
                    devices,
                    chan: chan.clone(),
                }) as Arc<dyn ChannelBackend>
            })
            .collect()
    }

    /// The ibv channel whose device, queue pairs and protocol it uses.
    pub fn ibv(&self) -> &IbvChannel {
        &self.chan
    }
}

impl crate::channel::sealed::Sealed for CudaGdr {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        {
            let _ = at;
            ChannelKind::CudaGdr
        }
    }
}

impl ChannelBackend for CudaGdr {
    fn name(&self) -> &'static str {
        "cuda_gdr"
    }

    fn priority(&self) -> i32 {
        // Above cuda_basic (0: staged through host memory), below cuda_ipc and cuda_xth, which
        // copy inside one host without the NIC.
        100
    }

    fn domain(&self) -> String {
        format!("{}+gpu", self.chan.domain())
    }

    fn devices(&self) -> DevicePair {
        self.devices
    }

    fn connections(&self) -> u32 {
        1
    }

    fn viable(&self) -> Result<(), String> {
        cuda::available()?;
        self.chan.viable()?;
        if self.chan.device().is_simulated() {
            // The simulated device "DMA"s with the CUDA driver's copies.
            return Ok(());
        }
        status::gpu_memory_reachable()
    }

    fn lane_read_buffer(&self) -> usize {
        self.chan.lane_read_buffer()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// A GPU, as the verbs layer sees it: dma-buf export, and copies for the simulated device.
pub struct GpuDma(pub Arc<Gpu>);

impl GpuMemory for GpuDma {
    fn ordinal(&self) -> u32 {
        self.0.ordinal()
    }

    fn dmabuf(&self, addr: u64, len: u64) -> Result<OwnedFd, String> {
        self.0.bind().map_err(|e| e.to_string())?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the context is current; the call writes one int (the descriptor) into `fd`.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                addr,
                len as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        cuda::check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", r).map_err(|e| e.to_string())?;
        if fd < 0 {
            return Err("cuMemGetHandleForAddressRange returned no descriptor".into());
        }
        // SAFETY: the driver just created the descriptor for us; nobody else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<(), String> {
        let stream = self.0.lease_stream().map_err(|e| e.to_string())?;
        self.0.bind().map_err(|e| e.to_string())?;
        // SAFETY: the simulated fabric checked both ranges against live registrations (whose
        // memory stays allocated while registered); unified addressing lets the driver tell
        // host from device memory. The copy is waited for before returning.
        unsafe {
            cuda::check(
                "cuMemcpyAsync",
                sys::cuMemcpyAsync(dst, src, len as usize, stream.cu_stream()),
            )
            .and_then(|_| {
                cuda::check(
                    "cuStreamSynchronize",
                    sys::cuStreamSynchronize(stream.cu_stream()),
                )
            })
        }
        .map_err(|e| e.to_string())
    }
}

/// The registration of `len` bytes of `gpu`'s memory at `ptr` (a tensor, or a stripe of one)
/// from `cache`: the whole allocation holding them, cached by (GPU, allocation range, buffer
/// id).
///
/// # Safety
/// The memory must stay allocated while the lease lives (and, with a keep budget, until the
/// cache drops the entry).
pub(crate) unsafe fn lease(
    cache: &Arc<RegCache>,
    gpu: &Arc<Gpu>,
    ptr: u64,
    len: usize,
) -> Result<Lease, VerbsError> {
    let alloc = crate::backend::cuda_ipc::ipc::allocation_of(gpu, ptr)
        .map_err(|e| VerbsError::Invalid(format!("finding the tensor's allocation: {e}")))?;
    let dma: Arc<dyn GpuMemory> = Arc::new(GpuDma(gpu.clone()));
    // SAFETY: forwarded.
    unsafe { cache.lease_gpu(dma, ptr, len as u64, alloc) }
}

/// This host's GPUs' PCI addresses, by ordinal, as sysfs spells them (none without a GPU).
fn gpu_addresses() -> &'static [String] {
    static GPUS: OnceLock<Vec<String>> = OnceLock::new();
    GPUS.get_or_init(|| {
        cuda::devices()
            .map(|d| {
                d.iter()
                    .map(|g| crate::topology::pci_address(&g.pci_bus_id))
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Which of a channel's devices (`devices`: names, the first device's first) each of this
/// host's GPUs uses, by the channel's topology. Empty with one device (nothing to choose) or no
/// placement.
pub(crate) fn gpu_links(chan: &IbvChannel, devices: &[String]) -> GpuLinks {
    if devices.len() < 2 {
        return GpuLinks::default();
    }
    match chan.topology() {
        Some(t) => GpuLinks::compute(&t, devices, gpu_addresses()),
        None => GpuLinks::default(),
    }
}

/// Makes RDMA writes that landed in this device's memory visible to work queued after this
/// call (`cuFlushGPUDirectRDMAWrites`); a no-op where the platform orders them anyway.
pub(crate) fn flush_rdma_writes(gpu: &Gpu) -> crate::Result<()> {
    gpu.bind()?;
    // SAFETY: the context is current; the call takes two enum values.
    let r = unsafe {
        sys::cuFlushGPUDirectRDMAWrites(
            sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
        )
    };
    match r {
        // A device or platform without the flush orders RDMA writes without it.
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => Ok(()),
        r => cuda::check("cuFlushGPUDirectRDMAWrites", r),
    }
}
