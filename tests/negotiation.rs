//! What negotiation picks, and that users can remove and re-prioritise backends.

mod common;

use actorpipe::*;
use common::*;

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
    (a.transport, a.channels)
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
