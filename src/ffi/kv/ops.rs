//! The `kv_client_*` exports that read and write keys, single and in
//! batches, and `kv_strerror`.

use std::ffi::{c_char, c_int, c_void, CStr};

use crate::ffi::boundary::{fits_in_memory, guard_or};
use crate::kv::{Client, KvError};

use super::client::with_client;
use super::handles::{bytes, code, key, Pair};
use super::types::{
    kv_client, KV_ERR_BUFFER_TOO_SMALL, KV_ERR_CAS_FAILED, KV_ERR_DISCONNECTED, KV_ERR_EXISTS,
    KV_ERR_INTERNAL, KV_ERR_INVALID_ARGUMENT, KV_ERR_KEY_TOO_LONG, KV_ERR_NOT_FOUND,
    KV_ERR_NO_MEMORY, KV_ERR_TIMEOUT, KV_ERR_VALUE_TOO_LONG, KV_OK,
};

/// Copies the value of `key` into `value_buf`. `*value_len` is the
/// buffer's capacity on entry and the value's length on return. A value
/// longer than the buffer is not copied: `KV_ERR_BUFFER_TOO_SMALL`, with
/// `*value_len` set to the length needed.
///
/// # Safety
/// `key` valid for `key_len` bytes, `value_buf` for `*value_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_client_get(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value_buf: *mut c_void,
    value_len: *mut usize,
) -> c_int {
    get_into(
        client,
        (key, key_len),
        (value_buf, value_len, std::ptr::null_mut()),
        Client::get_into,
    )
}

/// As `kv_client_get`, also reporting the value's version in `*version`
/// (when not NULL), for CAS loops.
///
/// # Safety
/// As `kv_client_get`; a non-NULL `version` must be writable.
#[no_mangle]
pub unsafe extern "C" fn kv_client_get_version(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value_buf: *mut c_void,
    value_len: *mut usize,
    version: *mut u64,
) -> c_int {
    get_into(
        client,
        (key, key_len),
        (value_buf, value_len, version),
        Client::get_into,
    )
}

/// As `kv_client_get_version`, without the server's CPU: the client READs
/// the server's hash index and then the value, and takes only a value that
/// verifies as current (a torn or outdated read is retried; what the index
/// cannot answer is asked of the server). Best for values that are read
/// far more often than written.
///
/// # Safety
/// As `kv_client_get_version`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_get_onesided(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value_buf: *mut c_void,
    value_len: *mut usize,
    version: *mut u64,
) -> c_int {
    get_into(
        client,
        (key, key_len),
        (value_buf, value_len, version),
        Client::get_one_sided_into,
    )
}

/// The body of the single-key GETs: checks the arguments,
/// lets `get` copy the value into the caller's buffer, and reports length
/// and version.
#[track_caller]
pub(super) unsafe fn get_into(
    client: *mut kv_client,
    (key, key_len): (*const c_char, usize),
    (value_buf, value_len, version): (*mut c_void, *mut usize, *mut u64),
    get: impl FnOnce(&Client, &[u8], &mut [u8]) -> Result<(usize, u64), KvError>,
) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            if value_len.is_null()
                || (value_buf.is_null() && *value_len > 0)
                || !fits_in_memory(*value_len)
            {
                return KV_ERR_INVALID_ARGUMENT;
            }
            let k = match self::key(key, key_len) {
                Ok(k) => k,
                Err(e) => return e.code(),
            };
            let buf: &mut [u8] = if value_buf.is_null() {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(value_buf.cast(), *value_len)
            };
            match get(c, k, buf) {
                Ok((n, v)) => {
                    *value_len = n;
                    if let Some(out) = version.as_mut() {
                        *out = v;
                    }
                    KV_OK
                }
                Err(KvError::BufferTooSmall { needed }) => {
                    *value_len = needed as usize;
                    KV_ERR_BUFFER_TOO_SMALL
                }
                Err(e) => code::<()>(Err(e)),
            }
        })
    })
}

/// Stores `value` under `key` (both copied): new keys get version 1, each
/// PUT adds 1.
///
/// # Safety
/// `key` valid for `key_len` bytes, `value` for `value_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_client_put(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value: *const c_void,
    value_len: usize,
) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            code(self::key(key, key_len).and_then(|k| c.put(k, bytes(value, value_len)?)))
        })
    })
}

/// Deletes `key`; `KV_ERR_NOT_FOUND` when absent.
///
/// # Safety
/// `key` valid for `key_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_client_delete(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            code(self::key(key, key_len).and_then(|k| c.delete(k)))
        })
    })
}

/// Stores `new_value` only if the key's version is `expected_version` (0:
/// only if the key is absent); `*new_version` (when not NULL) gets the new
/// version, or on `KV_ERR_CAS_FAILED` the current one (0: absent).
///
/// # Safety
/// `key` valid for `key_len` bytes, `new_value` for `new_value_len`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_cas(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    expected_version: u64,
    new_value: *const c_void,
    new_value_len: usize,
    new_version: *mut u64,
) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            let r = self::key(key, key_len)
                .and_then(|k| c.cas(k, expected_version, bytes(new_value, new_value_len)?));
            let reported = match &r {
                Ok(v) => Some(*v),
                Err(KvError::CasFailed { current }) => Some(*current),
                Err(_) => None,
            };
            if let (Some(v), Some(out)) = (reported, new_version.as_mut()) {
                *out = v;
            }
            code(r)
        })
    })
}

/// GETs `count` keys with several requests in flight. For each i,
/// `value_lens[i]` is the capacity of `values[i]` on entry and the value's
/// length after a success (the needed length when too small). Returns how
/// many succeeded (-1 for bad arguments).
///
/// # Safety
/// Each array holds `count` entries, valid as in `kv_client_get`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_batch_get(
    client: *mut kv_client,
    keys: *const *const c_char,
    key_lens: *const usize,
    values: *mut *mut c_void,
    value_lens: *mut usize,
    count: c_int,
) -> c_int {
    guard_or(-1, || {
        batch_get(
            client,
            (keys, key_lens),
            (values, value_lens),
            count,
            |c, keys, each| c.batch_get_with(keys, each),
        )
    })
}

/// As `kv_client_batch_get`, each key as `kv_client_get_onesided` GETs it:
/// the index buckets and then the values are READ with many in flight,
/// without the server's CPU.
///
/// # Safety
/// As `kv_client_batch_get`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_batch_get_onesided(
    client: *mut kv_client,
    keys: *const *const c_char,
    key_lens: *const usize,
    values: *mut *mut c_void,
    value_lens: *mut usize,
    count: c_int,
) -> c_int {
    guard_or(-1, || {
        batch_get(
            client,
            (keys, key_lens),
            (values, value_lens),
            count,
            |c, keys, each| c.batch_get_one_sided_with(keys, each),
        )
    })
}

/// The body of the batched GETs: checks the arrays, runs `get` on the
/// keys, and copies each value that fits straight into its buffer.
pub(super) unsafe fn batch_get(
    client: *mut kv_client,
    (keys, key_lens): (*const *const c_char, *const usize),
    (values, value_lens): (*mut *mut c_void, *mut usize),
    count: c_int,
    get: impl FnOnce(&Client, &[&[u8]], &mut dyn FnMut(usize, Result<(&[u8], u64), KvError>)),
) -> c_int {
    with_client(client, |c| {
        let n = match batch_len(
            count,
            &[
                keys.is_null(),
                key_lens.is_null(),
                values.is_null(),
                value_lens.is_null(),
            ],
        ) {
            Ok(n) => n,
            Err(early) => return early,
        };
        let keys = std::slice::from_raw_parts(keys, n);
        let key_lens = std::slice::from_raw_parts(key_lens, n);
        let values = std::slice::from_raw_parts(values, n);
        let value_lens = std::slice::from_raw_parts_mut(value_lens, n);
        let ks: Result<Vec<&[u8]>, KvError> = keys
            .iter()
            .zip(key_lens)
            .map(|(&k, &l)| key(k, l))
            .collect();
        let Ok(ks) = ks else { return -1 };
        let mut ok = 0;
        get(c, &ks, &mut |i, r| {
            let Ok((v, _)) = r else { return };
            if v.len() > value_lens[i] || (values[i].is_null() && !v.is_empty()) {
                value_lens[i] = v.len();
                return;
            }
            if !v.is_empty() {
                // SAFETY: the caller's buffer holds `value_lens[i]` bytes.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(values[i].cast::<u8>(), v.len()) };
                crate::copy::copy(out, v);
            }
            value_lens[i] = v.len();
            ok += 1;
        });
        ok
    })
}

/// PUTs `count` pairs with several requests in flight; returns how many
/// succeeded (-1 for bad arguments).
///
/// # Safety
/// Each array holds `count` entries, valid as in `kv_client_put`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_batch_put(
    client: *mut kv_client,
    keys: *const *const c_char,
    key_lens: *const usize,
    values: *const *const c_void,
    value_lens: *const usize,
    count: c_int,
) -> c_int {
    guard_or(-1, || {
        with_client(client, |c| {
            let n = match batch_len(
                count,
                &[
                    keys.is_null(),
                    key_lens.is_null(),
                    values.is_null(),
                    value_lens.is_null(),
                ],
            ) {
                Ok(n) => n,
                Err(early) => return early,
            };
            let parse = || -> Result<Vec<Pair>, KvError> {
                (0..n)
                    .map(|i| {
                        Ok((
                            key(*keys.add(i), *key_lens.add(i))?,
                            bytes(*values.add(i), *value_lens.add(i))?,
                        ))
                    })
                    .collect()
            };
            let Ok(pairs) = parse() else { return -1 };
            let mut stored = 0;
            c.batch_put_with(&pairs, |_, r| stored += c_int::from(r.is_ok()));
            stored
        })
    })
}

/// The entry count of a batch call, or what the call returns at once: 0
/// for an empty batch, -1 for a negative count or a NULL array.
pub(super) fn batch_len(count: c_int, nulls: &[bool]) -> Result<usize, c_int> {
    match count {
        0 => Err(0),
        n if n < 0 || nulls.iter().any(|&null| null) => Err(-1),
        n => Ok(n as usize),
    }
}

/// A static English description of a `KV_*` code. Do not free it.
#[no_mangle]
pub extern "C" fn kv_strerror(code: c_int) -> *const c_char {
    let s: &'static CStr = match code {
        KV_OK => c"success",
        KV_ERR_NOT_FOUND => c"no such key",
        KV_ERR_EXISTS => c"the key exists",
        KV_ERR_CAS_FAILED => c"the version did not match",
        KV_ERR_KEY_TOO_LONG => c"the key is too long",
        KV_ERR_VALUE_TOO_LONG => c"the value is too long",
        KV_ERR_NO_MEMORY => c"the server has no memory",
        KV_ERR_INTERNAL => c"internal error",
        KV_ERR_INVALID_ARGUMENT => c"invalid argument",
        KV_ERR_DISCONNECTED => c"not connected",
        KV_ERR_TIMEOUT => c"timed out",
        KV_ERR_BUFFER_TOO_SMALL => c"the buffer is too small for the value",
        _ => c"unknown key-value result code",
    };
    s.as_ptr()
}
