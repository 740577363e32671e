//! The efa channel's set-up list: each side's domains (fabric and endpoint address), which the
//! channel's driver writes on its lane after its hello (`actors/hardware/efa/channel/driver.rs`).
//!
//! Per domain, ours first: a u16 LE length and the fabric's name (UTF-8), then a u16 LE length
//! and the endpoint's address (not empty). At least one domain, at most [`MAX_DOMAINS`], in at
//! most [`MAX_HELLO`] bytes.

/// The longest domain list accepted from a peer (bytes).
pub const MAX_HELLO: u32 = 64 << 10;

/// The most domains a list may name.
pub const MAX_DOMAINS: usize = 64;

/// Our list: per domain, its fabric and endpoint address.
pub fn encode_domains(domains: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = Vec::new();
    for (fabric, name) in domains {
        for part in [fabric.as_bytes(), name] {
            b.extend_from_slice(&(part.len() as u16).to_le_bytes());
            b.extend_from_slice(part);
        }
    }
    b
}

/// The peer's list: (fabric, endpoint address) per domain; `None` if malformed.
pub fn decode_domains(mut b: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if b.len() > MAX_HELLO as usize {
        return None;
    }
    let take = |b: &mut &[u8]| -> Option<Vec<u8>> {
        let n = u16::from_le_bytes(b.get(..2)?.try_into().ok()?) as usize;
        let v = b.get(2..2 + n)?.to_vec();
        *b = &b[2 + n..];
        Some(v)
    };
    let mut out = Vec::new();
    while !b.is_empty() {
        let fabric = String::from_utf8(take(&mut b)?).ok()?;
        let name = take(&mut b)?;
        if name.is_empty() || out.len() == MAX_DOMAINS {
            return None;
        }
        out.push((fabric, name));
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_decodes_to_what_was_encoded() {
        let list = encode_domains(&[("tcp", b"addr-1"), ("lo", b"\x00\x01")]);
        let back = decode_domains(&list).expect("well formed");
        assert_eq!(
            back,
            vec![
                ("tcp".into(), b"addr-1".to_vec()),
                ("lo".into(), vec![0, 1])
            ]
        );
    }

    #[test]
    fn malformed_lists_are_refused() {
        assert_eq!(decode_domains(&[]), None, "empty");
        assert_eq!(decode_domains(&[5, 0, b'a']), None, "short fabric");
        assert_eq!(
            decode_domains(&encode_domains(&[("f", b"")])),
            None,
            "empty address"
        );
        let bad_utf8 = [1, 0, 0xff, 1, 0, 1];
        assert_eq!(decode_domains(&bad_utf8), None, "fabric not UTF-8");
        let many: Vec<(&str, &[u8])> = (0..=MAX_DOMAINS).map(|_| ("f", &b"a"[..])).collect();
        assert_eq!(
            decode_domains(&encode_domains(&many)),
            None,
            "too many domains"
        );
    }
}
