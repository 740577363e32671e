//! The engine on the real providers of `ACTORPIPE_EFA_PROVIDERS` (`tcp;ofi_rxm` and `shm` by
//! default; `backend::efa::tests::providers`): the EAGAIN storm, error order, pipes that fail
//! alone.

use super::*;
#[cfg(feature = "faults")]
use crate::backend::efa::faults::Dice;
use crate::backend::efa::tag::{self, Stream};
use crate::backend::efa::tests::{open, providers, run_alone};

fn pair(provider: &str) -> (Engine, u32, Engine, u32) {
    let mut a = Engine::new(open(provider));
    let mut b = Engine::new(open(provider));
    let pa = a.attach(b.endpoint().name()).expect("attach");
    let pb = b.attach(a.endpoint().name()).expect("attach");
    (a, pa, b, pb)
}

/// [`pair`] with `faults` on both sides (the second's seed one more).
#[cfg(feature = "faults")]
fn pair_with(provider: &str, faults: Faults) -> (Engine, u32, Engine, u32) {
    let (mut a, pa, mut b, pb) = pair(provider);
    a.set_faults(faults);
    b.set_faults(Faults {
        seed: faults.seed + 1,
        ..faults
    });
    (a, pa, b, pb)
}

#[cfg(feature = "faults")]
/// A random size: empty, tiny, small, medium, large (up to 2 MiB).
fn shape(d: &mut Dice, x: &mut u64) -> usize {
    *x = x
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let r = (*x >> 33) as usize;
    match r % 10 {
        0 => 0,
        1..=3 => r % 64 + 1,
        4..=6 => r % 4096 + 64,
        7 | 8 => r % (256 << 10) + 4096,
        _ if d.roll(0.5) => r % (2 << 20) + (256 << 10),
        _ => r % 4096,
    }
}

#[cfg(feature = "faults")]
fn pattern(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seq as usize * 31 + i * 7) as u8 ^ (i >> 8) as u8)
        .collect()
}

#[cfg(feature = "faults")]
/// 10 000 messages of random shape, with `faults` on both sides: every one arrives intact, and
/// each side sees its completions in post order. Without `inject`, every send goes out with
/// `fi_tsend` and ends with a completion.
fn storm(provider: &str, faults: Faults, count: u64, inject: bool) -> (Stats, Stats) {
    const WINDOW: u64 = 128;
    let (mut a, pa, mut b, pb) = pair_with(provider, faults);
    if !inject {
        a.set_inject_limit(0);
    }
    let mut dice = Dice::new(42);
    let mut x = 7u64;
    let sizes: Vec<usize> = (0..count).map(|_| shape(&mut dice, &mut x)).collect();
    let (mut sent, mut posted_recv, mut posted_send) = (0u64, 0u64, 0u64);
    let mut received = 0u64;
    let mut failures = Vec::new();
    let send_done = |f: Finished, next: &mut u64| {
        assert_eq!(f.id, *next, "sends complete in order");
        assert!(f.result.is_ok(), "send {}: {:?}", f.id, f.result);
        *next += 1;
    };
    let start = std::time::Instant::now();
    while received < count {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(120),
            "{provider}: stuck at {received}/{count}, stats {:?} / {:?}",
            a.stats(),
            b.stats()
        );
        while posted_recv < count && posted_recv < received + WINDOW {
            let len = sizes[posted_recv as usize];
            let op = Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb, posted_recv as u32),
                mem: vec![0; len],
                id: posted_recv,
            };
            b.post(pb, op, &mut |f| failures.push(f));
            posted_recv += 1;
        }
        while posted_send < count && posted_send < sent + WINDOW {
            let len = sizes[posted_send as usize];
            let op = Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, pb, posted_send as u32),
                mem: pattern(posted_send, len),
                id: posted_send,
            };
            a.post(pa, op, &mut |f| send_done(f, &mut sent));
            posted_send += 1;
        }
        a.progress(&mut |f| send_done(f, &mut sent)).expect("cq a");
        b.progress(&mut |f: Finished| {
            assert_eq!(f.id, received, "{provider}: receives complete in order");
            let len = sizes[f.id as usize];
            assert_eq!(
                f.result.as_ref().ok(),
                Some(&len),
                "{provider}: {:?}",
                f.result
            );
            assert!(
                f.mem == pattern(f.id, len),
                "{provider}: message {} intact",
                f.id
            );
            received += 1;
        })
        .expect("cq b");
        assert!(failures.is_empty(), "{provider}: {:?}", failures[0]);
    }
    while sent < count {
        a.progress(&mut |f| send_done(f, &mut sent)).expect("cq a");
        b.progress(&mut |_| panic!("nothing left to receive"))
            .expect("cq b");
    }
    (a.stats(), b.stats())
}

#[cfg(feature = "faults")]
#[test]
fn eagain_storm_delivers_everything_in_order_on_each_provider() {
    let faults = Faults {
        eagain: 0.9,
        cq_error: 0.0,
        seed: 1,
    };
    for provider in providers() {
        for inject in [true, false] {
            let (sa, sb) = storm(provider, faults, 10_000, inject);
            // 90 % of posts refused: about nine refusals per accepted post, on both sides.
            assert_eq!(sa.posted, 10_000, "{provider}: {sa:?}");
            assert!(sa.eagain > 50_000, "{provider}: {sa:?}");
            assert!(sb.eagain > 50_000, "{provider}: {sb:?}");
            assert!(sa.backlog_max > 1 && sb.backlog_max > 1, "{sa:?} {sb:?}");
            assert_eq!((sa.errors, sb.errors), (0, 0));
            assert_eq!((sa.backlog, sa.in_flight), (0, 0));
            // Injected sends (about half the shapes fit) end without a completion.
            if inject {
                assert!(sa.injected > 3_000, "{provider}: {sa:?}");
                assert_eq!(
                    sa.completions,
                    sa.posted - sa.injected,
                    "{provider}: {sa:?}"
                );
            } else {
                assert_eq!(sa.injected, 0, "{provider}: {sa:?}");
                assert_eq!(sa.completions, 10_000, "{provider}: {sa:?}");
            }
        }
    }
}

#[cfg(feature = "faults")]
#[test]
fn a_completion_error_fails_its_pipe_in_order_and_spares_the_others() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        // A second pipe between the same endpoints.
        let pa2 = a.attach(b.endpoint().name()).expect("attach");
        let pb2 = b.attach(a.endpoint().name()).expect("attach");
        let mut got: Vec<(u32, u64, bool)> = Vec::new();
        for i in 0..4u64 {
            for (pipe, me) in [(pb, pb), (pb2, pb2)] {
                let op = Op {
                    kind: Kind::Recv,
                    tag: tag::make(Stream::Raw, me, i as u32),
                    mem: vec![0; 8],
                    id: i,
                };
                b.post(pipe, op, &mut |f| {
                    got.push((f.pipe, f.id, f.result.is_ok()))
                });
            }
        }
        // Every completion of b's first pipe from now on is an error: the first one fails it.
        b.set_faults(Faults {
            cq_error: 1.0,
            ..Faults::NONE
        });
        for (pipe, to) in [(pa, pb), (pa2, pb2)] {
            let op = Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, to, 0),
                mem: vec![1; 8],
                id: 0,
            };
            a.post(pipe, op, &mut |_| {});
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < 8 && std::time::Instant::now() < deadline {
            a.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| got.push((f.pipe, f.id, f.result.is_ok())))
                .expect("cq");
        }
        // Both first receives completed with an injected error; each pipe failed, and its
        // later receives (cancelled) failed right after, in order.
        for pipe in [pb, pb2] {
            let ends: Vec<_> = got.iter().filter(|g| g.0 == pipe).collect();
            assert_eq!(ends.len(), 4, "{provider}: {got:?}");
            assert!(ends
                .iter()
                .enumerate()
                .all(|(i, g)| g.1 == i as u64 && !g.2));
        }
        // Faults off: a new pipe on the same endpoint works.
        b.set_faults(Faults::NONE);
        let pb3 = b.attach(a.endpoint().name()).expect("attach");
        let pa3 = a.attach(b.endpoint().name()).expect("attach");
        let mut ok = None;
        b.post(
            pb3,
            Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb3, 9),
                mem: vec![0; 3],
                id: 9,
            },
            &mut |f| ok = Some(f.result.map_err(|e| e.to_string())),
        );
        a.post(
            pa3,
            Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, pb3, 9),
                mem: vec![5; 3],
                id: 9,
            },
            &mut |_| {},
        );
        while ok.is_none() && std::time::Instant::now() < deadline {
            a.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| {
                if f.pipe == pb3 {
                    ok = Some(f.result.map_err(|e| e.to_string()))
                }
            })
            .expect("cq");
        }
        assert_eq!(
            ok,
            Some(Ok(3)),
            "{provider}: endpoint still serves other pipes"
        );
    }
}

/// A real provider error, not an injected one: a message longer than the receive posted for
/// it ends that receive with the provider's `FI_ETRUNC` completion (read with
/// `fi_cq_readerr`). The pipe fails with it, its later receives end with the same error in
/// post order, each with its own buffer back, and the endpoint's pipe to another peer is
/// untouched. (A second pipe to the same peer is not: on `tcp;ofi_rxm`, libfabric 1.17's tcp
/// provider disables the connection after a truncation, ofiwg/libfabric#8274.)
#[test]
fn a_truncated_receive_fails_its_pipe_in_order_and_spares_the_others() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        let mut c = Engine::new(open(provider));
        let pc = c.attach(b.endpoint().name()).expect("attach");
        let pb2 = b.attach(c.endpoint().name()).expect("attach");
        let mut got: Vec<(u32, u64, usize, Result<usize, FabricError>)> = Vec::new();
        let record = |got: &mut Vec<_>, f: Finished| {
            got.push((f.pipe, f.id, f.mem.as_ptr() as usize, f.result));
        };
        let mut buffers = Vec::new();
        for i in 0..4u64 {
            for pipe in [pb, pb2] {
                // The first pipe's first receive is too small for what comes.
                let len = if pipe == pb && i == 0 { 16 } else { 8192 };
                let mem = vec![0; len];
                buffers.push((pipe, i, mem.as_ptr() as usize));
                let op = Op {
                    kind: Kind::Recv,
                    tag: tag::make(Stream::Raw, pipe, i as u32),
                    mem,
                    id: i,
                };
                b.post(pipe, op, &mut |f| record(&mut got, f));
            }
        }
        for (sender, pipe, to) in [(&mut a, pa, pb), (&mut c, pc, pb2)] {
            for i in 0..4u32 {
                let op = Op {
                    kind: Kind::Send,
                    tag: tag::make(Stream::Raw, to, i),
                    mem: vec![1; 4096],
                    id: u64::from(i),
                };
                sender.post(pipe, op, &mut |_| {});
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < 8 && std::time::Instant::now() < deadline {
            a.progress(&mut |_| {}).expect("cq");
            c.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| record(&mut got, f)).expect("cq");
        }
        assert_eq!(got.len(), 8, "{provider}: every receive ended: {got:?}");
        let first = got
            .iter()
            .find(|g| g.0 == pb)
            .and_then(|g| g.3.as_ref().err().cloned())
            .expect("the first pipe's first receive failed");
        assert_eq!(
            (first.op, first.code),
            ("completion", crate::backend::efa::etrunc()),
            "{provider}: the provider's own error: {first}"
        );
        for pipe in [pb, pb2] {
            let ends: Vec<_> = got.iter().filter(|g| g.0 == pipe).collect();
            assert_eq!(ends.len(), 4, "{provider}: {got:?}");
            for (i, g) in ends.iter().enumerate() {
                assert_eq!(g.1, i as u64, "{provider}: in post order");
                let mine = buffers.iter().find(|b| b.0 == pipe && b.1 == g.1);
                assert_eq!(Some(g.2), mine.map(|b| b.2), "{provider}: its own buffer");
                if pipe == pb {
                    assert_eq!(
                        g.3.as_ref().err(),
                        Some(&first),
                        "{provider}: the pipe's error"
                    );
                } else {
                    assert_eq!(g.3.as_ref().ok(), Some(&4096), "{provider}: untouched");
                }
            }
        }
    }
}

#[cfg(feature = "faults")]
#[test]
fn an_injected_send_that_fails_fails_its_pipe_in_order() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        // One exchange first: rxm refuses posts (-FI_EAGAIN) while it connects, and the
        // faults below must meet the posts themselves, not their retries.
        let mut warm = None;
        b.post(
            pb,
            Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb, 99),
                mem: vec![0; 8],
                id: 99,
            },
            &mut |f| warm = Some(f.result.is_ok()),
        );
        let op = Op {
            kind: Kind::Send,
            tag: tag::make(Stream::Raw, pb, 99),
            mem: vec![1; 8],
            id: 99,
        };
        a.post(pa, op, &mut |_| {});
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while warm.is_none() && std::time::Instant::now() < deadline {
            a.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| warm = Some(f.result.is_ok()))
                .expect("cq");
        }
        assert_eq!(warm, Some(true), "{provider}");
        let mut got: Vec<(u64, Result<usize, String>)> = Vec::new();
        let record =
            |got: &mut Vec<_>, f: Finished| got.push((f.id, f.result.map_err(|e| e.to_string())));
        // A large send first (posted: a completion to wait for), then two that inject: the
        // first of those meets an injected error at its post. That fails the pipe: the large
        // send ends with the same error when its completion comes (the receive posted for it
        // may or may not complete: the send is cancelled), then the two small ones, in order.
        let big = 1 << 20;
        b.post(
            pb,
            Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb, 0),
                mem: vec![0; big],
                id: 0,
            },
            &mut |_| {},
        );
        a.post(
            pa,
            Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, pb, 0),
                mem: vec![3; big],
                id: 0,
            },
            &mut |f| record(&mut got, f),
        );
        a.set_faults(Faults {
            cq_error: 1.0,
            ..Faults::NONE
        });
        for id in [1, 2] {
            let op = Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, pb, id as u32),
                mem: vec![4; 8],
                id,
            };
            a.post(pa, op, &mut |f| record(&mut got, f));
        }
        a.set_faults(Faults::NONE);
        while got.len() < 3 && std::time::Instant::now() < deadline {
            a.progress(&mut |f| record(&mut got, f)).expect("cq");
            b.progress(&mut |_| {}).expect("cq");
        }
        let stats = a.stats();
        assert_eq!(
            stats.injected, 2,
            "{provider}: the warm-up's and one: {stats:?}"
        );
        assert_eq!(got.len(), 3, "{provider}: {got:?}");
        let e = got[1].1.as_ref().expect_err("the injected error");
        assert!(e.contains("injected completion error"), "{provider}: {e}");
        for (i, (id, result)) in got.iter().enumerate() {
            assert_eq!(*id, i as u64, "{provider}: in order");
            assert_eq!(
                result.as_ref().err(),
                Some(e),
                "{provider}: the pipe's error"
            );
        }
    }
}

#[test]
fn detach_fails_pending_receives_in_order_then_forgets_the_pipe() {
    for provider in providers() {
        let (_a, _pa, mut b, pb) = pair(provider);
        let mut got = Vec::new();
        for i in 0..5u64 {
            let op = Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb, i as u32),
                mem: vec![0; 16],
                id: i,
            };
            b.post(pb, op, &mut |f| got.push(f));
        }
        let why = FabricError {
            op: "detach",
            provider: provider.into(),
            code: super::super::ecanceled(),
            text: "pipe closed".into(),
        };
        b.detach(pb, why.clone(), &mut |f| got.push(f));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < 8 && std::time::Instant::now() < deadline {
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        let ids: Vec<u64> = got.iter().map(|f| f.id).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4], "{provider}");
        assert!(got.iter().all(|f| f.result.as_ref().err() == Some(&why)));
        assert!(got.iter().all(|f| f.mem.len() == 16), "buffers come back");
        assert_eq!(b.stats().pipes, 0, "{provider}: forgotten");
        // Posting to it now fails at once.
        let mut late = None;
        b.post(
            pb,
            Op {
                kind: Kind::Send,
                tag: 0,
                mem: vec![],
                id: 77,
            },
            &mut |f| late = Some(f),
        );
        assert!(late.expect("answered").result.is_err());
    }
}

/// A pipe whose peer is gone (`refuse_sends`): its backlogged sends and every later one end at
/// once with the refusal, in order behind the sends the provider already took, without
/// reaching the provider; its receives still complete (one backlogged behind the refused
/// sends included); the other pipe of the same endpoint sends as before.
#[cfg(feature = "faults")]
#[test]
fn refused_sends_end_in_order_and_spare_receives_and_other_pipes() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        // A second pipe between the same endpoints.
        let qa = a.attach(b.endpoint().name()).expect("attach");
        let qb = b.attach(a.endpoint().name()).expect("attach");
        let op = |kind, pipe, i: u64, mem| Op {
            kind,
            tag: tag::make(Stream::Raw, pipe, i as u32),
            mem,
            id: i,
        };
        a.set_inject_limit(0);
        let (mut sent, mut got, mut at_b, mut other) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let turn = |a: &mut Engine,
                    b: &mut Engine,
                    sent: &mut Vec<Finished>,
                    got: &mut Vec<Finished>,
                    at_b: &mut Vec<Finished>,
                    other: &mut Vec<Finished>| {
            assert!(std::time::Instant::now() < deadline, "{provider}: stuck");
            a.progress(&mut |f| match f.kind {
                Kind::Send => sent.push(f),
                Kind::Recv => got.push(f),
            })
            .expect("cq a");
            b.progress(&mut |f| match (f.kind, f.pipe == qb) {
                (Kind::Send, _) => {}
                (Kind::Recv, true) => other.push(f),
                (Kind::Recv, false) => at_b.push(f),
            })
            .expect("cq b");
        };
        // Two sends the provider takes and b receives.
        for i in 0..2 {
            b.post(pb, op(Kind::Recv, pb, i, vec![0; 64]), &mut |f| {
                at_b.push(f)
            });
            a.post(pa, op(Kind::Send, pb, i, pattern(i, 64)), &mut |f| {
                sent.push(f)
            });
        }
        while sent.len() < 2 || at_b.len() < 2 {
            turn(&mut a, &mut b, &mut sent, &mut got, &mut at_b, &mut other);
        }
        // Every post refused as -FI_EAGAIN: two sends backlogged, a receive behind them.
        a.set_faults(Faults {
            eagain: 1.0,
            ..Faults::NONE
        });
        for i in 2..4 {
            a.post(pa, op(Kind::Send, pb, i, pattern(i, 64)), &mut |f| {
                sent.push(f)
            });
        }
        a.post(pa, op(Kind::Recv, pa, 0, vec![0; 64]), &mut |f| got.push(f));
        assert_eq!(a.stats().backlog, 3, "{provider}");
        a.set_faults(Faults::NONE);
        let why = FabricError {
            op: "fi_tsend",
            provider: provider.into(),
            code: libc::ECONNRESET,
            text: "the peer is gone".into(),
        };
        a.refuse_sends(pa, why.clone(), &mut |f| sent.push(f));
        assert_eq!(a.stats().backlog, 1, "{provider}: only the receive is left");
        let posted = a.stats().posted;
        a.post(pa, op(Kind::Send, pb, 4, pattern(4, 64)), &mut |f| {
            sent.push(f)
        });
        assert_eq!(
            a.stats().posted,
            posted,
            "{provider}: nothing reached the provider"
        );
        assert_eq!(a.stats().refused, 3, "{provider}");
        // The other pipe still sends, and b still reaches the refusing pipe's receive.
        b.post(qb, op(Kind::Recv, qb, 0, vec![0; 64]), &mut |f| {
            other.push(f)
        });
        a.post(qa, op(Kind::Send, qb, 0, pattern(9, 64)), &mut |f| {
            sent.push(f)
        });
        b.post(pb, op(Kind::Send, pa, 0, pattern(7, 64)), &mut |_| {});
        while sent.len() < 6 || got.is_empty() || other.is_empty() {
            turn(&mut a, &mut b, &mut sent, &mut got, &mut at_b, &mut other);
        }
        let on_pa: Vec<_> = sent.iter().filter(|f| f.pipe == pa).collect();
        let ids: Vec<u64> = on_pa.iter().map(|f| f.id).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4], "{provider}: in order");
        assert!(on_pa[..2].iter().all(|f| f.result.is_ok()), "{provider}");
        assert!(
            on_pa[2..]
                .iter()
                .all(|f| f.result.as_ref().err() == Some(&why)),
            "{provider}: {:?}",
            on_pa[2..].iter().map(|f| &f.result).collect::<Vec<_>>()
        );
        assert!(on_pa.iter().all(|f| f.mem.len() == 64), "buffers come back");
        // b got the two sends the provider took, and nothing of the refused ones.
        assert_eq!(at_b.len(), 2, "{provider}");
        assert_eq!(at_b[0].mem, pattern(0, 64));
        assert_eq!(at_b[1].mem, pattern(1, 64));
        // The refusing pipe's receive completed with b's message.
        assert_eq!(got.len(), 1, "{provider}");
        assert_eq!(got[0].mem, pattern(7, 64), "{provider}");
        // The other pipe's send went through.
        assert!(sent.iter().any(|f| f.pipe == qa && f.result.is_ok()));
        assert_eq!(other[0].mem, pattern(9, 64), "{provider}");
        // Nothing more arrives at b on the refusing pipe, where receives wait for the refused
        // sends' tags.
        for i in 2..5 {
            b.post(pb, op(Kind::Recv, pb, i, vec![0; 64]), &mut |f| {
                at_b.push(f)
            });
        }
        for _ in 0..100 {
            turn(&mut a, &mut b, &mut sent, &mut got, &mut at_b, &mut other);
        }
        assert_eq!(at_b.len(), 2, "{provider}: a refused send arrived");
    }
}

/// [`Engine::inject`] sends at once from the caller's bytes with no end, but never ahead of
/// its pipe's backlog, nor on a pipe that refuses its sends: it says no then, and the caller's
/// post keeps the order rules. The peer gets every message, intact.
#[cfg(feature = "faults")]
#[test]
fn direct_injects_go_at_once_but_never_ahead_of_the_backlog() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        let mut got: Vec<Finished> = Vec::new();
        for id in 0..3 {
            let op = Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb, id),
                mem: vec![0; 16],
                id: id as u64,
            };
            b.post(pb, op, &mut |f| got.push(f));
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut ends = 0;
        // rxm refuses posts (-FI_EAGAIN) while it connects: the inject says no, nothing else.
        while !a.inject(pa, tag::make(Stream::Raw, pb, 0), &[1; 16], &mut |_| {
            ends += 1
        }) {
            assert!(
                std::time::Instant::now() < deadline,
                "{provider}: never went"
            );
            a.progress(&mut |_| ends += 1).expect("cq");
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        assert_eq!(ends, 0, "{provider}: no end for a direct inject");
        let s = a.stats();
        assert_eq!((s.direct, s.in_flight), (1, 0), "{provider}: {s:?}");
        // A send refused into the backlog: the next inject may not overtake it.
        a.set_faults(Faults {
            eagain: 1.0,
            ..Faults::NONE
        });
        let op = Op {
            kind: Kind::Send,
            tag: tag::make(Stream::Raw, pb, 1),
            mem: vec![2; 16],
            id: 1,
        };
        a.post(pa, op, &mut |_| ends += 1);
        a.set_faults(Faults::NONE);
        assert_eq!(a.stats().backlog, 1, "{provider}");
        let third = tag::make(Stream::Raw, pb, 2);
        assert!(
            !a.inject(pa, third, &[3; 16], &mut |_| ends += 1),
            "{provider}: an inject went ahead of the backlog"
        );
        while a.stats().backlog > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{provider}: backlog stuck"
            );
            a.progress(&mut |_| ends += 1).expect("cq");
        }
        assert!(
            a.inject(pa, third, &[3; 16], &mut |_| ends += 1),
            "{provider}"
        );
        while got.len() < 3 {
            assert!(std::time::Instant::now() < deadline, "{provider}: {got:?}");
            a.progress(&mut |_| ends += 1).expect("cq");
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        assert_eq!(ends, 1, "{provider}: only the posted send ends");
        for (i, f) in got.iter().enumerate() {
            assert_eq!(f.result.as_ref().ok(), Some(&16), "{provider}: {f:?}");
            assert_eq!(f.mem, vec![i as u8 + 1; 16], "{provider}: message {i}");
        }
        // A pipe whose sends are refused: no inject either.
        let e = FabricError {
            op: "fi_tsend",
            provider: provider.into(),
            code: libc::ECONNRESET,
            text: "the peer died".into(),
        };
        a.refuse_sends(pa, e, &mut |_| {});
        assert!(
            !a.inject(pa, tag::make(Stream::Raw, pb, 3), &[4; 16], &mut |_| {}),
            "{provider}"
        );
        assert_eq!(a.stats().direct, 2, "{provider}");
    }
}

/// Completion errors injected while injects stay on: a direct inject goes to the provider (the
/// production send path, its message arrives), then meets the injected error, which fails its
/// pipe; the caller's post of the same send then ends with that error.
#[cfg(feature = "faults")]
#[test]
fn an_injected_error_meets_a_direct_inject_on_the_production_path() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        let mut got: Vec<Finished> = Vec::new();
        let op = Op {
            kind: Kind::Recv,
            tag: tag::make(Stream::Raw, pb, 0),
            mem: vec![0; 16],
            id: 0,
        };
        b.post(pb, op, &mut |f| got.push(f));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        a.set_faults(Faults {
            cq_error: 1.0,
            ..Faults::NONE
        });
        let sent = tag::make(Stream::Raw, pb, 0);
        let mut ends: Vec<Finished> = Vec::new();
        // rxm refuses posts (-FI_EAGAIN) while it connects: retry until the inject reaches the
        // provider.
        while a.stats().direct == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{provider}: never went"
            );
            assert!(
                !a.inject(pa, sent, &[6; 16], &mut |f| ends.push(f)),
                "{provider}: an inject that meets an error says no"
            );
            a.progress(&mut |f| ends.push(f)).expect("cq");
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        let s = a.stats();
        assert_eq!((s.direct, s.errors), (1, 1), "{provider}: {s:?}");
        // The caller posts it, as after any "no": it ends with the pipe's error.
        let op = Op {
            kind: Kind::Send,
            tag: sent,
            mem: vec![6; 16],
            id: 7,
        };
        a.post(pa, op, &mut |f| ends.push(f));
        a.set_faults(Faults::NONE);
        while got.is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "{provider}: not delivered"
            );
            a.progress(&mut |f| ends.push(f)).expect("cq");
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        assert_eq!(got[0].mem, vec![6; 16], "{provider}: the inject went out");
        assert_eq!(ends.len(), 1, "{provider}: {ends:?}");
        assert_eq!(ends[0].id, 7);
        let e = ends[0].result.as_ref().expect_err("the pipe's error");
        assert!(
            e.text.contains("injected completion error"),
            "{provider}: {e}"
        );
    }
}

/// One message whose tag carries credits, sent (posted, then injected) to a receive posted for
/// its name: the receive ends with that name and those credits, which travel as the message's
/// remote CQ data, not in its tag (libfabric 1.17's rxm in passthru mode reports every received
/// tag as 0, and its CQ data intact: `scripts/fi-tags-probe.c` in git history). The efa stream's credits ride
/// there.
fn credits_arrive(provider: &str) {
    let (mut a, pa, mut b, pb) = pair(provider);
    for (seq, inject) in [(4, false), (5, true)] {
        let posted = tag::make(Stream::Control, pb, seq);
        let sent = tag::with_credits(posted, 3 + seq);
        let mut got: Vec<Finished> = Vec::new();
        let op = Op {
            kind: Kind::Recv,
            tag: posted,
            mem: vec![0; 96],
            id: 0,
        };
        b.post(pb, op, &mut |f| got.push(f));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let bytes = vec![seq as u8; 96];
        if inject {
            // rxm refuses posts (-FI_EAGAIN) while it connects: the inject says no, nothing else.
            while !a.inject(pa, sent, &bytes, &mut |_| {}) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{provider}: no inject"
                );
                a.progress(&mut |_| {}).expect("cq");
                b.progress(&mut |f| got.push(f)).expect("cq");
            }
        } else {
            let op = Op {
                kind: Kind::Send,
                tag: sent,
                mem: bytes.clone(),
                id: 0,
            };
            a.post(pa, op, &mut |_| {});
        }
        while got.is_empty() {
            assert!(std::time::Instant::now() < deadline, "{provider}: no end");
            a.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        assert_eq!(got[0].result, Ok(96), "{provider}");
        assert_eq!(got[0].tag, sent, "{provider}: the name and the credits");
        assert_eq!(got[0].mem, bytes, "{provider}");
    }
}

#[test]
fn receives_end_with_the_credits_their_message_carried() {
    for provider in providers() {
        credits_arrive(provider);
    }
}

/// [`credits_arrive`] with rxm's passthru on: rxm reads the switch once, as libfabric loads, so
/// this runs in a process of its own that [`credits_survive_unreported_tags`] starts.
#[test]
#[ignore = "run by credits_survive_unreported_tags, in a process of its own"]
fn credits_survive_unreported_tags_alone() {
    assert!(
        std::env::var_os(super::super::PASSTHRU).is_some(),
        "run with {}=1",
        super::super::PASSTHRU
    );
    for provider in providers() {
        credits_arrive(provider);
    }
    // The efa transport offers rxm here under another name (an end without passthru does not
    // talk to it), and shm as ever.
    use crate::actors::hardware::efa::transport::Efa;
    use crate::transport::Transport;
    let rxm = Efa::new("tcp;ofi_rxm");
    assert_eq!(rxm.viable(), Ok(()));
    assert!(
        rxm.domain().starts_with("tcp;ofi_rxm+passthru/"),
        "{}",
        rxm.domain()
    );
    assert!(!super::super::keeps_unexpected("tcp;ofi_rxm"));
    assert!(Efa::new("shm").domain().starts_with("shm/"));
    assert!(super::super::keeps_unexpected("shm"));
}

#[test]
fn credits_survive_unreported_tags() {
    let name = concat!(module_path!(), "::credits_survive_unreported_tags_alone");
    let name = name.split_once("::").map_or(name, |(_, rest)| rest);
    run_alone(name, &[(super::super::PASSTHRU, "1")]);
}

/// Receives beyond the provider's limit wait in the backlog (never fail the pipe), and a pipe's
/// sends are not held behind its waiting receives: with a limit of 8, 20 receives posted
/// leave 12 waiting, a send of the same pipe goes out at once, and as messages come every
/// receive is posted and ends, in post order.
#[test]
fn receives_beyond_the_limit_wait_and_hold_no_send_back() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        b.set_rx_limit(8);
        let mut got: Vec<(u64, Result<usize, FabricError>)> = Vec::new();
        let record = |got: &mut Vec<_>, f: Finished| {
            if f.kind == Kind::Recv {
                got.push((f.id, f.result))
            }
        };
        for i in 0..20u64 {
            let op = Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pb, i as u32),
                mem: vec![0; 64],
                id: i,
            };
            b.post(pb, op, &mut |f| record(&mut got, f));
        }
        let s = b.stats();
        assert_eq!((s.receives_posted, s.backlog), (8, 12), "{provider}: {s:?}");
        // A send of b's pipe is not held behind its waiting receives: a gets it before it has
        // sent anything (b's receives can only make room once a's messages come).
        let mut back = None;
        a.post(
            pa,
            Op {
                kind: Kind::Recv,
                tag: tag::make(Stream::Raw, pa, 0),
                mem: vec![0; 64],
                id: 100,
            },
            &mut |f| back = Some(f.result.is_ok()),
        );
        b.post(
            pb,
            Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, pa, 0),
                mem: vec![7; 64],
                id: 100,
            },
            &mut |f| record(&mut got, f),
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while back.is_none() && std::time::Instant::now() < deadline {
            a.progress(&mut |f| back = Some(f.result.is_ok()))
                .expect("cq");
            b.progress(&mut |f| record(&mut got, f)).expect("cq");
        }
        assert_eq!(
            back,
            Some(true),
            "{provider}: the send went past the receives"
        );
        for i in 0..20u32 {
            let op = Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Raw, pb, i),
                mem: vec![i as u8; 64],
                id: u64::from(i),
            };
            a.post(pa, op, &mut |_| {});
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut most = 0;
        while got.len() < 20 && std::time::Instant::now() < deadline {
            a.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| record(&mut got, f)).expect("cq");
            most = most.max(b.stats().receives_posted);
        }
        assert!(most <= 8, "{provider}: {most} receives posted at once");
        assert_eq!(got.len(), 20, "{provider}: {got:?}");
        for (i, (id, r)) in got.iter().enumerate() {
            assert_eq!(*id, i as u64, "{provider}: in post order");
            assert_eq!(r.as_ref().ok(), Some(&64), "{provider}");
        }
        let s = b.stats();
        assert_eq!((s.receives_posted, s.backlog), (0, 0), "{provider}: {s:?}");
    }
}

/// The inbox: shared receives that take any pipe's control-stream messages. Fifteen messages
/// for three pipes land in four receives (most of them wait as unexpected messages first), each
/// handed to the pipe its tag names with its sequence number and bytes; one for a pipe that
/// does not use the inbox is dropped and counted; the inbox keeps its receives posted; and a
/// pipe of the inbox that fails gets one end with the error. On a provider that does not take
/// shared receives (`backend::efa::shares_receives`) it reports how many arrived, and stops.
#[test]
fn the_inbox_hands_each_message_to_its_pipe() {
    for provider in providers() {
        let (mut a, pa, mut b, pb) = pair(provider);
        let pb2 = b.attach(a.endpoint().name()).expect("attach");
        let pb3 = b.attach(a.endpoint().name()).expect("attach");
        let idle = b.attach(a.endpoint().name()).expect("attach");
        b.set_inbox(4, 256);
        for pipe in [pb, pb2, pb3] {
            assert!(b.use_inbox(pipe), "{provider}");
        }
        assert_eq!(b.stats().inbox_posted, 4, "{provider}");
        let mut sent = Vec::new();
        for seq in 0..5u32 {
            for pipe in [pb, pb2, pb3] {
                let bytes: Vec<u8> = (0..100 + seq as usize)
                    .map(|i| (i as u32 ^ pipe) as u8)
                    .collect();
                sent.push((pipe, seq, bytes.clone()));
                let op = Op {
                    kind: Kind::Send,
                    tag: tag::make(Stream::Control, pipe, seq),
                    mem: bytes,
                    id: 0,
                };
                a.post(pa, op, &mut |_| {});
            }
        }
        // One for a pipe that takes none from the inbox.
        a.post(
            pa,
            Op {
                kind: Kind::Send,
                tag: tag::make(Stream::Control, idle, 0),
                mem: vec![1; 10],
                id: 0,
            },
            &mut |_| {},
        );
        let mut got: Vec<Finished> = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while (got.len() < 15 || b.stats().stray < 1) && std::time::Instant::now() < deadline {
            a.progress(&mut |_| {}).expect("cq");
            b.progress(&mut |f| got.push(f)).expect("cq");
        }
        if !crate::backend::efa::shares_receives(provider) {
            // What keeps the inbox off on this provider (`backend::efa::shares_receives`).
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "the_inbox_hands_each_message_to_its_pipe: skipped: {provider} does not take \
                 shared receives: {} of 15 messages reached an inbox of 4",
                got.len()
            );
            continue;
        }
        assert_eq!(
            got.len(),
            15,
            "{provider}: {:?} / a: {:?}",
            b.stats(),
            a.stats()
        );
        assert_eq!(b.stats().stray, 1, "{provider}");
        for (pipe, seq, bytes) in &sent {
            let f = got
                .iter()
                .find(|f| f.pipe == *pipe && f.id == u64::from(*seq))
                .unwrap_or_else(|| panic!("{provider}: message {seq} of pipe {pipe}"));
            assert_eq!(f.kind, Kind::Recv);
            assert_eq!(f.result.as_ref().ok(), Some(&bytes.len()), "{provider}");
            assert_eq!(&f.mem[..bytes.len()], &bytes[..], "{provider}");
        }
        for f in got.drain(..) {
            b.recycle_inbox(f.mem);
        }
        let s = b.stats();
        assert_eq!(
            (s.inbox_posted, s.receives_posted),
            (4, 0),
            "{provider}: {s:?}"
        );
        // A failing pipe of the inbox hears it.
        let e = FabricError {
            op: "test",
            provider: provider.into(),
            code: libc::ECONNRESET,
            text: "gone".into(),
        };
        let mut ends = Vec::new();
        b.detach(pb2, e.clone(), &mut |f| ends.push(f));
        assert_eq!(ends.len(), 1, "{provider}: {ends:?}");
        assert_eq!((ends[0].pipe, ends[0].id), (pb2, u64::MAX));
        assert_eq!(ends[0].result.as_ref().err(), Some(&e));
    }
}

/// RMA on each provider: a peer reads and writes memory registered for it, in pieces, the
/// ends in post order (a write's once its bytes are in the target's memory); the registration
/// closed, the next op fails its pipe. The target only progresses its engine.
#[test]
fn rma_reads_and_writes_registered_memory_then_fails_once_it_is_closed() {
    for provider in providers() {
        let (mut a, pa, mut b, _) = pair(provider);
        // The two every libfabric build has offer RMA: only another provider may lack it.
        let known = provider == "tcp;ofi_rxm" || provider == "shm";
        assert!(
            b.attributes().rma || !known,
            "{provider} opened without RMA"
        );
        if !b.attributes().rma {
            eprintln!("skipped on {provider}: the provider offers no RMA here");
            continue;
        }
        let len = 3 << 20;
        let mut target: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY: `target` outlives the registration (released below, before it drops).
        let (handle, key, addr) =
            unsafe { b.register_remote(target.as_mut_ptr() as usize, len, true) }
                .expect("register for RMA");
        let mut local = vec![0u8; len];
        let mut ends = Vec::new();
        let region = |buf: &mut Vec<u8>, offset: usize, n: usize| Region {
            base: buf.as_mut_ptr() as usize,
            buffer_len: buf.len(),
            offset,
            len: n,
        };
        // Read the first 2 MiB in two pieces; write 1 MiB of ours at 2 MiB.
        for (i, (at, n)) in [(0usize, 1usize << 20), (1 << 20, 1 << 20)]
            .into_iter()
            .enumerate()
        {
            let r = Rma {
                write: false,
                addr: addr + at as u64,
                key,
            };
            // SAFETY: `local` outlives the op's end, read below.
            unsafe {
                a.post_rma(pa, r, region(&mut local, at, n), i as u64, &mut |f| {
                    ends.push(f)
                })
            };
        }
        let ours: Vec<u8> = (0..1usize << 20).map(|i| (i * 13 + 1) as u8).collect();
        local[2 << 20..].copy_from_slice(&ours);
        let w = Rma {
            write: true,
            addr: addr + (2u64 << 20),
            key,
        };
        // SAFETY: as above.
        unsafe {
            a.post_rma(pa, w, region(&mut local, 2 << 20, 1 << 20), 2, &mut |f| {
                ends.push(f)
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while ends.len() < 3 && std::time::Instant::now() < deadline {
            a.progress(&mut |f| ends.push(f)).expect("progress");
            b.progress(&mut |_| {}).expect("progress");
        }
        let ids: Vec<u64> = ends.iter().map(|f| f.id).collect();
        assert_eq!(ids, [0, 1, 2], "{provider}: ends in post order");
        for f in &ends {
            assert_eq!(
                f.result.as_ref().ok(),
                Some(&(1usize << 20)),
                "{provider}: {f:?}"
            );
            assert_eq!(f.kind, Kind::Send);
        }
        let expected: Vec<u8> = (0..2usize << 20).map(|i| (i * 7 + 3) as u8).collect();
        assert!(
            local[..2 << 20] == expected[..],
            "{provider}: the read's bytes"
        );
        assert!(
            target[2 << 20..] == ours[..],
            "{provider}: the write's bytes, at its end"
        );
        assert_eq!(b.remote_registrations(), 1);
        b.release_remote(handle);
        assert_eq!(b.remote_registrations(), 0);
        // The key is gone: the next read fails (its pipe with it), and nothing lands. Not on
        // `shm`, which copies with process_vm_readv and checks no key: there the remote path's
        // revocation handshake (docs/remote.md) is all that keeps a peer out after
        // deregistration, and this trial says so if that ever changes.
        local[..4096].fill(0);
        let r = Rma {
            write: false,
            addr,
            key,
        };
        ends.clear();
        // SAFETY: as above.
        unsafe { a.post_rma(pa, r, region(&mut local, 0, 4096), 3, &mut |f| ends.push(f)) };
        while ends.is_empty() && std::time::Instant::now() < deadline {
            a.progress(&mut |f| ends.push(f)).expect("progress");
            b.progress(&mut |_| {}).expect("progress");
        }
        let checks_keys = provider != "shm";
        assert_eq!(
            ends.first().map(|f| f.result.is_err()),
            Some(checks_keys),
            "{provider}: a read of a closed registration: {ends:?}"
        );
        if checks_keys {
            assert!(
                local[..4096].iter().all(|&x| x == 0),
                "{provider}: nothing landed"
            );
        }
        drop(target);
    }
}
