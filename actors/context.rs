//! The `Context` actor: the registry of backends; it dials pipes and starts listeners.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::listener::Listener;
use super::messages::{Connect, Listen, Listening};
use super::pipe::{spawn_pipe, Pipe};
use crate::channel::basic::{Basic, DEFAULT_CHUNK_SIZE};
use crate::channel::ChannelBackend;
use crate::error::Error;
use crate::handshake::{handshake, Role};
use crate::negotiate::{Brochure, Offer};
use crate::transport::tcp::Tcp;
use crate::transport::{Acceptor, Transport, Url};
use crate::wire::Limits;

/// Settings shared by every pipe of a context.
pub struct Config {
    pub(crate) limits: Limits,
    pub(crate) chunk_size: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    pub(crate) channels: Vec<Arc<dyn ChannelBackend>>,
}

impl Config {
    /// What this context offers in negotiation.
    pub(crate) fn brochure(&self) -> Brochure {
        Brochure {
            transports: self
                .transports
                .iter()
                .map(|t| Offer {
                    name: t.name().into(),
                    priority: t.priority(),
                    domain: t.domain(),
                    addresses: Vec::new(),
                })
                .collect(),
            channels: self.channels.iter().map(|c| c.offer()).collect(),
        }
    }

    fn transport(&self, scheme: &str) -> Result<&Arc<dyn Transport>, Error> {
        self.transports
            .iter()
            .find(|t| t.name() == scheme)
            .ok_or_else(|| Error::Unavailable {
                backend: scheme.into(),
                reason: format!(
                    "no transport named {scheme:?} is enabled in this context (enabled: {})",
                    self.transports
                        .iter()
                        .map(|t| t.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("limits", &self.limits)
            .field("chunk_size", &self.chunk_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field(
                "transports",
                &self.transports.iter().map(|t| t.name()).collect::<Vec<_>>(),
            )
            .field(
                "channels",
                &self.channels.iter().map(|c| c.name()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Builds a [`Context`]. With no settings it enables every backend that can run here.
#[derive(Debug)]
pub struct ContextBuilder {
    config: Config,
}

impl Default for ContextBuilder {
    fn default() -> Self {
        ContextBuilder {
            config: Config {
                limits: Limits::default(),
                chunk_size: DEFAULT_CHUNK_SIZE,
                connect_timeout: Duration::from_secs(10),
                handshake_timeout: Duration::from_secs(10),
                transports: vec![Arc::new(Tcp)],
                channels: vec![Arc::new(Basic)],
            },
        }
    }
}

impl ContextBuilder {
    /// Bounds on what peers may announce (frame size, counts, sizes, metadata).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.config.limits = limits;
        self
    }

    /// Bytes per chunk when a tensor goes over the control connection (at least 1).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.config.chunk_size = bytes.max(1);
        self
    }

    /// How long dialing a peer may take.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.config.connect_timeout = t;
        self
    }

    /// How long the handshake of a new pipe may take, on either side.
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.config.handshake_timeout = t;
        self
    }

    /// Builds the context actor (start it with [`Actor::start`]).
    pub fn build(self) -> Context {
        Context {
            config: Arc::new(self.config),
        }
    }

    /// Builds and starts the context on the current arbiter.
    pub fn start(self) -> Addr<Context> {
        self.build().start()
    }
}

/// The registry of backends; send it [`Connect`] and [`Listen`].
#[derive(Debug)]
pub struct Context {
    config: Arc<Config>,
}

impl Context {
    /// A builder with every backend that can run here.
    pub fn builder() -> ContextBuilder {
        ContextBuilder::default()
    }
}

impl Actor for Context {
    type Context = actix::Context<Self>;
}

impl Handler<Connect> for Context {
    type Result = ResponseFuture<Result<Addr<Pipe>, Error>>;

    fn handle(&mut self, msg: Connect, _: &mut Self::Context) -> Self::Result {
        let config = self.config.clone();
        Box::pin(async move {
            let url = Url::parse(&msg.url)?;
            let stream = config
                .transport(&url.scheme)?
                .connect(&url, config.connect_timeout)
                .await?;
            let hs = handshake(
                stream,
                Role::Connect,
                &config.brochure(),
                &config.limits,
                config.handshake_timeout,
            )
            .await?;
            Ok(spawn_pipe(hs, &config))
        })
    }
}

impl Handler<Listen> for Context {
    type Result = ResponseFuture<Result<Listening, Error>>;

    fn handle(&mut self, msg: Listen, _: &mut Self::Context) -> Self::Result {
        let config = self.config.clone();
        Box::pin(async move {
            if msg.urls.is_empty() {
                return Err(Error::invalid("Listen needs at least one URL"));
            }
            let mut acceptors: Vec<Box<dyn Acceptor>> = Vec::new();
            for u in &msg.urls {
                let url = Url::parse(u)?;
                acceptors.push(config.transport(&url.scheme)?.listen(&url).await?);
            }
            let urls = acceptors.iter().flat_map(|a| a.urls()).collect();
            let listener = Listener::new(acceptors, msg.subscriber, config).start();
            Ok(Listening { listener, urls })
        })
    }
}
