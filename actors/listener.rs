//! The `Listener` actor: accepts on every bound endpoint and hands out pipes.
//!
//! Each incoming connection is handshaken on its own, under the context's handshake deadline; a
//! connection that sends garbage, the wrong version or nothing at all is dropped and logged, and
//! the listener goes on serving everyone else.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::context::Config;
use super::messages::{Accepted, StopListening};
use super::pipe::spawn_pipe;
use crate::handshake::{handshake, Role};
use crate::transport::{Acceptor, Stream};

/// Accepts pipes on one or more endpoints.
pub struct Listener {
    acceptors: Vec<Box<dyn Acceptor>>,
    subscriber: Recipient<Accepted>,
    config: Arc<Config>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").finish_non_exhaustive()
    }
}

/// A connection came in.
struct Incoming(Stream);

impl Message for Incoming {
    type Result = ();
}

impl Listener {
    pub(crate) fn new(
        acceptors: Vec<Box<dyn Acceptor>>,
        subscriber: Recipient<Accepted>,
        config: Arc<Config>,
    ) -> Self {
        Listener {
            acceptors,
            subscriber,
            config,
        }
    }
}

impl Actor for Listener {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        for mut acceptor in std::mem::take(&mut self.acceptors) {
            let me = ctx.address().downgrade();
            let accept_loop = async move {
                loop {
                    match acceptor.accept().await {
                        Ok(stream) => match me.upgrade() {
                            Some(addr) => addr.do_send(Incoming(stream)),
                            None => return,
                        },
                        Err(e) => {
                            // Out of descriptors or similar: back off instead of spinning.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            };
            ctx.spawn(accept_loop.into_actor(self));
        }
    }
}

impl Handler<Incoming> for Listener {
    type Result = ();

    fn handle(&mut self, Incoming(stream): Incoming, ctx: &mut Self::Context) {
        let config = self.config.clone();
        let peer = stream.peer.clone();
        let hs = async move {
            handshake(
                stream,
                Role::Accept,
                &config.brochure(),
                &config.limits,
                config.handshake_timeout,
            )
            .await
        };
        ctx.spawn(hs.into_actor(self).map(move |res, act, _| match res {
            Ok(hs) => {
                let pipe = spawn_pipe(hs, &act.config);
                act.subscriber.do_send(Accepted { pipe, peer });
            }
            Err(e) => tracing::info!(peer = %peer, error = %e, "refused an incoming pipe"),
        }));
    }
}

impl Handler<StopListening> for Listener {
    type Result = ();

    fn handle(&mut self, _: StopListening, ctx: &mut Self::Context) {
        ctx.stop();
    }
}
