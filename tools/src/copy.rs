//! `actorpipe bench copy`: how fast this machine copies large buffers on one thread and shared
//! among the process's copy threads (`actorpipe::internal::copy`), the floor under every same-host large
//! message (the shm ring's large reads and writes, the xth channel's copies).
//!
//! Each thread count runs in a process of its own (this program, with `--in-process --threads
//! N`, which prints JSON),
//! since a process fixes its copy threads at its first large copy. Every process times three
//! ways of copying the same prefaulted buffers, each the median of `--iters` copies after a
//! warm-up: `memcpy` (`copy_from_slice`, one thread), `non-temporal` (`copy::copy_nt`, one
//! thread) and `copy_large` (what the library uses: shared among the copy threads from 256
//! KiB, non-temporal from 8 MiB). Rates count each byte once.

use std::process::Command;
use std::time::Instant;

use serde_json::{json, Value};

use crate::cli::CopyArgs;
use crate::failure::{bad, Failure};
use crate::measure::pattern;
use crate::report::{emit, Provenance};
use crate::units::{gb_per_s, human_size};

/// The three ways, in the order of the table's columns.
const WAYS: [&str; 3] = ["memcpy", "non-temporal", "copy_large"];

pub fn run(args: &CopyArgs) -> Result<(), Failure> {
    if args.in_process {
        let [one] = args.threads.as_slice() else {
            return Err(bad("bench copy --in-process: one thread count"));
        };
        return one_process(args, *one).map(|v| println!("{v}"));
    }
    let here = Provenance::here();
    let mut results = Vec::new();
    for &n in &args.threads {
        results.push(child(args, n)?);
    }
    if args.json {
        let v = json!({
            "machine": here.machine,
            "date": here.date,
            "command": here.command,
            "iters": args.iters,
            "results": results,
        });
        println!("{v}");
        Ok(())
    } else {
        emit(&table(&here, args, &results))
    }
}

/// Runs this program for `threads` copy threads and reads its JSON.
fn child(args: &CopyArgs, threads: u32) -> Result<Value, Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Failed(format!("cannot find this program: {e}")))?;
    let sizes: Vec<String> = args.sizes.0.iter().map(|s| s.to_string()).collect();
    let out = Command::new(exe)
        .args([
            "bench",
            "copy",
            "--in-process",
            "--threads",
            &threads.to_string(),
        ])
        .args(["--sizes", &sizes.join(",")])
        .args(["--iters", &args.iters.to_string()])
        .env_remove("ACTORPIPE_COPY_THREADS")
        .output()
        .map_err(|e| Failure::Failed(format!("cannot run the copy process: {e}")))?;
    if !out.status.success() {
        return Err(Failure::Failed(format!(
            "the copy process for {threads} threads failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| Failure::Failed(format!("the copy process printed no JSON: {e}")))
}

/// Times every way at every size in this process, with `threads` copy threads.
fn one_process(args: &CopyArgs, threads: u32) -> Result<Value, Failure> {
    if let Err(now) = actorpipe::internal::copy::set_threads(threads as usize) {
        return Err(Failure::Failed(format!(
            "the copy threads had started already ({now})"
        )));
    }
    let in_force = actorpipe::internal::copy::threads();
    let mut rows = Vec::new();
    for &size in &args.sizes.0 {
        let len = size as usize;
        let src = pattern(len, size);
        // Prefaulted: the first touch of a page is not what is measured.
        let mut dst = vec![0xA5u8; len];
        let mut row = serde_json::Map::new();
        row.insert("size".into(), json!(size));
        for way in WAYS {
            let mut times = Vec::with_capacity(args.iters as usize);
            for i in 0..args.iters + WARMUP {
                let t = Instant::now();
                match way {
                    "memcpy" => dst.copy_from_slice(&src),
                    "non-temporal" => actorpipe::internal::copy::copy_nt(&mut dst, &src),
                    _ => actorpipe::internal::copy::copy_large(&mut dst, &src),
                }
                let took = t.elapsed();
                if i >= WARMUP {
                    times.push(took);
                }
            }
            if dst != src {
                return Err(Failure::Failed(format!(
                    "{way} of {} copied wrong bytes",
                    human_size(size)
                )));
            }
            dst.fill(0x5A);
            times.sort_unstable();
            let p50 = times[times.len() / 2];
            row.insert(way.into(), json!(gb_per_s(size, p50)));
        }
        rows.push(Value::Object(row));
    }
    Ok(json!({ "threads": in_force, "rows": rows }))
}

/// Untimed copies before the timed ones.
const WARMUP: u32 = 3;

fn table(here: &Provenance, args: &CopyArgs, results: &[Value]) -> String {
    let mut t = String::new();
    t += "actorpipe bench copy: one buffer copied into another, median of each way\n";
    t += &format!("  machine:  {}\n", here.machine);
    t += &format!("  date:     {}\n", here.date);
    t += &format!("  command:  {}\n", here.command);
    t += &format!(
        "  {} timed copies per cell after {WARMUP} untimed; one process per thread count; GB/s \
         count each byte once\n\n",
        args.iters
    );
    t += "| size | threads | memcpy GB/s | non-temporal GB/s | copy_large GB/s | copy_large / memcpy |\n";
    t += "| ---: | ---: | ---: | ---: | ---: | ---: |\n";
    for &size in &args.sizes.0 {
        for r in results {
            let threads = r["threads"].as_u64().unwrap_or(0);
            let Some(row) = r["rows"]
                .as_array()
                .and_then(|rows| rows.iter().find(|x| x["size"].as_u64() == Some(size)))
            else {
                continue;
            };
            let rate = |w: &str| row[w].as_f64().unwrap_or(0.0);
            let ratio = rate("copy_large") / rate("memcpy").max(f64::MIN_POSITIVE);
            t += &format!(
                "| {} | {threads} | {:.1} | {:.1} | {:.1} | {ratio:.2}x |\n",
                human_size(size),
                rate("memcpy"),
                rate("non-temporal"),
                rate("copy_large"),
            );
        }
    }
    t += "\nThe same host's messages: `actorpipe bench transport --backend shm --sizes 1M,64M`, \
          `bench channel --backend xth`, `bench pipe`, each with ACTORPIPE_COPY_THREADS=1 to \
          compare.\n";
    t
}
