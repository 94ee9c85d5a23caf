//! The globals legacy programs read and write, and how they and an options
//! struct become runtime options.

use std::ffi::c_int;
use std::ptr::addr_of;
use std::time::Duration;

use crate::runtime::{CommMode, Options, DEFAULT_RECV_BUF_LEN};

use super::types::*;

// The globals: programs read and write them directly; they are read when a
// connection or server is created.

/// Listen backlog.
#[no_mangle]
pub static mut rdmaListenBacklog: c_int = 128;
/// Address/route resolution timeout, and the bound of each connection-setup step.
#[no_mangle]
pub static mut rdmaTimeoutms: c_int = 1000;
/// Poll timeout of the runtime threads.
#[no_mangle]
pub static mut rdmaPollEventTimeoutms: c_int = 10;
/// Inline threshold (0: no inline).
#[no_mangle]
pub static mut rdmaMaxInlineData: c_int = 0;
#[no_mangle]
pub static mut rdmaRetryCount: c_int = 7;
/// RNR retry count (7: forever on the wire).
#[no_mangle]
pub static mut rdmaRnrRetryCount: c_int = 7;
/// Completions taken per poll.
#[no_mangle]
pub static mut rdmaMaxConcurrentWorkRequests: c_int = 128 + 2048 * 2;
/// Receives posted per connection.
#[no_mangle]
pub static mut rdmaRecvDepth: c_int = 1024;
/// Outstanding READs/atomics (0: the device's maximum).
#[no_mangle]
pub static mut rdmaMaxOutstandingRdAtomic: c_int = 0;
#[no_mangle]
pub static mut rdmaQp2CqMode: RdmaQpCqMapping = RdmaQpCqMapping::ONE_TO_ONE;
#[no_mangle]
pub static mut rdmaCommMode: RdmaCommMode = RdmaCommMode::RDMA_NON_BLOCKING;
/// Ask for physical-address access (unavailable on upstream rdma-core).
#[no_mangle]
pub static mut rdmaEnablePhysAddrAccess: bool = false;
/// CPU of the completion thread (-1: not pinned; 0 is a valid CPU).
#[no_mangle]
pub static mut rdmaIoAffinityCpuId: c_int = -1;

/// Reads a C-writable int-sized field or global without trusting it to hold
/// a valid Rust enum or bool.
pub(super) unsafe fn read_int<T>(p: *const T) -> c_int {
    std::ptr::read_volatile(p.cast::<c_int>())
}

pub(super) unsafe fn read_bool(p: *const bool) -> bool {
    std::ptr::read_volatile(p.cast::<u8>()) != 0
}

/// Turns a C options struct (NULL: all defaults) into runtime options; every
/// zero field takes the global's value.
pub(super) unsafe fn resolve_options(opt: *const RdmaOptions) -> Options {
    let pick = |field: *const c_int, global: *const c_int| -> c_int {
        let v = if field.is_null() { 0 } else { read_int(field) };
        if v != 0 {
            v
        } else {
            read_int(global)
        }
    };
    let f = |get: fn(*const RdmaOptions) -> *const c_int| {
        if opt.is_null() {
            std::ptr::null()
        } else {
            get(opt)
        }
    };
    let backlog = pick(
        f(|o| addr_of!((*o).rdma_listen_backlog)),
        addr_of!(rdmaListenBacklog),
    );
    let timeout = pick(
        f(|o| addr_of!((*o).rdma_timeoutms)),
        addr_of!(rdmaTimeoutms),
    );
    let tick = pick(
        f(|o| addr_of!((*o).rdma_poll_event_timeoutms)),
        addr_of!(rdmaPollEventTimeoutms),
    );
    let inline = pick(
        f(|o| addr_of!((*o).rdma_max_inline_data)),
        addr_of!(rdmaMaxInlineData),
    );
    let retry = pick(
        f(|o| addr_of!((*o).rdma_retry_count)),
        addr_of!(rdmaRetryCount),
    );
    let rnr = pick(
        f(|o| addr_of!((*o).rdma_rnr_retry_count)),
        addr_of!(rdmaRnrRetryCount),
    );
    let batch = pick(
        f(|o| addr_of!((*o).rdma_max_concurrent_work_requests)),
        addr_of!(rdmaMaxConcurrentWorkRequests),
    );
    let depth = pick(
        f(|o| addr_of!((*o).rdma_recv_depth)),
        addr_of!(rdmaRecvDepth),
    );
    let comm = pick(
        f(|o| addr_of!((*o).rdma_comm_mode).cast()),
        addr_of!(rdmaCommMode).cast(),
    );
    let rd = pick(
        f(|o| addr_of!((*o).rdma_max_outstanding_rd_atomic)),
        addr_of!(rdmaMaxOutstandingRdAtomic),
    );
    let cpu = pick(
        f(|o| addr_of!((*o).rdma_io_affinity_cpuid)),
        addr_of!(rdmaIoAffinityCpuId),
    );
    let pa = (!opt.is_null() && read_bool(addr_of!((*opt).rdma_enable_phys_addr_access)))
        || read_bool(addr_of!(rdmaEnablePhysAddrAccess));
    let defaults = Options::default();
    Options {
        listen_backlog: if backlog > 0 {
            backlog
        } else {
            defaults.listen_backlog
        },
        timeout: Duration::from_millis(if timeout > 0 { timeout as u64 } else { 1000 }),
        poll_event_timeout: Duration::from_millis(tick.clamp(1, 10_000) as u64),
        max_inline_data: inline.max(0) as u32,
        retry_count: retry.clamp(0, 7) as u8,
        rnr_retry_count: rnr.clamp(0, 7) as u8,
        max_concurrent_work_requests: if batch > 0 {
            batch as u32
        } else {
            defaults.max_concurrent_work_requests
        },
        recv_depth: if depth > 0 {
            depth as u32
        } else {
            defaults.recv_depth
        },
        comm_mode: if comm == RdmaCommMode::RDMA_BLOCKING as c_int {
            CommMode::Blocking
        } else {
            CommMode::NonBlocking
        },
        enable_phys_addr_access: pa,
        max_outstanding_rd_atomic: rd.max(0) as u32,
        io_affinity_cpu: usize::try_from(cpu).ok(),
        recv_buf_len: DEFAULT_RECV_BUF_LEN,
        spin: defaults.spin,
        // C callbacks run on the completion thread, as the legacy ones did.
        caller_polls: false,
        send_queue_bytes: defaults.send_queue_bytes,
        setup_deadline: defaults.setup_deadline,
    }
}
