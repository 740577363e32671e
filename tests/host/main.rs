//! Trials that need something of the host: cma's right to read process memory
//! (`process_vm_readv`, under ptrace rules), root for network namespaces, root to run a peer as
//! a second user (`cargo test --test host`). libtest-mimic (`harness = false`): a trial that
//! cannot run here reports itself ignored, its reason as its kind (`skipped: ...`), instead of
//! passing without checking anything.
//!
//! - `cma`: the cma primitives against the real kernel, this process's memory and a child's;
//! - `netns`: two hosts made of network namespaces, a link impaired, cut, doubled;
//! - `shm`: a peer of another user is refused, both ways.
//!
//! The trials run one at a time, nothing alongside, whatever `--test-threads` says: the netns
//! trials bound how long keepalive takes to find a cut link, and their child processes must not
//! share the machine's two cores with another trial's load.
//!
//! The binary is also its trials' child processes: run with [`CHILD_ENV`] set to a role and its
//! words (`cma`, `netns server`, `shm <url>`), `main` plays that role and exits.

use libtest_mimic::{Arguments, Trial};

#[path = "../common/mod.rs"]
mod common;

mod cma;
mod netns;
mod shm;

/// Selects a child role and its words: `cma`, `netns <mode> [url]`, `shm <url>`.
pub const CHILD_ENV: &str = "ACTORPIPE_HOST_CHILD";

fn main() {
    if let Ok(role) = std::env::var(CHILD_ENV) {
        let words: Vec<String> = role.split_whitespace().map(String::from).collect();
        match words.first().map(String::as_str) {
            Some("cma") => cma::child(),
            Some("netns") => netns::child(&words[1..]),
            Some("shm") => shm::child(&words[1..]),
            _ => panic!("unknown child role {role:?}"),
        }
        return;
    }
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let mut trials = cma::trials();
    trials.extend(shm::trials());
    trials.extend(netns::trials(&args));
    libtest_mimic::run(&args, trials).exit();
}

/// Whether this run may run the trial `name`: listing runs nothing, and the filter and `--skip`
/// select as libtest-mimic does. For a trial whose check of the host has side effects (netns
/// builds namespaces), made only when one of them will run.
pub fn may_run(args: &Arguments, name: &str) -> bool {
    let chosen = match &args.filter {
        None => true,
        Some(f) if args.exact => name == f,
        Some(f) => name.contains(f.as_str()),
    };
    let skipped = args.skip.iter().any(|s| {
        if args.exact {
            name == s
        } else {
            name.contains(s.as_str())
        }
    });
    !args.list && chosen && !skipped
}

/// A trial that runs `f` (a panic fails it), or reports itself ignored with `skip`, the reason
/// it cannot run here (`skipped: ...`).
pub fn trial(name: &str, skip: Option<&str>, f: fn()) -> Trial {
    let t = Trial::test(name, move || {
        f();
        Ok(())
    });
    match skip {
        Some(why) => t.with_ignored_flag(true).with_kind(why),
        None => t,
    }
}
