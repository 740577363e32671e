//! [`CudaCompletion`]: the CUDA-aware completion of a read, as PyTorch's CUDA-aware futures are.
//!
//! A read of CUDA tensors completes (its `ReadDone` is sent) as soon as the copies are
//! *enqueued*. The completion then carries one event per device the read touched, recorded right
//! after the last copy on that device. Correct use of the data is ordered after those events:
//!
//! - [`CudaCompletion::wait_on`] (non-blocking): a stream of yours waits for the events on the
//!   GPU; launch your next kernel on that stream right away, with no CPU stall.
//! - [`CudaCompletion::wait`] (blocking): the calling thread waits until the copies are done,
//!   after which any stream, and the host, may use the data.
//!
//! The events come from the devices' pools and go back when the completion is dropped; a wait
//! enqueued before that stays valid (the driver captures the event's state at the wait).

use super::{CudaStream, Event};

/// One event per device a read of CUDA tensors touched; see the module docs.
#[derive(Debug, Default)]
pub struct CudaCompletion {
    events: Vec<Event>,
    /// The stream each event was recorded on (as an address; 0 when unknown).
    streams: Vec<usize>,
}

impl CudaCompletion {
    /// A completion made of these events (at most one per device).
    pub fn new(events: Vec<Event>) -> Self {
        let streams = vec![0; events.len()];
        CudaCompletion { events, streams }
    }

    /// Adds the event of a device (replacing an earlier one of the same device: the later
    /// record covers the earlier work on the same stream).
    pub fn push(&mut self, event: Event) {
        let d = event.gpu().ordinal();
        if let Some(i) = self.events.iter().position(|e| e.gpu().ordinal() == d) {
            self.events.remove(i);
            self.streams.remove(i);
        }
        self.events.push(event);
        self.streams.push(0);
    }

    /// Adds an event recorded on `stream`: it replaces an earlier event of the same device and
    /// stream (the later record covers the earlier work), and joins the others. A read whose
    /// tensors of one device were consumed on one stream (the usual case) thus carries one event
    /// per device; tensors of one device on several streams carry one per stream.
    pub fn push_on(&mut self, event: Event, stream: &CudaStream) {
        let (d, s) = (event.gpu().ordinal(), stream.cu_stream() as usize);
        let same = |(e, at): (&Event, &usize)| e.gpu().ordinal() == d && *at == s;
        if let Some(i) = self.events.iter().zip(&self.streams).position(same) {
            self.events[i] = event;
        } else {
            self.events.push(event);
            self.streams.push(s);
        }
    }

    /// Whether no device was touched (nothing to wait for).
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The devices touched.
    pub fn devices(&self) -> impl Iterator<Item = u32> + '_ {
        self.events.iter().map(|e| e.gpu().ordinal())
    }

    /// The events, one per device.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Non-blocking wait: work queued on `stream` from now on runs after every copy of the read.
    pub fn wait_on(&self, stream: &CudaStream) -> crate::Result<()> {
        self.events.iter().try_for_each(|e| e.wait_on(stream))
    }

    /// Blocking wait: returns once every copy of the read has completed.
    pub fn wait(&self) -> crate::Result<()> {
        self.events.iter().try_for_each(|e| e.synchronize())
    }

    /// Whether every copy has completed, without waiting.
    pub fn is_complete(&self) -> crate::Result<bool> {
        for e in &self.events {
            if !e.is_complete()? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
