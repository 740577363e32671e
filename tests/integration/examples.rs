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

#[test]
fn info_lists_every_backend_and_why() {
    let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
        .arg("info")
        .output()
        .expect("run actorpipe info");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for name in ["tcp", "shm", "basic", "xth", "cma", "mpt"] {
        assert!(text.contains(&format!(" {name} ")), "{text}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
        .args(["info", "--json"])
        .output()
        .expect("run actorpipe info --json");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    // Six CPU backends first; with the cuda feature each CUDA channel once per device pair;
    // with the ibv feature the ibv transport and the ibv channel (other hardware backends come
    // with their features).
    let all = v.as_array().expect("a list");
    // cuda_gdr (features cuda and ibv) adds one row per device pair too.
    let cuda = match (cfg!(feature = "cuda"), cfg!(feature = "ibv")) {
        (true, true) => 11,
        (true, false) => 8,
        _ => 0,
    };
    let ibv = if cfg!(feature = "ibv") { 2 } else { 0 };
    let named = |p: &str| {
        all.iter()
            .filter(|b| b["name"].as_str().unwrap().starts_with(p))
            .count()
    };
    assert_eq!(named("cuda_"), cuda, "{v}");
    assert_eq!(named("ibv"), ibv, "{v}");
    assert!(all.len() >= 6 + cuda + ibv, "{v}");
    assert_eq!(v[1]["name"], "shm");
    assert!(v[1]["domain"].as_str().unwrap().contains(':'));
}

/// Runs `actorpipe <args> --json` and returns its JSON.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
        .args(args)
        .arg("--json")
        .output()
        .expect("run actorpipe bench");
    assert!(
        out.status.success(),
        "actorpipe {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "actorpipe {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The bench command end to end, tiny: two processes, a row per size with a baseline, and the
/// idle measurement with its memory and CPU columns; bad input exits with code 2.
#[test]
fn bench_command_runs_end_to_end() {
    let v = bench_json(&[
        "bench",
        "transport",
        "--sizes",
        "64,70K",
        "--iters",
        "20",
        "--rounds",
        "1",
    ]);
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{v}");
    for r in rows {
        assert_eq!(r["round_trips"], 20, "{r}");
        assert!(r["p50_us"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["baseline_p50_us"].as_f64().unwrap() > 0.0, "{r}");
    }
    // The standing receive, with a recipient actor and with a handler answering in place: a
    // small message from the read loop, a large one (70 KiB) from the pipe, on both sides.
    for api in ["standing", "handler"] {
        let v = bench_json(&[
            "bench",
            "transport",
            "--backend",
            "shm",
            "--sizes",
            "64,70K",
            "--iters",
            "20",
            "--rounds",
            "2",
            "--api",
            api,
        ]);
        let rows = v["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 2, "{api}: {v}");
        for r in rows {
            assert_eq!(r["round_trips"], 20, "{api}: {r}");
            assert!(r["p50_us"].as_f64().unwrap() > 0.0, "{api}: {r}");
        }
    }
    // mpt lanes from two loopback addresses, as from two NICs.
    let v = bench_json(&[
        "bench",
        "channel",
        "--backend",
        "mpt",
        "--lane-addresses",
        "127.0.0.2,127.0.0.3",
        "--sizes",
        "1M",
        "--iters",
        "5",
        "--rounds",
        "1",
    ]);
    assert_eq!(v["rows"][0]["round_trips"], 5, "{v}");
    // Heartbeats off on both sides still measures.
    let v = bench_json(&[
        "bench",
        "transport",
        "--no-keepalive",
        "--sizes",
        "64",
        "--iters",
        "5",
        "--rounds",
        "1",
    ]);
    assert_eq!(v["rows"][0]["round_trips"], 5, "{v}");
    let v = bench_json(&["bench", "idle", "--pipes", "5", "--hold", "1"]);
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{v}");
    for r in rows {
        assert_eq!(r["pipes"], 5);
        let cpu = r["client_idle_cpu_percent"].as_f64();
        assert!(cpu.is_some_and(|c| c.is_finite() && c >= 0.0), "{r}");
        assert_eq!(r["idle_hold_s"].as_f64(), Some(1.0), "{r}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
        .args(["bench", "transport", "--sizes", "nonsense"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// `bench layers`: both layers measured over the shm transport (and over tcp), each round's
/// round trips counted, and a core-speed figure beside them.
#[test]
fn bench_layers_measures_each_layer() {
    let v = bench_json(&[
        "bench", "layers", "--iters", "200", "--warmup", "20", "--rounds", "2", "--spin", "5",
    ]);
    let rows = v["rows"].as_array().expect("rows");
    let names: Vec<_> = rows.iter().map(|r| r["layer"].as_str().unwrap()).collect();
    assert_eq!(names, ["halves", "halves + actor"], "{v}");
    for r in rows {
        assert_eq!(r["round_trips"], 400, "{r}");
        // Every timing is a measured one: a layer that never ran would print zeros.
        for k in ["p50_min_us", "p50_us", "p50_max_us", "p99_us"] {
            assert!(r[k].as_f64().is_some_and(|v| v > 0.0), "{k}: {r}");
        }
    }
    assert!(v["ns_per_xorshift_step"].as_f64().unwrap() > 0.0, "{v}");
    // Over loopback TCP too.
    let v = bench_json(&[
        "bench",
        "layers",
        "--transport",
        "tcp",
        "--iters",
        "50",
        "--warmup",
        "5",
        "--rounds",
        "1",
    ]);
    assert_eq!(v["transport"], "tcp", "{v}");
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(v["rows"][1]["round_trips"], 50, "{v}");
    // One layer alone, as a profiler counts it.
    let v = bench_json(&[
        "bench", "layers", "--layers", "actor", "--iters", "50", "--warmup", "5", "--rounds", "1",
    ]);
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{v}");
    assert_eq!(rows[0]["layer"], "halves + actor", "{v}");
    assert_eq!(rows[0]["round_trips"], 50, "{v}");
}

/// `bench layers --transport efa`: the two layers over the efa transport's stream on libfabric's
/// `shm` provider, its endpoint spinning; without the feature, a clear refusal.
#[test]
fn bench_layers_over_efa() {
    let line =
        "bench layers --transport efa --provider shm --spin 50 --iters 50 --warmup 5 --rounds 1";
    let args: Vec<&str> = line.split(' ').collect();
    if cfg!(feature = "efa") {
        let v = bench_json(&args);
        assert_eq!(v["transport"], "efa [shm]", "{v}");
        let rows = v["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 2, "{v}");
        for r in rows {
            assert_eq!(r["round_trips"], 50, "{r}");
            assert!(r["p50_us"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        }
    } else {
        let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
            .args(&args)
            .output()
            .expect("run actorpipe bench layers");
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("feature `efa`"), "{err}");
    }
}

/// `bench efa --pin` on libfabric's `shm` provider: the raw ping-pong and a pipe row, each a
/// p50 and a ratio to raw, with every row's two sides pinned to CPUs 0 and 1.
#[cfg(feature = "efa")]
#[test]
fn bench_efa_pinned_prints_raw_and_pipe_rows() {
    let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
        .args([
            "bench",
            "efa",
            "--providers",
            "shm",
            "--sizes",
            "64",
            "--iters",
            "50",
            "--rounds",
            "1",
            "--spin",
            "50",
            "--api",
            "handler",
            "--rows",
            "raw,transport spin",
            "--pin",
        ])
        .output()
        .expect("run actorpipe bench efa");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in ["raw", "transport spin"] {
        let line = text
            .lines()
            .find(|l| l.starts_with("shm") && l.contains(&format!(" {row} ")))
            .unwrap_or_else(|| panic!("no {row} row: {text}"));
        let ratio: f64 = line
            .split_whitespace()
            .rev()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no ratio: {line}"));
        assert!(ratio > 0.0, "{line}");
    }
}

/// `bench copy`: one process per thread count, each reporting the count in force and a rate
/// for every way and size; a count of 0 is bad input.
#[test]
fn bench_copy_compares_thread_counts() {
    let v = bench_json(&[
        "bench",
        "copy",
        "--sizes",
        "300K,1M",
        "--threads",
        "1,3",
        "--iters",
        "2",
    ]);
    let results = v["results"].as_array().expect("results");
    let threads: Vec<_> = results.iter().map(|r| r["threads"].as_u64()).collect();
    assert_eq!(threads, [Some(1), Some(3)], "{v}");
    for r in results {
        let rows = r["rows"].as_array().expect("rows");
        let sizes: Vec<_> = rows.iter().map(|x| x["size"].as_u64()).collect();
        assert_eq!(sizes, [Some(300 << 10), Some(1 << 20)], "{v}");
        for row in rows {
            for way in ["memcpy", "non-temporal", "copy_large"] {
                assert!(row[way].as_f64().is_some_and(|g| g > 0.0), "{way}: {row}");
            }
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
        .args(["bench", "copy", "--threads", "0"])
        .output()
        .expect("run actorpipe bench copy");
    assert_eq!(out.status.code(), Some(2));
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

/// `bench channel --backend cuda_*` says why it cannot run (without the feature, without a GPU,
/// an unknown name); where a GPU is, each of the three channels runs a short measurement for
/// real.
#[test]
fn bench_cuda_channels_run_or_say_why_not() {
    let run_with = |backend: &str, extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_actorpipe"))
            .args(["bench", "channel", "--backend", backend])
            .args(["--sizes", "4K,5M", "--iters", "3", "--rounds", "1"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        (
            out.status.code(),
            err,
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let run = |backend: &str| run_with(backend, &[]);
    let (code, err, _) = run("cuda_nope");
    assert_eq!(code, Some(2), "{err}");
    let gdr = cfg!(all(feature = "cuda", feature = "ibv"));
    if cfg!(feature = "cuda") && !gdr {
        let (code, err, _) = run("cuda_gdr");
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("--features cuda,ibv"), "{err}");
    }
    #[cfg(feature = "cuda")]
    {
        let (code, err, _) = run_with("cuda_ipc", &["--spin", "20"]);
        assert_eq!(code, Some(2), "--spin without shm: {err}");
        assert!(err.contains("--transport shm"), "{err}");
    }
    let gdr_row = if gdr { &["cuda_gdr"][..] } else { &[] };
    for &backend in ["cuda_xth", "cuda_ipc", "cuda_basic"].iter().chain(gdr_row) {
        let (code, err, out) = run(backend);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = &out;
            assert_eq!(code, Some(2), "{err}");
            assert!(err.contains("--features cuda"), "{err}");
        }
        #[cfg(feature = "cuda")]
        match actorpipe::cuda::available() {
            Err(why) => {
                assert_eq!(code, Some(1), "{err}");
                assert!(
                    err.contains("no CUDA GPU here") && err.contains(&why),
                    "{err}"
                );
            }
            Ok(_) => {
                assert_eq!(code, Some(0), "{err}");
                assert!(out.contains(&format!("{backend} (cuda->cuda)")), "{out}");
                assert!(out.contains("| size | pipe p50"), "{out}");
                match backend {
                    "cuda_ipc" => assert!(out.contains("raw 2-proc p50"), "{out}"),
                    "cuda_basic" => assert!(out.contains("cpu channel p50"), "{out}"),
                    _ => {}
                }
                // The control stream over shm, spinning.
                let (code, err, out) = run_with(backend, &["--transport", "shm", "--spin", "20"]);
                assert_eq!(code, Some(0), "{err}");
                assert!(out.contains("control:  shm, spinning 20 us"), "{out}");
            }
        }
    }
}
