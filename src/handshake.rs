//! The handshake that turns a connected stream into a pipe's control connection.
//!
//! ```text
//! connector                              listener
//!   preamble + Hello{brochure}  ───►
//!                               ◄───  preamble + Hello{brochure}
//!   Choice (or Reject{reason})  ───►     checks it computes the same choice
//! ```
//!
//! Each side checks the other's preamble (magic and version) before decoding anything else, and
//! the whole exchange runs under one deadline, so a silent or slow peer cannot hold a listener's
//! resources.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

use crate::error::{Error, Origin};
use crate::negotiate::{choose, Brochure, Choice, Hello};
use crate::transport::stream::{io_error, read_frame, unexpected, READ_BUFFER};
use crate::transport::{BoxRead, BoxWrite, Stream};
use crate::wire::{encode_serde, Frame, FrameKind, Limits, Preamble, PREAMBLE_LEN};

/// Which end of the connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Dialed out; computes and sends the choice.
    Connect,
    /// Accepted; checks the choice.
    Accept,
}

/// A stream after a successful handshake.
pub struct Handshaken {
    /// The read half, with whatever the handshake left buffered.
    pub read: BufReader<BoxRead>,
    /// The write half.
    pub write: BoxWrite,
    /// What both sides agreed on.
    pub choice: Choice,
    /// The peer's address.
    pub peer: String,
    /// Our address.
    pub local: String,
}

impl std::fmt::Debug for Handshaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handshaken")
            .field("choice", &self.choice)
            .field("peer", &self.peer)
            .finish()
    }
}

/// Runs the handshake on `stream` within `deadline`.
pub async fn handshake(
    stream: Stream,
    role: Role,
    ours: &Brochure,
    limits: &Limits,
    deadline: Duration,
) -> Result<Handshaken, Error> {
    let origin = Origin::new(stream.peer.clone(), "tcp");
    let Stream {
        read,
        mut write,
        peer,
        local,
    } = stream;
    let mut read = BufReader::with_capacity(READ_BUFFER, read);
    let exchange = async {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&Preamble::OURS.encode());
        encode_serde(
            &mut out,
            FrameKind::Hello,
            &Hello {
                brochure: ours.clone(),
            },
        );
        write
            .write_all(&out)
            .await
            .map_err(|e| io_error("sending the hello", e, &origin))?;
        let mut pre = [0u8; PREAMBLE_LEN];
        read.read_exact(&mut pre)
            .await
            .map_err(|e| io_error("reading the peer's preamble", e, &origin))?;
        Preamble::check(&pre, &origin)?;
        let mut buf = Vec::new();
        let theirs = match read_frame(&mut read, &mut buf, limits, &origin).await? {
            Frame::Hello(h) => h.brochure,
            Frame::Reject(r) => return Err(rejected(r)),
            f => return Err(unexpected(f, "a hello", &origin)),
        };
        match role {
            Role::Connect => {
                out.clear();
                let choice = choose(ours, &theirs);
                match &choice {
                    Ok(c) => encode_serde(&mut out, FrameKind::Choice, c),
                    Err(e) => encode_serde(&mut out, FrameKind::Reject, &e.0),
                }
                write
                    .write_all(&out)
                    .await
                    .map_err(|e| io_error("sending the choice", e, &origin))?;
                choice.map_err(|e| Error::Unavailable {
                    backend: "negotiation".into(),
                    reason: e.0,
                })
            }
            Role::Accept => {
                let got = match read_frame(&mut read, &mut buf, limits, &origin).await? {
                    Frame::Choice(c) => c,
                    Frame::Reject(r) => return Err(rejected(r)),
                    f => return Err(unexpected(f, "a choice", &origin)),
                };
                let expected = choose(&theirs, ours).map_err(|e| {
                    Error::protocol(
                        format!("the peer chose {got:?} but nothing is in common: {e}"),
                        &origin,
                    )
                })?;
                if got != expected {
                    return Err(Error::protocol(
                        format!("the peer chose {got:?}, we compute {expected:?}"),
                        &origin,
                    ));
                }
                Ok(got)
            }
        }
    };
    let choice = match tokio::time::timeout(deadline, exchange).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::Timeout {
                what: "handshaking",
                after: deadline,
                origin,
            })
        }
    };
    Ok(Handshaken {
        read,
        write,
        choice,
        peer,
        local,
    })
}

fn rejected(reason: String) -> Error {
    Error::Unavailable {
        backend: "negotiation".into(),
        reason: format!("the peer refused the pipe: {reason}"),
    }
}
