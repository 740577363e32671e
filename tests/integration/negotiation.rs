//! What negotiation picks, and that users can remove and re-prioritise backends.

use actorpipe::*;

use crate::common::*;

async fn chosen(client: ContextBuilder, server: ContextBuilder) -> (String, Vec<String>) {
    let (tx, rx, _s) = pair(client, server).await;
    let a = tx.send(GetInfo).await.unwrap();
    let b = rx.send(GetInfo).await.unwrap();
    assert_eq!(
        (&a.transport, &a.channels),
        (&b.transport, &b.channels),
        "both sides agree"
    );
    // And the pipe works on what was chosen.
    let w = tx.send(Write::new(checked_message(1, &[3], &[100_000])));
    assert_eq!(verify(&read_one(&rx).await.unwrap()), 1);
    w.await.unwrap().result.unwrap();
    // The host pair only: with feature `cuda` on a GPU host a pipe also lists a CUDA channel
    // per device pair (tests/cuda.rs covers those), and this suite must pass there too.
    let host: Vec<String> = a
        .channels
        .iter()
        .map(ToString::to_string)
        .filter(|c| c.ends_with("(cpu->cpu)"))
        .collect();
    assert_eq!(host.len(), 1, "one channel for cpu->cpu: {:?}", a.channels);
    (a.transport, host)
}

#[actix::test]
async fn defaults_pick_the_fastest_shared_path_in_one_process() {
    let (t, c) = chosen(Context::builder(), Context::builder()).await;
    assert_eq!(t, "shm");
    assert_eq!(c, vec!["xth (cpu->cpu)"]);
}

#[actix::test]
async fn removing_backends_falls_through_the_priorities() {
    let b = || Context::builder().without("xth");
    assert_eq!(chosen(b(), b()).await.1, vec!["cma (cpu->cpu)"]);
    let b = || Context::builder().without("xth").without("cma");
    assert_eq!(chosen(b(), b()).await.1, vec!["mpt (cpu->cpu)"]);
    let b = || {
        Context::builder()
            .without("xth")
            .without("cma")
            .without("mpt")
    };
    assert_eq!(chosen(b(), b()).await.1, vec!["basic (cpu->cpu)"]);
    let b = || Context::builder().without("shm");
    assert_eq!(chosen(b(), b()).await.0, "tcp");
}

#[actix::test]
async fn priorities_can_be_changed() {
    let b = || {
        Context::builder()
            .priority("basic", 1000)
            .priority("tcp", 1000)
    };
    let (t, c) = chosen(b(), b()).await;
    assert_eq!(t, "tcp");
    assert_eq!(c, vec!["basic (cpu->cpu)"]);
}

#[actix::test]
async fn one_side_without_a_backend_means_neither_uses_it() {
    let (t, c) = chosen(
        Context::builder(),
        Context::builder().without("shm").without("xth"),
    )
    .await;
    assert_eq!(t, "tcp");
    assert_eq!(c, vec!["cma (cpu->cpu)"]);
}

#[actix::test]
async fn nothing_in_common_is_refused_with_the_reason() {
    let server = Server::start(
        Context::builder().only_channels(&["basic"]),
        "tcp://127.0.0.1:0",
    )
    .await;
    let client = Context::builder().only_channels(&["xth"]).start();
    match client.send(Connect::new(&server.url)).await.unwrap() {
        Err(Error::Unavailable { reason, .. }) => {
            assert!(reason.contains("no channel in common"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

fn mpt_only() -> ContextBuilder {
    Context::builder()
        .without("shm")
        .only_channels(&["mpt", "basic"])
        .lanes(3)
}

fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap()
}

/// mpt lanes leave from the local addresses given, one per NIC, round-robin (loopback has the
/// whole 127/8, so two "NICs" are 127.0.0.2 and 127.0.0.3); the listener sees them arrive from
/// there, and data striped across them arrives intact.
#[actix::test]
async fn mpt_lanes_leave_from_the_given_local_addresses() {
    let client = mpt_only().lane_addresses([ip("127.0.0.2"), ip("127.0.0.3")]);
    let (tx, rx, _s) = pair(client, mpt_only()).await;
    let mine = tx.send(GetInfo).await.unwrap().connections;
    let theirs = rx.send(GetInfo).await.unwrap().connections;
    assert_eq!(mine.len(), 3, "{mine:?}");
    assert_eq!(theirs.len(), 3, "{theirs:?}");
    for (i, (m, t)) in mine.iter().zip(&theirs).enumerate() {
        let nic = ["127.0.0.2", "127.0.0.3"][i % 2];
        assert_eq!((m.channel.as_str(), m.lane), ("mpt", i as u32));
        assert!(m.local.starts_with(&format!("tcp://{nic}:")), "{m:?}");
        assert!(t.peer.starts_with(&format!("tcp://{nic}:")), "{t:?}");
        assert_eq!(m.local, t.peer);
    }
    // The control connection is not a lane: it leaves from wherever routing says.
    assert!(tx
        .send(GetInfo)
        .await
        .unwrap()
        .local
        .starts_with("tcp://127.0.0.1:"));
    let w = tx.send(Write::new(checked_message(7, &[3], &[3 << 20, 1])));
    assert_eq!(verify(&read_one(&rx).await.unwrap()), 7);
    w.await.unwrap().result.unwrap();
}

/// A lane address that is not this host's, or not of the peer's family, fails the connect with
/// the reason; nothing is left half open.
#[actix::test]
async fn a_lane_address_that_cannot_be_bound_fails_the_connect() {
    let mut s = Server::start(mpt_only(), "tcp://127.0.0.1:0").await;
    for (bad, why) in [
        ("192.0.2.1", "cannot bind source address 192.0.2.1"),
        ("::1", "not of the same family"),
    ] {
        let ctx = mpt_only().lane_addresses([ip(bad)]).start();
        let e = ctx
            .send(Connect::new(&s.url))
            .await
            .unwrap()
            .expect_err("an unusable lane address");
        assert_eq!(e.class(), "connect", "{e}");
        assert!(e.to_string().contains(why), "{e}");
    }
    // The listener is still fine.
    let ctx = mpt_only().start();
    let tx = ctx.send(Connect::new(&s.url)).await.unwrap().unwrap();
    let rx = s.next().await;
    let w = tx.send(Write::new(checked_message(1, &[], &[1 << 20])));
    assert_eq!(verify(&read_one(&rx).await.unwrap()), 1);
    w.await.unwrap().result.unwrap();
}
