//! Quickstart: a listener and a pipe in one process, moving real tensors. The pipe bootstraps
//! over loopback TCP and negotiates the fastest path the two ends share (in one process: shared
//! memory for control, a single in-process copy for tensors); it prints what it chose.
//!
//! Run it with `cargo run --release --example quickstart`.

use std::time::Instant;

use actorpipe::prelude::*;

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

#[actix::main]
async fn main() -> actorpipe::Result<()> {
    let server = actorpipe::Context::builder().start();
    let client = actorpipe::Context::builder().start();

    // The server listens on a free loopback port and hands accepted pipes to an inbox.
    let (accepted, mut incoming) = inbox::<Accepted>();
    let listening = server.listen(["tcp://127.0.0.1:0"], accepted).await?;
    let url = &listening.urls[0];
    println!("listening on {url}");

    let tx = client.connect(url).await?;
    let rx = incoming.recv().await.expect("a pipe").pipe;
    let info = tx.info().await?;
    println!(
        "pipe {} to {} over {} with {}",
        info.id,
        info.peer,
        info.transport,
        info.channel_list()
    );
    println!();
    println!(
        "{:>10}  {:>8}  {:>10}  {:>10}",
        "tensor", "messages", "time", "throughput"
    );

    for size in [4 << 10, 1 << 20, 16 << 20, 64 << 20] {
        let mut data = vec![0u8; size];
        fill(&mut data, size as u64);
        let reps = (256 << 20) / size.max(1 << 20);
        let mut message = actorpipe::Message::new()
            .with_metadata(format!("{size} bytes").into_bytes())
            .with_payload(Payload::new(b"header".to_vec()))
            .with_tensor(Tensor::cpu(data.clone()));
        let mut allocation = None;
        let start = Instant::now();
        for _ in 0..reps {
            // Issue the write (awaited below), read on the other side, take the buffers back.
            let write = tx.write(message);
            let descriptor = rx.read_descriptor().await?;
            let alloc = match allocation.take() {
                Some(a) => a,
                None => Allocation::for_descriptor(&descriptor)?,
            };
            let got = rx.read(alloc).await?;
            message = write.await?.message;
            allocation = Some(Allocation::from(got));
        }
        let elapsed = start.elapsed();
        let received = allocation.as_ref().expect("read at least once");
        assert_eq!(
            received.tensors[0].as_cpu(),
            Some(&data[..]),
            "data arrived intact"
        );
        let gbps = (size * reps) as f64 / elapsed.as_secs_f64() / 1e9;
        println!(
            "{:>10}  {:>8}  {:>8.1}ms  {:>6.2} GB/s",
            human(size),
            reps,
            elapsed.as_secs_f64() * 1e3,
            gbps
        );
    }

    let closed = tx.close(Close::because("quickstart done")).await?;
    println!();
    println!("closed: {}", closed.error);
    Ok(())
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}
