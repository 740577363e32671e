//! The TCP bootstrap of an ibv connection: each side sends a [`Hello`] (queue pair number,
//! LID, GID, PSN, inbox address, key and size), connects its queue pair to the peer's, posts
//! its receives, and then both exchange one ready byte, so neither writes before the other can
//! receive. The TCP connection then stays open, carrying nothing: its hang-up is how a side
//! learns that the peer is gone.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::backend::ibv::{Endpoint, LinkLayer};

/// First bytes of a hello: name and version of this bootstrap.
pub const MAGIC: [u8; 8] = *b"APIBV\0\x01\0";
/// Bytes in a hello.
pub const HELLO_LEN: usize = 8 + 1 + 1 + 2 + 16 + 4 + 4 + 8 + 4 + 8;
/// The ready byte.
const READY: u8 = b'R';

/// What each side tells the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The port's link layer.
    pub link_layer: LinkLayer,
    /// The port number (informational).
    pub port: u8,
    /// The queue pair to connect to.
    pub endpoint: Endpoint,
    /// The inbox ring's address.
    pub inbox_addr: u64,
    /// Its remote key.
    pub inbox_rkey: u32,
    /// Its size in bytes (without the slack).
    pub inbox_cap: u64,
}

fn link_code(l: LinkLayer) -> u8 {
    match l {
        LinkLayer::InfiniBand => 1,
        LinkLayer::Ethernet => 2,
        LinkLayer::Simulated => 3,
    }
}

impl Hello {
    /// The wire form.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        let mut w = 0;
        let mut put = |x: &[u8]| {
            b[w..w + x.len()].copy_from_slice(x);
            w += x.len();
        };
        put(&MAGIC);
        put(&[link_code(self.link_layer), self.port]);
        put(&self.endpoint.lid.to_be_bytes());
        put(&self.endpoint.gid);
        put(&self.endpoint.qpn.to_be_bytes());
        put(&self.endpoint.psn.to_be_bytes());
        put(&self.inbox_addr.to_be_bytes());
        put(&self.inbox_rkey.to_be_bytes());
        put(&self.inbox_cap.to_be_bytes());
        b
    }

    /// Parses a hello; `Err` says what is wrong.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        if b[..8] != MAGIC {
            return Err("not an actorpipe ibv bootstrap (bad magic or version)".into());
        }
        let link_layer = match b[8] {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            3 => LinkLayer::Simulated,
            x => return Err(format!("unknown link layer {x}")),
        };
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4"));
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8"));
        Ok(Hello {
            link_layer,
            port: b[9],
            endpoint: Endpoint {
                lid: u16::from_be_bytes([b[10], b[11]]),
                gid: b[12..28].try_into().expect("16"),
                qpn: u32_at(28),
                psn: u32_at(32),
            },
            inbox_addr: u64_at(36),
            inbox_rkey: u32_at(44),
            inbox_cap: u64_at(48),
        })
    }
}

/// Sends ours and reads the peer's hello.
pub async fn exchange(
    read: &mut (impl AsyncRead + Unpin),
    write: &mut (impl AsyncWrite + Unpin),
    ours: &Hello,
) -> std::io::Result<Hello> {
    write.write_all(&ours.encode()).await?;
    write.flush().await?;
    let mut b = [0u8; HELLO_LEN];
    read.read_exact(&mut b).await?;
    Hello::decode(&b).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Says we are ready to receive and waits until the peer is.
pub async fn ready(
    read: &mut (impl AsyncRead + Unpin),
    write: &mut (impl AsyncWrite + Unpin),
) -> std::io::Result<()> {
    write.write_all(&[READY]).await?;
    write.flush().await?;
    let mut b = [0u8; 1];
    read.read_exact(&mut b).await?;
    if b[0] != READY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "bad ready byte from the ibv peer",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_refuses_garbage() {
        let h = Hello {
            link_layer: LinkLayer::InfiniBand,
            port: 1,
            endpoint: Endpoint {
                qpn: 0x12345,
                lid: 7,
                gid: [9; 16],
                psn: 0xabcdef,
            },
            inbox_addr: 0x7f00_0000_1000,
            inbox_rkey: 0xdead_beef,
            inbox_cap: 1 << 20,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Hello::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[8] = 99;
        assert!(Hello::decode(&bad).is_err());
    }
}
