//! The in-process path: the region lives in this process (a pipe between two contexts of it),
//! so a remote read or write is a copy between the region's memory and the caller's buffer,
//! made by the caller's thread (large batches shared among the process's copy threads,
//! `crate::copy`), holding the region's entry shared for the copy's length, so that
//! deregistration waits for it and no copy starts after. Where either side is device memory
//! (`cuda_xth`), the copies are the driver's, queued on the local buffer's stream (or the
//! region's, for host memory read into or written from a region of device memory) and waited
//! for before the region is let go.

use super::{check_spans, lookup, Entry, Notification, RegionDescriptor, Span};
use crate::copy::{copy_spans, Span as CopySpan, MAX_SPANS, NT_MIN, SHARED_MIN};
use crate::error::Error;
use crate::message::Buffer;

/// The caller's memory in an operation: `len` bytes at `ptr` (for device memory, its device
/// address), borrowed from its buffer for the operation.
pub(crate) struct Local<'a> {
    ptr: *mut u8,
    len: usize,
    #[cfg(feature = "cuda")]
    device: Option<&'a crate::cuda::CudaBuffer>,
    _buffer: std::marker::PhantomData<&'a mut Buffer>,
}

impl<'a> Local<'a> {
    /// The memory of `buffer` (which a read may write into: `Buffer::Cpu` or `Buffer::Cuda`).
    pub(crate) fn of(buffer: &'a mut Buffer) -> Local<'a> {
        let len = buffer.len() as usize;
        let ptr = match buffer {
            Buffer::Cpu(v) => v.as_mut_ptr(),
            Buffer::Shared(b) => b.as_ptr() as *mut u8,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => {
                return Local {
                    ptr: b.device_ptr() as *mut u8,
                    len,
                    device: Some(b),
                    _buffer: std::marker::PhantomData,
                }
            }
        };
        Local::host(ptr, len)
    }

    fn host(ptr: *mut u8, len: usize) -> Local<'a> {
        Local {
            ptr,
            len,
            #[cfg(feature = "cuda")]
            device: None,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Whether it is device memory.
    fn is_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.device.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }
}

/// Which way a copy goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Region to the local buffer.
    Out,
    /// Local buffer to the region.
    In,
}

/// Reads `spans` of the region `d` names into `local` (or writes them from it, `write`);
/// notifies its owner with `notify` after, once the bytes are in place. Returns the bytes
/// copied.
pub(crate) fn operate(
    d: &RegionDescriptor,
    spans: &[Span],
    local: Local<'_>,
    write: bool,
    notify: Option<Vec<u8>>,
) -> Result<u64, Error> {
    let way = if write { Way::In } else { Way::Out };
    let e = lookup(d)?;
    let n = copy(&e, spans, local, way)?;
    if let Some(data) = notify {
        e.owner.notify(Notification {
            region: d.id,
            write,
            data,
        });
    }
    Ok(n)
}

/// The path a copy between a region and `local` takes: `cuda_xth` where either is device
/// memory.
pub(crate) fn path(d: &RegionDescriptor, local: &Buffer) -> &'static str {
    let device = d.cuda_device().is_some() || local.device() != crate::message::Device::Cpu;
    if device {
        "cuda_xth"
    } else {
        "xth"
    }
}

/// The owner's own read of its region.
pub(crate) fn copy_out(e: &Entry, spans: &[Span], dst: &mut [u8]) -> Result<(), Error> {
    copy(e, spans, Local::host(dst.as_mut_ptr(), dst.len()), Way::Out).map(|_| ())
}

/// The owner's own write into its region.
pub(crate) fn copy_in(e: &Entry, spans: &[Span], src: &[u8]) -> Result<(), Error> {
    let local = Local::host(src.as_ptr() as *mut u8, src.len());
    copy(e, spans, local, Way::In).map(|_| ())
}

/// Copies `spans` between the region and `local` (read from for [`Way::In`], written to for
/// [`Way::Out`]).
fn copy(e: &Entry, spans: &[Span], local: Local<'_>, way: Way) -> Result<u64, Error> {
    let total = validate(e, spans, local.len as u64, way == Way::In)?;
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
                local.ptr.add(s.local as usize),
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
    if e.is_device() || local.is_device() {
        #[cfg(feature = "cuda")]
        {
            let stream = match (local.device, &store.buffer) {
                (Some(b), _) | (None, Buffer::Cuda(b)) => b.stream().clone(),
                _ => unreachable!("one side is device memory"),
            };
            // SAFETY: each piece lies inside the region's memory, held by the shared lock
            // until the copies have run (`copy_pieces` waits for the stream), and inside the
            // caller's buffer, borrowed for the call.
            unsafe { super::device::copy_pieces(&stream, pieces)? };
        }
        drop(memory);
        return Ok(total);
    }
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
    // Spans whose destinations come in order, each past the one before (a KV read gathering
    // into consecutive slots), cannot overlap: one pass, no allocation.
    let mut end = 0u64;
    let in_order = spans.iter().filter(|s| s.len > 0).all(|s| {
        let ok = dst(s) >= end;
        end = dst(s) + s.len;
        ok
    });
    if in_order {
        return None;
    }
    // Otherwise sort the destinations, in a buffer of this thread's that is reused.
    thread_local! {
        static RANGES: std::cell::RefCell<Vec<(u64, u64, usize)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    RANGES.with_borrow_mut(|ranges| {
        ranges.clear();
        ranges.extend(
            spans
                .iter()
                .enumerate()
                .filter(|(_, s)| s.len > 0)
                .map(|(i, s)| (dst(s), dst(s) + s.len, i)),
        );
        ranges.sort_unstable();
        ranges
            .windows(2)
            .find(|w| w[1].0 < w[0].1)
            .map(|w| (w[0].2.min(w[1].2), w[0].2.max(w[1].2)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_destinations_are_found_in_any_order() {
        let s = |local, len| Span::new(0, local, len);
        // In order and disjoint (the one pass), out of order and disjoint (the sort).
        assert_eq!(overlapping(&[s(0, 4), s(4, 4), s(8, 1)], Way::Out), None);
        assert_eq!(overlapping(&[s(8, 4), s(0, 4), s(4, 4)], Way::Out), None);
        // Overlaps: in order, out of order, and one hidden behind an empty span.
        assert_eq!(overlapping(&[s(0, 4), s(3, 4)], Way::Out), Some((0, 1)));
        assert_eq!(overlapping(&[s(8, 4), s(0, 9)], Way::Out), Some((0, 1)));
        assert_eq!(
            overlapping(&[s(0, 4), s(9, 0), s(2, 1)], Way::Out),
            Some((0, 2))
        );
        // A write checks the region's side, not the local buffer's.
        let w = [Span::new(0, 0, 4), Span::new(2, 8, 4)];
        assert_eq!(overlapping(&w, Way::In), Some((0, 1)));
        assert_eq!(overlapping(&w, Way::Out), None);
    }
}
