//! The cma channel when the kernel refuses the read at run time (EPERM, as under ptrace rules or
//! seccomp): the pipe does not die, the bytes come over the channel's side connection instead,
//! and the fallback is reported, whether the read was refused at its entry or part-way, in a
//! reader thread's share. The refusal is injected (`cma::simulate`), because this machine allows
//! the read; everything after the refused system call is the real path.
//!
//! The remote-memory `cma` path under the same refusal moves its operations onto the pipe's
//! remote lane (`refused_cma_moves_remote_operations_onto_the_lane`).
//!
//! The switch is process-wide: the test holds the binary's lock (`crate::ONE_AT_A_TIME`), so that
//! no other test's cma reads are refused meanwhile.

use actorpipe::internal::backend::cma;
use actorpipe::*;

use crate::common::*;

#[actix::test]
#[allow(clippy::await_holding_lock)]
async fn refused_reads_fall_back_and_are_reported() {
    let _one = crate::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let b = || {
        Context::builder()
            .without("shm")
            .only_channels(&["cma", "basic"])
            .chunk_size(64 << 10)
            // Every non-empty tensor by cma, so that every one can be refused.
            .cma_inline_max(0)
    };
    let (tx, rx, _s) = pair(b(), b()).await;
    assert_eq!(
        rx.send(GetInfo).await.unwrap().channels[0].to_string(),
        "cma (cpu->cpu)"
    );
    cma::simulate_refusal(true);
    for i in 0..10 {
        let w = tx.send(Write::new(checked_message(i, &[5], &[0, 1, (1 << 20) + 7])));
        assert_eq!(verify(&within(20, "read", read_one(&rx)).await.unwrap()), i);
        within(20, "write", w).await.unwrap().result.unwrap();
    }
    let info = rx.send(GetInfo).await.unwrap();
    assert!(!info.closed, "the pipe survives");
    assert_eq!(info.fallbacks, 20, "two non-empty tensors per message");
    // Both directions at once: acknowledgements and fallback bytes of the two directions
    // travel on separate side connections and must not mix.
    let one_way = |from: actix::Addr<Pipe>, to: actix::Addr<Pipe>, base: u64| async move {
        let writes: Vec<_> = (0..4)
            .map(|i| from.send(Write::new(checked_message(base + i, &[], &[(4 << 20) + 1]))))
            .collect();
        for i in 0..4 {
            assert_eq!(verify(&read_one(&to).await.unwrap()), base + i);
        }
        for w in writes {
            w.await.unwrap().result.unwrap();
        }
    };
    within(60, "both directions", async {
        tokio::join!(
            one_way(tx.clone(), rx.clone(), 100),
            one_way(rx.clone(), tx.clone(), 200)
        )
    })
    .await;
    assert_eq!(rx.send(GetInfo).await.unwrap().fallbacks, 24);
    assert_eq!(tx.send(GetInfo).await.unwrap().fallbacks, 4);
    // Refused part-way, inside a reader thread's share (the read's first shares may have
    // landed): the whole tensor comes over the side connection all the same. Whether a reader
    // thread takes a share of a given read is up to the scheduler, so write until one has.
    cma::simulate(cma::Refusal::InReaderShares);
    let before = rx.send(GetInfo).await.unwrap().fallbacks;
    let mut sent = 0;
    while rx.send(GetInfo).await.unwrap().fallbacks == before {
        assert!(sent < 200, "no read was refused in a reader thread's share");
        let w = tx.send(Write::new(checked_message(
            300 + sent,
            &[],
            &[(8 << 20) + 3],
        )));
        assert_eq!(
            verify(&within(20, "read", read_one(&rx)).await.unwrap()),
            300 + sent
        );
        within(20, "write", w).await.unwrap().result.unwrap();
        sent += 1;
    }
    let fallbacks = rx.send(GetInfo).await.unwrap().fallbacks;
    assert!(!rx.send(GetInfo).await.unwrap().closed, "the pipe survives");
    // The refusal lifts: the fast path is back, no more fallbacks.
    cma::simulate_refusal(false);
    let w = tx.send(Write::new(checked_message(99, &[], &[4096])));
    assert_eq!(verify(&read_one(&rx).await.unwrap()), 99);
    w.await.unwrap().result.unwrap();
    assert_eq!(rx.send(GetInfo).await.unwrap().fallbacks, fallbacks);
}

/// A pipe that negotiated cma, whose owner may not reach the initiator's memory (the refusal
/// injected for the whole process): the lane's probe finds it, and the remote operations move
/// their bytes on the lane instead (`PipeInfo::remote` and `RemoteDone::path` say `tcp`); they
/// succeed, none fails as refused.
#[actix::test]
#[allow(clippy::await_holding_lock)]
async fn refused_cma_moves_remote_operations_onto_the_lane() {
    use actorpipe::remote::{RemoteRead, RemoteWrite, Span};
    let _one = crate::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let b = || {
        Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["cma", "basic"])
    };
    // The contexts start (and probe cma) before the refusal, so the pipe negotiates cma; the
    // lane's probe, at the pipe's set-up, meets the refusal.
    let mut server = Server::start(b(), "tcp://127.0.0.1:0").await;
    let client = b().start();
    cma::simulate_refusal(true);
    let (tx, _rx) = server.dial(&client).await;
    let info = tx.send(GetInfo).await.unwrap();
    assert_eq!(info.channel_list(), "cma (cpu->cpu)");
    let path = within(5, "the probe's answer", async {
        loop {
            let info = tx.send(GetInfo).await.unwrap();
            match info.remote.map(|r| r.path) {
                Some(p) if p != "cma" => break p,
                _ => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
            }
        }
    })
    .await;
    assert_eq!(path, "tcp");
    let region = server
        .ctx
        .register(Buffer::Cpu(vec![5; 1 << 20]))
        .await
        .unwrap();
    let d = region.descriptor().clone();
    let read = tx
        .remote_read(RemoteRead::new(
            &d,
            vec![Span::whole(1 << 20)],
            vec![0; 1 << 20],
        ))
        .await
        .unwrap();
    assert_eq!(read.path, "tcp");
    assert!(read.buffer.as_cpu().unwrap().iter().all(|&b| b == 5));
    let write = tx
        .remote_write(RemoteWrite::new(&d, vec![Span::new(8, 0, 8)], vec![6; 8]))
        .await
        .unwrap();
    assert_eq!(write.path, "tcp");
    let mut got = [0u8; 8];
    region.read_at(8, &mut got).unwrap();
    assert_eq!(got, [6; 8]);
    cma::simulate_refusal(false);
}
