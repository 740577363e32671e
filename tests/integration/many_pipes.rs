//! Many pipes on one context at once.

use actorpipe::*;

use crate::common::*;

/// 128 pipes between two contexts, all moving messages at the same time; each pipe's messages
/// arrive intact and in order, and pipes do not mix.
#[actix::test]
async fn a_hundred_and_twenty_eight_pipes_at_once() {
    const PIPES: u64 = 128;
    const MESSAGES: u64 = 10;
    let mut server = Server::start(Context::builder(), "tcp://127.0.0.1:0").await;
    let client = Context::builder().chunk_size(8 << 10).start();
    let mut pairs = Vec::new();
    for _ in 0..PIPES {
        let (tx, rx) = server.dial(&client).await;
        pairs.push((tx, rx));
    }
    let work = pairs.iter().enumerate().map(|(p, (tx, rx))| {
        let (tx, rx) = (tx.clone(), rx.clone());
        async move {
            let base = p as u64 * 1000;
            let writes: Vec<_> = (0..MESSAGES)
                .map(|i| tx.send(Write::new(checked_message(base + i, &[64], &[20_000]))))
                .collect();
            for i in 0..MESSAGES {
                assert_eq!(verify(&read_one(&rx).await.unwrap()), base + i);
            }
            for w in writes {
                w.await.unwrap().result.unwrap();
            }
        }
    });
    let tasks: Vec<_> = work.map(actix::spawn).collect();
    within(120, "128 pipes", async {
        for t in tasks {
            t.await.expect("pipe task");
        }
    })
    .await;
    for (tx, _) in &pairs {
        assert!(!tx.send(GetInfo).await.unwrap().closed);
    }
}
