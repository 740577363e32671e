//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use actix::Addr;
use actorpipe::*;

/// Deterministic bytes for a seed: xorshift64 words.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for b in chunks.into_remainder() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    v
}

/// A 64-bit checksum (FNV-1a over 8-byte words, then the tail and the length).
pub fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        h ^= u64::from_le_bytes(c.try_into().unwrap());
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ data.len() as u64
}

/// Bounds a test step so a bug shows up as a failure, never as a hung suite.
pub async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {secs} s"),
    }
}

/// A context restricted to TCP and the basic channel: for tests of the pipe's own logic that
/// assert what happens on a byte stream (other backends have their conformance suites).
pub fn tcp_basic() -> ContextBuilder {
    Context::builder().without("shm").only_channels(&["basic"])
}

/// A listening context: its address, its URL, and the queue of accepted pipes.
pub struct Server {
    pub ctx: Addr<Context>,
    pub url: String,
    pub listener: Addr<Listener>,
    pub accepted: tokio::sync::mpsc::UnboundedReceiver<Accepted>,
}

impl Server {
    pub async fn start(builder: ContextBuilder, url: &str) -> Server {
        let ctx = builder.start();
        let (r, accepted) = inbox::<Accepted>();
        let l = ctx
            .send(Listen::new([url], r))
            .await
            .unwrap()
            .expect("listen");
        Server {
            ctx,
            url: l.urls[0].clone(),
            listener: l.listener,
            accepted,
        }
    }

    pub async fn next(&mut self) -> Addr<Pipe> {
        within(10, "accepting a pipe", self.accepted.recv())
            .await
            .expect("listener alive")
            .pipe
    }
}

/// A connected pair of pipes over loopback TCP: (client side, server side).
pub async fn pair(
    client: ContextBuilder,
    server: ContextBuilder,
) -> (Addr<Pipe>, Addr<Pipe>, Server) {
    let mut s = Server::start(server, "tcp://127.0.0.1:0").await;
    let c = client.start();
    let tx = c
        .send(Connect::new(&s.url))
        .await
        .unwrap()
        .expect("connect");
    let rx = s.next().await;
    (tx, rx, s)
}

/// Reads one whole message: descriptor, allocation, read.
pub async fn read_one(pipe: &Addr<Pipe>) -> Result<Message> {
    let d = pipe.send(ReadDescriptor).await.unwrap().descriptor?;
    let alloc = Allocation::for_descriptor(&d)?;
    let done = pipe.send(Read::new(alloc)).await.unwrap();
    done.result.map(|_| done.message)
}

/// A message whose metadata records the checksums of its contents.
pub fn checked_message(index: u64, payload_sizes: &[usize], tensor_sizes: &[usize]) -> Message {
    let mut m = Message::new();
    let mut sums = Vec::new();
    for (j, &n) in payload_sizes.iter().enumerate() {
        let data = pattern(index * 1000 + j as u64, n);
        sums.push(checksum(&data).to_string());
        m.payloads.push(Payload {
            data,
            metadata: format!("p{j}").into_bytes(),
        });
    }
    sums.push("|".into());
    for (j, &n) in tensor_sizes.iter().enumerate() {
        let data = pattern(index * 1000 + 500 + j as u64, n);
        sums.push(checksum(&data).to_string());
        let mut t = Tensor::cpu(data);
        t.metadata = format!("t{j}").into_bytes();
        m.tensors.push(t);
    }
    m.metadata = format!("{index};{}", sums.join(",")).into_bytes();
    m
}

/// Checks a received message against the checksums in its metadata; returns its index.
pub fn verify(m: &Message) -> u64 {
    let meta = String::from_utf8(m.metadata.clone()).expect("utf8 metadata");
    let (index, sums) = meta.split_once(';').expect("index;sums");
    let sums: Vec<&str> = sums.split(',').collect();
    let split = sums.iter().position(|s| *s == "|").expect("separator");
    assert_eq!(split, m.payloads.len(), "payload count of message {index}");
    assert_eq!(
        sums.len() - split - 1,
        m.tensors.len(),
        "tensor count of message {index}"
    );
    for (j, p) in m.payloads.iter().enumerate() {
        assert_eq!(p.metadata, format!("p{j}").into_bytes());
        assert_eq!(
            checksum(&p.data).to_string(),
            sums[j],
            "payload {j} of message {index}"
        );
    }
    for (j, t) in m.tensors.iter().enumerate() {
        assert_eq!(t.metadata, format!("t{j}").into_bytes());
        let data = t.buffer.as_cpu().expect("cpu tensor");
        assert_eq!(
            checksum(data).to_string(),
            sums[split + 1 + j],
            "tensor {j} of message {index}"
        );
    }
    index.parse().expect("index")
}

/// A small seeded generator for test plans.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The sizes the conformance plans draw from; 64 MiB is drawn rarely to bound the run time.
pub fn draw_size(rng: &mut Rng) -> usize {
    const SIZES: [usize; 6] = [0, 1, 31, 32, 4 << 10, 1 << 20];
    if rng.below(100) == 0 {
        64 << 20
    } else {
        SIZES[rng.below(SIZES.len() as u64) as usize]
    }
}
