//! Which channel each tensor of a pipe goes through: one per device pair, as negotiated, among
//! the channels this pipe carries.
//!
//! The sender routes a tensor by (its device's kind, its target device's kind) to the channel
//! negotiated for that pair, or, when there is none, to the one for its source's kind on both
//! ends: a target device is a suggestion. The receiver checks that the channel a descriptor
//! names is one it carries, for the tensor's source kind, and learns from the channel's pair the
//! kind of memory the tensor lands in.

use crate::message::Device;
use crate::negotiate::{Choice, DeviceKind, DevicePair};

use super::super::channel::ChannelKind;

/// The routing table of one pipe.
#[derive(Debug, Clone)]
pub(crate) struct Routes {
    /// The channel for each device pair, indexed by [`slot`].
    by_pair: [Option<usize>; 4],
    /// Each negotiated channel's kind and pair, by index in the choice.
    channels: Vec<(ChannelKind, DevicePair)>,
}

fn slot(p: DevicePair) -> usize {
    let k = |d: DeviceKind| match d {
        DeviceKind::Cpu => 0,
        DeviceKind::Cuda => 1,
    };
    k(p.source) * 2 + k(p.target)
}

impl Routes {
    /// The table for a negotiated choice whose channels run as `kinds` (same order), with host
    /// tensors on channel `cpu`. A channel of another pair is used only if its kind carries CUDA
    /// tensors ([`ChannelKind::carries_cuda`]): a pipe never routes to a channel it cannot drive.
    pub fn new(choice: &Choice, kinds: &[ChannelKind], cpu: usize) -> Self {
        let mut by_pair = [None; 4];
        by_pair[slot(DevicePair::CPU)] = Some(cpu);
        let mut channels = Vec::with_capacity(kinds.len());
        for (i, (c, kind)) in choice.channels.iter().zip(kinds).enumerate() {
            channels.push((*kind, c.devices));
            if c.devices != DevicePair::CPU && kind.carries_cuda() {
                by_pair[slot(c.devices)].get_or_insert(i);
            }
        }
        Routes { by_pair, channels }
    }

    /// The channel for a device pair, if the pipe carries one.
    pub fn route(&self, pair: DevicePair) -> Option<usize> {
        self.by_pair[slot(pair)]
    }

    /// The channel a tensor on `source`, suggested for `target`, goes through: the pair's
    /// channel, else the one for the source's kind on both ends.
    pub fn for_tensor(&self, source: Device, target: Option<Device>) -> Option<usize> {
        let source = DeviceKind::from(source);
        let target = target.map_or(source, DeviceKind::from);
        let pair = |target| DevicePair { source, target };
        self.route(pair(target))
            .or_else(|| self.route(pair(source)))
    }

    /// The kind of channel `ch`.
    pub fn kind(&self, ch: usize) -> Option<ChannelKind> {
        self.channels.get(ch).map(|c| c.0)
    }

    /// Checks an incoming tensor's route: channel `ch` must be the one this pipe uses for its
    /// source kind and the pair the channel serves. Returns the target device as the receiver's
    /// descriptor should show it: its kind is the kind of memory the channel lands the tensor
    /// in (a suggestion the sender could not follow is replaced).
    pub fn check(
        &self,
        ch: usize,
        source: Device,
        target: Option<Device>,
    ) -> Result<Option<Device>, String> {
        let pair = self
            .channels
            .get(ch)
            .map(|c| c.1)
            .filter(|p| self.route(*p) == Some(ch))
            .ok_or_else(|| format!("channel {ch} is not one this pipe carries"))?;
        if pair.source != DeviceKind::from(source) {
            return Err(format!(
                "channel {ch} moves {pair} tensors, not tensors from {source}"
            ));
        }
        let landing = target.unwrap_or(source);
        Ok(match (pair.target, DeviceKind::from(landing)) {
            (want, have) if want == have => target,
            // Routed to host memory although suggested for a GPU.
            (DeviceKind::Cpu, _) => Some(Device::Cpu),
            // To a GPU with no GPU named: the sender's device when it is one.
            (DeviceKind::Cuda, _) => match source {
                Device::Cuda(_) => None,
                Device::Cpu => {
                    return Err(format!(
                    "channel {ch} lands {pair} tensors in GPU memory, but the tensor names no GPU"
                ))
                }
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::negotiate::{ChannelChoice, DeviceKind::*};

    fn choice(channels: &[(&str, DeviceKind, DeviceKind)]) -> Choice {
        Choice {
            transport: "shm".into(),
            channels: channels
                .iter()
                .map(|(name, source, target)| ChannelChoice {
                    name: (*name).into(),
                    devices: DevicePair {
                        source: *source,
                        target: *target,
                    },
                    connections: 0,
                })
                .collect(),
            token: 0,
            proof: None,
            remote: false,
        }
    }

    const BASIC: ChannelKind = ChannelKind::Basic {
        chunk_size: 1 << 20,
    };

    #[test]
    fn host_only_pipes_route_everything_to_the_cpu_channel() {
        let c = choice(&[("basic", Cpu, Cpu)]);
        let r = Routes::new(&c, &[BASIC], 0);
        assert_eq!(r.for_tensor(Device::Cpu, None), Some(0));
        // A suggestion no channel follows: host memory it is.
        assert_eq!(r.for_tensor(Device::Cpu, Some(Device::Cuda(1))), Some(0));
        assert_eq!(r.for_tensor(Device::Cuda(0), None), None);
        assert_eq!(r.for_tensor(Device::Cuda(0), Some(Device::Cpu)), None);
        assert_eq!(
            r.check(0, Device::Cpu, Some(Device::Cuda(1))),
            Ok(Some(Device::Cpu)),
            "the receiver's descriptor says where it lands"
        );
        assert_eq!(r.check(0, Device::Cpu, None), Ok(None));
        assert!(r.check(0, Device::Cuda(0), None).is_err());
        assert!(r.check(1, Device::Cpu, None).is_err());
    }

    #[test]
    fn channels_the_pipe_cannot_drive_are_never_routed_to() {
        // A CUDA channel negotiated (a peer of another build) but run as basic here.
        let c = choice(&[("basic", Cpu, Cpu), ("cuda_ipc", Cuda, Cuda)]);
        let r = Routes::new(&c, &[BASIC, BASIC], 0);
        assert_eq!(r.for_tensor(Device::Cuda(0), None), None);
        assert!(r.check(1, Device::Cuda(0), None).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_tensors_go_to_the_channel_of_their_pair() {
        let x = ChannelKind::CudaXth { pipe: 7 };
        let c = choice(&[
            ("xth", Cpu, Cpu),
            ("cuda_xth", Cpu, Cuda),
            ("cuda_xth", Cuda, Cpu),
            ("cuda_xth", Cuda, Cuda),
        ]);
        let r = Routes::new(&c, &[ChannelKind::Xth { pipe: 7 }, x, x, x], 0);
        assert_eq!(r.for_tensor(Device::Cpu, None), Some(0));
        assert_eq!(r.for_tensor(Device::Cpu, Some(Device::Cpu)), Some(0));
        assert_eq!(r.for_tensor(Device::Cpu, Some(Device::Cuda(1))), Some(1));
        assert_eq!(r.for_tensor(Device::Cuda(0), Some(Device::Cpu)), Some(2));
        assert_eq!(r.for_tensor(Device::Cuda(0), None), Some(3));
        assert_eq!(
            r.for_tensor(Device::Cuda(0), Some(Device::Cuda(1))),
            Some(3)
        );
        // The receiver's side of the same routes.
        assert_eq!(
            r.check(1, Device::Cpu, Some(Device::Cuda(1))),
            Ok(Some(Device::Cuda(1)))
        );
        assert_eq!(
            r.check(2, Device::Cuda(0), Some(Device::Cpu)),
            Ok(Some(Device::Cpu))
        );
        assert_eq!(r.check(3, Device::Cuda(2), None), Ok(None));
        // A host tensor named on a cuda->cuda channel, a channel index out of range.
        assert!(r.check(3, Device::Cpu, Some(Device::Cuda(0))).is_err());
        assert!(r.check(9, Device::Cuda(0), None).is_err());
        // A cpu->cuda channel for a tensor that names no GPU.
        assert!(r.check(1, Device::Cpu, None).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn between_processes_cuda_ipc_carries_the_pairs_it_serves() {
        // What two processes of one host negotiate: cuda_ipc for cuda->cuda and cuda->cpu,
        // nothing for cpu->cuda (cuda_basic is not carried).
        let i = ChannelKind::CudaIpc { pipe: 3 };
        let c = choice(&[
            ("basic", Cpu, Cpu),
            ("cuda_ipc", Cuda, Cuda),
            ("cuda_ipc", Cuda, Cpu),
        ]);
        let r = Routes::new(&c, &[BASIC, i, i], 0);
        assert_eq!(r.for_tensor(Device::Cuda(0), None), Some(1));
        assert_eq!(
            r.for_tensor(Device::Cuda(1), Some(Device::Cuda(0))),
            Some(1)
        );
        assert_eq!(r.for_tensor(Device::Cuda(0), Some(Device::Cpu)), Some(2));
        assert_eq!(r.for_tensor(Device::Cpu, Some(Device::Cuda(0))), Some(0));
        assert_eq!(
            r.check(2, Device::Cuda(0), Some(Device::Cpu)),
            Ok(Some(Device::Cpu))
        );
        assert_eq!(r.check(1, Device::Cuda(0), None), Ok(None));
        assert!(r.check(1, Device::Cpu, Some(Device::Cuda(0))).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn without_a_pair_channel_a_cuda_tensor_stays_on_its_kind() {
        let x = ChannelKind::CudaXth { pipe: 7 };
        let c = choice(&[("basic", Cpu, Cpu), ("cuda_xth", Cuda, Cuda)]);
        let r = Routes::new(&c, &[BASIC, x], 0);
        // cuda->cpu is not negotiated: the tensor lands on a GPU, and the descriptor says so.
        assert_eq!(r.for_tensor(Device::Cuda(0), Some(Device::Cpu)), Some(1));
        assert_eq!(r.check(1, Device::Cuda(0), Some(Device::Cpu)), Ok(None));
        // cpu->cuda neither: host memory.
        assert_eq!(r.for_tensor(Device::Cpu, Some(Device::Cuda(0))), Some(0));
    }
}
