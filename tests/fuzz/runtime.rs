//! The runtime's commands and extended-message headers: what a peer SENDs
//! and what it writes at the head of a ring message.

use proptest::prelude::*;
use snowrdma::runtime::proto::{Cmd, ExtKind, Opcode, CMD_LEN, EXT_HEADER_LEN, RDMA_CMD_MAGIC};

use crate::corpus::{self, Input};

fn cmd(version: u8, opcode: Opcode, addr: u64, length: u32, key: u32) -> Vec<u8> {
    let mut c = Cmd::new(opcode, addr, length, key);
    c.version = version;
    c.encode().to_vec()
}

fn cmd_inputs() -> Vec<Input> {
    let mut v1 = Cmd::new(Opcode::RegLocalAddr, 0x7f12_3456_7000, 1 << 20, 0x1234);
    v1.version = 1;
    v1.recv_depth = 512;
    v1.ring_use = 64 << 10;
    let v2 = Cmd { version: 2, ..v1 };
    let mut garbage = v1.encode();
    garbage[11..16].copy_from_slice(&[0xff; 5]);
    let mut legacy_garbage = cmd(0, Opcode::RegLocalAddr, 0x1000, 4096, 7);
    legacy_garbage[3..11].copy_from_slice(&[0xee; 8]);
    let credit = cmd(1, Opcode::Credit, 4096, 3, 0);
    let with = |at: usize, v: u8| {
        let mut b = credit.clone();
        b[at] = v;
        b
    };
    let mut oversize = credit.clone();
    oversize.push(0);
    corpus::load(
        "runtime_cmd",
        &[
            ("ok-reg_local_addr_v1", v1.encode().to_vec()),
            ("ok-reg_local_addr_v2", v2.encode().to_vec()),
            (
                "ok-reg_local_addr_v0",
                cmd(0, Opcode::RegLocalAddr, 0x1000, 4096, 7),
            ),
            ("ok-reg_local_addr_v0_reserved_garbage", legacy_garbage),
            ("ok-reserved_garbage", garbage.to_vec()),
            (
                "ok-reg_phys_addr",
                cmd(1, Opcode::RegPhysAddr, 0, 0, 0xbeef),
            ),
            ("ok-goodbye", cmd(1, Opcode::ConnGoodbye, 0, 0, 0)),
            ("ok-credit", credit.clone()),
            (
                "ok-credit_max",
                cmd(1, Opcode::Credit, u64::MAX, u32::MAX, u32::MAX),
            ),
            ("ok-future_version", with(1, 0xff)),
            (
                "ok-credit_slot",
                cmd(2, Opcode::CreditSlot, 0x7f12_3456_8000, 16, 0x5678),
            ),
            (
                "ok-credit_wanted",
                cmd(2, Opcode::CreditWanted, 1 << 20, 1000, 0),
            ),
            ("bad-empty", Vec::new()),
            ("bad-truncated", credit[..CMD_LEN - 1].to_vec()),
            ("bad-oversize", oversize),
            ("bad-magic", with(0, b'X')),
            ("bad-opcode_6", with(2, 6)),
            ("bad-opcode_255", with(2, 0xff)),
        ],
    )
}

/// What a decoded command must be: the bytes it came from, less what the
/// decoder ignores (reserved bytes; a legacy peer's extension fields).
fn check_cmd(b: &[u8]) -> bool {
    let Ok(c) = Cmd::decode(b) else {
        return false;
    };
    assert_eq!(b.len(), CMD_LEN);
    assert_eq!(b[0], RDMA_CMD_MAGIC);
    let mut canonical = b.to_vec();
    canonical[11..16].fill(0);
    if c.version == 0 {
        canonical[3..11].fill(0);
        assert_eq!((c.recv_depth, c.ring_use), (0, 0));
    }
    assert_eq!(c.encode().to_vec(), canonical, "{c:?}");
    true
}

fn ext_inputs() -> Vec<Input> {
    let imm = ExtKind::WithImm(0xdead_beef).encode();
    let mut with_payload = imm.to_vec();
    with_payload.extend_from_slice(b"payload");
    let mut silent_garbage = ExtKind::Silent.encode();
    silent_garbage[4..].fill(0xaa);
    let kind = |k: u32| {
        let mut b = imm;
        b[..4].copy_from_slice(&k.to_be_bytes());
        b.to_vec()
    };
    corpus::load(
        "runtime_ext",
        &[
            ("ok-with_imm", imm.to_vec()),
            (
                "ok-with_imm_max",
                ExtKind::WithImm(u32::MAX).encode().to_vec(),
            ),
            ("ok-silent", ExtKind::Silent.encode().to_vec()),
            ("ok-silent_garbage_imm", silent_garbage.to_vec()),
            ("ok-with_payload", with_payload),
            ("bad-empty", Vec::new()),
            ("bad-truncated", imm[..EXT_HEADER_LEN - 1].to_vec()),
            ("bad-kind_0", kind(0)),
            ("bad-kind_3", kind(3)),
            ("bad-kind_max", kind(u32::MAX)),
        ],
    )
}

fn check_ext(b: &[u8]) -> bool {
    let Some(k) = ExtKind::decode(b) else {
        return false;
    };
    assert!(b.len() >= EXT_HEADER_LEN);
    let e = k.encode();
    match k {
        ExtKind::WithImm(_) => assert_eq!(&e[..], &b[..EXT_HEADER_LEN]),
        // A silent message's immediate field means nothing.
        ExtKind::Silent => assert_eq!(&e[..4], &b[..4]),
    }
    true
}

#[test]
fn the_command_corpus_decodes_as_named() {
    corpus::check_all(&cmd_inputs(), check_cmd);
}

#[test]
fn the_extended_header_corpus_decodes_as_named() {
    corpus::check_all(&ext_inputs(), check_ext);
}

fn opcode() -> impl Strategy<Value = Opcode> {
    prop_oneof![
        Just(Opcode::RegLocalAddr),
        Just(Opcode::RegPhysAddr),
        Just(Opcode::ConnGoodbye),
        Just(Opcode::Credit),
    ]
}

proptest! {
    #![proptest_config(corpus::config(5000))]

    #[test]
    fn mutated_commands_never_panic(b in corpus::mutated(&cmd_inputs())) {
        check_cmd(&b);
    }

    #[test]
    fn mutated_extended_headers_never_panic(b in corpus::mutated(&ext_inputs())) {
        check_ext(&b);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in corpus::arbitrary_bytes()) {
        check_cmd(&b);
        check_ext(&b);
    }

    #[test]
    fn commands_round_trip(
        version in any::<u8>(),
        opcode in opcode(),
        recv_depth in any::<u32>(),
        ring_use in any::<u32>(),
        addr in any::<u64>(),
        length in any::<u32>(),
        key in any::<u32>(),
    ) {
        let mut c = Cmd::new(opcode, addr, length, key);
        c.version = version;
        // A legacy command has no extension fields.
        if version > 0 {
            c.recv_depth = recv_depth;
            c.ring_use = ring_use;
        }
        prop_assert_eq!(Cmd::decode(&c.encode()), Ok(c));
    }

    #[test]
    fn extended_headers_round_trip(imm in any::<u32>(), silent in any::<bool>()) {
        let k = if silent { ExtKind::Silent } else { ExtKind::WithImm(imm) };
        prop_assert_eq!(ExtKind::decode(&k.encode()), Some(k));
    }
}
