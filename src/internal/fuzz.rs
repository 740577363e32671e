//! The fuzz targets' checks, one function per target (`fuzz/fuzz_targets/`): each takes
//! arbitrary bytes, feeds them to a decoder that reads what a peer sent, and panics only if an
//! invariant breaks. The fuzz binaries call them under libFuzzer; `tests/integration/fuzz_seeds.rs`
//! replays the seeds kept in `fuzz/seeds/<target>/` through them on every test run.

use crate::error::Origin;
use crate::wire::{check_frame_len, decode_frame, Limits};

/// The limit sets the wire target decodes under: the defaults, and the tight ones a cautious
/// deployment might set (4 KiB frames, 4 payloads, 4 tensors, 256 bytes of metadata).
pub fn wire_limits() -> [Limits; 2] {
    [
        Limits::default(),
        Limits {
            max_frame_size: 4096,
            max_payloads: 4,
            max_tensors: 4,
            max_metadata_size: 256,
            max_payload_size: 1 << 20,
            max_tensor_size: 1 << 20,
        },
    ]
}

/// `wire_decoder`, one frame: the input as one frame's bytes after its length prefix (the
/// length check, then the decoder). A refused frame is an error, never a panic.
pub fn wire_frame(data: &[u8], limits: &Limits) {
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    if check_frame_len(len, limits).is_ok() {
        let _ = decode_frame(data, limits);
    }
}

/// `wire_decoder`, a stream: the input as a byte stream, read frame after frame (the length
/// prefix included) until the bytes run out or one is refused.
pub async fn wire_stream(data: &[u8], limits: &Limits) {
    let mut r = data;
    let mut buf = Vec::new();
    let origin = Origin::default();
    while crate::transport::stream::read_frame(&mut r, &mut buf, limits, &origin)
        .await
        .is_ok()
    {}
}

/// `shm_ring`: a ring driven by the input's operations, the peer storing arbitrary values in
/// the shared header between them (see the ring's `hostile_peer`).
pub fn shm_ring(data: &[u8]) {
    crate::backend::shm::ring::hostile_peer(data);
}

/// `efa_control` (feature `efa`; without it, nothing): what an efa peer sends outside the data: the channel's domain list (decoded,
/// and any list that decodes encodes back to the same bytes), and the 64-bit tags of its
/// messages (split into their fields and made again; a tag's credits, and the count of
/// receives a rendezvous word grants, never exceed their bounds).
pub fn efa_control(data: &[u8]) {
    #[cfg(feature = "efa")]
    efa_control_checks(data);
    #[cfg(not(feature = "efa"))]
    let _ = data;
}

#[cfg(feature = "efa")]
fn efa_control_checks(data: &[u8]) {
    use crate::backend::efa::{hello, tag};
    if let Some(list) = hello::decode_domains(data) {
        assert!(!list.is_empty() && list.len() <= hello::MAX_DOMAINS);
        let pairs: Vec<(&str, &[u8])> = list.iter().map(|(f, a)| (f.as_str(), &a[..])).collect();
        assert_eq!(
            hello::encode_domains(&pairs),
            data,
            "a decoded list encodes back"
        );
    }
    for w in data.chunks(8) {
        let mut b = [0u8; 8];
        b[..w.len()].copy_from_slice(w);
        let t = u64::from_le_bytes(b);
        let _ = tag::split(t);
        assert!(tag::credits(t) <= tag::MAX_CREDITS);
        let _ = tag::on_the_wire(t);
        let _ = tag::received(t, t.rotate_left(17));
    }
}

/// `ibv_control` (feature `ibv`; without it, nothing): what an ibv peer sends outside the data: the transport's bootstrap hello
/// (decoded; a hello that decodes is checked against ours as the transport does) and the
/// channel's write requests (decoded and encoded back to the same bytes).
pub fn ibv_control(data: &[u8]) {
    #[cfg(feature = "ibv")]
    {
        use crate::backend::ibv::channel::core::{Request, REQUEST_LEN};
        use crate::backend::ibv::transport::bootstrap::{Hello, HELLO_LEN};
        let mut hello = [0u8; HELLO_LEN];
        let n = data.len().min(HELLO_LEN);
        hello[..n].copy_from_slice(&data[..n]);
        if let Ok(h) = Hello::decode(&hello) {
            let _ = crate::backend::ibv::transport::check_peer(&h, &h);
        }
        for r in data.chunks(REQUEST_LEN) {
            let mut b = [0u8; REQUEST_LEN];
            b[..r.len()].copy_from_slice(r);
            assert_eq!(Request::decode(&b).encode(), b, "a request encodes back");
        }
    }
    #[cfg(not(feature = "ibv"))]
    let _ = data;
}
