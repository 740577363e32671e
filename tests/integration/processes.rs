//! Two OS processes over loopback: the peer is the `echo_peer` example, started as a child.
//! They negotiate shm and cma, as two processes of one user do; our side lowers its cma inline
//! limit (`cma_inline_max`: over shm, cma sends tensors of up to 64 MiB inline on the ring by
//! default), so that its tensors are read by cma, and checks that they were.

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

/// Our pipe to `peer` is shm + cma.
async fn assert_shm_cma(pipe: &actix::Addr<Pipe>) {
    let info = pipe.send(GetInfo).await.unwrap();
    assert_eq!(info.transport, "shm", "{info:?}");
    assert!(
        info.channels.iter().any(|c| c.name == "cma"),
        "{}",
        info.channel_list()
    );
}

/// 200 echoes of random shape: our tensors above 4 KiB go by cma, the smaller ones inline.
#[actix::test]
async fn messages_round_trip_through_another_process() {
    let peer = Peer::start();
    let ctx = Context::builder()
        .chunk_size(1 << 20)
        .cma_inline_max(4 << 10)
        .start();
    let pipe = ctx
        .send(Connect::new(&peer.url))
        .await
        .unwrap()
        .expect("connect");
    assert_shm_cma(&pipe).await;
    let mut rng = Rng(77);
    within(120, "200 echoes", async {
        for i in 0..200 {
            let payloads: Vec<usize> = (0..rng.below(3)).map(|_| draw_size(&mut rng)).collect();
            let tensors: Vec<usize> = (0..rng.below(3)).map(|_| draw_size(&mut rng)).collect();
            let m = checked_message(i, &payloads, &tensors);
            let receipt = Receipt::of(&m);
            let w = pipe.send(Write::new(m));
            let back = read_one(&pipe).await.expect("echo");
            assert_eq!(verify(&back), i);
            let d = w.await.unwrap();
            d.result.unwrap();
            receipt.check_write(&d.message, &format!("write {i}"));
        }
    })
    .await;
    let info = pipe.send(GetInfo).await.unwrap();
    assert!(
        info.tensors_by_channel > 0 && info.tensors_on_control > 0 && info.fallbacks == 0,
        "tensors by cma and inline: {info:?}"
    );
}

/// The peer is killed with SIGKILL while 64 MiB tensors are in flight both ways (ours by cma):
/// every pending operation completes with a peer-lost error, in order, with its buffers (the
/// same ones, unchanged), and nothing hangs.
#[actix::test]
async fn peer_killed_mid_transfer_fails_every_pending_operation() {
    let mut peer = Peer::start();
    let ctx = Context::builder().cma_inline_max(1 << 20).start();
    let pipe = ctx
        .send(Connect::new(&peer.url))
        .await
        .unwrap()
        .expect("connect");
    assert_shm_cma(&pipe).await;
    let (closed_to, mut closed) = inbox::<Closed>();
    pipe.send(Subscribe(closed_to)).await.unwrap();
    let (w_to, mut writes) = inbox::<WriteDone>();
    let (r_to, mut descs) = inbox::<DescriptorReady>();
    // One round trip first, so the transfer is under way both ways when the kill comes.
    let m = checked_message(0, &[], &[64 << 20]);
    let receipt = Receipt::of(&m);
    let w = pipe.send(Write::new(m));
    assert_eq!(verify(&read_one(&pipe).await.unwrap()), 0);
    let d = w.await.unwrap();
    d.result.unwrap();
    receipt.check_write(&d.message, "write 0");
    let info = pipe.send(GetInfo).await.unwrap();
    assert_eq!(
        info.tensors_by_channel, 1,
        "the tensor went by cma: {info:?}"
    );
    let mut written = Vec::new();
    for i in 1..=8 {
        let m = checked_message(i, &[], &[64 << 20]);
        written.push(Receipt::of(&m));
        pipe.do_send(Write::new(m).notify(w_to.clone()));
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
        written[i as usize - 1].check_write(&d.message, &format!("write {i}"));
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
