//! The verbs layer on a real device.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use snowrdma::verbs::selftest::{ConnectMode, Endpoint, LoopbackPair, Op};
use snowrdma::verbs::{
    AccessFlags, CmEventKind, CmId, Completion, ConnParam, Error, QpState, SendOp, SendRequest,
    WcOpcode, WcStatus,
};

use crate::{ctx, device_ip, TIMEOUT};

const SIZES: [usize; 4] = [1, 64, 4096, 1 << 20];

fn pair(mode: ConnectMode) -> LoopbackPair {
    LoopbackPair::connect(&ctx(), mode, 1 << 20, TIMEOUT)
        .unwrap_or_else(|e| panic!("connecting a {mode} pair: {e}"))
}

fn check_all_sizes(mode: ConnectMode, op: Op) {
    let mut pair = pair(mode);
    let sizes: &[usize] = if op.is_atomic() { &[8] } else { &SIZES };
    for &size in sizes {
        pair.verify(op, size)
            .unwrap_or_else(|e| panic!("{op} of {size} B over a {mode} pair: {e}"));
    }
}

macro_rules! op_tests {
    ($($name:ident: $mode:ident, $op:ident;)*) => {$(
        #[test]
        #[ignore = "needs an RDMA device: run `make test`"]
        fn $name() {
            check_all_sizes(ConnectMode::$mode, Op::$op);
        }
    )*};
}

op_tests! {
    cm_send: RdmaCm, Send;
    cm_send_with_imm: RdmaCm, SendWithImm;
    cm_write: RdmaCm, Write;
    cm_write_with_imm: RdmaCm, WriteWithImm;
    cm_read: RdmaCm, Read;
    cm_compare_swap: RdmaCm, CompareSwap;
    cm_fetch_add: RdmaCm, FetchAdd;
    manual_send: Manual, Send;
    manual_send_with_imm: Manual, SendWithImm;
    manual_write: Manual, Write;
    manual_write_with_imm: Manual, WriteWithImm;
    manual_read: Manual, Read;
    manual_compare_swap: Manual, CompareSwap;
    manual_fetch_add: Manual, FetchAdd;
}

/// Posts one request from `a` to `b`'s buffer and waits for its completion,
/// failed or not.
fn post_and_wait(pair: &mut LoopbackPair, op: SendOp, len: usize) -> Completion {
    let sge = pair.a.mr.sge(..len);
    unsafe {
        pair.a
            .qp
            .post_send(&[SendRequest::new(1, op, std::slice::from_ref(&sge))])
            .unwrap()
    };
    let mut wc = [Completion::default()];
    pair.a.send_cq.wait(&mut wc, TIMEOUT).unwrap();
    let [wc] = wc;
    wc
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_failed_compare_swap_returns_the_current_value_and_changes_nothing() {
    let mut pair = pair(ConnectMode::Manual);
    pair.b.mr.as_mut_slice()[..8].copy_from_slice(&77u64.to_ne_bytes());
    let remote = pair.b.mr.remote().at(0);
    let wc = post_and_wait(
        &mut pair,
        SendOp::CompareSwap {
            remote,
            compare: 5,
            swap: 9,
        },
        8,
    );
    assert!(wc.is_ok(), "{wc:?}");
    assert_eq!(wc.opcode(), WcOpcode::COMP_SWAP);
    assert_eq!(
        u64::from_ne_bytes(pair.a.mr.as_slice()[..8].try_into().unwrap()),
        77
    );
    assert_eq!(
        u64::from_ne_bytes(pair.b.mr.as_slice()[..8].try_into().unwrap()),
        77
    );
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn unsignaled_writes_complete_with_the_next_signaled_one() {
    let mut pair = pair(ConnectMode::RdmaCm);
    let n = 8;
    let chunk = 4096;
    for (i, b) in pair.a.mr.as_mut_slice()[..n * chunk].iter_mut().enumerate() {
        *b = (i / chunk) as u8 + 1;
    }
    let sges: Vec<_> = (0..n)
        .map(|i| pair.a.mr.sge(i * chunk..(i + 1) * chunk))
        .collect();
    let remote = pair.b.mr.remote();
    let reqs: Vec<_> = (0..n)
        .map(|i| {
            let req = SendRequest::new(
                i as u64,
                SendOp::Write(remote.at((i * chunk) as u64)),
                &sges[i..i + 1],
            );
            if i + 1 == n {
                req
            } else {
                req.unsignaled()
            }
        })
        .collect();
    unsafe { pair.a.qp.post_send(&reqs).unwrap() };
    let wc = pair.a.send_cq.wait_one(TIMEOUT).unwrap();
    assert_eq!(
        wc.wr_id(),
        (n - 1) as u64,
        "only the signaled request completes"
    );
    let mut more = [Completion::default()];
    assert_eq!(
        pair.a.send_cq.poll(&mut more).unwrap(),
        0,
        "unsignaled requests made completions"
    );
    assert_eq!(
        pair.a.mr.as_slice()[..n * chunk],
        pair.b.mr.as_slice()[..n * chunk]
    );
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn read_with_a_wrong_rkey_fails_with_remote_access_error() {
    let mut pair = pair(ConnectMode::Manual);
    let mut remote = pair.b.mr.remote().at(0);
    remote.rkey ^= 0x5a5a;
    let wc = post_and_wait(&mut pair, SendOp::Read(remote), 64);
    assert_eq!(wc.status(), WcStatus::REM_ACCESS_ERR, "{wc:?}");
    let err = wc.into_result().unwrap_err();
    assert_eq!(err.completion_status(), Some(WcStatus::REM_ACCESS_ERR));
    assert!(err.to_string().contains("remote access error"), "{err}");
    assert_eq!(pair.a.qp.state().unwrap(), QpState::ERR);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn write_with_a_wrong_rkey_fails_and_changes_nothing() {
    let mut pair = pair(ConnectMode::RdmaCm);
    pair.a.mr.as_mut_slice()[..64].fill(0xee);
    let mut remote = pair.b.mr.remote().at(0);
    remote.rkey = remote.rkey.wrapping_add(0x100);
    let wc = post_and_wait(&mut pair, SendOp::Write(remote), 64);
    assert_eq!(wc.status(), WcStatus::REM_ACCESS_ERR, "{wc:?}");
    assert!(pair.b.mr.as_slice()[..64].iter().all(|&b| b == 0));
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn write_beyond_the_remote_region_fails() {
    let mut pair = pair(ConnectMode::Manual);
    let remote = pair.b.mr.remote().at(pair.b.mr.len() as u64 - 32);
    let wc = post_and_wait(&mut pair, SendOp::Write(remote), 64);
    assert_eq!(wc.status(), WcStatus::REM_ACCESS_ERR, "{wc:?}");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_send_without_a_posted_receive_fails_instead_of_hanging() {
    // rnr_retry is finite by default, so the sender gives up.
    let mut pair = pair(ConnectMode::Manual);
    let start = Instant::now();
    let wc = post_and_wait(&mut pair, SendOp::Send, 64);
    assert_eq!(wc.status(), WcStatus::RNR_RETRY_EXC_ERR, "{wc:?}");
    assert!(start.elapsed() < TIMEOUT);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn atomics_refuse_misaligned_targets_and_wrong_sizes_before_posting() {
    let pair = pair(ConnectMode::Manual);
    let sge = pair.a.mr.sge(..8);
    let odd = pair.b.mr.remote().at(4);
    let err = unsafe {
        pair.a.qp.post_send(&[SendRequest::new(
            1,
            SendOp::FetchAdd {
                remote: odd,
                add: 1,
            },
            &[sge],
        )])
    }
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let wide = pair.a.mr.sge(..16);
    let err = unsafe {
        pair.a.qp.post_send(&[SendRequest::new(
            1,
            SendOp::FetchAdd {
                remote: pair.b.mr.remote().at(0),
                add: 1,
            },
            &[wide],
        )])
    }
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(
        pair.a.qp.state().unwrap(),
        QpState::RTS,
        "nothing was posted"
    );
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn connecting_where_nothing_listens_fails_within_the_timeout() {
    let timeout = Duration::from_secs(3);
    let start = Instant::now();
    let dst = SocketAddr::new(IpAddr::V4(device_ip()), 1);
    let result = CmId::resolve(dst, None, timeout).and_then(|id| {
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(16, None)?;
        let _qp = id.create_qp(&pd, &cq, &cq, &Default::default())?;
        id.connect(&ConnParam::default())?;
        id.expect_event(CmEventKind::ESTABLISHED, timeout)
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, Error::CmEvent { got, .. } if got == CmEventKind::REJECTED || got == CmEventKind::UNREACHABLE)
            || err.is_timeout(),
        "{err}"
    );
    assert!(
        start.elapsed() < timeout * 2 + Duration::from_secs(1),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn resolving_an_address_nobody_has_fails_within_the_timeout() {
    let ip = device_ip().octets();
    // Same subnet, a host that does not exist.
    let nobody = Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3].wrapping_add(100));
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let err = CmId::resolve(SocketAddr::new(IpAddr::V4(nobody), 7471), None, timeout)
        .and_then(|id| {
            id.connect(&ConnParam::default())?;
            id.expect_event(CmEventKind::ESTABLISHED, timeout)
        })
        .unwrap_err();
    assert!(
        start.elapsed() < timeout * 3 + Duration::from_secs(1),
        "took {:?}",
        start.elapsed()
    );
    assert!(!err.to_string().is_empty());
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn waiting_on_a_cq_with_nothing_posted_times_out() {
    let ctx = ctx();
    let channel = ctx.create_comp_channel().unwrap();
    for cq in [
        ctx.create_cq(4, Some(&channel)).unwrap(),
        ctx.create_cq(4, None).unwrap(),
    ] {
        let start = Instant::now();
        let err = cq.wait_one(Duration::from_millis(300)).unwrap_err();
        assert!(err.is_timeout(), "{err}");
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn private_data_travels_with_connect_and_accept() {
    let ip = device_ip();
    let listener = CmId::listen_on(SocketAddr::new(IpAddr::V4(ip), 0), 4).unwrap();
    let client = CmId::resolve(listener.local_addr().unwrap(), None, TIMEOUT).unwrap();
    let ctx = client.context().unwrap();
    let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(8, None).unwrap());
    let _cqp = client
        .create_qp(&pd, &cq, &cq, &Default::default())
        .unwrap();
    let hello = ConnParam {
        private_data: b"hello server".to_vec(),
        ..Default::default()
    };
    client.connect(&hello).unwrap();

    let (server, req) = listener.get_request(TIMEOUT).unwrap();
    assert_eq!(&req.private_data[..12], b"hello server");
    let sctx = server.context().unwrap();
    let (spd, scq) = (sctx.alloc_pd().unwrap(), sctx.create_cq(8, None).unwrap());
    let _sqp = server
        .create_qp(&spd, &scq, &scq, &Default::default())
        .unwrap();
    server
        .accept(&ConnParam {
            private_data: b"welcome".to_vec(),
            ..Default::default()
        })
        .unwrap();
    let est = client
        .expect_event(CmEventKind::ESTABLISHED, TIMEOUT)
        .unwrap();
    assert_eq!(&est.private_data[..7], b"welcome");
    server
        .expect_event(CmEventKind::ESTABLISHED, TIMEOUT)
        .unwrap();
    assert_eq!(server.peer_addr().unwrap().ip(), IpAddr::V4(ip));

    // The side that disconnects first hears back only when the peer answers
    // with a disconnect of its own.
    client.disconnect().unwrap();
    server
        .expect_event(CmEventKind::DISCONNECTED, TIMEOUT)
        .unwrap();
    server.disconnect().unwrap();
    client
        .expect_event(CmEventKind::DISCONNECTED, TIMEOUT)
        .unwrap();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn endpoints_connected_apart_learn_each_others_buffer_and_can_write_it() {
    let listener = CmId::listen_on(SocketAddr::new(IpAddr::V4(device_ip()), 0), 1).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        Endpoint::accept_from(&listener, 64, TIMEOUT, |_| Ok(())).unwrap()
    });
    let (client, lent) = Endpoint::connect_to(addr, 128, TIMEOUT, |_| Ok(())).unwrap();
    let (mut server, advertised) = server.join().unwrap();
    assert_eq!(lent, server.mr.remote());
    assert_eq!(advertised, Some(client.mr.remote()));

    let mut client = client;
    for (i, b) in client.mr.as_mut_slice()[..64].iter_mut().enumerate() {
        *b = i as u8 ^ 0x5a;
    }
    let sge = client.mr.sge(..64);
    unsafe {
        client
            .qp
            .post_send(&[SendRequest::new(1, SendOp::Write(lent.at(0)), &[sge])])
            .unwrap()
    };
    let mut wc = [Completion::default()];
    client.send_cq.wait(&mut wc, TIMEOUT).unwrap();
    let [wc] = wc;
    wc.into_result().expect("the write completes");
    let want: Vec<u8> = (0..64).map(|i| i as u8 ^ 0x5a).collect();
    assert_eq!(&server.mr.as_mut_slice()[..64], &want[..]);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn handles_keep_their_parents_alive_whatever_the_drop_order() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let mut mr = pd.allocate(4096, AccessFlags::all()).unwrap();
    let cq = ctx
        .create_cq(8, Some(&ctx.create_comp_channel().unwrap()))
        .unwrap();
    drop(ctx);
    drop(pd);
    mr.as_mut_slice()[0] = 1;
    assert_ne!(mr.lkey(), 0);
    // The PD behind the MR still works: a QP can be made in it.
    let qp = mr.pd().create_rc_qp(&cq, &cq, &Default::default()).unwrap();
    drop(cq);
    drop(mr);
    assert_eq!(qp.queue_pair().state().unwrap(), QpState::INIT);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn registration_checks_its_arguments() {
    let pd = ctx().alloc_pd().unwrap();
    let err = pd.allocate(4096, AccessFlags::REMOTE_WRITE).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = pd.allocate(0, AccessFlags::LOCAL_WRITE).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let mr = pd
        .allocate(100, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
        .unwrap();
    assert_eq!(mr.len(), 100);
    assert_eq!(mr.addr() % 4096, 0, "allocations are page-aligned");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn the_default_gid_is_the_ipv4_mapped_roce_v2_one() {
    let ctx = ctx();
    let index = ctx.default_gid_index(1).unwrap();
    let gid = ctx.query_gid(1, index).unwrap();
    assert_eq!(gid.to_ipv4(), Some(device_ip()));
}
