//! The `Listener` actor: accepts on every bound endpoint and hands out pipes.
//!
//! Every accepted connection is greeted on its own, under the context's handshake deadline: a
//! `Hello` starts a new pipe, a `Join` attaches an extra connection (control stream on another
//! transport, a channel's lane) to a pipe being set up. A pipe is handed out once all its
//! connections are in; one that does not complete in time is dropped. A connection that sends
//! garbage, the wrong version or nothing at all is dropped and logged, and the listener goes on
//! serving everyone else.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::context::Config;
use super::messages::{Accepted, StopListening};
use super::pipe::{spawn_pipe, PipeParts};
use crate::handshake::{self, Greeting, Halves, Handshaken};
use crate::negotiate::{Brochure, Join, Purpose};
use crate::transport::{Acceptor, Stream};

/// A pipe whose extra connections have not all arrived.
struct Pending {
    hs: Handshaken,
    control: Option<Halves>,
    lanes: Vec<Vec<Option<Halves>>>,
    missing: usize,
}

/// Accepts pipes on one or more endpoints.
pub struct Listener {
    acceptors: Vec<(String, Box<dyn Acceptor>)>,
    subscriber: Recipient<Accepted>,
    config: Arc<Config>,
    brochure: Brochure,
    pending: HashMap<u64, Pending>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

/// A connection came in on the endpoint of transport `.0`.
struct Incoming(String, Stream);

impl Message for Incoming {
    type Result = ();
}

impl Listener {
    pub(crate) fn new(
        acceptors: Vec<(String, Box<dyn Acceptor>)>,
        subscriber: Recipient<Accepted>,
        config: Arc<Config>,
    ) -> Self {
        let addresses: Vec<(String, String)> = acceptors
            .iter()
            .flat_map(|(n, a)| a.urls().into_iter().map(move |u| (n.clone(), u)))
            .collect();
        let brochure = config.brochure(&addresses);
        Listener {
            acceptors,
            subscriber,
            config,
            brochure,
            pending: HashMap::new(),
        }
    }

    fn hand_out(&mut self, parts: PipeParts) {
        let peer = parts.peer.clone();
        let pipe = spawn_pipe(parts, &self.config);
        self.subscriber.do_send(Accepted { pipe, peer });
    }

    fn on_hello(&mut self, bootstrap: &str, hs: Handshaken, ctx: &mut Context<Self>) {
        let joins = hs.choice.joins(bootstrap);
        if joins.is_empty() {
            let choice = hs.choice;
            let lanes = choice.channels.iter().map(|_| Vec::new()).collect();
            self.hand_out(PipeParts {
                peer: hs.halves.peer.clone(),
                control: hs.halves,
                choice,
                lanes,
            });
            return;
        }
        let token = hs.choice.token;
        let lanes = hs
            .choice
            .channels
            .iter()
            .map(|c| (0..c.connections).map(|_| None).collect())
            .collect();
        self.pending.insert(
            token,
            Pending {
                hs,
                control: None,
                lanes,
                missing: joins.len(),
            },
        );
        ctx.run_later(self.config.handshake_timeout, move |act, _| {
            if act.pending.remove(&token).is_some() {
                tracing::info!("dropped a pipe whose connections did not all join in time");
            }
        });
    }

    fn on_join(&mut self, h: Halves, join: Join) {
        let Some(p) = self.pending.get_mut(&join.token) else {
            tracing::info!(peer = %h.peer, "refused a join for no pending pipe");
            return;
        };
        if let Some(k) = self.config.secret.as_deref() {
            let (nonce, token) = (&p.hs.listener_nonce, join.token);
            let ok = join
                .proof
                .as_ref()
                .is_some_and(|proof| crate::auth::check_join(k, nonce, token, join.purpose, proof));
            if !ok {
                tracing::info!(peer = %h.peer, "refused a join without proof of the secret");
                return;
            }
        }
        let mut h = h;
        let slot = match join.purpose {
            Purpose::Control => &mut p.control,
            Purpose::Channel { channel, lane } => {
                if let Some(c) = p.hs.choice.channels.get(channel as usize) {
                    h = h.with_read_buffer(self.config.lane_read_buffer(&c.name));
                }
                match p
                    .lanes
                    .get_mut(channel as usize)
                    .and_then(|l| l.get_mut(lane as usize))
                {
                    Some(slot) => slot,
                    None => {
                        tracing::info!(peer = %h.peer, ?join, "refused a join for no such lane");
                        return;
                    }
                }
            }
        };
        if slot.is_some() {
            tracing::info!(peer = %h.peer, ?join, "refused a duplicate join");
            return;
        }
        *slot = Some(h);
        p.missing -= 1;
        if p.missing > 0 {
            return;
        }
        let p = self.pending.remove(&join.token).expect("present");
        let choice = p.hs.choice;
        self.hand_out(PipeParts {
            peer: p.hs.halves.peer.clone(),
            control: p.control.unwrap_or(p.hs.halves),
            choice,
            lanes: p
                .lanes
                .into_iter()
                .map(|l| l.into_iter().flatten().collect())
                .collect(),
        });
    }
}

impl Actor for Listener {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        for (name, mut acceptor) in std::mem::take(&mut self.acceptors) {
            let me = ctx.address().downgrade();
            let accept_loop = async move {
                loop {
                    match acceptor.accept().await {
                        Ok(stream) => match me.upgrade() {
                            Some(addr) => addr.do_send(Incoming(name.clone(), stream)),
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
        // Like a pipe, a listener nobody holds an address of any more stops (and frees its ports).
        ctx.run_interval(Duration::from_secs(2), |_, ctx| {
            if !ctx.connected() {
                ctx.stop();
            }
        });
    }
}

impl Handler<Incoming> for Listener {
    type Result = ();

    fn handle(&mut self, Incoming(bootstrap, stream): Incoming, ctx: &mut Self::Context) {
        let config = self.config.clone();
        let ours = self.brochure.clone();
        let peer = stream.peer.clone();
        let greet = async move {
            let limits = config.limits;
            let t = config.handshake_timeout;
            match handshake::greet(stream, &limits, t).await? {
                Greeting::Hello(h, hello) => {
                    let secret = config.secret.as_deref();
                    let hs = handshake::accept(h, hello, &ours, secret, &limits, t).await?;
                    Ok(Ok(hs))
                }
                Greeting::Join(h, j) => Ok(Err((h, j))),
            }
        };
        ctx.spawn(greet.into_actor(self).map(move |res, act, ctx| match res {
            Ok(Ok(hs)) => act.on_hello(&bootstrap, hs, ctx),
            Ok(Err((h, j))) => act.on_join(h, j),
            Err::<_, crate::Error>(e) => {
                crate::metrics::negotiation_failed(&e);
                tracing::info!(peer = %peer, error = %e, "refused an incoming connection")
            }
        }));
    }
}

impl Handler<StopListening> for Listener {
    type Result = ();

    fn handle(&mut self, _: StopListening, ctx: &mut Self::Context) {
        ctx.stop();
    }
}
