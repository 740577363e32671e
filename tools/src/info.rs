//! `actorpipe info`: every backend this build knows, whether it can run on this host and why
//! not, and the domain descriptor it advertises (two peers use a backend only if both offer it
//! with equal descriptors).

use actorpipe::internal::backend::{report, BackendReport};

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
            "{:<10} {:<10} {:>8}  {:<10} {:<12} domain\n",
            "kind", "name", "priority", "available", "devices"
        ));
        for b in &r {
            out.push_str(&line(b));
            out.push('\n');
            if let Some(why) = &b.reason {
                out.push_str(&format!("{:>19}why not: {why}\n", ""));
            }
        }
        out.push_str(&gpus());
        out.push_str(&rdma_devices());
        out.push_str(&gdr());
    }
    if !json {
        out.push_str(&fabric());
    }
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
}

/// The libfabric section: version, providers and domains, and whether `efa` can run.
#[cfg(feature = "efa")]
fn fabric() -> String {
    let r = actorpipe::internal::backend::efa::report();
    let mut out = format!(
        "\nlibfabric {} (built against {})\n",
        r.version, r.built_against
    );
    for d in &r.domains {
        out.push_str(&format!(
            "  provider {:<12} fabric {:<16} domain {:<10} max message {}{}\n",
            d.provider,
            d.fabric,
            d.domain,
            d.max_msg_size,
            if d.mr_local {
                ", registers local memory"
            } else {
                ""
            }
        ));
    }
    let mut providers: Vec<&str> = r.domains.iter().map(|d| d.provider.as_str()).collect();
    providers.sort_unstable();
    providers.dedup();
    for p in providers
        .into_iter()
        .filter(|p| actorpipe::internal::backend::efa::passthru(p))
    {
        out.push_str(&format!(
            "  {p}: rxm's passthru on ({}): the tcp provider's own RDM endpoint; peers \
             must have it on too (named {})\n",
            actorpipe::internal::backend::efa::PASSTHRU,
            actorpipe::internal::backend::efa::wire_name(p)
        ));
    }
    match &r.efa {
        Ok(()) => out.push_str("efa: usable\n"),
        Err(why) => out.push_str(&format!("efa: not usable: {why}\n")),
    }
    out
}

#[cfg(not(feature = "efa"))]
fn fabric() -> String {
    "\nlibfabric: not in this build (cargo feature `efa` is off)\n".into()
}

fn line(b: &BackendReport) -> String {
    let domain = if b.domain.is_empty() {
        "(any peer)"
    } else {
        &b.domain
    };
    format!(
        "{:<10} {:<10} {:>8}  {:<10} {:<12} {}",
        b.kind,
        b.name,
        b.priority,
        if b.available { "yes" } else { "no" },
        b.devices.as_deref().unwrap_or("-"),
        domain
    )
}

/// The GPU section of the table: each CUDA device, or why there is none.
fn gpus() -> String {
    #[cfg(feature = "cuda")]
    {
        match actorpipe::cuda::devices() {
            Ok(list) => {
                let mut s = String::from(
                    "\ngpu      name                             memory  pci bus id    numa\n",
                );
                for d in list {
                    s.push_str(&format!(
                        "cuda:{:<3} {:<32} {:>6} GiB  {:<13} {}\n",
                        d.ordinal,
                        d.name,
                        d.memory >> 30,
                        d.pci_bus_id,
                        d.numa_node.map_or("-".to_string(), |n| n.to_string())
                    ));
                }
                s
            }
            Err(why) => format!("\ngpu: none usable: {why}\n"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        "\ngpu: this build has no CUDA support (build with --features cuda)\n".to_string()
    }
}

/// The `cuda_gdr` section: whether it can run on this host's HCAs or why not, what each GPU
/// offers the HCA, and each GPU's NICs by PCIe distance.
fn gdr() -> String {
    #[cfg(all(feature = "cuda", feature = "ibv"))]
    {
        format!(
            "\n{}",
            actorpipe::internal::backend::cuda_gdr::status::GdrStatus::here().report()
        )
    }
    #[cfg(not(all(feature = "cuda", feature = "ibv")))]
    {
        "\ncuda_gdr: not in this build (build with --features cuda,ibv)\n".to_string()
    }
}

/// The RDMA devices found (real HCAs; the simulated device is never listed), or why none.
fn rdma_devices() -> String {
    match actorpipe::internal::backend::rdma_devices() {
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
