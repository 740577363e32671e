//! `actorpipe bench efa`: tagged ping-pong through the endpoint actor, and through pipes on the
//! `efa` transport and the `efa` channel ([`crate::efa_pipe`]), next to a raw baseline written
//! with the same libfabric binding (no actorpipe code on its path), in the same run, rounds
//! alternating, on each provider asked for.
//!
//! Raw: two threads, each with its own endpoint, each busy-polling its completion queue: post a
//! receive, post the send, wait for both. Actor: two threads, each an actix system with a
//! `FabricEndpoint`; the client posts the same two ops with one `FabricPost` and awaits both
//! ends on its queue; the server echoes each message back from the buffer it arrived in.

use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use actorpipe::internal::backend::efa::engine::{Kind, Op};
use actorpipe::internal::backend::efa::tag::{self, Stream};
use actorpipe::internal::backend::efa::{Domain, Endpoint, InfoList, PostError};
use actorpipe::internal::hardware::efa::{
    EndpointConfig, FabricAttach, FabricDescribe, FabricEndpoint, FabricPost,
};

use crate::cli::EfaArgs;
use crate::failure::Failure;
use crate::measure::{Counts, Samples, Summary};
use crate::units::{gb_per_s, human_duration, human_size};

/// Runs the benchmark and prints one row per (provider, size).
pub fn run(args: &EfaArgs) -> Result<(), Failure> {
    if let Some(secs) = args.idle {
        return idle(args, Duration::from_secs(secs));
    }
    let pin = args.pin;
    if pin {
        crate::run::pin_to(0)?;
    }
    println!(
        "{:<12} {:>6} {:<15} {:>11} {:>7} {:>9}",
        "provider", "size", "row", "p50", "vs raw", "GB/s"
    );
    // The rows' efa transports are configured here, so the ACTORPIPE_EFA_* variables do not
    // reach them: without --spin the endpoints never spin; with it each actorpipe row runs
    // twice per round, without and with spin, against the same raw rounds.
    let plain = EndpointConfig {
        busy_poll: Duration::ZERO,
        force_polling: args.no_wait_fd,
        ..EndpointConfig::default()
    };
    let wait_fd = !args.no_wait_fd;
    let mut configs = vec![("", plain)];
    if let Some(us) = args.spin {
        let spin = EndpointConfig {
            busy_poll: Duration::from_micros(us),
            ..plain
        };
        configs.push((" spin", spin));
    }
    let wanted = |row: &str| args.rows.is_empty() || args.rows.iter().any(|r| r == row);
    for provider in &args.providers {
        for &size in &args.sizes.0 {
            let counts = Counts::for_size(size, args.iters, None);
            // The striped row only where the provider lists several domains.
            let domains = actorpipe::transport::Efa::new(provider)
                .domains()
                .map_or(0, |d| d.len());
            let mut rows = vec![("raw".to_string(), Samples::new())];
            // The raw ping-pong again, sending with fi_tinject (no send completion), as the
            // endpoint does for sends that fit; only where this size fits.
            let inject = InfoList::get(Some(provider))
                .ok()
                .and_then(|l| l.iter().next().map(|i| i.attributes().inject_size >= size))
                .unwrap_or(false);
            let at_raw = rows.len();
            rows.push(("raw inject".to_string(), Samples::new()));
            for (suffix, _) in &configs {
                for name in ["actor", "transport", "channel", "in-place", "striped"] {
                    rows.push((format!("{name}{suffix}"), Samples::new()));
                }
            }
            for _ in 0..args.rounds {
                if wanted("raw") {
                    rows[0].1.extend(raw_round(
                        provider,
                        size as usize,
                        counts,
                        (false, pin, wait_fd),
                    )?);
                }
                if inject && wanted("raw inject") {
                    rows[at_raw].1.extend(raw_round(
                        provider,
                        size as usize,
                        counts,
                        (true, pin, wait_fd),
                    )?);
                }
                for (k, (suffix, config)) in configs.iter().enumerate() {
                    let at = at_raw + 1 + 5 * k;
                    let wanted = |row: &str| wanted(&format!("{row}{suffix}"));
                    if wanted("actor") {
                        rows[at].1.extend(actor_round(
                            provider,
                            size as usize,
                            counts,
                            *config,
                            pin,
                        )?);
                    }
                    let pipe_rows = [
                        crate::efa_pipe::Row::Transport,
                        crate::efa_pipe::Row::Channel,
                        crate::efa_pipe::Row::InPlace,
                        crate::efa_pipe::Row::Striped,
                    ];
                    for (j, row) in pipe_rows.into_iter().enumerate() {
                        let skip = row == crate::efa_pipe::Row::Striped && domains < 2;
                        if skip || !wanted(row.name()) {
                            continue;
                        }
                        rows[at + 1 + j].1.extend(crate::efa_pipe::round(
                            row, provider, size, counts, *config, args.api, pin,
                        )?);
                    }
                }
            }
            // Without the raw row (left out with --rows, to count one row's work) the ratio
            // column is empty.
            let raw = Summary::of(&rows[0].1).map_or(f64::NAN, |r| r.p50.as_secs_f64());
            for (name, samples) in &rows {
                let Some(s) = Summary::of(samples) else {
                    continue;
                };
                println!(
                    "{:<12} {:>6} {:<15} {:>11} {:>7.2} {:>9.2}",
                    provider,
                    human_size(size),
                    name,
                    human_duration(s.p50),
                    s.p50.as_secs_f64() / raw,
                    gb_per_s(2 * size, s.p50),
                );
            }
        }
    }
    Ok(())
}

fn failed(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::Failed(format!("{what}: {e}"))
}

/// The raw ping-pong's endpoint: its CQ with a wait fd where the provider offers one, as the
/// endpoint actor's by default, unless `wait_fd` is false (`--no-wait-fd`).
fn open_raw(provider: &str, wait_fd: bool) -> Result<Endpoint, Failure> {
    let list = InfoList::get(Some(provider)).map_err(|e| failed("fi_getinfo", e))?;
    let info = list
        .iter()
        .next()
        .ok_or_else(|| failed(provider, "no domain"))?;
    let domain = Domain::open(info).map_err(|e| failed("domain", e))?;
    Endpoint::open_with(&domain, info, wait_fd).map_err(|e| failed("endpoint", e))
}

/// Waits until `n` completions have been read, busy-polling.
fn reap(ep: &mut Endpoint, mut n: usize) -> Result<(), Failure> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while n > 0 {
        let mut err = None;
        ep.poll(|c| {
            if let Err(e) = c.result {
                err = Some(e);
            }
            n -= 1;
        })
        .map_err(|e| failed("fi_cq_read", e))?;
        if let Some(e) = err {
            return Err(failed("completion", e));
        }
        if Instant::now() > deadline {
            return Err(failed("raw ping-pong", "no completion within 60 s"));
        }
    }
    Ok(())
}

/// Posts with `f`, progressing the CQ and retrying while the provider answers `-FI_EAGAIN`
/// (rxm does while it connects to a new peer). Returns the completions read meanwhile.
fn post(
    ep: &mut Endpoint,
    mut f: impl FnMut(&Endpoint) -> Result<(), PostError>,
) -> Result<usize, Failure> {
    let mut read = 0;
    loop {
        match f(ep) {
            Ok(()) => return Ok(read),
            Err(PostError::Again) => {
                read += ep.poll(|_| {}).map_err(|e| failed("fi_cq_read", e))?;
            }
            Err(PostError::Failed(e)) => return Err(failed("post", e)),
        }
    }
}

/// One side of the raw ping-pong: `total` exchanges; the client times each after the warm-up.
/// With `inject`, the sends are `fi_tinject`s: no completion to wait for.
fn raw_side(
    mut ep: Endpoint,
    peer: &[u8],
    size: usize,
    counts: Counts,
    (client, inject): (bool, bool),
) -> Result<Samples, Failure> {
    let to = ep.insert(peer).map_err(|e| failed("fi_av_insert", e))?;
    let mut out = vec![7u8; size];
    let mut inb = vec![0u8; size];
    let (mut c1, mut c2) = ([0u64; 9], [0u64; 9]);
    let t = tag::make(Stream::Raw, 0, 0);
    let mut samples = Samples::with_capacity(counts.iters as usize);
    for i in 0..counts.total() {
        let start = Instant::now();
        let (pin, pout) = (inb.as_mut_ptr(), out.as_ptr());
        let (x1, x2) = (c1.as_mut_ptr().cast(), c2.as_mut_ptr().cast());
        // SAFETY: buffers and contexts live across `reap`, which reads both completions.
        let mut early = post(&mut ep, |ep| unsafe {
            ep.trecv(pin, size, std::ptr::null_mut(), to, t, 0, x1)
        })?;
        if !client {
            reap(&mut ep, 1 - early)?;
            early = 0;
        }
        let sends: usize = if inject {
            early += post(&mut ep, |ep| ep.tinject(&out, to, t, 0))?;
            0
        } else {
            // SAFETY: as above.
            early += post(&mut ep, |ep| unsafe {
                ep.tsend(pout, size, std::ptr::null_mut(), to, t, 0, x2)
            })?;
            1
        };
        reap(
            &mut ep,
            (if client { 1 + sends } else { sends }).saturating_sub(early),
        )?;
        if client && i >= counts.warmup {
            samples.push(start.elapsed());
        }
        std::mem::swap(&mut out, &mut inb);
    }
    Ok(samples)
}

fn raw_round(
    provider: &str,
    size: usize,
    counts: Counts,
    (inject, pin, wait_fd): (bool, bool, bool),
) -> Result<Samples, Failure> {
    let (to_server, from_client) = std_mpsc::channel::<Vec<u8>>();
    let (to_client, from_server) = std_mpsc::channel::<Vec<u8>>();
    let p = provider.to_string();
    let server = std::thread::spawn(move || -> Result<Samples, Failure> {
        pin_echo(pin)?;
        let ep = open_raw(&p, wait_fd)?;
        let _ = to_client.send(ep.name().to_vec());
        let peer = from_client.recv().map_err(|e| failed("setup", e))?;
        raw_side(ep, &peer, size, counts, (false, inject))
    });
    let ep = open_raw(provider, wait_fd)?;
    let _ = to_server.send(ep.name().to_vec());
    let peer = from_server.recv().map_err(|e| failed("server", e))?;
    let samples = raw_side(ep, &peer, size, counts, (true, inject))?;
    server.join().map_err(|_| failed("server", "panicked"))??;
    Ok(samples)
}

/// One side through the endpoint actor, inside an actix system of its own thread.
fn actor_side(
    provider: String,
    tx: std_mpsc::Sender<(Vec<u8>, u32)>,
    rx: std_mpsc::Receiver<(Vec<u8>, u32)>,
    size: usize,
    counts: Counts,
    (client, config): (bool, EndpointConfig),
) -> Result<Samples, Failure> {
    let system = actix::System::new();
    system.block_on(async move {
        let ep = FabricEndpoint::open(&provider, None, config)?;
        let name = ep.send(FabricDescribe).await?.name;
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send((name, 0));
        let (peer, _) = rx.recv().map_err(|e| failed("setup", e))?;
        let pipe = ep.send(FabricAttach { peer, sink }).await??;
        let _ = tx.send((Vec::new(), pipe));
        let (_, peer_pipe) = rx.recv().map_err(|e| failed("setup", e))?;
        let (tin, tout) = (
            tag::make(Stream::Raw, pipe, 0),
            tag::make(Stream::Raw, peer_pipe, 0),
        );
        let mut out = vec![7u8; size];
        let mut inb = vec![0u8; size];
        let mut samples = Samples::with_capacity(counts.iters as usize);
        for i in 0..counts.total() {
            let start = Instant::now();
            let recv = Op {
                kind: Kind::Recv,
                tag: tin,
                mem: std::mem::take(&mut inb),
                id: 0,
            };
            if client {
                let send = Op {
                    kind: Kind::Send,
                    tag: tout,
                    mem: std::mem::take(&mut out),
                    id: 0,
                };
                ep.do_send(FabricPost {
                    pipe,
                    ops: vec![recv, send],
                });
            } else {
                ep.do_send(FabricPost {
                    pipe,
                    ops: vec![recv],
                });
                let f = done
                    .recv()
                    .await
                    .ok_or_else(|| failed("endpoint", "stopped"))?;
                f.result.map_err(|e| failed("receive", e))?;
                let send = Op {
                    kind: Kind::Send,
                    tag: tout,
                    mem: f.mem,
                    id: 0,
                };
                ep.do_send(FabricPost {
                    pipe,
                    ops: vec![send],
                });
            }
            for _ in 0..if client { 2 } else { 1 } {
                let f = done
                    .recv()
                    .await
                    .ok_or_else(|| failed("endpoint", "stopped"))?;
                f.result.as_ref().map_err(|e| failed("op", e))?;
                match f.kind {
                    Kind::Recv => inb = f.mem,
                    Kind::Send => out = f.mem,
                }
            }
            if !client {
                // The echo went out of the receive buffer; the send buffer is the spare.
                std::mem::swap(&mut out, &mut inb);
            }
            if client && i >= counts.warmup {
                samples.push(start.elapsed());
            }
        }
        Ok(samples)
    })
}

fn actor_round(
    provider: &str,
    size: usize,
    counts: Counts,
    config: EndpointConfig,
    pin: bool,
) -> Result<Samples, Failure> {
    let (a_tx, b_rx) = std_mpsc::channel();
    let (b_tx, a_rx) = std_mpsc::channel();
    let p = provider.to_string();
    let server = std::thread::spawn(move || {
        pin_echo(pin)?;
        actor_side(p, b_tx, b_rx, size, counts, (false, config))
    });
    let samples = actor_side(
        provider.to_string(),
        a_tx,
        a_rx,
        size,
        counts,
        (true, config),
    )?;
    server.join().map_err(|_| failed("server", "panicked"))??;
    Ok(samples)
}

/// With `--pin`, binds the calling echo side's thread (and those it starts) to CPU 1; the
/// client's is on CPU 0 from the start of the run.
pub fn pin_echo(pin: bool) -> Result<(), Failure> {
    if pin {
        crate::run::pin_to(1)?;
    }
    Ok(())
}

/// CPU time this process has used (user + system).
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct we pass; RUSAGE_SELF is always valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000);
    t(u.ru_utime) + t(u.ru_stime)
}

/// Idle cost: one endpoint actor with a receive posted (a pipe waiting for its peer), held for
/// `hold`, per provider and progress mode; prints the CPU share of one core it used.
fn idle(args: &EfaArgs, hold: Duration) -> Result<(), Failure> {
    println!("{:<12} {:<22} {:>14}", "provider", "progress", "idle CPU");
    for provider in &args.providers {
        for force_polling in [false, true] {
            let config = EndpointConfig {
                force_polling,
                busy_poll: Duration::ZERO,
                ..EndpointConfig::default()
            };
            let p = provider.clone();
            let (share, wait_fd) = actix::System::new().block_on(async move {
                let a = FabricEndpoint::open(&p, None, config)?;
                let b = FabricEndpoint::open(&p, None, config)?;
                let name_b = b.send(FabricDescribe).await?.name;
                let info = a.send(FabricDescribe).await?;
                let (sink, _done) = tokio::sync::mpsc::unbounded_channel();
                let pipe = a.send(FabricAttach { peer: name_b, sink }).await??;
                let t = tag::make(Stream::Raw, pipe, 0);
                a.do_send(FabricPost {
                    pipe,
                    ops: vec![Op {
                        kind: Kind::Recv,
                        tag: t,
                        mem: vec![0; 64],
                        id: 0,
                    }],
                });
                // Let the spin phase end first.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let (c0, w0) = (cpu_time(), Instant::now());
                tokio::time::sleep(hold).await;
                let share = (cpu_time() - c0).as_secs_f64() / w0.elapsed().as_secs_f64();
                drop(b);
                Ok::<_, Failure>((share, info.wait_fd))
            })?;
            let mode = if wait_fd {
                "wait fd"
            } else {
                "polling (1 ms back-off)"
            };
            if force_polling && !wait_fd && provider_has_no_fd_anyway(provider) {
                continue;
            }
            println!("{:<12} {:<22} {:>13.2}%", provider, mode, share * 100.0);
        }
    }
    Ok(())
}

/// Whether forcing polling changes nothing (the provider has no wait fd).
fn provider_has_no_fd_anyway(provider: &str) -> bool {
    open_raw(provider, true)
        .map(|ep| ep.wait_fd().is_none())
        .unwrap_or(true)
}
