//! End-to-end tests of the shm transport over real memfds, eventfds and sockets, in one process.
//! Cross-process behaviour is approximated with two runtimes on two threads, and a crash with
//! halves dropped "silently" (socket closed, ring flags untouched).

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::halves::{ShmRead, ShmWrite};
use super::*;

const LIMIT: Duration = Duration::from_secs(30);

/// Fails the test instead of hanging.
async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f).await.expect("the test hung")
}

/// A connected (client, server) pair of streams.
async fn pair(shm: &Shm) -> (Stream, Stream) {
    let mut acc = shm.listen_name(None).await.unwrap();
    let name = parse_url(&acc.urls()[0]).unwrap().unwrap();
    let (c, s) = tokio::join!(shm.connect_name(&name, LIMIT), acc.accept());
    (c.unwrap(), s.unwrap())
}

type Halves = (ShmRead, ShmWrite);

/// Like [`pair`], with the concrete halves (for the crash hooks).
async fn raw_pair(shm: &Shm) -> (Halves, Halves) {
    let mut acc = shm.listen_name(None).await.unwrap();
    let name = parse_url(&acc.urls()[0]).unwrap().unwrap();
    let (c, s) = tokio::join!(shm.connect_halves(&name, LIMIT), acc.next());
    (c.unwrap(), s.unwrap())
}

fn byte_at(pos: usize) -> u8 {
    (pos % 251) as u8
}

/// Writes `total` bytes of the test pattern in pieces of `piece`.
async fn send_pattern(w: &mut (impl AsyncWriteExt + Unpin), total: usize, piece: usize) {
    let source: Vec<u8> = (0..piece + 251).map(byte_at).collect();
    let mut sent = 0;
    while sent < total {
        let n = piece.min(total - sent);
        let at = sent % 251;
        w.write_all(&source[at..at + n]).await.unwrap();
        sent += n;
    }
}

/// Reads exactly `total` bytes and checks them against the pattern.
async fn check_pattern(r: &mut (impl AsyncReadExt + Unpin), total: usize) {
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0;
    while got < total {
        let want = buf.len().min(total - got);
        let n = r.read(&mut buf[..want]).await.unwrap();
        assert!(n > 0, "end of stream after {got} of {total} bytes");
        for (i, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, byte_at(got + i), "byte {}", got + i);
        }
        got += n;
    }
}

#[tokio::test]
async fn small_and_large_messages_round_trip() {
    bounded(async {
        let shm = Shm::new().with_capacity(64 << 10);
        let (mut c, mut s) = pair(&shm).await;
        c.write.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        s.read.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hello");

        let total = 64 << 20;
        let start = Instant::now();
        tokio::join!(
            send_pattern(&mut c.write, total, 4 << 20),
            check_pattern(&mut s.read, total)
        );
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "shm: 64 MiB through a 64 KiB ring, one thread, content checked: {:.3} s ({:.2} GiB/s)",
            secs,
            total as f64 / secs / (1u64 << 30) as f64
        );
    })
    .await
}

#[tokio::test]
async fn both_directions_at_once() {
    bounded(async {
        let shm = Shm::new().with_capacity(16 << 10);
        let (c, s) = pair(&shm).await;
        let (mut cr, mut cw, mut sr, mut sw) = (c.read, c.write, s.read, s.write);
        let total = 8 << 20;
        tokio::join!(
            send_pattern(&mut cw, total, 100_000),
            send_pattern(&mut sw, total, 7_000),
            check_pattern(&mut sr, total),
            check_pattern(&mut cr, total),
        );
    })
    .await
}

#[tokio::test]
async fn dropping_or_shutting_down_the_writer_ends_the_stream() {
    bounded(async {
        let (mut c, mut s) = pair(&Shm::new()).await;
        c.write.write_all(&[7u8; 100]).await.unwrap();
        drop(c.write);
        let mut got = Vec::new();
        s.read.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, vec![7u8; 100]);

        s.write.write_all(b"bye").await.unwrap();
        s.write.shutdown().await.unwrap();
        let e = s.write.write_all(b"more").await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
        let mut got = Vec::new();
        c.read.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
    })
    .await
}

#[tokio::test]
async fn a_dropped_peer_ends_reads_and_breaks_writes() {
    bounded(async {
        let (c, mut s) = pair(&Shm::new().with_capacity(4096)).await;
        // A read parked before the peer goes away wakes up with end of stream.
        let dropper = async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(c);
        };
        let mut b = [0u8; 16];
        let (n, ()) = tokio::join!(s.read.read(&mut b), dropper);
        assert_eq!(n.unwrap(), 0);
        let e = s.write.write_all(&[1u8; 10]).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
    })
    .await
}

#[tokio::test]
async fn a_crashed_peer_is_noticed_through_the_socket() {
    bounded(async {
        let shm = Shm::new().with_capacity(4096);
        // Data sent before the crash is still delivered, then end of stream.
        let ((mut cr, mut cw), (mut sr, _sw)) = raw_pair(&shm).await;
        cw.write_all(b"last words").await.unwrap();
        cr.silent = true;
        cw.silent = true;
        drop((cr, cw));
        let mut got = Vec::new();
        sr.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last words");

        // A writer parked on a full ring gets BrokenPipe; a parked reader gets end of stream.
        let ((mut cr, mut cw), (mut sr, mut sw)) = raw_pair(&shm).await;
        cr.silent = true;
        cw.silent = true;
        let crash = async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop((cr, cw));
        };
        let mut b = [0u8; 8];
        let (w, r, ()) = tokio::join!(sw.write_all(&[0u8; 64 << 10]), sr.read(&mut b), crash);
        assert_eq!(w.unwrap_err().kind(), std::io::ErrorKind::BrokenPipe);
        assert_eq!(r.unwrap(), 0);
    })
    .await
}

/// The hang-up watch wakes the task that waits now, not one that waited on the half before.
#[tokio::test]
async fn a_crash_wakes_the_task_waiting_now() {
    bounded(async {
        let ((mut cr, mut cw), (mut sr, _sw)) = raw_pair(&Shm::new()).await;
        cr.silent = true;
        cw.silent = true;
        let mut b = [0u8; 8];
        // A first wait, from this task, given up.
        let first = tokio::time::timeout(Duration::from_millis(20), sr.read(&mut b)).await;
        assert!(first.is_err(), "nothing to read yet");
        // A second, from another task, is the one the crash must wake.
        let second = tokio::spawn(async move {
            let mut b = [0u8; 8];
            sr.read(&mut b).await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop((cr, cw));
        assert_eq!(second.await.unwrap().unwrap(), 0, "end of stream");
    })
    .await
}

/// The shared framing code on top: a frame goes through, then the peer leaving is reported as
/// `PeerClosed` on both the read and the write side.
#[tokio::test]
async fn the_shared_frame_reader_sees_peer_closed() {
    use crate::transport::stream::{io_error, read_frame};
    use crate::wire::{encode_serde, Frame, FrameKind, Limits};
    bounded(async {
        let (mut c, mut s) = pair(&Shm::new().with_capacity(4096)).await;
        let mut frame = Vec::new();
        let bye = crate::wire::Farewell {
            reason: "x".repeat(10_000),
            graceful: false,
        };
        encode_serde(&mut frame, FrameKind::Close, &bye);
        let origin = Origin::new("shm://test", "shm");
        // Frames are read through a buffer, as a connection reads them.
        let mut r = tokio::io::BufReader::new(&mut s.read);
        let (limits, mut buf) = (Limits::default(), Vec::new());
        let (w, f) = tokio::join!(
            c.write.write_all(&frame),
            read_frame(&mut r, &mut buf, &limits, &origin)
        );
        w.unwrap();
        assert_eq!(f.unwrap(), Frame::Close(bye));
        drop(c);
        let e = read_frame(&mut r, &mut buf, &limits, &origin)
            .await
            .unwrap_err();
        assert_eq!(e.class(), "peer_closed", "{e}");
        let e = s.write.write_all(&frame).await.unwrap_err();
        assert_eq!(io_error("writing", e, &origin).class(), "peer_closed");
    })
    .await
}

#[tokio::test]
async fn spin_mode_moves_the_same_bytes() {
    bounded(async {
        let shm = Shm::new()
            .with_capacity(8192)
            .with_spin(Duration::from_micros(20));
        assert_eq!(shm.spin(), Some(Duration::from_micros(20)));
        let (mut c, mut s) = pair(&shm).await;
        let total = 4 << 20;
        tokio::join!(
            send_pattern(&mut c.write, total, 50_000),
            check_pattern(&mut s.read, total)
        );
        drop(c);
        let mut b = [0u8; 1];
        assert_eq!(s.read.read(&mut b).await.unwrap(), 0);
    })
    .await
}

/// A spinning read must not hold the thread: the task that writes what it waits for runs on the
/// same single thread, between its polls. With a spin of 10 s that held the thread, the read
/// would take 10 s (the writer could only run once the read parked).
#[test]
fn a_spinning_read_gives_way_to_other_tasks_on_its_thread() {
    let spin = Duration::from_secs(10);
    runtime().block_on(bounded(async {
        let shm = Shm::new().with_spin(spin);
        let (mut c, mut s) = pair(&shm).await;
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async move {
                let start = Instant::now();
                let reader = tokio::task::spawn_local(async move {
                    let mut b = [0u8; 3];
                    s.read.read_exact(&mut b).await.unwrap();
                    b
                });
                // Let the reader start spinning first.
                tokio::task::yield_now().await;
                let writer = tokio::task::spawn_local(async move {
                    c.write.write_all(b"abc").await.unwrap();
                    c
                });
                assert_eq!(&reader.await.unwrap(), b"abc");
                let took = start.elapsed();
                assert!(took < spin / 4, "the read took {took:?}");
                drop(writer.await.unwrap());
            })
            .await;
    }))
}

/// The read loop asks `halves::spins` whether to give way after each message: yes for a
/// spinning shm half only, through the boxed trait object the loop holds.
#[test]
fn only_a_spinning_shm_half_spins() {
    runtime().block_on(bounded(async {
        let (_c, s) = pair(&Shm::new().with_spin(Duration::from_micros(20))).await;
        assert!(super::halves::spins(&*s.read));
        let (_c, s) = pair(&Shm::new()).await;
        assert!(!super::halves::spins(&*s.read));
        let other: crate::transport::BoxRead = Box::new(tokio::io::empty());
        assert!(!super::halves::spins(&*other));
    }))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `server` on an accepted stream and `client` on a connected one, each on its own runtime
/// and thread, as two processes would; returns what the client returns.
fn across_threads<T, FS, FC>(
    shm: Shm,
    server: impl FnOnce(Stream) -> FS + Send + 'static,
    client: impl FnOnce(Stream) -> FC,
) -> T
where
    FS: Future<Output = ()>,
    FC: Future<Output = T>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    let server_shm = shm.clone();
    let server = std::thread::spawn(move || {
        runtime().block_on(bounded(async move {
            let mut acc = server_shm.listen_name(None).await.unwrap();
            tx.send(acc.urls()[0].clone()).unwrap();
            server(acc.accept().await.unwrap()).await
        }))
    });
    let url = rx.recv().unwrap();
    let out = runtime().block_on(bounded(async {
        client(shm.connect_url(&url, LIMIT).await.unwrap()).await
    }));
    server.join().unwrap();
    out
}

/// Echoes 64-byte messages until end of stream.
async fn echo(mut s: Stream) {
    let mut b = [0u8; 64];
    while s.read.read_exact(&mut b).await.is_ok() {
        s.write.write_all(&b).await.unwrap();
    }
}

/// Sends `rounds` 64-byte messages one at a time, each waiting for its echo; the mean round trip.
async fn ping(mut c: Stream, rounds: u32) -> Duration {
    let mut b = [5u8; 64];
    let start = Instant::now();
    for i in 0..rounds {
        b[0] = i as u8;
        c.write.write_all(&b).await.unwrap();
        c.read.read_exact(&mut b).await.unwrap();
        assert_eq!(b[0], i as u8);
    }
    start.elapsed() / rounds
}

#[test]
fn ping_pong_between_two_runtimes() {
    for shm in [Shm::new(), Shm::new().with_spin(Duration::from_micros(20))] {
        let spin = shm.spin();
        let rtt = across_threads(shm, echo, |c| ping(c, 500));
        eprintln!("shm ping-pong, spin {spin:?}: {rtt:?} per round trip");
    }
}

/// Throughput and latency between two threads (`cargo test --release --lib
/// transport::shm::tests::measure -- --ignored --nocapture`). Needs two idle cores to mean
/// anything, spin mode especially.
#[test]
#[ignore]
fn measure() {
    for capacity in [64 << 10, 2 << 20] {
        let total: usize = 4 << 30;
        let shm = Shm::new().with_capacity(capacity);
        let secs = across_threads(
            shm,
            move |mut s| async move {
                let buf = vec![1u8; 1 << 20];
                let mut sent = 0;
                while sent < total {
                    s.write.write_all(&buf).await.unwrap();
                    sent += buf.len();
                }
            },
            move |mut c| async move {
                let mut buf = vec![0u8; 1 << 20];
                let start = Instant::now();
                let mut got = 0;
                while got < total {
                    got += c.read.read(&mut buf).await.unwrap();
                }
                start.elapsed().as_secs_f64()
            },
        );
        eprintln!(
            "shm stream, {} KiB ring, 1 MiB writes and reads: {:.2} GiB/s",
            capacity >> 10,
            total as f64 / secs / (1u64 << 30) as f64
        );
    }
    for spin in [None, Some(Duration::from_micros(20))] {
        let shm = match spin {
            Some(d) => Shm::new().with_spin(d),
            None => Shm::new(),
        };
        let rtt = across_threads(shm, echo, |c| ping(c, 20_000));
        eprintln!("shm ping-pong of 64 bytes, spin {spin:?}: {rtt:?} per round trip");
    }
}

#[test]
fn the_domain_is_boot_id_namespaces_and_uid() {
    let d = domain();
    let parts: Vec<&str> = d.split(':').collect();
    assert_eq!(parts.len(), 4, "{d}");
    assert_eq!(parts[0].len(), 36, "boot id in {d}");
    assert!(parts[1].parse::<u64>().unwrap() > 0, "ipc namespace in {d}");
    assert!(parts[2].parse::<u64>().unwrap() > 0, "net namespace in {d}");
    assert_eq!(parts[3].parse::<u32>().unwrap(), fd::uid(), "{d}");
    assert_eq!(Shm::new().domain(), d);
    assert_eq!(Shm::new().name(), "shm");
    assert_eq!(Shm::new().priority(), 100);
}

#[test]
fn urls_and_names() {
    assert_eq!(
        parse_url("shm://w0.rank-3_a").unwrap().as_deref(),
        Some("w0.rank-3_a")
    );
    assert_eq!(parse_url("shm://").unwrap(), None);
    assert_eq!(parse_url("shm://auto").unwrap(), None);
    for bad in [
        "tcp://a:1",
        "shm:/x",
        "shm://a b",
        "shm://a/b",
        "shm://a:0",
        "shm://é",
    ] {
        assert_eq!(
            parse_url(bad).unwrap_err().class(),
            "invalid_argument",
            "{bad}"
        );
    }
    assert!(parse_url(&format!("shm://{}", "n".repeat(65))).is_err());
    assert!(parse_url(&format!("shm://{}", "n".repeat(64))).is_ok());

    assert_eq!(Shm::new().capacity(), 2 << 20);
    assert_eq!(Shm::new().with_capacity(1000).capacity(), 4096);
    assert_eq!(Shm::new().with_capacity(3 << 20).capacity(), 4 << 20);
    assert_eq!(Shm::new().with_capacity(usize::MAX).capacity(), 1 << 30);
}

#[tokio::test]
async fn the_transport_trait_takes_name_urls() {
    bounded(async {
        let shm = Shm::new();
        let t: &dyn Transport = &shm;
        let mut acc = t.listen("shm://auto").await.unwrap();
        let url = acc.urls()[0].clone();
        assert!(
            url.starts_with(&format!("shm://{}-", std::process::id())),
            "{url}"
        );
        let (c, s) = tokio::join!(t.connect(&url, LIMIT), acc.accept());
        let (mut c, mut s) = (c.unwrap(), s.unwrap());
        assert_eq!(c.peer, url);
        c.write.write_all(b"via the trait").await.unwrap();
        let mut b = [0u8; 13];
        s.read.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"via the trait");

        for bad in ["shm://127.0.0.1:0", "shm://name:5", "tcp://x:1"] {
            let e = t.connect(bad, LIMIT).await.unwrap_err();
            assert_eq!(e.class(), "invalid_argument", "{bad}: {e}");
        }
    })
    .await
}

#[tokio::test]
async fn names_are_exclusive_and_missing_ones_fail_clearly() {
    bounded(async {
        let shm = Shm::new();
        let name = format!("test-{}-exclusive", std::process::id());
        let _first = shm.listen_name(Some(&name)).await.unwrap();
        let e = shm.listen_name(Some(&name)).await.unwrap_err().to_string();
        assert!(e.contains("taken"), "{e}");
        let e = shm
            .connect_name(&format!("test-{}-nobody", std::process::id()), LIMIT)
            .await
            .unwrap_err();
        assert_eq!(e.class(), "connect");
        assert!(e.to_string().contains("no shm listener"), "{e}");
    })
    .await
}

#[tokio::test]
async fn broken_clients_do_not_stop_the_listener() {
    bounded(async {
        let shm = Shm::new();
        let mut acc = shm.listen_name(None).await.unwrap();
        let name = parse_url(&acc.urls()[0]).unwrap().unwrap();
        let sock = socket_name(&name);
        // One client sends garbage, one sends nothing at all.
        let garbage = fd::connect_abstract(&sock).unwrap();
        let junk = [0xAAu8; 64];
        // SAFETY: writes 64 bytes from a valid buffer to a socket we own.
        let n = unsafe { libc::write(garbage.as_raw_fd(), junk.as_ptr().cast(), junk.len()) };
        assert_eq!(n, 64);
        let _silent = fd::connect_abstract(&sock).unwrap();
        let (c, s) = tokio::join!(shm.connect_name(&name, LIMIT), acc.accept());
        let (mut c, mut s) = (c.unwrap(), s.unwrap());
        c.write.write_all(b"ok").await.unwrap();
        let mut b = [0u8; 2];
        s.read.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ok");
    })
    .await
}

use std::os::fd::AsRawFd;

#[test]
fn halves_are_send() {
    fn send<T: Send + Unpin>() {}
    send::<ShmRead>();
    send::<ShmWrite>();
    send::<ShmAcceptor>();
}
