//! The broker's C ABI on bad input, before any device is needed.

use std::ptr::addr_of_mut;

use super::*;
use crate::ffi::broker_mem::{snowrdma_mem_manager_create, snowrdma_mem_manager_destroy};

unsafe extern "C" fn ignore(
    _: *mut c_void,
    _: *mut snowrdma_broker,
    _: *const snowrdma_broker_event,
) {
}

#[test]
fn a_mode_no_enum_has_is_refused_before_rust_holds_it() {
    // The config as C may fill it: `mode` written as a plain int.
    let mut cfg: snowrdma_broker_config = unsafe { std::mem::zeroed() };
    cfg.hosts = c"127.0.0.1:7000".as_ptr();
    cfg.slots_per_peer = 4;
    cfg.slot_size = 64;
    cfg.doorbell_batch = 1;
    cfg.memory_len = 4096;
    unsafe { addr_of_mut!(cfg.mode).cast::<c_int>().write(7) };
    let made = unsafe { config_from_c(&cfg) };
    assert!(
        matches!(&made, Err(BrokerError::InvalidArgument(why)) if why.contains("mode 7")),
        "{:?}",
        made.err()
    );
    let b = unsafe { snowrdma_broker_create(&cfg, Some(ignore), std::ptr::null_mut()) };
    assert!(b.is_null());
    unsafe { addr_of_mut!(cfg.mode).cast::<c_int>().write(1) };
    let made = unsafe { config_from_c(&cfg) }.unwrap();
    assert_eq!(made.mode, ConnectMode::Socket);
}

#[test]
fn a_memory_manager_of_more_than_the_address_space_is_null_not_an_abort() {
    let mut room = [0u8; 64];
    let base = room.as_mut_ptr().cast::<c_char>();
    assert!(snowrdma_mem_manager_create(base, u64::MAX, 1, 1 << 20).is_null());
    let m = snowrdma_mem_manager_create(base, 1 << 50, 4, 1 << 20);
    assert!(!m.is_null(), "a large range costs nothing until used");
    snowrdma_mem_manager_destroy(m);
}
