//! The CUDA IPC handle cache: one actor per context and device owns the handles we exported and
//! the ones we opened from peers (design card: "CUDA IPC handle caches keyed by peer, tensor and
//! operation").
//!
//! - **Export** (sending): the allocation holding a tensor is found (`cuMemGetAddressRange`) and
//!   its buffer id read; a cached export for (peer, buffer id) answers without another
//!   `cuIpcGetMemHandle`.
//! - **Open** (receiving): a peer's handle for (peer, its buffer id) is opened once and mapped
//!   until the entry goes. An entry whose handle bytes differ from the lookup's is stale (the
//!   peer freed the allocation and made another at the same address) and is replaced, never
//!   returned. Interprocess events are cached the same way.
//! - **Bounds and lifetime**: each map keeps at most `bound` entries, least recently used out;
//!   [`ClosePeer`] drops every entry of a pipe that closed. An opened mapping handed to a copy is
//!   an `Arc`: it is unmapped only once the last holder is done with it.
//! - **Metrics**: `actorpipe_cuda_ipc_lookups_total{side, outcome}` and
//!   `actorpipe_cuda_ipc_open_handles`; [`GetStats`] returns the counters.
//!
//! Each context keeps its caches in [`IpcCaches`], one [`IpcCacheActor`] per device, made on
//! first use. The actor owns the cache ([`Shared`]: the maps, and the channel's staging
//! allocations); the pipe and channel actors of the context run the hot path on it directly
//! through a [`DeviceCache`] (an uncontended lock: no mailbox hop per tensor), while closing a
//! pipe ([`ClosePeer`]) and reading the counters ([`GetStats`]) go through the actor's mailbox.

pub(crate) mod driver;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use actix::prelude::*;

use crate::backend::cuda_ipc::cache::Stats;
use crate::backend::cuda_ipc::cache::{IpcCache, DEFAULT_BOUND};
use crate::backend::cuda_ipc::ipc::{Exported, NotExportable, Opened, RemoteEvent, HANDLE_LEN};
use crate::cuda::sys;

/// What one device's cache actor owns: the cache, and the staging allocations of tensors
/// whose memory cannot be exported (reused, so their exports stay cached on the peer).
pub struct Shared {
    /// The handles.
    pub cache: IpcCache,
    /// Exportable copies of pool memory.
    pub staging: crate::backend::cuda_ipc::Staging,
}

/// The actor of one context and device: owns its [`Shared`] state.
pub struct IpcCacheActor {
    shared: Arc<Mutex<Shared>>,
}

impl Actor for IpcCacheActor {
    type Context = Context<Self>;
}

impl IpcCacheActor {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One device's cache, as the pipes and channels of its context hold it.
#[derive(Clone)]
pub struct DeviceCache {
    /// The actor ([`ClosePeer`], [`GetStats`], and the other messages).
    pub addr: Addr<IpcCacheActor>,
    shared: Arc<Mutex<Shared>>,
}

impl DeviceCache {
    /// The cache, for a call on the hot path.
    pub fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A context's caches, one per device, made (and their actors started, on the calling
/// arbiter) on first use.
#[derive(Default)]
pub struct IpcCaches {
    devices: Mutex<HashMap<u32, DeviceCache>>,
}

impl std::fmt::Debug for IpcCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("IpcCaches")
            .field("devices", &devices.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl IpcCaches {
    /// The cache of device `ordinal` (started now if this is its first use; must run inside an
    /// actix system).
    pub fn device(&self, ordinal: u32) -> crate::Result<DeviceCache> {
        let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = devices.get(&ordinal) {
            return Ok(c.clone());
        }
        let shared = Arc::new(Mutex::new(Shared {
            cache: IpcCache::new(ordinal, DEFAULT_BOUND)?,
            staging: Default::default(),
        }));
        let addr = IpcCacheActor {
            shared: shared.clone(),
        }
        .start();
        let c = DeviceCache { addr, shared };
        devices.insert(ordinal, c.clone());
        Ok(c)
    }

    /// Tells every device's cache that pipe `peer` closed.
    pub fn close_peer(&self, peer: u64) {
        let devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        for c in devices.values() {
            c.addr.do_send(ClosePeer(peer));
        }
    }

    /// The devices with a cache so far.
    pub fn devices(&self) -> Vec<u32> {
        let devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<u32> = devices.keys().copied().collect();
        v.sort();
        v
    }
}

/// Exports the allocation holding `ptr` for `peer`: the handle, the allocation's buffer id, and
/// the offset of `ptr` in it. `Ok(Err(..))` when the memory cannot be exported (pool memory).
#[derive(Debug)]
pub struct Export {
    /// The pipe the tensor goes to.
    pub peer: u64,
    /// The tensor's device pointer.
    pub ptr: sys::CUdeviceptr,
}

impl Message for Export {
    type Result = crate::Result<Result<Exported, NotExportable>>;
}

/// Opens (or finds open) a peer's allocation.
#[derive(Debug)]
pub struct Open {
    /// The pipe the peer is on.
    pub peer: u64,
    /// What the peer exported.
    pub exported: Exported,
}

impl Message for Open {
    type Result = crate::Result<Arc<Opened>>;
}

/// Opens (or finds open) a peer's interprocess event.
#[derive(Debug)]
pub struct OpenEvent {
    /// The pipe the peer is on.
    pub peer: u64,
    /// The event's handle.
    pub handle: [u8; HANDLE_LEN],
}

impl Message for OpenEvent {
    type Result = crate::Result<Arc<RemoteEvent>>;
}

/// A pipe closed: drop everything cached for it (opened mappings are unmapped once no copy holds
/// them).
#[derive(Debug, Clone, Copy)]
pub struct ClosePeer(pub u64);

impl Message for ClosePeer {
    type Result = ();
}

/// The counters of the three maps: (exports, opened memory, opened events).
#[derive(Debug, Clone, Copy)]
pub struct GetStats;

impl Message for GetStats {
    type Result = (Stats, Stats, Stats);
}

impl Handler<Export> for IpcCacheActor {
    type Result = crate::Result<Result<Exported, NotExportable>>;
    fn handle(&mut self, m: Export, _: &mut Context<Self>) -> Self::Result {
        self.lock().cache.export(m.peer, m.ptr)
    }
}

impl Handler<Open> for IpcCacheActor {
    type Result = crate::Result<Arc<Opened>>;
    fn handle(&mut self, m: Open, _: &mut Context<Self>) -> Self::Result {
        self.lock().cache.open(m.peer, &m.exported)
    }
}

impl Handler<OpenEvent> for IpcCacheActor {
    type Result = crate::Result<Arc<RemoteEvent>>;
    fn handle(&mut self, m: OpenEvent, _: &mut Context<Self>) -> Self::Result {
        self.lock().cache.open_event(m.peer, &m.handle)
    }
}

impl Handler<ClosePeer> for IpcCacheActor {
    type Result = ();
    fn handle(&mut self, m: ClosePeer, _: &mut Context<Self>) {
        self.lock().cache.close_peer(m.0);
    }
}

impl Handler<GetStats> for IpcCacheActor {
    type Result = MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.lock().cache.stats())
    }
}
