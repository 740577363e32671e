//! Registered memory and one-sided access to it: the model every remote-memory path shares.
//!
//! A context *registers* memory ([`crate::remote::Register`]): the runtime takes the buffer, gives
//! the owner a [`Region`] handle, and the region a compact [`RegionDescriptor`] that the owner
//! sends to peers however it likes. A peer holding the descriptor reads from the region or
//! writes into it with [`crate::remote::RemoteRead`] / [`crate::remote::RemoteWrite`] on a pipe
//! to the owner, each a batch of [`Span`]s, and may leave a notification for the owner, which
//! arrives after the data it announces is in place. docs/remote.md describes the model, the
//! guarantees and each path.
//!
//! This module holds what every path needs: the descriptor and its capability token, the
//! bounds checks of a batch, and the process's table of registered regions, through which the
//! in-process path ([`local`]) copies and which keeps deregistration safe: a region's memory is
//! handed back (or freed) only once no copy into or out of it is running, and no later one can
//! start.

mod cma;
#[cfg(feature = "cuda")]
pub(crate) mod device;
pub(crate) mod lane;
pub(crate) mod local;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Origin};
use crate::message::Buffer;

/// The descriptor format this build writes and reads.
const DESCRIPTOR_VERSION: u8 = 1;

/// What a peer needs to reach a registered region: who owns it, which region, its length,
/// whether it takes writes, and the capability token without which the owner's runtime
/// refuses every operation. Serialisable (serde) and compact: [`RegionDescriptor::to_bytes`]
/// makes about 80 bytes of it, whatever the region's size.
///
/// The token is 128 random bits from the kernel (`getrandom(2)`), made at registration: a
/// descriptor is a capability, so send it only to peers that may touch the region.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    version: u8,
    /// The owner's process (the token the `xth` channel's domain names it by).
    owner: String,
    /// The owner's context, within its process.
    context: u64,
    /// The region, within its process (never reused while the process runs).
    id: u64,
    token: [u64; 2],
    len: u64,
    writable: bool,
    /// Where the region's bytes are.
    #[serde(default)]
    memory: Memory,
}

/// Where a region's bytes are: host memory, or device memory of the owner's GPU `device`
/// (`ipc`: exportable over CUDA IPC, `cuMemAlloc` memory; pool memory is not, and is served by
/// the owner through the remote lane).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Memory {
    #[default]
    Host,
    Cuda {
        device: u32,
        ipc: bool,
    },
}

impl std::fmt::Debug for RegionDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token stays out of logs.
        f.debug_struct("RegionDescriptor")
            .field("owner", &self.owner)
            .field("context", &self.context)
            .field("id", &self.id)
            .field("len", &self.len)
            .field("writable", &self.writable)
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl RegionDescriptor {
    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the region takes remote writes (host memory registered as `Buffer::Cpu`, or
    /// device memory; a `Buffer::Shared` region is read-only).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The owner's GPU when the region is device memory (`Buffer::Cuda`); `None` for host
    /// memory.
    pub fn cuda_device(&self) -> Option<u32> {
        match self.memory {
            Memory::Host => None,
            Memory::Cuda { device, .. } => Some(device),
        }
    }

    /// Where the region's bytes are.
    #[cfg(feature = "cuda")]
    pub(crate) fn memory(&self) -> Memory {
        self.memory
    }

    /// The region's number, unique within its owner's process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The descriptor as bytes (MessagePack), to put in a message's metadata, a file or a
    /// key-value store.
    pub fn to_bytes(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("a descriptor always serialises")
    }

    /// A descriptor from [`RegionDescriptor::to_bytes`]'s bytes; [`Error::Protocol`] if they
    /// are not one, [`Error::Version`] if another format version wrote them.
    pub fn from_bytes(bytes: &[u8]) -> Result<RegionDescriptor, Error> {
        let d: RegionDescriptor = rmp_serde::from_slice(bytes).map_err(|e| {
            Error::protocol(format!("not a region descriptor: {e}"), &Origin::default())
        })?;
        if d.version != DESCRIPTOR_VERSION {
            return Err(Error::Version {
                ours: DESCRIPTOR_VERSION as u32,
                theirs: d.version as u32,
                origin: Origin::default(),
            });
        }
        Ok(d)
    }

    /// Whether the region lives in this process.
    pub(crate) fn is_local(&self) -> bool {
        self.owner == crate::backend::xth::process_token()
    }
}

/// One piece of a batch: `len` bytes at `remote` in the region and at `local` in the
/// operation's local buffer. A read copies remote to local, a write local to remote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Span {
    /// Offset in the remote region.
    pub remote: u64,
    /// Offset in the local buffer.
    pub local: u64,
    /// Bytes.
    pub len: u64,
}

impl Span {
    /// `len` bytes at `remote` in the region and `local` in the local buffer.
    pub fn new(remote: u64, local: u64, len: u64) -> Span {
        Span { remote, local, len }
    }

    /// The whole of a region of `len` bytes, at offset 0 of the local buffer.
    pub fn whole(len: u64) -> Span {
        Span::new(0, 0, len)
    }
}

/// Checks a batch against the region's and the local buffer's lengths: every span inside
/// both, none overflowing. Returns the batch's bytes.
pub(crate) fn check_spans(spans: &[Span], region: u64, local: u64) -> Result<u64, Error> {
    let mut total = 0u64;
    for (i, s) in spans.iter().enumerate() {
        let out = |what: &str, at: u64, len: u64| {
            Error::invalid(format!(
                "span {i}: {} bytes at {at} run past the {what} ({len} bytes)",
                s.len
            ))
        };
        if s.remote.checked_add(s.len).is_none_or(|end| end > region) {
            return Err(out("remote region", s.remote, region));
        }
        if s.local.checked_add(s.len).is_none_or(|end| end > local) {
            return Err(out("local buffer", s.local, local));
        }
        total = total.saturating_add(s.len);
    }
    Ok(total)
}

/// 128 random bits from the kernel.
fn random_token() -> [u64; 2] {
    let mut t = [0u64; 2];
    let mut filled = 0usize;
    let bytes = std::mem::size_of_val(&t);
    while filled < bytes {
        // SAFETY: the pointer and length name the unfilled tail of `t`, which lives across the
        // call; getrandom(2) writes at most that many bytes.
        let n = unsafe {
            libc::getrandom(
                (t.as_mut_ptr() as *mut u8).add(filled).cast(),
                bytes - filled,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            // Interrupted by a signal: try again. Anything else (no getrandom, ENOSYS) is a
            // kernel older than 3.17, which this crate does not run on.
            assert_eq!(e.kind(), std::io::ErrorKind::Interrupted, "getrandom: {e}");
            continue;
        }
        filled += n as usize;
    }
    t
}

/// Compares two tokens in time that does not depend on where they differ.
fn same_token(a: &[u64; 2], b: &[u64; 2]) -> bool {
    ((a[0] ^ b[0]) | (a[1] ^ b[1])) == 0
}

/// A notification a peer left with a remote operation, delivered to the owner's subscribers
/// ([`crate::remote::SubscribeNotifications`]) once the data it announces is in place.
#[derive(Debug, Clone)]
pub struct Notification {
    /// The region the operation touched ([`RegionDescriptor::id`]).
    pub region: u64,
    /// Whether the operation was a write (the region's bytes changed) or a read.
    pub write: bool,
    /// The bytes the peer attached.
    pub data: Vec<u8>,
}

/// Where a notification goes: `false` once the subscriber is gone (it is then forgotten).
pub(crate) type Subscriber = Box<dyn Fn(Notification) -> bool + Send>;

/// A context's side of its regions: its number and who hears its notifications.
#[derive(Default)]
pub(crate) struct Owner {
    pub(crate) context: u64,
    subscribers: Mutex<Vec<Subscriber>>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner")
            .field("context", &self.context)
            .finish_non_exhaustive()
    }
}

impl Owner {
    /// A new context's.
    pub(crate) fn new() -> Arc<Owner> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(Owner {
            context: NEXT.fetch_add(1, Ordering::Relaxed),
            subscribers: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn subscribe(&self, to: Subscriber) {
        let mut s = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        s.push(to);
    }

    /// Hands `n` to every subscriber (one mailbox hop each), forgetting those gone; with none,
    /// it is dropped.
    fn notify(&self, n: Notification) {
        let mut s = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        let before = s.len();
        s.retain(|deliver| deliver(n.clone()));
        if before > 0 {
            crate::metrics::remote_notification();
        }
    }
}

/// A registered region's memory, as the table holds it: the buffer and where its bytes are
/// (for device memory, the device address).
struct Store {
    buffer: Buffer,
    base: *mut u8,
}

// SAFETY: `base` points into `buffer`'s memory (heap or device), which moves with it; the
// table only copies through it while holding the entry's lock shared, and takes the buffer out
// only holding it exclusively.
unsafe impl Send for Store {}
// SAFETY: as above: shared access copies through `base` only.
unsafe impl Sync for Store {}

/// A registered region, as the process's table holds it.
pub(crate) struct Entry {
    token: [u64; 2],
    len: u64,
    writable: bool,
    owner: Arc<Owner>,
    /// `None` once deregistered. Copies hold it shared for their whole length.
    memory: RwLock<Option<Store>>,
    /// The device, for device memory: copies into and out of it are the driver's.
    #[cfg(feature = "cuda")]
    gpu: Option<Arc<crate::cuda::Gpu>>,
    /// The allocation exported over CUDA IPC, for device memory that can be.
    #[cfg(feature = "cuda")]
    pub(crate) exported: Option<crate::backend::cuda_ipc::ipc::Exported>,
    /// The peers (remote lanes) that mapped the region over CUDA IPC: each is told to let go
    /// of its mapping at deregistration, which waits for their acknowledgements. Taken with
    /// `memory` held (shared to add, exclusively to take), so no lease is handed out after.
    leases: Mutex<Vec<Box<dyn Holder>>>,
}

/// A peer that holds a mapping of a region (its remote lane).
pub(crate) trait Holder: Send {
    /// Whether its lane has ended (a dead process holds no mapping, a live one closed its
    /// mappings with its lane): it need not be told, and is forgotten.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn gone(&self) -> bool;
    /// Tells it to let go of region `id`, handing it the acknowledgement to send once it has;
    /// `false` if it is gone already.
    fn revoke(self: Box<Self>, id: u64, ack: tokio::sync::oneshot::Sender<()>) -> bool;
}

impl Entry {
    /// Runs `f` with the region's base address, holding the memory shared for its length (so
    /// that deregistration waits for it); the "not registered" error once deregistered.
    pub(crate) fn with_memory<R>(&self, id: u64, f: impl FnOnce(*mut u8) -> R) -> Result<R, Error> {
        let memory = self.memory.read().unwrap_or_else(|p| p.into_inner());
        match memory.as_ref() {
            Some(store) => Ok(f(store.base)),
            None => Err(gone(id)),
        }
    }

    /// Hands a notification to the region's owner.
    pub(crate) fn notify(&self, n: Notification) {
        self.owner.notify(n);
    }

    /// Whether the region is device memory.
    pub(crate) fn is_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.gpu.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Records a peer's lease (its mapping over CUDA IPC), unless the region was deregistered.
    #[cfg(feature = "cuda")]
    pub(crate) fn lease(&self, id: u64, holder: Box<dyn Holder>) -> Result<(), Error> {
        let memory = self.memory.read().unwrap_or_else(|p| p.into_inner());
        if memory.is_none() {
            return Err(gone(id));
        }
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        // Peers whose lanes ended are forgotten, so that a long-lived region leased by many
        // short-lived pipes keeps only the live ones.
        leases.retain(|h| !h.gone());
        leases.push(holder);
        Ok(())
    }

    /// Copies `len` bytes between `offset` of the region, whose memory starts at `base`, and
    /// host memory at `host`: into the region if `into`, out of it otherwise.
    ///
    /// # Safety
    /// The caller holds the memory (inside [`Entry::with_memory`], which gave `base`); the span
    /// lies inside the region (checked), and `host` is valid for `len` bytes.
    pub(crate) unsafe fn move_bytes(
        &self,
        base: *mut u8,
        offset: u64,
        host: *mut u8,
        len: usize,
        into: bool,
    ) -> Result<(), Error> {
        // SAFETY: the caller's contract puts `offset..offset + len` inside the region.
        let at = unsafe { base.add(offset as usize) };
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            let (dst, src) = if into { (at, host) } else { (host, at) };
            // SAFETY: both ranges are valid for `len` bytes (the caller's contract), one of
            // them device memory of `gpu`; `cuMemcpy` returns once the bytes are in place.
            return unsafe { device::copy_sync(gpu, dst as u64, src as u64, len) };
        }
        let (dst, src) = if into {
            (at, host as *const u8)
        } else {
            (host, at as *const u8)
        };
        // SAFETY: as above; a region's memory is never the caller's own buffer.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        Ok(())
    }
}

/// The process's registered regions, by number.
fn table() -> &'static Mutex<crate::keymap::KeyMap<u64, Arc<Entry>>> {
    static TABLE: OnceLock<Mutex<crate::keymap::KeyMap<u64, Arc<Entry>>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The region `d` names, if its token is right and it is still registered.
pub(crate) fn lookup(d: &RegionDescriptor) -> Result<Arc<Entry>, Error> {
    let entry = table()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&d.id)
        .cloned();
    match entry {
        Some(e) if same_token(&e.token, &d.token) => Ok(e),
        Some(_) => Err(Error::Unauthenticated {
            reason: format!(
                "region {}: the descriptor's capability token is not the region's",
                d.id
            ),
            origin: Origin::default(),
        }),
        None => Err(gone(d.id)),
    }
}

/// The error of an operation on a region no longer registered.
pub(crate) fn gone(id: u64) -> Error {
    Error::invalid(format!(
        "region {id} is not registered (deregistered, or never registered in its owner's process)"
    ))
}

/// The owner's handle on a registered region. Dropping it deregisters the region (waiting for
/// copies in progress, none later) and frees its memory; [`Region::deregister`] hands the
/// memory back instead.
pub struct Region {
    descriptor: RegionDescriptor,
    entry: Arc<Entry>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("descriptor", &self.descriptor)
            .finish()
    }
}

impl Region {
    /// Registers `buffer` for `owner`'s context.
    pub(crate) fn register(buffer: Buffer, owner: Arc<Owner>) -> Result<Region, Error> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        #[cfg(feature = "cuda")]
        let mut device = None;
        let (base, writable, memory) = match &buffer {
            Buffer::Cpu(v) => (v.as_ptr() as *mut u8, true, Memory::Host),
            Buffer::Shared(b) => (b.as_ptr() as *mut u8, false, Memory::Host),
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => {
                // Exported once, here: a peer of this host maps the allocation (cuda_ipc);
                // memory that cannot be exported (a stream-ordered pool's) is served by the
                // owner through the remote lane instead.
                let exported = if b.is_empty() {
                    None
                } else {
                    crate::backend::cuda_ipc::ipc::export(b.gpu(), b.device_ptr())?.ok()
                };
                let memory = Memory::Cuda {
                    device: b.device(),
                    ipc: exported.is_some(),
                };
                device = Some((b.gpu().clone(), exported));
                (b.device_ptr() as *mut u8, true, memory)
            }
        };
        let len = buffer.len();
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let token = random_token();
        let descriptor = RegionDescriptor {
            version: DESCRIPTOR_VERSION,
            owner: crate::backend::xth::process_token().to_string(),
            context: owner.context,
            id,
            token,
            len,
            writable,
            memory,
        };
        #[cfg(feature = "cuda")]
        let (gpu, exported) = match device {
            Some((g, e)) => (Some(g), e),
            None => (None, None),
        };
        let entry = Arc::new(Entry {
            token,
            len,
            writable,
            owner,
            memory: RwLock::new(Some(Store { buffer, base })),
            #[cfg(feature = "cuda")]
            gpu,
            #[cfg(feature = "cuda")]
            exported,
            leases: Mutex::new(Vec::new()),
        });
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, entry.clone());
        crate::metrics::remote_regions(1.0);
        Ok(Region { descriptor, entry })
    }

    /// The descriptor to hand to peers.
    pub fn descriptor(&self) -> &RegionDescriptor {
        &self.descriptor
    }

    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.descriptor.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.descriptor.len == 0
    }

    /// Copies `dst.len()` bytes at `offset` of the region into `dst` (the owner's own access:
    /// peers may be copying at the same time; bytes a peer writes meanwhile may or may not be
    /// seen, as with any shared memory). For device memory it is a copy by the driver that
    /// returns once the bytes are in `dst`.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), Error> {
        let span = Span::new(offset, 0, dst.len() as u64);
        local::copy_out(&self.entry, &[span], dst)
    }

    /// Copies `src` to `offset` of the region (the owner's own access, as
    /// [`Region::read_at`]). A read-only region (`Buffer::Shared`) refuses it.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), Error> {
        let span = Span::new(offset, 0, src.len() as u64);
        local::copy_in(&self.entry, &[span], src)
    }

    /// Deregisters the region and hands its memory back: copies in progress finish first (this
    /// waits for them), peers that mapped device memory over CUDA IPC let go of their mappings
    /// first (this waits for their acknowledgements, or their lanes' end), and every later
    /// operation on the descriptor fails with [`Error::InvalidArgument`] ("region N is not
    /// registered").
    pub async fn deregister(self) -> Buffer {
        let (store, acks) = self.take();
        for ack in acks {
            // An error is the peer's lane gone: it holds no mapping any more.
            let _ = ack.await;
        }
        store.map_or(Buffer::Cpu(Vec::new()), |s| s.buffer)
    }

    /// Takes the memory out (once; `None` after), and the acknowledgements to wait for before
    /// the memory may be reused or freed.
    fn take(&self) -> (Option<Store>, Vec<tokio::sync::oneshot::Receiver<()>>) {
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.descriptor.id);
        // Waits for every copy holding the memory shared; none starts after (the entry is out
        // of the table, and a copy that found it before sees `None`).
        let mut memory = self.entry.memory.write().unwrap_or_else(|e| e.into_inner());
        let Some(store) = memory.take() else {
            return (None, Vec::new());
        };
        let holders =
            std::mem::take(&mut *self.entry.leases.lock().unwrap_or_else(|e| e.into_inner()));
        drop(memory);
        let mut acks = Vec::with_capacity(holders.len());
        for holder in holders {
            let (tx, rx) = tokio::sync::oneshot::channel();
            if holder.revoke(self.descriptor.id, tx) {
                acks.push(rx);
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.entry.gpu {
            // Copies this process queued on the memory (the owner's own, `cuda_xth`) have run.
            let _ = gpu.synchronize();
        }
        crate::metrics::remote_regions(-1.0);
        (Some(store), acks)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let (store, acks) = self.take();
        if acks.is_empty() {
            return drop(store);
        }
        // Peers still map the memory: it is freed once they have let go, off this thread (the
        // acknowledgements come through remote lanes that may run on it).
        let keep = move || {
            for ack in acks {
                let _ = ack.blocking_recv();
            }
            drop(store);
        };
        if std::thread::Builder::new()
            .name("actorpipe-revoke".into())
            .spawn(keep)
            .is_err()
        {
            // The closure (and the memory) went with the failed spawn.
            tracing::error!("no thread to wait for a region's revocation: its memory was freed");
        }
    }
}
