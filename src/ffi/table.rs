//! The one table type behind every kind of handle C holds (connections,
//! listeners, key-value servers, clients and `kv_open` handles).
//!
//! A handle is the address of memory the library owns. C keeps handles
//! after it closed them, by mistake or (an accepted `RdmaConn` after its
//! disconnect callback) by design; if the allocator handed that address to
//! the next object of the same kind, the dead handle would be taken for the
//! new object. So the memory of a closed handle stays allocated until
//! [`QUARANTINE`] more objects of its kind were created: until then its
//! address cannot come back, the table answers "unknown" for it, and a C
//! struct there (an `RdmaConn`'s `state`) still reads as it was left.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;

/// Objects of a kind created after a handle closed before its address can
/// be reused.
pub(crate) const QUARANTINE: u64 = 1024;

/// Memory at a handle's address, which C may read (a C struct) or only
/// compare (an opaque one-byte token); freed once the table and every Rust
/// holder let go of it.
pub(crate) struct CMemory<C>(UnsafeCell<C>);

// SAFETY: the library writes the contents under its own discipline (plain
// fields, volatile where C may read concurrently); the allocation itself is
// never moved.
unsafe impl<C> Send for CMemory<C> {}
unsafe impl<C> Sync for CMemory<C> {}

impl<C> CMemory<C> {
    pub(crate) fn new(value: C) -> Arc<CMemory<C>> {
        Arc::new(CMemory(UnsafeCell::new(value)))
    }

    /// The handle: the address C gets.
    pub(crate) fn get(&self) -> *mut C {
        self.0.get()
    }
}

/// Keeps a handle's memory allocated, whatever its type.
type Keep = Arc<dyn Send + Sync>;

struct State<T> {
    /// By address. FxHash: every C call looks its handle up, and a caller
    /// can only look addresses up, not choose the ones inserted.
    live: FxHashMap<usize, (Arc<T>, Keep)>,
    /// Memory of closed handles, oldest first, with `created` at closing.
    closed: VecDeque<(u64, Keep)>,
    /// Objects ever inserted.
    created: u64,
}

/// Live handles of one kind, by address, and the quarantine of closed ones.
pub(crate) struct HandleTable<T> {
    state: Mutex<State<T>>,
}

impl<T> HandleTable<T> {
    pub(crate) fn new() -> Self {
        HandleTable {
            state: Mutex::new(State {
                live: FxHashMap::default(),
                closed: VecDeque::new(),
                created: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        // A panic elsewhere never leaves the table half-changed: every
        // change below is a single map or queue operation.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `value` under the address of `memory` and returns it.
    pub(crate) fn insert<C: 'static>(&self, memory: Arc<CMemory<C>>, value: Arc<T>) -> *mut C {
        let handle = memory.get();
        let mut st = self.lock();
        st.created += 1;
        let created = st.created;
        // The memory of this object was allocated before this point, so a
        // closed handle's memory freed here is reusable from the next one.
        while st
            .closed
            .front()
            .is_some_and(|(at, _)| at + QUARANTINE <= created)
        {
            st.closed.pop_front();
        }
        st.live.insert(handle as usize, (value, memory));
        handle
    }

    /// Registers `value` under a fresh opaque handle.
    pub(crate) fn insert_opaque<H>(&self, value: T) -> *mut H {
        self.insert(CMemory::new(0u8), Arc::new(value)).cast()
    }

    /// The object behind a live handle; `None` for anything else (NULL,
    /// closed, foreign), which is never dereferenced.
    pub(crate) fn get<H>(&self, handle: *const H) -> Option<Arc<T>> {
        self.lock()
            .live
            .get(&(handle as usize))
            .map(|(v, _)| v.clone())
    }

    /// The object behind a live handle if `check` lets it out (checked
    /// under the table's lock, so a refused caller never holds a reference
    /// that could outlive the handle's removal); `None` when not live.
    pub(crate) fn get_checked<H, E>(
        &self,
        handle: *const H,
        check: impl FnOnce(&T) -> Result<(), E>,
    ) -> Option<Result<Arc<T>, E>> {
        self.lock()
            .live
            .get(&(handle as usize))
            .map(|(v, _)| check(v).map(|()| v.clone()))
    }

    /// Takes a live handle out of the table (its memory goes to the
    /// quarantine) and returns its object; `None` when it was not live.
    pub(crate) fn remove<H>(&self, handle: *const H) -> Option<Arc<T>> {
        let mut st = self.lock();
        let (value, memory) = st.live.remove(&(handle as usize))?;
        let created = st.created;
        st.closed.push_back((created, memory));
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_handle_is_unknown_and_its_address_not_reused_for_the_next_1024() {
        let table = HandleTable::<u32>::new();
        let dead: *mut u8 = table.insert_opaque(7);
        assert_eq!(table.get(dead).as_deref(), Some(&7));
        assert_eq!(table.remove(dead).as_deref(), Some(&7));
        assert!(table.get(dead).is_none());
        assert!(table.remove(dead).is_none(), "a second close is refused");
        // Create and close objects one at a time, as careless programs do:
        // without the quarantine the allocator hands the same address back.
        for i in 0..QUARANTINE {
            let h: *mut u8 = table.insert_opaque(i as u32);
            assert_ne!(h, dead, "object {i} after the close got its address");
            assert!(table.get(dead).is_none());
            table.remove(h);
        }
    }

    #[test]
    fn the_memory_of_a_closed_struct_stays_readable_while_quarantined() {
        let table = HandleTable::<()>::new();
        let mem = CMemory::new(5u64);
        let freed = Arc::downgrade(&mem);
        let h = table.insert(mem, Arc::new(()));
        table.remove(h);
        for _ in 0..QUARANTINE - 1 {
            let h: *mut u8 = table.insert_opaque(());
            table.remove(h);
        }
        // SAFETY: the quarantine still holds the memory (the point of the test).
        assert_eq!(unsafe { *h }, 5);
        let _: *mut u8 = table.insert_opaque(());
        assert!(
            freed.upgrade().is_none(),
            "freed at the 1024th object after"
        );
    }
}
