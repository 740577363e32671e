//! Large copies shared among copy threads (`actorpipe::internal::copy::threads`): the shm ring's large
//! reads and writes and the xth channel's copies, with sharing on whatever the machine (every
//! test here asks for 3 threads before the process's first large copy; the default on 2 cores,
//! as in CI, is none, so the other test binaries cover the copies without sharing).

mod common;

use std::io::IoSlice;
use std::sync::Arc;

use actorpipe::internal::backend::shm::{ring, Shm};
use actorpipe::*;
use common::*;

const THREADS: usize = 3;

/// Sharing on, for this process: every test asks before its first copy.
fn shared() {
    let _ = actorpipe::internal::copy::set_threads(THREADS);
    assert_eq!(
        actorpipe::internal::copy::threads(),
        THREADS,
        "another test of this binary started the copy threads with another count"
    );
}

/// A writer and a reader on two threads push 40 MiB through a 1 MiB ring in uneven vectored
/// writes (up to 11 slices, some empty) and reads into large and small destinations: the same
/// bytes in the same order, across wrap-arounds, batches and span lists that fill up.
#[test]
fn a_ring_moves_the_same_bytes_with_shared_copies() {
    shared();
    let (mut p, mut c) = ring::in_memory(1 << 20).unwrap();
    let data = Arc::new(pattern(3, (40 << 20) + 11));
    let d = data.clone();
    let writer = std::thread::spawn(move || {
        let mut sent = 0;
        let mut k = 0usize;
        while sent < d.len() {
            k += 1;
            let want = ((k * 7919) % (3 << 20)).min(d.len() - sent).max(1);
            // Cut `want` bytes into up to 11 slices of uneven sizes, some empty.
            let mut cuts: Vec<usize> = (0..(k % 11))
                .map(|i| sent + (want * (i * i + 1) / 140).min(want))
                .collect();
            cuts.push(sent + want);
            cuts.sort_unstable();
            let mut at = sent;
            let slices: Vec<IoSlice> = cuts
                .iter()
                .map(|&end| {
                    let s = IoSlice::new(&d[at..end]);
                    at = end;
                    s
                })
                .collect();
            let n = p.write(&slices).unwrap();
            if n == 0 {
                std::thread::yield_now();
            }
            sent += n;
        }
    });
    let mut out = vec![0u8; data.len()];
    let mut got = 0;
    let mut k = 0usize;
    while got < out.len() {
        k += 1;
        // Mostly large destinations (shared, non-temporal above 1 MiB), now and then small.
        let room = if k % 5 == 0 { 4099 } else { 5 << 20 };
        let end = (got + room).min(out.len());
        let n = c.read(&mut out[got..end]).unwrap();
        if n == 0 {
            std::thread::yield_now();
        }
        got += n;
    }
    writer.join().unwrap();
    assert!(out == *data, "bytes differ");
}

/// Large tensors over the shm transport (basic channel), with the default 2 MiB ring and a
/// 512 KiB one, both ways at once, checked byte for byte.
#[actix::test]
async fn shm_pipes_move_large_tensors_with_shared_copies() {
    shared();
    for capacity in [ring::DEFAULT_CAPACITY, 512 << 10] {
        let b = || {
            Context::builder()
                .transport(Arc::new(Shm::new().with_capacity(capacity)))
                .only_channels(&["basic"])
        };
        let (x, y, _s) = pair(b(), b()).await;
        check_backends(&x, "shm", "basic").await;
        let sizes = [
            (256 << 10) - 1,
            256 << 10,
            (1 << 20) + 3,
            (9 << 20) + 1,
            33 << 20,
        ];
        let one_way = |from: actix::Addr<Pipe>, to: actix::Addr<Pipe>, base: u64| async move {
            for (i, &size) in sizes.iter().enumerate() {
                let i = base + i as u64;
                let w = from.send(Write::new(checked_message(i, &[size / 3 + 1], &[size, 77])));
                assert_eq!(verify(&read_one(&to).await.expect("read")), i);
                w.await.unwrap().result.expect("write");
            }
        };
        within(120, "large tensors both ways", async {
            tokio::join!(one_way(x.clone(), y.clone(), 0), one_way(y, x, 100))
        })
        .await;
    }
}

/// The xth channel's copy of a large tensor (non-temporal above 8 MiB) is shared too.
#[actix::test]
async fn xth_copies_large_tensors_with_shared_copies() {
    shared();
    let b = || {
        Context::builder()
            .without("shm")
            .only_channels(&["xth", "basic"])
    };
    let (x, y, _s) = pair(b(), b()).await;
    check_backends(&x, "tcp", "xth").await;
    for (i, size) in [300_001usize, (8 << 20) + 5, 24 << 20]
        .into_iter()
        .enumerate()
    {
        let w = x.send(Write::new(checked_message(i as u64, &[], &[size])));
        let m = within(60, "read", read_one(&y)).await.expect("read");
        assert_eq!(verify(&m), i as u64);
        within(60, "write", w).await.unwrap().result.expect("write");
    }
}
