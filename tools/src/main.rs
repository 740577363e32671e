//! `actorpipe`: the command-line tool of the actorpipe runtime.
//!
//! `actorpipe info` lists every backend and whether it can run here.
//! `actorpipe bench transport|channel|pipe` measures echo round trips through the runtime and,
//! in the same run, through a raw baseline with no actorpipe code on its path; `actorpipe bench
//! idle` measures what idle pipes cost. `docs/performance.md` shows results and explains them.
//!
//! Exit codes: 0 on success, 2 on bad input (arguments, URLs, backend names), 1 when something
//! fails while running.

mod baseline;
mod bench;
mod cli;
mod copy;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "efa")]
mod efa;
#[cfg(feature = "efa")]
mod efa_pipe;
mod failure;
mod fired;
mod handler;
mod idle;
mod info;
mod layers;
mod measure;
mod plan;
mod probe;
mod remote;
#[cfg(feature = "cuda")]
mod remote_gpu;
mod report;
mod run;
mod scaling;
mod server;
mod tally;
mod units;

use clap::Parser;

use cli::{BenchCommand, Cli, Command};
use failure::Failure;
use plan::Kind;

fn main() {
    // The echoing side of `bench channel --backend cuda_ipc` (never returns there).
    #[cfg(feature = "cuda")]
    cuda::echo_child();
    // The owner's side of `bench remote --backend cuda_ipc` (never returns there).
    #[cfg(feature = "cuda")]
    remote_gpu::owner_child();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info { json } => {
            info::run(json);
            Ok(())
        }
        Command::Bench { what } => bench_command(what),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}

fn bench_command(what: BenchCommand) -> Result<(), Failure> {
    // Every context the command builds reads the ACTORPIPE_* variables: a malformed one is bad
    // input before anything runs.
    plan::check_env()?;
    let (kind, args) = match what {
        BenchCommand::Transport(a) => (Kind::Transport, a),
        BenchCommand::Channel(a) => (Kind::Channel, a),
        BenchCommand::Pipe(a) => (Kind::Pipe, a),
        BenchCommand::Idle(a) => return idle::run(&a),
        BenchCommand::Layers(a) => return layers::run(&a),
        BenchCommand::Copy(a) => return copy::run(&a),
        BenchCommand::Remote(a) => return remote::run(&a),
        #[cfg(feature = "efa")]
        BenchCommand::Efa(a) => return efa::run(&a),
    };
    if kind == Kind::Channel
        && args
            .backend
            .as_deref()
            .is_some_and(|b| b.starts_with("cuda_"))
    {
        #[cfg(feature = "cuda")]
        return cuda::run(&args);
        #[cfg(not(feature = "cuda"))]
        return Err(failure::bad(
            "the cuda_* channels need a build with --features cuda",
        ));
    }
    if !args.device.is_empty() {
        return Err(failure::bad("--device is for the cuda_* channels"));
    }
    if scaling::wanted(kind, &args) {
        return scaling::run(&args);
    }
    let plan = plan::plan(kind, &args)?;
    run::run(&plan, &args)
}
