//! `actorpipe info`: every backend this build knows, whether it can run on this host and why
//! not, and the domain descriptor it advertises (two peers use a backend only if both offer it
//! with equal descriptors).

use actorpipe::backends::{report, BackendReport};

/// Prints the report as a table, or as JSON with `json`.
pub fn run(json: bool) {
    let r = report();
    if json {
        // Serialising plain strings and numbers cannot fail.
        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
        return;
    }
    println!(
        "{:<10} {:<6} {:>8}  {:<10} {:<12} domain",
        "kind", "name", "priority", "available", "devices"
    );
    for b in &r {
        println!("{}", line(b));
        if let Some(why) = &b.reason {
            println!("{:>19}why not: {why}", "");
        }
    }
}

fn line(b: &BackendReport) -> String {
    let domain = if b.domain.is_empty() {
        "(any peer)"
    } else {
        &b.domain
    };
    format!(
        "{:<10} {:<6} {:>8}  {:<10} {:<12} {}",
        b.kind,
        b.name,
        b.priority,
        if b.available { "yes" } else { "no" },
        b.devices.as_deref().unwrap_or("-"),
        domain
    )
}
