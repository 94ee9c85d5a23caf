//! The broker's slab memory manager for C (`include/snowrdma/broker.h`):
//! a thin layer over [`crate::broker::MemManager`]. Unlike a broker, a
//! manager may be used from any thread.

use std::ffi::{c_char, c_int};

use once_cell::sync::Lazy;

use crate::broker::MemManager;
use crate::ffi::boundary::{guard, guard_or};
use crate::ffi::table::HandleTable;

/// Opaque memory manager handle.
#[allow(non_camel_case_types)]
pub struct snowrdma_mem_manager {
    _private: [u8; 0],
}

static MANAGERS: Lazy<HandleTable<MemManager>> = Lazy::new(HandleTable::new);

/// A slab memory manager over `len` bytes at `base` (typically part of the
/// data region): `partitions` partitions of `slab_size`-byte slabs, size
/// classes from 1,200 bytes doubling. NULL for bad arguments (among them
/// more partitions than `len` holds slabs). Thread-safe.
/// Free with `snowrdma_mem_manager_destroy`; the memory stays the caller's.
#[no_mangle]
pub extern "C" fn snowrdma_mem_manager_create(
    base: *mut c_char,
    len: u64,
    partitions: u32,
    slab_size: u64,
) -> *mut snowrdma_mem_manager {
    guard(|| {
        if base.is_null() {
            return std::ptr::null_mut();
        }
        match MemManager::new(base as usize, len, partitions, slab_size) {
            Some(m) => MANAGERS.insert_opaque(m),
            None => std::ptr::null_mut(),
        }
    })
}

/// The size class for items of `size` bytes (`key` picks the partition);
/// -1 when no class holds it.
#[no_mangle]
pub extern "C" fn snowrdma_mem_manager_class(
    m: *mut snowrdma_mem_manager,
    key: u64,
    size: u64,
) -> i32 {
    guard_or(-1, || {
        MANAGERS
            .get(m)
            .and_then(|m| m.class_of(key, size))
            .map_or(-1, |c| c as i32)
    })
}

/// An item of `class` from the partition of `key`; NULL when it is full.
#[no_mangle]
pub extern "C" fn snowrdma_mem_manager_alloc(
    m: *mut snowrdma_mem_manager,
    key: u64,
    class: u32,
) -> *mut c_char {
    guard(|| {
        MANAGERS
            .get(m)
            .and_then(|m| m.alloc(key, class))
            .map_or(std::ptr::null_mut(), |a| a as *mut c_char)
    })
}

/// Returns an item; 0, or -1 when it is not a live item of that class and
/// partition (a double free included), which changes nothing.
#[no_mangle]
pub extern "C" fn snowrdma_mem_manager_free(
    m: *mut snowrdma_mem_manager,
    key: u64,
    item: *mut c_char,
    class: u32,
) -> c_int {
    guard_or(-1, || match MANAGERS.get(m) {
        Some(m) => match m.free(key, item as usize, class) {
            Ok(()) => 0,
            Err(e) => {
                log::warn!("snowrdma_mem_manager_free: {e}");
                -1
            }
        },
        None => -1,
    })
}

/// Frees the manager (not the memory it managed).
#[no_mangle]
pub extern "C" fn snowrdma_mem_manager_destroy(m: *mut snowrdma_mem_manager) {
    guard(|| {
        MANAGERS.remove(m);
    })
}
