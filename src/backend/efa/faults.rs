//! Fault injection for the endpoint: refuse a fraction of posts with `-FI_EAGAIN`, turn a
//! fraction of completions into errors. Only in builds with the `faults` feature (the engine
//! has no trace of it otherwise); off unless set (`EndpointConfig::faults`, the `FabricFaults`
//! message, or `ACTORPIPE_EFA_FAULTS` for contexts built by
//! [`ContextBuilder::from_env`](crate::ContextBuilder::from_env), in the format of
//! [`Faults::parse`]).

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// Fraction of posts (0.0 to 1.0) refused as if the provider returned `-FI_EAGAIN`. The
    /// provider is not called for them: the op goes to the backlog exactly as a real refusal.
    pub eagain: f64,
    /// Fraction of successful completions reported as `FI_EIO` errors instead.
    pub cq_error: f64,
    /// Seed of the generator (the same seed refuses the same posts).
    pub seed: u64,
}

impl Faults {
    /// No faults.
    pub const NONE: Faults = Faults {
        eagain: 0.0,
        cq_error: 0.0,
        seed: 0,
    };

    /// Parses `eagain=0.9,cq_error=0.001,seed=7` (any subset, any order).
    pub fn parse(s: &str) -> Result<Faults, String> {
        let mut f = Faults::NONE;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("fault {part:?}: expected name=value"))?;
            let bad = |e: &dyn std::fmt::Display| format!("fault {k}={v:?}: {e}");
            match k {
                "eagain" | "cq_error" => {
                    let x: f64 = v.parse().map_err(|e| bad(&e))?;
                    if !(0.0..=1.0).contains(&x) {
                        return Err(bad(&"must be between 0 and 1"));
                    }
                    if k == "eagain" {
                        f.eagain = x;
                    } else {
                        f.cq_error = x;
                    }
                }
                "seed" => f.seed = v.parse().map_err(|e| bad(&e))?,
                _ => return Err(format!("unknown fault {k:?} (eagain, cq_error, seed)")),
            }
        }
        Ok(f)
    }

    /// Whether anything is injected.
    pub fn active(&self) -> bool {
        self.eagain > 0.0 || self.cq_error > 0.0
    }
}

/// A small deterministic generator (xorshift64*), enough to pick which posts fail.
#[derive(Debug, Clone)]
pub struct Dice(u64);

impl Dice {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Dice {
        Dice(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    /// `true` with probability `p`.
    pub fn roll(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
        (x as f64) / ((1u64 << 53) as f64) < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let f = Faults::parse("eagain=0.9, seed=3").unwrap();
        assert_eq!((f.eagain, f.cq_error, f.seed), (0.9, 0.0, 3));
        assert!(f.active());
        assert!(Faults::parse("eagain=2").is_err());
        assert!(Faults::parse("nope=1").is_err());
        assert!(Faults::parse("eagain").is_err());
        assert!(!Faults::parse("").unwrap().active());
    }

    #[test]
    fn dice_hits_about_the_fraction() {
        let mut d = Dice::new(1);
        let hits = (0..100_000).filter(|_| d.roll(0.9)).count();
        assert!((88_000..92_000).contains(&hits), "{hits}");
        assert!(!(0..1000).any(|_| d.roll(0.0)));
    }
}
