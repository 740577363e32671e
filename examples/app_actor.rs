//! An application actor that opens a pipe and works only with completion messages.
//!
//! The `Client` actor connects in `started`, fires three writes and a descriptor read with
//! itself as the recipient, and reacts to `WriteDone`, `DescriptorReady` and `ReadDone` as they
//! arrive. The other end is an echo server in the same process (see `echo_peer.rs` for one as
//! actors). Run: `cargo run --example app_actor`.

use actix::prelude::*;
use actorpipe::{
    inbox, Accepted, Allocation, Connect, DescriptorReady, Listen, Message as PipeMessage, Notify,
    Op, Pipe, Read, ReadDescriptor, ReadDone, Tensor, Write, WriteDone,
};

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
            .send(Connect::new(&self.url))
            .into_actor(self)
            .map(|res, act, ctx| {
                let pipe = match res {
                    Ok(Ok(p)) => p,
                    Ok(Err(e)) => return eprintln!("connect failed: {e}"),
                    Err(e) => return eprintln!("context gone: {e}"),
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
    loop {
        let Ok(d) = pipe.send(ReadDescriptor).await.map(|d| d.descriptor) else {
            return;
        };
        let Ok(d) = d else { return };
        let alloc = Allocation::for_descriptor(&d).expect("fits in memory");
        let Ok(r) = pipe.send(Read::new(alloc)).await else {
            return;
        };
        if r.result.is_err() {
            return;
        }
        pipe.do_send(Write::new(r.message));
    }
}

fn main() {
    let system = System::new();
    system.block_on(async {
        let server = actorpipe::Context::builder().start();
        let (accepted, mut incoming) = inbox::<Accepted>();
        let l = server
            .send(Listen::new(["tcp://127.0.0.1:0"], accepted))
            .await
            .expect("context alive")
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
