//! [`ContextBuilder::from_env`]: the one place the library reads `ACTORPIPE_*` variables.

use super::ContextBuilder;
use crate::error::Error;

/// A variable's value as [`ContextBuilder::from_env`] sees it: `None` when unset or empty
/// (blanks only), else the value without surrounding blanks.
type Lookup<'a> = &'a dyn Fn(&str) -> Result<Option<String>, Error>;

/// The process environment, through [`Lookup`]'s rules.
fn process_env(name: &str) -> Result<Option<String>, Error> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_string())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(Error::invalid(format!("{name}={v:?}: not valid UTF-8")))
        }
    }
}

/// `name=value` does not parse: `expected` says what would.
fn malformed(name: &str, value: &str, expected: &str) -> Error {
    Error::invalid(format!("{name}={value:?}: expected {expected}"))
}

/// `value` as a switch (`1`, `true`, `yes`, `on`; `0`, `false`, `no`, `off`; any case).
fn switch(name: &str, value: &str) -> Result<bool, Error> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(malformed(
            name,
            value,
            "1, true, yes or on; or 0, false, no or off",
        )),
    }
}

/// `value` as a whole number.
fn number<T: std::str::FromStr>(name: &str, value: &str, what: &str) -> Result<T, Error> {
    value.parse().map_err(|_| malformed(name, value, what))
}

/// A variable set in a build without the feature that would use it: ignored, with a warning.
#[allow(dead_code)] // every feature on: nothing is left out
fn ignored(name: &str, feature: &str) {
    tracing::warn!("{name} ignored: this build has no `{feature}` feature");
}

impl ContextBuilder {
    /// Every variable [`from_env`](Self::from_env) reads (docs/operations.md, "Environment
    /// variables", says what each sets).
    pub const ENV_VARIABLES: &'static [&'static str] = &[
        "ACTORPIPE_METRICS_ADDR",
        "ACTORPIPE_LOOPS_ON_RUNTIME",
        "ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER",
        "ACTORPIPE_COPY_THREADS",
        "ACTORPIPE_CUDA_WATCH_SPIN_US",
        "ACTORPIPE_EFA_PROVIDER",
        "ACTORPIPE_EFA_DOMAINS",
        "ACTORPIPE_EFA_BOOTSTRAP",
        "ACTORPIPE_EFA_SPIN",
        "ACTORPIPE_EFA_FAULTS",
    ];

    /// A builder with the defaults ([`Context::builder`](super::Context::builder)) and the
    /// settings the `ACTORPIPE_*` environment variables give, each applied as the builder
    /// method it stands for (the table in docs/operations.md, "Environment variables"); what
    /// is called on the builder afterwards overrides them. The library reads the environment
    /// nowhere else: a builder made otherwise ignores these variables. The `actorpipe` command
    /// builds its contexts with this.
    ///
    /// A variable that is unset or empty sets nothing. A malformed value is an error
    /// ([`Error::InvalidArgument`], naming the variable and its value), and nothing is set. A
    /// variable of a feature this build lacks (`ACTORPIPE_EFA_*` without `efa`,
    /// `ACTORPIPE_EFA_FAULTS` without `faults`, `ACTORPIPE_CUDA_WATCH_SPIN_US` without `cuda`)
    /// is ignored, with a warning in the log.
    ///
    /// `ACTORPIPE_COPY_THREADS` and `ACTORPIPE_CUDA_WATCH_SPIN_US` are process-wide: building
    /// the context applies them ([`crate::copy::set_threads`], `crate::cuda::set_watch_spin`);
    /// a copy-thread count that comes after the process's first large copy is logged as not
    /// applied.
    pub fn from_env() -> Result<ContextBuilder, Error> {
        ContextBuilder::default().with_env(&process_env)
    }

    /// `self` with the settings the variables `get` finds.
    fn with_env(mut self, get: Lookup<'_>) -> Result<ContextBuilder, Error> {
        if let Some(v) = get("ACTORPIPE_METRICS_ADDR")? {
            let addr = crate::metrics::parse_addr(&v).map_err(|_| {
                malformed(
                    "ACTORPIPE_METRICS_ADDR",
                    &v,
                    "host:port or a port (bound on 127.0.0.1)",
                )
            })?;
            self = self.metrics(addr);
        }
        if let Some(v) = get("ACTORPIPE_LOOPS_ON_RUNTIME")? {
            self = self.loops_on_runtime(switch("ACTORPIPE_LOOPS_ON_RUNTIME", &v)?);
        }
        if let Some(v) = get("ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER")? {
            self =
                self.read_loop_follows_handler(switch("ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER", &v)?);
        }
        if let Some(v) = get("ACTORPIPE_COPY_THREADS")? {
            let n: usize = number(
                "ACTORPIPE_COPY_THREADS",
                &v,
                "a number of threads (1: no copy threads)",
            )?;
            self.copy_threads = Some(n);
        }
        if let Some(v) = get("ACTORPIPE_CUDA_WATCH_SPIN_US")? {
            let us: u64 = number(
                "ACTORPIPE_CUDA_WATCH_SPIN_US",
                &v,
                "a number of microseconds",
            )?;
            #[cfg(feature = "cuda")]
            {
                self.cuda_watch_spin = Some(std::time::Duration::from_micros(us));
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = us;
                ignored("ACTORPIPE_CUDA_WATCH_SPIN_US", "cuda");
            }
        }
        self.efa_env(get)
    }

    /// The `ACTORPIPE_EFA_*` part of [`with_env`](Self::with_env).
    #[cfg(feature = "efa")]
    fn efa_env(mut self, get: Lookup<'_>) -> Result<ContextBuilder, Error> {
        use crate::actors::hardware::efa::channel::Domains;
        if let Some(v) = get("ACTORPIPE_EFA_PROVIDER")? {
            self.efa.provider = Some(v);
        }
        if let Some(v) = get("ACTORPIPE_EFA_DOMAINS")? {
            self.efa.domains = Some(if v == "all" {
                Domains::All
            } else {
                Domains::Named(
                    v.split(',')
                        .map(str::trim)
                        .filter(|d| !d.is_empty())
                        .map(String::from)
                        .collect(),
                )
            });
        }
        if let Some(v) = get("ACTORPIPE_EFA_BOOTSTRAP")? {
            let ip = v
                .parse()
                .map_err(|_| malformed("ACTORPIPE_EFA_BOOTSTRAP", &v, "an IP address"))?;
            self = self.efa_bootstrap_host(ip);
        }
        let mut config = self.efa.config.unwrap_or_default();
        let mut changed = false;
        if let Some(v) = get("ACTORPIPE_EFA_SPIN")? {
            let us: u64 = number(
                "ACTORPIPE_EFA_SPIN",
                &v,
                "a number of microseconds (0: no spin)",
            )?;
            config.busy_poll = std::time::Duration::from_micros(us);
            changed = true;
        }
        if let Some(v) = get("ACTORPIPE_EFA_FAULTS")? {
            #[cfg(feature = "faults")]
            {
                config.faults = crate::backend::efa::faults::Faults::parse(&v)
                    .map_err(|e| Error::invalid(format!("ACTORPIPE_EFA_FAULTS={v:?}: {e}")))?;
                changed = true;
            }
            #[cfg(not(feature = "faults"))]
            {
                let _ = v;
                ignored("ACTORPIPE_EFA_FAULTS", "faults");
            }
        }
        if changed {
            self = self.efa_config(config);
        }
        Ok(self)
    }

    /// Without the `efa` feature its variables are ignored, with a warning.
    #[cfg(not(feature = "efa"))]
    fn efa_env(self, get: Lookup<'_>) -> Result<ContextBuilder, Error> {
        for name in Self::ENV_VARIABLES
            .iter()
            .filter(|n| n.starts_with("ACTORPIPE_EFA_"))
        {
            if get(name)?.is_some() {
                ignored(name, "efa");
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`ContextBuilder::with_env`] over these variables only.
    fn with(vars: &[(&str, &str)]) -> Result<ContextBuilder, Error> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let get = move |name: &str| -> Result<Option<String>, Error> {
            Ok(vars
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.trim().to_string())
                .filter(|v| !v.is_empty()))
        };
        ContextBuilder::default().with_env(&get)
    }

    fn summary(b: &ContextBuilder) -> String {
        format!("{b:?}")
    }

    /// Each variable does what the builder method it stands for does.
    #[test]
    fn each_variable_is_its_builder_method() {
        let cases: Vec<(&str, &str, ContextBuilder)> = vec![
            (
                "ACTORPIPE_METRICS_ADDR",
                "9100",
                ContextBuilder::default().metrics("127.0.0.1:9100".parse().unwrap()),
            ),
            (
                "ACTORPIPE_METRICS_ADDR",
                "0.0.0.0:9200",
                ContextBuilder::default().metrics("0.0.0.0:9200".parse().unwrap()),
            ),
            (
                "ACTORPIPE_LOOPS_ON_RUNTIME",
                "yes",
                ContextBuilder::default().loops_on_runtime(true),
            ),
            (
                "ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER",
                "0",
                ContextBuilder::default().read_loop_follows_handler(false),
            ),
            (
                "ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER",
                " ",
                ContextBuilder::default(),
            ),
        ];
        for (name, value, want) in cases {
            let got = with(&[(name, value)]).unwrap();
            assert_eq!(summary(&got), summary(&want), "{name}={value:?}");
        }
        let b = with(&[("ACTORPIPE_COPY_THREADS", "3")]).unwrap();
        assert_eq!(b.copy_threads, Some(3));
        let b = with(&[("ACTORPIPE_CUDA_WATCH_SPIN_US", "7")]).unwrap();
        #[cfg(feature = "cuda")]
        assert_eq!(b.cuda_watch_spin, Some(std::time::Duration::from_micros(7)));
        #[cfg(not(feature = "cuda"))]
        let _ = b;
    }

    #[cfg(feature = "efa")]
    #[test]
    fn the_efa_variables_are_its_builder_methods() {
        use crate::actors::hardware::efa::EndpointConfig;
        let got = with(&[
            ("ACTORPIPE_EFA_PROVIDER", "tcp;ofi_rxm"),
            ("ACTORPIPE_EFA_DOMAINS", "lo, eth0"),
            ("ACTORPIPE_EFA_BOOTSTRAP", "127.0.0.1"),
            ("ACTORPIPE_EFA_SPIN", "50"),
        ])
        .unwrap();
        let want = ContextBuilder::default()
            .efa_domains("tcp;ofi_rxm", &["lo", "eth0"])
            .efa_bootstrap_host("127.0.0.1".parse().unwrap())
            .efa_config(EndpointConfig {
                busy_poll: std::time::Duration::from_micros(50),
                ..EndpointConfig::default()
            });
        assert_eq!(summary(&got), summary(&want));
        let got = with(&[("ACTORPIPE_EFA_DOMAINS", "all")]).unwrap();
        assert_eq!(
            got.efa.domains,
            Some(crate::actors::hardware::efa::channel::Domains::All)
        );
        // A setting made in code afterwards wins over the environment's.
        let got = with(&[("ACTORPIPE_EFA_SPIN", "50")])
            .unwrap()
            .efa_config(EndpointConfig::default());
        assert_eq!(
            summary(&got),
            summary(&ContextBuilder::default().efa_config(EndpointConfig::default()))
        );
    }

    #[cfg(feature = "faults")]
    #[test]
    fn efa_faults_and_spin_make_one_endpoint_config() {
        let b = with(&[
            ("ACTORPIPE_EFA_FAULTS", "eagain=0.5,seed=3"),
            ("ACTORPIPE_EFA_SPIN", "20"),
        ])
        .unwrap();
        let c = b.efa.config.expect("an endpoint config");
        assert_eq!((c.faults.eagain, c.faults.seed), (0.5, 3));
        assert_eq!(c.busy_poll, std::time::Duration::from_micros(20));
    }

    /// A malformed value is an error that names the variable and the value.
    #[test]
    fn malformed_values_are_errors() {
        let mut bad = vec![
            ("ACTORPIPE_METRICS_ADDR", "localhost"),
            ("ACTORPIPE_LOOPS_ON_RUNTIME", "maybe"),
            ("ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER", "2"),
            ("ACTORPIPE_COPY_THREADS", "-1"),
            ("ACTORPIPE_CUDA_WATCH_SPIN_US", "20us"),
        ];
        if cfg!(feature = "efa") {
            bad.extend([
                ("ACTORPIPE_EFA_BOOTSTRAP", "eth0"),
                ("ACTORPIPE_EFA_SPIN", "fast"),
            ]);
        }
        if cfg!(feature = "faults") {
            bad.push(("ACTORPIPE_EFA_FAULTS", "eagain=2"));
        }
        for (name, value) in bad {
            let e = with(&[(name, value)]).expect_err(name);
            assert_eq!(e.kind(), crate::ErrorClass::InvalidArgument, "{e}");
            let text = e.to_string();
            assert!(text.contains(name) && text.contains(value), "{text}");
        }
    }

    /// No variable set: the defaults.
    #[test]
    fn nothing_set_is_the_defaults() {
        assert_eq!(
            summary(&with(&[]).unwrap()),
            summary(&ContextBuilder::default())
        );
    }

    /// docs/operations.md's table lists every variable `from_env` reads.
    #[test]
    fn the_operations_table_lists_every_variable() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md");
        let Ok(doc) = std::fs::read_to_string(path) else {
            return; // a packaged crate has no docs/
        };
        for name in ContextBuilder::ENV_VARIABLES {
            assert!(
                doc.contains(&format!("| `{name}` |")),
                "docs/operations.md has no row for {name}"
            );
        }
    }
}
