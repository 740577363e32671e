//! The server side of a run, and how a client starts it.
//!
//! By default the client spawns its own executable (`std::env::current_exe()`) with the hidden
//! `--serve` flag. The server prints one line per endpoint on stdout, then `ready`:
//!
//! ```text
//! actorpipe tcp://127.0.0.1:40123
//! baseline-tcp 127.0.0.1:40125
//! baseline-cma 4242 0x7f1c2c000000 67108864
//! ready
//! ```
//!
//! It answers `rss` on stdin with `rss <KiB>`, and exits when its stdin closes, so it never
//! outlives the client. With `--listen` alone (two hosts) it prints the same lines and serves
//! until interrupted.

use std::io::{BufRead, BufReader, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use actix::System;

use crate::baseline::{cma, shm, tcp};
use crate::bench;
use crate::cli::RunArgs;
use crate::failure::{bad, Failure};
use crate::plan::Plan;

/// How long a spawned server may take to print `ready`.
const START_LIMIT: Duration = Duration::from_secs(60);

/// Where a server can be reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoints {
    /// The actorpipe listener's URL.
    pub actorpipe: String,
    /// The raw TCP echo server, if it runs.
    pub tcp: Option<SocketAddr>,
    /// The buffer exposed for process_vm_readv, if any.
    pub cma: Option<cma::Exposed>,
}

/// A server process this process spawned; it exits when this value is dropped.
pub struct Spawned {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Spawned {
    /// Spawns this executable with `args` and waits until it is ready.
    pub fn start(args: &[String]) -> Result<(Spawned, Endpoints), Failure> {
        let exe = std::env::current_exe()
            .map_err(|e| Failure::Failed(format!("cannot find this program's path: {e}")))?;
        let mut child = Command::new(&exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Failure::Failed(format!("cannot start {}: {e}", exe.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Spawned {
            stdin: child.stdin.take(),
            child,
            lines,
        };
        let mut endpoints = Endpoints::default();
        loop {
            let line = server.next_line("start")?;
            let (key, value) = line.split_once(' ').unwrap_or((line.as_str(), ""));
            match key {
                "actorpipe" => endpoints.actorpipe = value.to_string(),
                "baseline-tcp" => endpoints.tcp = value.parse().ok(),
                "baseline-cma" => endpoints.cma = cma::Exposed::parse(value),
                "ready" => break,
                _ => {}
            }
        }
        if endpoints.actorpipe.is_empty() {
            return Err(Failure::Failed(
                "the server did not say where it listens".into(),
            ));
        }
        Ok((server, endpoints))
    }

    fn next_line(&mut self, doing: &str) -> Result<String, Failure> {
        match self.lines.recv_timeout(START_LIMIT) {
            Ok(line) => Ok(line),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Failure::Failed(format!(
                "the server process did not {doing} within {START_LIMIT:?}"
            ))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self
                    .child
                    .wait()
                    .map_or("unknown status".to_string(), |s| s.to_string());
                Err(Failure::Failed(format!(
                    "the server process exited before it could {doing} ({status}); its errors are above"
                )))
            }
        }
    }

    /// The server's resident memory, in KiB.
    pub fn rss_kib(&mut self) -> Result<u64, Failure> {
        let stdin = self.stdin.as_mut().expect("stdin is open until drop");
        writeln!(stdin, "rss").map_err(|e| Failure::Failed(format!("server gone: {e}")))?;
        loop {
            let line = self.next_line("answer")?;
            if let Some(kib) = line.strip_prefix("rss ") {
                return kib
                    .trim()
                    .parse()
                    .map_err(|_| Failure::Failed(format!("bad answer from the server: {line:?}")));
            }
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        // Closing its stdin tells the server to exit.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Exits once stdin closes (the client is gone); answers `rss` with `rss <KiB>`.
pub fn watch_stdin() {
    std::thread::spawn(|| {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line.trim() == "rss" {
                let kib = crate::idle::rss().map_or(0, |r| r.total_kib);
                // The client reads this; if it is gone, stdin closes next and we exit.
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "rss {kib}").and_then(|_| out.flush());
            }
        }
        std::process::exit(0);
    });
}

/// Where the raw TCP baseline binds: the listen URL's address with port + 1 (or any port when
/// the URL asks for any), or loopback when the run does not listen on TCP.
async fn baseline_bind(url: &str) -> Result<SocketAddr, Failure> {
    let loopback = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    if actorpipe::transport::scheme(url)? != "tcp" {
        return Ok(loopback);
    }
    let parsed = actorpipe::transport::Url::parse(url)?;
    let mut addr = *parsed
        .socket_addrs()
        .await?
        .first()
        .ok_or_else(|| bad(format!("{url:?} resolves to no address")))?;
    addr.set_port(match parsed.port {
        0 | u16::MAX => 0,
        p => p + 1,
    });
    Ok(addr)
}

/// Runs the server side of `plan` at `url` until the client goes (spawned) or for ever.
pub fn serve(plan: &Plan, args: &RunArgs, url: &str, largest: u64) -> Result<(), Failure> {
    let spawned = args.serve;
    // Take over inherited descriptors before anything else can open one.
    let shm_fds = args
        .shm_fds
        .as_deref()
        .map(shm::RingFds::from_arg)
        .transpose()
        .map_err(bad)?;
    let system = System::new();
    let (listening, tcp_bind) = system.block_on(async {
        let l = bench::listen(plan.setup.builder(), url, args.api).await?;
        Ok::<_, Failure>((l, baseline_bind(url).await?))
    })?;
    let needs = plan.needs();
    let mut lines = vec![format!("actorpipe {}", listening.urls[0])];
    if needs.tcp {
        let addr = tcp::spawn_server(tcp_bind)
            .map_err(|e| Failure::Failed(format!("tcp baseline server at {tcp_bind}: {e}")))?;
        lines.push(format!("baseline-tcp {addr}"));
    }
    if let (true, Some(fds)) = (needs.shm, shm_fds) {
        shm::spawn_server(fds, plan.setup.spin)?;
    }
    if needs.cma && spawned {
        lines.push(format!("baseline-cma {}", cma::expose(largest).to_line()));
    }
    lines.push("ready".into());
    let mut out = std::io::stdout().lock();
    for l in &lines {
        writeln!(out, "{l}")?;
    }
    out.flush()?;
    drop(out);
    if spawned {
        watch_stdin();
    } else {
        eprintln!(
            "serving {}; on the other host run: actorpipe bench {} <same options> --connect {}",
            plan.label,
            plan.kind.name(),
            listening.urls[0]
        );
    }
    let _listening = listening;
    system.run()?;
    Ok(())
}
