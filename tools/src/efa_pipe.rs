//! The pipe rows of `actorpipe bench efa`: the same ping-pong through two contexts, an echo
//! server and a client in threads of their own, with one tensor of the size per message:
//!
//! - `transport`: the `efa` transport with the `basic` channel (the tensor's bytes travel on the
//!   control stream: copied into and out of the stream's bounce buffers);
//! - `channel`: the `efa` transport with the `efa` channel (the tensor goes from the sender's
//!   buffer into the receiver's, in place; up to the channel's inline limit, 8 KiB by default,
//!   it rides the control stream instead, as in `transport`);
//! - `in-place`: the same with no inline limit: every tensor in place, whatever its size;
//! - `striped`: the same with the channel on every domain of the provider (tensors over 64 KiB
//!   striped over them), where it lists two or more.
//!
//! All use the public API only ([`crate::bench`]'s echo server and client), driven as `--api`
//! says (`receive` by default: fired operations, reads with `Receive`).

use std::sync::{mpsc as std_mpsc, Arc};

use actorpipe::internal::hardware::efa::EndpointConfig;
use actorpipe::transport::Efa;
use actorpipe::ContextBuilder;

use crate::bench::{Api, Client};
use crate::failure::Failure;
use crate::measure::{Counts, Samples};
use crate::plan::Shape;
use crate::report::Progress;

/// Which backends a pipe row runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    /// `efa` transport, `basic` channel.
    Transport,
    /// `efa` transport, `efa` channel.
    Channel,
    /// `efa` transport, `efa` channel with every tensor in place (no inline limit).
    InPlace,
    /// `efa` transport, `efa` channel on every domain of the provider.
    Striped,
}

impl Row {
    fn builder(self, provider: &str, config: EndpointConfig) -> ContextBuilder {
        let b = crate::plan::base_builder().without("shm");
        let t = Efa::new(provider).with_config(config);
        let c = actorpipe::channel::Efa::over(&t);
        match self {
            Row::Transport => b.transport(Arc::new(t)).only_channels(&["basic"]),
            Row::Channel => b
                .transport(Arc::new(t))
                .channel(Arc::new(c))
                .only_channels(&["efa", "basic"]),
            Row::InPlace => b
                .transport(Arc::new(t))
                .channel(Arc::new(c.inline_max(0)))
                .only_channels(&["efa", "basic"]),
            Row::Striped => b
                .transport(Arc::new(t))
                .channel(Arc::new(c.all_domains()))
                .only_channels(&["efa", "basic"]),
        }
    }

    /// The row's name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Row::Transport => "transport",
            Row::Channel => "channel",
            Row::InPlace => "in-place",
            Row::Striped => "striped",
        }
    }

    fn channel(self) -> &'static str {
        match self {
            Row::Transport => "basic",
            Row::Channel | Row::InPlace | Row::Striped => "efa",
        }
    }
}

/// One round of `counts` round trips of one tensor of `size` bytes.
pub fn round(
    row: Row,
    provider: &str,
    size: u64,
    counts: Counts,
    config: EndpointConfig,
    api: Api,
    pin: bool,
) -> Result<Samples, Failure> {
    let (url_tx, url_rx) = std_mpsc::channel::<Result<String, Failure>>();
    let (stop_tx, stop_rx) = std_mpsc::channel::<()>();
    let p = provider.to_string();
    let server = std::thread::spawn(move || {
        if let Err(e) = crate::efa::pin_echo(pin) {
            let _ = url_tx.send(Err(e));
            return;
        }
        actix::System::new().block_on(async move {
            match crate::bench::listen(row.builder(&p, config), "tcp://127.0.0.1:0", api).await {
                Ok(listening) => {
                    let _ = url_tx.send(Ok(listening.urls[0].clone()));
                    let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
                    drop(listening);
                }
                Err(e) => {
                    let _ = url_tx.send(Err(e));
                }
            }
        })
    });
    let url = url_rx
        .recv()
        .map_err(|_| Failure::Failed("efa echo server: stopped".into()))??;
    let result = actix::System::new().block_on(async {
        let mut client =
            Client::connect(row.builder(provider, config), &url, Shape::Tensor, api).await?;
        if client.info.transport != "efa" || client.channel() != row.channel() {
            return Err(Failure::Failed(format!(
                "negotiated {} / {}, expected efa / {}",
                client.info.transport,
                client.channel(),
                row.channel()
            )));
        }
        let progress = Progress::new(counts.total() as u64, true);
        client.measure(size, counts, &progress).await
    });
    let _ = stop_tx.send(());
    let _ = server.join();
    result
}
