//! Authentication with a shared secret: right secret, wrong secret, no secret on either side.
//! A peer without the secret cannot open a pipe, and cannot make the listener allocate more
//! than one small handshake frame.

use std::time::Duration;

use actorpipe::internal::wire::Preamble;
use actorpipe::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

async fn connect(client: ContextBuilder, server: &Server) -> Result<actix::Addr<Pipe>> {
    let c = client.start();
    within(10, "connect", c.send(Connect::new(&server.url)))
        .await
        .unwrap()
}

#[actix::test]
async fn the_right_secret_opens_pipes_on_every_backend() {
    // Default backends (shm + xth: joins authenticated too) and tcp with mpt lanes.
    for b in [
        || Context::builder().secret("correct horse"),
        || {
            Context::builder()
                .secret("correct horse")
                .without("shm")
                .only_channels(&["mpt", "basic"])
        },
    ] {
        let (tx, rx, _s) = pair(b(), b()).await;
        let w = tx.send(Write::new(checked_message(1, &[10], &[200_000])));
        assert_eq!(verify(&read_one(&rx).await.unwrap()), 1);
        w.await.unwrap().result.unwrap();
    }
}

#[actix::test]
async fn a_wrong_or_missing_secret_is_refused_both_ways() {
    let mut server = Server::start(
        Context::builder()
            .secret("s3cret")
            .handshake_timeout(Duration::from_secs(2)),
        "tcp://127.0.0.1:0",
    )
    .await;
    for (client, what) in [
        (Context::builder().secret("wrong"), "does not match"),
        (Context::builder(), "requires a shared secret"),
    ] {
        match connect(client, &server).await {
            Err(Error::Unauthenticated { reason, .. }) => {
                assert!(reason.contains(what), "{reason}")
            }
            other => panic!("expected Unauthenticated, got {other:?}"),
        }
    }
    // The server never handed out a pipe.
    assert!(server.accepted.try_recv().is_err());

    // A client with a secret refuses a server without one.
    let open = Server::start(Context::builder(), "tcp://127.0.0.1:0").await;
    match connect(Context::builder().secret("s3cret"), &open).await {
        Err(Error::Unauthenticated { reason, .. }) => {
            assert!(reason.contains("has no shared secret"), "{reason}")
        }
        other => panic!("expected Unauthenticated, got {other:?}"),
    }
    // And the right secret still works on the same server.
    let pipe = connect(Context::builder().secret("s3cret"), &server)
        .await
        .unwrap();
    server.next().await;
    drop(pipe);
}

#[actix::test]
async fn an_unauthenticated_peer_cannot_make_the_listener_allocate() {
    let server = Server::start(
        Context::builder()
            .secret("s3cret")
            .handshake_timeout(Duration::from_secs(2)),
        "tcp://127.0.0.1:0",
    )
    .await;
    let addr = server.url.trim_start_matches("tcp://").to_string();
    // A hello announcing 1 MiB: over the 64 KiB handshake limit, refused before any read.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(&Preamble::OURS.encode()).await.unwrap();
    s.write_all(&(1u32 << 20).to_le_bytes()).await.unwrap();
    let mut back = Vec::new();
    within(5, "refusal", s.read_to_end(&mut back))
        .await
        .unwrap();
    assert!(back.is_empty(), "nothing said to a stranger");
    assert_eq!(actorpipe::internal::auth::HANDSHAKE_FRAME_LIMIT, 64 << 10);
}
