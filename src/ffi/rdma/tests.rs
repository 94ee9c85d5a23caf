use std::time::Duration;

use crate::runtime::CommMode;

use super::globals::resolve_options;
use super::*;

#[test]
fn zero_fields_take_the_globals_and_set_fields_are_honoured() {
    // SAFETY: all-zero is the `RdmaConnOptions opt = {0};` of C programs.
    let mut opt: RdmaOptions = unsafe { std::mem::zeroed() };
    let defaults = unsafe { resolve_options(&opt) };
    assert_eq!(defaults, unsafe { resolve_options(std::ptr::null()) });
    assert_eq!(defaults.timeout, Duration::from_millis(1000));
    assert_eq!(defaults.recv_depth, 1024);
    assert_eq!(defaults.comm_mode, CommMode::NonBlocking);
    assert_eq!(defaults.io_affinity_cpu, None);

    opt.rdma_timeoutms = 2500;
    opt.rdma_recv_depth = 64;
    opt.rdma_io_affinity_cpuid = 1;
    opt.rdma_rnr_retry_count = 3;
    let set = unsafe { resolve_options(&opt) };
    assert_eq!(set.timeout, Duration::from_millis(2500));
    assert_eq!(set.recv_depth, 64);
    assert_eq!(set.io_affinity_cpu, Some(1));
    assert_eq!(set.rnr_retry_count, 3);

    // A program that sets a global changes the default of zero fields;
    // CPU 0 is chosen through the global (a zero field means "default").
    unsafe {
        rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
        rdmaIoAffinityCpuId = 0;
    }
    let from_globals = unsafe { resolve_options(std::ptr::null()) };
    unsafe {
        rdmaCommMode = RdmaCommMode::RDMA_NON_BLOCKING;
        rdmaIoAffinityCpuId = -1;
    }
    assert_eq!(from_globals.comm_mode, CommMode::Blocking);
    assert_eq!(from_globals.io_affinity_cpu, Some(0));
}

#[test]
fn unknown_handles_are_refused_without_being_touched() {
    let mut junk = [0u8; 512];
    let fake = junk.as_mut_ptr().cast::<RdmaConn>();
    unsafe {
        assert_eq!(rdmaConnSend(fake, junk.as_mut_ptr().cast(), 4), usize::MAX);
        assert_eq!(rdmaConnSetRecvCallback(fake, None), RDMA_ERR);
        assert_eq!(rdmaSyncReadSignaled(fake, 0, 0, 0, 0, 8), RDMA_ERR);
        assert!(rdmaConnRegMem(std::ptr::null_mut(), 8).is_null());
        rdmaConnClose(fake);
        assert_eq!(rdmaServerStop(junk.as_mut_ptr().cast()), RDMA_ERR);
        assert_eq!(rdmaPAReadSignaled(fake, 0, 0, 0, 8), RDMA_ERR);
    }
    assert!(
        junk.iter().all(|&b| b == 0),
        "nothing was written through the bad pointer"
    );
}
