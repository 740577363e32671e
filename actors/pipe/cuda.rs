//! Completions of CUDA-routed tensors (feature `cuda`): a sent tensor's buffer back, or a
//! received tensor's copy enqueued with the event the read's [`CudaCompletion`] gathers.
//!
//! [`CudaCompletion`]: crate::cuda::CudaCompletion

use super::super::channel::CudaDone;
use super::*;

impl StreamHandler<CudaDone> for Pipe {
    fn handle(&mut self, done: CudaDone, _: &mut Self::Context) {
        let span = self.span.clone();
        let _entered = span.enter();
        match done {
            CudaDone::Wrote {
                seq,
                index,
                buffer,
                result,
            } => self.tensor_written(seq, index, buffer, result, false),
            CudaDone::Read {
                seq,
                index,
                buffer,
                event,
                result,
            } => {
                if let (Some(ReadState::Running { cuda, .. }), Some((event, stream))) =
                    (self.tensor_read(seq, index, buffer, result, false), event)
                {
                    cuda.push_on(event, &stream);
                }
                self.pump_reads();
            }
        }
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}
