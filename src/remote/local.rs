//! The in-process path: the region lives in this process (a pipe between two contexts of it),
//! so a remote read or write is a copy between the region's memory and the caller's buffer,
//! made by the caller's thread (large batches shared among the process's copy threads,
//! `crate::copy`), holding the region's entry shared for the copy's length, so that
//! deregistration waits for it and no copy starts after.

use super::{check_spans, lookup, Entry, Notification, RegionDescriptor, Span};
use crate::copy::{copy_spans, Span as CopySpan, MAX_SPANS, NT_MIN, SHARED_MIN};
use crate::error::Error;

/// Which way a copy goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Region to the local buffer.
    Out,
    /// Local buffer to the region.
    In,
}

/// Reads `spans` of the region `d` names into `dst`; notifies its owner with `notify` after.
/// Returns the bytes copied.
pub(crate) fn read(
    d: &RegionDescriptor,
    spans: &[Span],
    dst: &mut [u8],
    notify: Option<Vec<u8>>,
) -> Result<u64, Error> {
    operate(d, spans, (dst.as_mut_ptr(), dst.len()), Way::Out, notify)
}

/// Writes `src`'s `spans` into the region `d` names; notifies its owner with `notify` once
/// the bytes are in place. Returns the bytes copied.
pub(crate) fn write(
    d: &RegionDescriptor,
    spans: &[Span],
    src: &[u8],
    notify: Option<Vec<u8>>,
) -> Result<u64, Error> {
    operate(
        d,
        spans,
        (src.as_ptr() as *mut u8, src.len()),
        Way::In,
        notify,
    )
}

/// A peer's copy `way` between the region `d` names and `local`, then its notification.
fn operate(
    d: &RegionDescriptor,
    spans: &[Span],
    (local, len): (*mut u8, usize),
    way: Way,
    notify: Option<Vec<u8>>,
) -> Result<u64, Error> {
    let e = lookup(d)?;
    let n = copy(&e, spans, local, len, way)?;
    if let Some(data) = notify {
        e.owner.notify(Notification {
            region: d.id,
            write: way == Way::In,
            data,
        });
    }
    Ok(n)
}

/// The owner's own read of its region.
pub(crate) fn copy_out(e: &Entry, spans: &[Span], dst: &mut [u8]) -> Result<(), Error> {
    copy(e, spans, dst.as_mut_ptr(), dst.len(), Way::Out).map(|_| ())
}

/// The owner's own write into its region.
pub(crate) fn copy_in(e: &Entry, spans: &[Span], src: &[u8]) -> Result<(), Error> {
    copy(e, spans, src.as_ptr() as *mut u8, src.len(), Way::In).map(|_| ())
}

/// Copies `spans` between the region and the `len` bytes at `local` (read from for
/// [`Way::In`], written to for [`Way::Out`]).
fn copy(e: &Entry, spans: &[Span], local: *mut u8, len: usize, way: Way) -> Result<u64, Error> {
    let total = validate(e, spans, len as u64, way == Way::In)?;
    let memory = e.memory.read().unwrap_or_else(|p| p.into_inner());
    let Some(store) = memory.as_ref() else {
        return Err(Error::invalid(
            "the region was deregistered while the operation started",
        ));
    };
    let pieces = spans.iter().filter(|s| s.len > 0).map(|s| {
        // SAFETY: `check_spans` put each span inside both buffers, so both `add`s stay in them.
        let (r, l) = unsafe {
            (
                store.base.add(s.remote as usize),
                local.add(s.local as usize),
            )
        };
        let (src, dst) = match way {
            Way::Out => (r as *const u8, l),
            Way::In => (l as *const u8, r),
        };
        CopySpan {
            src,
            dst,
            len: s.len as usize,
        }
    });
    if (total as usize) < SHARED_MIN {
        for p in pieces {
            // SAFETY: each span lies inside the region's memory, held by the shared lock for
            // the copy, and inside the caller's buffer, borrowed for the call; the
            // destinations do not overlap each other (checked above), and a region's memory
            // is never the caller's own buffer (the caller owns its buffer, the table the
            // region's).
            unsafe { std::ptr::copy_nonoverlapping(p.src, p.dst, p.len) };
        }
    } else {
        let nt = total as usize >= NT_MIN;
        let mut batch = Vec::with_capacity(MAX_SPANS.min(spans.len()));
        for p in pieces {
            batch.push(p);
            if batch.len() == MAX_SPANS {
                // SAFETY: as for the small copies above.
                unsafe { copy_spans(&batch, nt) };
                batch.clear();
            }
        }
        if !batch.is_empty() {
            // SAFETY: as for the small copies above.
            unsafe { copy_spans(&batch, nt) };
        }
    }
    drop(memory);
    Ok(total)
}

/// Checks a batch against region `e` and a local buffer of `local` bytes (a write needs a
/// writable region; no two spans may write the same bytes: they would race each other across
/// copy threads). Returns the batch's bytes.
pub(crate) fn validate(e: &Entry, spans: &[Span], local: u64, write: bool) -> Result<u64, Error> {
    if write && !e.writable {
        return Err(Error::invalid(
            "the region is read-only (registered as Buffer::Shared)",
        ));
    }
    let total = check_spans(spans, e.len, local)?;
    let way = if write { Way::In } else { Way::Out };
    if let Some((i, j)) = overlapping(spans, way) {
        return Err(Error::invalid(format!(
            "spans {i} and {j} write the same bytes"
        )));
    }
    Ok(total)
}

/// Two spans whose destinations overlap, if any (by index).
fn overlapping(spans: &[Span], way: Way) -> Option<(usize, usize)> {
    if spans.len() < 2 {
        return None;
    }
    let dst = |s: &Span| match way {
        Way::Out => s.local,
        Way::In => s.remote,
    };
    let mut ranges: Vec<(u64, u64, usize)> = spans
        .iter()
        .enumerate()
        .filter(|(_, s)| s.len > 0)
        .map(|(i, s)| (dst(s), dst(s) + s.len, i))
        .collect();
    ranges.sort_unstable();
    ranges
        .windows(2)
        .find(|w| w[1].0 < w[0].1)
        .map(|w| (w[0].2.min(w[1].2), w[0].2.max(w[1].2)))
}
