//! KV-cache blocks from a prefill worker to a decode worker, one-sided (docs/remote.md).
//!
//! The `Prefill` actor registers a pool of KV blocks with its context, fills them, and sends
//! the pool's descriptor to the decode side in a message's metadata. The `Decode` actor reads
//! the blocks its request needs, scattered over the pool, into one contiguous buffer with a
//! single batched `RemoteRead`, leaving a notification for the prefill side, and starts its
//! next step once the read completes. The prefill side hears the notification after the read,
//! and could then free or reuse those blocks.
//!
//! Both workers run here as two contexts of one process. Built with feature `cuda` on a host with
//! a GPU, the pool and the decode buffer are device memory of GPU 0 (path `cuda_xth`; between two
//! processes of the host it would be `cuda_ipc`), and the decode step's next work goes on its
//! buffer's stream; elsewhere both are host memory (path `xth`). Run: `cargo run --example
//! kv_transfer` (or `--features cuda`).

use actix::prelude::*;
use actorpipe::prelude::*;
use actorpipe::remote::{
    Notification, Region, RegionDescriptor, RemoteDone, RemoteRead, Span, SubscribeNotifications,
};

/// Bytes per KV block (one layer's keys and values for 16 tokens, say).
const BLOCK: u64 = 64 << 10;
/// Blocks in the prefill worker's pool.
const POOL_BLOCKS: u64 = 512;
/// The blocks the decode worker's request needs, in the order its next step wants them.
const WANTED: [u64; 8] = [7, 3, 100, 101, 102, 250, 511, 0];

/// Stops the system once both workers are done (the notification and the read's completion
/// may come in either order).
fn one_done() {
    static DONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if DONE.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
        System::current().stop();
    }
}

/// What block `b` holds: its number in every byte (the prefill step's output, in this example).
fn block_byte(b: u64) -> u8 {
    (b % 251) as u8
}

struct Prefill {
    ctx: Addr<actorpipe::Context>,
    region: Option<Region>,
}

impl Actor for Prefill {
    type Context = Context<Self>;
}

/// Sets up the pool and hands its descriptor to the decode worker on `pipe`.
struct Start(Addr<Pipe>);

impl actix::Message for Start {
    type Result = ();
}

impl Handler<Start> for Prefill {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, Start(pipe): Start, ctx: &mut Self::Context) -> Self::Result {
        let me = ctx.address().recipient::<Notification>();
        let owner = self.ctx.clone();
        Box::pin(
            async move {
                owner
                    .send(SubscribeNotifications(me))
                    .await
                    .expect("context");
                let pool: Vec<u8> = (0..POOL_BLOCKS)
                    .flat_map(|b| std::iter::repeat_n(block_byte(b), BLOCK as usize))
                    .collect();
                let region = owner.register(memory(pool)).await.expect("register");
                let descriptor = region.descriptor().to_bytes();
                println!(
                    "prefill: registered {POOL_BLOCKS} blocks of {} KiB; descriptor {} bytes",
                    BLOCK >> 10,
                    descriptor.len()
                );
                let m = actorpipe::Message::new().with_metadata(descriptor);
                pipe.write(m).await.expect("send the descriptor");
                region
            }
            .into_actor(self)
            .map(|region, act, _| act.region = Some(region)),
        )
    }
}

impl Handler<Notification> for Prefill {
    type Result = ();

    fn handle(&mut self, n: Notification, _: &mut Self::Context) {
        println!(
            "prefill: notified by region {}: {}",
            n.region,
            String::from_utf8_lossy(&n.data)
        );
        // The blocks were read: this worker may reuse them. Deregistering waits for any copy
        // still under way and hands the pool back.
        if let Some(region) = self.region.take() {
            actix::spawn(async move {
                let pool = region.deregister().await;
                println!("prefill: pool of {} bytes back", pool.len());
                one_done();
            });
        } else {
            one_done();
        }
    }
}

struct Decode {
    pipe: Addr<Pipe>,
}

impl Actor for Decode {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let pipe = self.pipe.clone();
        let me = ctx.address().recipient::<RemoteDone>();
        ctx.spawn(
            async move {
                let m = pipe.receive().await.expect("the descriptor");
                let region = RegionDescriptor::from_bytes(&m.metadata).expect("a descriptor");
                // One batch: block `b` of the pool to slot `i` of the local buffer.
                let spans = WANTED
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| Span::new(b * BLOCK, i as u64 * BLOCK, BLOCK))
                    .collect();
                let local = memory(vec![0u8; WANTED.len() * BLOCK as usize]);
                let read =
                    RemoteRead::new(&region, spans, local).notify_owner("decode: read 8 blocks");
                pipe.do_send(read.notify(me));
            }
            .into_actor(self),
        );
    }
}

impl Handler<RemoteDone> for Decode {
    type Result = ();

    fn handle(&mut self, d: RemoteDone, _: &mut Self::Context) {
        if let Err(e) = &d.result {
            eprintln!("decode: the read failed: {e}");
            return System::current().stop();
        }
        let got = bytes(&d.buffer);
        for (i, &b) in WANTED.iter().enumerate() {
            let slot = &got[i * BLOCK as usize..(i + 1) * BLOCK as usize];
            assert!(slot.iter().all(|&x| x == block_byte(b)), "block {b}");
        }
        println!(
            "decode: read {} blocks ({} KiB) over {} in one batch; next step starts",
            WANTED.len(),
            d.bytes >> 10,
            d.path
        );
        one_done();
    }
}

/// `bytes` where the workers keep their blocks: device memory of GPU 0 where there is one (and
/// feature `cuda`), host memory elsewhere.
fn memory(bytes: Vec<u8>) -> Buffer {
    #[cfg(feature = "cuda")]
    if actorpipe::cuda::available().is_ok() {
        let mut b = actorpipe::cuda::CudaBuffer::alloc(0, bytes.len()).expect("device memory");
        b.copy_from_host(&bytes).expect("fill the device memory");
        return Buffer::Cuda(b);
    }
    Buffer::Cpu(bytes)
}

/// What the decode step's next work would see: for device memory, a copy queued on the buffer's
/// stream after the read (the read's bytes are in place when it completes).
fn bytes(b: &Buffer) -> Vec<u8> {
    #[cfg(feature = "cuda")]
    if let Some(c) = b.as_cuda() {
        return c.to_vec().expect("the blocks, from the device");
    }
    b.as_cpu().expect("host memory").to_vec()
}

fn main() {
    let system = System::new();
    system.block_on(async {
        let builder = || actorpipe::Context::builder().only_transports(&["tcp"]);
        let prefill_ctx = builder().start();
        let decode_ctx = builder().start();
        let (to, mut accepted) = inbox::<Accepted>();
        let listening = prefill_ctx
            .listen(["tcp://127.0.0.1:0"], to)
            .await
            .expect("listen");
        let decode_pipe = decode_ctx
            .connect(listening.urls[0].as_str())
            .await
            .expect("connect");
        let prefill_pipe = accepted.recv().await.expect("accepted").pipe;
        let prefill = Prefill {
            ctx: prefill_ctx,
            region: None,
        }
        .start();
        prefill.do_send(Start(prefill_pipe));
        Decode { pipe: decode_pipe }.start();
        // The listener stops once its address is dropped: keep it while the system runs.
        std::mem::forget(listening.listener);
    });
    system.run().expect("system ran");
}
