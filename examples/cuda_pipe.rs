//! A GPU tensor through a pipe, and work queued on the receiving stream right after `ReadDone`,
//! with no CPU stall (feature `cuda`; docs/cuda.md).
//!
//! Two contexts of this process connect (so the `cuda_xth` channel carries the tensor: one
//! device-to-device copy on the receiver's stream, ordered after the sender's stream by an
//! event). The `Consumer` actor receives each message; in its `ReadDone` handler it makes its
//! own stream wait for the read's completion on the GPU (`CudaCompletion::wait_on`) and
//! immediately queues the next step on that stream (here a device-to-device copy standing in for
//! a kernel). Only at the end does it read the result back to check it.
//!
//! Run: `cargo run --example cuda_pipe --features cuda`. Without a GPU it says so and exits 0.

use std::sync::Arc;

use actix::prelude::*;
use actorpipe::cuda::{self, CudaBuffer, StreamLease};
use actorpipe::{
    inbox, Accepted, Connect, Listen, Message as PipeMessage, Op, Pipe, ReadDone, Receive, Tensor,
    Write,
};

const LEN: usize = 64 << 20;
const MESSAGES: u8 = 4;

/// Receives GPU tensors and queues work on them right away.
struct Consumer {
    pipe: Addr<Pipe>,
    gpu: Arc<cuda::Gpu>,
    /// The stream the consumer's work runs on.
    stream: StreamLease,
    /// Where that work writes, one buffer per message.
    outputs: Vec<CudaBuffer>,
    /// The received messages, alive until the work on them has run.
    inputs: Vec<PipeMessage>,
    done: Option<tokio::sync::oneshot::Sender<Vec<CudaBuffer>>>,
}

impl Actor for Consumer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.pipe
            .do_send(Receive::new().notify(ctx.address().recipient()));
    }
}

impl Handler<ReadDone> for Consumer {
    type Result = ();

    fn handle(&mut self, r: ReadDone, ctx: &mut Self::Context) {
        if let Err(e) = r.result {
            eprintln!("read failed: {e}");
            return System::current().stop();
        }
        // The copies into the received buffer are enqueued, not necessarily done: order our
        // work after them on the GPU. No CPU thread waits.
        r.cuda.wait_on(&self.stream).expect("stream wait");
        let input = r.message.tensors[0].buffer.as_cuda().expect("a GPU tensor");
        let out = CudaBuffer::alloc(self.gpu.ordinal(), input.len()).expect("device memory");
        // SAFETY: both are `len` bytes of this device; `input` lives until the copy has run
        // (kept below until the end), `out` in `outputs`.
        unsafe {
            cuda::copy_async(
                (out.device_ptr(), &self.gpu),
                (input.device_ptr(), &self.gpu),
                input.len(),
                &self.stream,
            )
        }
        .expect("queue the next step");
        println!(
            "message {:?}: ReadDone with events on {:?}; next step queued",
            r.message.metadata,
            r.cuda.devices().collect::<Vec<_>>()
        );
        self.outputs.push(out);
        // The received buffer must outlive the work queued on it: kept to the end here (an
        // application would hand it back with `Receive::reusing` once its work has run).
        self.inputs.push(r.message);
        if self.outputs.len() == MESSAGES as usize {
            if let Some(tx) = self.done.take() {
                let _ = tx.send(std::mem::take(&mut self.outputs));
            }
        } else {
            self.pipe
                .do_send(Receive::new().notify(ctx.address().recipient()));
        }
    }
}

fn main() {
    if let Err(why) = cuda::available() {
        println!("no CUDA GPU here ({why}): nothing to show");
        return;
    }
    let system = System::new();
    system.block_on(async {
        let gpu = cuda::gpu(0).expect("cuda:0");
        let server = actorpipe::Context::builder().start();
        let (accepted, mut incoming) = inbox::<Accepted>();
        let l = server
            .send(Listen::new(["tcp://127.0.0.1:0"], accepted))
            .await
            .expect("context alive")
            .expect("listen");
        let client = actorpipe::Context::builder().start();
        let tx = client
            .send(Connect::new(&l.urls[0]))
            .await
            .expect("context alive")
            .expect("connect");
        let rx = incoming.recv().await.expect("a pipe").pipe;
        let (done, outputs) = tokio::sync::oneshot::channel();
        Consumer {
            pipe: rx,
            gpu: gpu.clone(),
            stream: gpu.lease_stream().expect("stream"),
            outputs: Vec::new(),
            inputs: Vec::new(),
            done: Some(done),
        }
        .start();
        let mut sent = Vec::new();
        for i in 0..MESSAGES {
            let data: Vec<u8> = (0..LEN).map(|k| (k as u8).wrapping_mul(i + 1)).collect();
            let mut t = CudaBuffer::alloc(0, LEN).expect("device memory");
            t.copy_from_host(&data).expect("fill");
            let m = PipeMessage::new()
                .with_metadata(vec![i])
                .with_tensor(Tensor::cuda(t));
            let w = tx.send(Write::new(m)).await.expect("pipe alive");
            w.result.expect("write");
            sent.push(data);
        }
        let outputs = outputs.await.expect("consumer done");
        for (i, (out, data)) in outputs.iter().zip(&sent).enumerate() {
            assert_eq!(&out.to_vec().expect("read back"), data, "message {i}");
        }
        println!(
            "{MESSAGES} GPU tensors of {} MiB received and used",
            LEN >> 20
        );
        let _keep = l.listener;
    });
}
