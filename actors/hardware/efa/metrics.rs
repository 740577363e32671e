//! An endpoint's metric handles, resolved once when it opens (as a pipe's are, see
//! [`crate::metrics::PipeMetrics`]), so that publishing its counters after a progress pass costs
//! atomic adds: no key built, no label string cloned, nothing allocated.

use metrics::{counter, gauge, Counter, Gauge};

use crate::backend::efa::engine::Stats;

/// The handles, and the counters as last published.
pub(super) struct EndpointMetrics {
    posts: Counter,
    eagain: Counter,
    injects: Counter,
    completions: Counter,
    errors: Counter,
    backlog: Gauge,
    bytes: Counter,
    published: Stats,
}

impl EndpointMetrics {
    /// Handles labelled with the endpoint's provider (and domain, for bytes).
    pub(super) fn open(provider: &str, domain: &str) -> EndpointMetrics {
        let labels = [("provider", provider.to_string())];
        let per_domain = [
            ("provider", provider.to_string()),
            ("domain", domain.to_string()),
        ];
        let backlog = gauge!(crate::metrics::EFA_BACKLOG, &labels);
        backlog.set(0.0);
        EndpointMetrics {
            posts: counter!(crate::metrics::EFA_POSTS, &labels),
            eagain: counter!(crate::metrics::EFA_EAGAIN, &labels),
            injects: counter!(crate::metrics::EFA_INJECTS, &labels),
            completions: counter!(crate::metrics::EFA_COMPLETIONS, &labels),
            errors: counter!(crate::metrics::EFA_ERRORS, &labels),
            backlog,
            bytes: counter!(crate::metrics::EFA_BYTES, &per_domain),
            published: Stats::default(),
        }
    }

    /// Publishes the increments since the last call.
    pub(super) fn publish(&mut self, s: Stats) {
        let p = &self.published;
        if s == *p {
            return;
        }
        // Only the counters that moved: each handle is a call through a pointer and an atomic
        // add, and a pass moves two or three of the six.
        for (c, now, then) in [
            (&self.posts, s.posted, p.posted),
            (&self.eagain, s.eagain, p.eagain),
            (&self.injects, s.injected, p.injected),
            (&self.completions, s.completions, p.completions),
            (&self.errors, s.errors, p.errors),
            (&self.bytes, s.bytes, p.bytes),
        ] {
            if now != then {
                c.increment(now - then);
            }
        }
        if s.backlog != p.backlog {
            self.backlog.set(s.backlog as f64);
        }
        self.published = s;
    }
}
