//! Host tests: everything that needs no RDMA device.

use std::io;
use std::net::Ipv4Addr;
use std::time::Duration;

use snowrdma::verbs::{
    devices, CmEventKind, Context, Error, Gid, Mtu, QpInfo, RemoteRegion, WcStatus,
};

#[test]
fn qp_info_survives_the_wire_and_malformed_info_is_refused() {
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&[198, 18, 0, 1]);
    let info = QpInfo {
        qpn: 0x12_3456,
        psn: 0xab_cdef,
        lid: 7,
        gid: Gid(gid),
        mtu: Mtu(5),
    };
    let bytes = info.to_bytes();
    assert_eq!(QpInfo::from_bytes(&bytes).unwrap(), info);
    assert!(matches!(
        QpInfo::from_bytes(&bytes[..29]),
        Err(Error::InvalidArgument(_))
    ));
    let mut bad = bytes;
    bad[0] = 0xff; // QP numbers are 24 bits
    assert!(matches!(
        QpInfo::from_bytes(&bad),
        Err(Error::InvalidArgument(_))
    ));
    let mut bad_mtu = bytes;
    bad_mtu[29] = 9;
    assert!(matches!(
        QpInfo::from_bytes(&bad_mtu),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn remote_regions_survive_the_wire_and_offsets_are_checked() {
    let r = RemoteRegion {
        addr: 0x7f00_0000_1000,
        len: 4096,
        rkey: 0xdead_beef,
    };
    assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()).unwrap(), r);
    assert!(RemoteRegion::from_bytes(&[0; 3]).is_err());
    assert_eq!(r.at(16).addr, 0x7f00_0000_1010);
    assert_eq!(r.at(16).rkey, 0xdead_beef);
    assert!(std::panic::catch_unwind(|| r.at(4097)).is_err());
}

#[test]
fn ipv4_mapped_gids_give_their_address() {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&[198, 18, 0, 1]);
    let gid = Gid(g);
    assert_eq!(gid.to_ipv4(), Some(Ipv4Addr::new(198, 18, 0, 1)));
    assert_eq!(gid.to_string(), "::ffff:198.18.0.1");
    let mut link_local = [0u8; 16];
    link_local[0] = 0xfe;
    link_local[1] = 0x80;
    link_local[15] = 1;
    assert_eq!(Gid(link_local).to_ipv4(), None);
    assert!(Gid::default().is_zero());
}

#[test]
fn mtus_convert_to_bytes() {
    let bytes: Vec<u32> = (1..=5).map(|m| Mtu(m).bytes()).collect();
    assert_eq!(bytes, [256, 512, 1024, 2048, 4096]);
    assert_eq!(Mtu(0).bytes(), 0);
}

#[test]
fn errors_name_the_verb_and_the_reason() {
    let e = Error::Verb {
        verb: "ibv_reg_mr",
        source: io::Error::from_raw_os_error(libc::ENOMEM),
    };
    assert!(e.to_string().starts_with("ibv_reg_mr failed: "), "{e}");
    assert!(e.to_string().contains("Cannot allocate memory"), "{e}");
    assert_eq!(e.errno(), Some(libc::ENOMEM));

    let e = Error::Completion {
        wr_id: 9,
        status: WcStatus::REM_ACCESS_ERR,
        vendor_err: 0x11,
    };
    assert_eq!(e.completion_status(), Some(WcStatus::REM_ACCESS_ERR));
    assert!(e.to_string().contains("work request 9"), "{e}");
    assert!(e.to_string().contains("remote access error"), "{e}");

    let e = Error::CmEvent {
        expected: CmEventKind::ESTABLISHED,
        got: CmEventKind::REJECTED,
        status: 28,
    };
    let s = e.to_string();
    assert!(
        s.contains("RDMA_CM_EVENT_ESTABLISHED") && s.contains("RDMA_CM_EVENT_REJECTED"),
        "{s}"
    );
    assert!(s.contains("reject reason 28"), "{s}");
    let e = Error::CmEvent {
        expected: CmEventKind::ADDR_RESOLVED,
        got: CmEventKind::ADDR_ERROR,
        status: -110,
    };
    assert!(e.to_string().contains("timed out"), "{e}");

    let e = Error::Timeout {
        what: "a work completion",
        timeout: Duration::from_millis(250),
    };
    assert!(e.is_timeout());
    assert_eq!(
        e.to_string(),
        "timed out after 250ms waiting for a work completion"
    );
}

#[test]
fn listing_devices_never_fails_for_lack_of_rdma() {
    // On a host without RDMA support this is an empty list, not an error.
    devices().unwrap();
}

#[test]
fn opening_a_device_that_does_not_exist_names_it() {
    let err = Context::open(Some("no-such-device0")).unwrap_err();
    assert!(
        matches!(&err, Error::NoSuchDevice(n) if n == "no-such-device0"),
        "{err}"
    );
}
