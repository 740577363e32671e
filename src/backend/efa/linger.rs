//! Closing shm endpoints that peers of this process may still reach.
//!
//! libfabric's `shm` provider (1.17, and `efa`, which reaches same-host peers through an shm
//! endpoint of its own) keeps every endpoint's queues in a shared-memory region. For a peer in
//! another process it maps the peer's region itself; for a peer in **this** process it uses the
//! peer's own mapping (it finds it in a process-wide list by name). So when an endpoint closes,
//! its region is unmapped under every endpoint of the process that has it as a peer, and the next
//! post or completion-queue read of such an endpoint (a response to hand back, an inject buffer
//! to return to the peer's pool) touches unmapped memory: SIGSEGV in `pthread_spin_trylock`
//! under `fi_cq_read`. Removing the peer from the address vector first does not help: the
//! provider's pending operations keep the pointer.
//!
//! The rule kept here: **an shm endpoint is closed only when no open endpoint of this process
//! has it as a peer.** Each domain of such a provider is a member of a process-wide registry;
//! an address inserted into an endpoint's address vector that names an endpoint of this process
//! links the two members (both ways: the provider lets either side write into the other's
//! region). When its owner drops an endpoint, the endpoint, its CQ and AV are *parked* here
//! instead of closed: nobody posts on it or reads its CQ again, so the provider never touches
//! its buffers again. When the domain itself is dropped (its last user gone) the member is
//! *released*, and every released member all of whose links are released too is closed, domain
//! and fabric included. Closing released members in any order is safe: a close does not touch
//! its peers' regions (tests/efa_close.rs checks it). An address of an endpoint of this process
//! that is already closed is refused at insert (the provider would use its stale mapping).
//!
//! Cost: a short-lived endpoint that talked to a long-lived one of the same process stays open
//! (parked, idle) until that one closes too. Peers in other processes are not affected.
//!
//! The registry's first member also removes the regions a killed process with this pid left in
//! `/dev/shm` (the provider creates its region exclusively, so they would make this process's
//! `fi_endpoint` fail with `EBUSY`): see `sweep_stale_regions_of_this_pid`.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::ffi;

/// Whether endpoints of `provider` must linger (see the module docs).
pub(super) fn applies(provider: &str) -> bool {
    provider == "shm" || provider == "efa"
}

/// An endpoint's libfabric objects, parked after its owner dropped it.
pub(super) struct Parked {
    /// The endpoints its sends to its peers went out on (`shm`), bound to its CQ and AV.
    pub senders: Vec<*mut ffi::FidEp>,
    pub ep: *mut ffi::FidEp,
    pub cq: *mut ffi::FidCq,
    pub av: *mut ffi::FidAv,
}

struct Member {
    released: bool,
    links: HashSet<u64>,
    names: Vec<Vec<u8>>,
    parked: Vec<Parked>,
    domain: Option<(*mut ffi::FidDomain, *mut ffi::FidFabric)>,
}

#[derive(Default)]
struct Registry {
    next: u64,
    members: HashMap<u64, Member>,
    names: HashMap<Vec<u8>, u64>,
    closed: HashSet<Vec<u8>>,
}

// SAFETY: the raw pointers are libfabric objects that nobody else uses any more: parked
// endpoints are never posted on or polled again, and a domain is handed over only when its last
// Rust owner is gone. They are opened with FI_THREAD_DOMAIN, which asks the application to
// serialize calls within a domain, not to make them from one thread: every call on them here is
// made under the registry's mutex.
unsafe impl Send for Registry {}

fn registry() -> MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The part of an address the provider reads: a string address ends at its NUL.
fn key(name: &[u8]) -> Vec<u8> {
    name.split(|b| *b == 0).next().unwrap_or_default().to_vec()
}

/// A new member, for a domain just opened.
pub(super) fn join() -> u64 {
    static SWEPT: OnceLock<()> = OnceLock::new();
    SWEPT.get_or_init(sweep_stale_regions_of_this_pid);
    let mut r = registry();
    r.next += 1;
    let id = r.next;
    r.members.insert(
        id,
        Member {
            released: false,
            links: HashSet::new(),
            names: Vec::new(),
            parked: Vec::new(),
            domain: None,
        },
    );
    id
}

/// Records the address of an endpoint just opened on `member`'s domain.
pub(super) fn named(member: u64, name: &[u8]) {
    let mut r = registry();
    let k = key(name);
    r.names.insert(k.clone(), member);
    if let Some(m) = r.members.get_mut(&member) {
        m.names.push(k);
    }
}

/// Called before `member` inserts the address `peer`: links the two if `peer` is an endpoint of
/// this process. `false`: `peer` is an endpoint of this process that is closed already.
pub(super) fn link(member: u64, peer: &[u8]) -> bool {
    let mut r = registry();
    let k = key(peer);
    if r.closed.contains(&k) {
        return false;
    }
    let Some(&other) = r.names.get(&k) else {
        return true;
    };
    if other != member {
        for (a, b) in [(member, other), (other, member)] {
            if let Some(m) = r.members.get_mut(&a) {
                m.links.insert(b);
            }
        }
    }
    true
}

/// Parks an endpoint its owner dropped; it closes with its member.
pub(super) fn park(member: u64, parked: Parked) {
    let mut r = registry();
    match r.members.get_mut(&member) {
        Some(m) => m.parked.push(parked),
        // Unreachable (a member lives until its domain is released), but never leak.
        None => close(parked),
    }
}

/// The member's domain was dropped: closes every member that no open one can reach any more.
pub(super) fn release(member: u64, domain: *mut ffi::FidDomain, fabric: *mut ffi::FidFabric) {
    let mut r = registry();
    let Some(m) = r.members.get_mut(&member) else {
        return;
    };
    m.released = true;
    m.domain = Some((domain, fabric));
    let mut candidates: Vec<u64> = m.links.iter().copied().collect();
    candidates.push(member);
    for id in candidates {
        let closable = r.members.get(&id).is_some_and(|m| {
            m.released
                && m.links
                    .iter()
                    .all(|l| r.members.get(l).is_none_or(|o| o.released))
        });
        if !closable {
            continue;
        }
        let Some(m) = r.members.remove(&id) else {
            continue;
        };
        for l in &m.links {
            if let Some(o) = r.members.get_mut(l) {
                o.links.remove(&id);
            }
        }
        for n in m.names {
            r.names.remove(&n);
            r.closed.insert(n);
        }
        for p in m.parked {
            close(p);
        }
        if let Some((d, f)) = m.domain {
            // SAFETY: every endpoint, CQ and AV of the domain is closed (above, or by its owner
            // when it never had a name); its memory registrations went before its last Rc.
            unsafe {
                ffi::ap_close_domain(d);
                ffi::ap_close_fabric(f);
            }
        }
    }
}

fn close(p: Parked) {
    // SAFETY: objects of a parked endpoint, each closed once, its endpoints before the CQ and AV
    // bound to them; no peer that could still reach its region is open (see `release`).
    unsafe {
        for ep in p.senders {
            ffi::ap_close_ep(ep);
        }
        ffi::ap_close_ep(p.ep);
        ffi::ap_close_cq(p.cq);
        ffi::ap_close_av(p.av);
    }
}

/// Removes the shm regions a dead process with this process's pid left behind.
///
/// libfabric 1.17's `shm` provider names an endpoint's region `/dev/shm/PID:N:M` and creates it
/// exclusively; a process killed with SIGKILL never unlinks its regions (16 MiB each). When the
/// pid comes round again, the new process's `fi_endpoint` fails with `EBUSY` ("Device or
/// resource busy"): the peer-death tests, which kill processes by the dozen, met it on a busy
/// machine. Before this process's first shm domain has an endpoint, every region named after
/// its pid is such a leftover, so it is unlinked. Regions of other pids are left alone: their
/// process may live in another pid namespace that shares this `/dev/shm`.
fn sweep_stale_regions_of_this_pid() {
    sweep(std::path::Path::new("/dev/shm"), std::process::id());
}

/// Unlinks the files of `dir` named `PID:N:M` for `pid`; returns how many.
fn sweep(dir: &std::path::Path, pid: u32) -> usize {
    let prefix = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        // The provider's own shape only: PID:N:M, digits.
        let mut parts = rest.split(':');
        let shaped = parts.clone().count() == 2
            && parts.all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        if !shaped {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                removed += 1;
                tracing::info!(region = name, "removed a stale shm region of this pid")
            }
            Err(e) => tracing::warn!(region = name, error = %e, "stale shm region left in place"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    #[test]
    fn sweep_removes_only_this_pids_regions_of_the_providers_shape() {
        let dir = std::env::temp_dir().join(format!("ap-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let names = [
            "4242:0:0",
            "4242:3:12",
            "42420:0:0",
            "4242:x:0",
            "4242:0",
            "77:0:0",
        ];
        for n in names {
            std::fs::write(dir.join(n), b"").unwrap();
        }
        assert_eq!(super::sweep(&dir, 4242), 2);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["42420:0:0", "4242:0", "4242:x:0", "77:0:0"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
