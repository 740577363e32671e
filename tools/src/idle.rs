//! `bench idle`: what an idle pipe costs. One client context opens N pipes to a server process
//! it spawned; both sides report resident memory (`VmRSS` of `/proc/self/status`) before and
//! after, and the client counts its file descriptors. One pipe is opened before the "before"
//! reading, so that one-time costs (runtime buffers, allocator arenas, thread pools) are not
//! charged to the pipes.

use std::io::Write as _;
use std::time::Duration;

use actix::{Addr, System};
use actorpipe::{Connect, GetInfo, Pipe};
use serde_json::json;

use crate::bench;
use crate::cli::IdleArgs;
use crate::failure::{bad, Failure};
use crate::plan::{Setup, Transports};
use crate::report::{Progress, Provenance};
use crate::server::{self, Spawned};

/// The per-pipe goal of the issue.
const GOAL_KIB: f64 = 64.0;

/// Resident memory of this process, from `/proc/self/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rss {
    /// `VmRSS`.
    pub total_kib: u64,
    /// `RssAnon`: heap and stacks.
    pub anon_kib: u64,
    /// `RssShmem`: shared memory this process has touched (shm rings).
    pub shmem_kib: u64,
}

/// Reads this process's resident memory; `None` without `/proc`.
pub fn rss() -> Option<Rss> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()
    };
    Some(Rss {
        total_kib: field("VmRSS:")?,
        anon_kib: field("RssAnon:").unwrap_or(0),
        shmem_kib: field("RssShmem:").unwrap_or(0),
    })
}

/// CPU time (user + system) this process has used so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct we pass, which lives for the call.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// A configuration `bench idle` measures.
fn setup(name: &str) -> Result<Setup, Failure> {
    match name {
        "tcp+basic" => Ok(Setup {
            transports: Transports::Tcp,
            channel: Some("basic"),
            lanes: None,
            spin: None,
            no_keepalive: false,
            io_threads: None,
            cma_threads: None,
            mpt_inline_max: None,
        }),
        "default" => Ok(Setup {
            transports: Transports::Both,
            channel: None,
            lanes: None,
            spin: None,
            no_keepalive: false,
            io_threads: None,
            cma_threads: None,
            mpt_inline_max: None,
        }),
        _ => Err(bad(format!(
            "unknown configuration {name:?} for bench idle: use tcp+basic or default"
        ))),
    }
}

/// One configuration's numbers.
struct Measured {
    name: String,
    negotiated: String,
    pipes: u32,
    client_before: Rss,
    client_after: Rss,
    server_before: u64,
    server_after: u64,
    fds_before: usize,
    fds_after: usize,
    /// Client CPU time over the idle hold, and the hold.
    idle_cpu: Duration,
    hold: Duration,
}

impl Measured {
    fn per_pipe(&self, before: u64, after: u64) -> f64 {
        after.saturating_sub(before) as f64 / self.pipes as f64
    }

    fn client_kib(&self) -> f64 {
        self.per_pipe(self.client_before.total_kib, self.client_after.total_kib)
    }

    fn server_kib(&self) -> f64 {
        self.per_pipe(self.server_before, self.server_after)
    }

    /// The client's CPU use while the pipes sat idle, in percent of one core.
    fn idle_cpu_percent(&self) -> f64 {
        100.0 * self.idle_cpu.as_secs_f64() / self.hold.as_secs_f64()
    }
}

/// Runs `bench idle` (or its server side).
pub fn run(args: &IdleArgs) -> Result<(), Failure> {
    let names: Vec<&str> = match args.backend.as_deref() {
        None | Some("both") => vec!["tcp+basic", "default"],
        Some(one) => vec![one],
    };
    let setups: Vec<(&str, Setup)> = names
        .iter()
        .map(|n| setup(n).map(|s| (*n, s)))
        .collect::<Result<_, _>>()?;
    if let Some(url) = &args.serve {
        crate::plan::check_url(url)?;
        return serve(&setups[0].1, url);
    }
    if rss().is_none() {
        return Err(Failure::Failed("bench idle needs /proc/self/status".into()));
    }
    let progress = Progress::new(setups.len() as u64 * args.pipes as u64, args.json);
    let mut results = Vec::new();
    for (name, setup) in &setups {
        progress.stage(format!("{name}: opening pipes"));
        results.push(measure(
            name,
            setup,
            args.pipes,
            Duration::from_secs(args.hold),
            &progress,
        )?);
    }
    progress.finish();
    crate::report::emit(&report(&results, args.json))
}

fn serve(setup: &Setup, url: &str) -> Result<(), Failure> {
    let system = System::new();
    let listening = system.block_on(bench::listen(setup.builder(), url, bench::Api::Fired))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "actorpipe {}", listening.urls[0])?;
    writeln!(out, "ready")?;
    out.flush()?;
    drop(out);
    server::watch_stdin();
    let _listening = listening;
    system.run()?;
    Ok(())
}

fn measure(
    name: &str,
    setup: &Setup,
    pipes: u32,
    hold: Duration,
    progress: &Progress,
) -> Result<Measured, Failure> {
    let args: Vec<String> = [
        "bench",
        "idle",
        "--backend",
        name,
        "--serve",
        setup.default_listen(),
    ]
    .map(String::from)
    .to_vec();
    let (mut server, endpoints) = Spawned::start(&args)?;
    let system = System::new();
    let builder = setup.builder();
    let ctx = system.block_on(async move { builder.start() });
    let url = endpoints.actorpipe.clone();
    let connect = |ctx: actix::Addr<actorpipe::Context>| {
        let url = url.clone();
        async move {
            ctx.send(Connect::new(&url))
                .await?
                .map_err(|e| Failure::from(e).context(&format!("connecting to {url}")))
        }
    };
    let first: Addr<Pipe> = system.block_on(connect(ctx.clone()))?;
    let info = system.block_on(first.send(GetInfo))?;
    system.block_on(async { tokio::time::sleep(Duration::from_millis(300)).await });
    let client_before = rss().unwrap_or_default();
    let fds_before = open_fds();
    let server_before = server.rss_kib()?;
    let mut open = Vec::with_capacity(pipes as usize);
    for _ in 0..pipes {
        open.push(system.block_on(connect(ctx.clone()))?);
        progress.inc();
    }
    progress.stage(format!("{name}: settling"));
    system.block_on(async { tokio::time::sleep(Duration::from_secs(1)).await });
    let client_after = rss().unwrap_or_default();
    let fds_after = open_fds();
    let server_after = server.rss_kib()?;
    progress.stage(format!("{name}: idle for {}", human_secs(hold)));
    let cpu_before = cpu_time();
    system.block_on(async { tokio::time::sleep(hold).await });
    let idle_cpu = cpu_time().saturating_sub(cpu_before);
    drop(open);
    drop(first);
    drop(server);
    Ok(Measured {
        name: name.to_string(),
        negotiated: format!("{}, {}", info.transport, info.channel_list()),
        pipes,
        client_before,
        client_after,
        server_before,
        server_after,
        fds_before,
        fds_after,
        idle_cpu,
        hold,
    })
}

fn human_secs(d: Duration) -> String {
    format!("{} s", d.as_secs())
}

/// The results as a table, or as JSON.
fn report(results: &[Measured], as_json: bool) -> String {
    let p = Provenance::here();
    if as_json {
        let rows: Vec<_> = results
            .iter()
            .map(|m| {
                json!({
                    "configuration": m.name,
                    "negotiated": m.negotiated,
                    "pipes": m.pipes,
                    "client_rss_kib_before": m.client_before.total_kib,
                    "client_rss_kib_after": m.client_after.total_kib,
                    "client_kib_per_pipe": m.client_kib(),
                    "client_anon_kib_per_pipe": m.per_pipe(m.client_before.anon_kib, m.client_after.anon_kib),
                    "client_shmem_kib_per_pipe": m.per_pipe(m.client_before.shmem_kib, m.client_after.shmem_kib),
                    "server_rss_kib_before": m.server_before,
                    "server_rss_kib_after": m.server_after,
                    "server_kib_per_pipe": m.server_kib(),
                    "client_fds_per_pipe": m.fds_after.saturating_sub(m.fds_before) as f64 / m.pipes as f64,
                    "client_idle_cpu_percent": m.idle_cpu_percent(),
                    "idle_hold_s": m.hold.as_secs_f64(),
                    "goal_kib_per_pipe": GOAL_KIB,
                })
            })
            .collect();
        let doc = json!({
            "bench": "idle",
            "machine": p.machine,
            "date": p.date,
            "command": p.command,
            "rows": rows,
        });
        return serde_json::to_string_pretty(&doc).expect("plain JSON") + "\n";
    }
    let mut out = String::new();
    out += "actorpipe bench idle: pipes opened on one client context to a spawned server, then left idle\n";
    out += "  RSS is VmRSS of /proc/self/status, after minus before, over the pipes opened\n";
    out += "  idle CPU is the client's user + system time while every pipe sat idle, in % of one core\n";
    out += &format!("  machine:     {}\n", p.machine);
    out += &format!("  date:        {}\n", p.date);
    out += &format!("  command:     {}\n\n", p.command);
    out += "| configuration | negotiated | pipes | client KiB/pipe | of which anon / shmem | server KiB/pipe | client fds/pipe | client idle CPU | goal < 64 KiB |\n";
    out += "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n";
    for m in results {
        let client = m.client_kib();
        let server = m.server_kib();
        let met = if client.max(server) < GOAL_KIB {
            "met"
        } else {
            "missed"
        };
        out += &format!(
            "| {} | {} | {} | {:.1} | {:.1} / {:.1} | {:.1} | {:.1} | {:.2} % over {} | {} |\n",
            m.name,
            m.negotiated,
            m.pipes,
            client,
            m.per_pipe(m.client_before.anon_kib, m.client_after.anon_kib),
            m.per_pipe(m.client_before.shmem_kib, m.client_after.shmem_kib),
            server,
            m.fds_after.saturating_sub(m.fds_before) as f64 / m.pipes as f64,
            m.idle_cpu_percent(),
            human_secs(m.hold),
            met
        );
    }
    out
}
