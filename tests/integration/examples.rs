//! Every example runs, so none can rot. (The echo_peer example is run by processes.rs, and
//! here by the connect_burst test.)

use std::process::Command;
use std::time::Duration;

use crate::common::example;

/// Runs an example to completion (bounded) and returns its standard output.
fn run(name: &str) -> String {
    let mut child = Command::new(example(name))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start example");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                status.success(),
                "{name} failed: {status}\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            return stdout;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{name} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn quickstart_moves_tensors_and_reports() {
    let out = run("quickstart");
    assert!(out.contains("listening on tcp://127.0.0.1:"), "{out}");
    for size in ["4 KiB", "1 MiB", "16 MiB", "64 MiB"] {
        assert!(out.contains(size), "{out}");
    }
    assert!(out.contains("GB/s"), "{out}");
    assert!(
        out.contains("closed: pipe closed locally: quickstart done"),
        "{out}"
    );
}

#[test]
fn app_actor_gets_every_completion() {
    let out = run("app_actor");
    for i in 0..3 {
        assert!(out.contains(&format!("write {i} done: Ok(())")), "{out}");
        assert!(
            out.contains(&format!(
                "echo {i} back: metadata [{i}], tensor of 1048576 bytes, Ok(())"
            )),
            "{out}"
        );
    }
}

#[test]
fn metrics_example_prints_a_scrape() {
    let out = run("metrics");
    assert!(out.contains("actorpipe_messages_written_total{"), "{out}");
    assert!(out.contains("actorpipe_pipes_open 2"), "{out}");
}

/// `connect_burst` against an `echo_peer`: every connect is accounted for and every pipe echoes.
#[test]
fn connect_burst_dials_at_once_and_checks_every_pipe() {
    let mut peer = crate::common::ChildProcess::spawn({
        let mut c = Command::new(example("echo_peer"));
        c.arg("tcp://127.0.0.1:0");
        c
    });
    let (_, url) = peer
        .line("listening on ", Duration::from_secs(20))
        .expect("echo_peer starts");
    let out = Command::new(example("connect_burst"))
        .args([url.as_str(), "12"])
        .output()
        .expect("run connect_burst");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("12 connects to {url}")), "{text}");
    assert!(text.contains(": 12 ok"), "{text}");
    assert!(text.contains("12 of 12 pipes carried an echo"), "{text}");
}

#[test]
fn kv_transfer_reads_blocks_one_sided_and_notifies() {
    let out = run("kv_transfer");
    assert!(
        out.contains("prefill: registered 512 blocks of 64 KiB"),
        "{out}"
    );
    // Device memory where the example finds a GPU (feature `cuda`), host memory elsewhere.
    assert!(
        out.contains("decode: read 8 blocks (512 KiB) over xth in one batch")
            || out.contains("decode: read 8 blocks (512 KiB) over cuda_xth in one batch"),
        "{out}"
    );
    assert!(out.contains("prefill: notified by region"), "{out}");
    assert!(
        out.contains("prefill: pool of 33554432 bytes back"),
        "{out}"
    );
}
