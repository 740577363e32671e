//! The 64-bit tags of tagged messages: which pipe, which stream of it, which message.
//!
//! ```text
//!  63     59 58    56 55                  32 31                               0
//! +---------+--------+----------------------+----------------------------------+
//! | credits | stream |  pipe (receiver's)   |  sequence number (per stream)    |
//! +---------+--------+----------------------+----------------------------------+
//! ```
//!
//! The pipe field is the *receiving* side's pipe number on its endpoint (the two sides tell each
//! other theirs when the pipe is set up), so tags are unique at every receiver without
//! `FI_DIRECTED_RECV`: a receive posted for (stream, pipe, seq) can only match that one message.
//! Ordering therefore never depends on the provider's matching order: the descriptor says how
//! many messages follow and the receiver posts exactly those tags (the descriptors give the
//! ordering). Sequence numbers wrap at 2^32; at most a few thousand are outstanding at once.
//!
//! The credits field is not part of a message's name, and never goes on the wire: a message of
//! the efa stream carries there, between the stream and the engine, the credits its sender
//! returns for the opposite direction (see `actors::fabric::stream`). The engine sends them as
//! the message's remote CQ data ([`on_the_wire`]) and gives a completed receive its posted
//! name with the credits its message carried ([`received`]): not every provider reports a
//! received message's tag (libfabric 1.17's rxm with its passthru on reports 0), while remote
//! CQ data arrives on all of them. Every other message leaves the field zero.

/// Bits for the pipe number: 16 M pipes per endpoint.
pub const PIPE_BITS: u32 = 24;
/// The largest pipe number.
pub const MAX_PIPE: u32 = (1 << PIPE_BITS) - 1;

/// What a tagged message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Stream {
    /// The pipe's control stream (the `efa` transport): its messages, and the credits its
    /// reader returns (to the peer's writing half's pipe).
    Control = 1,
    /// Tensor bytes (the `efa` channel).
    Tensor = 3,
    /// Raw test and benchmark traffic.
    Raw = 4,
    /// The first message of a control stream on a connection-based provider (`ofi_rxm`): one
    /// side speaks first, so the two never open the provider's connection at once.
    FirstWord = 5,
}

/// Where the credits field starts.
const CREDIT_SHIFT: u32 = 59;
/// The largest number of credits one tag carries.
pub const MAX_CREDITS: u32 = (1 << (64 - CREDIT_SHIFT)) - 1;
/// The credits field's bits (never on the wire: [`on_the_wire`]).
pub const IGNORE: u64 = (MAX_CREDITS as u64) << CREDIT_SHIFT;

/// The tag of message `seq` of `stream` for the receiver's pipe `pipe` (no credits).
pub fn make(stream: Stream, pipe: u32, seq: u32) -> u64 {
    debug_assert!(pipe <= MAX_PIPE);
    ((stream as u64) << 56) | (((pipe & MAX_PIPE) as u64) << 32) | seq as u64
}

/// `tag` carrying `credits` (at most [`MAX_CREDITS`]) in its credits field.
pub fn with_credits(tag: u64, credits: u32) -> u64 {
    debug_assert!(credits <= MAX_CREDITS);
    (tag & !IGNORE) | ((u64::from(credits) & u64::from(MAX_CREDITS)) << CREDIT_SHIFT)
}

/// The credits a received message's tag carries.
pub fn credits(tag: u64) -> u32 {
    (tag >> CREDIT_SHIFT) as u32
}

/// What a send of `tag` puts on the wire: the tag without its credits field, and the credits
/// as the message's remote CQ data (0: none, a plain send).
pub fn on_the_wire(tag: u64) -> (u64, u64) {
    (tag & !IGNORE, u64::from(credits(tag)))
}

/// The tag a receive posted for `posted` ends with when its message carried `data` as remote
/// CQ data: the posted name, with the credits the data holds (at most [`MAX_CREDITS`]).
pub fn received(posted: u64, data: u64) -> u64 {
    with_credits(posted, data.min(u64::from(MAX_CREDITS)) as u32)
}

/// The parts of a tag: (stream byte, pipe, seq), credits left out.
pub fn split(tag: u64) -> (u8, u32, u32) {
    (
        ((tag & !IGNORE) >> 56) as u8,
        ((tag >> 32) as u32) & MAX_PIPE,
        tag as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_stays_in_its_field() {
        for (s, p, q) in [
            (Stream::Control, 0, 0),
            (Stream::Tensor, MAX_PIPE, u32::MAX),
            (Stream::Raw, 12345, 7),
        ] {
            let t = make(s, p, q);
            assert_eq!(split(t), (s as u8, p, q));
        }
        assert_ne!(
            make(Stream::Control, 1, 0),
            make(Stream::Tensor, 1, 0),
            "streams differ"
        );
        assert_ne!(
            make(Stream::Raw, 1, 5),
            make(Stream::Raw, 2, 5),
            "pipes differ"
        );
    }

    #[test]
    fn credits_ride_outside_the_name() {
        let t = make(Stream::Control, MAX_PIPE, u32::MAX);
        for n in [0, 1, 16, MAX_CREDITS] {
            let c = with_credits(t, n);
            assert_eq!(credits(c), n);
            assert_eq!(c & !IGNORE, t, "the name is untouched");
            assert_eq!(split(c), split(t));
        }
        assert_eq!(
            credits(with_credits(with_credits(t, 7), 2)),
            2,
            "replaced, not added"
        );
        // Every stream's byte fits below the field.
        for s in [
            Stream::Control,
            Stream::Tensor,
            Stream::Raw,
            Stream::FirstWord,
        ] {
            assert_eq!(make(s, 0, 0) & IGNORE, 0);
        }
    }
}
