use std::ffi::c_char;

use crate::kv::KvError;

use super::*;

#[test]
fn codes_match_the_engine() {
    assert_eq!(KvError::CasFailed { current: 1 }.code(), KV_ERR_CAS_FAILED);
    assert_eq!(
        KvError::BufferTooSmall { needed: 1 }.code(),
        KV_ERR_BUFFER_TOO_SMALL
    );
    assert_eq!(KvError::Timeout(Default::default()).code(), KV_ERR_TIMEOUT);
}

#[test]
fn bad_handles_and_arguments_are_refused() {
    let bogus = 0x1234 as *mut kv_client;
    assert_eq!(kv_client_connect(bogus, c"127.0.0.1".as_ptr(), 1), -1);
    let mut len = 4usize;
    let mut buf = [0u8; 4];
    let r = unsafe { kv_client_get(bogus, c"k".as_ptr(), 1, buf.as_mut_ptr().cast(), &mut len) };
    assert_eq!(r, KV_ERR_INVALID_ARGUMENT);
    let c = kv_client_create(CONN_MODE_CM);
    assert!(!c.is_null());
    let r = unsafe { kv_client_put(c, std::ptr::null(), 1, std::ptr::null(), 0) };
    assert_eq!(r, KV_ERR_DISCONNECTED, "not connected comes first");
    assert_eq!(kv_client_connect(c, std::ptr::null(), 1), -1);
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
    assert_eq!(kv_server_start(s), -1, "destroyed");
}
