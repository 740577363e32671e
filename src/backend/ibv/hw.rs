//! Real HCAs, through `sideway` (which loads `libibverbs` at run time), with the `ibv` feature.
//!
//! Without the feature, or where `libibverbs` finds no device, [`devices`] says why there is
//! none. Listing fails with `ENOSYS` when the library loads but no provider (kernel driver)
//! answers: that is "no devices", as on every machine this project has run on so far.

use super::*;

/// Why this host has no usable RDMA device, or the devices it has.
pub fn devices() -> Result<Vec<DeviceInfo>, VerbsError> {
    imp::devices()
}

/// Opens port `port` of the device called `name` (GID index `gid_index`).
pub fn open(name: &str, port: u8, gid_index: u8) -> Result<Box<dyn Device>, VerbsError> {
    imp::open(name, port, gid_index)
}

/// The PCI address of an RDMA device, from sysfs (`/sys/class/infiniband/<name>/device`).
pub fn pci_address(name: &str) -> Option<String> {
    let link = std::fs::read_link(format!("/sys/class/infiniband/{name}/device")).ok()?;
    link.file_name()?.to_str().map(str::to_string)
}

#[cfg(not(feature = "ibv"))]
mod imp {
    use super::*;

    pub(super) fn devices() -> Result<Vec<DeviceInfo>, VerbsError> {
        Err(VerbsError::NoDevice(
            "built without the `ibv` feature (cargo build --features ibv)".into(),
        ))
    }

    pub(super) fn open(_: &str, _: u8, _: u8) -> Result<Box<dyn Device>, VerbsError> {
        devices().map(|_| unreachable!())
    }
}

#[cfg(feature = "ibv")]
mod imp {
    use std::os::fd::{AsRawFd, RawFd};
    use std::sync::Arc;

    use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event};
    use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
    use sideway::ibverbs::completion::{
        BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue,
        PollCompletionQueueError, WorkCompletionOperationType, WorkCompletionStatus,
    };
    use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
    use sideway::ibverbs::device_context::{self, DeviceContext, PortState};
    use sideway::ibverbs::protection_domain::ProtectionDomain;
    use sideway::ibverbs::queue_pair::{
        BasicQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairState,
        SetScatterGatherEntry, WorkRequestFlags,
    };
    use sideway::ibverbs::AccessFlags;

    use super::*;

    fn lib(call: &'static str, e: impl std::fmt::Display) -> VerbsError {
        VerbsError::Library {
            call,
            detail: e.to_string(),
        }
    }

    fn list() -> Result<DeviceList, VerbsError> {
        DeviceList::new().map_err(|e| {
            let text = format!("{e:?}");
            if text.contains("38") || text.contains("not implemented") {
                VerbsError::NoDevice(
                    "libibverbs loaded, but no RDMA device or provider is present (ENOSYS)".into(),
                )
            } else {
                VerbsError::NoDevice(format!("ibv_get_device_list failed: {e}"))
            }
        })
    }

    fn port_info(ctx: &DeviceContext, port: u8, gid_index: u8) -> Option<PortInfo> {
        let attr = ctx.query_port(port).ok()?;
        let gid = ctx
            .query_gid(port, gid_index.into())
            .map(|g: Gid| g.raw)
            .unwrap_or_default();
        Some(PortInfo {
            port,
            link_layer: match attr.link_layer() {
                device_context::LinkLayer::Ethernet => LinkLayer::Ethernet,
                _ => LinkLayer::InfiniBand,
            },
            active: attr.port_state() == PortState::Active,
            lid: attr.lid(),
            gid,
            gid_index,
            mtu: 128u32 << (attr.active_mtu() as u32),
        })
    }

    pub(super) fn devices() -> Result<Vec<DeviceInfo>, VerbsError> {
        let list = list()?;
        let mut out = Vec::new();
        for dev in &list {
            let name = dev.name();
            let Ok(ctx) = dev.open() else { continue };
            let ports = ctx.query_device().map(|a| a.phys_port_cnt()).unwrap_or(1);
            out.push(DeviceInfo {
                pci: pci_address(&name),
                guid: dev.guid().as_u64(),
                ports: (1..=ports).filter_map(|p| port_info(&ctx, p, 0)).collect(),
                name,
            });
        }
        if out.is_empty() {
            return Err(VerbsError::NoDevice(
                "ibv_get_device_list found none".into(),
            ));
        }
        Ok(out)
    }

    struct HwDevice {
        info: DeviceInfo,
        port: PortInfo,
        ctx: Arc<DeviceContext>,
        pd: Arc<ProtectionDomain>,
    }

    pub(super) fn open(name: &str, port: u8, gid_index: u8) -> Result<Box<dyn Device>, VerbsError> {
        let list = list()?;
        let dev = list
            .iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| VerbsError::NoDevice(format!("no RDMA device called {name}")))?;
        let ctx = dev.open().map_err(|e| lib("ibv_open_device", e))?;
        let port_info = port_info(&ctx, port, gid_index)
            .ok_or_else(|| VerbsError::NoDevice(format!("{name} has no port {port}")))?;
        let pd = ctx.alloc_pd().map_err(|e| lib("ibv_alloc_pd", e))?;
        Ok(Box::new(HwDevice {
            info: DeviceInfo {
                name: name.into(),
                guid: dev.guid().as_u64(),
                pci: pci_address(name),
                ports: vec![port_info.clone()],
            },
            port: port_info,
            ctx,
            pd,
        }))
    }

    impl Device for HwDevice {
        fn info(&self) -> &DeviceInfo {
            &self.info
        }

        fn port(&self) -> &PortInfo {
            &self.port
        }

        unsafe fn register(
            &self,
            addr: *mut u8,
            len: usize,
            access: Access,
        ) -> Result<Box<dyn MemoryRegion>, VerbsError> {
            let flags = flags_of(access);
            // SAFETY: the caller keeps the memory allocated until the registration is dropped
            // (this function's contract).
            let mr = unsafe { self.pd.reg_mr(addr as usize, len, flags) }
                .map_err(|e| lib("ibv_reg_mr", e))?;
            Ok(Box::new(HwMr(mr)))
        }

        /// GPUDirect RDMA. First dma-buf (Linux 5.12+, rdma-core 34+, NVIDIA's open kernel
        /// modules): the range exported by the CUDA driver as a dma-buf descriptor, registered
        /// at I/O virtual address `addr` so remote addresses are device pointers. Then, where
        /// that fails, `ibv_reg_mr` of the device pointer itself, which works where the
        /// `nvidia-peermem` module lets the HCA driver resolve GPU addresses. Never run on real
        /// hardware (none was reachable): see docs/ibv.md.
        unsafe fn register_gpu(
            &self,
            gpu: Arc<dyn GpuMemory>,
            addr: u64,
            len: usize,
            access: Access,
        ) -> Result<Box<dyn MemoryRegion>, VerbsError> {
            let flags = flags_of(access);
            let page = 4096u64;
            let span = (len as u64).div_ceil(page) * page;
            let dmabuf = gpu.dmabuf(addr, span).and_then(|fd| {
                // SAFETY: `fd` is a dma-buf of `span` bytes of device memory at `addr`, which the
                // caller keeps allocated until the registration is dropped; the registration
                // holds its own reference to the dma-buf, so `fd` may close after the call.
                unsafe { self.pd.reg_dmabuf_mr(0, len, addr, fd.as_raw_fd(), flags) }
                    .map_err(|e| format!("ibv_reg_dmabuf_mr: {e}"))
            });
            let mr = match dmabuf {
                Ok(mr) => mr,
                // SAFETY: as for `register`: the caller keeps the memory allocated.
                Err(why) => unsafe { self.pd.reg_mr(addr as usize, len, flags) }.map_err(|e| {
                    VerbsError::Library {
                        call: "registering GPU memory",
                        detail: format!(
                            "dma-buf: {why}; ibv_reg_mr of the device pointer (nvidia-peermem): \
                             {e}"
                        ),
                    }
                })?,
            };
            Ok(Box::new(HwMr(mr)))
        }

        fn create_qp(&self, caps: QpCaps) -> Result<Box<dyn QueuePair>, VerbsError> {
            let channel = self
                .ctx
                .create_comp_channel()
                .map_err(|e| lib("ibv_create_comp_channel", e))?;
            channel
                .set_nonblocking(true)
                .map_err(|e| lib("fcntl(O_NONBLOCK)", e))?;
            let cq = self
                .ctx
                .create_cq_builder()
                .setup_cqe(caps.max_send_wr + caps.max_recv_wr)
                .setup_comp_channel(&channel, 0)
                .build()
                .map_err(|e| lib("ibv_create_cq", e))?;
            let generic = GenericCompletionQueue::from(Arc::clone(&cq));
            let mut qp = self
                .pd
                .create_qp_builder()
                .setup_send_cq(generic.clone())
                .setup_recv_cq(generic)
                .setup_max_send_wr(caps.max_send_wr)
                .setup_max_recv_wr(caps.max_recv_wr)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .build()
                .map_err(|e| lib("ibv_create_qp", e))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(self.port.port)
                .setup_access_flags(
                    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
                );
            qp.modify(&attr)
                .map_err(|e| lib("ibv_modify_qp(INIT)", e))?;
            let endpoint = Endpoint {
                qpn: qp.qp_number(),
                lid: self.port.lid,
                gid: self.port.gid,
                psn: random_psn(),
            };
            Ok(Box::new(HwQp {
                qp,
                cq,
                channel,
                caps,
                endpoint,
                port: self.port.clone(),
                state: QpState::Init,
                unacked: 0,
            }))
        }
    }

    /// libibverbs access flags for `access` (local write always: libibverbs' usual flags).
    fn flags_of(access: Access) -> AccessFlags {
        let mut flags = AccessFlags::LocalWrite;
        if access.remote_write {
            flags |= AccessFlags::RemoteWrite;
        }
        if access.remote_read {
            flags |= AccessFlags::RemoteRead;
        }
        flags
    }

    struct HwMr(Arc<sideway::ibverbs::memory_region::MemoryRegion>);

    impl MemoryRegion for HwMr {
        fn addr(&self) -> u64 {
            self.0.get_ptr() as u64
        }
        fn len(&self) -> u64 {
            self.0.region_len() as u64
        }
        fn lkey(&self) -> u32 {
            self.0.lkey()
        }
        fn rkey(&self) -> u32 {
            self.0.rkey()
        }
    }

    struct HwQp {
        qp: BasicQueuePair,
        cq: Arc<BasicCompletionQueue>,
        channel: Arc<CompletionChannel>,
        caps: QpCaps,
        endpoint: Endpoint,
        port: PortInfo,
        state: QpState,
        /// CQ events taken with `ibv_get_cq_event` and not yet acknowledged.
        unacked: u32,
    }

    // SAFETY: the verbs objects are used from one thread at a time (the owner holds `&mut`);
    // libibverbs allows their use from any thread.
    unsafe impl Send for HwQp {}

    fn status(s: u32) -> Status {
        match WorkCompletionStatus::from(s) {
            WorkCompletionStatus::Success => Status::Success,
            WorkCompletionStatus::LocalLengthError => Status::LocalLength,
            WorkCompletionStatus::LocalProtectionError => Status::LocalProtection,
            WorkCompletionStatus::RemoteAccessError => Status::RemoteAccess,
            WorkCompletionStatus::ResponderNotReadyRetryCounterExceededError => {
                Status::RnrRetryExceeded
            }
            WorkCompletionStatus::RetryCounterExceededError => Status::RetryExceeded,
            WorkCompletionStatus::WorkRequestFlushedError => Status::Flushed,
            _ => Status::Other(s),
        }
    }

    impl QueuePair for HwQp {
        fn endpoint(&self) -> Endpoint {
            self.endpoint
        }

        fn caps(&self) -> QpCaps {
            self.caps
        }

        fn state(&self) -> QpState {
            self.state
        }

        fn connect(&mut self, remote: &Endpoint) -> Result<(), VerbsError> {
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu((self.port.mtu.trailing_zeros().saturating_sub(7)).into())
                .setup_dest_qp_num(remote.qpn)
                .setup_rq_psn(remote.psn)
                .setup_max_dest_read_atomic(16)
                .setup_min_rnr_timer(12);
            let mut ah = AddressHandleAttribute::new();
            ah.setup_dest_lid(remote.lid).setup_port(self.port.port);
            if self.port.link_layer == LinkLayer::Ethernet || remote.gid[..8] != self.port.gid[..8]
            {
                ah.setup_grh(&Gid { raw: remote.gid }, 0, self.port.gid_index, 64, 0);
            }
            attr.setup_address_vector(&ah);
            self.qp
                .modify(&attr)
                .map_err(|e| lib("ibv_modify_qp(RTR)", e))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(self.endpoint.psn)
                .setup_timeout(14)
                .setup_retry_cnt(7)
                .setup_rnr_retry(self.caps.rnr_retry)
                .setup_max_read_atomic(16);
            self.qp
                .modify(&attr)
                .map_err(|e| lib("ibv_modify_qp(RTS)", e))?;
            self.state = QpState::ReadyToSend;
            Ok(())
        }

        fn set_error(&mut self) {
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Error);
            if self.qp.modify(&attr).is_ok() {
                self.state = QpState::Error;
            }
        }

        fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError> {
            let mut guard = self.qp.start_post_send();
            let handle = guard.construct_wr(wr.wr_id, WorkRequestFlags::Signaled);
            let local = match wr.op {
                SendOp::Send => handle.setup_send(),
                SendOp::Write { remote_addr, rkey } => handle.setup_write(rkey, remote_addr),
                SendOp::WriteImm {
                    remote_addr,
                    rkey,
                    imm,
                } => handle.setup_write_imm(rkey, remote_addr, imm.to_be()),
                SendOp::Read { remote_addr, rkey } => handle.setup_read(rkey, remote_addr),
            };
            if wr.local.len > 0 {
                // SAFETY: the caller's memory lies in a registration it keeps alive until the
                // request completes (the queue-pair owner holds the buffer until then).
                unsafe { local.setup_sge(wr.local.lkey, wr.local.addr, wr.local.len as u32) };
            }
            guard.post().map_err(|e| match e {
                sideway::ibverbs::queue_pair::PostSendError::NotEnoughResources(_) => {
                    VerbsError::QueueFull("send")
                }
                e => lib("ibv_post_send", e),
            })
        }

        fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError> {
            let mut guard = self.qp.start_post_recv();
            let handle = guard.construct_wr(wr.wr_id);
            if wr.local.len > 0 {
                // SAFETY: as for sends: the memory stays registered until the completion.
                unsafe { handle.setup_sge(wr.local.lkey, wr.local.addr, wr.local.len as u32) };
            }
            guard.post().map_err(|e| match e {
                sideway::ibverbs::queue_pair::PostRecvError::NotEnoughResources(_) => {
                    VerbsError::QueueFull("receive")
                }
                e => lib("ibv_post_recv", e),
            })
        }

        fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
            let mut n = 0;
            while n < max {
                let poller = match self.cq.start_poll() {
                    Ok(p) => p,
                    Err(PollCompletionQueueError::CompletionQueueEmpty) => break,
                    Err(e) => return Err(lib("ibv_poll_cq", e)),
                };
                for wc in poller {
                    let op = WorkCompletionOperationType::from(wc.opcode());
                    let (opcode, imm) = match op {
                        WorkCompletionOperationType::Send => (Opcode::Send, None),
                        WorkCompletionOperationType::Write => (Opcode::Write, None),
                        WorkCompletionOperationType::Read => (Opcode::Read, None),
                        WorkCompletionOperationType::ReceiveWithImmediate => {
                            (Opcode::Recv, Some(u32::from_be(wc.imm_data())))
                        }
                        _ => (Opcode::Recv, None),
                    };
                    let status = status(wc.status());
                    if status != Status::Success {
                        self.state = QpState::Error;
                    }
                    out.push(Completion {
                        wr_id: wc.wr_id(),
                        status,
                        opcode,
                        byte_len: wc.byte_len(),
                        imm,
                    });
                    n += 1;
                }
            }
            Ok(n)
        }

        fn arm(&mut self) -> Result<(), VerbsError> {
            // SAFETY: `cq` is a live CQ owned by `self.cq`; `req_notify_cq` is the provider's
            // implementation of the static inline `ibv_req_notify_cq`.
            let rc = unsafe {
                let cq: *mut ibv_cq = self.cq.cq().as_ptr();
                match (*(*cq).context).ops.req_notify_cq {
                    Some(f) => f(cq, 0),
                    None => libc::ENOSYS,
                }
            };
            if rc != 0 {
                return Err(lib(
                    "ibv_req_notify_cq",
                    std::io::Error::from_raw_os_error(rc),
                ));
            }
            Ok(())
        }

        fn notify_fd(&self) -> RawFd {
            self.channel.as_raw_fd()
        }

        fn ack_notifications(&mut self) -> Result<(), VerbsError> {
            loop {
                let mut cq: *mut ibv_cq = std::ptr::null_mut();
                let mut ctx: *mut libc::c_void = std::ptr::null_mut();
                // SAFETY: the channel is live and non-blocking; the out-pointers are valid.
                let rc = unsafe {
                    ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut ctx)
                };
                if rc != 0 {
                    break;
                }
                self.unacked += 1;
            }
            if self.unacked > 0 {
                // SAFETY: acknowledges events taken from this CQ above.
                unsafe { ibv_ack_cq_events(self.cq.cq().as_ptr(), self.unacked) };
                self.unacked = 0;
            }
            Ok(())
        }
    }
}
