//! Dials many pipes at once to one listener (an `echo_peer`), then checks that every pipe it got
//! works: the admission test of docs/operations.md.
//!
//! ```text
//! bash -c 'ulimit -n 1024; exec cargo run --release --example echo_peer -- tcp://127.0.0.1:5000'
//! cargo run --release --example connect_burst -- tcp://127.0.0.1:5000 256
//! ```
//!
//! It prints how many `Connect`s succeeded, how many failed and why, how long the slowest took,
//! and how many of the pipes it got carried an echo.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use actorpipe::prelude::*;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or("tcp://127.0.0.1:5000".into());
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    actix::System::new().block_on(async move {
        let ctx = actorpipe::Context::builder().start();
        let started = Instant::now();
        let dials: Vec<_> = (0..n)
            .map(|_| {
                let (ctx, url) = (ctx.clone(), url.clone());
                actix::spawn(async move {
                    let r = ctx.connect(url).await;
                    (r, started.elapsed())
                })
            })
            .collect();
        let mut pipes = Vec::new();
        let mut failed: BTreeMap<String, (usize, Duration)> = BTreeMap::new();
        let mut slowest_ok = Duration::ZERO;
        for d in dials {
            let (r, at) = d.await.expect("dial task");
            match r {
                Ok(p) => {
                    slowest_ok = slowest_ok.max(at);
                    pipes.push(p);
                }
                Err(e) => {
                    let key = match &e {
                        Error::Refused { reason, .. } => format!("refused: {reason}"),
                        Error::Timeout { what, .. } => format!("timeout while {what}"),
                        e => e.class().to_string(),
                    };
                    let slot = failed.entry(key).or_default();
                    slot.0 += 1;
                    slot.1 = slot.1.max(at);
                }
            }
        }
        println!(
            "{n} connects to {url} in {:.2?}: {} ok (slowest {slowest_ok:.2?})",
            started.elapsed(),
            pipes.len()
        );
        for (why, (count, slowest)) in &failed {
            println!("  {count} failed with {why} (slowest {slowest:.2?})");
        }
        let echoes = pipes.iter().enumerate().map(|(i, p)| {
            let p = p.clone();
            async move {
                let m = actorpipe::Message::new().with_tensor(Tensor::cpu(vec![i as u8; 4096]));
                let w = p.write(m);
                let back = p.receive().await?;
                w.await?;
                Ok::<_, Error>(back.tensors[0].buffer.as_cpu() == Some(&[i as u8; 4096][..]))
            }
        });
        let mut worked = 0;
        let mut broken: BTreeMap<String, usize> = BTreeMap::new();
        for e in echoes {
            match tokio::time::timeout(Duration::from_secs(20), e).await {
                Ok(Ok(true)) => worked += 1,
                Ok(Ok(false)) => *broken.entry("wrong bytes".into()).or_default() += 1,
                Ok(Err(e)) => *broken.entry(e.class().to_string()).or_default() += 1,
                Err(_) => *broken.entry("no echo in 20 s".into()).or_default() += 1,
            }
        }
        println!("{worked} of {} pipes carried an echo", pipes.len());
        for (why, count) in &broken {
            println!("  {count} did not: {why}");
        }
    });
    Ok(())
}
