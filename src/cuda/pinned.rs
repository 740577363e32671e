//! Page-locked host buffers for staging copies between device and host memory, pooled.
//!
//! The driver copies between device memory and pinned host memory by DMA at full link speed, and
//! asynchronously; pageable memory goes through a driver bounce buffer. Pinning is expensive
//! (a system call and page-table work per allocation), so the pool keeps what it made.

use std::sync::{Arc, Mutex};

use super::{check, gpu, sys};

/// A pool of pinned host buffers of one size.
#[derive(Debug)]
pub struct PinnedPool {
    size: usize,
    keep: usize,
    free: Mutex<Vec<usize>>,
}

/// A pinned host buffer from a [`PinnedPool`]; it goes back when dropped.
pub struct PinnedBuf {
    ptr: *mut u8,
    pool: Arc<PinnedPool>,
}

// SAFETY: the buffer is plain host memory owned by this value alone.
unsafe impl Send for PinnedBuf {}

impl std::fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuf({:p}, {} bytes)", self.ptr, self.pool.size)
    }
}

impl PinnedPool {
    /// A pool of `size`-byte buffers that keeps up to `keep` idle ones.
    pub fn new(size: usize, keep: usize) -> Arc<Self> {
        Arc::new(PinnedPool {
            size: size.max(1),
            keep,
            free: Mutex::new(Vec::new()),
        })
    }

    /// The size of each buffer.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Idle buffers in the pool.
    pub fn idle(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// A buffer, reused when one is idle, pinned (portable to every context) otherwise.
    pub fn take(self: &Arc<Self>) -> crate::Result<PinnedBuf> {
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let ptr = match reused {
            Some(p) => p as *mut u8,
            None => {
                // Any device's context will do: portable memory is pinned for all of them.
                gpu(0)?.bind()?;
                let mut p = std::ptr::null_mut();
                // SAFETY: a context is current; the call writes `p`.
                check("cuMemHostAlloc", unsafe {
                    sys::cuMemHostAlloc(&mut p, self.size, sys::CU_MEMHOSTALLOC_PORTABLE)
                })?;
                crate::metrics::cuda_created("pinned");
                p.cast()
            }
        };
        Ok(PinnedBuf {
            ptr,
            pool: self.clone(),
        })
    }
}

impl PinnedBuf {
    /// The host address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.pool.size
    }

    /// Whether it holds no bytes (never: pools make buffers of at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes. The caller must make sure no copy into them is still running on a stream.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `size` bytes of host memory owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.pool.size) }
    }

    /// The bytes, mutably; as for [`Self::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.pool.size) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.pool.keep {
            free.push(self.ptr as usize);
        } else {
            drop(free);
            // SAFETY: pinned by cuMemHostAlloc, owned by us, no longer used.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}
