//! `actorpipe info`: every backend this build knows, whether it can run on this host and why
//! not, and the domain descriptor it advertises (two peers use a backend only if both offer it
//! with equal descriptors).

use actorpipe::backends::{report, BackendReport};

/// Prints the report as a table, or as JSON with `json`. A closed stdout (`| head`) ends the
/// output quietly.
pub fn run(json: bool) {
    use std::io::Write;
    let r = report();
    let mut out = String::new();
    if json {
        // Serialising plain strings and numbers cannot fail.
        out = serde_json::to_string_pretty(&r).unwrap_or_default();
        out.push('\n');
    } else {
        out.push_str(&format!(
            "{:<10} {:<6} {:>8}  {:<10} {:<12} domain\n",
            "kind", "name", "priority", "available", "devices"
        ));
        for b in &r {
            out.push_str(&line(b));
            out.push('\n');
            if let Some(why) = &b.reason {
                out.push_str(&format!("{:>19}why not: {why}\n", ""));
            }
        }
        out.push_str(&rdma_devices());
    }
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
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

/// The RDMA devices found (real HCAs; the simulated device is never listed), or why none.
fn rdma_devices() -> String {
    match actorpipe::backends::rdma_devices() {
        Err(why) => format!("\nRDMA devices: none ({why})\n"),
        Ok(devs) => {
            let mut s = String::from("\nRDMA devices:\n");
            for d in devs {
                for p in &d.ports {
                    s.push_str(&format!(
                        "  {} port {} {} {} lid {} pci {}\n",
                        d.name,
                        p.port,
                        p.link_layer,
                        if p.active { "active" } else { "down" },
                        p.lid,
                        d.pci.as_deref().unwrap_or("-")
                    ));
                }
            }
            s
        }
    }
}
