//! `kv_limits`: the server's limits against clients it does not control,
//! set beside the legacy `kv_config` (whose layout is fixed).

use std::ffi::c_int;
use std::ptr::addr_of;
use std::time::Duration;

use crate::ffi::boundary::guard_or;
use crate::kv::Limits;

use super::handles::{code, SERVERS};
use super::types::{kv_server, KV_ERR_INVALID_ARGUMENT, KV_OK};

#[allow(non_camel_case_types)]
/// A server's limits (see the README's Limits section). Start from
/// `kv_limits_default()` and change the fields you need; every field must
/// be positive, and `worker_queue` at most KV_MAX_WORKER_QUEUE.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kv_limits {
    /// Clients connected (or still connecting) at once; more are refused.
    pub max_connections: u64,
    /// Milliseconds a client has to finish connecting before it is dropped.
    pub setup_deadline_ms: u64,
    /// Bytes of replies that may wait for one client; beyond, it is
    /// disconnected.
    pub reply_queue_bytes: u64,
    /// Requests that may wait for each worker thread; beyond, new ones wait
    /// for room. At most KV_MAX_WORKER_QUEUE (each queue is allocated whole
    /// at start).
    pub worker_queue: u64,
    /// Requests of one client that may wait for its worker; beyond, they
    /// are answered KV_ERR_NO_MEMORY.
    pub client_jobs: u64,
    /// Bytes of values stored outside the memory pool; beyond, large PUTs
    /// are answered KV_ERR_NO_MEMORY.
    pub large_value_quota: u64,
    /// Bytes of values one client may hold leased; beyond, its oldest
    /// leases end.
    pub lease_bytes: u64,
    /// Milliseconds after which an unreleased lease ends.
    pub lease_time_ms: u64,
    // Its layout is fixed: programs built against it are not rebuilt.
    // A new limit gets its own getter and setter (kv_server_set_target_bytes).
}

// The size programs were built against (released 2026-11 at 64 bytes).
const _: () = assert!(std::mem::size_of::<kv_limits>() == 64);

fn to_c(l: &Limits) -> kv_limits {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    kv_limits {
        max_connections: l.max_connections as u64,
        setup_deadline_ms: ms(l.setup_deadline),
        reply_queue_bytes: l.reply_queue_bytes as u64,
        worker_queue: l.worker_queue as u64,
        client_jobs: l.client_jobs as u64,
        large_value_quota: l.large_value_quota,
        lease_bytes: l.lease_bytes,
        lease_time_ms: ms(l.lease_time),
    }
}

/// Reads `*p` one field at a time (no Rust value is made from the C bytes
/// as a whole) over the limits it has fields for; the others (those set
/// by their own calls) are kept. Sizes that do not fit this machine are
/// clamped.
///
/// # Safety
/// `p` must point to a readable `kv_limits`.
unsafe fn from_c(p: *const kv_limits, others: &Limits) -> Limits {
    let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    Limits {
        max_connections: size(addr_of!((*p).max_connections).read_unaligned()),
        setup_deadline: Duration::from_millis(addr_of!((*p).setup_deadline_ms).read_unaligned()),
        reply_queue_bytes: size(addr_of!((*p).reply_queue_bytes).read_unaligned()),
        worker_queue: size(addr_of!((*p).worker_queue).read_unaligned()),
        client_jobs: size(addr_of!((*p).client_jobs).read_unaligned()),
        large_value_quota: addr_of!((*p).large_value_quota).read_unaligned(),
        lease_bytes: addr_of!((*p).lease_bytes).read_unaligned(),
        lease_time: Duration::from_millis(addr_of!((*p).lease_time_ms).read_unaligned()),
        target_bytes: others.target_bytes,
        host_connections: others.host_connections,
    }
}

/// The default limits.
#[no_mangle]
pub extern "C" fn kv_limits_default() -> kv_limits {
    to_c(&Limits::default())
}

/// Sets a server's limits (`limits` is copied; the limits with their own
/// setters, such as `kv_server_set_target_bytes`, are kept). Connection,
/// request, quota and lease limits apply at once; `setup_deadline_ms`,
/// `reply_queue_bytes` and `worker_queue` from the next `kv_server_start`.
/// Returns KV_OK, or KV_ERR_INVALID_ARGUMENT for a NULL or unknown handle,
/// a NULL `limits`, a zero field or a `worker_queue` over
/// KV_MAX_WORKER_QUEUE.
///
/// # Safety
/// A non-NULL `limits` must point to a `kv_limits`.
#[no_mangle]
pub unsafe extern "C" fn kv_server_set_limits(
    server: *mut kv_server,
    limits: *const kv_limits,
) -> c_int {
    guard_or(KV_ERR_INVALID_ARGUMENT, || {
        if limits.is_null() {
            return KV_ERR_INVALID_ARGUMENT;
        }
        let Some(s) = SERVERS.get(server) else {
            return KV_ERR_INVALID_ARGUMENT;
        };
        code(s.update_limits(|l| *l = from_c(limits, l)))
    })
}

/// Sets the bytes of values one client may hold in write targets (large
/// PUTs under way, asked for and not yet stored; default 2 GiB); beyond,
/// its next large PUT is answered KV_ERR_NO_MEMORY. A client holding
/// none always gets one. Applies at once. Returns KV_OK, or
/// KV_ERR_INVALID_ARGUMENT for a NULL or unknown handle or a zero `bytes`.
#[no_mangle]
pub extern "C" fn kv_server_set_target_bytes(server: *mut kv_server, bytes: u64) -> c_int {
    guard_or(KV_ERR_INVALID_ARGUMENT, || {
        let Some(s) = SERVERS.get(server) else {
            return KV_ERR_INVALID_ARGUMENT;
        };
        code(s.update_limits(|l| l.target_bytes = bytes))
    })
}

/// Writes a server's write-target share (see `kv_server_set_target_bytes`)
/// to `*out`; KV_ERR_INVALID_ARGUMENT for a NULL or unknown handle or a
/// NULL `out`.
///
/// # Safety
/// A non-NULL `out` must point to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn kv_server_get_target_bytes(
    server: *const kv_server,
    out: *mut u64,
) -> c_int {
    read_out(server, out, |l| l.target_bytes)
}

/// Sets how many clients from one IP address may be connected (or setting
/// up) at once (default UINT64_MAX: no limit besides `max_connections`);
/// beyond, a new one from that address is refused at once, as past
/// `max_connections`. Each client has its own shares (queued requests,
/// leases, write targets), so this bounds what one host takes by opening
/// many connections. Applies to the next client. Returns KV_OK, or
/// KV_ERR_INVALID_ARGUMENT for a NULL or unknown handle or a zero `count`.
#[no_mangle]
pub extern "C" fn kv_server_set_host_connections(server: *mut kv_server, count: u64) -> c_int {
    guard_or(KV_ERR_INVALID_ARGUMENT, || {
        let Some(s) = SERVERS.get(server) else {
            return KV_ERR_INVALID_ARGUMENT;
        };
        let count = usize::try_from(count).unwrap_or(usize::MAX);
        code(s.update_limits(|l| l.host_connections = count))
    })
}

/// Writes a server's clients-per-address limit (see
/// `kv_server_set_host_connections`) to `*out`; KV_ERR_INVALID_ARGUMENT
/// for a NULL or unknown handle or a NULL `out`.
///
/// # Safety
/// A non-NULL `out` must point to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn kv_server_get_host_connections(
    server: *const kv_server,
    out: *mut u64,
) -> c_int {
    read_out(server, out, |l| l.host_connections as u64)
}

/// Writes what `pick` takes of a server's limits to `*out`.
///
/// # Safety
/// A non-NULL `out` must point to writable memory for a `T`.
unsafe fn read_out<T>(
    server: *const kv_server,
    out: *mut T,
    pick: impl FnOnce(&Limits) -> T,
) -> c_int {
    guard_or(KV_ERR_INVALID_ARGUMENT, || {
        let Some(s) = SERVERS.get(server) else {
            return KV_ERR_INVALID_ARGUMENT;
        };
        if out.is_null() {
            return KV_ERR_INVALID_ARGUMENT;
        }
        out.write_unaligned(pick(&s.limits()));
        KV_OK
    })
}

/// The limits a server has now; KV_ERR_INVALID_ARGUMENT for a NULL or
/// unknown handle or a NULL `out`.
///
/// # Safety
/// A non-NULL `out` must point to writable memory for a `kv_limits`.
#[no_mangle]
pub unsafe extern "C" fn kv_server_get_limits(
    server: *const kv_server,
    out: *mut kv_limits,
) -> c_int {
    read_out(server, out, to_c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_go_to_c_and_back_and_bad_arguments_are_refused() {
        let c = kv_limits_default();
        // SAFETY: a valid kv_limits.
        assert_eq!(unsafe { from_c(&c, &Limits::default()) }, Limits::default());
        let none: *const kv_limits = std::ptr::null();
        // SAFETY: NULL and unknown pointers are what is being tested.
        unsafe {
            assert_eq!(
                kv_server_set_limits(std::ptr::null_mut(), &c),
                KV_ERR_INVALID_ARGUMENT
            );
            let bogus = 8usize as *mut kv_server;
            assert_eq!(kv_server_set_limits(bogus, none), KV_ERR_INVALID_ARGUMENT);
            assert_eq!(kv_server_set_limits(bogus, &c), KV_ERR_INVALID_ARGUMENT);
            assert_eq!(
                kv_server_set_target_bytes(bogus, 1),
                KV_ERR_INVALID_ARGUMENT
            );
            let mut bytes = 0;
            assert_eq!(
                kv_server_get_target_bytes(bogus, &mut bytes),
                KV_ERR_INVALID_ARGUMENT
            );
            assert_eq!(
                kv_server_set_host_connections(bogus, 1),
                KV_ERR_INVALID_ARGUMENT
            );
            assert_eq!(
                kv_server_get_host_connections(bogus, &mut bytes),
                KV_ERR_INVALID_ARGUMENT
            );
            let mut out = c;
            assert_eq!(
                kv_server_get_limits(bogus, &mut out),
                KV_ERR_INVALID_ARGUMENT
            );
        }
    }

    #[test]
    fn a_server_takes_limits_from_c_and_refuses_a_zero_one() {
        use crate::ffi::kv::{kv_server_create, kv_server_destroy};
        // SAFETY: NULL config: defaults (the pool is mapped, not touched).
        let server = unsafe { kv_server_create(std::ptr::null()) };
        assert!(!server.is_null());
        let mut limits = kv_limits_default();
        limits.max_connections = 3;
        limits.lease_time_ms = 1500;
        let mut out = kv_limits_default();
        let mut target_bytes = 0;
        // SAFETY: valid pointers to kv_limits and u64.
        let mut host_connections = 0;
        unsafe {
            assert_eq!(kv_server_set_target_bytes(server, 5 << 20), KV_OK);
            assert_eq!(kv_server_set_host_connections(server, 2), KV_OK);
            assert_eq!(kv_server_set_limits(server, &limits), KV_OK);
            assert_eq!(kv_server_get_limits(server, &mut out), KV_OK);
            assert_eq!(kv_server_get_target_bytes(server, &mut target_bytes), KV_OK);
            assert_eq!(
                kv_server_get_host_connections(server, &mut host_connections),
                KV_OK
            );
            assert_eq!(
                (
                    out.max_connections,
                    out.lease_time_ms,
                    target_bytes,
                    host_connections
                ),
                (3, 1500, 5 << 20, 2),
                "set_limits keeps the limits it has no field for"
            );
            assert_eq!(
                kv_server_set_host_connections(server, 0),
                KV_ERR_INVALID_ARGUMENT
            );
            assert_eq!(
                kv_server_set_target_bytes(server, 0),
                KV_ERR_INVALID_ARGUMENT
            );
            assert_eq!(
                kv_server_get_target_bytes(server, std::ptr::null_mut()),
                KV_ERR_INVALID_ARGUMENT
            );
            assert_eq!(kv_server_get_target_bytes(server, &mut target_bytes), KV_OK);
            assert_eq!(target_bytes, 5 << 20, "unchanged");
            let zero = kv_limits {
                client_jobs: 0,
                ..limits
            };
            assert_eq!(kv_server_set_limits(server, &zero), KV_ERR_INVALID_ARGUMENT);
            assert_eq!(kv_server_get_limits(server, &mut out), KV_OK);
            assert_eq!(out.client_jobs, limits.client_jobs, "unchanged");
        }
        kv_server_destroy(server);
    }

    #[test]
    fn a_worker_queue_past_the_maximum_is_refused_before_it_is_allocated() {
        use crate::ffi::kv::{kv_server_create, kv_server_destroy};
        use crate::kv::MAX_WORKER_QUEUE;
        // SAFETY: NULL config: defaults (the pool is mapped, not touched).
        let server = unsafe { kv_server_create(std::ptr::null()) };
        assert!(!server.is_null());
        let most = kv_limits {
            worker_queue: MAX_WORKER_QUEUE as u64,
            ..kv_limits_default()
        };
        let mut out = kv_limits_default();
        // SAFETY: valid pointers to kv_limits.
        unsafe {
            assert_eq!(kv_server_set_limits(server, &most), KV_OK);
            for too_deep in [MAX_WORKER_QUEUE as u64 + 1, u64::MAX] {
                let limits = kv_limits {
                    worker_queue: too_deep,
                    ..most
                };
                assert_eq!(
                    kv_server_set_limits(server, &limits),
                    KV_ERR_INVALID_ARGUMENT,
                    "{too_deep}"
                );
            }
            assert_eq!(kv_server_get_limits(server, &mut out), KV_OK);
            assert_eq!(out.worker_queue, most.worker_queue, "unchanged");
        }
        kv_server_destroy(server);
    }
}
