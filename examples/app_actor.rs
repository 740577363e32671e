//! An application actor that opens a pipe and works only with completion messages.
//!
//! The `Client` actor connects in `started`, fires three writes and a descriptor read with
//! itself as the recipient, and reacts to `WriteDone`, `DescriptorReady` and `ReadDone` as they
//! arrive. The other end is an echo server in the same process (see `echo_peer.rs` for one as
//! actors). Run: `cargo run --example app_actor`.

use actix::prelude::*;
use actorpipe::prelude::*;
use actorpipe::{Message as PipeMessage, Notify, Read, Write};

struct Client {
    url: String,
    ctx: Addr<actorpipe::Context>,
    pipe: Option<Addr<Pipe>>,
    echoes: usize,
}

impl Actor for Client {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.ctx
            .connect(&self.url)
            .into_actor(self)
            .map(|res, act, ctx| {
                let pipe = match res {
                    Ok(p) => p,
                    Err(e) => return eprintln!("connect failed: {e}"),
                };
                let me = ctx.address();
                for i in 0..3u8 {
                    let m = PipeMessage::new()
                        .with_metadata(vec![i])
                        .with_tensor(Tensor::cpu(vec![i; 1 << 20]));
                    pipe.do_send(Write::new(m).notify(me.clone().recipient()));
                }
                pipe.do_send(ReadDescriptor.notify(me.recipient()));
                act.pipe = Some(pipe);
            })
            .wait(ctx);
    }
}

impl Handler<WriteDone> for Client {
    type Result = ();
    fn handle(&mut self, d: WriteDone, _: &mut Self::Context) {
        println!("write {} done: {:?}", d.id, d.result);
    }
}

impl Handler<DescriptorReady> for Client {
    type Result = ();
    fn handle(&mut self, d: DescriptorReady, ctx: &mut Self::Context) {
        let Ok(descriptor) = d.descriptor else {
            return eprintln!("pipe failed: {:?}", d.descriptor);
        };
        let alloc = Allocation::for_descriptor(&descriptor).expect("fits in memory");
        let pipe = self.pipe.as_ref().expect("connected");
        pipe.do_send(Read::new(alloc).notify(ctx.address().recipient()));
    }
}

impl Handler<ReadDone> for Client {
    type Result = ();
    fn handle(&mut self, r: ReadDone, ctx: &mut Self::Context) {
        let t = &r.message.tensors[0];
        println!(
            "echo {} back: metadata {:?}, tensor of {} bytes, {:?}",
            self.echoes,
            r.message.metadata,
            t.buffer.len(),
            r.result
        );
        self.echoes += 1;
        if self.echoes < 3 {
            let pipe = self.pipe.as_ref().expect("connected");
            pipe.do_send(ReadDescriptor.notify(ctx.address().recipient()));
        } else {
            System::current().stop();
        }
    }
}

/// Echoes every message of one pipe (plain async code, through awaited operations).
async fn echo(pipe: Addr<Pipe>) {
    // Any error means the pipe closed.
    while let Ok(d) = pipe.read_descriptor().await {
        let alloc = Allocation::for_descriptor(&d).expect("fits in memory");
        let Ok(m) = pipe.read(alloc).await else {
            return;
        };
        pipe.do_send(Write::new(m));
    }
}

fn main() {
    let system = System::new();
    system.block_on(async {
        let server = actorpipe::Context::builder().start();
        let (accepted, mut incoming) = inbox::<Accepted>();
        let l = server
            .listen(["tcp://127.0.0.1:0"], accepted)
            .await
            .expect("listen");
        actix::spawn(async move {
            let _keep_listening = l.listener;
            while let Some(a) = incoming.recv().await {
                actix::spawn(echo(a.pipe));
            }
        });
        Client {
            url: l.urls[0].clone(),
            ctx: actorpipe::Context::builder().start(),
            pipe: None,
            echoes: 0,
        }
        .start();
    });
    system.run().expect("system ran");
    // `Notify` and `Op` are what `.notify(..)` builds on; named here so the imports show them.
    let _: Option<Notify<Write>> = None;
    fn _op<T: Op>() {}
}
