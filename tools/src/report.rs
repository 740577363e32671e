//! What a run prints: a progress bar while it runs, then a table (or JSON) that says what was
//! measured, on which machine, when, and with which command.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use crate::measure::Summary;
use crate::units::{gb_per_s, human_duration, human_size};

/// Writes `text` to stdout. A reader that went away (`| head`) is not an error: the output
/// simply stops, as with any command-line tool.
pub fn emit(text: &str) -> Result<(), crate::failure::Failure> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(
            crate::failure::Failure::Failed(format!("cannot write the results: {e}")),
        ),
        _ => Ok(()),
    }
}

/// A progress bar on stderr, or nothing.
#[derive(Debug, Clone)]
pub struct Progress(ProgressBar);

impl Progress {
    /// A bar for `total` round trips; hidden when `hidden` (for `--json`).
    pub fn new(total: u64, hidden: bool) -> Progress {
        if hidden {
            return Progress::hidden();
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("{msg:26} [{bar:20}] {pos}/{len} trips, {eta} left")
                .map(|s| s.progress_chars("=> "))
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        Progress(bar)
    }

    /// A bar that draws nothing.
    pub fn hidden() -> Progress {
        Progress(ProgressBar::hidden())
    }

    /// One round trip done.
    pub fn inc(&self) {
        self.0.inc(1);
    }

    /// Says what runs now.
    pub fn stage(&self, what: String) {
        self.0.set_message(what);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// One size of a run.
#[derive(Debug, Clone)]
pub struct Row {
    /// Message size in bytes (the tensor's, for `pipe`).
    pub size: u64,
    /// actorpipe round trips.
    pub actorpipe: Summary,
    /// Baseline round trips, if a baseline ran.
    pub baseline: Option<Summary>,
    /// The single-thread memcpy round trip of this size, the same-host ceiling.
    pub ceiling: Duration,
}

impl Row {
    fn gbps(&self, d: Duration) -> f64 {
        gb_per_s(2 * self.size, d)
    }

    /// actorpipe's p50 round trip over the baseline's.
    pub fn ratio(&self) -> Option<f64> {
        let b = self.baseline?;
        (b.p50 > Duration::ZERO).then(|| self.actorpipe.p50.as_secs_f64() / b.p50.as_secs_f64())
    }
}

/// Everything a run reports.
#[derive(Debug, Clone)]
pub struct Report {
    /// `transport tcp`, `channel cma`, `pipe default`.
    pub title: String,
    /// What one round trip carries.
    pub carries: String,
    /// Where the two sides ran.
    pub arrangement: String,
    /// What the pipe negotiated: transport and channels.
    pub negotiated: String,
    /// The baseline, described; or why there is none.
    pub baseline: String,
    /// The baseline's short name, if one ran.
    pub baseline_name: Option<String>,
    /// Anything else worth knowing about this run.
    pub notes: Vec<String>,
    /// The rows, in `--sizes` order.
    pub rows: Vec<Row>,
    /// How the machine's first two cores reached each other at the start and at the end of
    /// the run ([`crate::probe`]).
    pub cores: [Option<crate::probe::CrossCore>; 2],
    /// Machine, date and command.
    pub provenance: Provenance,
}

fn gbps_text(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

impl Report {
    /// The human form: a header, then a Markdown table (pastes into docs as is).
    pub fn table(&self) -> String {
        let mut out = String::new();
        let p = &self.provenance;
        out += &format!("actorpipe bench {}: {}\n", self.title, self.carries);
        out += &format!("  arrangement: {}\n", self.arrangement);
        out += &format!("  negotiated:  {}\n", self.negotiated);
        out += &format!("  baseline:    {}\n", self.baseline);
        for n in &self.notes {
            out += &format!("  note:        {n}\n");
        }
        out += &format!("  machine:     {}\n", p.machine);
        for (when, c) in ["at start", "at end"].iter().zip(&self.cores) {
            let seen = c.map_or("not measured (fewer than 2 CPUs)".into(), |c| c.describe());
            out += &format!("  cores {when:<8} {seen}\n");
        }
        out += &format!("  date:        {}\n", p.date);
        out += &format!("  command:     {}\n\n", p.command);
        out += "| size | round trips | p50 | p99 | GB/s | baseline p50 | baseline GB/s | ratio | memcpy GB/s |\n";
        out += "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
        for r in &self.rows {
            let (bp50, bgbps) = match r.baseline {
                Some(b) => (human_duration(b.p50), gbps_text(r.gbps(b.p50))),
                None => ("n/a".into(), "n/a".into()),
            };
            let ratio = r.ratio().map_or("n/a".into(), |x| format!("{x:.2}×"));
            out += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                human_size(r.size),
                r.actorpipe.count,
                human_duration(r.actorpipe.p50),
                human_duration(r.actorpipe.p99),
                gbps_text(r.gbps(r.actorpipe.p50)),
                bp50,
                bgbps,
                ratio,
                gbps_text(r.gbps(r.ceiling)),
            );
        }
        out += "\nGB/s = 2 × size / p50 round trip; ratio = actorpipe p50 / baseline p50 (lower is better, 1.00× = as fast as the raw path).\n";
        out
    }

    /// The machine-readable form (`--json`); times in microseconds.
    pub fn json(&self) -> Value {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "size": r.size,
                    "round_trips": r.actorpipe.count,
                    "p50_us": us(r.actorpipe.p50),
                    "p99_us": us(r.actorpipe.p99),
                    "gb_per_s": r.gbps(r.actorpipe.p50),
                    "baseline_p50_us": r.baseline.map(|b| us(b.p50)),
                    "baseline_p99_us": r.baseline.map(|b| us(b.p99)),
                    "baseline_gb_per_s": r.baseline.map(|b| r.gbps(b.p50)),
                    "ratio": r.ratio(),
                    "memcpy_gb_per_s": r.gbps(r.ceiling),
                })
            })
            .collect();
        json!({
            "bench": self.title,
            "carries": self.carries,
            "arrangement": self.arrangement,
            "negotiated": self.negotiated,
            "baseline": self.baseline_name,
            "baseline_description": self.baseline,
            "notes": self.notes,
            "machine": self.provenance.machine,
            "cores": self.cores.iter().map(|c| c.map(|c| json!({
                "cpus": [c.cpus.0, c.cpus.1],
                "cache_line_round_trip_us": c.line_round_trip.as_secs_f64() * 1e6,
                "handover_1mib_gb_per_s": c.handover_gbps,
            }))).collect::<Vec<_>>(),
            "date": self.provenance.date,
            "command": self.provenance.command,
            "rows": rows,
        })
    }
}

/// Where and when a run happened, and how to repeat it.
#[derive(Debug, Clone)]
pub struct Provenance {
    /// Cores, CPU model, memory, kernel.
    pub machine: String,
    /// UTC, to the minute.
    pub date: String,
    /// The command line, program name as `actorpipe`.
    pub command: String,
}

impl Provenance {
    /// This machine, now, and this process's command line.
    pub fn here() -> Provenance {
        Provenance {
            machine: machine(),
            date: utc_now(),
            command: command_line(),
        }
    }
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|x| x.1.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cores}-core {} ({model}), {:.1} GiB, Linux {}",
        std::env::consts::ARCH,
        mem_kib as f64 / (1u64 << 20) as f64,
        kernel.trim()
    )
}

fn command_line() -> String {
    let mut words = Vec::new();
    // A tunable that changes memcpy (see docs/performance.md) is part of how to repeat a run.
    if let Ok(t) = std::env::var("GLIBC_TUNABLES") {
        words.push(format!("GLIBC_TUNABLES={t}"));
    }
    words.push("actorpipe".to_string());
    for a in std::env::args().skip(1) {
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || "'\"$&|;<>".contains(c)) {
            words.push(format!("'{}'", a.replace('\'', r"'\''")));
        } else {
            words.push(a);
        }
    }
    words.join(" ")
}

/// `YYYY-MM-DD HH:MM UTC`, from the civil-from-days algorithm (no time zone database needed).
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60
    )
}
