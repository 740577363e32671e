//! Known traffic, then a real HTTP scrape of the Prometheus endpoint: the counters equal the
//! traffic. Its own test binary, because the exporter and its counters are process-wide.

mod common;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};

use actorpipe::*;
use common::*;

fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// The value of the sample `name{labels}` whose labels include every pair given.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[actix::test]
async fn counters_equal_the_traffic() {
    let addr = actorpipe::metrics::serve("127.0.0.1:0".parse().unwrap()).unwrap();
    assert!(addr.ip().is_loopback());
    let b = || tcp_basic();
    let (tx, rx, _s) = pair(b(), b()).await;
    const N: u64 = 10;
    for i in 0..N {
        let m = Message::new()
            .with_payload(Payload::new(vec![1; 100]))
            .with_tensor(Tensor::cpu(vec![i as u8; 1000]));
        let w = tx.send(Write::new(m));
        read_one(&rx).await.unwrap();
        w.await.unwrap().result.unwrap();
    }
    // One refused operation.
    let r = rx.send(Read::new(Allocation::default())).await.unwrap();
    assert!(r.result.is_err());

    let text = scrape(addr);
    let tb = [("transport", "tcp"), ("channel", "basic")];
    assert_eq!(
        value(&text, "actorpipe_messages_written_total", &tb),
        Some(N as f64)
    );
    assert_eq!(
        value(&text, "actorpipe_bytes_written_total", &tb),
        Some((N * 1100) as f64)
    );
    assert_eq!(
        value(&text, "actorpipe_messages_read_total", &tb),
        Some(N as f64)
    );
    assert_eq!(
        value(&text, "actorpipe_bytes_read_total", &tb),
        Some((N * 1100) as f64)
    );
    assert_eq!(value(&text, "actorpipe_pipes_opened_total", &tb), Some(2.0));
    assert_eq!(value(&text, "actorpipe_pipes_open", &[]), Some(2.0));
    assert_eq!(
        value(
            &text,
            "actorpipe_negotiations_total",
            &[("outcome", "ok"), ("channel", "basic")]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            &text,
            "actorpipe_operation_errors_total",
            &[("op", "read"), ("class", "invalid_argument")]
        ),
        Some(1.0)
    );
    // Real histogram buckets, not a summary: every write landed in some bucket.
    let writes = [("op", "write"), ("transport", "tcp"), ("le", "+Inf")];
    assert_eq!(
        value(&text, "actorpipe_operation_seconds_bucket", &writes),
        Some(N as f64)
    );
    let buckets = text
        .lines()
        .filter(|l| {
            l.starts_with("actorpipe_operation_seconds_bucket") && l.contains("op=\"write\"")
        })
        .count();
    assert_eq!(
        buckets,
        actorpipe::metrics::LATENCY_BUCKETS.len() + 1,
        "{text}"
    );
    assert_eq!(
        value(&text, "actorpipe_backlog_operations", &[("op", "write")]),
        Some(0.0)
    );
    // Labels stay bounded: no addresses or ids anywhere in the labels.
    assert!(!text.contains("127.0.0.1"), "no peer address in labels");

    tx.send(Close::because("done")).await.unwrap();
    let (to, mut closed) = inbox::<Closed>();
    rx.send(Subscribe(to)).await.unwrap();
    within(10, "Closed", closed.recv()).await.unwrap();
    let text = scrape(addr);
    assert_eq!(value(&text, "actorpipe_pipes_open", &[]), Some(0.0));
    assert_eq!(
        value(
            &text,
            "actorpipe_pipes_closed_total",
            &[("reason", "closed")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &text,
            "actorpipe_pipes_closed_total",
            &[("reason", "peer_closed")]
        ),
        Some(1.0)
    );
    // A refused handshake is counted by class.
    let c = Context::builder().start();
    let bad = c.send(Connect::new("tcp://127.0.0.1:1")).await.unwrap();
    assert!(bad.is_err());
    let text = scrape(addr);
    assert_eq!(
        value(
            &text,
            "actorpipe_negotiations_total",
            &[("outcome", "connect")]
        ),
        Some(1.0)
    );
    // Serving again at port 0 returns the running exporter; another address is refused.
    assert_eq!(
        actorpipe::metrics::serve("127.0.0.1:0".parse().unwrap()).unwrap(),
        addr
    );
    let other = SocketAddr::from(([127, 0, 0, 1], addr.port().wrapping_add(1)));
    assert!(actorpipe::metrics::serve(other).is_err());
}

#[cfg(feature = "efa")]
#[path = "common/efa.rs"]
#[allow(dead_code)]
mod efa_support;

/// An exchange on the `shm` provider (part of every libfabric build, as the `efa` feature's own
/// tests rely on): the endpoint counters scraped equal the endpoints' own, injects included.
#[cfg(feature = "efa")]
#[test]
fn efa_counters_equal_the_endpoints() {
    use actorpipe::internal::hardware::efa::FabricStats;
    use efa_support::*;
    let addr = actorpipe::metrics::serve("127.0.0.1:0".parse().unwrap()).unwrap();
    actix::System::new().block_on(async {
        let (a, b) = endpoints("shm", plain(false)).await;
        let (tx, rx) = pipe(&a, &b).await;
        exchange(tx.direct(), rx.direct(), 200, 16).await;
        let (sa, sb) = (
            a.send(FabricStats).await.unwrap(),
            b.send(FabricStats).await.unwrap(),
        );
        assert!(sa.injected > 0, "small sends were injected: {sa:?}");
        assert!(sa.injected < sa.posted, "large ones were not: {sa:?}");
        let text = scrape(addr);
        let shm = [("provider", "shm")];
        for (name, want) in [
            ("actorpipe_efa_posts_total", sa.posted + sb.posted),
            ("actorpipe_efa_injects_total", sa.injected + sb.injected),
            (
                "actorpipe_efa_completions_total",
                sa.completions + sb.completions,
            ),
            ("actorpipe_efa_errors_total", 0),
        ] {
            assert_eq!(
                value(&text, name, &shm),
                Some(want as f64),
                "{name}\n{text}"
            );
        }
    });
}

/// The backlog gauge of two endpoints at once, each with every post refused (fault injection):
/// one series each (labelled with the endpoint's transport instance, `endpoint`), each equal to
/// its own backlog as soon as a pass has seen it (no `FabricStats` asked: that publishes too),
/// back to 0 once the backlog drains, and at 0 once its pipe is detached. On `tcp;ofi_rxm`, so
/// that the shm counters of the test above count its endpoints alone.
#[cfg(feature = "faults")]
#[test]
fn efa_backlog_gauge_is_per_endpoint() {
    use actorpipe::internal::backend::efa::engine::{Kind, Op};
    use actorpipe::internal::backend::efa::faults::Faults;
    use actorpipe::internal::backend::efa::tag::{self, Stream};
    use actorpipe::internal::hardware::efa::{
        FabricDescribe, FabricDetach, FabricFaults, FabricPost,
    };
    use efa_support::*;
    const PROVIDER: &str = "tcp;ofi_rxm";
    if let Some(why) = missing(PROVIDER) {
        eprintln!("{why}");
        return;
    }
    let addr = actorpipe::metrics::serve("127.0.0.1:0".parse().unwrap()).unwrap();
    actix::System::new().block_on(async {
        let refuse = Faults {
            eagain: 1.0,
            cq_error: 0.0,
            seed: 5,
        };
        let (a, b) = endpoints(PROVIDER, config(refuse, false)).await;
        let (sa, sb) = pipe(&a, &b).await;
        let ia = a.send(FabricDescribe).await.unwrap().instance.to_string();
        let ib = b.send(FabricDescribe).await.unwrap().instance.to_string();
        assert_ne!(ia, ib);
        let gauges = || {
            let text = scrape(addr);
            let of = |i: &str| {
                let labels = [("provider", PROVIDER), ("endpoint", i)];
                value(&text, "actorpipe_efa_backlog_operations", &labels)
            };
            (of(&ia), of(&ib))
        };
        let wait_for = |want: (Option<f64>, Option<f64>), what: &'static str| {
            let gauges = &gauges;
            async move {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                loop {
                    let now = gauges();
                    if now == want {
                        return;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{what}: {now:?}, not {want:?}"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        };
        // Receives, every one refused: `a` backlogs 3, `b` 7.
        let recvs = |side: &Side, n: u64| FabricPost {
            pipe: side.pipe,
            ops: (0..n)
                .map(|i| Op {
                    kind: Kind::Recv,
                    tag: tag::make(Stream::Raw, side.pipe, i as u32),
                    mem: vec![0; 64],
                    id: i,
                })
                .collect(),
        };
        a.send(recvs(&sa, 3)).await.unwrap();
        b.send(recvs(&sb, 7)).await.unwrap();
        wait_for((Some(3.0), Some(7.0)), "both backlogs").await;
        // `a`'s retries go through: its gauge follows, `b`'s stays.
        a.send(FabricFaults(Faults::NONE)).await.unwrap();
        wait_for((Some(0.0), Some(7.0)), "a drained").await;
        // Detaching `b`'s pipe ends its backlogged receives.
        b.send(FabricDetach {
            pipe: sb.pipe,
            reason: "done".into(),
        })
        .await
        .unwrap();
        wait_for((Some(0.0), Some(0.0)), "b detached").await;
    });
}

/// Remote operations on the in-process path: the counters scraped equal the operations made
/// (nextest runs each test of this binary in a process of its own).
#[actix::test]
async fn remote_counters_equal_the_operations() {
    use actorpipe::remote::{RemoteRead, RemoteWrite, Span};
    let addr = actorpipe::metrics::serve("127.0.0.1:0".parse().unwrap()).unwrap();
    let b = || {
        Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["xth", "basic"])
    };
    let mut s = Server::start(b(), "tcp://127.0.0.1:0").await;
    let (pipe, _rx) = s.dial(&b().start()).await;
    let region = s.ctx.register(Buffer::Cpu(vec![0; 1 << 20])).await.unwrap();
    let d = region.descriptor().clone();
    let (to, _notes) = inbox::<actorpipe::remote::Notification>();
    s.ctx
        .send(actorpipe::remote::SubscribeNotifications(to))
        .await
        .unwrap();
    for i in 0..5u64 {
        let span = vec![Span::new(i * 4096, 0, 4096)];
        pipe.remote_write(RemoteWrite::new(&d, span.clone(), vec![1; 4096]).notify_owner(*b"w"))
            .await
            .unwrap();
        pipe.remote_read(RemoteRead::new(&d, span, vec![0; 4096]))
            .await
            .unwrap();
    }
    // One refused: past the region's end.
    let bad = pipe
        .send(RemoteRead::new(
            &d,
            vec![Span::new(1 << 20, 0, 1)],
            vec![0; 1],
        ))
        .await
        .unwrap();
    assert!(bad.result.is_err());
    let text = scrape(addr);
    let at = |op, outcome| {
        value(
            &text,
            "actorpipe_remote_operations_total",
            &[("op", op), ("path", "xth"), ("outcome", outcome)],
        )
    };
    assert_eq!(at("remote_write", "ok"), Some(5.0), "{text}");
    // Per peer: the peer's address without its port (one series per peer, not per connection).
    let peer = pipe.info().await.unwrap().peer;
    let host = peer.rsplit_once(':').map_or(peer.as_str(), |(h, _)| h);
    assert!(host.starts_with("tcp://127.0.0.1"), "{peer}");
    assert_eq!(
        value(
            &text,
            "actorpipe_remote_operations_total",
            &[
                ("op", "remote_write"),
                ("path", "xth"),
                ("peer", host),
                ("outcome", "ok")
            ],
        ),
        Some(5.0),
        "{text}"
    );
    assert_eq!(at("remote_read", "ok"), Some(5.0));
    assert_eq!(
        value(
            &text,
            "actorpipe_remote_operations_total",
            &[
                ("op", "remote_read"),
                ("path", "xth"),
                ("outcome", "invalid_argument")
            ],
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &text,
            "actorpipe_remote_bytes_total",
            &[("op", "remote_write"), ("path", "xth")],
        ),
        Some(5.0 * 4096.0)
    );
    assert_eq!(value(&text, "actorpipe_remote_regions", &[]), Some(1.0));
    assert_eq!(
        value(&text, "actorpipe_remote_notifications_total", &[]),
        Some(5.0)
    );
    drop(region);
    let text = scrape(addr);
    assert_eq!(value(&text, "actorpipe_remote_regions", &[]), Some(0.0));
}
