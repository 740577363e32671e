//! A round-trip benchmark from start to table: start the server side, connect, measure each
//! size through actorpipe and then through its baseline, report.

use std::net::SocketAddr;

use actix::{Arbiter, System};
use actorpipe::ContextBuilder;

use crate::baseline::{self, cma, shm, tcp, Baseline, BaselineClient};
use crate::bench::{self, Client};
use crate::cli::RunArgs;
use crate::failure::Failure;
use crate::measure::{Counts, Samples, Summary};
use crate::plan::{Arrangement, Plan};
use crate::report::{Progress, Provenance, Report, Row};
use crate::server::{self, Endpoints, Spawned};
use crate::units::human_size;

/// What keeps the server side alive while the client measures.
enum ServerSide {
    /// A child process; dropping it ends the process.
    Process { _child: Spawned },
    /// A thread of this process.
    Thread(Arbiter),
    /// Another host's business.
    Remote,
}

impl Drop for ServerSide {
    fn drop(&mut self) {
        if let ServerSide::Thread(a) = self {
            a.stop();
        }
    }
}

/// Runs the benchmark that `plan` describes.
pub fn run(plan: &Plan, args: &RunArgs) -> Result<(), Failure> {
    let largest = args.sizes.0.iter().copied().max().unwrap_or(0);
    if let Arrangement::Listen(url) = &plan.arrangement {
        if args.pin {
            pin_to(1)?;
        }
        return server::serve(plan, args, url, largest);
    }
    let report = measure(plan, args)?;
    if args.json {
        let mut text = serde_json::to_string_pretty(&report.json()).expect("plain JSON");
        text.push('\n');
        crate::report::emit(&text)
    } else {
        crate::report::emit(&report.table())
    }
}

/// Measures the client side of `plan` (not `--listen`) and returns its report.
pub fn measure(plan: &Plan, args: &RunArgs) -> Result<Report, Failure> {
    // How the two cores reach each other now, and again at the end (see `probe`).
    let cores_before = crate::probe::measure();
    if args.pin {
        // Before any thread starts, so that every thread of this side inherits it.
        pin_to(0)?;
    }
    let system = System::new();
    let mut ring_fds = None;
    let (server, endpoints) = match &plan.arrangement {
        Arrangement::Spawned => {
            if plan.needs().shm {
                ring_fds = Some(shm::RingFds::create().map_err(|e| {
                    Failure::Failed(format!("cannot set up the shm baseline: {e}"))
                })?);
            }
            let server_args = server_args(plan, args, ring_fds.as_ref().map(|f| f.to_arg()));
            let (spawned, endpoints) = Spawned::start(&server_args)?;
            (ServerSide::Process { _child: spawned }, endpoints)
        }
        Arrangement::InProcess => {
            let (url, arbiter) = system.block_on(start_in_process(
                plan.setup.builder(),
                plan.setup.default_listen(),
                args.pin,
                args.api,
            ))?;
            let endpoints = Endpoints {
                actorpipe: url,
                ..Endpoints::default()
            };
            (ServerSide::Thread(arbiter), endpoints)
        }
        Arrangement::Connect(url) => {
            let tcp = match &args.baseline {
                Some(a) => a.parse().ok(),
                None => system.block_on(next_port(url)),
            };
            let endpoints = Endpoints {
                actorpipe: url.clone(),
                tcp,
                cma: None,
            };
            (ServerSide::Remote, endpoints)
        }
        Arrangement::Listen(_) => unreachable!("served above"),
    };

    let mut builder = plan.setup.builder();
    if !args.lane_addresses.is_empty() {
        builder = builder.lane_addresses(args.lane_addresses.iter().copied());
    }
    let mut client = system.block_on(Client::connect(
        builder,
        &endpoints.actorpipe,
        plan.shape,
        args.api,
    ))?;
    let baseline = plan.baseline.unwrap_or_else(|| {
        Baseline::for_channel(client.channel(), &client.info.transport, plan.lanes)
    });
    let connected = if args.no_baseline {
        Err("not measured (--no-baseline)".to_string())
    } else {
        connect_baseline(baseline, &endpoints, ring_fds, plan)
    };
    let (mut baseline_client, baseline_text) = match connected {
        Ok(c) => (Some(c), baseline.describe()),
        Err(why) => (None, format!("n/a: {why}")),
    };

    let counts: Vec<Counts> = args
        .sizes
        .0
        .iter()
        .map(|&s| Counts::for_size(s, args.iters, args.warmup))
        .collect();
    let per_pass: u64 = counts.iter().map(|c| c.total() as u64).sum();
    let passes = if baseline_client.is_some() { 2 } else { 1 };
    let progress = Progress::new(per_pass * passes, args.json);
    let mut rows = Vec::new();
    for (&size, &count) in args.sizes.0.iter().zip(&counts) {
        // Rounds alternate between actorpipe and the baseline, so that a slow spell of the
        // machine weighs on both alike.
        let rounds = args.rounds.min(count.iters).max(1);
        let mut ours = Samples::new();
        let mut theirs = Samples::new();
        for round in 0..rounds {
            let share = Counts {
                warmup: if round == 0 { count.warmup } else { 0 },
                iters: count.iters / rounds + u32::from(round < count.iters % rounds),
            };
            progress.stage(format!("{}: actorpipe", human_size(size)));
            let s = system
                .block_on(client.measure(size, share, &progress))
                .map_err(|e| {
                    e.context(&format!(
                        "{} round trips of {}",
                        plan.label,
                        human_size(size)
                    ))
                })?;
            ours.extend(s);
            if let Some(b) = &mut baseline_client {
                progress.stage(format!("{}: baseline", human_size(size)));
                let s = b.measure(size, share, &progress).map_err(|e| {
                    Failure::Failed(format!("baseline round trips of {}: {e}", human_size(size)))
                })?;
                theirs.extend(s);
            }
        }
        rows.push(Row {
            size,
            actorpipe: Summary::of(&ours).expect("at least one timed round trip"),
            baseline: Summary::of(&theirs),
            ceiling: baseline::ceiling(size, count),
        });
    }
    progress.finish();
    let cores = [cores_before, crate::probe::measure()];
    let negotiated = format!(
        "transport {}, channels {}",
        client.info.transport,
        client.info.channel_list()
    );
    let channel = client.channel().to_string();
    system.block_on(client.close());
    drop(server);

    let mut notes = Vec::new();
    notes.push(format!(
        "api {}: {}",
        args.api.name(),
        match args.api {
            bench::Api::Fired => {
                "actors fire operations with notify and handle the completions; reads are ReadDescriptor then Read"
            }
            bench::Api::Receive => {
                "actors fire operations with notify and handle the completions; reads are Receive"
            }
            bench::Api::Writer => {
                "as receive, writing through a PipeWriter (small messages written from the actor's handler)"
            }
            bench::Api::Standing => {
                "as writer, reading with one standing receive (ReceiveAll): small messages go from the read loop to the actor"
            }
            bench::Api::Handler => {
                "as standing, with a handler called in place (ReceiveAll::calling): each side writes its next message from the read loop, no mailbox hop"
            }
            bench::Api::Awaited => "async code awaits each operation",
        }
    ));
    if plan.baseline.is_none() {
        notes.push(format!(
            "the baseline follows what the pipe negotiated (channel {channel})"
        ));
    }
    notes.push(format!(
        "each size runs in {} rounds alternating actorpipe and the baseline",
        args.rounds
    ));
    if rows.iter().any(|r| r.actorpipe.count < 100) {
        notes.push("with fewer than 100 round trips, p99 is the slowest one".into());
    }
    if let Some(spin) = plan.setup.spin {
        notes.push(format!(
            "spin mode: shm rings are polled for {} µs before sleeping (baseline too)",
            spin.as_micros()
        ));
    }
    let report = Report {
        title: plan.label.clone(),
        carries: plan.shape.describe().to_string(),
        arrangement: arrangement_text(plan),
        negotiated,
        baseline: baseline_text,
        baseline_name: baseline_client.is_some().then(|| baseline.name()),
        notes,
        rows,
        cores,
        provenance: Provenance::here(),
    };
    Ok(report)
}

fn arrangement_text(plan: &Plan) -> String {
    match &plan.arrangement {
        Arrangement::Spawned => {
            "2 processes on this host: this client and the echo server it spawned".into()
        }
        Arrangement::InProcess => {
            "1 process, 2 contexts on 2 threads (xth and the simulated ibv device work only within one process)".into()
        }
        Arrangement::Connect(url) => format!("this client and the echo server at {url}"),
        Arrangement::Listen(url) => format!("echo server at {url}"),
    }
}

/// The arguments that start the server side of `plan` as a child process.
fn server_args(plan: &Plan, args: &RunArgs, shm_fds: Option<String>) -> Vec<String> {
    let mut a: Vec<String> = ["bench", plan.kind.name(), "--serve", "--listen"]
        .map(String::from)
        .to_vec();
    a.push(plan.setup.default_listen().into());
    let sizes: Vec<String> = args.sizes.0.iter().map(u64::to_string).collect();
    a.extend(["--sizes".into(), sizes.join(",")]);
    for (flag, value) in [
        ("--backend", args.backend.clone()),
        ("--transport", args.transport.clone()),
        ("--lanes", args.lanes().map(|n| n.to_string())),
        ("--io-threads", args.io_threads.map(|n| n.to_string())),
        ("--cma-threads", args.cma_threads.map(|n| n.to_string())),
        (
            "--mpt-inline-max",
            args.mpt_inline_max.map(|n| n.to_string()),
        ),
        ("--spin", args.spin.map(|n| n.to_string())),
        ("--shm-fds", shm_fds),
        ("--api", Some(args.api.name().to_string())),
    ] {
        if let Some(v) = value {
            a.extend([flag.into(), v]);
        }
    }
    if args.pin {
        a.push("--pin".into());
    }
    if args.no_keepalive {
        a.push("--no-keepalive".into());
    }
    a
}

/// Binds the calling thread (and every thread it starts later) to one CPU.
pub(crate) fn pin_to(cpu: usize) -> Result<(), Failure> {
    // Online CPUs, not the ones this process may use: a spawned server inherits CPU 0 alone.
    // SAFETY: sysconf reads a system setting.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    if cpu >= cpus {
        return Err(crate::failure::bad(format!(
            "--pin needs 2 CPUs, this machine offers {cpus}"
        )));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity only touch it.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        return Err(Failure::Failed(format!(
            "cannot pin to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Starts an echo server on a new thread of this process; returns its URL and its thread.
async fn start_in_process(
    builder: ContextBuilder,
    url: &str,
    pin: bool,
    api: bench::Api,
) -> Result<(String, Arbiter), Failure> {
    let arbiter = Arbiter::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let url = url.to_string();
    arbiter.spawn_fn(move || {
        if pin {
            if let Err(e) = pin_to(1) {
                eprintln!("warning: {e}");
            }
        }
        actix::spawn(async move {
            match bench::listen(builder, &url, api).await {
                Ok(listening) => {
                    let _ = tx.send(Ok(listening.urls[0].clone()));
                    // The listener runs while this is held: hold it until the thread stops.
                    let _listening = listening;
                    std::future::pending::<()>().await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        });
    });
    let url = rx
        .await
        .map_err(|_| Failure::Failed("the in-process server thread stopped".into()))??;
    Ok((url, arbiter))
}

/// The TCP baseline of a server at `url`: same host, port + 1.
async fn next_port(url: &str) -> Option<SocketAddr> {
    let parsed = actorpipe::transport::Url::parse(url).ok()?;
    if parsed.scheme != "tcp" || parsed.port == u16::MAX {
        return None;
    }
    let mut addr = *parsed.socket_addrs().await.ok()?.first()?;
    addr.set_port(parsed.port + 1);
    Some(addr)
}

/// The client of `baseline`, or why it cannot run.
fn connect_baseline(
    baseline: Baseline,
    endpoints: &Endpoints,
    ring_fds: Option<shm::RingFds>,
    plan: &Plan,
) -> Result<BaselineClient, String> {
    let same_host = "it needs the server spawned on this host (drop --connect)";
    match baseline {
        Baseline::Tcp { lanes } => {
            let addr = endpoints
                .tcp
                .ok_or("no address for the server's TCP baseline (give --baseline HOST:PORT)")?;
            tcp::TcpClient::new(addr, lanes)
                .map(BaselineClient::Tcp)
                .map_err(|e| e.to_string())
        }
        Baseline::ShmRing => {
            let fds = ring_fds.ok_or(same_host)?;
            shm::ShmClient::new(fds, plan.setup.spin)
                .map(BaselineClient::Shm)
                .map_err(|e| e.to_string())
        }
        Baseline::Cma => endpoints
            .cma
            .map(|e| BaselineClient::Cma(cma::CmaClient::new(e)))
            .ok_or_else(|| same_host.to_string()),
        Baseline::Memcpy => Ok(BaselineClient::Memcpy(baseline::Memcpy::default())),
    }
}
