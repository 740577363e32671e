//! An endpoint's metric handles, resolved once when it opens (as a pipe's are, see
//! [`crate::metrics::PipeMetrics`]), so that publishing its counters after a progress pass costs
//! atomic adds: no key built, no label string cloned, nothing allocated.
//!
//! The counters are per provider (and domain, for bytes): every endpoint adds its increments to
//! them. The backlog gauge is per endpoint: labelled with the provider, the domain and the
//! `efa` transport instance the endpoint serves (`endpoint`; one endpoint per instance and
//! domain on a thread, and every context builds its own instance). Each endpoint moves it by
//! the change of its own backlog, so endpoints that share labels (one transport instance used
//! on two threads) add up instead of overwriting each other, and a closing endpoint takes its
//! share back out ([`EndpointMetrics::close`]).

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
    /// Closed: the backlog gauge holds no share of this endpoint's any more.
    closed: bool,
}

impl EndpointMetrics {
    /// Handles labelled with the endpoint's provider (and domain, for bytes; and the transport
    /// instance `instance` too, for the backlog).
    pub(super) fn open(provider: &str, domain: &str, instance: u64) -> EndpointMetrics {
        let labels = [("provider", provider.to_string())];
        let per_domain = [
            ("provider", provider.to_string()),
            ("domain", domain.to_string()),
        ];
        let per_endpoint = [
            ("provider", provider.to_string()),
            ("domain", domain.to_string()),
            ("endpoint", instance.to_string()),
        ];
        let backlog = gauge!(crate::metrics::EFA_BACKLOG, &per_endpoint);
        // Shows the series (at 0 while nothing is backlogged) from the endpoint's opening.
        backlog.increment(0.0);
        EndpointMetrics {
            posts: counter!(crate::metrics::EFA_POSTS, &labels),
            eagain: counter!(crate::metrics::EFA_EAGAIN, &labels),
            injects: counter!(crate::metrics::EFA_INJECTS, &labels),
            completions: counter!(crate::metrics::EFA_COMPLETIONS, &labels),
            errors: counter!(crate::metrics::EFA_ERRORS, &labels),
            backlog,
            bytes: counter!(crate::metrics::EFA_BYTES, &per_domain),
            published: Stats::default(),
            closed: false,
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
        if s.backlog != p.backlog && !self.closed {
            self.backlog.increment(s.backlog as f64 - p.backlog as f64);
        }
        self.published = s;
    }

    /// The endpoint closes: its share of the backlog gauge goes (what it still held is never
    /// retried).
    pub(super) fn close(&mut self) {
        if !std::mem::replace(&mut self.closed, true) {
            self.backlog.decrement(self.published.backlog as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backlog gauge's value for `endpoint` in a rendered scrape.
    fn backlog(text: &str, endpoint: &str) -> Option<f64> {
        let label = format!("endpoint=\"{endpoint}\"");
        text.lines()
            .filter(|l| l.starts_with(crate::metrics::EFA_BACKLOG) && l.contains(&label))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[test]
    fn the_backlog_gauge_is_per_endpoint_and_leaves_with_it() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let (mut a, mut b, mut c) = metrics::with_local_recorder(&recorder, || {
            (
                EndpointMetrics::open("shm", "d", 1),
                EndpointMetrics::open("shm", "d", 2),
                // The same labels as `b`: one transport instance used on two threads.
                EndpointMetrics::open("shm", "d", 2),
            )
        });
        let at = |backlog| Stats {
            backlog,
            ..Stats::default()
        };
        let both = || {
            let text = handle.render();
            (backlog(&text, "1"), backlog(&text, "2"))
        };
        // Each endpoint's series shows from its opening.
        assert_eq!(both(), (Some(0.0), Some(0.0)));
        a.publish(at(3));
        b.publish(at(7));
        // Two endpoints do not overwrite each other.
        assert_eq!(both(), (Some(3.0), Some(7.0)));
        // Endpoints with the same labels add up.
        c.publish(at(4));
        assert_eq!(both(), (Some(3.0), Some(11.0)));
        b.publish(at(2));
        assert_eq!(both(), (Some(3.0), Some(6.0)));
        // A closing endpoint takes its share out, and publishes none after.
        b.close();
        assert_eq!(both(), (Some(3.0), Some(4.0)));
        b.publish(at(9));
        b.close();
        assert_eq!(both(), (Some(3.0), Some(4.0)));
        c.close();
        a.publish(at(0));
        assert_eq!(both(), (Some(0.0), Some(0.0)));
    }
}
