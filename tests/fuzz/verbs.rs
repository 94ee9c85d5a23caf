//! What two sides exchange to connect without the CM (socket mode): the
//! queue pair's address and a registered region.

use proptest::prelude::*;
use snowrdma::verbs::{Gid, Mtu, QpInfo, RemoteRegion, QP_INFO_WIRE_LEN, REMOTE_REGION_WIRE_LEN};

use crate::corpus::{self, Input};

fn qp_info_inputs() -> Vec<Input> {
    let mut gid = [0u8; 16];
    gid[10..12].fill(0xff);
    gid[12..].copy_from_slice(&[198, 18, 0, 1]);
    let info = QpInfo {
        qpn: 0x12_3456,
        psn: 0xab_cdef,
        lid: 7,
        gid: Gid(gid),
        mtu: Mtu(5),
    }
    .to_bytes();
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = info;
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b.to_vec()
    };
    let mut oversize = info.to_vec();
    oversize.push(0);
    corpus::load(
        "verbs_qp_info",
        &[
            ("ok-roce", info.to_vec()),
            (
                "ok-largest",
                patch(0, &[0, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0xff, 0xff, 0xff]),
            ),
            ("bad-empty", Vec::new()),
            ("bad-truncated", info[..QP_INFO_WIRE_LEN - 1].to_vec()),
            ("bad-oversize", oversize),
            ("bad-qpn_25_bits", patch(0, &[1])),
            ("bad-psn_25_bits", patch(4, &[1])),
            ("bad-mtu_0", patch(26, &[0, 0, 0, 0])),
            ("bad-mtu_6", patch(26, &[0, 0, 0, 6])),
            ("bad-mtu_max", patch(26, &[0xff; 4])),
        ],
    )
}

fn check_qp_info(b: &[u8]) -> bool {
    let Ok(info) = QpInfo::from_bytes(b) else {
        return false;
    };
    assert_eq!(info.to_bytes().to_vec(), b);
    assert!(info.qpn < 1 << 24 && info.psn < 1 << 24 && info.mtu.bytes() > 0);
    true
}

fn region_inputs() -> Vec<Input> {
    let region = RemoteRegion {
        addr: 0x7f00_0000_1000,
        len: 1 << 20,
        rkey: 0x1234,
    }
    .to_bytes();
    corpus::load(
        "verbs_remote_region",
        &[
            ("ok-region", region.to_vec()),
            (
                "ok-max",
                RemoteRegion {
                    addr: u64::MAX,
                    len: u64::MAX,
                    rkey: u32::MAX,
                }
                .to_bytes()
                .to_vec(),
            ),
            ("bad-empty", Vec::new()),
            (
                "bad-truncated",
                region[..REMOTE_REGION_WIRE_LEN - 1].to_vec(),
            ),
            ("bad-oversize", [&region[..], &[0]].concat()),
        ],
    )
}

fn check_region(b: &[u8]) -> bool {
    let Ok(r) = RemoteRegion::from_bytes(b) else {
        return false;
    };
    assert_eq!(r.to_bytes().to_vec(), b);
    true
}

#[test]
fn the_qp_info_corpus_decodes_as_named() {
    corpus::check_all(&qp_info_inputs(), check_qp_info);
}

#[test]
fn the_remote_region_corpus_decodes_as_named() {
    corpus::check_all(&region_inputs(), check_region);
}

proptest! {
    #![proptest_config(corpus::config(2000))]

    #[test]
    fn mutated_qp_infos_never_panic(b in corpus::mutated(&qp_info_inputs())) {
        check_qp_info(&b);
    }

    #[test]
    fn mutated_regions_never_panic(b in corpus::mutated(&region_inputs())) {
        check_region(&b);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in corpus::arbitrary_bytes()) {
        check_qp_info(&b);
        check_region(&b);
    }

    #[test]
    fn qp_infos_round_trip(
        qpn in 0u32..1 << 24,
        psn in 0u32..1 << 24,
        lid in any::<u16>(),
        gid in any::<[u8; 16]>(),
        mtu in 1u32..=5,
    ) {
        let info = QpInfo { qpn, psn, lid, gid: Gid(gid), mtu: Mtu(mtu) };
        prop_assert_eq!(QpInfo::from_bytes(&info.to_bytes()).unwrap(), info);
    }

    #[test]
    fn regions_round_trip(addr in any::<u64>(), len in any::<u64>(), rkey in any::<u32>()) {
        let r = RemoteRegion { addr, len, rkey };
        prop_assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()).unwrap(), r);
    }
}
