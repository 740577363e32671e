//! The I/O pool (`ContextBuilder::io_threads`): mpt's lanes run their loops on threads of their
//! own, and the pipe keeps ordering and failure semantics. The conformance suite runs over the
//! pool too (`mpt_pool`, `mpt_pool_many_lanes` in `tests/integration/conformance.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::RawFd;

use actix::Addr;
use actorpipe::*;

use crate::common::*;

fn mpt(lanes: u32, threads: usize) -> ContextBuilder {
    Context::builder()
        .without("shm")
        .only_channels(&["mpt", "basic"])
        .lanes(lanes)
        .io_threads(threads)
}

/// This process's threads whose name starts with `actix-rt` (arbiters: the test's own and
/// every pool thread), with the CPU time each has used so far, in ns
/// (`/proc/self/task/TID/schedstat`).
fn arbiter_threads() -> BTreeMap<u32, u64> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/task").expect("procfs") {
        let dir = entry.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("actix-rt") {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        let ns = stat.split_whitespace().next().unwrap().parse().unwrap();
        let tid = dir.file_name().unwrap().to_str().unwrap().parse().unwrap();
        out.insert(tid, ns);
    }
    out
}

/// Echo-free transfer: `tx` writes `n` messages of one `size`-byte tensor, `rx` reads them.
async fn transfer(tx: &Addr<Pipe>, rx: &Addr<Pipe>, n: u64, size: usize) {
    let (to, mut done) = inbox::<WriteDone>();
    for i in 0..n {
        tx.do_send(Write::new(checked_message(i, &[], &[size])).notify(to.clone()));
    }
    for i in 0..n {
        assert_eq!(verify(&read_one(rx).await.expect("read")), i);
        let d = done.recv().await.unwrap();
        assert_eq!(d.id, i);
        d.result.expect("write");
    }
}

// The tests of this file count threads: one at a time, and no other test alongside.
use crate::ONE_AT_A_TIME;

#[actix::test]
#[allow(clippy::await_holding_lock)]
async fn lanes_run_on_threads_of_their_own() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // Linux only, as the crate is: a missing procfs fails the test rather than passing it.
    assert!(
        std::path::Path::new("/proc/self/task/").exists(),
        "this test counts threads in /proc/self/task, which is missing"
    );
    let before: BTreeSet<u32> = arbiter_threads().into_keys().collect();
    let (tx, rx, _s) = pair(mpt(4, 4), mpt(4, 4)).await;
    let info = tx.send(GetInfo).await.unwrap();
    assert_eq!(info.connections.len(), 4, "{:?}", info.connections);
    let start = arbiter_threads();
    let pool: Vec<u32> = start
        .keys()
        .filter(|t| !before.contains(t))
        .copied()
        .collect();
    // Each context's pool started one thread per lane but the first, which stays on the
    // context's arbiter with the pipe and moves its share of each tensor there.
    assert_eq!(pool.len(), 6, "pool threads {pool:?}");
    within(120, "transfer", transfer(&tx, &rx, 4, 32 << 20)).await;
    let end = arbiter_threads();
    // 4 × 32 MiB in 8 MiB stripes: every pool thread of both sides moved bytes. Copying 8 MiB
    // per message through the kernel takes milliseconds; an idle arbiter uses microseconds.
    let busy = pool
        .iter()
        .filter(|t| end.get(t).copied().unwrap_or(0) - start[t] > 2_000_000)
        .count();
    assert_eq!(
        busy,
        6,
        "CPU ns per pool thread: {:?}",
        pool.iter()
            .map(|t| end.get(t).copied().unwrap_or(0) - start[t])
            .collect::<Vec<_>>()
    );
}

/// An IPv4 socket address from what `getsockname` or `getpeername` wrote.
fn v4(ss: &libc::sockaddr_storage) -> Option<std::net::SocketAddr> {
    if ss.ss_family != libc::AF_INET as libc::sa_family_t {
        return None;
    }
    // SAFETY: the family says this is a sockaddr_in, which fits in a sockaddr_storage.
    let sin: libc::sockaddr_in = unsafe { std::mem::transmute_copy(ss) };
    let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
    Some((ip, u16::from_be(sin.sin_port)).into())
}

/// Our connected socket from `local` to `peer` (`tcp://IP:PORT` each), among our descriptors.
fn socket_between(local: &str, peer: &str) -> Option<RawFd> {
    let parse = |u: &str| {
        u.strip_prefix("tcp://")?
            .parse::<std::net::SocketAddr>()
            .ok()
    };
    let want = (parse(local)?, parse(peer)?);
    for entry in std::fs::read_dir("/proc/self/fd").ok()? {
        let fd: RawFd = entry.ok()?.file_name().to_str()?.parse().ok()?;
        type Get = unsafe extern "C" fn(
            libc::c_int,
            *mut libc::sockaddr,
            *mut libc::socklen_t,
        ) -> libc::c_int;
        let name = |f: Get| {
            // SAFETY: a zeroed sockaddr_storage is valid; the call writes at most `len` bytes.
            unsafe {
                let mut ss: libc::sockaddr_storage = std::mem::zeroed();
                let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
                let r: libc::c_int = f(fd, &mut ss as *mut _ as *mut libc::sockaddr, &mut len);
                (r == 0).then_some(ss)
            }
        };
        let (Some(l), Some(p)) = (
            name(libc::getsockname as Get),
            name(libc::getpeername as Get),
        ) else {
            continue;
        };
        if (v4(&l), v4(&p)) == (Some(want.0), Some(want.1)) {
            return Some(fd);
        }
    }
    None
}

#[actix::test]
#[allow(clippy::await_holding_lock)]
async fn a_lane_dying_fails_pending_ops_in_order() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (tx, rx, _s) = pair(mpt(4, 3), mpt(4, 3)).await;
    // Pending reads first, then one of the reader's lanes cut under its loop.
    let (read_to, mut reads) = inbox::<ReadDone>();
    for _ in 0..6 {
        rx.do_send(Receive::new().notify(read_to.clone()));
    }
    let info = rx.send(GetInfo).await.unwrap();
    let lane = &info.connections[2];
    let fd = socket_between(&lane.local, &lane.peer).expect("the lane's socket");
    // SAFETY: shuts down a socket of this process's lane; its owner sees end of stream.
    assert_eq!(unsafe { libc::shutdown(fd, libc::SHUT_RDWR) }, 0);
    let (write_to, mut writes) = inbox::<WriteDone>();
    for i in 0..6 {
        tx.do_send(Write::new(checked_message(i, &[], &[4 << 20])).notify(write_to.clone()));
    }
    let mut failed = false;
    for i in 0..6 {
        let r = within(30, "read completion", reads.recv()).await.unwrap();
        assert_eq!(r.id, i, "reads complete in order");
        match r.result {
            Ok(()) => {
                assert!(!failed, "a read succeeded after one failed");
                assert_eq!(verify(&r.message), i);
            }
            Err(e) => {
                failed = true;
                assert!(
                    matches!(e.class(), "peer_closed" | "closed" | "protocol"),
                    "read {i}: {e}"
                );
            }
        }
    }
    assert!(failed, "the cut lane failed the reads");
    let mut failed = false;
    for i in 0..6 {
        let w = within(30, "write completion", writes.recv()).await.unwrap();
        assert_eq!(w.id, i, "writes complete in order");
        match w.result {
            Ok(()) => assert!(!failed, "a write succeeded after one failed"),
            Err(_) => failed = true,
        }
    }
}
