//! The builder's settings combine the same whatever the order of the calls.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::ContextBuilder;
use crate::backend::mpt::Mpt;
use crate::backend::shm::Shm;
use crate::backend::tcp::{Keepalive, Tcp};
use crate::wire::Limits;

/// A builder call with a representative argument, by name.
type Setter = (&'static str, fn(ContextBuilder) -> ContextBuilder);

/// Every setter of the builder, some twice with arguments that meet another's (a transport or
/// channel of the builder's own, the same name removed or re-prioritised).
fn setters() -> Vec<Setter> {
    #[allow(unused_mut)] // more with feature `efa`
    let mut v: Vec<Setter> = vec![
        ("limits", |b| {
            b.limits(Limits {
                max_tensors: 7,
                ..Limits::default()
            })
        }),
        ("chunk_size", |b| b.chunk_size(1 << 20)),
        ("connect_timeout", |b| {
            b.connect_timeout(Duration::from_secs(3))
        }),
        ("handshake_timeout", |b| {
            b.handshake_timeout(Duration::from_secs(4))
        }),
        ("max_pending_pipes", |b| b.max_pending_pipes(7)),
        ("cma_threads", |b| b.cma_threads(9)),
        ("loops_on_runtime", |b| b.loops_on_runtime(true)),
        ("read_loop_follows_handler", |b| {
            b.read_loop_follows_handler(false)
        }),
        ("io_threads", |b| b.io_threads(17)),
        ("io_threads_for_machine", |b| b.io_threads_for_machine()),
        ("cma_inline_max", |b| b.cma_inline_max(1234)),
        ("secret", |b| b.secret("s")),
        ("keepalive", |b| {
            b.keepalive(Duration::from_secs(1), Duration::from_secs(6))
        }),
        ("no_keepalive", |b| b.no_keepalive()),
        ("tcp_keepalive", |b| {
            b.tcp_keepalive(Keepalive {
                interval: Duration::from_secs(3),
                timeout: Duration::from_secs(9),
                unacked_timeout: Some(Duration::from_secs(20)),
            })
        }),
        ("lanes", |b| b.lanes(4)),
        ("lane_addresses", |b| {
            b.lane_addresses(["127.0.0.1", "::1"].map(|a| a.parse::<IpAddr>().unwrap()))
        }),
        ("mpt_inline_max", |b| b.mpt_inline_max(999)),
        ("transport(tcp)", |b| {
            b.transport(Arc::new(Tcp::with_keepalive(None)))
        }),
        ("transport(shm)", |b| {
            b.transport(Arc::new(Shm::new().with_capacity(1 << 20)))
        }),
        ("channel(mpt)", |b| {
            b.channel(Arc::new(Mpt {
                lanes: 3,
                sources: Vec::new(),
                inline_max: 5,
            }))
        }),
        ("without(xth)", |b| b.without("xth")),
        ("without(shm)", |b| b.without("shm")),
        ("without(mpt)", |b| b.without("mpt")),
        ("only_transports", |b| b.only_transports(&["tcp"])),
        ("only_channels(basic, mpt, cma)", |b| {
            b.only_channels(&["basic", "mpt", "cma"])
        }),
        ("only_channels(basic, mpt, xth)", |b| {
            b.only_channels(&["basic", "mpt", "xth"])
        }),
        ("priority(mpt)", |b| b.priority("mpt", 99)),
        ("priority(shm)", |b| b.priority("shm", 1)),
        ("priority(tcp)", |b| b.priority("tcp", 5)),
        ("metrics", |b| b.metrics("127.0.0.1:0".parse().unwrap())),
    ];
    #[cfg(feature = "efa")]
    v.extend(efa_setters());
    v
}

#[cfg(feature = "efa")]
fn efa_setters() -> Vec<Setter> {
    use crate::actors::hardware::efa::{transport::Efa, EndpointConfig};
    vec![
        ("efa", |b| b.efa("tcp;ofi_rxm")),
        ("efa_domains", |b| b.efa_domains("tcp;ofi_rxm", &["lo"])),
        ("efa_config", |b| {
            b.efa_config(EndpointConfig {
                busy_poll: Duration::from_micros(50),
                ..EndpointConfig::default()
            })
        }),
        ("efa_bootstrap_host", |b| {
            b.efa_bootstrap_host("127.0.0.1".parse().unwrap())
        }),
        ("transport(efa)", |b| b.transport(Arc::new(Efa::new("shm")))),
        ("channel(efa)", |b| {
            b.channel(Arc::new(
                crate::actors::hardware::efa::channel::Efa::new("shm").inline_max(0),
            ))
        }),
        ("priority(efa)", |b| b.priority("efa", 77)),
        ("without(efa)", |b| b.without("efa")),
    ]
}

/// Pairs of calls that set one setting, where the last call wins by design.
const ONE_SETTING: [(&str, &str); 2] = [
    ("keepalive", "no_keepalive"),
    ("io_threads", "io_threads_for_machine"),
];

/// The configuration `b` resolves to, transports and channels with their priorities and
/// settings.
fn resolved(b: &ContextBuilder) -> String {
    format!("{:#?}", b.resolve())
}

/// Each setter shows in the resolved configuration (so that the test below compares something).
#[test]
fn every_setter_changes_the_configuration() {
    let default = resolved(&ContextBuilder::default());
    for (name, set) in setters() {
        if name == "io_threads_for_machine" {
            continue; // the default
        }
        assert_ne!(
            resolved(&set(ContextBuilder::default())),
            default,
            "{name} changed nothing"
        );
    }
}

/// Every pair of setters, in both orders, resolves to the same configuration.
#[test]
fn the_order_of_two_calls_does_not_matter() {
    let all = setters();
    let mut differ = Vec::new();
    for (i, (a, set_a)) in all.iter().enumerate() {
        for (b, set_b) in &all[i + 1..] {
            if ONE_SETTING.contains(&(a, b)) || ONE_SETTING.contains(&(b, a)) {
                continue;
            }
            let ab = resolved(&set_b(set_a(ContextBuilder::default())));
            let ba = resolved(&set_a(set_b(ContextBuilder::default())));
            if ab != ba {
                differ.push(format!("{a} then {b}, and {b} then {a}"));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "{} pairs resolve differently in the two orders:\n{}",
        differ.len(),
        differ.join("\n")
    );
}

/// The resolved `mpt` channel of `b`.
fn mpt(b: &ContextBuilder) -> (Mpt, i32) {
    let config = b.resolve();
    let (c, p) = config
        .channels
        .iter()
        .find(|(c, _)| c.name() == "mpt")
        .expect("an mpt channel");
    let m = c
        .as_any()
        .and_then(|a| a.downcast_ref::<Mpt>())
        .expect("Mpt");
    (m.clone(), *p)
}

/// An `Mpt` of yours is the base `lanes`, `lane_addresses` and `mpt_inline_max` change, and
/// `priority` survives it, whichever comes first.
#[test]
fn an_mpt_of_yours_is_the_base_of_the_mpt_settings() {
    let mine = || {
        Arc::new(Mpt {
            lanes: 7,
            sources: Vec::new(),
            inline_max: 5,
        })
    };
    for b in [
        ContextBuilder::default()
            .channel(mine())
            .lanes(3)
            .priority("mpt", 99),
        ContextBuilder::default()
            .priority("mpt", 99)
            .lanes(3)
            .channel(mine()),
    ] {
        let (m, p) = mpt(&b);
        assert_eq!((m.lanes, m.inline_max, p), (3, 5, 99), "{b:?}");
    }
}

/// `keepalive` reaches a `Tcp` of yours, and `tcp_keepalive` wins over it for the kernel's side.
#[test]
fn keepalive_reaches_a_tcp_of_yours() {
    let tcp = |b: &ContextBuilder| {
        let config = b.resolve();
        let (t, _) = config
            .transports
            .iter()
            .find(|(t, _)| t.name() == "tcp")
            .expect("tcp");
        *t.as_any()
            .and_then(|a| a.downcast_ref::<Tcp>())
            .expect("Tcp")
    };
    let (i, t) = (Duration::from_secs(1), Duration::from_secs(6));
    let b = ContextBuilder::default()
        .keepalive(i, t)
        .transport(Arc::new(Tcp::with_keepalive(None)));
    assert_eq!(
        tcp(&b).keepalive.map(|k| (k.interval, k.timeout)),
        Some((i, t))
    );
    let k = Keepalive {
        unacked_timeout: Some(Duration::from_secs(20)),
        ..Keepalive::default()
    };
    let b = ContextBuilder::default().tcp_keepalive(k).no_keepalive();
    assert_eq!(tcp(&b).keepalive, Some(k));
    assert!(b.resolve().heartbeat.is_none());
    // Without any of the three, a Tcp of yours is used as it is.
    let b = ContextBuilder::default().transport(Arc::new(Tcp::with_keepalive(None)));
    assert_eq!(tcp(&b).keepalive, None);
}

/// What `without` and `only_*` remove is gone, whenever it was added.
#[test]
fn removals_win_over_additions() {
    for b in [
        ContextBuilder::default()
            .without("shm")
            .transport(Arc::new(Shm::new())),
        ContextBuilder::default()
            .transport(Arc::new(Shm::new()))
            .without("shm"),
    ] {
        let config = b.resolve();
        assert!(config.transports.iter().all(|(t, _)| t.name() != "shm"));
    }
    let b = ContextBuilder::default()
        .only_channels(&["basic", "mpt"])
        .only_channels(&["mpt", "xth"]);
    let names: Vec<&str> = b.resolve().channels.iter().map(|(c, _)| c.name()).collect();
    assert_eq!(names, ["mpt"]);
}
