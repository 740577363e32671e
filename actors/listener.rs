//! The `Listener` actor: accepts on every bound endpoint and hands out pipes.
//!
//! Every accepted connection is greeted on its own, under the context's handshake deadline: a
//! `Hello` starts a new pipe, a `Join` attaches an extra connection (control stream on another
//! transport, a channel's lane) to a pipe being set up. A pipe is handed out once all its
//! connections are in; one that does not complete in time is dropped. A connection that sends
//! garbage, the wrong version or nothing at all is dropped and logged, and the listener goes on
//! serving everyone else.
//!
//! # Admission
//!
//! A listener takes only the pipes it can serve. When a `Hello` arrives it computes the choice
//! the peer will make and refuses the pipe at once (`Refuse{reason}`, which the connecting side
//! sees as [`Error::Refused`](crate::Error::Refused)) if:
//!
//! - as many pipes as `max_pending_pipes` are being set up already ("too many pending
//!   handshakes"), or
//! - the descriptors the pipe's joins will need, on top of those open and those reserved for the
//!   joins of pipes already admitted, would leave less than a headroom under `RLIMIT_NOFILE`
//!   ("listener out of file descriptors").
//!
//! An admitted pipe's joins therefore always find descriptors, and a burst of connects ends with
//! every pipe that fits working and every other one refused fast, instead of all of them
//! starving each other until the handshake timeout. Once every join is in, the listener sends
//! `Ready` on the bootstrap connection, and only then does the peer's `Connect` resolve.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncBufReadExt;

use actix::prelude::*;

use super::context::Config;
use super::messages::{Accepted, StopListening};
use super::pipe::{spawn_pipe, PipeParts};
use crate::handshake::{self, Greeting, Halves, Handshaken};
use crate::metrics::Refusal;
use crate::negotiate::{choose, Brochure, Choice, Hello, Join, Purpose};
use crate::transport::{Acceptor, Stream};

/// A pipe whose extra connections have not all arrived.
struct Pending {
    choice: Choice,
    listener_nonce: Vec<u8>,
    /// Tells the watcher of the bootstrap connection to hand it back (every join is in, or
    /// the pipe timed out).
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The joins did not all come in within the handshake timeout.
    timed_out: bool,
    control: Option<Halves>,
    lanes: Vec<Vec<Option<Halves>>>,
    remote: Option<Halves>,
    missing: usize,
    /// The transport of the bootstrap connection (the channels' joins come over it).
    bootstrap: String,
    /// Descriptors still reserved for the joins not in yet.
    reserved: usize,
}

/// Descriptors one join of `purpose` holds while set up, for a pipe bootstrapped over
/// `bootstrap`.
fn join_cost(config: &Config, choice: &Choice, bootstrap: &str, purpose: Purpose) -> usize {
    let transport = match purpose {
        Purpose::Control => choice.transport.as_str(),
        Purpose::Channel { .. } | Purpose::Remote => bootstrap,
    };
    config.transport(transport).map_or(1, |t| t.descriptors())
}

/// How long a refusal may take to write before the connection is simply dropped.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);

/// Descriptors kept free beyond every reservation: for the process's other needs (files, the
/// accept of the next connection, a cma thread, logging).
fn headroom(limit: usize) -> usize {
    16 + limit / 64
}

/// Accepts pipes on one or more endpoints.
pub struct Listener {
    acceptors: Vec<(String, Box<dyn Acceptor>)>,
    subscriber: Recipient<Accepted>,
    config: Arc<Config>,
    brochure: Brochure,
    pending: HashMap<u64, Pending>,
    /// Admitted pipes whose handshake is running.
    handshaking: usize,
    /// Accepted connections whose first frame has not been read yet.
    greeting: usize,
    /// Descriptors reserved for the joins of admitted pipes (handshaking or pending).
    reserved: usize,
    /// Joins that came in before their pipe's handshake was over (a peer dials its joins as
    /// soon as it has sent its choice, and under load a join can be greeted before the choice
    /// is read), by token; they are attached when the pipe becomes pending.
    early: HashMap<u64, Vec<(Halves, Join)>>,
}

/// The most early joins kept per pending pipe the listener may have.
const EARLY_JOINS_PER_PIPE: usize = 4;

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("pending", &self.pending.len())
            .field("handshaking", &self.handshaking)
            .field("reserved", &self.reserved)
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
        require: &[String],
    ) -> Self {
        let addresses: Vec<(String, String)> = acceptors
            .iter()
            .flat_map(|(n, a)| a.urls().into_iter().map(move |u| (n.clone(), u)))
            .collect();
        let mut brochure = config.brochure(&addresses);
        // Required backends: offer only them, per kind, so negotiation can pick nothing else.
        let named = |n: &str| require.iter().any(|r| r == n);
        if brochure.transports.iter().any(|t| named(&t.name)) {
            brochure.transports.retain(|t| named(&t.name));
        }
        if brochure.channels.iter().any(|c| named(&c.name)) {
            brochure.channels.retain(|c| named(&c.name));
        }
        // A pipe reaches a transport at an address: one this listener has none for (it could
        // not listen on it: `Listening::not_listening`) is not offered, so that negotiation
        // picks another both sides have. Offered, it was chosen, and every dial to this
        // listener failed ("the peer offers it but gives no address for it").
        brochure.transports.retain(|t| !t.addresses.is_empty());
        Listener {
            acceptors,
            subscriber,
            config,
            brochure,
            pending: HashMap::new(),
            handshaking: 0,
            greeting: 0,
            reserved: 0,
            early: HashMap::new(),
        }
    }

    /// Whether a new pipe whose joins need `cost` descriptors may be set up now.
    fn admit(&self, cost: usize) -> Result<(), Refusal> {
        if self.pending.len() + self.handshaking >= self.config.max_pending_pipes {
            return Err(Refusal::PendingHandshakes);
        }
        if let Some(u) = crate::fds::usage() {
            // Connections still being greeted are either admitted (and reserved for) or closed
            // soon; their descriptors are not counted against the newcomer.
            let open = u.open.saturating_sub(self.greeting);
            if open + self.reserved + cost + headroom(u.limit) > u.limit {
                return Err(Refusal::Descriptors);
            }
        }
        Ok(())
    }

    /// A `Hello` came in on a connection of transport `bootstrap`: admit the pipe and run the
    /// handshake, or refuse it at once.
    fn on_hello_frame(
        &mut self,
        bootstrap: String,
        h: Halves,
        hello: Hello,
        ctx: &mut Context<Self>,
    ) {
        let cost = choose(&hello.brochure, &self.brochure).map_or(0, |c| {
            c.joins(&bootstrap)
                .into_iter()
                .map(|p| join_cost(&self.config, &c, &bootstrap, p))
                .sum()
        });
        if let Err(why) = self.admit(cost) {
            crate::metrics::refused(why);
            tracing::info!(peer = %h.peer, reason = why.reason(), "refused a pipe");
            ctx.spawn(handshake::refuse(h, why.reason(), REFUSAL_TIMEOUT).into_actor(self));
            return;
        }
        self.handshaking += 1;
        self.reserved += cost;
        let config = self.config.clone();
        let ours = self.brochure.clone();
        let peer = h.peer.clone();
        let accept = async move {
            let secret = config.secret.as_deref();
            let t = config.handshake_timeout;
            handshake::accept(h, hello, &ours, secret, &config.limits, t).await
        };
        ctx.spawn(accept.into_actor(self).map(move |res, act, ctx| {
            act.handshaking -= 1;
            match res {
                Ok(hs) => act.on_hello(bootstrap, hs, cost, ctx),
                Err(e) => {
                    act.reserved -= cost;
                    crate::metrics::negotiation_failed(&e);
                    tracing::info!(peer = %peer, error = %e, "refused an incoming connection");
                }
            }
        }));
    }

    /// Tells the peer the whole pipe is accepted, then starts it.
    fn confirm(
        &mut self,
        bootstrap: Halves,
        control: Option<Halves>,
        choice: Choice,
        (lanes, remote): (Vec<Vec<Halves>>, Option<(Halves, String)>),
        ctx: &mut Context<Self>,
    ) {
        let t = self.config.handshake_timeout;
        let confirm = async move {
            let mut bootstrap = bootstrap;
            handshake::confirm(&mut bootstrap, t).await?;
            Ok::<_, crate::Error>(PipeParts {
                peer: bootstrap.peer.clone(),
                control: control.unwrap_or(bootstrap),
                choice,
                lanes,
                remote,
            })
        };
        ctx.spawn(confirm.into_actor(self).map(|res, act, _| match res {
            Ok(parts) => act.hand_out(parts),
            Err(e) => tracing::info!(error = %e, "the peer left before its pipe was confirmed"),
        }));
    }

    /// Starts the pipe and hands it to the subscriber once it is attached (see `spawn_pipe`),
    /// whether the listener still runs then or not.
    fn hand_out(&mut self, parts: PipeParts) {
        let peer = parts.peer.clone();
        let (pipe, attached) = spawn_pipe(parts, &self.config);
        if !attached.pending() {
            return self.subscriber.do_send(Accepted { pipe, peer });
        }
        let subscriber = self.subscriber.clone();
        let limit = self.config.handshake_timeout;
        actix::spawn(async move {
            attached.wait(limit).await;
            subscriber.do_send(Accepted { pipe, peer });
        });
    }

    fn on_hello(
        &mut self,
        bootstrap: String,
        hs: Handshaken,
        cost: usize,
        ctx: &mut Context<Self>,
    ) {
        let joins = hs.choice.joins(&bootstrap);
        if joins.is_empty() {
            self.reserved -= cost;
            let lanes = hs.choice.channels.iter().map(|_| Vec::new()).collect();
            self.confirm(hs.halves, None, hs.choice, (lanes, None), ctx);
            return;
        }
        let token = hs.choice.token;
        let lanes = hs
            .choice
            .channels
            .iter()
            .map(|c| (0..c.connections).map(|_| None).collect())
            .collect();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        self.pending.insert(
            token,
            Pending {
                choice: hs.choice,
                listener_nonce: hs.listener_nonce,
                stop: Some(stop),
                timed_out: false,
                control: None,
                lanes,
                remote: None,
                missing: joins.len(),
                bootstrap,
                reserved: cost,
            },
        );
        // Watch the bootstrap connection while the joins come in: the peer sends nothing on it
        // until `Ready`, so bytes or its end mean the peer gave up (a join failed, it timed
        // out): the pipe is dropped at once and its descriptors go back to the others.
        let mut bootstrap = hs.halves;
        let watch = async move {
            let gone = tokio::select! {
                r = bootstrap.read.fill_buf() => Some(match r {
                    Ok([]) => "it hung up".to_string(),
                    Ok(b) => format!("it sent {} unexpected bytes", b.len()),
                    Err(e) => e.to_string(),
                }),
                _ = stopped => None,
            };
            (bootstrap, gone)
        };
        ctx.spawn(
            watch
                .into_actor(self)
                .map(move |(h, gone), act, ctx| act.settle(token, h, gone, ctx)),
        );
        for (h, join) in self.early.remove(&token).unwrap_or_default() {
            self.on_join(h, join, ctx);
        }
        let timeout = self.config.handshake_timeout;
        ctx.run_later(timeout, move |act, _| {
            if let Some(p) = act.pending.get_mut(&token) {
                p.timed_out = true;
                if let Some(stop) = p.stop.take() {
                    let _ = stop.send(());
                }
            }
        });
    }

    /// The watch of pending pipe `token`'s bootstrap connection `h` ended: the peer left
    /// (`gone`), every join is in, or the joins timed out.
    fn settle(&mut self, token: u64, h: Halves, gone: Option<String>, ctx: &mut Context<Self>) {
        let Some(p) = self.pending.remove(&token) else {
            return;
        };
        self.reserved -= p.reserved;
        if let Some(why) = gone {
            tracing::info!(peer = %h.peer, %why, "dropped a pipe whose peer left before it was set up");
        } else if p.timed_out || p.missing > 0 {
            let why = Refusal::JoinTimeout;
            crate::metrics::refused(why);
            tracing::info!(peer = %h.peer, "dropped a pipe whose connections did not all join in time");
            let refuse = handshake::refuse_pending(h, why.reason(), REFUSAL_TIMEOUT);
            ctx.spawn(refuse.into_actor(self));
        } else {
            let lanes = p
                .lanes
                .into_iter()
                .map(|l| l.into_iter().flatten().collect())
                .collect();
            let remote = p.remote.map(|r| (r, p.bootstrap));
            self.confirm(h, p.control, p.choice, (lanes, remote), ctx);
        }
    }

    fn on_join(&mut self, h: Halves, join: Join, ctx: &mut Context<Self>) {
        let Some(p) = self.pending.get_mut(&join.token) else {
            // Its pipe may still be handshaking: keep it for as long as a handshake may take.
            let held: usize = self.early.values().map(Vec::len).sum();
            if self.handshaking == 0 || held >= self.config.max_pending_pipes * EARLY_JOINS_PER_PIPE
            {
                tracing::info!(peer = %h.peer, "refused a join for no pending pipe");
                return;
            }
            let token = join.token;
            let first = !self.early.contains_key(&token);
            self.early.entry(token).or_default().push((h, join));
            if first {
                ctx.run_later(self.config.handshake_timeout, move |act, _| {
                    if act.early.remove(&token).is_some() {
                        tracing::info!("refused joins for no pending pipe");
                    }
                });
            }
            return;
        };
        if let Some(k) = self.config.secret.as_deref() {
            let (nonce, token) = (&p.listener_nonce, join.token);
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
                if let Some(c) = p.choice.channels.get(channel as usize) {
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
            Purpose::Remote if p.choice.remote => &mut p.remote,
            Purpose::Remote => {
                tracing::info!(peer = %h.peer, "refused a remote lane for a pipe without one");
                return;
            }
        };
        if slot.is_some() {
            tracing::info!(peer = %h.peer, ?join, "refused a duplicate join");
            return;
        }
        *slot = Some(h);
        p.missing -= 1;
        let cost = join_cost(&self.config, &p.choice, &p.bootstrap, join.purpose).min(p.reserved);
        p.reserved -= cost;
        self.reserved -= cost;
        if p.missing == 0 {
            // The watcher hands the bootstrap connection back and `settle` confirms the pipe.
            if let Some(stop) = p.stop.take() {
                let _ = stop.send(());
            }
        }
    }
}

impl Actor for Listener {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        for (name, mut acceptor) in std::mem::take(&mut self.acceptors) {
            let me = ctx.address().downgrade();
            let accept_loop = async move {
                let mut failures = 0u64;
                let mut logged: Option<Instant> = None;
                loop {
                    match acceptor.accept().await {
                        Ok(stream) => match me.upgrade() {
                            Some(addr) => addr.do_send(Incoming(name.clone(), stream)),
                            None => return,
                        },
                        Err(e) => {
                            // Out of descriptors or similar: back off instead of spinning. The
                            // connection waits in the backlog; admission keeps the descriptors
                            // of admitted pipes' joins free, and refused connections close
                            // soon, so this passes. Logged once a second at most.
                            failures += 1;
                            if logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                                tracing::warn!(error = %e, failures, "accept failed");
                                logged = Some(Instant::now());
                            }
                            let pause = if crate::fds::is_exhaustion(&e) {
                                10
                            } else {
                                100
                            };
                            tokio::time::sleep(Duration::from_millis(pause)).await;
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
        let peer = stream.peer.clone();
        self.greeting += 1;
        let greet =
            async move { handshake::greet(stream, &config.limits, config.handshake_timeout).await };
        ctx.spawn(greet.into_actor(self).map(move |res, act, ctx| {
            act.greeting -= 1;
            match res {
                Ok(Greeting::Hello(h, hello)) => act.on_hello_frame(bootstrap, h, hello, ctx),
                Ok(Greeting::Join(h, j)) => act.on_join(h, j, ctx),
                Err(e) => {
                    crate::metrics::negotiation_failed(&e);
                    tracing::info!(peer = %peer, error = %e, "refused an incoming connection")
                }
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
