//! Serve Prometheus metrics, move some traffic, and print what a scrape returns.
//!
//! Run: `cargo run --example metrics` (or, in a program that builds its context with
//! `ContextBuilder::from_env()`, set `ACTORPIPE_METRICS_ADDR=127.0.0.1:9100` and scrape
//! `http://127.0.0.1:9100/metrics` while it runs).

use std::io::{Read as _, Write as _};

use actorpipe::prelude::*;

#[actix::main]
async fn main() -> actorpipe::Result<()> {
    // Loopback only; port 0 picks a free port.
    let addr = actorpipe::metrics::serve("127.0.0.1:0".parse().expect("address"))?;
    let server = actorpipe::Context::builder().start();
    let (accepted, mut incoming) = inbox::<Accepted>();
    let l = server.listen(["tcp://127.0.0.1:0"], accepted).await?;
    let client = actorpipe::Context::builder().start();
    let tx = client.connect(&l.urls[0]).await?;
    let rx = incoming.recv().await.expect("a pipe").pipe;
    for i in 0..5u8 {
        let w = tx.write(actorpipe::Message::new().with_tensor(Tensor::cpu(vec![i; 256 << 10])));
        let d = rx.read_descriptor().await?;
        rx.read(Allocation::for_descriptor(&d)?).await?;
        w.await?;
    }

    // A real HTTP scrape of the endpoint.
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("response");
    println!("scrape of http://{addr}/metrics:");
    for line in body
        .lines()
        .filter(|l| l.starts_with("actorpipe_") && !l.contains("_bucket"))
    {
        println!("  {line}");
    }
    Ok(())
}
