use std::ffi::{c_char, c_int};

use crate::kv::KvError;

use super::handles::{bytes, key};
use super::*;

#[test]
fn bad_handles_and_arguments_are_refused() {
    let bogus = 0x1234 as *mut kv_client;
    assert_eq!(
        kv_client_connect(bogus, c"127.0.0.1".as_ptr(), 1),
        KV_ERR_INVALID_ARGUMENT
    );
    let mut len = 4usize;
    let mut buf = [0u8; 4];
    let r = unsafe { kv_client_get(bogus, c"k".as_ptr(), 1, buf.as_mut_ptr().cast(), &mut len) };
    assert_eq!(r, KV_ERR_INVALID_ARGUMENT);
    let c = kv_client_create(CONN_MODE_CM);
    assert!(!c.is_null());
    let r = unsafe { kv_client_put(c, std::ptr::null(), 1, std::ptr::null(), 0) };
    assert_eq!(r, KV_ERR_DISCONNECTED, "not connected comes first");
    assert_eq!(
        kv_client_connect(c, std::ptr::null(), 1),
        KV_ERR_INVALID_ARGUMENT
    );
    kv_client_destroy(c);
    kv_client_destroy(c);
    assert!(kv_client_create(7).is_null());
    let cfg = kv_config {
        bind_ip: [b'1' as c_char; 64],
        port: 0,
        memory_size: 4 << 20,
        use_huge_pages: false,
        hash_table_size: 16,
        num_workers: 1,
        conn_mode: CONN_MODE_CM,
        ib_dev: [0; 64],
    };
    assert!(
        unsafe { kv_server_create(&cfg) }.is_null(),
        "unterminated bind_ip"
    );
    let cfg = kv_config {
        bind_ip: [0; 64],
        ..cfg
    };
    let s = unsafe { kv_server_create(&cfg) };
    assert!(!s.is_null());
    assert_eq!(kv_server_port(s), -1, "not started");
    kv_server_destroy(s);
    assert_eq!(kv_server_start(s), KV_ERR_INVALID_ARGUMENT, "destroyed");
}

#[test]
fn every_engine_error_has_its_header_code() {
    let all = [
        (KvError::NotFound, KV_ERR_NOT_FOUND),
        (KvError::Exists, KV_ERR_EXISTS),
        (KvError::CasFailed { current: 1 }, KV_ERR_CAS_FAILED),
        (KvError::KeyTooLong, KV_ERR_KEY_TOO_LONG),
        (KvError::ValueTooLong { max: 1 }, KV_ERR_VALUE_TOO_LONG),
        (KvError::NoMemory, KV_ERR_NO_MEMORY),
        (KvError::Internal(String::new()), KV_ERR_INTERNAL),
        (
            KvError::InvalidArgument(String::new()),
            KV_ERR_INVALID_ARGUMENT,
        ),
        (KvError::Disconnected(String::new()), KV_ERR_DISCONNECTED),
        (KvError::Timeout(Default::default()), KV_ERR_TIMEOUT),
        (
            KvError::BufferTooSmall { needed: 1 },
            KV_ERR_BUFFER_TOO_SMALL,
        ),
    ];
    for (e, code) in all {
        assert_eq!(e.code(), code, "{e}");
    }
}

#[test]
fn lengths_are_range_checked_before_any_slice_is_made() {
    let k = c"key";
    unsafe {
        assert_eq!(key(k.as_ptr(), usize::MAX), Err(KvError::KeyTooLong));
        assert_eq!(
            key(k.as_ptr(), KV_MAX_KEY_LEN + 1),
            Err(KvError::KeyTooLong)
        );
        assert_eq!(key(k.as_ptr(), 3), Ok(&b"key"[..]));
        assert!(matches!(
            bytes(k.as_ptr().cast(), usize::MAX),
            Err(KvError::InvalidArgument(_))
        ));
        assert!(matches!(
            bytes(k.as_ptr().cast(), isize::MAX as usize + 1),
            Err(KvError::InvalidArgument(_))
        ));
    }
}

#[test]
fn dead_client_handles_stay_dead_while_new_ones_are_made() {
    let dead = kv_client_create(CONN_MODE_CM);
    kv_client_destroy(dead);
    // Half the quarantine: other tests in this process make clients too.
    for i in 0..crate::ffi::table::QUARANTINE / 2 {
        let c = kv_client_create(CONN_MODE_CM);
        assert_ne!(c, dead, "client {i} after the destroy got its address");
        let r = unsafe { kv_client_delete(dead, c"k".as_ptr(), 1) };
        assert_eq!(r, KV_ERR_INVALID_ARGUMENT);
        kv_client_destroy(c);
    }
}

#[test]
fn the_config_is_read_field_by_field_from_unaligned_memory() {
    let mut bytes = vec![0u8; std::mem::size_of::<kv_config>() + 1];
    let p = unsafe { bytes.as_mut_ptr().add(1) }.cast::<kv_config>();
    let s = unsafe {
        std::ptr::addr_of_mut!((*p).memory_size).write_unaligned(4 << 20);
        std::ptr::addr_of_mut!((*p).hash_table_size).write_unaligned(16);
        std::ptr::addr_of_mut!((*p).num_workers).write_unaligned(1);
        // A bool byte no Rust bool has: taken as true (huge pages, which
        // fall back with a warning where there are none).
        std::ptr::addr_of_mut!((*p).use_huge_pages)
            .cast::<u8>()
            .write(2);
        kv_server_create(p)
    };
    assert!(!s.is_null());
    let mut line = [0 as c_char; 8];
    let n = unsafe { kv_server_stats(s, line.as_mut_ptr(), usize::MAX) };
    assert!(n > 0, "a length no buffer has is not written to");
    assert_eq!(line[0], 0);
    kv_server_destroy(s);
}

#[test]
fn a_table_or_memory_size_past_the_address_space_is_refused() {
    for (memory, table) in [(4usize << 20, 1usize << 56), (usize::MAX, 16)] {
        let mut cfg: kv_config = unsafe { std::mem::zeroed() };
        cfg.memory_size = memory;
        cfg.hash_table_size = table;
        cfg.num_workers = 1;
        let s = unsafe { kv_server_create(&cfg) };
        assert!(s.is_null(), "memory {memory}, table {table}: refused");
    }
}

#[test]
fn a_worker_count_past_the_maximum_is_refused() {
    let mut cfg: kv_config = unsafe { std::mem::zeroed() };
    cfg.memory_size = 4 << 20;
    cfg.hash_table_size = 16;
    let most = c_int::try_from(crate::kv::MAX_WORKERS).unwrap();
    for (workers, refused) in [(most, false), (most + 1, true), (c_int::MAX, true)] {
        cfg.num_workers = workers;
        let s = unsafe { kv_server_create(&cfg) };
        assert_eq!(s.is_null(), refused, "{workers} workers");
        kv_server_destroy(s);
    }
}
