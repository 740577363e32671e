//! The handshake that turns connected streams into a pipe.
//!
//! ```text
//! connector                                   listener
//!   preamble + Hello{brochure}        ───►       (greet: preamble, then the first frame)
//!                                     ◄───     preamble + Hello{brochure}
//!   Choice{transport, channels, token} ───►     checks it computes the same choice
//!
//! then, for each extra connection the choice needs (control stream on another transport,
//! a channel's own connections):
//!   preamble + Join{token, purpose}   ───►     attaches it to the pipe being set up
//!
//! and once every join is in, on the bootstrap connection:
//!                                     ◄───     Ready (or Refuse{reason})
//! ```
//!
//! A listener that cannot take a new pipe answers the `Hello` with its preamble and
//! `Refuse{reason}` instead, and hangs up ([`refuse`]).
//!
//! The listening side reads first, so one acceptor serves both new pipes (`Hello`) and
//! connections joining one (`Join`). Each side checks the other's preamble (magic and version)
//! before decoding anything else; a listener that sees another version answers with its own
//! preamble so the peer can report both versions. Every step runs under a deadline, so a silent
//! or slow peer cannot hold a listener's resources.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

use crate::auth;
use crate::error::{Error, Origin};
use crate::negotiate::{choose, Brochure, Choice, Hello, Join, Purpose};
use crate::transport::stream::{io_error, read_frame, unexpected, READ_BUFFER};
use crate::transport::{BoxRead, BoxWrite, Stream};
use crate::wire::{encode_serde, Frame, FrameKind, Limits, Preamble, PREAMBLE_LEN};

/// A connection ready to carry frames: buffered read half, write half, addresses.
pub struct Halves {
    /// The read half, with whatever the handshake left buffered.
    pub read: BufReader<BoxRead>,
    /// The write half.
    pub write: BoxWrite,
    /// The peer's address.
    pub peer: String,
    /// Our address.
    pub local: String,
}

impl std::fmt::Debug for Halves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Halves")
            .field("peer", &self.peer)
            .field("local", &self.local)
            .finish()
    }
}

impl Halves {
    /// The same connection with a smaller read buffer of `capacity` bytes (handshakes read
    /// through one of [`READ_BUFFER`] bytes). When the handshake has read ahead, the buffer is
    /// kept as it is, with those bytes.
    pub fn with_read_buffer(self, capacity: usize) -> Halves {
        if capacity >= READ_BUFFER || !self.read.buffer().is_empty() {
            return self;
        }
        Halves {
            read: BufReader::with_capacity(capacity, self.read.into_inner()),
            ..self
        }
    }
}

impl From<Stream> for Halves {
    fn from(s: Stream) -> Self {
        Halves {
            read: BufReader::with_capacity(READ_BUFFER, s.read),
            write: s.write,
            peer: s.peer,
            local: s.local,
        }
    }
}

/// A bootstrap connection after a successful handshake.
#[derive(Debug)]
pub struct Handshaken {
    /// The connection.
    pub halves: Halves,
    /// What both sides agreed on.
    pub choice: Choice,
    /// The peer's brochure (its addresses for other transports).
    pub theirs: Brochure,
    /// The listener's nonce (joining connections prove the secret over it).
    pub listener_nonce: Vec<u8>,
}

/// What the first frame on an accepted connection asked for.
#[derive(Debug)]
pub enum Greeting {
    /// A new pipe: finish with [`accept`].
    Hello(Halves, Hello),
    /// An extra connection for a pipe being set up.
    Join(Halves, Join),
}

async fn deadline<T>(
    d: Duration,
    what: &'static str,
    origin: &Origin,
    f: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(d, f).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            what,
            after: d,
            origin: origin.clone(),
        }),
    }
}

fn origin_of(h: &Halves) -> Origin {
    Origin::new(h.peer.clone(), "")
}

async fn send(h: &mut Halves, bytes: &[u8], what: &'static str) -> Result<(), Error> {
    let origin = origin_of(h);
    h.write
        .write_all(bytes)
        .await
        .map_err(|e| io_error(what, e, &origin))
}

async fn read_preamble(h: &mut Halves) -> Result<(), Error> {
    let origin = origin_of(h);
    let mut pre = [0u8; PREAMBLE_LEN];
    h.read
        .read_exact(&mut pre)
        .await
        .map_err(|e| io_error("reading the peer's preamble", e, &origin))?;
    Preamble::check(&pre, &origin).map(drop)
}

/// Frame limits before the peer has authenticated: nothing larger than a handshake needs.
fn handshake_limits(limits: &Limits) -> Limits {
    Limits {
        max_frame_size: limits.max_frame_size.min(auth::HANDSHAKE_FRAME_LIMIT),
        ..*limits
    }
}

fn unauthenticated(reason: &str, origin: &Origin) -> Error {
    Error::Unauthenticated {
        reason: reason.into(),
        origin: origin.clone(),
    }
}

fn proof_bytes(p: Vec<u8>) -> Option<serde_bytes::ByteBuf> {
    Some(serde_bytes::ByteBuf::from(p))
}

fn refused(reason: String, origin: &Origin) -> Error {
    Error::Refused {
        reason,
        origin: origin.clone(),
    }
}

fn rejected(reason: String) -> Error {
    Error::Unavailable {
        backend: "negotiation".into(),
        reason: format!("the peer refused the pipe: {reason}"),
    }
}

/// Connecting side: exchanges hellos over `stream` and sends the choice, with a fresh token.
/// With a `secret`, the listener must prove it knows it, and we prove it in the choice.
pub async fn connect(
    stream: Stream,
    ours: &Brochure,
    secret: Option<&[u8]>,
    limits: &Limits,
    timeout: Duration,
) -> Result<Handshaken, Error> {
    let mut h = Halves::from(stream);
    let origin = origin_of(&h);
    let limits = &handshake_limits(limits);
    let nonce = auth::nonce();
    deadline(timeout, "handshaking", &origin, async {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&Preamble::OURS.encode());
        encode_serde(
            &mut out,
            FrameKind::Hello,
            &Hello {
                brochure: ours.clone(),
                nonce: nonce.clone(),
                proof: None,
            },
        );
        send(&mut h, &out, "sending the hello").await?;
        read_preamble(&mut h).await?;
        let mut buf = Vec::new();
        let hello = match read_frame(&mut h.read, &mut buf, limits, &origin).await? {
            Frame::Hello(hello) => hello,
            Frame::Reject(r) => return Err(rejected(r)),
            Frame::Refuse(reason) => return Err(refused(reason, &origin)),
            f => return Err(unexpected(f, "a hello", &origin)),
        };
        match (secret, &hello.proof) {
            (Some(k), Some(p)) if auth::check_listener(k, &nonce, &hello.nonce, p) => {}
            (Some(_), Some(_)) => {
                return Err(unauthenticated(
                    "the listener's proof does not match our shared secret",
                    &origin,
                ))
            }
            (Some(_), None) => {
                return Err(unauthenticated(
                    "the listener has no shared secret and ours requires one",
                    &origin,
                ))
            }
            (None, Some(_)) => {
                return Err(unauthenticated(
                    "the listener requires a shared secret and none is configured here",
                    &origin,
                ))
            }
            (None, None) => {}
        }
        let theirs = hello.brochure;
        out.clear();
        let choice = choose(ours, &theirs).map(|mut c| {
            c.token = fresh_token();
            c.proof = secret
                .map(|k| auth::connector_proof(k, &hello.nonce, &nonce, c.token))
                .and_then(proof_bytes);
            c
        });
        match &choice {
            Ok(c) => encode_serde(&mut out, FrameKind::Choice, c),
            Err(e) => encode_serde(&mut out, FrameKind::Reject, &e.0),
        }
        send(&mut h, &out, "sending the choice").await?;
        let choice = choice.map_err(|e| Error::Unavailable {
            backend: "negotiation".into(),
            reason: e.0,
        })?;
        Ok((choice, theirs, hello.nonce))
    })
    .await
    .map(|(choice, theirs, listener_nonce)| Handshaken {
        halves: h,
        choice,
        theirs,
        listener_nonce,
    })
}

/// Listening side: reads the preamble and the first frame of an accepted connection.
pub async fn greet(stream: Stream, limits: &Limits, timeout: Duration) -> Result<Greeting, Error> {
    let mut h = Halves::from(stream);
    let origin = origin_of(&h);
    let limits = &handshake_limits(limits);
    enum First {
        Hello(Hello),
        Join(Join),
    }
    let first = deadline(timeout, "waiting for a hello", &origin, async {
        if let Err(e) = read_preamble(&mut h).await {
            if let Error::Version { .. } = e {
                // Say which version we speak before hanging up.
                let _ = h.write.write_all(&Preamble::OURS.encode()).await;
            }
            return Err(e);
        }
        let mut buf = Vec::new();
        match read_frame(&mut h.read, &mut buf, limits, &origin).await? {
            Frame::Hello(hello) => Ok(First::Hello(hello)),
            Frame::Join(j) => Ok(First::Join(j)),
            f => Err(unexpected(f, "a hello or a join", &origin)),
        }
    })
    .await?;
    Ok(match first {
        First::Hello(theirs) => Greeting::Hello(h, theirs),
        First::Join(j) => Greeting::Join(h, j),
    })
}

/// Listening side, after a `Hello`: answers with our brochure (and, with a `secret`, our proof)
/// and checks the peer's choice (and its proof).
pub async fn accept(
    mut h: Halves,
    hello: Hello,
    ours: &Brochure,
    secret: Option<&[u8]>,
    limits: &Limits,
    timeout: Duration,
) -> Result<Handshaken, Error> {
    let origin = origin_of(&h);
    let limits = &handshake_limits(limits);
    let theirs = hello.brochure;
    let nonce = auth::nonce();
    let choice = deadline(timeout, "handshaking", &origin, async {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&Preamble::OURS.encode());
        encode_serde(
            &mut out,
            FrameKind::Hello,
            &Hello {
                brochure: ours.clone(),
                nonce: nonce.clone(),
                proof: secret
                    .map(|k| auth::listener_proof(k, &hello.nonce, &nonce))
                    .and_then(proof_bytes),
            },
        );
        send(&mut h, &out, "sending the hello").await?;
        let mut buf = Vec::new();
        let got = match read_frame(&mut h.read, &mut buf, limits, &origin).await? {
            Frame::Choice(c) => c,
            Frame::Reject(r) => return Err(rejected(r)),
            f => return Err(unexpected(f, "a choice", &origin)),
        };
        let mut expected = choose(&theirs, ours).map_err(|e| {
            Error::protocol(
                format!("the peer chose {got:?} but nothing is in common: {e}"),
                &origin,
            )
        })?;
        if let Some(k) = secret {
            let ok = got
                .proof
                .as_ref()
                .is_some_and(|p| auth::check_connector(k, &nonce, &hello.nonce, got.token, p));
            if !ok {
                let e = unauthenticated("the connector did not prove the shared secret", &origin);
                out.clear();
                encode_serde(&mut out, FrameKind::Reject, &"authentication failed");
                let _ = send(&mut h, &out, "sending a refusal").await;
                return Err(e);
            }
        }
        expected.token = got.token;
        expected.proof = got.proof.clone();
        if got != expected {
            let e = Error::protocol(
                format!("the peer chose {got:?}, we compute {expected:?}"),
                &origin,
            );
            out.clear();
            encode_serde(&mut out, FrameKind::Reject, &e.to_string());
            let _ = send(&mut h, &out, "sending a refusal").await;
            return Err(e);
        }
        Ok(got)
    })
    .await?;
    Ok(Handshaken {
        halves: h,
        choice,
        theirs,
        listener_nonce: nonce,
    })
}

/// Connecting side: opens an extra connection's conversation with `Join` (with a proof of the
/// secret over the listener's nonce, when there is a secret).
pub async fn join(
    stream: Stream,
    hs: (&[u8], u64),
    purpose: Purpose,
    secret: Option<&[u8]>,
    timeout: Duration,
) -> Result<Halves, Error> {
    let (listener_nonce, token) = hs;
    let mut h = Halves::from(stream);
    let origin = origin_of(&h);
    let mut out = Vec::with_capacity(96);
    out.extend_from_slice(&Preamble::OURS.encode());
    let proof = secret
        .map(|k| auth::join_proof(k, listener_nonce, token, purpose))
        .and_then(proof_bytes);
    encode_serde(
        &mut out,
        FrameKind::Join,
        &Join {
            token,
            purpose,
            proof,
        },
    );
    deadline(
        timeout,
        "joining",
        &origin,
        send(&mut h, &out, "sending a join"),
    )
    .await?;
    Ok(h)
}

/// Listening side: turns away the pipe whose `Hello` came in on `h`, telling the peer why
/// (preamble and `Refuse{reason}`), then hangs up. Best effort within `timeout`: a peer that does
/// not read is simply dropped.
pub async fn refuse(mut h: Halves, reason: &str, timeout: Duration) {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&Preamble::OURS.encode());
    encode_serde(&mut out, FrameKind::Refuse, &reason);
    let _ = tokio::time::timeout(timeout, async {
        send(&mut h, &out, "sending a refusal").await?;
        h.write
            .shutdown()
            .await
            .map_err(|e| io_error("hanging up", e, &origin_of(&h)))
    })
    .await;
}

/// Listening side: turns away a pipe being set up on its bootstrap connection `h` (after the
/// choice: its joins did not all come in), with `Refuse{reason}`. Best effort, as [`refuse`].
pub async fn refuse_pending(mut h: Halves, reason: &str, timeout: Duration) {
    let mut out = Vec::with_capacity(64);
    encode_serde(&mut out, FrameKind::Refuse, &reason);
    let _ = tokio::time::timeout(timeout, send(&mut h, &out, "sending a refusal")).await;
}

/// Listening side: tells the connecting side, on the bootstrap connection, that the whole pipe
/// is accepted (every join is in).
pub async fn confirm(h: &mut Halves, timeout: Duration) -> Result<(), Error> {
    let mut out = Vec::with_capacity(8);
    crate::wire::encode_frame(&mut out, FrameKind::Ready, |_| {});
    let origin = origin_of(h);
    deadline(
        timeout,
        "confirming the pipe",
        &origin,
        send(h, &out, "confirming the pipe"),
    )
    .await
}

/// Connecting side, after its joins: waits on the bootstrap connection `h` until the listener
/// says it accepted the whole pipe (`Ready`). `Refuse` is [`Error::Refused`]; the connection
/// closing is [`Error::PeerClosed`].
pub async fn accepted(h: &mut Halves, limits: &Limits, timeout: Duration) -> Result<(), Error> {
    let origin = origin_of(h);
    let limits = &handshake_limits(limits);
    deadline(
        timeout,
        "waiting for the listener to accept the pipe",
        &origin,
        async {
            let mut buf = Vec::new();
            match read_frame(&mut h.read, &mut buf, limits, &origin).await {
                Ok(Frame::Ready) => Ok(()),
                Ok(Frame::Refuse(reason)) => Err(refused(reason, &origin)),
                Ok(Frame::Reject(r)) => Err(rejected(r)),
                Ok(f) => Err(unexpected(f, "the listener's confirmation", &origin)),
                Err(Error::PeerClosed {
                    reason,
                    graceful,
                    origin,
                }) => Err(Error::PeerClosed {
                    reason: format!("the listener hung up before accepting the pipe ({reason})"),
                    graceful,
                    origin,
                }),
                Err(e) => Err(e),
            }
        },
    )
    .await
}

/// A token naming a pipe during set-up: unpredictable enough that a stray connection cannot
/// guess a pending pipe's (authentication proper comes with the shared secret).
fn fresh_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn halves() -> (Halves, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(4096);
        let (r, w) = tokio::io::split(ours);
        let h = Halves::from(Stream {
            read: Box::new(r),
            write: Box::new(w),
            peer: "test://peer".into(),
            local: "test://local".into(),
        });
        (h, theirs)
    }

    #[tokio::test]
    async fn a_smaller_read_buffer_replaces_an_empty_one() {
        let (h, mut peer) = halves();
        let mut h = h.with_read_buffer(16);
        let sent: Vec<u8> = (0..100).collect();
        peer.write_all(&sent).await.unwrap();
        assert_eq!(h.read.fill_buf().await.unwrap().len(), 16, "16-byte buffer");
        let mut got = vec![0; 100];
        h.read.read_exact(&mut got).await.unwrap();
        assert_eq!(got, sent);
    }

    #[tokio::test]
    async fn bytes_the_handshake_read_ahead_are_kept() {
        let (mut h, mut peer) = halves();
        let sent: Vec<u8> = (0..100).collect();
        peer.write_all(&sent).await.unwrap();
        let mut first = [0; 10];
        h.read.read_exact(&mut first).await.unwrap();
        assert!(!h.read.buffer().is_empty(), "the rest is buffered");
        let mut h = h.with_read_buffer(16);
        let mut rest = vec![0; 90];
        h.read.read_exact(&mut rest).await.unwrap();
        assert_eq!([&first[..], &rest[..]].concat(), sent);
    }
}
