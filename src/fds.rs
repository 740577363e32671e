//! This process's file descriptors against its limit (`RLIMIT_NOFILE`).
//!
//! A listener admits a new pipe only if the descriptors its connections will need fit under the
//! limit with some headroom (see `actors/listener.rs`), and the shm transport says so when it
//! cannot receive a peer's descriptors because this process is at its limit.
//! docs/operations.md tells what each kind of pipe costs and how to size the limit.

/// Descriptors in use and the soft limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Descriptors open in this process.
    pub open: usize,
    /// `RLIMIT_NOFILE`'s soft limit (the most descriptors this process may have open).
    pub limit: usize,
}

impl Usage {
    /// Descriptors that can still be opened.
    pub fn free(&self) -> usize {
        self.limit.saturating_sub(self.open)
    }
}

/// The soft `RLIMIT_NOFILE`, or `None` when unlimited or unknown.
pub fn limit() -> Option<usize> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass; RLIMIT_NOFILE is a valid resource.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0
        || r.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    usize::try_from(r.rlim_cur).ok()
}

/// Descriptors open in this process (the entries of `/proc/self/fd`, less the one reading it),
/// or `None` without `/proc`.
pub fn open() -> Option<usize> {
    let n = std::fs::read_dir("/proc/self/fd").ok()?.count();
    Some(n.saturating_sub(1))
}

/// This process's usage, when both figures are known. Costs a directory listing of
/// `/proc/self/fd` (tens of microseconds per thousand descriptors): meant for connection set-up,
/// not for a data path.
pub fn usage() -> Option<Usage> {
    let limit = limit()?;
    Some(Usage {
        open: open()?,
        limit,
    })
}

/// Whether this process cannot open `n` more descriptors (false when unknown).
pub fn exhausted(n: usize) -> bool {
    match std::fs::read_dir("/proc/self/fd") {
        // Not even one descriptor to list them with.
        Err(e) => is_exhaustion(&e),
        Ok(dir) => limit().is_some_and(|l| l.saturating_sub(dir.count().saturating_sub(1)) < n),
    }
}

/// The error for "this process is out of descriptors" while doing `what`, with the figures.
pub fn out_of_descriptors(what: &str) -> std::io::Error {
    let figures = match usage() {
        Some(u) => format!(" ({} open, RLIMIT_NOFILE {})", u.open, u.limit),
        None => String::new(),
    };
    std::io::Error::other(OutOfDescriptors(format!(
        "this process is out of file descriptors{figures}: {what}"
    )))
}

/// The inner error of [`out_of_descriptors`], to recognise it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfDescriptors(pub String);

impl std::fmt::Display for OutOfDescriptors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OutOfDescriptors {}

/// Whether `e` says this process ran out of descriptors: [`out_of_descriptors`], `EMFILE`, or
/// `ENFILE` (the whole system).
pub fn is_exhaustion(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
        || e.get_ref()
            .is_some_and(|i| i.downcast_ref::<OutOfDescriptors>().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_a_new_descriptor() {
        // Linux has /proc, and RLIMIT_NOFILE cannot be unlimited there.
        let before = usage().expect("/proc/self/fd and RLIMIT_NOFILE");
        let f = std::fs::File::open("/proc/self/status").expect("open");
        let after = usage().expect("usage");
        // Other test threads may open or close descriptors meanwhile; ours is there.
        assert!(after.open >= 1 && after.limit == before.limit);
        drop(f);
        assert!(!exhausted(1), "a test process is not at its limit");
        assert!(is_exhaustion(&std::io::Error::from_raw_os_error(
            libc::EMFILE
        )));
        assert!(is_exhaustion(&out_of_descriptors("testing")));
        assert!(!is_exhaustion(&std::io::Error::from_raw_os_error(
            libc::EBADF
        )));
    }
}
