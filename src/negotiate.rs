//! Negotiation: two brochures in, one choice of transport and channels out.
//!
//! Each side lists what it can run (an [`Offer`] per transport, a [`ChannelOffer`] per channel),
//! each with a priority and a *domain descriptor*: a string that must be equal on both sides for
//! the backend to work between them (anything for TCP; boot id and namespaces for shared memory;
//! a process token for in-process channels). The connecting side computes the [`Choice`] with
//! [`choose`] and sends it; the listening side computes it too and refuses the pipe if the two
//! differ. Both use the connecting side's priorities, so the answer is a pure function of the two
//! brochures.

use serde::{Deserialize, Serialize};

/// A transport one side can run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// Backend name (`tcp`, `shm`, …).
    pub name: String,
    /// Higher wins.
    pub priority: i32,
    /// Must be equal on both sides for the backend to connect them.
    pub domain: String,
    /// Where the peer can reach this side over this backend, as URLs.
    pub addresses: Vec<String>,
}

/// The kind of memory at one end of a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// CUDA device memory.
    Cuda,
}

impl From<crate::message::Device> for DeviceKind {
    fn from(d: crate::message::Device) -> Self {
        match d {
            crate::message::Device::Cpu => DeviceKind::Cpu,
            crate::message::Device::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Source and target memory kinds a channel moves between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DevicePair {
    /// Where the sender's buffer lives.
    pub source: DeviceKind,
    /// Where the receiver's buffer lives.
    pub target: DeviceKind,
}

impl DevicePair {
    /// CPU to CPU.
    pub const CPU: DevicePair = DevicePair {
        source: DeviceKind::Cpu,
        target: DeviceKind::Cpu,
    };
}

impl std::fmt::Display for DevicePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}->{}", self.source, self.target)
    }
}

/// A channel one side can run, for one device pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelOffer {
    /// Backend name (`basic`, `xth`, …).
    pub name: String,
    /// Higher wins.
    pub priority: i32,
    /// Must be equal on both sides.
    pub domain: String,
    /// What it moves between.
    pub devices: DevicePair,
    /// Connections of its own it needs per pipe (lanes for mpt, a side connection for cma).
    pub connections: u32,
}

/// Everything one side can run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Brochure {
    /// Transports, any order.
    pub transports: Vec<Offer>,
    /// Channels, any order.
    pub channels: Vec<ChannelOffer>,
    /// Whether the sender serves and issues one-sided operations on registered memory over a
    /// lane of each pipe (docs/remote.md); peers from before it say nothing, read as `false`.
    #[serde(default)]
    pub remote: bool,
}

/// The handshake frame each side sends first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// What the sender can run.
    pub brochure: Brochure,
    /// A fresh random challenge (see [`crate::auth`]).
    #[serde(with = "serde_bytes")]
    pub nonce: Vec<u8>,
    /// The listener's answer to the connector's challenge, when it has a secret.
    pub proof: Option<serde_bytes::ByteBuf>,
}

/// The channel chosen for one device pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelChoice {
    /// Channel name.
    pub name: String,
    /// The device pair it serves.
    pub devices: DevicePair,
    /// Connections of its own that join the pipe at set-up.
    pub connections: u32,
}

/// The outcome of negotiation; a tensor's descriptor names its channel by index in `channels`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    /// The transport for the control stream.
    pub transport: String,
    /// One channel per device pair both sides serve, sorted by device pair.
    pub channels: Vec<ChannelChoice>,
    /// Names the pipe when extra connections join it (set by the connecting side, random).
    pub token: u64,
    /// The connector's answer to the listener's challenge, when it has a secret.
    pub proof: Option<serde_bytes::ByteBuf>,
    /// Whether the pipe has a remote-memory lane (both sides offered one).
    #[serde(default)]
    pub remote: bool,
}

/// Why an extra connection joins a pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Purpose {
    /// It carries the control stream (the chosen transport differs from the bootstrap one).
    Control,
    /// It is connection `lane` of channel `channel` (index in [`Choice::channels`]).
    Channel {
        /// Channel index.
        channel: u32,
        /// Connection index within the channel.
        lane: u32,
    },
    /// It carries the pipe's one-sided operations on registered memory (requests both ways,
    /// served by the owner of the region; docs/remote.md).
    Remote,
}

/// First frame on a connection that joins a pipe being set up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Join {
    /// The pipe's token from its [`Choice`].
    pub token: u64,
    /// What this connection is for.
    pub purpose: Purpose,
    /// Proof of the shared secret, when there is one.
    pub proof: Option<serde_bytes::ByteBuf>,
}

impl Choice {
    /// Every extra connection this choice needs, besides the bootstrap one, in the order the
    /// connecting side opens them.
    pub fn joins(&self, bootstrap: &str) -> Vec<Purpose> {
        let mut v = Vec::new();
        if self.transport != bootstrap {
            v.push(Purpose::Control);
        }
        for (i, c) in self.channels.iter().enumerate() {
            for lane in 0..c.connections {
                v.push(Purpose::Channel {
                    channel: i as u32,
                    lane,
                });
            }
        }
        if self.remote {
            v.push(Purpose::Remote);
        }
        v
    }
}

impl Choice {
    /// The index of the channel serving `pair`, if any.
    pub fn channel_for(&self, pair: DevicePair) -> Option<usize> {
        self.channels.iter().position(|c| c.devices == pair)
    }
}

/// Why two brochures have nothing in common.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoCommonBackend(pub String);

impl std::fmt::Display for NoCommonBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Computes the choice for a pipe from the connecting side's and the listening side's brochures.
///
/// The transport is the connector's highest-priority transport that the listener also offers
/// with an equal domain (ties broken by name). For every device pair both serve, the channel is
/// chosen the same way. No common transport, or no common CPU->CPU channel, is an error.
pub fn choose(connector: &Brochure, listener: &Brochure) -> Result<Choice, NoCommonBackend> {
    let transport = connector
        .transports
        .iter()
        .filter(|o| {
            listener
                .transports
                .iter()
                .any(|p| p.name == o.name && p.domain == o.domain)
        })
        .max_by(|a, b| a.priority.cmp(&b.priority).then(b.name.cmp(&a.name)))
        .ok_or_else(|| {
            NoCommonBackend(format!(
                "no transport in common (we offer {}, the peer offers {})",
                names(connector.transports.iter().map(|o| &o.name)),
                names(listener.transports.iter().map(|o| &o.name)),
            ))
        })?;
    let mut pairs: Vec<DevicePair> = connector.channels.iter().map(|c| c.devices).collect();
    pairs.sort();
    pairs.dedup();
    let mut channels = Vec::new();
    for pair in pairs {
        let best = connector
            .channels
            .iter()
            .filter(|c| c.devices == pair)
            .filter(|c| {
                listener
                    .channels
                    .iter()
                    .any(|p| p.devices == pair && p.name == c.name && p.domain == c.domain)
            })
            .max_by(|a, b| a.priority.cmp(&b.priority).then(b.name.cmp(&a.name)));
        if let Some(c) = best {
            channels.push(ChannelChoice {
                name: c.name.clone(),
                devices: pair,
                connections: c.connections,
            });
        }
    }
    if !channels.iter().any(|c| c.devices == DevicePair::CPU) {
        return Err(NoCommonBackend(
            "no channel in common for cpu->cpu tensors".into(),
        ));
    }
    // Two contexts of one process need no lane: their remote operations are copies (`xth`).
    let remote = connector.remote && listener.remote && !channels.iter().any(|c| c.name == "xth");
    Ok(Choice {
        transport: transport.name.clone(),
        channels,
        token: 0,
        proof: None,
        remote,
    })
}

fn names<'a>(it: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = it.map(|s| s.as_str()).collect();
    if v.is_empty() {
        "nothing".into()
    } else {
        v.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, priority: i32, domain: &str) -> Offer {
        Offer {
            name: name.into(),
            priority,
            domain: domain.into(),
            addresses: vec![],
        }
    }

    fn c(name: &str, priority: i32, domain: &str, devices: DevicePair) -> ChannelOffer {
        ChannelOffer {
            name: name.into(),
            priority,
            domain: domain.into(),
            devices,
            connections: 0,
        }
    }

    const CUDA: DevicePair = DevicePair {
        source: DeviceKind::Cuda,
        target: DeviceKind::Cuda,
    };

    #[test]
    fn highest_priority_with_matching_domain_wins() {
        let a = Brochure {
            transports: vec![t("tcp", 0, ""), t("shm", 10, "boot-a")],
            channels: vec![
                c("basic", 0, "", DevicePair::CPU),
                c("cma", 10, "boot-a", DevicePair::CPU),
                c("cuda_ipc", 5, "gpu-a", CUDA),
            ],
            remote: false,
        };
        let mut b = a.clone();
        let choice = choose(&a, &b).unwrap();
        assert_eq!(choice.transport, "shm");
        assert_eq!(
            choice.channels[choice.channel_for(DevicePair::CPU).unwrap()].name,
            "cma"
        );
        assert!(choice.channel_for(CUDA).is_some());

        // Another host: the shm and cma domains differ, cuda is not offered.
        b.transports[1].domain = "boot-b".into();
        b.channels[1].domain = "boot-b".into();
        b.channels.pop();
        let choice = choose(&a, &b).unwrap();
        assert_eq!(choice.transport, "tcp");
        assert_eq!(choice.channels.len(), 1);
        assert_eq!(choice.channels[0].name, "basic");
        assert_eq!(choice.channel_for(CUDA), None);
    }

    #[test]
    fn both_sides_compute_the_same_answer() {
        let a = Brochure {
            transports: vec![t("tcp", 1, ""), t("x", 1, "")],
            channels: vec![c("basic", 0, "", DevicePair::CPU)],
            remote: false,
        };
        // Ties are broken by name, so the order of offers does not matter.
        let mut b = a.clone();
        b.transports.reverse();
        assert_eq!(choose(&a, &b).unwrap(), choose(&a, &a).unwrap());
        assert_eq!(choose(&a, &b).unwrap().transport, "tcp");
    }

    #[test]
    fn joins_list_every_extra_connection() {
        let mut a = Brochure {
            transports: vec![t("tcp", 0, ""), t("shm", 10, "h")],
            channels: vec![c("mpt", 5, "", DevicePair::CPU)],
            remote: false,
        };
        a.channels[0].connections = 2;
        let choice = choose(&a, &a).unwrap();
        assert_eq!(
            choice.joins("tcp"),
            vec![
                Purpose::Control,
                Purpose::Channel {
                    channel: 0,
                    lane: 0
                },
                Purpose::Channel {
                    channel: 0,
                    lane: 1
                }
            ]
        );
        assert_eq!(choice.joins("shm").len(), 2);
    }

    #[test]
    fn nothing_in_common_is_an_error_that_says_what_each_offered() {
        let a = Brochure {
            transports: vec![t("tcp", 0, "")],
            channels: vec![c("basic", 0, "", DevicePair::CPU)],
            remote: false,
        };
        let b = Brochure {
            transports: vec![t("shm", 0, "")],
            channels: vec![],
            remote: false,
        };
        let e = choose(&a, &b).unwrap_err();
        assert!(e.0.contains("we offer tcp, the peer offers shm"), "{e}");
        let b = Brochure {
            transports: vec![t("tcp", 0, "")],
            channels: vec![],
            remote: false,
        };
        assert!(choose(&a, &b).unwrap_err().0.contains("cpu->cpu"));
    }
}
