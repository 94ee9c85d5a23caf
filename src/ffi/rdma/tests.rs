use std::time::Duration;

use crate::runtime::{CommMode, ConnKind, ConnState};

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

#[test]
fn a_closed_connection_stays_dead_while_new_ones_are_made() {
    unsafe {
        let dead = rdmaConn(std::ptr::null());
        assert!(!dead.is_null());
        rdmaConnClose(dead);
        // Half the quarantine: other tests in this process make connections too.
        for i in 0..crate::ffi::table::QUARANTINE / 2 {
            let c = rdmaConn(std::ptr::null());
            assert_ne!(c, dead, "connection {i} after the close got its address");
            assert_eq!(rdmaConnSetRecvCallback(dead, None), RDMA_ERR);
            rdmaConnClose(c);
        }
        // Still readable, as a program that kept it finds it.
        assert_eq!((*dead).r#type, ConnKind::ConnectedConn);
    }
}

#[test]
fn lengths_no_object_can_have_are_refused_before_any_slice_is_made() {
    let mut junk = [0u8; 16];
    let fake = junk.as_mut_ptr().cast::<RdmaConn>();
    let data = junk.as_mut_ptr().cast();
    unsafe {
        assert_eq!(rdmaConnSend(fake, data, usize::MAX), usize::MAX);
        assert_eq!(rdmaConnWrite(fake, data, usize::MAX), usize::MAX);
        assert_eq!(rdmaConnWriteWithImm(fake, 1, data, usize::MAX), RDMA_ERR);
        assert_eq!(
            crate::ffi::snowrdma_device_name(0, data.cast(), usize::MAX),
            crate::ffi::snowrdma_result::SNOWRDMA_ERR_INVALID_ARGUMENT
        );
    }
}

#[test]
fn options_are_read_field_by_field_from_unaligned_memory_with_bad_enums() {
    // An options struct at an odd address, with enum and bool fields
    // holding values no Rust enum or bool has.
    let mut bytes = vec![0u8; std::mem::size_of::<RdmaOptions>() + 1];
    let p = unsafe { bytes.as_mut_ptr().add(1) }.cast::<RdmaOptions>();
    unsafe {
        std::ptr::addr_of_mut!((*p).rdma_timeoutms).write_unaligned(2500);
        std::ptr::addr_of_mut!((*p).rdma_comm_mode)
            .cast::<i32>()
            .write_unaligned(7);
        std::ptr::addr_of_mut!((*p).rdma_qp2cq_mode)
            .cast::<i32>()
            .write_unaligned(-3);
        std::ptr::addr_of_mut!((*p).rdma_enable_phys_addr_access)
            .cast::<u8>()
            .write(2);
        let o = resolve_options(p);
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert_eq!(o.comm_mode, CommMode::NonBlocking, "unknown: the default");
        assert!(o.enable_phys_addr_access);
        let c = rdmaConn(p);
        assert!(!c.is_null());
        assert_eq!((*c).options.rdma_comm_mode as i32, 0, "stored as unset");
        assert_eq!((*c).options.rdma_qp2cq_mode, RdmaQpCqMapping::ONE_TO_ONE);
        assert!((*c).options.rdma_enable_phys_addr_access);
        rdmaConnClose(c);
    }
}

#[test]
fn connect_failures_set_errno() {
    unsafe {
        *libc::__errno_location() = 0;
        assert_eq!(
            rdmaConnect(std::ptr::null_mut(), c"1.2.3.4".as_ptr().cast_mut(), 1),
            RDMA_ERR
        );
        assert_eq!(*libc::__errno_location(), libc::EINVAL);
        let c = rdmaConn(std::ptr::null());
        *libc::__errno_location() = 0;
        assert_eq!(rdmaConnect(c, c"1.2.3.4".as_ptr().cast_mut(), -1), RDMA_ERR);
        assert_eq!(*libc::__errno_location(), libc::EINVAL, "bad port");
        assert_eq!((*c).state, ConnState::Error);
        assert_eq!((*c).last_errno, libc::EINVAL);
        rdmaConnClose(c);
    }
}
