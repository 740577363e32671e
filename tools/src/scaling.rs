//! `bench channel --backend mpt --lanes 1,2,4,8`: mpt at each lane count, next to single-stream
//! tcp+basic and the N-socket raw baseline of the same run, in one table.

use crate::cli::RunArgs;
use crate::failure::Failure;
use crate::plan::{self, Kind};
use crate::report::{Provenance, Report};
use crate::units::human_size;

/// Whether `args` ask for a scaling table.
pub fn wanted(kind: Kind, args: &RunArgs) -> bool {
    kind == Kind::Channel && args.lanes.len() > 1 && args.listen.is_none()
}

/// Measures tcp+basic, then mpt at each lane count, and prints one table.
pub fn run(args: &RunArgs) -> Result<(), Failure> {
    if args.backend.as_deref() != Some("mpt") {
        return Err(crate::failure::bad(
            "a list of lane counts needs --backend mpt",
        ));
    }
    if args.json {
        return Err(crate::failure::bad(
            "--json takes one lane count (run once per count)",
        ));
    }
    let mut single = args.clone();
    single.backend = Some("basic".into());
    single.transport = Some("tcp".into());
    single.lanes = Vec::new();
    let basic = crate::run::measure(&plan::plan(Kind::Channel, &single)?, &single)?;
    let mut runs = Vec::new();
    for &n in &args.lanes {
        let mut one = args.clone();
        one.lanes = vec![n];
        runs.push((
            n,
            crate::run::measure(&plan::plan(Kind::Channel, &one)?, &one)?,
        ));
    }
    crate::report::emit(&table(&basic, &runs, &Provenance::here()))
}

fn gbps(size: u64, d: std::time::Duration) -> f64 {
    2.0 * size as f64 / d.as_secs_f64() / 1e9
}

fn table(basic: &Report, runs: &[(u32, Report)], p: &Provenance) -> String {
    let mut out = String::new();
    out += "actorpipe bench channel mpt, lanes scaling: 1 tensor of each size, echoed\n";
    out += &format!(
        "  machine:  {}\n  date:     {}\n  command:  {}\n",
        p.machine, p.date, p.command
    );
    out += &format!("  single stream: {} ({})\n", basic.title, basic.negotiated);
    if let Some((_, r)) = runs.first() {
        out += &format!("  arrangement: {}\n", r.arrangement);
    }
    out += "  x tcp+basic: tcp+basic p50 / mpt p50 (higher is better); raw: TCP over N sockets, one thread per socket\n\n";
    out += "| size | lanes | mpt p50 | mpt GB/s | x tcp+basic | raw p50 | raw GB/s | mpt / raw |\n";
    out += "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
    for (i, b) in basic.rows.iter().enumerate() {
        out += &format!(
            "| {} | tcp+basic | {:.3?} | {:.2} | 1.00 | {} | {} | {} |\n",
            human_size(b.size),
            b.actorpipe.p50,
            gbps(b.size, b.actorpipe.p50),
            b.baseline
                .map_or("n/a".into(), |s| format!("{:.3?}", s.p50)),
            b.baseline
                .map_or("n/a".into(), |s| format!("{:.2}", gbps(b.size, s.p50))),
            b.baseline.map_or("n/a".into(), |s| format!(
                "{:.2}x",
                b.actorpipe.p50.as_secs_f64() / s.p50.as_secs_f64()
            )),
        );
        for (n, r) in runs {
            let Some(row) = r.rows.get(i) else { continue };
            let p50 = row.actorpipe.p50;
            out += &format!(
                "| {} | {n} | {:.3?} | {:.2} | {:.2} | {} | {} | {} |\n",
                human_size(row.size),
                p50,
                gbps(row.size, p50),
                b.actorpipe.p50.as_secs_f64() / p50.as_secs_f64(),
                row.baseline
                    .map_or("n/a".into(), |s| format!("{:.3?}", s.p50)),
                row.baseline
                    .map_or("n/a".into(), |s| format!("{:.2}", gbps(row.size, s.p50))),
                row.baseline.map_or("n/a".into(), |s| format!(
                    "{:.2}x",
                    p50.as_secs_f64() / s.p50.as_secs_f64()
                )),
            );
        }
    }
    out
}
