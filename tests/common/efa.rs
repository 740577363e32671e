//! Endpoint-level helpers of the efa tests (`tests/efa.rs`, `tests/efa_direct.rs`): endpoints,
//! pipes between them, and an exchange that checks order and integrity.

use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::internal::backend::efa::engine::{Finished, Kind, Op};
#[cfg(feature = "faults")]
use actorpipe::internal::backend::efa::faults::Faults;
use actorpipe::internal::backend::efa::tag::{self, Stream};
use actorpipe::internal::hardware::efa::{
    EndpointConfig, FabricAttach, FabricDescribe, FabricEndpoint, FabricPost, FabricShare, Poster,
};
use tokio::sync::mpsc;

/// Names the libfabric providers the efa suites run on, comma-separated (a provider's own name
/// may hold `;`, as `tcp;ofi_rxm` does, never `,`): `ACTORPIPE_EFA_PROVIDERS=efa` on a machine
/// with the device runs the same trials on it. Every suite that runs on providers takes them
/// from [`providers`] (the library's unit tests read the same variable,
/// `backend::efa::tests::providers`).
pub const PROVIDERS_VAR: &str = "ACTORPIPE_EFA_PROVIDERS";

/// The providers when [`PROVIDERS_VAR`] is unset or empty: the two every libfabric build has.
pub const DEFAULT_PROVIDERS: &str = "tcp;ofi_rxm,shm";

/// The providers the efa suites run on, in the order [`PROVIDERS_VAR`] lists them.
pub fn providers() -> Vec<String> {
    let var = std::env::var(PROVIDERS_VAR).unwrap_or_default();
    let list = if var.trim().is_empty() {
        DEFAULT_PROVIDERS
    } else {
        &var
    };
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect()
}

/// Whether `provider` is one the suites run on (trials about one provider's own behaviour run
/// only where it is listed).
pub fn listed(provider: &str) -> bool {
    providers().iter().any(|p| p == provider)
}

/// Why a provider cannot be tested here, if it cannot: the line a trial on it reports.
pub fn missing(provider: &str) -> Option<String> {
    actorpipe::internal::backend::efa::InfoList::get(Some(provider))
        .err()
        .map(|e| format!("skipped: no {provider} provider here ({e})"))
}

/// One end of a pipe between two endpoints.
pub struct Side {
    pub ep: Addr<FabricEndpoint>,
    pub pipe: u32,
    pub done: mpsc::UnboundedReceiver<Finished>,
    pub poster: Poster,
    /// Post through `poster` (no mailbox hop), not with `FabricPost`.
    pub direct: bool,
}

/// Tags of an [`exchange`]: one per message (what pipes do), or the same for all, so that the
/// provider matches sends to receives in the order they reach it, and any reordering of a
/// pipe's posts (the backlog's order rule broken) puts a message into another's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tags {
    PerMessage,
    Same,
}

impl Side {
    /// Posts `ops` for this side's pipe, directly or through the actor.
    pub fn post(&self, ops: Vec<Op>) {
        if self.direct {
            self.poster.post(self.pipe, ops);
        } else {
            self.ep.do_send(FabricPost {
                pipe: self.pipe,
                ops,
            });
        }
    }

    /// The same side, posting directly.
    pub fn direct(self) -> Side {
        Side {
            direct: true,
            ..self
        }
    }
}

/// Spin mode, as the trials that repeat a case with it use it.
pub const SPIN: Duration = Duration::from_micros(50);

/// The default configuration with `faults`, in spin mode if `spin`.
#[cfg(feature = "faults")]
pub fn config(faults: Faults, spin: bool) -> EndpointConfig {
    EndpointConfig {
        faults,
        ..plain(spin)
    }
}

/// The default configuration, in spin mode if `spin`.
pub fn plain(spin: bool) -> EndpointConfig {
    EndpointConfig {
        busy_poll: if spin { SPIN } else { Duration::ZERO },
        ..EndpointConfig::default()
    }
}

pub async fn endpoints(
    provider: &str,
    config: EndpointConfig,
) -> (Addr<FabricEndpoint>, Addr<FabricEndpoint>) {
    let a = FabricEndpoint::open(provider, None, config).expect("endpoint a");
    let b = FabricEndpoint::open(provider, None, config).expect("endpoint b");
    (a, b)
}

/// A pipe between endpoints `a` and `b`: each side's number, queues.
pub async fn pipe(a: &Addr<FabricEndpoint>, b: &Addr<FabricEndpoint>) -> (Side, Side) {
    let na = a.send(FabricDescribe).await.unwrap().name;
    let nb = b.send(FabricDescribe).await.unwrap().name;
    let (sa, da) = mpsc::unbounded_channel();
    let (sb, db) = mpsc::unbounded_channel();
    let pa = a
        .send(FabricAttach { peer: nb, sink: sa })
        .await
        .unwrap()
        .unwrap();
    let pb = b
        .send(FabricAttach { peer: na, sink: sb })
        .await
        .unwrap()
        .unwrap();
    (
        Side {
            ep: a.clone(),
            pipe: pa,
            done: da,
            poster: a.send(FabricShare).await.unwrap(),
            direct: false,
        },
        Side {
            ep: b.clone(),
            pipe: pb,
            done: db,
            poster: b.send(FabricShare).await.unwrap(),
            direct: false,
        },
    )
}

fn size_of(i: u64) -> usize {
    let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    match i % 8 {
        0 => 0,
        1..=3 => (h % 64) as usize + 1,
        4 | 5 => (h % 8192) as usize,
        6 => (h % (128 << 10)) as usize,
        _ => (h % (1 << 20)) as usize,
    }
}

fn bytes(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (i as usize ^ k.wrapping_mul(13)) as u8)
        .collect()
}

/// `count` messages of random shape from `tx` to `rx`, at most `window` in flight: every
/// one arrives intact, and ends come in post order on both sides.
pub async fn exchange(tx: Side, rx: Side, count: u64, window: u64) -> (Side, Side) {
    exchange_tagged(tx, rx, count, window, Tags::PerMessage).await
}

/// [`exchange`] with the tags of `tags`.
pub async fn exchange_tagged(
    mut tx: Side,
    mut rx: Side,
    count: u64,
    window: u64,
    tags: Tags,
) -> (Side, Side) {
    let deadline = Instant::now() + Duration::from_secs(180);
    let (mut posted, mut received, mut sent) = (0u64, 0u64, 0u64);
    while received < count {
        assert!(Instant::now() < deadline, "stuck at {received}/{count}");
        while posted < count && posted < received + window {
            let len = size_of(posted);
            let seq = if tags == Tags::Same { 0 } else { posted as u32 };
            let t = tag::make(Stream::Raw, rx.pipe, seq);
            rx.post(vec![Op {
                kind: Kind::Recv,
                tag: t,
                mem: vec![0; len],
                id: posted,
            }]);
            tx.post(vec![Op {
                kind: Kind::Send,
                tag: t,
                mem: bytes(posted, len),
                id: posted,
            }]);
            posted += 1;
        }
        tokio::select! {
            Some(f) = rx.done.recv() => {
                assert_eq!(f.id, received, "receives end in order");
                let len = size_of(f.id);
                assert_eq!(f.result.as_ref().ok(), Some(&len), "{:?}", f.result);
                assert!(f.mem == bytes(f.id, len), "message {} intact", f.id);
                received += 1;
            }
            Some(f) = tx.done.recv() => {
                assert_eq!(f.id, sent, "sends end in order");
                assert!(f.result.is_ok(), "{:?}", f.result);
                sent += 1;
            }
            () = tokio::time::sleep(Duration::from_secs(60)) => {
                panic!("no end for 60 s at {received}/{count}: progress stalled");
            }
        }
    }
    while sent < count {
        let f = tx.done.recv().await.expect("send ends");
        assert_eq!((f.id, f.result.is_ok()), (sent, true));
        sent += 1;
    }
    (tx, rx)
}
