//! Authentication: an optional shared secret turns the hello exchange into a challenge–response.
//!
//! Each side sends a fresh random nonce in its `Hello`. The listener proves it knows the secret
//! with `HMAC-SHA256(secret, "actorpipe v1 listener" ‖ connector nonce ‖ listener nonce)`, the
//! connector with `HMAC-SHA256(secret, "actorpipe v1 connector" ‖ listener nonce ‖ connector
//! nonce ‖ token)`, and every extra connection joining the pipe with `HMAC-SHA256(secret,
//! "actorpipe v1 join" ‖ listener nonce ‖ token ‖ purpose)`. Proofs are compared in constant
//! time; the secret itself never crosses the wire. A peer without the secret cannot open a pipe,
//! and before it has proven itself it can make the listener allocate no more than one
//! handshake frame ([`HANDSHAKE_FRAME_LIMIT`]).
//!
//! This authenticates peers; it does not encrypt or sign the traffic that follows (see
//! docs/security.md).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::negotiate::Purpose;

/// Bytes in a nonce.
pub const NONCE_LEN: usize = 32;

/// Largest frame accepted before the peer has authenticated (hello, choice, join).
pub const HANDSHAKE_FRAME_LIMIT: u32 = 64 << 10;

/// A fresh random nonce from the kernel's generator.
pub fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    let mut filled = 0;
    while filled < n.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `n`.
        let r = unsafe { libc::getrandom(n[filled..].as_mut_ptr().cast(), n.len() - filled, 0) };
        if r > 0 {
            filled += r as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // No kernel randomness (pre-3.17 kernels): fall back to the hasher's random keys.
            use std::hash::{BuildHasher, Hasher};
            for chunk in n.chunks_mut(8) {
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_usize(filled);
                chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
            }
            break;
        }
    }
    n
}

fn mac(secret: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("any key length");
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    m
}

fn purpose_bytes(p: Purpose) -> [u8; 9] {
    let mut b = [0u8; 9];
    match p {
        Purpose::Control => {}
        Purpose::Channel { channel, lane } => {
            b[0] = 1;
            b[1..5].copy_from_slice(&channel.to_le_bytes());
            b[5..9].copy_from_slice(&lane.to_le_bytes());
        }
        Purpose::Remote => b[0] = 2,
    }
    b
}

/// The listener's proof.
pub fn listener_proof(secret: &[u8], connector_nonce: &[u8], listener_nonce: &[u8]) -> Vec<u8> {
    mac(
        secret,
        &[b"actorpipe v1 listener", connector_nonce, listener_nonce],
    )
    .finalize()
    .into_bytes()
    .to_vec()
}

/// The connector's proof.
pub fn connector_proof(
    secret: &[u8],
    listener_nonce: &[u8],
    connector_nonce: &[u8],
    token: u64,
) -> Vec<u8> {
    mac(
        secret,
        &[
            b"actorpipe v1 connector",
            listener_nonce,
            connector_nonce,
            &token.to_le_bytes(),
        ],
    )
    .finalize()
    .into_bytes()
    .to_vec()
}

/// A joining connection's proof.
pub fn join_proof(secret: &[u8], listener_nonce: &[u8], token: u64, purpose: Purpose) -> Vec<u8> {
    mac(
        secret,
        &[
            b"actorpipe v1 join",
            listener_nonce,
            &token.to_le_bytes(),
            &purpose_bytes(purpose),
        ],
    )
    .finalize()
    .into_bytes()
    .to_vec()
}

/// Checks a proof in constant time: recomputes the MAC over `parts` and compares.
fn verify(secret: &[u8], parts: &[&[u8]], proof: &[u8]) -> bool {
    mac(secret, parts).verify_slice(proof).is_ok()
}

/// Checks the listener's proof.
pub fn check_listener(secret: &[u8], cn: &[u8], ln: &[u8], proof: &[u8]) -> bool {
    verify(secret, &[b"actorpipe v1 listener", cn, ln], proof)
}

/// Checks the connector's proof.
pub fn check_connector(secret: &[u8], ln: &[u8], cn: &[u8], token: u64, proof: &[u8]) -> bool {
    verify(
        secret,
        &[b"actorpipe v1 connector", ln, cn, &token.to_le_bytes()],
        proof,
    )
}

/// Checks a joining connection's proof.
pub fn check_join(secret: &[u8], ln: &[u8], token: u64, purpose: Purpose, proof: &[u8]) -> bool {
    verify(
        secret,
        &[
            b"actorpipe v1 join",
            ln,
            &token.to_le_bytes(),
            &purpose_bytes(purpose),
        ],
        proof,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_check_only_with_the_same_secret_and_inputs() {
        let (a, b) = (nonce(), nonce());
        assert_ne!(a, b, "fresh nonces");
        let p = listener_proof(b"s3cret", &a, &b);
        assert!(check_listener(b"s3cret", &a, &b, &p));
        assert!(!check_listener(b"other", &a, &b, &p));
        assert!(
            !check_listener(b"s3cret", &b, &a, &p),
            "roles and order matter"
        );
        let p = connector_proof(b"k", &b, &a, 7);
        assert!(check_connector(b"k", &b, &a, 7, &p));
        assert!(!check_connector(b"k", &b, &a, 8, &p));
        assert!(!check_connector(b"k", &b, &a, 7, &p[..31]));
        let j = Purpose::Channel {
            channel: 1,
            lane: 2,
        };
        let p = join_proof(b"k", &b, 7, j);
        assert!(check_join(b"k", &b, 7, j, &p));
        assert!(!check_join(b"k", &b, 7, Purpose::Control, &p));
    }
}
