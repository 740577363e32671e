//! The registration cache of an endpoint: memory registrations (`fi_mr_reg`) of caller buffers
//! that ops move in place (the `efa` channel), for providers that require them (`FI_MR_LOCAL`,
//! as older `efa` providers do; or when forced, for tests).
//!
//! **Key.** A registration covers one whole buffer, `(address, length)`, as the caller handed it
//! over: every chunk of a tensor posted while the buffer is held shares one `fi_mr_reg`.
//!
//! **Invalidation rule.** A registration lives exactly as long as at least one op over its
//! buffer is in the engine (backlogged, posted, or finished and not yet handed back): the op
//! that takes it counts it ([`RegCache::acquire`]), the end of the op un-counts it
//! ([`RegCache::release`]), and the last release deregisters it (`fi_close`), *before* the op's
//! end reaches the caller, and so before the buffer can go back to the user. A buffer the user
//! frees, or whose address the allocator hands out again, can therefore never be reached through
//! a stale registration: there is none left by then. The price: a buffer sent again in a later
//! message is registered again. (Caching across messages would need to learn when the user's
//! memory is unmapped, the memory-hook machinery of libfabric's own MR cache; this rule needs
//! none.)

use std::ffi::c_void;
use std::rc::Rc;

use super::{Domain, FabricError, Mr};
use crate::keymap::KeyMap;

/// Registrations in use, keyed by buffer. See the module docs.
#[derive(Default)]
pub struct RegCache {
    entries: KeyMap<(usize, usize), (Mr, usize)>,
    registrations: u64,
}

impl RegCache {
    /// The descriptor of the registration of `len` bytes at `base`, registering them on first
    /// use; counts one more user.
    ///
    /// # Safety
    /// The memory stays allocated and is not handed back to its owner until the matching
    /// [`RegCache::release`].
    pub unsafe fn acquire(
        &mut self,
        domain: &Rc<Domain>,
        base: usize,
        len: usize,
    ) -> Result<*mut c_void, FabricError> {
        if let Some((mr, users)) = self.entries.get_mut(&(base, len)) {
            *users += 1;
            return Ok(mr.desc());
        }
        // SAFETY: the caller keeps the memory alive until the last release, and the Mr is
        // dropped at that release.
        let mr = unsafe { domain.register(base as *const u8, len) }?;
        let desc = mr.desc();
        self.registrations += 1;
        self.entries.insert((base, len), (mr, 1));
        Ok(desc)
    }

    /// The descriptor of the registration of `(base, len)`, if it is registered.
    pub fn desc(&self, base: usize, len: usize) -> *mut c_void {
        self.entries
            .get(&(base, len))
            .map_or(std::ptr::null_mut(), |(mr, _)| mr.desc())
    }

    /// One user of the registration of `(base, len)` is done; the last one deregisters it.
    pub fn release(&mut self, base: usize, len: usize) {
        if let Some((_, users)) = self.entries.get_mut(&(base, len)) {
            *users -= 1;
            if *users == 0 {
                self.entries.remove(&(base, len));
            }
        }
    }

    /// Buffers registered now.
    pub fn live(&self) -> usize {
        self.entries.len()
    }

    /// Registrations made so far (`fi_mr_reg` calls).
    pub fn registrations(&self) -> u64 {
        self.registrations
    }
}
