//! Remote memory (docs/remote.md): registered regions, one-sided reads and writes on a pipe to
//! the owner, notifications, deregistration. One suite of cases, run on every path
//! ([`remote_suite!`]): `xth` (two contexts of this process, a copy by the initiator), and the
//! paths over the pipe's remote lane, served by the owner: `cma` (`process_vm_readv`/`writev`)
//! and the fallback whose bytes travel on the lane (`tcp`, `shm`). The lane paths run here
//! between two contexts of this process with `xth` left out of the pipe, so the owner's side
//! is the same code as across processes (cma towards its own pid); the trials across processes
//! (the owner killed mid-batch) are in `tests/serial/remote_peer_death.rs`.

use std::time::Duration;

use actix::Addr;
use actorpipe::prelude::*;
use actorpipe::remote::{
    Notification, RegionDescriptor, RemoteDone, RemoteOp, RemoteRead, RemoteWrite, Span,
    SubscribeNotifications,
};

use crate::common::{within, Server};

/// A path under test: its name (what `RemoteDone::path` says) and the contexts of both sides.
pub struct RemotePath {
    name: &'static str,
    builder: fn() -> actorpipe::ContextBuilder,
    /// A write is landed under one hold of the region (cma, xth), so a deregistration racing it
    /// leaves all of it or none; on the lane paths it is landed a chunk at a time, so a
    /// deregistration can cut it after a prefix.
    whole_writes: bool,
    /// Where the owner listens.
    url: &'static str,
}

/// Every case of the suite on one path.
macro_rules! remote_suite {
    ($name:ident, $path:expr; $($case:ident),* $(,)?) => {
        mod $name {
            use super::*;
            const PATH: RemotePath = $path;
            $(
                #[actix::test]
                async fn $case() {
                    super::$case(&PATH).await
                }
            )*
        }
    };
}

/// The suite on one path: every case.
macro_rules! every_case {
    ($name:ident, $path:expr) => {
        remote_suite!($name, $path;
            random_batches_read_and_write_the_right_bytes,
            completions_come_in_issue_order_per_kind,
            a_notification_arrives_after_its_data,
            forged_and_stale_descriptors_are_refused,
            bad_batches_fail_clearly_and_the_pipe_goes_on,
            deregistration_waits_for_copies_in_flight,
            many_initiators_share_one_region,
            a_failed_pipe_fails_its_remote_operations,
            an_operation_past_its_deadline_fails_with_timeout,

        );
    };
}

every_case!(
    xth,
    RemotePath {
        name: "xth",
        builder: || actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["xth", "basic"]),
        whole_writes: true,
        url: "tcp://127.0.0.1:0",
    }
);

every_case!(
    cma,
    RemotePath {
        name: "cma",
        builder: || actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["cma", "basic"]),
        whole_writes: true,
        url: "tcp://127.0.0.1:0",
    }
);

every_case!(
    tcp,
    RemotePath {
        name: "tcp",
        builder: || actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["basic"]),
        whole_writes: false,
        url: "tcp://127.0.0.1:0",
    }
);

every_case!(
    shm,
    RemotePath {
        name: "shm",
        builder: || actorpipe::Context::builder()
            .only_transports(&["shm"])
            .only_channels(&["basic"]),
        whole_writes: false,
        url: "shm://",
    }
);

/// An owner context and a pipe to it on path `p`; the pipe negotiated what the path needs.
async fn owner_and_pipe(p: &RemotePath) -> (Server, Addr<Pipe>, Addr<Pipe>) {
    let mut s = Server::start((p.builder)(), p.url).await;
    let (tx, rx) = s.dial(&(p.builder)().start()).await;
    let region = s.ctx.register(Buffer::Cpu(vec![0; 8])).await.unwrap();
    let d = region.descriptor().clone();
    let probe = tx
        .remote_read(RemoteRead::new(&d, vec![Span::whole(8)], vec![0; 8]))
        .await;
    let info = tx.info().await.unwrap();
    assert_eq!(probe.map(|d| d.path).ok(), Some(p.name), "{info:?}");
    // PipeInfo names the path too, and the lane where there is one (none for xth).
    let remote = info.remote.expect("a remote path");
    assert_eq!(remote.path, p.name);
    assert_eq!(remote.lane.is_some(), p.name != "xth", "{remote:?}");
    (s, tx, rx)
}

/// Bytes that say where they are: byte `i` of pattern `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) as u8)
        .collect()
}

/// A small deterministic generator (xorshift), so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `n` spans with disjoint local and remote ranges, inside a region of `region` bytes and a
/// local buffer of `local` bytes: each takes its own slot of both.
fn random_spans(rng: &mut Rng, n: usize, region: u64, local: u64) -> Vec<Span> {
    let slot_r = region / n as u64;
    let slot_l = local / n as u64;
    let mut order: Vec<u64> = (0..n as u64).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    (0..n)
        .map(|i| {
            let len = 1 + rng.below(slot_r.min(slot_l));
            let r = order[i] * slot_r + rng.below(slot_r - len + 1);
            let l = i as u64 * slot_l + rng.below(slot_l - len + 1);
            Span::new(r, l, len)
        })
        .collect()
}

async fn random_batches_read_and_write_the_right_bytes(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    const LEN: usize = 4 << 20;
    let mut model = pattern(1, LEN);
    let region = s.ctx.register(Buffer::Cpu(model.clone())).await.unwrap();
    let d = region.descriptor().clone();
    assert_eq!(d.len(), LEN as u64);
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for round in 0..40 {
        let n = 1 + rng.below(64) as usize;
        let local_len = 1 + rng.below(2 << 20) as usize + n;
        let spans = random_spans(&mut rng, n, LEN as u64, local_len as u64);
        if round % 2 == 0 {
            let done = pipe
                .remote_read(RemoteRead::new(&d, spans.clone(), vec![0u8; local_len]))
                .await
                .unwrap();
            assert_eq!(done.path, p.name);
            let got = done.buffer.as_cpu().unwrap();
            for sp in &spans {
                let (r, l, n) = (sp.remote as usize, sp.local as usize, sp.len as usize);
                assert_eq!(&got[l..l + n], &model[r..r + n], "round {round}: {sp:?}");
            }
            assert_eq!(done.bytes, spans.iter().map(|s| s.len).sum::<u64>());
        } else {
            let src = pattern(round, local_len);
            let done = pipe
                .remote_write(RemoteWrite::new(&d, spans.clone(), src.clone()))
                .await
                .unwrap();
            assert_eq!(done.buffer.as_cpu().unwrap(), &src[..], "the buffer back");
            for sp in &spans {
                let (r, l, n) = (sp.remote as usize, sp.local as usize, sp.len as usize);
                model[r..r + n].copy_from_slice(&src[l..l + n]);
            }
            let mut now = vec![0u8; LEN];
            region.read_at(0, &mut now).unwrap();
            assert!(now == model, "round {round}: the region after the write");
        }
    }
    assert!(region.deregister().await.as_cpu().unwrap() == &model[..]);
}

async fn completions_come_in_issue_order_per_kind(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    let region = s.ctx.register(Buffer::Cpu(vec![0; 1 << 20])).await.unwrap();
    let d = region.descriptor().clone();
    let (to, mut done) = inbox::<RemoteDone>();
    for i in 0..200u64 {
        let span = vec![Span::new(i * 4096, 0, 4096)];
        if i % 3 == 0 {
            pipe.do_send(RemoteRead::new(&d, span, vec![0u8; 4096]).notify(to.clone()));
        } else {
            pipe.do_send(RemoteWrite::new(&d, span, vec![i as u8; 4096]).notify(to.clone()));
        }
    }
    // `owner_and_pipe`'s probe was read 0.
    let mut next = [1u64, 0];
    for _ in 0..200 {
        let r = within(10, "a completion", done.recv()).await.unwrap();
        r.result.unwrap();
        let k = (r.op == RemoteOp::Write) as usize;
        assert_eq!(r.id, next[k], "{:?} completions in order", r.op);
        next[k] += 1;
    }
    assert_eq!(next, [68, 133]);
}

async fn a_notification_arrives_after_its_data(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    let region = std::sync::Arc::new(s.ctx.register(Buffer::Cpu(vec![0; 8 << 20])).await.unwrap());
    let d = region.descriptor().clone();
    let (to, mut notes) = inbox::<Notification>();
    s.ctx.send(SubscribeNotifications(to)).await.unwrap();
    for i in 1..=8u8 {
        let block = vec![Span::new((i as u64 - 1) << 20, 0, 1 << 20)];
        let w = RemoteWrite::new(&d, block, vec![i; 1 << 20]).notify_owner(vec![i]);
        pipe.do_send(w);
    }
    for i in 1..=8u8 {
        let n = within(10, "a notification", notes.recv()).await.unwrap();
        assert_eq!((n.region, n.write, n.data.clone()), (d.id(), true, vec![i]));
        // The block it announces is in place when the owner hears.
        let mut block = vec![0u8; 1 << 20];
        region.read_at((i as u64 - 1) << 20, &mut block).unwrap();
        assert!(
            block.iter().all(|&b| b == i),
            "block {i} before its notification"
        );
    }
    // A read notifies too, after its copy.
    pipe.remote_read(RemoteRead::new(&d, vec![Span::whole(16)], vec![0; 16]).notify_owner(*b"r"))
        .await
        .unwrap();
    let n = within(10, "the read's notification", notes.recv())
        .await
        .unwrap();
    assert_eq!((n.write, n.data), (false, b"r".to_vec()));
}

/// The descriptor's fields, as its bytes hold them (the last: where the memory is).
/// A descriptor with another token: the same bytes, the token's words changed.
fn forged(d: &RegionDescriptor) -> RegionDescriptor {
    crate::common::forge(d, |f| f.4[1] ^= 1)
}

async fn forged_and_stale_descriptors_are_refused(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    let region = s.ctx.register(Buffer::Cpu(vec![5; 4096])).await.unwrap();
    let d = region.descriptor().clone();
    let bytes = d.to_bytes();
    assert!(bytes.len() < 128, "a descriptor of {} bytes", bytes.len());
    assert_eq!(RegionDescriptor::from_bytes(&bytes).unwrap(), d);
    let token = rmp_serde::from_slice::<crate::common::DescriptorFields>(&bytes)
        .unwrap()
        .4;
    let shown = format!("{d:?}");
    for w in token {
        let (dec, hex) = (w.to_string(), format!("{w:x}"));
        assert!(
            !shown.contains(&dec) && !shown.contains(&hex),
            "the token in {shown}"
        );
    }
    assert_eq!(
        RegionDescriptor::from_bytes(b"not one").unwrap_err().kind(),
        ErrorClass::Protocol
    );

    let bad = forged(&d);
    let r = pipe
        .send(RemoteRead::new(&bad, vec![Span::whole(16)], vec![0; 16]))
        .await
        .unwrap();
    assert_eq!(r.result.unwrap_err().kind(), ErrorClass::Auth);
    let w = pipe
        .send(RemoteWrite::new(&bad, vec![Span::whole(16)], vec![9; 16]))
        .await
        .unwrap();
    assert_eq!(w.result.unwrap_err().kind(), ErrorClass::Auth);
    let mut now = vec![0; 4096];
    region.read_at(0, &mut now).unwrap();
    assert!(
        now.iter().all(|&b| b == 5),
        "a forged write touched the region"
    );

    // Deregistered: the memory comes back as the last write left it, and the descriptor is stale.
    pipe.remote_write(RemoteWrite::new(&d, vec![Span::whole(4)], vec![1; 4]))
        .await
        .unwrap();
    let back = region.deregister().await;
    assert_eq!(&back.as_cpu().unwrap()[..5], &[1, 1, 1, 1, 5]);
    let r = pipe
        .send(RemoteRead::new(&d, vec![Span::whole(4)], vec![0; 4]))
        .await
        .unwrap();
    let e = r.result.unwrap_err();
    assert_eq!(e.kind(), ErrorClass::InvalidArgument);
    assert!(e.to_string().contains("not registered"), "{e}");
    assert_eq!(r.buffer.as_cpu().unwrap().len(), 4, "the buffer comes back");
}

async fn bad_batches_fail_clearly_and_the_pipe_goes_on(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    let region = s.ctx.register(Buffer::Cpu(vec![0; 1024])).await.unwrap();
    let ro = s
        .ctx
        .register(Buffer::Shared(Bytes::from(vec![3; 64])))
        .await
        .unwrap();
    let d = region.descriptor().clone();
    assert!(!ro.descriptor().is_writable());
    let cases: Vec<(&str, actorpipe::remote::RemoteDone)> = vec![
        (
            "past the region",
            pipe.send(RemoteRead::new(
                &d,
                vec![Span::new(1000, 0, 25)],
                vec![0; 64],
            ))
            .await
            .unwrap(),
        ),
        (
            "past the local buffer",
            pipe.send(RemoteRead::new(&d, vec![Span::new(0, 60, 5)], vec![0; 64]))
                .await
                .unwrap(),
        ),
        (
            "an offset that overflows",
            pipe.send(RemoteWrite::new(
                &d,
                vec![Span::new(u64::MAX, 0, 2)],
                vec![0; 64],
            ))
            .await
            .unwrap(),
        ),
        (
            "two spans into the same bytes",
            pipe.send(RemoteRead::new(
                &d,
                vec![Span::new(0, 0, 16), Span::new(100, 8, 16)],
                vec![0; 64],
            ))
            .await
            .unwrap(),
        ),
        (
            "a write into a read-only region",
            pipe.send(RemoteWrite::new(
                ro.descriptor(),
                vec![Span::whole(4)],
                vec![0; 4],
            ))
            .await
            .unwrap(),
        ),
        (
            "a read into shared bytes",
            pipe.send(RemoteRead::new(
                &d,
                vec![Span::whole(4)],
                Bytes::from(vec![0; 4]),
            ))
            .await
            .unwrap(),
        ),
    ];
    for (what, done) in cases {
        let e = done.result.expect_err(what);
        assert_eq!(e.kind(), ErrorClass::InvalidArgument, "{what}: {e}");
    }
    // The read-only region reads, and the pipe goes on.
    let r = pipe
        .remote_read(RemoteRead::new(
            ro.descriptor(),
            vec![Span::whole(64)],
            vec![0; 64],
        ))
        .await
        .unwrap();
    assert!(r.buffer.as_cpu().unwrap().iter().all(|&b| b == 3));
    let m = actorpipe::Message::new().with_tensor(Tensor::cpu(vec![1; 1 << 16]));
    let w = pipe.write(m);
    within(10, "a message after the bad batches", _rx.receive())
        .await
        .unwrap();
    w.await.unwrap();
}

/// Deregistration races copies in flight: a copy that started finishes before the memory comes
/// back (the buffer holds all of its bytes), and one that comes later fails having touched
/// nothing (the buffer holds none).
async fn deregistration_waits_for_copies_in_flight(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    const LEN: usize = 32 << 20;
    // How long a write of that size takes on this path, unraced.
    let took = {
        let region = s.ctx.register(Buffer::Cpu(vec![0; LEN])).await.unwrap();
        let d = region.descriptor().clone();
        let t = std::time::Instant::now();
        let w = RemoteWrite::new(&d, vec![Span::whole(LEN as u64)], vec![1; LEN]);
        pipe.remote_write(w).await.unwrap();
        t.elapsed()
    };
    let (mut landed, mut refused) = (0, 0);
    for round in 0..12u8 {
        let region = s.ctx.register(Buffer::Cpu(vec![0; LEN])).await.unwrap();
        let d = region.descriptor().clone();
        let fill = round + 1;
        let src = vec![fill; LEN];
        // Deregister from another thread, at a moment that moves from round to round: from
        // well before the write is issued to past the time it takes.
        let step = (took / 3).max(Duration::from_micros(750));
        let pause = step * (round as u32 % 6);
        let back = std::thread::spawn(move || {
            std::thread::sleep(pause);
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(region.deregister())
        });
        if round >= 6 {
            tokio::time::sleep(Duration::from_millis(8)).await;
        }
        let write = pipe.send(RemoteWrite::new(&d, vec![Span::whole(LEN as u64)], src));
        let done = within(20, "the write", write).await.unwrap();
        let back = back.join().unwrap();
        let bytes = back.as_cpu().unwrap();
        match done.result {
            Ok(()) => {
                landed += 1;
                assert!(
                    bytes.iter().all(|&b| b == fill),
                    "round {round}: part of a landed write"
                );
            }
            Err(e) => {
                refused += 1;
                assert_eq!(e.kind(), ErrorClass::InvalidArgument, "{e}");
                // What landed is a prefix of the write (none of it where writes land whole).
                let cut = bytes.iter().position(|&b| b != fill).unwrap_or(LEN);
                assert!(
                    bytes[cut..].iter().all(|&b| b == 0),
                    "round {round}: a refused write wrote other than a prefix"
                );
                assert!(
                    cut == 0 || !p.whole_writes,
                    "round {round}: a refused write landed {cut} bytes"
                );
            }
        }
    }
    eprintln!("deregistration race: {landed} writes landed whole, {refused} refused");
    assert!(
        landed > 0 && refused > 0,
        "both orders: {landed} landed, {refused} refused"
    );
}

async fn many_initiators_share_one_region(p: &RemotePath) {
    let b = p.builder;
    let mut s = Server::start(b(), p.url).await;
    const EACH: usize = 1 << 20;
    const PEERS: usize = 6;
    let region = s
        .ctx
        .register(Buffer::Cpu(vec![0; EACH * PEERS]))
        .await
        .unwrap();
    let d = region.descriptor().clone();
    let mut pipes = Vec::new();
    for _ in 0..PEERS {
        pipes.push(s.dial(&b().start()).await.0);
    }
    // Each initiator writes its own stripe in 16 pieces, all at once, then reads all stripes.
    let (to, mut done) = inbox::<RemoteDone>();
    for (k, p) in pipes.iter().enumerate() {
        for piece in 0..16 {
            let at = (k * EACH + piece * (EACH / 16)) as u64;
            let span = vec![Span::new(at, 0, (EACH / 16) as u64)];
            p.do_send(RemoteWrite::new(&d, span, vec![k as u8 + 1; EACH / 16]).notify(to.clone()));
        }
    }
    for _ in 0..PEERS * 16 {
        within(20, "a write", done.recv())
            .await
            .unwrap()
            .result
            .unwrap();
    }
    for p in &pipes {
        let spans = (0..PEERS)
            .map(|k| Span::new((k * EACH) as u64, (k * EACH) as u64, EACH as u64))
            .collect();
        let r = p
            .remote_read(RemoteRead::new(&d, spans, vec![0; EACH * PEERS]))
            .await
            .unwrap();
        for (k, stripe) in r.buffer.as_cpu().unwrap().chunks(EACH).enumerate() {
            assert!(stripe.iter().all(|&b| b == k as u8 + 1), "stripe {k}");
        }
    }
}

async fn a_failed_pipe_fails_its_remote_operations(p: &RemotePath) {
    let (s, pipe, rx) = owner_and_pipe(p).await;
    let region = s.ctx.register(Buffer::Cpu(vec![0; 64])).await.unwrap();
    let d = region.descriptor().clone();
    rx.send(Close::because("the owner goes")).await.unwrap();
    // The initiator's pipe learns of the close; then every remote operation fails with its
    // error, the buffer back.
    let closed = within(10, "the close", async {
        loop {
            let r = pipe
                .send(RemoteRead::new(&d, vec![Span::whole(8)], vec![0; 8]))
                .await
                .unwrap();
            if let Err(e) = r.result {
                break (e, r.buffer);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(closed.0.kind(), ErrorClass::PeerClosed, "{}", closed.0);
    assert_eq!(closed.1.as_cpu().unwrap().len(), 8);
}

/// A pipe with no path to the region (between two contexts of this process, but without `xth`)
/// says so, and moves nothing.
#[actix::test]
async fn a_pipe_without_a_path_says_so() {
    let b = || {
        actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["basic"])
            .remote_lane(false)
    };
    let mut s = Server::start(b(), "tcp://127.0.0.1:0").await;
    let (basic, _) = s.dial(&b().start()).await;
    let region = s.ctx.register(Buffer::Cpu(vec![7; 8])).await.unwrap();
    let d = region.descriptor().clone();
    let r = basic
        .send(RemoteWrite::new(&d, vec![Span::whole(8)], vec![0; 8]))
        .await
        .unwrap();
    let e = r.result.unwrap_err();
    assert_eq!(e.kind(), ErrorClass::Unavailable, "{e}");
    assert!(e.to_string().contains("remote_lane(false)"), "{e}");
    assert_eq!(r.path, "");
    assert_eq!(basic.info().await.unwrap().remote, None);
    let mut now = vec![0; 8];
    region.read_at(0, &mut now).unwrap();
    assert_eq!(now, vec![7; 8]);
}

async fn an_operation_past_its_deadline_fails_with_timeout(p: &RemotePath) {
    let (s, pipe, _rx) = owner_and_pipe(p).await;
    let region = s.ctx.register(Buffer::Cpu(vec![0; 8 << 20])).await.unwrap();
    let d = region.descriptor().clone();
    let late = pipe
        .send(
            RemoteRead::new(&d, vec![Span::whole(8 << 20)], vec![0; 8 << 20])
                .within(Duration::ZERO),
        )
        .await
        .unwrap();
    assert_eq!(late.result.unwrap_err().kind(), ErrorClass::Timeout);
    assert_eq!(late.buffer.len(), 8 << 20, "the buffer comes back");
    let fine = pipe
        .remote_read(
            RemoteRead::new(&d, vec![Span::whole(16)], vec![0; 16]).within(Duration::from_secs(10)),
        )
        .await;
    assert!(fine.is_ok(), "{fine:?}");
}
