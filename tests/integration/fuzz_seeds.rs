//! The fuzz targets' seeds (`fuzz/seeds/<target>/`), replayed through the targets' checks
//! (`actorpipe::internal::fuzz`) on every test run: inputs that once found a bug, and the
//! minimized corpus of the last long runs, keep being decoded the way the fuzzers decode them.
//! `write_seeds` (run by hand) writes the starting inputs the fuzzers grow from.

use std::path::{Path, PathBuf};

use actorpipe::internal::fuzz;
use actorpipe::internal::wire::{self, Ack, ChunkHeader, FrameKind};

/// A fuzz target's check of one input.
type Check = fn(&[u8]);

/// Every fuzz target, with its check.
fn targets() -> Vec<(&'static str, Check)> {
    vec![
        ("wire_decoder", wire_decoder),
        ("shm_ring", fuzz::shm_ring),
        ("efa_control", fuzz::efa_control),
        ("ibv_control", fuzz::ibv_control),
    ]
}

fn wire_decoder(data: &[u8]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime");
    for limits in &fuzz::wire_limits() {
        fuzz::wire_frame(data, limits);
        rt.block_on(fuzz::wire_stream(data, limits));
    }
}

fn seeds(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

#[test]
fn every_target_replays_its_seeds() {
    for (target, check) in targets() {
        let dir = seeds(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{target}: no seeds in {}", dir.display());
        for f in files {
            let data = std::fs::read(&f).expect("a seed");
            let caught = std::panic::catch_unwind(|| check(&data));
            assert!(
                caught.is_ok(),
                "{target}: seed {} fails its check",
                f.display()
            );
        }
    }
}

/// Writes the starting seeds: valid inputs of each target, which the fuzzers mutate.
/// `cargo test --all-features --test integration fuzz_seeds::write_seeds -- --ignored`
#[test]
#[ignore = "writes fuzz/seeds/; run by hand"]
fn write_seeds() {
    let mut out: Vec<(&str, &str, Vec<u8>)> = Vec::new();
    // wire_decoder: a stream of frames (length prefix and body), and one frame's body alone.
    let frame = |kind: FrameKind, body: &dyn Fn(&mut Vec<u8>)| {
        let mut b = Vec::new();
        wire::encode_frame(&mut b, kind, |v| body(v));
        b
    };
    let ack = frame(FrameKind::Ack, &|v| {
        wire::encode_ack(
            v,
            &Ack {
                seq: 7,
                tensor: 1,
                ok: true,
            },
        )
    });
    let chunk = frame(FrameKind::Chunk, &|v| {
        wire::encode_chunk(
            v,
            &ChunkHeader {
                seq: 3,
                tensor: 0,
                offset: 4096,
                length: 16,
            },
        )
    });
    let msg = actorpipe::Message::new()
        .with_metadata(b"meta".to_vec())
        .with_payload(actorpipe::Payload::new(vec![1, 2, 3]))
        .with_tensor(actorpipe::Tensor::cpu(vec![0u8; 64]));
    let desc = frame(FrameKind::Descriptor, &|v| {
        wire::encode_descriptor(v, 9, &msg, |_, _| 0)
    });
    out.push((
        "wire_decoder",
        "stream-ack-chunk-descriptor",
        [&ack[..], &chunk, &desc].concat(),
    ));
    out.push(("wire_decoder", "descriptor-body", desc[4..].to_vec()));
    // shm_ring: writes and reads only (the bytes must come back in order), then the peer's
    // stores among them.
    out.push((
        "shm_ring",
        "write-read",
        vec![0, 40, 1, 20, 1, 30, 0, 200, 1, 255, 5, 0],
    ));
    let mut tamper = vec![0, 50, 2, 0];
    tamper.extend_from_slice(&u64::MAX.to_le_bytes());
    tamper.extend_from_slice(&[1, 60, 3, 0]);
    tamper.extend_from_slice(&(1u64 << 40).to_le_bytes());
    tamper.extend_from_slice(&[0, 10, 4, 0, 1, 0, 0, 0, 1, 0, 0, 0, 5, 0]);
    out.push(("shm_ring", "hostile-positions", tamper));
    // efa_control: a domain list of two domains; tags.
    let mut list = Vec::new();
    for (fabric, addr) in [
        ("172.17.0.0/16", &b"\x02\x00\x13\x88\xac\x11\x00\x02"[..]),
        ("lo", b"ep"),
    ] {
        for part in [fabric.as_bytes(), addr] {
            list.extend_from_slice(&(part.len() as u16).to_le_bytes());
            list.extend_from_slice(part);
        }
    }
    out.push(("efa_control", "two-domains", list));
    out.push((
        "efa_control",
        "tags",
        (0..4u64)
            .flat_map(|i| (i << 60 | i << 24 | i).to_le_bytes())
            .collect(),
    ));
    // ibv_control: a hello's bytes (magic, simulated link), then a write request.
    let mut hello = b"APIBV\x00\x01\x00".to_vec();
    hello.extend_from_slice(&[3, 1, 0, 0]);
    hello.resize(64, 7);
    out.push(("ibv_control", "hello-and-request", hello));
    for (target, name, data) in out {
        let dir = seeds(target);
        std::fs::create_dir_all(&dir).expect("the seeds' directory");
        std::fs::write(dir.join(name), data).expect("a seed");
    }
}
