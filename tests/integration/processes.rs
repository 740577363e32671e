//! Two OS processes over loopback: the peer is the `echo_peer` example, started as a child.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use actorpipe::*;

use crate::common::*;

struct Peer {
    child: Child,
    url: String,
}

impl Peer {
    fn start() -> Peer {
        let mut child = Command::new(example("echo_peer"))
            .arg("tcp://127.0.0.1:0")
            .stdout(Stdio::piped())
            .spawn()
            .expect("start echo_peer");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        // Keep draining its output so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in out.lines() {});
        Peer { child, url }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[actix::test]
async fn messages_round_trip_through_another_process() {
    let peer = Peer::start();
    let ctx = Context::builder().chunk_size(1 << 20).start();
    let pipe = ctx
        .send(Connect::new(&peer.url))
        .await
        .unwrap()
        .expect("connect");
    let mut rng = Rng(77);
    within(120, "200 echoes", async {
        for i in 0..200 {
            let payloads: Vec<usize> = (0..rng.below(3)).map(|_| draw_size(&mut rng)).collect();
            let tensors: Vec<usize> = (0..rng.below(3)).map(|_| draw_size(&mut rng)).collect();
            let w = pipe.send(Write::new(checked_message(i, &payloads, &tensors)));
            let back = read_one(&pipe).await.expect("echo");
            assert_eq!(verify(&back), i);
            w.await.unwrap().result.unwrap();
        }
    })
    .await;
}

/// The peer is killed with SIGKILL while 64 MiB tensors are in flight both ways: every pending
/// operation completes with a peer-lost error, in order, with its buffers, and nothing hangs.
#[actix::test]
async fn peer_killed_mid_transfer_fails_every_pending_operation() {
    let mut peer = Peer::start();
    let ctx = Context::builder().start();
    let pipe = ctx
        .send(Connect::new(&peer.url))
        .await
        .unwrap()
        .expect("connect");
    let (closed_to, mut closed) = inbox::<Closed>();
    pipe.send(Subscribe(closed_to)).await.unwrap();
    let (w_to, mut writes) = inbox::<WriteDone>();
    let (r_to, mut descs) = inbox::<DescriptorReady>();
    // One round trip first, so the transfer is under way both ways when the kill comes.
    let w = pipe.send(Write::new(checked_message(0, &[], &[64 << 20])));
    assert_eq!(verify(&read_one(&pipe).await.unwrap()), 0);
    w.await.unwrap().result.unwrap();
    for i in 1..=8 {
        pipe.do_send(Write::new(checked_message(i, &[], &[64 << 20])).notify(w_to.clone()));
    }
    for _ in 0..4 {
        pipe.do_send(ReadDescriptor.notify(r_to.clone()));
    }
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    peer.child.kill().expect("kill -9");
    let mut failed = false;
    for i in 1..=8 {
        let d = within(20, "write completion", writes.recv()).await.unwrap();
        assert_eq!(d.id, i);
        assert_eq!(d.message.tensors[0].buffer.len(), 64 << 20, "buffer back");
        match d.result {
            Ok(()) => assert!(!failed, "in order: no success after a failure"),
            Err(e) => {
                failed = true;
                assert_eq!(e.class(), "peer_closed", "{e}");
            }
        }
    }
    assert!(failed, "8 x 64 MiB cannot all be written to a dead peer");
    let mut last_ok = true;
    for _ in 0..4 {
        let d = within(20, "descriptor", descs.recv()).await.unwrap();
        match d.descriptor {
            Ok(_) => assert!(last_ok),
            Err(e) => {
                last_ok = false;
                assert_eq!(e.class(), "peer_closed", "{e}");
            }
        }
    }
    let c = within(20, "Closed", closed.recv()).await.unwrap();
    assert_eq!(c.error.class(), "peer_closed");
}
