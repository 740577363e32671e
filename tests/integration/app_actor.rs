//! A pipe driven from inside an application actor: it connects, fires operations with itself as
//! the recipient, and handles the completion messages.

use actix::prelude::*;
use actorpipe::*;
use tokio::sync::oneshot;

use crate::common::*;

/// Connects in `started`, sends three messages and reads three echoes; reports what it saw.
struct App {
    ctx: Addr<actorpipe::Context>,
    url: String,
    pipe: Option<Addr<Pipe>>,
    written: Vec<u64>,
    received: Vec<u64>,
    report: Option<oneshot::Sender<(Vec<u64>, Vec<u64>)>>,
}

impl Actor for App {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.ctx
            .send(Connect::new(&self.url))
            .into_actor(self)
            .map(|res, act, ctx| {
                let pipe = res.expect("context alive").expect("connect");
                for i in 0..3 {
                    let m = checked_message(i, &[3], &[5000]);
                    pipe.do_send(Write::new(m).notify(ctx.address().recipient()));
                }
                pipe.do_send(ReadDescriptor.notify(ctx.address().recipient()));
                act.pipe = Some(pipe);
            })
            .wait(ctx);
    }
}

impl Handler<WriteDone> for App {
    type Result = ();
    fn handle(&mut self, d: WriteDone, _: &mut Self::Context) {
        d.result.expect("write");
        self.written.push(d.id);
    }
}

impl Handler<DescriptorReady> for App {
    type Result = ();
    fn handle(&mut self, d: DescriptorReady, ctx: &mut Self::Context) {
        let alloc = Allocation::for_descriptor(&d.descriptor.expect("descriptor")).unwrap();
        let pipe = self.pipe.as_ref().unwrap();
        pipe.do_send(Read::new(alloc).notify(ctx.address().recipient()));
    }
}

impl Handler<ReadDone> for App {
    type Result = ();
    fn handle(&mut self, r: ReadDone, ctx: &mut Self::Context) {
        r.result.expect("read");
        self.received.push(verify(&r.message));
        if self.received.len() < 3 {
            let pipe = self.pipe.as_ref().unwrap();
            pipe.do_send(ReadDescriptor.notify(ctx.address().recipient()));
        } else if let Some(tx) = self.report.take() {
            let _ = tx.send((self.written.clone(), self.received.clone()));
        }
    }
}

/// The echo side, also an actor: reads each message and writes it back.
struct Echo(Addr<Pipe>);

impl Actor for Echo {
    type Context = actix::Context<Self>;
    fn started(&mut self, ctx: &mut Self::Context) {
        self.0
            .do_send(ReadDescriptor.notify(ctx.address().recipient()));
    }
}

impl Handler<DescriptorReady> for Echo {
    type Result = ();
    fn handle(&mut self, d: DescriptorReady, ctx: &mut Self::Context) {
        if let Ok(d) = d.descriptor {
            let alloc = Allocation::for_descriptor(&d).unwrap();
            self.0
                .do_send(Read::new(alloc).notify(ctx.address().recipient()));
        }
    }
}

impl Handler<ReadDone> for Echo {
    type Result = ();
    fn handle(&mut self, r: ReadDone, ctx: &mut Self::Context) {
        if r.result.is_ok() {
            self.0.do_send(Write::new(r.message));
            self.0
                .do_send(ReadDescriptor.notify(ctx.address().recipient()));
        }
    }
}

struct Acceptor;

impl Actor for Acceptor {
    type Context = actix::Context<Self>;
}

impl Handler<Accepted> for Acceptor {
    type Result = ();
    fn handle(&mut self, a: Accepted, _: &mut Self::Context) {
        Echo(a.pipe).start();
    }
}

#[actix::test]
async fn application_actors_drive_pipes_through_completion_messages() {
    let server = actorpipe::Context::builder().start();
    let listening = server
        .send(Listen::new(
            ["tcp://127.0.0.1:0"],
            Acceptor.start().recipient(),
        ))
        .await
        .unwrap()
        .unwrap();
    let (tx, rx) = oneshot::channel();
    App {
        ctx: actorpipe::Context::builder().start(),
        url: listening.urls[0].clone(),
        pipe: None,
        written: vec![],
        received: vec![],
        report: Some(tx),
    }
    .start();
    let (written, received) = within(30, "app actor", rx).await.unwrap();
    assert_eq!(written, vec![0, 1, 2], "write completions in order");
    assert_eq!(received, vec![0, 1, 2], "echoes in order");
}

/// The same from a plain `actix::System` (no test macro): pipes need only a running system.
#[test]
fn works_from_a_plain_actix_system() {
    let system = System::new();
    let got = system.block_on(async {
        let (tx, rx, _s) = pair(actorpipe::Context::builder(), actorpipe::Context::builder()).await;
        let w = tx.send(Write::new(checked_message(42, &[1], &[1])));
        let m = read_one(&rx).await.unwrap();
        w.await.unwrap().result.unwrap();
        verify(&m)
    });
    assert_eq!(got, 42);
}
