//! A reader's own pass on the real providers of `ACTORPIPE_EFA_PROVIDERS` (`tcp;ofi_rxm` and
//! `shm` by default): what it claims, and what it must leave to its pipe's queue.

use std::time::{Duration, Instant};

use super::*;
use crate::backend::efa::engine::Kind;
use crate::backend::efa::tag::{self, Stream};
use crate::backend::efa::tests::{open, providers};

fn receive(pipe: u32, seq: u32) -> Op {
    Op {
        kind: Kind::Recv,
        tag: tag::make(Stream::Raw, pipe, seq),
        mem: vec![0; 16],
        id: seq as u64,
    }
}

/// Sends one 16-byte message of `fill` from `b` to `pipe`'s receive `seq` on `core`'s endpoint,
/// then passes on `core` (claiming for `claim_pipe` with `queue` and `into`) until an end of
/// `pipe` has come out, on its queue or claimed.
fn deliver_one(
    core: &mut Core,
    b: &mut Engine,
    (pb, pipe, seq, fill): (u32, u32, u32, u8),
    queue: &mut mpsc::UnboundedReceiver<Finished>,
    into: &mut VecDeque<Finished>,
    claim_pipe: u32,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let before = queue.len() + into.len();
    // rxm refuses posts (-FI_EAGAIN) while it connects: the inject says no then.
    while !b.inject(
        pb,
        tag::make(Stream::Raw, pipe, seq),
        &[fill; 16],
        &mut |_| {},
    ) {
        assert!(Instant::now() < deadline, "never sent");
        b.progress(&mut |_| {}).expect("cq");
        core.progress().0.expect("cq");
    }
    while queue.len() + into.len() == before {
        assert!(Instant::now() < deadline, "never arrived");
        b.progress(&mut |_| {}).expect("cq");
        let mut claim = Claim {
            pipe: claim_pipe,
            queue,
            into,
        };
        core.progress_claiming(Some(&mut claim)).0.expect("cq");
    }
}

/// A reader's own pass keeps the ends of its pipe only while the pipe's queue is empty: with an
/// end waiting there (handed out by an earlier pass), the new one goes behind it in the queue,
/// so that the reader, which takes claimed ends first, still sees them in order. The ends of
/// other pipes always go to their own queues.
#[test]
fn a_readers_pass_claims_its_ends_only_behind_an_empty_queue() {
    for provider in providers() {
        let mut a = Engine::new(open(provider));
        let mut b = Engine::new(open(provider));
        let (pa, other) = (
            a.attach(b.endpoint().name()).expect("attach"),
            a.attach(b.endpoint().name()).expect("attach"),
        );
        let pb = b.attach(a.endpoint().name()).expect("attach");
        let mut core = Core::new(a);
        let (tx, mut queue) = mpsc::unbounded_channel();
        let (other_tx, mut other_queue) = mpsc::unbounded_channel();
        core.sinks.insert(pa, tx.clone());
        core.sinks.insert(other, other_tx);
        core.post(pa, (0..3).map(|s| receive(pa, s)));
        core.post(other, [receive(other, 0)]);
        let mut into = VecDeque::new();

        // An end an earlier pass handed to the queue, not read yet.
        tx.send(Finished {
            pipe: pa,
            id: 99,
            kind: Kind::Send,
            tag: 0,
            mem: Vec::new(),
            result: Ok(0),
        })
        .unwrap();
        deliver_one(&mut core, &mut b, (pb, pa, 0, 1), &mut queue, &mut into, pa);
        assert!(into.is_empty(), "{provider}: claimed past a waiting end");
        let ids: Vec<u64> = std::iter::from_fn(|| queue.try_recv().ok())
            .map(|f| f.id)
            .collect();
        assert_eq!(ids, [99, 0], "{provider}: the queue keeps the order");
        assert_eq!(core.reader_claims, 0, "{provider}");

        // The queue empty: the pass keeps the pipe's end, and only its pipe's.
        deliver_one(&mut core, &mut b, (pb, pa, 1, 2), &mut queue, &mut into, pa);
        deliver_one(
            &mut core,
            &mut b,
            (pb, other, 0, 3),
            &mut other_queue,
            &mut into,
            pa,
        );
        assert!(
            queue.is_empty(),
            "{provider}: the claimed end went through the queue"
        );
        let f = into.pop_front().expect("claimed");
        assert_eq!((f.pipe, f.id), (pa, 1), "{provider}");
        assert_eq!(f.mem, vec![2; 16], "{provider}");
        assert!(into.is_empty(), "{provider}: claimed another pipe's end");
        let f = other_queue.try_recv().expect("the other pipe's end");
        assert_eq!((f.pipe, f.mem), (other, vec![3; 16]), "{provider}");
        assert_eq!(core.reader_claims, 1, "{provider}");
    }
}
