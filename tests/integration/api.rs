//! The API as a user meets it: the prelude, one-step calls, error classes, backend choice, where
//! metrics are served, contexts on other arbiters.

// The prelude must glob-import next to actix's and std::io's without a clash.
use actix::prelude::*;
use actorpipe::prelude::*;
#[allow(unused_imports)]
use std::io::prelude::*;

use std::time::Duration;

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what} took over 20 s"))
}

/// A client pipe and the server's end of it, over tcp + basic unless the builders say otherwise.
async fn pair(
    client: ContextBuilder,
    server: ContextBuilder,
    require: &[&str],
) -> (Addr<Pipe>, Addr<Pipe>, Listening) {
    let server = server.start();
    let (accepted, mut incoming) = inbox::<Accepted>();
    let listen = Listen::new(["tcp://127.0.0.1:0"], accepted).require(require);
    let l = server.send(listen).await.expect("context").expect("listen");
    let tx = within("connect", client.start().connect(&l.urls[0]))
        .await
        .expect("connect");
    let rx = within("accept", incoming.recv())
        .await
        .expect("a pipe")
        .pipe;
    (tx, rx, l)
}

#[actix::test]
async fn one_step_calls_give_one_result() {
    let builder = || actorpipe::Context::builder().only_transports(&["tcp"]);
    let (tx, rx, l) = pair(builder().only_channels(&["basic"]), builder(), &[]).await;
    assert_eq!(l.endpoints.len(), 1);
    assert_eq!(l.endpoints[0].transport, "tcp");
    assert_eq!(l.endpoints[0].url, l.urls[0]);

    let m = actorpipe::Message::new()
        .with_metadata(b"hello".to_vec())
        .with_tensor(Tensor::cpu(vec![3; 100_000]));
    let w = tx.write(m);
    let got = within("receive", rx.receive()).await.expect("receive");
    assert_eq!(got.metadata, b"hello");
    assert_eq!(got.tensors[0].buffer.as_cpu(), Some(&[3u8; 100_000][..]));
    let done = w.await.expect("write");
    assert_eq!(done.id, 0);
    assert_eq!(
        done.message.tensors[0].buffer.len(),
        100_000,
        "buffers back"
    );

    // Two-step read through the one-step calls.
    let w = tx.write(actorpipe::Message::new().with_payload(Payload::new(vec![1, 2, 3])));
    let d = rx.read_descriptor().await.expect("descriptor");
    let m = rx
        .read(Allocation::for_descriptor(&d).expect("alloc"))
        .await;
    assert_eq!(m.expect("read").payloads[0].data, vec![1, 2, 3]);
    w.await.expect("write");

    let info = tx.info().await.expect("info");
    assert_eq!(info.transport, "tcp");
    assert_eq!(info.channel_list(), "basic (cpu->cpu)");
    assert_eq!(
        (info.tensors_on_control, info.tensors_by_channel),
        (1, 0),
        "basic sends its one tensor on the control connection"
    );
    assert!(!info.closed);

    // Errors come out as one `Error`, matched by class.
    let closed = tx.close(Close::because("done")).await.expect("close");
    assert_eq!(closed.error.kind(), ErrorClass::Closed);
    let e = tx
        .write(actorpipe::Message::new())
        .await
        .expect_err("closed");
    assert_eq!(e.kind(), ErrorClass::Closed);
    assert_eq!(e.class(), "closed");
    let e = rx.receive().await.expect_err("the peer closed");
    assert_eq!(e.kind(), ErrorClass::PeerClosed);
    assert!(e.kind().is_transient());
}

#[actix::test]
async fn a_listener_can_require_its_backends() {
    let both = || actorpipe::Context::builder().only_transports(&["tcp"]);
    // The client prefers xth and mpt to basic; the listener requires basic, and gets it.
    let (tx, _rx, _l) = pair(both(), both(), &["basic"]).await;
    let info = tx.info().await.expect("info");
    assert_eq!(info.channels[0].name, "basic", "{:?}", info.channels);
    // A client without the required channel is refused, with the reason.
    let server = both().start();
    let (accepted, _incoming) = inbox::<Accepted>();
    let l = server
        .send(Listen::new(["tcp://127.0.0.1:0"], accepted).require(&["mpt"]))
        .await
        .expect("context")
        .expect("listen");
    let client = both().without("mpt").start();
    let e = within("connect", client.connect(&l.urls[0]))
        .await
        .expect_err("no common channel");
    assert_eq!(e.kind(), ErrorClass::Unavailable, "{e}");
}

#[actix::test]
async fn only_transports_keeps_the_ones_named() {
    let ctx = actorpipe::Context::builder()
        .only_transports(&["tcp"])
        .start();
    let (accepted, _incoming) = inbox::<Accepted>();
    let e = ctx
        .listen(["shm://"], accepted)
        .await
        .expect_err("shm was removed");
    assert_eq!(e.kind(), ErrorClass::Unavailable, "{e}");
}

#[test]
fn metrics_addr_reports_the_bound_port_or_the_failure() {
    let served = actorpipe::Context::builder()
        .metrics("127.0.0.1:0".parse().unwrap())
        .build();
    let addr = served.metrics_addr().expect("bound");
    assert_ne!(addr.port(), 0, "port 0 resolved");
    // One exporter per process: another address fails, and the context says why.
    let other = actorpipe::Context::builder()
        .metrics("127.0.0.1:1".parse().unwrap())
        .build();
    let e = other.metrics_addr().expect_err("taken");
    assert_eq!(e.kind(), ErrorClass::InvalidArgument, "{e}");
    // A context that was not asked says so.
    let e = actorpipe::Context::builder()
        .build()
        .metrics_addr()
        .expect_err("not asked");
    assert_eq!(e.kind(), ErrorClass::Unavailable, "{e}");
    // Once started, the context answers GetMetricsAddr, in the raw form and in one step.
    System::new().block_on(async move {
        let ctx = served.start();
        let got = ctx.send(GetMetricsAddr).await.expect("context");
        assert_eq!(got.expect("bound"), addr);
        assert_eq!(ctx.metrics_addr().await.expect("bound"), addr);
    });
}

#[test]
fn a_context_runs_on_another_arbiter() {
    System::new().block_on(async {
        let arbiter = Arbiter::new();
        let ctx = actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .start_in(&arbiter.handle());
        let (accepted, mut incoming) = inbox::<Accepted>();
        let l = ctx
            .listen(["tcp://127.0.0.1:0"], accepted)
            .await
            .expect("listen");
        let here = actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .start();
        let tx = here.connect(&l.urls[0]).await.expect("connect");
        let rx = incoming.recv().await.expect("a pipe").pipe;
        let w = tx.write(actorpipe::Message::new().with_metadata(b"x".to_vec()));
        assert_eq!(rx.receive().await.expect("receive").metadata, b"x");
        w.await.expect("write");
        arbiter.stop();
    });
}

#[actix::test]
async fn info_says_how_tensors_travelled() {
    // xth moves tensors between two contexts of one process: through the channel, not the
    // control connection.
    let builder = || {
        actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["xth"])
    };
    let (tx, rx, _l) = pair(builder(), builder(), &[]).await;
    for _ in 0..3 {
        let m = actorpipe::Message::new().with_tensor(Tensor::cpu(vec![7; 1 << 20]));
        let w = tx.write(m);
        within("receive", rx.receive()).await.expect("receive");
        w.await.expect("write");
    }
    let info = tx.info().await.expect("info");
    assert_eq!(info.transport, "tcp");
    assert_eq!(info.channels[0].name, "xth");
    assert_eq!(
        info.channels[0].devices,
        actorpipe::internal::negotiate::DevicePair::CPU
    );
    assert_eq!((info.tensors_on_control, info.tensors_by_channel), (0, 3));
    // The receiving side counts what it sent: nothing.
    let back = rx.info().await.expect("info");
    assert_eq!((back.tensors_on_control, back.tensors_by_channel), (0, 0));
}

/// One shared, read-only buffer written to several pipes at once, over every CPU channel: no
/// copy on the sending side (the very same bytes come back in each `WriteDone`), the right bytes
/// on each receiving side, and a read into shared bytes refused with a clear error.
#[actix::test]
async fn one_shared_buffer_goes_to_many_pipes() {
    let data = Bytes::from(
        (0..(3 << 20) + 5)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    for (transport, channel) in [
        ("tcp", "basic"),
        ("tcp", "xth"),
        ("tcp", "mpt"),
        ("shm", "cma"),
        ("shm", "basic"),
    ] {
        let builder = || {
            actorpipe::Context::builder()
                .only_transports(&[transport])
                .only_channels(&[channel])
        };
        let server = builder().start();
        let (accepted, mut incoming) = inbox::<Accepted>();
        let url = if transport == "tcp" {
            "tcp://127.0.0.1:0"
        } else {
            "shm://"
        };
        let l = server.listen([url], accepted).await.expect("listen");
        let client = builder().start();
        let mut pipes = Vec::new();
        for _ in 0..3 {
            let tx = within("connect", client.connect(&l.urls[0]))
                .await
                .expect("connect");
            let rx = within("accept", incoming.recv()).await.expect("pipe").pipe;
            pipes.push((tx, rx));
        }
        let info = pipes[0].0.info().await.expect("info");
        assert_eq!(info.transport, transport);
        assert_eq!(info.channels[0].name, channel);
        // Small and empty shared tensors too (cma sends small ones inline).
        let message = || {
            actorpipe::Message::new()
                .with_tensor(Tensor::shared(data.clone()))
                .with_tensor(Tensor::shared(data.slice(..100)))
                .with_tensor(Tensor::shared(Bytes::new()))
        };
        let writes: Vec<_> = pipes.iter().map(|(tx, _)| tx.write(message())).collect();
        for (_, rx) in &pipes {
            let got = within("receive", rx.receive()).await.expect("receive");
            assert_eq!(got.tensors[0].buffer.as_cpu(), Some(&data[..]), "{channel}");
            assert_eq!(got.tensors[1].buffer.as_cpu(), Some(&data[..100]));
            assert!(got.tensors[2].buffer.is_empty());
        }
        for w in writes {
            let done = within("write", w).await.expect("write");
            let back = done.message.tensors[0].buffer.as_shared().expect("shared");
            assert_eq!(back.as_ptr(), data.as_ptr(), "the same bytes, not a copy");
            assert_eq!(back.len(), data.len());
        }
        // A read needs memory it can write into.
        let (tx, rx) = &pipes[0];
        let w = tx.write(actorpipe::Message::new().with_tensor(Tensor::cpu(vec![1; 10])));
        let d = rx.read_descriptor().await.expect("descriptor");
        let mut alloc = Allocation::for_descriptor(&d).expect("alloc");
        alloc.tensors[0] = Buffer::Shared(Bytes::from(vec![0; 10]));
        let e = rx.read(alloc).await.expect_err("read into shared bytes");
        assert_eq!(e.kind(), ErrorClass::InvalidArgument, "{e}");
        assert!(e.to_string().contains("read-only"), "{e}");
        // The refused read did not consume the message.
        let mut alloc = Allocation::for_descriptor(&d).expect("alloc");
        alloc.tensors[0] = Buffer::Cpu(vec![0; 10]);
        let m = rx.read(alloc).await.expect("read");
        assert_eq!(m.tensors[0].buffer.as_cpu(), Some(&[1u8; 10][..]));
        w.await.expect("write");
    }
}

/// A free loopback port: bound, then let go.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

#[actix::test]
async fn connect_retries_a_transient_failure_until_the_listener_is_up() {
    let url = format!("tcp://127.0.0.1:{}", free_port());
    let client = actorpipe::Context::builder()
        .only_transports(&["tcp"])
        .start();
    // Once, nobody listens: a transient error, and the first is the result.
    let e = within("connect", client.connect(&url))
        .await
        .expect_err("nobody listens");
    assert!(e.kind().is_transient(), "{e}");
    // With a policy, the dial goes on until the listener comes up.
    let dial =
        client.connect(Connect::new(&url).retry(
            Retry::attempts(100).backoff(Duration::from_millis(20), Duration::from_millis(50)),
        ));
    let up = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let server = actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .start();
        let (accepted, incoming) = inbox::<Accepted>();
        let l = server
            .listen([url.as_str()], accepted)
            .await
            .expect("listen");
        (server, l, incoming)
    };
    let (pipe, _server) = within("retried connect", async { tokio::join!(dial, up) }).await;
    pipe.expect("connected once the listener was up");
}

#[actix::test]
async fn connect_does_not_retry_what_cannot_change() {
    let client = actorpipe::Context::builder().start();
    // A transport this context lacks: not transient, so the 10 s wait never happens.
    let started = std::time::Instant::now();
    let e =
        within(
            "connect",
            client.connect(Connect::new("nosuch://127.0.0.1:1").retry(
                Retry::attempts(3).backoff(Duration::from_secs(10), Duration::from_secs(10)),
            )),
        )
        .await
        .expect_err("no such transport");
    assert!(!e.kind().is_transient(), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "it waited to retry"
    );
}

#[actix::test]
async fn write_done_gives_the_same_buffers_back_on_failure() {
    let builder = || actorpipe::Context::builder().only_transports(&["tcp"]);
    let (tx, rx, _l) = pair(builder(), builder(), &[]).await;
    within("close", tx.close(Close::because("done")))
        .await
        .expect("close");
    drop(rx);
    let bytes = vec![7u8; 64 << 10];
    let at = bytes.as_ptr();
    let m = actorpipe::Message::new().with_tensor(Tensor::cpu(bytes));
    let done = within("write", tx.write_done(m))
        .await
        .expect("the pipe answers");
    assert!(done.result.is_err(), "a closed pipe refuses the write");
    let back = done.message.tensors[0].buffer.as_cpu().expect("host bytes");
    assert_eq!(back.as_ptr(), at, "the same allocation");
    assert!(back.iter().all(|&b| b == 7), "the same bytes");
}

#[actix::test]
async fn listen_with_takes_the_listeners_requirements() {
    let both = || actorpipe::Context::builder().only_transports(&["tcp"]);
    let server = both().start();
    let (accepted, _incoming) = inbox::<Accepted>();
    let l = within(
        "listen",
        server.listen_with(Listen::new(["tcp://127.0.0.1:0"], accepted).require(&["mpt"])),
    )
    .await
    .expect("listen");
    let client = both().without("mpt").start();
    let e = within("connect", client.connect(&l.urls[0]))
        .await
        .expect_err("the listener requires mpt");
    assert_eq!(e.kind(), ErrorClass::Unavailable, "{e}");
}
