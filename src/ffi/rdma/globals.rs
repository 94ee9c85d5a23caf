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
/// Messages up to this many bytes are posted inline. 0: the library picks
/// (128 bytes where the device takes them, else none); what a peer
/// receives is the same either way.
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

/// Reads a global C programs write, without trusting it to hold a valid
/// Rust enum or bool.
pub(super) unsafe fn read_int<T>(p: *const T) -> c_int {
    std::ptr::read_volatile(p.cast::<c_int>())
}

pub(super) unsafe fn read_bool(p: *const bool) -> bool {
    std::ptr::read_volatile(p.cast::<u8>()) != 0
}

/// Copies an options struct from C field by field, each read as the
/// integer C stored (the struct may be unaligned): enum fields holding an
/// unknown value count as unset (0), the bool is any nonzero byte. No Rust
/// value is ever made from C bytes that may not be one.
pub(super) unsafe fn copy_options(p: *const RdmaOptions) -> RdmaOptions {
    let int = |f: *const c_int| f.read_unaligned();
    let qp2cq = int(addr_of!((*p).rdma_qp2cq_mode).cast());
    let comm = int(addr_of!((*p).rdma_comm_mode).cast());
    RdmaOptions {
        rdma_listen_backlog: int(addr_of!((*p).rdma_listen_backlog)),
        rdma_timeoutms: int(addr_of!((*p).rdma_timeoutms)),
        rdma_poll_event_timeoutms: int(addr_of!((*p).rdma_poll_event_timeoutms)),
        rdma_max_inline_data: int(addr_of!((*p).rdma_max_inline_data)),
        rdma_retry_count: int(addr_of!((*p).rdma_retry_count)),
        rdma_rnr_retry_count: int(addr_of!((*p).rdma_rnr_retry_count)),
        rdma_max_concurrent_work_requests: int(addr_of!((*p).rdma_max_concurrent_work_requests)),
        rdma_recv_depth: int(addr_of!((*p).rdma_recv_depth)),
        rdma_qp2cq_mode: if qp2cq == RdmaQpCqMapping::MANY_TO_ONE as c_int {
            RdmaQpCqMapping::MANY_TO_ONE
        } else {
            RdmaQpCqMapping::ONE_TO_ONE
        },
        rdma_comm_mode: if comm == RdmaCommMode::RDMA_NON_BLOCKING as c_int {
            RdmaCommMode::RDMA_NON_BLOCKING
        } else {
            RdmaCommMode::RDMA_BLOCKING
        },
        rdma_enable_phys_addr_access: addr_of!((*p).rdma_enable_phys_addr_access)
            .cast::<u8>()
            .read_unaligned()
            != 0,
        rdma_max_outstanding_rd_atomic: int(addr_of!((*p).rdma_max_outstanding_rd_atomic)),
        rdma_io_affinity_cpuid: int(addr_of!((*p).rdma_io_affinity_cpuid)),
        // Any pointer-sized value is a valid optional function pointer.
        recv_callback: addr_of!((*p).recv_callback).read_unaligned(),
        write_callback: addr_of!((*p).write_callback).read_unaligned(),
        read_callback: addr_of!((*p).read_callback).read_unaligned(),
        connected_callback: addr_of!((*p).connected_callback).read_unaligned(),
        disconnect_callback: addr_of!((*p).disconnect_callback).read_unaligned(),
        accept_callback: addr_of!((*p).accept_callback).read_unaligned(),
    }
}

/// All fields unset: the `{0}` of C programs.
pub(super) fn unset_options() -> RdmaOptions {
    // SAFETY: all-zero is valid (zero ints, the 0 enum values, false, None).
    unsafe { std::mem::zeroed() }
}

/// Turns a C options struct (NULL: all defaults) into runtime options; every
/// zero field takes the global's value.
pub(super) unsafe fn resolve_options(opt: *const RdmaOptions) -> Options {
    let o = if opt.is_null() {
        unset_options()
    } else {
        copy_options(opt)
    };
    let pick = |v: c_int, global: *const c_int| if v != 0 { v } else { read_int(global) };
    let backlog = pick(o.rdma_listen_backlog, addr_of!(rdmaListenBacklog));
    let timeout = pick(o.rdma_timeoutms, addr_of!(rdmaTimeoutms));
    let tick = pick(
        o.rdma_poll_event_timeoutms,
        addr_of!(rdmaPollEventTimeoutms),
    );
    let inline = pick(o.rdma_max_inline_data, addr_of!(rdmaMaxInlineData));
    let retry = pick(o.rdma_retry_count, addr_of!(rdmaRetryCount));
    let rnr = pick(o.rdma_rnr_retry_count, addr_of!(rdmaRnrRetryCount));
    let batch = pick(
        o.rdma_max_concurrent_work_requests,
        addr_of!(rdmaMaxConcurrentWorkRequests),
    );
    let depth = pick(o.rdma_recv_depth, addr_of!(rdmaRecvDepth));
    let comm = pick(o.rdma_comm_mode as c_int, addr_of!(rdmaCommMode).cast());
    let rd = pick(
        o.rdma_max_outstanding_rd_atomic,
        addr_of!(rdmaMaxOutstandingRdAtomic),
    );
    let cpu = pick(o.rdma_io_affinity_cpuid, addr_of!(rdmaIoAffinityCpuId));
    let pa = o.rdma_enable_phys_addr_access || read_bool(addr_of!(rdmaEnablePhysAddrAccess));
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
        nap: defaults.nap,
        // C callbacks run on the completion thread, as the legacy ones did.
        caller_polls: false,
        send_queue_bytes: defaults.send_queue_bytes,
        setup_deadline: defaults.setup_deadline,
        max_setups: defaults.max_setups,
        protocol_version: defaults.protocol_version,
    }
}
