//! The `efa` channel over several domains of one provider (`tcp;ofi_rxm` lists `lo` and the
//! host's network interfaces as domains): tensors striped over the domains both peers have, the
//! bytes counted per domain, peers whose domain sets differ. Each trial reports itself skipped,
//! with the reason, where the build has no `efa` feature or the provider lists fewer than two
//! domains here. (The conformance suite `efa_efa_domains` and the peer-death backend
//! `efa_efa_domains` run the same configuration, on each provider of `ACTORPIPE_EFA_PROVIDERS`.)

use libtest_mimic::{Arguments, Trial};

#[cfg(feature = "efa")]
#[path = "common/mod.rs"]
mod common;

#[cfg(feature = "efa")]
mod domains {
    use std::sync::Arc;

    use actix::Addr;
    use actorpipe::internal::hardware::efa::FabricStats;
    use actorpipe::transport::Efa;
    use actorpipe::*;

    use super::common::*;

    pub const PROVIDER: &str = "tcp;ofi_rxm";

    /// The provider's domains here, or why the trials cannot run.
    pub fn listed() -> Result<Vec<String>, String> {
        let d = Efa::new(PROVIDER)
            .domains()
            .map_err(|e| format!("skipped: {e}"))?;
        if d.len() < 2 {
            return Err(format!(
                "skipped: {PROVIDER} lists {} domain(s) here, striping needs 2",
                d.len()
            ));
        }
        Ok(d.into_iter().map(|(_, d)| d).collect())
    }

    /// A context on `PROVIDER` whose efa channel uses `domains` (`None`: only the transport's),
    /// with its transport so that the test can ask its endpoints. Chunks of 256 KiB, pipes on
    /// the context's thread (the endpoints the test asks are this thread's).
    fn context(domains: Option<&[&str]>) -> (ContextBuilder, Efa) {
        let t = Efa::new(PROVIDER);
        let c = actorpipe::channel::Efa::over(&t).max_message(256 << 10);
        let c = match domains {
            None => c,
            Some([]) => c.all_domains(),
            Some(names) => c.domains(names),
        };
        let b = Context::builder()
            .without("shm")
            .io_threads(0)
            .transport(Arc::new(t.clone()))
            .channel(Arc::new(c))
            .only_channels(&["efa", "basic"]);
        (b, t)
    }

    /// Bytes moved so far by each of `t`'s endpoints on `domains` (opened if not yet).
    async fn bytes(t: &Efa, domains: &[String]) -> Vec<u64> {
        let mut v = Vec::new();
        for d in domains {
            let ep = t.endpoint_on(d).expect("endpoint");
            v.push(ep.send(FabricStats).await.expect("stats").bytes);
        }
        v
    }

    /// `n` messages of random shape (tensors from empty to 8 MiB), 8 writes in flight: each
    /// arrives intact and in order; returns the tensor bytes sent.
    async fn stream(tx: &Addr<Pipe>, rx: &Addr<Pipe>, n: u64, seed: u64) -> u64 {
        const TENSORS: [usize; 8] = [0, 1, 4097, 65_536, 65_537, 300_001, 1 << 20, 8 << 20];
        random_stream(tx, rx, n, 8, seed, |rng| {
            let payloads = (0..rng.below(2))
                .map(|_| rng.below(2000) as usize)
                .collect();
            let tensors = (0..1 + rng.below(3))
                .map(|_| TENSORS[rng.below(TENSORS.len() as u64) as usize])
                .collect();
            (payloads, tensors)
        })
        .await
    }

    /// Both peers on every domain: messages arrive intact and in order, and each domain's
    /// endpoint, on each side, moved a fair share of the striped tensors' bytes.
    pub fn striped_over_every_domain() {
        let names = listed().expect("checked before");
        actix::System::new().block_on(async {
            let (cb, ct) = context(Some(&[]));
            let (sb, st) = context(Some(&[]));
            let (tx, rx, _s) = pair(cb, sb).await;
            check_backends(&tx, "efa", "efa").await;
            check_backends(&rx, "efa", "efa").await;
            let (c0, s0) = (bytes(&ct, &names).await, bytes(&st, &names).await);
            // One 64 MiB tensor: stripes of 64 MiB / domains each.
            let big = 64 << 20;
            tx.do_send(Write::new(checked_message(0, &[], &[big])));
            let m = within(120, "the 64 MiB tensor", read_one(&rx))
                .await
                .expect("read");
            assert_eq!(verify(&m), 0);
            let (c1, s1) = (bytes(&ct, &names).await, bytes(&st, &names).await);
            let share = big as u64 / names.len() as u64;
            for (i, d) in names.iter().enumerate() {
                for (side, a, b) in [("sender", &c0, &c1), ("receiver", &s0, &s1)] {
                    let moved = b[i] - a[i];
                    assert!(
                        moved >= share - (64 << 10),
                        "the {side}'s endpoint on {d} moved {moved} bytes of the tensor, \
                         expected its stripe of {share}"
                    );
                }
            }
            // Then random shapes, both directions at once.
            let (c2, s2) = (bytes(&ct, &names).await, bytes(&st, &names).await);
            let (sent, back) = within(240, "random shapes both ways", async {
                tokio::join!(stream(&tx, &rx, 60, 5), stream(&rx, &tx, 60, 6))
            })
            .await;
            let (c3, s3) = (bytes(&ct, &names).await, bytes(&st, &names).await);
            for i in 0..names.len() {
                let moved = (c3[i] - c2[i]) + (s3[i] - s2[i]);
                assert!(
                    moved * names.len() as u64 * 4 >= sent + back,
                    "domain {} moved {moved} of {} tensor bytes",
                    names[i],
                    sent + back
                );
            }
        });
    }

    /// One peer on every domain, the other on the transport's only: they use the one domain
    /// they share (the others' endpoints move nothing), data intact.
    pub fn one_sided_domains_use_the_common_one() {
        let names = listed().expect("checked before");
        actix::System::new().block_on(async {
            let (cb, ct) = context(Some(&[]));
            let (sb, _st) = context(None);
            let (tx, rx, _s) = pair(cb, sb).await;
            check_backends(&tx, "efa", "efa").await;
            let before = bytes(&ct, &names).await;
            let own = ct.domain_name().expect("domain");
            within(120, "messages", stream(&tx, &rx, 20, 9)).await;
            let after = bytes(&ct, &names).await;
            for (i, d) in names.iter().enumerate() {
                let moved = after[i] - before[i];
                if *d == own {
                    assert!(moved > 0, "the common domain {d} moved nothing");
                } else {
                    assert_eq!(moved, 0, "domain {d}, which the peer lacks, moved bytes");
                }
            }
        });
    }

    /// A peer naming its further domains beside one taking all of them: both pair the same
    /// domains, the striped tensor arrives intact, and every domain outside the named ones
    /// moves nothing.
    pub fn named_and_all_domains_agree() {
        let names = listed().expect("checked before");
        actix::System::new().block_on(async {
            let own = Efa::new(PROVIDER).domain_name().expect("domain");
            let other: Vec<&str> = names
                .iter()
                .map(String::as_str)
                .filter(|d| *d != own)
                .collect();
            // The server names the first further domain; the client all of them.
            let (cb, ct) = context(Some(&[]));
            let (sb, st) = context(Some(&other[..1]));
            let (tx, rx, _s) = pair(cb, sb).await;
            check_backends(&tx, "efa", "efa").await;
            let (c0, s0) = (bytes(&ct, &names).await, bytes(&st, &names).await);
            let big = 16 << 20;
            tx.do_send(Write::new(checked_message(0, &[], &[big])));
            let m = within(120, "the tensor", read_one(&rx))
                .await
                .expect("read");
            assert_eq!(verify(&m), 0);
            let (c1, s1) = (bytes(&ct, &names).await, bytes(&st, &names).await);
            for (i, d) in names.iter().enumerate() {
                let used = *d == own || *d == other[0];
                let moved = c1[i] - c0[i] + s1[i] - s0[i];
                assert_eq!(
                    moved >= big as u64 / 2,
                    used,
                    "domain {d} moved {moved} bytes (in the intersection: {used})"
                );
            }
        });
    }
}

#[cfg(feature = "efa")]
fn trials() -> Vec<Trial> {
    type Case = fn();
    let cases: [(&str, Case); 3] = [
        (
            "striped_over_every_domain",
            domains::striped_over_every_domain,
        ),
        (
            "one_sided_domains_use_the_common_one",
            domains::one_sided_domains_use_the_common_one,
        ),
        (
            "named_and_all_domains_agree",
            domains::named_and_all_domains_agree,
        ),
    ];
    let skip = domains::listed().err();
    cases
        .into_iter()
        .map(|(name, case)| {
            let t = Trial::test(name, move || {
                case();
                Ok(())
            });
            match &skip {
                Some(why) => t.with_ignored_flag(true).with_kind(why.clone()),
                None => t,
            }
        })
        .collect()
}

#[cfg(not(feature = "efa"))]
fn trials() -> Vec<Trial> {
    vec![Trial::test("efa_domains", || Ok(()))
        .with_ignored_flag(true)
        .with_kind("skipped: built without the `efa` feature")]
}

fn main() {
    let args = Arguments::from_args();
    libtest_mimic::run(&args, trials()).exit();
}
