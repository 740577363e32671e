//! The binding against the real providers of this host: those `ACTORPIPE_EFA_PROVIDERS` names
//! ([`providers`]; by default `tcp;ofi_rxm` and `shm`, both part of every libfabric build, so
//! `--features efa` can rely on them).

use std::sync::OnceLock;

use super::*;

/// The variable naming the providers the tests run on, comma-separated: the one the integration
/// suites read too (tests/common/efa.rs, `PROVIDERS_VAR`).
pub const PROVIDERS_VAR: &str = "ACTORPIPE_EFA_PROVIDERS";

/// The providers when [`PROVIDERS_VAR`] is unset or empty.
pub const DEFAULT_PROVIDERS: &str = "tcp;ofi_rxm,shm";

/// The providers of [`PROVIDERS_VAR`] that libfabric has here, in its order: what every test
/// that runs "on each provider" runs on. A listed provider that is absent is reported, by each
/// test that asks, on stderr past the harness's capture: `skipped: no efa provider here (..)`.
pub fn providers() -> Vec<&'static str> {
    static VAR: OnceLock<String> = OnceLock::new();
    let var = VAR.get_or_init(|| {
        let v = std::env::var(PROVIDERS_VAR).unwrap_or_default();
        if v.trim().is_empty() {
            DEFAULT_PROVIDERS.to_string()
        } else {
            v
        }
    });
    var.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .filter(|p| match InfoList::get(Some(p)) {
            Ok(_) => true,
            Err(e) => {
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "{}: skipped: no {p} provider here ({e})",
                    std::thread::current().name().unwrap_or("a test")
                );
                false
            }
        })
        .collect()
}

/// An endpoint of `provider`, on loopback for tcp.
pub fn open(provider: &str) -> Endpoint {
    open_with(provider, true)
}

/// [`open`], its CQ with a wait fd only if `wait_fd` (and the provider offers one).
fn open_with(provider: &str, wait_fd: bool) -> Endpoint {
    let list = InfoList::get(Some(provider)).expect("provider present");
    // tcp's loopback domain; a provider without one (`shm`, `efa`) its first.
    let info = list
        .iter()
        .find(|i| i.attributes().domain == "lo")
        .or_else(|| list.iter().next())
        .expect("a domain");
    let domain = Domain::open(info).expect("domain");
    Endpoint::open_with(&domain, info, wait_fd).expect("endpoint")
}

/// Polls both endpoints (manual progress: each side moves only when its CQ is read) until `a`
/// has `na` completions and `b` has `nb`.
fn reap(
    a: &mut Endpoint,
    na: usize,
    b: &mut Endpoint,
    nb: usize,
) -> (Vec<Completion>, Vec<Completion>) {
    let (mut ga, mut gb) = (Vec::new(), Vec::new());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ga.len() < na || gb.len() < nb {
        assert!(std::time::Instant::now() < deadline, "no completion");
        a.poll(|c| ga.push(c)).expect("cq");
        b.poll(|c| gb.push(c)).expect("cq");
    }
    assert_eq!((ga.len(), gb.len()), (na, nb), "no extra completions");
    (ga, gb)
}

/// Posts a receive of `inbox` on `b` for tag `tag` from `from`.
///
/// # Safety
/// `inbox` and `ctx` outlive the receive's completion (or `b`).
unsafe fn post_recv(b: &Endpoint, inbox: &mut [u8], from: FiAddr, tag: u64, ctx: &mut [u64; 8]) {
    // SAFETY: the caller's contract.
    unsafe {
        b.trecv(
            inbox.as_mut_ptr(),
            inbox.len(),
            std::ptr::null_mut(),
            from,
            tag,
            0,
            ctx.as_mut_ptr().cast(),
        )
    }
    .expect("recv");
}

/// Posts a tagged send of `msg` to `to` with context `ctx`.
///
/// # Safety
/// `msg` and `ctx` must outlive the send's completion (or the endpoint).
unsafe fn post_send(
    a: &Endpoint,
    msg: &[u8],
    to: FiAddr,
    tag: u64,
    ctx: &mut [u64; 8],
) -> Result<(), PostError> {
    // SAFETY: the caller's contract.
    unsafe {
        a.tsend(
            msg.as_ptr(),
            msg.len(),
            std::ptr::null_mut(),
            to,
            tag,
            0,
            ctx.as_mut_ptr().cast(),
        )
    }
}

/// Sends with `send` from `a` to `b`, retrying while the provider answers `-FI_EAGAIN` (rxm
/// does while it connects to a new peer), progressing both meanwhile (neither may complete
/// anything yet).
fn send_retrying(
    a: &mut Endpoint,
    b: &mut Endpoint,
    mut send: impl FnMut(&Endpoint) -> Result<(), PostError>,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match send(a) {
            Ok(()) => return,
            Err(PostError::Again) if std::time::Instant::now() < deadline => {
                a.poll(|_| panic!("nothing posted")).expect("cq");
                b.poll(|_| panic!("nothing matched yet")).expect("cq");
            }
            Err(e) => panic!("{}: send: {e:?}", a.provider()),
        }
    }
}

#[test]
fn version_and_errors_read_back() {
    let ((major, _), (hmajor, _)) = version();
    assert!(major >= 1 && hmajor >= 1);
    assert_eq!(strerror(eagain()), "Resource temporarily unavailable");
    let e = InfoList::get(Some("no-such-provider"))
        .err()
        .expect("no provider");
    assert!(e.to_string().contains("fi_getinfo"), "{e}");
}

/// One tagged message of 100 bytes (tag 7) from `a` to `b`: both completions carry their
/// contexts, and the bytes arrive.
fn tagged_message(provider: &str, mut a: Endpoint, mut b: Endpoint) {
    let b_at_a = a.insert(b.name()).expect("insert");
    let a_at_b = b.insert(a.name()).expect("insert");
    let mut ctx_a = [0u64; 8];
    let mut ctx_b = [0u64; 8];
    let mut inbox = vec![0u8; 100];
    let msg: Vec<u8> = (0..100u8).collect();
    // SAFETY: buffers and contexts outlive the completions waited for below.
    unsafe { post_recv(&b, &mut inbox, a_at_b, 7, &mut ctx_b) };
    // SAFETY: as above.
    send_retrying(&mut a, &mut b, |a| unsafe {
        post_send(a, &msg, b_at_a, 7, &mut ctx_a)
    });
    let (sent, got) = reap(&mut a, 1, &mut b, 1);
    let (sent, got) = (&sent[0], &got[0]);
    assert_eq!(sent.context, ctx_a.as_ptr() as u64, "{provider}");
    assert!(sent.result.is_ok(), "{provider}");
    assert_eq!(got.context, ctx_b.as_ptr() as u64, "{provider}");
    assert_eq!((got.len, got.tag), (100, 7), "{provider}");
    assert_eq!(inbox, msg, "{provider}");
}

#[test]
fn tagged_ping_pong_on_each_provider() {
    for provider in providers() {
        let a = open(provider);
        assert_eq!(a.provider(), provider);
        tagged_message(provider, a, open(provider));
    }
}

/// A CQ opened without a wait fd has none, where the provider would give one (`tcp;ofi_rxm`:
/// `FI_WAIT_FD`) and where it has none anyway (`shm`), and a tagged message between two such
/// endpoints goes through, progressed by polling alone.
#[test]
fn endpoints_open_without_a_wait_fd_on_request() {
    assert!(
        open("tcp;ofi_rxm").wait_fd().is_some(),
        "tcp;ofi_rxm offers a wait fd"
    );
    for provider in providers() {
        let (a, b) = (open_with(provider, false), open_with(provider, false));
        assert_eq!((a.wait_fd(), b.wait_fd()), (None, None), "{provider}");
        tagged_message(provider, a, b);
    }
}

#[test]
fn short_or_foreign_addresses_are_refused() {
    let a = open("shm");
    let e = a.insert(b"short").expect_err("refused");
    assert!(e.to_string().contains("shm: fi_av_insert failed"), "{e}");
}

#[test]
fn cancelled_receive_completes_with_ecanceled() {
    for provider in providers() {
        let mut a = open(provider);
        let mut b = open(provider);
        let mut ctx = [0u64; 8];
        let mut buf = vec![0u8; 16];
        // SAFETY: buffer and context outlive the cancellation's completion, read below.
        unsafe {
            a.trecv(
                buf.as_mut_ptr(),
                16,
                std::ptr::null_mut(),
                Endpoint::any_source(),
                1,
                0,
                ctx.as_mut_ptr().cast(),
            )
            .expect("recv");
        }
        // SAFETY: the receive above is posted and its completion not read yet.
        unsafe { a.cancel(ctx.as_mut_ptr().cast()) };
        let (mut c, _) = reap(&mut a, 1, &mut b, 0);
        let e = c.remove(0).result.expect_err("cancelled");
        assert_eq!(e.code, ecanceled(), "{provider}: {e}");
    }
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Runs [`descriptors_alone`] in a process of its own: the other tests of this binary open and
/// close descriptors meanwhile, which made the count here race with them.
#[test]
fn closing_releases_every_descriptor() {
    run_alone(&in_this_module("descriptors_alone"), &[]);
}

/// The name the test harness gives the test `name` of this module: its path without the crate.
fn in_this_module(name: &str) -> String {
    let here = module_path!();
    let here = here.split_once("::").map_or(here, |(_, rest)| rest);
    format!("{here}::{name}")
}

/// Runs the ignored test `name` of this binary in a process of its own, with `env` set, and
/// asserts that it passed.
pub fn run_alone(name: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([name, "--exact", "--ignored", "--test-threads", "1"])
        .envs(env.iter().copied())
        .output()
        .expect("run the test binary");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

#[test]
#[ignore = "run alone by closing_releases_every_descriptor, in a process of its own"]
fn descriptors_alone() {
    for provider in providers() {
        // The first open loads the provider (its own lasting descriptors, if any).
        drop(open(provider));
        let before = fds();
        for _ in 0..3 {
            let mut a = open(provider);
            let mut b = open(provider);
            let at = a.insert(b.name()).expect("insert");
            b.insert(a.name()).expect("insert");
            let mut ctx = [0u64; 8];
            let msg = [1u8; 8];
            loop {
                // SAFETY: buffer and context outlive the completion read below.
                let r = unsafe {
                    a.tsend(
                        msg.as_ptr(),
                        8,
                        std::ptr::null_mut(),
                        at,
                        1,
                        0,
                        ctx.as_mut_ptr().cast(),
                    )
                };
                match r {
                    Ok(()) => break,
                    Err(PostError::Again) => {
                        a.poll(|_| {}).expect("cq");
                        b.poll(|_| {}).expect("cq");
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
            let mut ctx_b = [0u64; 8];
            let mut inb = [0u8; 8];
            // SAFETY: as above.
            unsafe {
                b.trecv(
                    inb.as_mut_ptr(),
                    8,
                    std::ptr::null_mut(),
                    Endpoint::any_source(),
                    1,
                    0,
                    ctx_b.as_mut_ptr().cast(),
                )
                .expect("recv");
            }
            reap(&mut a, 1, &mut b, 1);
        }
        assert_eq!(fds(), before, "{provider}: descriptors left open");
    }
}

#[test]
fn registration_cache_shares_one_registration_per_buffer_and_releases_it() {
    for provider in providers() {
        let ep = open(provider);
        let domain = ep.domain().clone();
        let mut cache = regcache::RegCache::default();
        let a = vec![1u8; 4096];
        let b = [2u8; 100];
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        // SAFETY: `a` and `b` outlive every acquisition (released below, before they drop).
        unsafe {
            let d1 = cache.acquire(&domain, pa, a.len()).expect("register a");
            let d2 = cache.acquire(&domain, pa, a.len()).expect("a again");
            assert_eq!(d1, d2, "{provider}: one registration per buffer");
            cache.acquire(&domain, pb, b.len()).expect("register b");
        }
        assert_eq!((cache.registrations(), cache.live()), (2, 2), "{provider}");
        cache.release(pa, a.len());
        assert_eq!(cache.live(), 2, "{provider}: a still has a user");
        cache.release(pa, a.len());
        cache.release(pb, b.len());
        assert_eq!(cache.live(), 0, "{provider}: the last release deregisters");
        assert!(cache.desc(pa, a.len()).is_null());
    }
}

#[test]
fn an_inject_arrives_without_a_send_completion() {
    for provider in providers() {
        let mut a = open(provider);
        let mut b = open(provider);
        // What the endpoint was granted: `tcp;ofi_rxm` offers 64 B unless asked for more.
        let limit = a.domain().attributes().inject_size as usize;
        assert!(
            limit >= super::INJECT_WANTED.min(4096),
            "{provider}: {limit}"
        );
        let b_at_a = a.insert(b.name()).expect("insert");
        let a_at_b = b.insert(a.name()).expect("insert");
        let mut ctx_b = [0u64; 8];
        let mut inbox = vec![0u8; limit];
        let msg: Vec<u8> = (0..limit).map(|i| i as u8).collect();
        // SAFETY: the buffer and context outlive the completion waited for below.
        unsafe { post_recv(&b, &mut inbox, a_at_b, 9, &mut ctx_b) };
        send_retrying(&mut a, &mut b, |a| a.tinject(&msg, b_at_a, 9, 0));
        // `reap` checks that `a` gets no completion.
        let (_, got) = reap(&mut a, 0, &mut b, 1);
        assert_eq!(got[0].len as usize, limit, "{provider}");
        assert_eq!(inbox, msg, "{provider}");
    }
}

/// A message longer than the receive posted for it: the provider's own error completion
/// (`fi_cq_readerr`), with `FI_ETRUNC`, its text and the receive's context, and the endpoint
/// still serves another peer. (Not the same peer on `tcp;ofi_rxm`: libfabric 1.17's tcp
/// provider disables the connection after a truncation, ofiwg/libfabric#8274.)
#[test]
fn a_receive_posted_too_small_completes_with_the_providers_truncation_error() {
    for provider in providers() {
        let mut a = open(provider);
        let mut b = open(provider);
        let mut c = open(provider);
        let b_at_a = a.insert(b.name()).expect("insert");
        let a_at_b = b.insert(a.name()).expect("insert");
        let b_at_c = c.insert(b.name()).expect("insert");
        let c_at_b = b.insert(c.name()).expect("insert");
        let (mut ctx_a, mut ctx_b) = ([0u64; 8], [0u64; 8]);
        let mut small = vec![0u8; 16];
        let msg = vec![7u8; 4096];
        // SAFETY: the buffers and contexts outlive the completions waited for below.
        unsafe { post_recv(&b, &mut small, a_at_b, 5, &mut ctx_b) };
        // SAFETY: as above.
        send_retrying(&mut a, &mut b, |a| unsafe {
            post_send(a, &msg, b_at_a, 5, &mut ctx_a)
        });
        // The receiver's error; the sender may or may not see its send complete (each
        // provider decides whether a truncated delivery is the sender's error too).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut got = Vec::new();
        while got.is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "{provider}: no completion"
            );
            a.poll(|_| {}).expect("cq");
            b.poll(|c| got.push(c)).expect("cq");
        }
        let done = &got[0];
        assert_eq!(
            done.context,
            ctx_b.as_ptr() as u64,
            "{provider}: the receive's context"
        );
        let e = done.result.as_ref().expect_err("a truncation error");
        assert_eq!((e.op, e.code), ("completion", etrunc()), "{provider}: {e}");
        assert!(
            e.to_string().contains(provider),
            "{provider}: names it: {e}"
        );
        // The endpoint goes on: a receive large enough gets another peer's message whole.
        let mut ctx_c = [0u64; 8];
        let mut inbox = vec![0u8; 64];
        let next: Vec<u8> = (0..64).collect();
        // SAFETY: as above.
        unsafe { post_recv(&b, &mut inbox, c_at_b, 6, &mut ctx_c) };
        send_retrying(&mut c, &mut b, |c| c.tinject(&next, b_at_c, 6, 0));
        let mut ok = None;
        while ok.is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "{provider}: no second completion"
            );
            a.poll(|_| {}).expect("cq");
            c.poll(|_| {}).expect("cq");
            b.poll(|c| ok = Some(c.result.is_ok())).expect("cq");
        }
        assert_eq!(ok, Some(true), "{provider}");
        assert_eq!(inbox, next, "{provider}");
    }
}

/// rxm's passthru switch is read as libfabric reads a boolean, and applies to rxm over tcp
/// only; this process runs without it, so every provider keeps its own name and its unexpected
/// messages.
#[test]
fn passthru_applies_to_rxm_over_tcp_only() {
    for on in ["1", "on", "YES", " true "] {
        assert!(switch_on(Some(on)), "{on}");
    }
    for off in [
        None,
        Some("0"),
        Some("off"),
        Some("no"),
        Some("false"),
        Some(""),
    ] {
        assert!(!switch_on(off), "{off:?}");
    }
    assert!(rides_tcp("tcp;ofi_rxm") && rides_tcp("net;ofi_rxm"));
    for other in ["verbs;ofi_rxm", "tcp", "shm", "efa", "sockets"] {
        assert!(!rides_tcp(other), "{other}");
    }
    if std::env::var_os(PASSTHRU).is_none() {
        for p in providers() {
            assert!(!passthru(p) && keeps_unexpected(p), "{p}");
            assert_eq!(wire_name(p), p);
        }
    }
}

/// A peer that does not answer its sends (it has posted no receive for them, as a dead one
/// never will) holds back no other peer's send completions. On `shm` the responses of sends
/// over its inject size queue in order per sending endpoint, so the endpoint sends to each peer
/// from an endpoint of its own (docs/efa.md, "A dead peer's sends on `shm`"): without them, none
/// of the live peer's 8 completions came while the silent peer's send waited. Either peer may be
/// the one the main endpoint sends to. A peer removed from the AV gives its sending endpoint to
/// the next one.
#[test]
fn a_peer_that_does_not_answer_holds_back_no_other_peers_send_completions() {
    const SIZE: usize = 64 << 10;
    const N: usize = 8;
    for provider in providers() {
        for silent_first in [true, false] {
            let mut a = open(provider);
            let mut silent = open(provider);
            let mut live = open(provider);
            let (at_silent, at_live) = if silent_first {
                let s = a.insert(silent.name()).expect("insert");
                (s, a.insert(live.name()).expect("insert"))
            } else {
                let l = a.insert(live.name()).expect("insert");
                (a.insert(silent.name()).expect("insert"), l)
            };
            silent.insert(a.name()).expect("insert");
            live.insert(a.name()).expect("insert");
            if sends_per_peer(provider) {
                assert_eq!(
                    a.send_endpoints(),
                    1,
                    "{provider}: one peer sends on the main"
                );
            }
            let what = format!("{provider}, silent peer inserted first: {silent_first}");
            let payload = vec![7u8; SIZE];
            let mut silent_inbox = vec![0u8; SIZE];
            let mut inboxes = vec![vec![0u8; SIZE]; N];
            // Contexts, boxed so that their addresses stay put: one per op.
            let mut ctx: Vec<Box<[u64; 8]>> = (0..2 * N + 2).map(|_| Box::new([0; 8])).collect();
            let addr = |c: &[u64; 8]| c.as_ptr() as u64;
            let sent_silent = addr(&ctx[0]);
            let sent_live: Vec<u64> = (1..=N).map(|i| addr(&ctx[i])).collect();
            let (mut a_done, mut live_got) = (Vec::new(), 0);
            // Reads all three CQs: `a`'s send completions into `done`, the live peer's
            // receives counted in `got`; nothing completes at the silent peer.
            fn progress(eps: [&mut Endpoint; 3], done: &mut Vec<u64>, got: &mut usize) {
                let [a, s, l] = eps;
                a.poll(|c| {
                    c.result.as_ref().expect("a send");
                    done.push(c.context)
                })
                .expect("cq");
                s.poll(|c| panic!("{c:?}: nothing completes at the silent peer"))
                    .expect("cq");
                l.poll(|c| {
                    c.result.as_ref().expect("a receive");
                    *got += 1
                })
                .expect("cq");
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let (head, rest) = ctx.split_at_mut(1);
            loop {
                // SAFETY: the payload and the context outlive the send's completion, which
                // this test waits for below (or the endpoint's drop).
                let r = unsafe {
                    a.tsend(
                        payload.as_ptr(),
                        SIZE,
                        std::ptr::null_mut(),
                        at_silent,
                        1,
                        0,
                        head[0].as_mut_ptr().cast(),
                    )
                };
                match r {
                    Ok(()) => break,
                    Err(PostError::Again) if std::time::Instant::now() < deadline => {
                        progress([&mut a, &mut silent, &mut live], &mut a_done, &mut live_got)
                    }
                    Err(e) => panic!("{what}: send to the silent peer: {e:?}"),
                }
            }
            for (i, inbox) in inboxes.iter_mut().enumerate() {
                let (send_ctx, recv_ctx) = rest.split_at_mut(N);
                // SAFETY: the inbox and the context outlive the receive's completion (waited
                // for below).
                unsafe {
                    post_recv(
                        &live,
                        inbox,
                        Endpoint::any_source(),
                        100 + i as u64,
                        &mut recv_ctx[i],
                    )
                };
                loop {
                    // SAFETY: as the send above.
                    let r = unsafe {
                        a.tsend(
                            payload.as_ptr(),
                            SIZE,
                            std::ptr::null_mut(),
                            at_live,
                            100 + i as u64,
                            0,
                            send_ctx[i].as_mut_ptr().cast(),
                        )
                    };
                    match r {
                        Ok(()) => break,
                        Err(PostError::Again) if std::time::Instant::now() < deadline => {
                            progress([&mut a, &mut silent, &mut live], &mut a_done, &mut live_got)
                        }
                        Err(e) => panic!("{what}: send {i} to the live peer: {e:?}"),
                    }
                }
            }
            let live_done = |done: &[u64]| sent_live.iter().filter(|c| done.contains(c)).count();
            while (live_got < N || live_done(&a_done) < N) && std::time::Instant::now() < deadline {
                progress([&mut a, &mut silent, &mut live], &mut a_done, &mut live_got);
            }
            assert_eq!(live_got, N, "{what}: the live peer's receives");
            assert_eq!(
                live_done(&a_done),
                N,
                "{what}: send completions to the live peer while the silent one has not \
                 answered its send"
            );
            assert!(inboxes.iter().all(|b| b == &payload), "{what}");
            // The silent peer answers at last: its send completes too.
            let last = ctx.last_mut().expect("a context");
            // SAFETY: as above.
            unsafe { post_recv(&silent, &mut silent_inbox, Endpoint::any_source(), 1, last) };
            while !a_done.contains(&sent_silent) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{what}: the silent send"
                );
                a.poll(|c| a_done.push(c.context)).expect("cq");
                silent.poll(|_| {}).expect("cq");
            }
            assert_eq!(silent_inbox, payload, "{what}");
            // The live peer goes: a new one sends on its endpoint (or on the main one).
            a.remove(at_live).expect("remove");
            let mut next = open(provider);
            let at_next = a.insert(next.name()).expect("insert");
            next.insert(a.name()).expect("insert");
            if sends_per_peer(provider) {
                assert_eq!(
                    a.send_endpoints(),
                    1,
                    "{what}: the live peer's endpoint again"
                );
            }
            let mut inbox = vec![0u8; SIZE];
            let (mut rctx, mut sctx) = ([0u64; 8], [0u64; 8]);
            // SAFETY: as above.
            unsafe { post_recv(&next, &mut inbox, Endpoint::any_source(), 9, &mut rctx) };
            send_retrying(&mut a, &mut next, |a| {
                // SAFETY: as above.
                unsafe {
                    a.tsend(
                        payload.as_ptr(),
                        SIZE,
                        std::ptr::null_mut(),
                        at_next,
                        9,
                        0,
                        sctx.as_mut_ptr().cast(),
                    )
                }
            });
            reap(&mut a, 1, &mut next, 1);
            assert_eq!(inbox, payload, "{what}");
        }
    }
}
