//! libfabric, bound by hand (feature `efa`).
//!
//! The crates.io bindings don't fit (see docs/efa.md): `shim.c` compiles libfabric's
//! `static inline` calls, `ffi` declares them, and this module wraps every object in an owner
//! that closes it on drop: [`InfoList`] (`fi_getinfo`), [`Domain`] (fabric and domain),
//! [`Endpoint`] (an RDM endpoint with its completion queue [`Cq`] and address vector [`Av`]) and
//! [`Mr`] (a memory registration). Nothing outside this module touches a raw `fid`.
//!
//! Objects are `!Send`: a domain is opened with `FI_THREAD_DOMAIN`, so everything under it is
//! used from the one thread that opened it (the endpoint actor's arbiter, or a baseline thread).
//! One exception: an `shm` endpoint that a peer of this process may still reach is not closed
//! when dropped but parked, and closed later, from whichever thread drops its last such peer,
//! under `linger`'s lock (libfabric 1.17's shm would otherwise crash that peer).
//! Posting is `unsafe`: the memory and the context pointer must stay valid until the completion
//! is read or the endpoint is closed, and the caller (the endpoint actor) guarantees it.

pub mod engine;
#[cfg(feature = "faults")]
pub mod faults;
mod ffi;
pub mod hello;
mod linger;
pub mod regcache;
pub mod tag;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::os::fd::RawFd;
use std::rc::Rc;

use ffi::ApCompletion as RawCompletion;

/// A libfabric address in an address vector (`fi_addr_t`).
pub type FiAddr = u64;

/// A failed libfabric call: which call, the provider, the code and `fi_strerror`'s text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricError {
    /// The call that failed (`fi_tsend`, `fi_cq_read`, a completion, …).
    pub op: &'static str,
    /// The provider (`tcp;ofi_rxm`, `shm`, `efa`), or empty before one was chosen.
    pub provider: String,
    /// The libfabric error code, positive (`FI_EAGAIN` = 11, …).
    pub code: i32,
    /// `fi_strerror(code)`, plus the provider's own text for completion errors.
    pub text: String,
}

impl FabricError {
    fn new(op: &'static str, provider: &str, ret: i64) -> Self {
        let code = ret.unsigned_abs().min(i32::MAX as u64) as i32;
        FabricError {
            op,
            provider: provider.to_string(),
            code,
            text: strerror(code),
        }
    }
}

impl fmt::Display for FabricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let provider = if self.provider.is_empty() {
            "libfabric"
        } else {
            &self.provider
        };
        write!(
            f,
            "{provider}: {} failed: {} (FI error {})",
            self.op, self.text, self.code
        )
    }
}

impl std::error::Error for FabricError {}

/// `fi_strerror(code)` for a positive libfabric error code.
pub fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static string (or NULL for unknown codes in some
    // builds), never freed.
    let p = unsafe { ffi::ap_strerror(code) };
    if p.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-null, NUL-terminated static string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The switch that turns libfabric's rxm passthru on ([`passthru`]).
pub const PASSTHRU: &str = "FI_OFI_RXM_ENABLE_PASSTHRU";

/// Whether `provider` runs with rxm's passthru in this process: rxm over tcp (or over net, its
/// other name) with [`PASSTHRU`] on, read once, as rxm reads it once when libfabric loads.
/// rxm then hands tagged calls to the tcp provider's own RDM endpoint ("an optimized path to
/// the tcp provider", `fi_info -e`), which differs from rxm's in three ways the efa transport
/// and channel heed (docs/efa.md, "Providers"):
///
/// - it speaks another protocol on the wire: an end with it and an end without it do not talk
///   (libfabric's own `fi_pingpong` fails or hangs), so peers compare [`wire_name`]s;
/// - libfabric 1.17's reports every received message's tag as 0: the efa stream's credits
///   travel as remote CQ data, which it keeps ([`engine`]);
/// - it keeps an unexpected tagged message only up to its inject size (128 bytes), and stops
///   reading the connection behind a larger one until a matching receive is posted: the efa
///   channel sends an in-place tensor only once the peer has posted its receives
///   ([`keeps_unexpected`]).
pub fn passthru(provider: &str) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| switch_on(std::env::var(PASSTHRU).ok().as_deref()));
    on && rides_tcp(provider)
}

/// Whether rxm's passthru switch, set to `value`, is on: read as libfabric reads a boolean.
fn switch_on(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        ["1", "on", "yes", "true"]
            .iter()
            .any(|t| v.trim().eq_ignore_ascii_case(t))
    })
}

/// Whether passthru applies to `provider`: rxm over tcp or net (rxm over verbs is left alone).
fn rides_tcp(provider: &str) -> bool {
    let mut layers = provider.split(';');
    let core = layers.next().unwrap_or_default();
    matches!(core, "tcp" | "net") && layers.any(|p| p == "ofi_rxm")
}

/// `provider`'s name as two peers compare it before they talk over the fabric (the efa
/// transport's hello and domain): the provider's own, with `+passthru` where [`passthru`]
/// holds, since the two ways of `tcp;ofi_rxm` do not talk to each other.
pub fn wire_name(provider: &str) -> String {
    if passthru(provider) {
        format!("{provider}+passthru")
    } else {
        provider.to_string()
    }
}

/// Whether `provider`'s endpoint keeps an unexpected tagged message of any size until a
/// receive matches it (rxm, `shm` and `efa` do), so a sender may send a tensor before the
/// peer has posted its receive. rxm's [`passthru`] does not: it keeps such a message only up
/// to its inject size and stops reading the connection behind a larger one, so the efa channel
/// waits for the peer's word that its receives are posted (a rendezvous).
pub fn keeps_unexpected(provider: &str) -> bool {
    !passthru(provider)
}

/// Whether the efa stream's messages may share the endpoint's receives (the engine's inbox,
/// `Engine::set_inbox`): receives that match any pipe's message by a tag with its pipe and
/// sequence bits ignored, and that must also take the messages that arrived before them.
///
/// rxm over tcp does (without its [`passthru`], which reports no received tag and keeps no
/// large unexpected message). libfabric 1.17's `shm` does not: a receive with ignored tag bits
/// matches a message that comes after it, but not most of those already waiting as unexpected
/// messages: with an inbox of 4 receives, reposted as each completes, 8 of 15 messages arrive
/// and the rest wait for ever (`backend::efa::engine::tests`,
/// `the_inbox_hands_each_message_to_its_pipe`, which reports the count), while receives with
/// exact tags take every waiting message. The `efa` provider is not reachable here, so it
/// keeps receives per stream too until measured.
pub fn shares_receives(provider: &str) -> bool {
    rides_tcp(provider) && !passthru(provider)
}

/// libfabric's version at run time and the headers' version this build was compiled against,
/// each as (major, minor).
pub fn version() -> ((u32, u32), (u32, u32)) {
    // SAFETY: plain getters without arguments.
    let (run, built) = unsafe { (ffi::ap_version(), ffi::ap_header_version()) };
    ((run >> 16, run & 0xffff), (built >> 16, built & 0xffff))
}

fn constant(which: i32) -> u64 {
    // SAFETY: a switch over integer constants.
    unsafe { ffi::ap_const(which) }
}

/// `FI_EAGAIN`: the provider is out of resources for now; progress the CQ and retry.
pub fn eagain() -> i32 {
    constant(0) as i32
}

/// `FI_ECANCELED`: an operation cancelled with `fi_cancel` (or by closing).
pub fn ecanceled() -> i32 {
    constant(6) as i32
}

/// `FI_ETRUNC`: a message longer than the receive posted for it (the provider's own error
/// completion, read with `fi_cq_readerr`).
pub fn etrunc() -> i32 {
    constant(8) as i32
}

/// `FI_EIO`, the code fault injection reports completions with.
pub fn eio() -> i32 {
    constant(9) as i32
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null NUL-terminated strings owned by the fi_info list, read while it lives.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// What an `fi_info` entry says about a provider's RDM endpoints on one domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// Provider name as libfabric spells it (`tcp;ofi_rxm`, `shm`, `efa`).
    pub provider: String,
    /// Fabric name (`127.0.0.1/32`, `shm`, `efa`).
    pub fabric: String,
    /// Domain name: the NIC (`lo`, `eth0`, `rdmap0s6-rdm`, `shm`).
    pub domain: String,
    /// Largest message one post may carry; larger ones are chunked.
    pub max_msg_size: u64,
    /// Largest message sent inline (`fi_inject` size).
    pub inject_size: u64,
    /// Transmit queue depth.
    pub tx_size: u64,
    /// Receive queue depth.
    pub rx_size: u64,
    /// Whether local buffers must be registered (`FI_MR_LOCAL`).
    pub mr_local: bool,
    /// Whether endpoint addresses are NUL-terminated strings (`FI_ADDR_STR`: shm) rather than
    /// fixed-size binary addresses.
    pub string_addresses: bool,
    /// Whether the endpoints read and write their peers' registered memory (`FI_RMA`: the
    /// `efa` remote-memory path).
    pub rma: bool,
    /// Whether an RMA operation names the target's memory by its virtual address
    /// (`FI_MR_VIRT_ADDR`); otherwise by its offset in the registration.
    pub virt_addr: bool,
}

/// The inject size [`InfoList::get`] asks a provider for when its default is smaller: a
/// small message's frame and a 4 KiB payload's, with room for their headers. Sends up to the
/// inject size go out with `fi_tinject` ([`engine`]): no send completion to read.
pub const INJECT_WANTED: usize = 4096 + 256;

/// The result of `fi_getinfo` for RDM endpoints with tagged messages; freed on drop.
pub struct InfoList {
    head: *mut ffi::FiInfo,
}

impl InfoList {
    /// Every (provider, fabric, domain) offering RDM tagged endpoints; `provider` filters by name
    /// (`tcp;ofi_rxm`, `shm`, `efa`). No match is an error with code `FI_ENODATA`.
    ///
    /// With a provider named, entries that inject less than [`INJECT_WANTED`] bytes by default
    /// are asked again for that much (a hint: `tcp;ofi_rxm` offers 64 B unless asked, and up
    /// to its 16 KiB bounce buffers if asked). The answer is kept only if it lists the same
    /// (provider, fabric, domain) entries in the same order: a provider that cannot grant the
    /// hint for some of its domains keeps its defaults for all.
    pub fn get(provider: Option<&str>) -> Result<InfoList, FabricError> {
        let list = Self::get_with(provider, 0)?;
        let short = list
            .iter()
            .all(|i| i.attributes().inject_size < INJECT_WANTED as u64);
        if provider.is_some() && short {
            if let Ok(more) = Self::get_with(provider, INJECT_WANTED) {
                if more.names() == list.names() {
                    return Ok(more);
                }
            }
        }
        Ok(list)
    }

    /// The entries with RMA (the remote-memory path) where asking for it leaves the list as it
    /// is: the same (provider, fabric, domain) entries in the same order. A provider or domain
    /// without RMA is never dropped for it: then no entry gets it.
    fn get_with(provider: Option<&str>, inject: usize) -> Result<InfoList, FabricError> {
        let plain = Self::get_caps(provider, inject, false)?;
        match Self::get_caps(provider, inject, true) {
            Ok(rma) if rma.names() == plain.names() => Ok(rma),
            _ => Ok(plain),
        }
    }

    /// Each entry's (provider, fabric, domain), in order.
    fn names(&self) -> Vec<(String, String, String)> {
        self.iter()
            .map(|i| {
                let a = i.attributes();
                (a.provider, a.fabric, a.domain)
            })
            .collect()
    }

    fn get_caps(provider: Option<&str>, inject: usize, rma: bool) -> Result<InfoList, FabricError> {
        let name = provider
            .map(CString::new)
            .transpose()
            .map_err(|_| FabricError {
                op: "fi_getinfo",
                provider: provider.unwrap_or_default().into(),
                code: constant(7) as i32,
                text: "provider name holds a NUL byte".into(),
            })?;
        let mut head = std::ptr::null_mut();
        // SAFETY: `name` outlives the call; `head` receives a list we own and free on drop.
        let ret = unsafe {
            ffi::ap_getinfo(
                name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
                inject,
                i32::from(rma),
                &mut head,
            )
        };
        if ret != 0 {
            return Err(FabricError::new(
                "fi_getinfo",
                provider.unwrap_or_default(),
                ret as i64,
            ));
        }
        Ok(InfoList { head })
    }

    /// The entries, in libfabric's order of preference.
    pub fn iter(&self) -> impl Iterator<Item = Info<'_>> {
        let mut p = self.head;
        std::iter::from_fn(move || {
            if p.is_null() {
                return None;
            }
            let cur = p;
            // SAFETY: `cur` is an entry of the list we own.
            p = unsafe { ffi::ap_info_next(cur) };
            Some(Info {
                ptr: cur,
                _list: std::marker::PhantomData,
            })
        })
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed once.
        unsafe { ffi::ap_freeinfo(self.head) }
    }
}

/// One entry of an [`InfoList`].
#[derive(Clone, Copy)]
pub struct Info<'a> {
    ptr: *mut ffi::FiInfo,
    _list: std::marker::PhantomData<&'a InfoList>,
}

impl Info<'_> {
    /// The entry's attributes.
    pub fn attributes(&self) -> Attributes {
        let mut raw = std::mem::MaybeUninit::<ffi::ApInfo>::uninit();
        // SAFETY: the entry lives as long as its list (the lifetime), and ap_info_read fills
        // every field of `raw`.
        let raw = unsafe {
            ffi::ap_info_read(self.ptr, raw.as_mut_ptr());
            raw.assume_init()
        };
        Attributes {
            provider: cstr(raw.provider),
            fabric: cstr(raw.fabric),
            domain: cstr(raw.domain),
            max_msg_size: raw.max_msg_size,
            inject_size: raw.inject_size,
            tx_size: raw.tx_size,
            rx_size: raw.rx_size,
            mr_local: raw.mr_mode & constant(1) != 0,
            string_addresses: raw.addr_format as u64 == constant(10),
            rma: raw.caps & constant(12) != 0,
            virt_addr: raw.mr_mode & constant(13) != 0,
        }
    }
}

struct FabricHandle {
    ptr: *mut ffi::FidFabric,
}

impl Drop for FabricHandle {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return; // handed to `linger` with its domain
        }
        // SAFETY: opened by fi_fabric, closed once, after every domain (domains hold an Rc).
        unsafe { ffi::ap_close_fabric(self.ptr) };
    }
}

/// An open fabric and domain (one NIC of one provider).
pub struct Domain {
    ptr: *mut ffi::FidDomain,
    fabric: FabricHandle,
    attributes: Attributes,
    // Providers whose endpoints must outlive their peers in this process (shm): the domain's
    // member number in `linger`'s registry.
    linger: Option<u64>,
}

impl Domain {
    /// Opens the fabric and the domain `info` names.
    pub fn open(info: Info<'_>) -> Result<Rc<Domain>, FabricError> {
        let attributes = info.attributes();
        let mut fabric = std::ptr::null_mut();
        // SAFETY: info is a live fi_info entry; fabric receives an object we close on drop.
        let ret = unsafe { ffi::ap_fabric(info.ptr, &mut fabric) };
        if ret != 0 {
            return Err(FabricError::new(
                "fi_fabric",
                &attributes.provider,
                ret as i64,
            ));
        }
        let fabric = FabricHandle { ptr: fabric };
        let mut domain = std::ptr::null_mut();
        // SAFETY: as above; the fabric is open.
        let ret = unsafe { ffi::ap_domain(fabric.ptr, info.ptr, &mut domain) };
        if ret != 0 {
            return Err(FabricError::new(
                "fi_domain",
                &attributes.provider,
                ret as i64,
            ));
        }
        let linger = linger::applies(&attributes.provider).then(linger::join);
        Ok(Rc::new(Domain {
            ptr: domain,
            fabric,
            attributes,
            linger,
        }))
    }

    /// What the domain's provider said about it.
    pub fn attributes(&self) -> &Attributes {
        &self.attributes
    }

    /// Registers `len` bytes at `addr` for local sends and receives.
    ///
    /// # Safety
    /// The memory must stay allocated until the [`Mr`] is dropped (the registration cache,
    /// [`regcache`], keeps that rule).
    pub unsafe fn register(
        self: &Rc<Self>,
        addr: *const u8,
        len: usize,
    ) -> Result<Mr, FabricError> {
        // SAFETY: the caller's contract.
        unsafe { self.register_with(addr, len, constant(4) | constant(5)) }
    }

    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// As [`Domain::register`].
    unsafe fn register_with(
        self: &Rc<Self>,
        addr: *const u8,
        len: usize,
        access: u64,
    ) -> Result<Mr, FabricError> {
        let mut mr = std::ptr::null_mut();
        let mut desc = std::ptr::null_mut();
        // SAFETY: the caller keeps the memory alive; mr and desc receive the registration.
        let ret = unsafe { ffi::ap_mr_reg(self.ptr, addr.cast(), len, access, &mut mr, &mut desc) };
        if ret != 0 {
            return Err(FabricError::new(
                "fi_mr_reg",
                &self.attributes.provider,
                ret as i64,
            ));
        }
        Ok(Mr {
            ptr: mr,
            desc,
            _domain: self.clone(),
        })
    }
}

impl Domain {
    /// Registers `len` bytes at `addr` for peers to read with RMA, and to write if `writable`
    /// (the owner's side of the `efa` remote-memory path); [`Mr::key`] is what they name it by.
    ///
    /// # Safety
    /// The memory must stay allocated until the [`Mr`] is dropped, and (if `writable`) be
    /// reached by nobody but its owner and the provider meanwhile (peers write into it).
    pub unsafe fn register_remote(
        self: &Rc<Self>,
        addr: *const u8,
        len: usize,
        writable: bool,
    ) -> Result<Mr, FabricError> {
        let mut access = constant(14) | constant(15) | constant(16);
        if writable {
            access |= constant(17);
        }
        // SAFETY: the caller's contract.
        unsafe { self.register_with(addr, len, access) }
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        if let Some(member) = self.linger {
            // Closed by `linger` once no open endpoint of this process can reach its endpoints.
            let fabric = std::mem::replace(&mut self.fabric.ptr, std::ptr::null_mut());
            return linger::release(member, self.ptr, fabric);
        }
        // SAFETY: opened by fi_domain, closed once, after every endpoint, CQ, AV and MR under it
        // (each holds an Rc of the domain); the fabric closes after it (field drop order).
        unsafe { ffi::ap_close_domain(self.ptr) };
    }
}

/// A memory registration; deregistered on drop.
pub struct Mr {
    ptr: *mut ffi::FidMr,
    desc: *mut c_void,
    _domain: Rc<Domain>,
}

impl Mr {
    /// The local descriptor to pass with a post.
    pub fn desc(&self) -> *mut c_void {
        self.desc
    }

    /// The key peers name this registration by in RMA operations.
    pub fn key(&self) -> u64 {
        // SAFETY: a live registration.
        unsafe { ffi::ap_mr_key(self.ptr) }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: opened by fi_mr_reg, closed once, before its domain.
        unsafe { ffi::ap_close_mr(self.ptr) };
    }
}

/// A completion queue in tagged format.
pub struct Cq {
    ptr: *mut ffi::FidCq,
    wait_fd: Option<RawFd>,
    _domain: Rc<Domain>,
}

impl Drop for Cq {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return; // parked
        }
        // SAFETY: opened by fi_cq_open, closed once, after the endpoint bound to it.
        unsafe { ffi::ap_close_cq(self.ptr) };
    }
}

/// An address vector (table).
pub struct Av {
    ptr: *mut ffi::FidAv,
    _domain: Rc<Domain>,
}

impl Drop for Av {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return; // parked
        }
        // SAFETY: opened by fi_av_open, closed once, after the endpoint bound to it.
        unsafe { ffi::ap_close_av(self.ptr) };
    }
}

struct EpHandle {
    ptr: *mut ffi::FidEp,
}

impl Drop for EpHandle {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return; // parked
        }
        // SAFETY: opened by fi_endpoint, closed once, before its CQ and AV (field order of
        // Endpoint). Closing cancels whatever is still posted.
        unsafe { ffi::ap_close_ep(self.ptr) };
    }
}

/// Whether endpoints of `provider` send to each peer from an endpoint of their own
/// ([`Endpoint`]'s senders): `shm`, whose send completions queue in order behind the slowest
/// peer (see `Senders`).
pub fn sends_per_peer(provider: &str) -> bool {
    provider == "shm"
}

/// One fi_info entry of our own (a copy), freed on drop.
struct OwnedInfo {
    ptr: *mut ffi::FiInfo,
}

impl Drop for OwnedInfo {
    fn drop(&mut self) {
        // SAFETY: a copy made by fi_dupinfo, freed once; nothing keeps a pointer into it (an
        // endpoint opened with it copies what it needs).
        unsafe { ffi::ap_freeinfo(self.ptr) }
    }
}

/// Which endpoint an [`Endpoint`]'s sends to each peer go out on (`shm`: [`sends_per_peer`]).
///
/// libfabric 1.17's `shm` provider answers each send that moves more than its inject size
/// (4 KiB: by cma, or through its bounce buffers for a receiver without cma) with a response
/// the receiver writes into the sender's region once it has copied the message, and it reads
/// those responses from one queue per endpoint, in order, stopping at the first entry still
/// waiting (`smr_progress_resp`). A send that its receiver never answers (a killed peer, or
/// one yet to post the matching receive) therefore holds back the completion of every later
/// such send of that endpoint, to any peer, while the messages themselves arrive: one dead
/// peer stalled every pipe of its endpoint for good. Sends up to the inject size complete at
/// their post and need no response.
///
/// So the responses of each peer's sends get a queue of their own: each peer's sends go out on
/// an endpoint of its own, opened on the same domain and bound to the main endpoint's CQ and
/// AV, so its completions come with the others' and its `fi_addr_t`s are the AV's. Receives
/// stay on the main endpoint, whose address is the one peers know: a receiver matches by tag
/// and never asks which endpoint sent, so nothing changes for the peer. A stalled queue then
/// holds back only the sends to the peer that does not answer.
///
/// The main endpoint sends to one peer itself (the first inserted while it has none), so an
/// endpoint with one peer at a time opens nothing more. A peer removed from the AV (the engine
/// removes one only once every op of its pipes has ended: none of its responses is left in
/// the queue) gives its sending endpoint back for the next new peer. A dead peer's sends never
/// end, so its endpoint is never handed out again. The endpoints close with the main one
/// (parked with it where `linger` applies). Each costs an `shm` region (16 MiB of
/// `/dev/shm`, a few MiB of it touched) and a turn of every CQ read's progress.
struct Senders {
    info: OwnedInfo,
    /// The endpoint each peer's sends go out on: `None` the main one, `Some(i)` `eps[i]`.
    lanes: HashMap<FiAddr, Option<usize>>,
    eps: Vec<EpHandle>,
    /// Endpoints of `eps` that no peer uses.
    idle: Vec<usize>,
    /// Peers whose sends the main endpoint carries: one, or more where opening an endpoint
    /// of their own failed (they then share its queue, as before).
    on_main: usize,
}

impl Senders {
    /// The endpoint that sends to `dest`, if not the main one.
    fn of(&self, dest: FiAddr) -> Option<*mut ffi::FidEp> {
        if self.eps.is_empty() {
            return None; // one peer at a time: no lookup on the way of every send
        }
        match self.lanes.get(&dest) {
            Some(Some(i)) => Some(self.eps[*i].ptr),
            _ => None,
        }
    }

    /// Takes `lane` back from a peer that no longer uses it.
    fn give_back(&mut self, lane: Option<usize>) {
        match lane {
            None => self.on_main = self.on_main.saturating_sub(1),
            Some(i) => self.idle.push(i),
        }
    }
}

/// Why a post did not go through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostError {
    /// `-FI_EAGAIN`: no room now; progress the CQ and retry.
    Again,
    /// Anything else: the operation cannot be posted.
    Failed(FabricError),
}

/// One completion read from the CQ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The context pointer given to the post, as an integer.
    pub context: u64,
    /// The tag of a tagged receive's message (senders: whatever the provider reports). Not
    /// every provider reports it: libfabric 1.17's rxm in passthru mode reports 0.
    pub tag: u64,
    /// The remote CQ data a received message carried (0 if none).
    pub data: u64,
    /// Bytes received (receives).
    pub len: u64,
    /// `Err` for an error completion.
    pub result: Result<(), FabricError>,
}

/// An enabled RDM endpoint with its completion queue and address vector.
///
/// Fields drop in order: the endpoint (and its senders) close before its CQ and AV, which close
/// before the domain.
///
/// On `shm` ([`sends_per_peer`]) the sends to each peer go out on an endpoint of their own, on
/// the same CQ and AV, so that a peer that never answers its sends (a dead one) holds back no
/// other peer's send completions: see `Senders` and docs/efa.md, "A dead peer's sends on `shm`".
pub struct Endpoint {
    ep: EpHandle,
    // Before the CQ and AV, which they are bound to.
    senders: Option<RefCell<Senders>>,
    cq: Cq,
    av: Av,
    domain: Rc<Domain>,
    name: Vec<u8>,
    raw: Vec<RawCompletion>,
}

impl Endpoint {
    /// Opens an endpoint on `domain` with the entry `info` that opened it. The CQ gets a wait fd
    /// if the provider offers one (`FI_WAIT_FD`), none otherwise.
    pub fn open(domain: &Rc<Domain>, info: Info<'_>) -> Result<Endpoint, FabricError> {
        Endpoint::open_with(domain, info, true)
    }

    /// [`Endpoint::open`], its CQ with a wait fd only if `wait_fd` asks for one (and the
    /// provider offers it). A CQ without one is only polled, and costs no signalling: a
    /// provider's CQ with a wait fd writes to that fd when a completion arrives and reads it
    /// back once the CQ is drained (on `tcp;ofi_rxm`, a `write` and a `read` system call per
    /// completion, whether or not anybody waits on the fd).
    pub fn open_with(
        domain: &Rc<Domain>,
        info: Info<'_>,
        wait_fd: bool,
    ) -> Result<Endpoint, FabricError> {
        let provider = domain.attributes.provider.clone();
        let size = (domain.attributes.tx_size + domain.attributes.rx_size).clamp(64, 1 << 16);
        let mut cq_ptr = std::ptr::null_mut();
        let mut fd: std::ffi::c_int = -1;
        let want = std::ffi::c_int::from(wait_fd);
        // SAFETY: the domain is open; cq_ptr and fd receive a CQ we close on drop.
        let mut ret =
            unsafe { ffi::ap_cq_open(domain.ptr, size as usize, want, &mut cq_ptr, &mut fd) };
        if ret != 0 && wait_fd {
            // No wait object here (shm): a CQ we poll.
            // SAFETY: as above.
            ret = unsafe { ffi::ap_cq_open(domain.ptr, size as usize, 0, &mut cq_ptr, &mut fd) };
        }
        if ret != 0 {
            return Err(FabricError::new("fi_cq_open", &provider, ret as i64));
        }
        let cq = Cq {
            ptr: cq_ptr,
            wait_fd: (fd >= 0).then_some(fd),
            _domain: domain.clone(),
        };
        let mut av_ptr = std::ptr::null_mut();
        // SAFETY: the domain is open; av_ptr receives an AV we close on drop.
        let ret = unsafe { ffi::ap_av_open(domain.ptr, &mut av_ptr) };
        if ret != 0 {
            return Err(FabricError::new("fi_av_open", &provider, ret as i64));
        }
        let av = Av {
            ptr: av_ptr,
            _domain: domain.clone(),
        };
        let mut ep_ptr = std::ptr::null_mut();
        // SAFETY: info, domain, CQ and AV are live; ep_ptr receives an endpoint closed on drop.
        let ret = unsafe { ffi::ap_endpoint(domain.ptr, info.ptr, cq.ptr, av.ptr, &mut ep_ptr) };
        if ret != 0 {
            return Err(FabricError::new("fi_endpoint", &provider, ret as i64));
        }
        let ep = EpHandle { ptr: ep_ptr };
        let mut name = vec![0u8; 256];
        let mut len = name.len();
        // SAFETY: name has len bytes of room; the provider writes at most len and updates it.
        let ret = unsafe { ffi::ap_getname(ep.ptr, name.as_mut_ptr().cast(), &mut len) };
        if ret != 0 {
            return Err(FabricError::new("fi_getname", &provider, ret as i64));
        }
        name.truncate(len);
        if let Some(member) = domain.linger {
            linger::named(member, &name);
        }
        let senders = if sends_per_peer(&provider) {
            // SAFETY: info is a live fi_info entry; the copy is ours, freed on drop.
            let copy = unsafe { ffi::ap_dupinfo(info.ptr) };
            if copy.is_null() {
                return Err(FabricError::new(
                    "fi_dupinfo",
                    &provider,
                    constant(11) as i64,
                ));
            }
            Some(RefCell::new(Senders {
                info: OwnedInfo { ptr: copy },
                lanes: HashMap::new(),
                eps: Vec::new(),
                idle: Vec::new(),
                on_main: 0,
            }))
        } else {
            None
        };
        Ok(Endpoint {
            ep,
            senders,
            cq,
            av,
            domain: domain.clone(),
            name,
            raw: vec![RawCompletion::default(); 64],
        })
    }

    /// The domain this endpoint lives on.
    pub fn domain(&self) -> &Rc<Domain> {
        &self.domain
    }

    /// The provider's name.
    pub fn provider(&self) -> &str {
        &self.domain.attributes.provider
    }

    /// This endpoint's address, to give to peers (opaque bytes, provider-specific).
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// Inserts a peer's address (its [`Endpoint::name`]) into the address vector.
    pub fn insert(&self, name: &[u8]) -> Result<FiAddr, FabricError> {
        let fits = if self.domain.attributes.string_addresses {
            // A string address: the provider reads up to its NUL.
            name.contains(&0)
        } else {
            // A binary address of the provider's fixed size.
            name.len() == self.name.len()
        };
        if !fits {
            // Never hand the provider fewer bytes than it will read (a peer of another
            // provider, or a truncated hello).
            return Err(FabricError {
                op: "fi_av_insert",
                provider: self.provider().into(),
                code: constant(7) as i32,
                text: format!(
                    "peer address ({} bytes) is not an address of this provider (ours: {} bytes{})",
                    name.len(),
                    self.name.len(),
                    if self.domain.attributes.string_addresses {
                        ", NUL-terminated"
                    } else {
                        ""
                    }
                ),
            });
        }
        if let Some(member) = self.domain.linger {
            // Links us to a peer of this process before the provider maps it (see `linger`).
            if !linger::link(member, name) {
                return Err(FabricError {
                    op: "fi_av_insert",
                    provider: self.provider().into(),
                    code: constant(7) as i32,
                    text: "the peer is an endpoint of this process that is closed already".into(),
                });
            }
        }
        // The peer's sending endpoint is bound to the AV before the address goes in, so the
        // provider maps the peer for it too.
        let lane = self.sender_for_new_peer();
        let mut out = 0;
        // SAFETY: the provider reads one address of its own format from `name`, which holds a
        // whole one (checked above) and outlives the call.
        let ret = unsafe { ffi::ap_av_insert(self.av.ptr, name.as_ptr().cast(), &mut out) };
        if let Some(s) = &self.senders {
            let mut s = s.borrow_mut();
            if ret != 0 {
                s.give_back(lane);
            } else if let Some(old) = s.lanes.insert(out, lane) {
                // An address inserted twice: the provider hands back the same fi_addr_t.
                s.give_back(old);
            }
        }
        if ret != 0 {
            return Err(FabricError::new(
                "fi_av_insert",
                self.provider(),
                ret as i64,
            ));
        }
        Ok(out)
    }

    /// The endpoint a peer about to be inserted will send on ([`Senders`]): the main one if it
    /// sends to nobody, else an idle one, else a new one. `None` (the main one) also where the
    /// provider needs none, or where opening one fails (then that peer shares the main one's
    /// queue of responses, as without senders).
    fn sender_for_new_peer(&self) -> Option<usize> {
        let s = self.senders.as_ref()?;
        let mut s = s.borrow_mut();
        if s.on_main == 0 {
            s.on_main = 1;
            return None;
        }
        if let Some(i) = s.idle.pop() {
            return Some(i);
        }
        let mut ep = std::ptr::null_mut();
        // SAFETY: our copy of the entry, the domain, the CQ and the AV are live; ep receives an
        // endpoint closed on drop (or parked with ours), before the CQ and AV.
        let ret = unsafe {
            ffi::ap_endpoint(
                self.domain.ptr,
                s.info.ptr,
                self.cq.ptr,
                self.av.ptr,
                &mut ep,
            )
        };
        if ret != 0 {
            let e = FabricError::new("fi_endpoint", self.provider(), ret as i64);
            tracing::warn!(
                "{e}: this peer's sends share the endpoint's queue of responses (a dead peer \
                 can hold back their completions)"
            );
            s.on_main += 1;
            return None;
        }
        s.eps.push(EpHandle { ptr: ep });
        Some(s.eps.len() - 1)
    }

    /// How many endpoints of its own this endpoint has opened for its peers' sends (`shm`:
    /// see [`Endpoint`]); the main endpoint sends to one peer itself.
    pub fn send_endpoints(&self) -> usize {
        self.senders.as_ref().map_or(0, |s| s.borrow().eps.len())
    }

    /// The endpoint that sends to `dest`.
    fn sender(&self, dest: FiAddr) -> *mut ffi::FidEp {
        self.senders
            .as_ref()
            .and_then(|s| s.borrow().of(dest))
            .unwrap_or(self.ep.ptr)
    }

    /// Removes a peer's address from the address vector: call it only once every op with that
    /// peer has ended.
    ///
    /// On `shm` ([`sends_per_peer`]) the address stays in the AV and only the peer's sending
    /// endpoint goes back to the idle ones. libfabric 1.17's `shm` forgets a removed peer in
    /// its map but leaves each endpoint's own record of how that peer numbers it, and the AV
    /// hands the freed `fi_addr_t` to the next peer inserted: sends to that peer then go out
    /// stamped as the removed peer's, and the new peer answers them into the region of
    /// whichever peer it knows by that number (`scripts/shm-stall.sh`, against 1.17: the
    /// message arrived, its send never completed). Kept, the address names the same peer for the endpoint's
    /// life, and inserting it again hands back the same `fi_addr_t`. The price: every peer
    /// an endpoint ever had keeps a slot of the provider's 256 and its region mapped until the
    /// endpoint closes.
    pub fn remove(&self, addr: FiAddr) -> Result<(), FabricError> {
        if let Some(s) = &self.senders {
            let mut s = s.borrow_mut();
            if let Some(lane) = s.lanes.remove(&addr) {
                s.give_back(lane);
            }
            return Ok(());
        }
        // SAFETY: the AV is open; removing an unknown address is an error code, not UB.
        let ret = unsafe { ffi::ap_av_remove(self.av.ptr, addr) };
        if ret != 0 {
            return Err(FabricError::new(
                "fi_av_remove",
                self.provider(),
                ret as i64,
            ));
        }
        Ok(())
    }

    fn post_result(&self, op: &'static str, ret: isize) -> Result<(), PostError> {
        if ret == 0 {
            Ok(())
        } else if -ret as i64 == constant(0) as i64 {
            Err(PostError::Again)
        } else {
            Err(PostError::Failed(FabricError::new(
                op,
                self.provider(),
                ret as i64,
            )))
        }
    }

    /// Posts a tagged send of `len` bytes at `buf` to `dest`; with `data` non-zero the message
    /// carries it as remote CQ data (`fi_tsenddata`: the receive's [`Completion::data`]).
    ///
    /// # Safety
    /// `buf..buf+len` must stay readable and `context` valid (and untouched by us beyond
    /// `FI_CONTEXT2`'s 64 bytes, which the provider may write) until the completion for
    /// `context` has been read, the op cancelled and its completion read, or the endpoint
    /// dropped. `desc` is null or the descriptor of a live registration covering the buffer.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tsend(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: FiAddr,
        tag: u64,
        data: u64,
        context: *mut c_void,
    ) -> Result<(), PostError> {
        // SAFETY: the caller's contract above.
        let ret = unsafe {
            ffi::ap_tsend(
                self.sender(dest),
                buf.cast(),
                len,
                desc,
                dest,
                tag,
                data,
                context,
            )
        };
        self.post_result("fi_tsend", ret)
    }

    /// Posts an RMA read of `len` bytes at `addr` of `peer`'s registration `key` into `buf`
    /// (`fi_read`), or with `write` an RMA write of `buf` there (`fi_writemsg`, delivery
    /// complete: its completion says the bytes are in the peer's memory).
    ///
    /// # Safety
    /// As [`Endpoint::tsend`], with `buf..buf+len` writable (a read) and not otherwise accessed
    /// until the completion.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rma(
        &self,
        write: bool,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        peer: FiAddr,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Result<(), PostError> {
        let ep = self.sender(peer);
        // SAFETY: the caller's contract above.
        let ret = unsafe {
            if write {
                ffi::ap_write(ep, buf.cast(), len, desc, peer, addr, key, context)
            } else {
                ffi::ap_read(ep, buf.cast(), len, desc, peer, addr, key, context)
            }
        };
        self.post_result(if write { "fi_write" } else { "fi_read" }, ret)
    }

    /// Sends `buf` (at most [`Attributes::inject_size`] bytes) to `dest`, tagged `tag`, as an
    /// inject: the provider has taken the bytes when this returns `Ok`, and no completion
    /// follows. No registration is needed. `data` as in [`Endpoint::tsend`]
    /// (`fi_tinjectdata`).
    pub fn tinject(&self, buf: &[u8], dest: FiAddr, tag: u64, data: u64) -> Result<(), PostError> {
        let (ptr, len) = (buf.as_ptr().cast(), buf.len());
        // SAFETY: `buf` is a live slice for the call; an inject copies it (or sends it) before
        // returning, and keeps no pointer to it or to any context.
        let ret = unsafe { ffi::ap_tinject(self.sender(dest), ptr, len, dest, tag, data) };
        self.post_result("fi_tinject", ret)
    }

    /// Posts a tagged receive of up to `len` bytes into `buf`, matching `tag` (bits set in
    /// `ignore` are not compared) from `src` ([`Endpoint::any_source`] for any).
    ///
    /// # Safety
    /// As [`Endpoint::tsend`], with `buf..buf+len` writable and not otherwise accessed.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn trecv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: FiAddr,
        tag: u64,
        ignore: u64,
        context: *mut c_void,
    ) -> Result<(), PostError> {
        // SAFETY: the caller's contract above.
        let ret = unsafe {
            ffi::ap_trecv(
                self.ep.ptr,
                buf.cast(),
                len,
                desc,
                src,
                tag,
                ignore,
                context,
            )
        };
        self.post_result("fi_trecv", ret)
    }

    /// `FI_ADDR_UNSPEC`: a receive from any source.
    pub fn any_source() -> FiAddr {
        constant(3)
    }

    /// Asks the provider to cancel the operation posted with `context`; its completion then
    /// comes with `FI_ECANCELED` (or normally, if it finished first). Asked of the main
    /// endpoint, which holds every receive: the sends of a peer's own endpoint (`shm`) are
    /// not asked, as `shm` cancels receives only.
    ///
    /// # Safety
    /// `context` is the context of an operation posted on this endpoint whose completion has
    /// not been read, or a pointer the provider will not find (then nothing happens); the
    /// provider may compare it with its own and, for some providers, read the op's scratch.
    pub unsafe fn cancel(&self, context: *mut c_void) {
        // SAFETY: the caller's contract above; an unknown context is answered -FI_ENOENT.
        unsafe { ffi::ap_cancel(self.ep.ptr, context) };
    }

    /// Reads up to 64 completions, calling `f` for each. Returns how many were read (0: the CQ
    /// is empty). An `Err` is a failure of the CQ itself, not of an operation.
    pub fn poll(&mut self, mut f: impl FnMut(Completion)) -> Result<usize, FabricError> {
        let mut text = [0 as std::ffi::c_char; 256];
        // SAFETY: raw has 64 entries of room and text 256 bytes; the shim writes within them.
        let n = unsafe {
            ffi::ap_cq_read(
                self.cq.ptr,
                self.raw.as_mut_ptr(),
                self.raw.len(),
                text.as_mut_ptr(),
                text.len(),
            )
        };
        if n < 0 {
            return Err(FabricError::new("fi_cq_read", self.provider(), n as i64));
        }
        for raw in &self.raw[..n as usize] {
            let result = if raw.err == 0 {
                Ok(())
            } else {
                // SAFETY: the shim NUL-terminates `text` (snprintf), or left it zeroed.
                let detail = unsafe { CStr::from_ptr(text.as_ptr()) }.to_string_lossy();
                let mut e = FabricError::new("completion", self.provider(), raw.err as i64);
                if !detail.is_empty() && detail != e.text {
                    e.text = format!("{} ({detail})", e.text);
                }
                Err(e)
            };
            f(Completion {
                context: raw.context,
                tag: raw.tag,
                data: raw.data,
                len: raw.len,
                result,
            });
        }
        Ok(n as usize)
    }

    /// The CQ's wait fd, where the provider has one: readable when completions may be waiting.
    pub fn wait_fd(&self) -> Option<RawFd> {
        self.cq.wait_fd
    }

    /// Whether it is safe to sleep on [`Endpoint::wait_fd`] now (`fi_trywait`); `false` means
    /// poll the CQ again first.
    pub fn trywait(&self) -> bool {
        // SAFETY: fabric and CQ are open.
        unsafe { ffi::ap_trywait(self.domain.fabric.ptr, self.cq.ptr) == 0 }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let Some(member) = self.domain.linger else {
            return; // the fields close it: endpoint, then CQ and AV
        };
        // Parked, not closed: a peer of this process may still reach its region (see `linger`).
        // Nothing posts on it or reads its CQ after this, so the provider never touches the
        // memory of its pending operations again.
        let senders = self.senders.as_ref().map_or_else(Vec::new, |s| {
            s.borrow_mut()
                .eps
                .iter_mut()
                .map(|e| std::mem::replace(&mut e.ptr, std::ptr::null_mut()))
                .collect()
        });
        let parked = linger::Parked {
            senders,
            ep: std::mem::replace(&mut self.ep.ptr, std::ptr::null_mut()),
            cq: std::mem::replace(&mut self.cq.ptr, std::ptr::null_mut()),
            av: std::mem::replace(&mut self.av.ptr, std::ptr::null_mut()),
        };
        linger::park(member, parked);
    }
}

#[cfg(test)]
pub(crate) mod tests;

/// What libfabric offers on this host, for `actorpipe info`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    /// libfabric's version at run time (`major.minor`).
    pub version: String,
    /// The headers' version this build was compiled against.
    pub built_against: String,
    /// Every (provider, fabric, domain) with RDM tagged endpoints, in libfabric's order.
    pub domains: Vec<DomainReport>,
    /// Whether the `efa` provider itself is usable here, and why not.
    pub efa: Result<(), String>,
}

/// One domain in a [`Report`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DomainReport {
    /// Provider name.
    pub provider: String,
    /// Fabric name.
    pub fabric: String,
    /// Domain (NIC) name.
    pub domain: String,
    /// Largest message per post.
    pub max_msg_size: u64,
    /// Whether local buffers must be registered.
    pub mr_local: bool,
}

/// Lists what libfabric offers here.
pub fn report() -> Report {
    let ((maj, min), (hmaj, hmin)) = version();
    let domains = match InfoList::get(None) {
        Ok(list) => list
            .iter()
            .map(|i| {
                let a = i.attributes();
                DomainReport {
                    provider: a.provider,
                    fabric: a.fabric,
                    domain: a.domain,
                    max_msg_size: a.max_msg_size,
                    mr_local: a.mr_local,
                }
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    let efa = if domains.iter().any(|d| d.provider == "efa") {
        Ok(())
    } else {
        Err(match InfoList::get(Some("efa")) {
            Err(e) => format!(
                "libfabric lists no efa domain ({}): no Elastic Fabric Adapter on this host \
                 (EFA exists only on AWS instances that have one attached, with the efa kernel \
                 driver); the tcp;ofi_rxm and shm providers run the same code",
                e.text
            ),
            Ok(_) => "the efa provider offers no RDM endpoint with tagged messages".into(),
        })
    };
    Report {
        version: format!("{maj}.{min}"),
        built_against: format!("{hmaj}.{hmin}"),
        domains,
        efa,
    }
}
