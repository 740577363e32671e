//! Bad input from raw sockets: refused connections, garbage, truncated, oversized and
//! wrong-version frames, and garbage after a valid handshake. Each gets a clear error; the
//! listener keeps serving other pipes; nothing panics or hangs.

use std::time::Duration;

use actorpipe::internal::backend::tcp::into_stream;
use actorpipe::internal::handshake;
use actorpipe::internal::negotiate::{Brochure, ChannelOffer, DevicePair, Offer};
use actorpipe::internal::wire::{self, encode_frame, FrameKind, Preamble, MAGIC};
use actorpipe::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;

fn brochure() -> Brochure {
    Brochure {
        transports: vec![Offer {
            name: "tcp".into(),
            priority: 0,
            domain: String::new(),
            addresses: vec![],
        }],
        channels: vec![ChannelOffer {
            name: "basic".into(),
            priority: 0,
            domain: String::new(),
            devices: DevicePair::CPU,
            connections: 0,
        }],
        remote: false,
    }
}

/// After each bad client, a good one still gets a working pipe.
async fn still_serves(server: &mut Server) {
    let c = Context::builder().start();
    let (tx, rx) = server.dial(&c).await;
    let m = checked_message(3, &[5], &[7]);
    let w = tx.send(Write::new(m));
    assert_eq!(verify(&read_one(&rx).await.unwrap()), 3);
    w.await.unwrap().result.unwrap();
}

fn fast_server() -> ContextBuilder {
    Context::builder().handshake_timeout(Duration::from_millis(300))
}

#[actix::test]
async fn connection_refused_fails_at_once_with_a_clear_error() {
    // A socket bound and never listening: a connect to its port is refused, and, unlike a
    // listener bound and dropped, no other process can take the port meanwhile (under a loaded
    // machine's parallel test runs one did: this connect reached a stranger's listener).
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    let c = Context::builder().start();
    let url = format!("tcp://127.0.0.1:{port}");
    let r = within(5, "refused connect", c.send(Connect::new(&url)))
        .await
        .unwrap();
    match r {
        Err(Error::Connect { url: u, source }) => {
            assert_eq!(u, url);
            assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
        }
        other => panic!("expected Connect error, got {other:?}"),
    }
    // A URL that does not parse is an invalid argument, not a hang.
    let r = c.send(Connect::new("tcp//nope")).await.unwrap();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })));
    let r = c.send(Connect::new("ib://127.0.0.1:1")).await.unwrap();
    assert!(matches!(r, Err(Error::Unavailable { .. })));
    drop(held);
}

#[actix::test]
async fn garbage_truncated_oversized_and_silent_clients_are_refused() {
    let mut server = Server::start(fast_server(), "tcp://127.0.0.1:0").await;
    let addr = server.url.trim_start_matches("tcp://").to_string();

    // Garbage: an HTTP request.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut sink = Vec::new();
    // The listener drops us: reading ends (its preamble + hello first, then EOF).
    within(5, "garbage refused", s.read_to_end(&mut sink))
        .await
        .ok();
    still_serves(&mut server).await;

    // Truncated: a valid preamble, then half a frame, then hang up.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&Preamble::OURS.encode()).await.unwrap();
    s.write_all(&[100, 0, 0, 0, 1, 0x92]).await.unwrap();
    drop(s);
    still_serves(&mut server).await;

    // Oversized: a frame announcing 4 GiB.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&Preamble::OURS.encode()).await.unwrap();
    s.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    within(5, "oversized refused", s.read_to_end(&mut sink))
        .await
        .ok();
    still_serves(&mut server).await;

    // Silent: connects and says nothing; the handshake deadline frees the listener.
    let silent = TcpStream::connect(&addr).await.unwrap();
    still_serves(&mut server).await;
    let mut silent = silent;
    let r = within(5, "silent client dropped", silent.read_to_end(&mut sink)).await;
    assert!(r.is_ok(), "the listener hangs up on a silent client");
}

#[actix::test]
async fn wrong_version_is_refused_on_both_sides() {
    // A client speaking v2 to our listener.
    let mut server = Server::start(fast_server(), "tcp://127.0.0.1:0").await;
    let addr = server.url.trim_start_matches("tcp://").to_string();
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&Preamble { version: 2 }.encode())
        .await
        .unwrap();
    let mut back = Vec::new();
    within(5, "v2 client refused", s.read_to_end(&mut back))
        .await
        .ok();
    assert_eq!(
        &back[..8],
        &MAGIC,
        "the listener announced itself before hanging up"
    );
    still_serves(&mut server).await;

    // A v2 listener answering our connect: the error names both versions.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("tcp://{}", l.local_addr().unwrap());
    let fake = async {
        let (mut s, _) = l.accept().await.unwrap();
        s.write_all(&Preamble { version: 2 }.encode())
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf).await;
        s
    };
    let c = Context::builder().start();
    let (r, _s) = tokio::join!(within(5, "v2 server", c.send(Connect::new(&url))), fake);
    match r.unwrap() {
        Err(Error::Version {
            ours: 1, theirs: 2, ..
        }) => {}
        other => panic!("expected a version error, got {other:?}"),
    }
}

#[actix::test]
async fn oversized_frame_from_a_server_is_a_limit_error() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("tcp://{}", l.local_addr().unwrap());
    let fake = async {
        let (mut s, _) = l.accept().await.unwrap();
        s.write_all(&Preamble::OURS.encode()).await.unwrap();
        s.write_all(&(1u32 << 30).to_le_bytes()).await.unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf).await;
        s
    };
    let c = Context::builder().start();
    let (r, _s) = tokio::join!(
        within(5, "oversized server", c.send(Connect::new(&url))),
        fake
    );
    match r.unwrap() {
        Err(Error::LimitExceeded {
            limit: "frame size",
            value,
            ..
        }) => assert_eq!(value, 1 << 30),
        other => panic!("expected a frame size limit error, got {other:?}"),
    }
}

/// A peer that completes the handshake and then sends a frame that is not a descriptor, a
/// descriptor that does not decode, or one over the limits: the accepted pipe closes with a
/// protocol or limit error delivered to its pending read, and the listener keeps serving.
#[actix::test]
async fn garbage_after_the_handshake_closes_only_that_pipe() {
    let limits = Limits {
        max_tensors: 16,
        ..Limits::default()
    };
    let mut server = Server::start(fast_server().limits(limits), "tcp://127.0.0.1:0").await;
    let addr = server.url.trim_start_matches("tcp://").to_string();

    let frames: Vec<(Vec<u8>, &str)> = vec![
        // A chunk header where a descriptor belongs.
        (
            {
                let mut b = Vec::new();
                encode_frame(&mut b, FrameKind::Chunk, |b| b.extend([0x94, 0, 0, 0, 1]));
                b
            },
            "protocol",
        ),
        // An unknown frame kind.
        (vec![3, 0, 0, 0, 77, 1, 2], "protocol"),
        // A descriptor body that is not MessagePack.
        (
            {
                let mut b = Vec::new();
                encode_frame(&mut b, FrameKind::Descriptor, |b| b.extend([0xff; 9]));
                b
            },
            "protocol",
        ),
        // A descriptor announcing a million tensors.
        (
            {
                let mut b = Vec::new();
                encode_frame(&mut b, FrameKind::Descriptor, |b| {
                    b.extend([0x94, 0, 0xc4, 0, 0x90, 0xdd]);
                    b.extend(1_000_000u32.to_be_bytes());
                });
                b
            },
            "limit",
        ),
        // A good descriptor with an 8-byte tensor, read together with its chunks, but the
        // chunk that follows names another tensor.
        (
            {
                let m = Message::new().with_tensor(Tensor::cpu(vec![1; 8]));
                let mut b = Vec::new();
                encode_frame(&mut b, FrameKind::Descriptor, |b| {
                    wire::encode_descriptor(b, 0, &m, |_, _| 0)
                });
                let h = wire::ChunkHeader {
                    seq: 0,
                    tensor: 1,
                    offset: 0,
                    length: 8,
                };
                encode_frame(&mut b, FrameKind::Chunk, |b| wire::encode_chunk(b, &h));
                b.extend([1; 8]);
                b
            },
            "protocol",
        ),
        // A descriptor with the wrong sequence number.
        (
            {
                let mut b = Vec::new();
                encode_frame(&mut b, FrameKind::Descriptor, |b| {
                    b.extend([0x94, 5, 0xc4, 0, 0x90, 0x90])
                });
                b
            },
            "protocol",
        ),
    ];
    for (frame, class) in frames {
        let s = into_stream(TcpStream::connect(&addr).await.unwrap()).unwrap();
        let mut hs = within(
            5,
            "raw handshake",
            handshake::connect(
                s,
                &brochure(),
                None,
                &Limits::default(),
                Duration::from_secs(5),
            ),
        )
        .await
        .expect("handshake");
        // No joins: the listener confirms the pipe at once.
        handshake::accepted(&mut hs.halves, &Limits::default(), Duration::from_secs(5))
            .await
            .expect("confirmed");
        let pipe = server.next().await;
        hs.halves.write.write_all(&frame).await.unwrap();
        let d = within(5, "pending read fails", pipe.send(ReadDescriptor))
            .await
            .unwrap();
        let e = d.descriptor.expect_err("garbage is refused");
        assert_eq!(e.class(), class, "{e}");
        // The bad peer is told why before the connection goes.
        let mut back = Vec::new();
        let _ = within(5, "hang up", hs.halves.read.read_to_end(&mut back)).await;
        assert!(
            back.len() > 5 && back[4] == FrameKind::Close as u8,
            "close frame sent"
        );
        still_serves(&mut server).await;
    }
}

/// A peer whose mpt tensor's channel data is not the tensor's length (the lanes' only check on
/// what the descriptor says they will carry): the read fails with a protocol error naming the
/// channel, and nothing waits for bytes the lanes will never bring.
#[actix::test]
async fn mpt_channel_data_that_is_not_the_length_fails_the_read() {
    let server_side = fast_server()
        .without("shm")
        .only_channels(&["mpt"])
        .lanes(1);
    let mut server = Server::start(server_side, "tcp://127.0.0.1:0").await;
    let addr = server.url.trim_start_matches("tcp://").to_string();
    let mut ours = brochure();
    ours.channels = vec![ChannelOffer {
        name: "mpt".into(),
        priority: 10,
        domain: String::new(),
        devices: DevicePair::CPU,
        connections: 1,
    }];
    let s = into_stream(TcpStream::connect(&addr).await.unwrap()).unwrap();
    let t = Duration::from_secs(5);
    let mut hs = within(
        5,
        "raw handshake",
        handshake::connect(s, &ours, None, &Limits::default(), t),
    )
    .await
    .expect("handshake");
    assert_eq!(hs.choice.channels[0].name, "mpt", "{:?}", hs.choice);
    // The one lane joins; then the listener confirms the pipe.
    let lane = into_stream(TcpStream::connect(&addr).await.unwrap()).unwrap();
    let purpose = actorpipe::internal::negotiate::Purpose::Channel {
        channel: 0,
        lane: 0,
    };
    let _lane = within(
        5,
        "join",
        handshake::join(
            lane,
            (&hs.listener_nonce, hs.choice.token),
            purpose,
            None,
            t,
        ),
    )
    .await
    .expect("join");
    within(
        5,
        "confirmed",
        handshake::accepted(&mut hs.halves, &Limits::default(), t),
    )
    .await
    .expect("confirmed");
    let pipe = server.next().await;
    // An 8-byte tensor (too small for a lane by default, but a sender decides) whose channel
    // data claims 9 bytes.
    let m = Message::new().with_tensor(Tensor::cpu(vec![1; 8]));
    let mut b = Vec::new();
    encode_frame(&mut b, FrameKind::Descriptor, |b| {
        wire::encode_descriptor(b, 0, &m, |_, data| {
            data.set(&9u64.to_le_bytes());
            0
        })
    });
    hs.halves.write.write_all(&b).await.unwrap();
    let d = within(5, "descriptor", pipe.send(ReadDescriptor))
        .await
        .unwrap()
        .descriptor
        .expect("the descriptor itself is well formed");
    let done = within(
        5,
        "the read fails",
        pipe.send(Read::new(Allocation::for_descriptor(&d).unwrap())),
    )
    .await
    .unwrap();
    let e = done.result.expect_err("wrong channel data is refused");
    assert_eq!(e.class(), "protocol", "{e}");
    assert!(e.to_string().contains("mpt channel data"), "{e}");
}
