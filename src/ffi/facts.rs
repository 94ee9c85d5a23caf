//! A check that every fact the C headers state (enum values, codes,
//! constants) is the value the Rust side defines. The headers are generated
//! from the Rust items where cbindgen can express them; this test walks all
//! of them, so a stale header, a renumbered variant or a code defined twice
//! fails here.

use crate::broker::EventKind;
use crate::ffi::broker::snowrdma_broker_status;
use crate::ffi::snowrdma_result;
use crate::kv::{codes, KvError};
use crate::runtime::proto::{Opcode, RDMA_CMD_MAGIC};
use crate::runtime::{ConnKind, ConnState};

const HEADERS: [&str; 3] = [
    include_str!("../../include/rdma.h"),
    include_str!("../../include/kv_store.h"),
    include_str!("../../include/snowrdma/broker.h"),
];

/// The value a header gives `name`: an enumerator `NAME = v` or a
/// `#define NAME v`.
fn header_value(name: &str) -> i64 {
    for h in HEADERS {
        for line in h.lines() {
            let t = line.trim().trim_end_matches(',');
            let rest = t
                .strip_prefix("#define ")
                .and_then(|r| r.strip_prefix(name))
                .filter(|r| r.starts_with(' '))
                .or_else(|| t.strip_prefix(name).and_then(|r| r.strip_prefix(" = ")));
            if let Some(v) = rest {
                return v
                    .trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{name} = {v:?}"));
            }
        }
    }
    panic!("no header defines {name}");
}

fn check(pairs: &[(&str, i64)]) {
    let mut seen = std::collections::HashSet::new();
    for &(name, rust) in pairs {
        assert_eq!(
            header_value(name),
            rust,
            "{name}: the header differs from the Rust side"
        );
        assert!(seen.insert(rust), "{name}: the value {rust} is used twice");
    }
}

#[test]
fn connection_states_and_kinds() {
    // Adding a variant breaks this match, and so reminds to list it below.
    let all = |s: ConnState| match s {
        ConnState::None
        | ConnState::Connecting
        | ConnState::Accepting
        | ConnState::Connected
        | ConnState::MrReady
        | ConnState::Closed
        | ConnState::Error => s as i64,
    };
    check(&[
        ("RDMA_CONN_STATE_NONE", all(ConnState::None)),
        ("RDMA_CONN_STATE_CONNECTING", all(ConnState::Connecting)),
        ("RDMA_CONN_STATE_ACCEPTING", all(ConnState::Accepting)),
        ("RDMA_CONN_STATE_CONNECTED", all(ConnState::Connected)),
        ("RDMA_CONN_STATE_MR_READY", all(ConnState::MrReady)),
        ("RDMA_CONN_STATE_CLOSED", all(ConnState::Closed)),
        ("RDMA_CONN_STATE_ERROR", all(ConnState::Error)),
    ]);
    let kind = |k: ConnKind| match k {
        ConnKind::AcceptedConn | ConnKind::ConnectedConn => k as i64,
    };
    check(&[
        ("ACCEPTED_CONN", kind(ConnKind::AcceptedConn)),
        ("CONNECTED_CONN", kind(ConnKind::ConnectedConn)),
    ]);
}

#[test]
fn wire_opcodes_and_magic() {
    let op = |o: Opcode| match o {
        Opcode::RegLocalAddr
        | Opcode::RegPhysAddr
        | Opcode::ConnGoodbye
        | Opcode::Credit
        | Opcode::CreditSlot
        | Opcode::CreditWanted => o as i64,
    };
    // CREDIT (version 1), CREDIT_SLOT and CREDIT_WANTED (version 2) are
    // ours; the legacy header does not name them.
    check(&[
        ("REG_LOCAL_ADDR", op(Opcode::RegLocalAddr)),
        ("REG_PHYS_ADDR", op(Opcode::RegPhysAddr)),
        ("CONN_GOODBYE", op(Opcode::ConnGoodbye)),
    ]);
    assert_eq!(header_value("RDMA_CMD_MAGIC"), i64::from(RDMA_CMD_MAGIC));
}

#[test]
fn every_kv_error_code() {
    let errors = [
        KvError::NotFound,
        KvError::Exists,
        KvError::CasFailed { current: 3 },
        KvError::KeyTooLong,
        KvError::ValueTooLong { max: 9 },
        KvError::NoMemory,
        KvError::Internal(String::new()),
        KvError::InvalidArgument(String::new()),
        KvError::Disconnected(String::new()),
        KvError::Timeout(Default::default()),
        KvError::BufferTooSmall { needed: 1 },
    ];
    // Exhaustive: a new variant must be added to `errors` above.
    let name = |e: &KvError| match e {
        KvError::NotFound => "KV_ERR_NOT_FOUND",
        KvError::Exists => "KV_ERR_EXISTS",
        KvError::CasFailed { .. } => "KV_ERR_CAS_FAILED",
        KvError::KeyTooLong => "KV_ERR_KEY_TOO_LONG",
        KvError::ValueTooLong { .. } => "KV_ERR_VALUE_TOO_LONG",
        KvError::NoMemory => "KV_ERR_NO_MEMORY",
        KvError::Internal(_) => "KV_ERR_INTERNAL",
        KvError::InvalidArgument(_) => "KV_ERR_INVALID_ARGUMENT",
        KvError::Disconnected(_) => "KV_ERR_DISCONNECTED",
        KvError::Timeout(_) => "KV_ERR_TIMEOUT",
        KvError::BufferTooSmall { .. } => "KV_ERR_BUFFER_TOO_SMALL",
    };
    let mut pairs: Vec<(&str, i64)> = errors
        .iter()
        .map(|e| (name(e), i64::from(e.code())))
        .collect();
    pairs.push(("KV_OK", i64::from(codes::KV_OK)));
    check(&pairs);
    // What a server reports on the wire comes back as the same error.
    for e in &errors[..6] {
        let back = KvError::from_code(e.code(), 0);
        assert_eq!(back.code(), e.code(), "{e}");
    }
    assert_eq!(
        header_value("KV_DEFAULT_PORT"),
        i64::from(codes::KV_DEFAULT_PORT)
    );
}

#[test]
fn kv_bounds_are_the_key_value_layers() {
    use crate::ffi::kv::{KV_MAX_KEY_LEN, KV_MAX_WORKERS, KV_MAX_WORKER_QUEUE};
    let bounds = [
        ("KV_MAX_KEY_LEN", KV_MAX_KEY_LEN, crate::kv::MAX_KEY_LEN),
        (
            "KV_MAX_WORKERS",
            KV_MAX_WORKERS as usize,
            crate::kv::MAX_WORKERS,
        ),
        (
            "KV_MAX_WORKER_QUEUE",
            KV_MAX_WORKER_QUEUE as usize,
            crate::kv::MAX_WORKER_QUEUE,
        ),
    ];
    for (name, ffi, kv) in bounds {
        assert_eq!(
            ffi, kv,
            "{name}: the C side differs from the key-value layer"
        );
        assert_eq!(header_value(name), kv as i64, "{name}: the header is stale");
    }
}

#[test]
fn result_codes_and_broker_events() {
    use snowrdma_broker_status::*;
    use snowrdma_result::*;
    check(&[
        ("SNOWRDMA_OK", SNOWRDMA_OK as i64),
        (
            "SNOWRDMA_ERR_INVALID_ARGUMENT",
            SNOWRDMA_ERR_INVALID_ARGUMENT as i64,
        ),
        ("SNOWRDMA_ERR_NO_DEVICE", SNOWRDMA_ERR_NO_DEVICE as i64),
        ("SNOWRDMA_ERR_VERBS", SNOWRDMA_ERR_VERBS as i64),
        ("SNOWRDMA_ERR_COMPLETION", SNOWRDMA_ERR_COMPLETION as i64),
        ("SNOWRDMA_ERR_TIMEOUT", SNOWRDMA_ERR_TIMEOUT as i64),
        (
            "SNOWRDMA_ERR_BUFFER_TOO_SMALL",
            SNOWRDMA_ERR_BUFFER_TOO_SMALL as i64,
        ),
        ("SNOWRDMA_ERR_INTERNAL", SNOWRDMA_ERR_INTERNAL as i64),
    ]);
    check(&[
        ("SNOWRDMA_BROKER_OK", SNOWRDMA_BROKER_OK as i64),
        (
            "SNOWRDMA_BROKER_INVALID_ARGUMENT",
            SNOWRDMA_BROKER_INVALID_ARGUMENT as i64,
        ),
        ("SNOWRDMA_BROKER_AGAIN", SNOWRDMA_BROKER_AGAIN as i64),
        (
            "SNOWRDMA_BROKER_PEER_FAILED",
            SNOWRDMA_BROKER_PEER_FAILED as i64,
        ),
        ("SNOWRDMA_BROKER_NO_PEER", SNOWRDMA_BROKER_NO_PEER as i64),
        ("SNOWRDMA_BROKER_TIMEOUT", SNOWRDMA_BROKER_TIMEOUT as i64),
        ("SNOWRDMA_BROKER_SYSTEM", SNOWRDMA_BROKER_SYSTEM as i64),
        ("SNOWRDMA_BROKER_PROTOCOL", SNOWRDMA_BROKER_PROTOCOL as i64),
        (
            "SNOWRDMA_BROKER_REENTRANT",
            SNOWRDMA_BROKER_REENTRANT as i64,
        ),
        (
            "SNOWRDMA_BROKER_WRONG_THREAD",
            SNOWRDMA_BROKER_WRONG_THREAD as i64,
        ),
        ("SNOWRDMA_BROKER_INTERNAL", SNOWRDMA_BROKER_INTERNAL as i64),
    ]);
    let ev = |k: EventKind| match k {
        EventKind::Recv
        | EventKind::SendDone
        | EventKind::WriteDone
        | EventKind::ReadDone
        | EventKind::Failed
        | EventKind::PeerDown => k as i64,
    };
    check(&[
        ("SNOWRDMA_BROKER_EVENT_KIND_RECV", ev(EventKind::Recv)),
        (
            "SNOWRDMA_BROKER_EVENT_KIND_SEND_DONE",
            ev(EventKind::SendDone),
        ),
        (
            "SNOWRDMA_BROKER_EVENT_KIND_WRITE_DONE",
            ev(EventKind::WriteDone),
        ),
        (
            "SNOWRDMA_BROKER_EVENT_KIND_READ_DONE",
            ev(EventKind::ReadDone),
        ),
        ("SNOWRDMA_BROKER_EVENT_KIND_FAILED", ev(EventKind::Failed)),
        (
            "SNOWRDMA_BROKER_EVENT_KIND_PEER_DOWN",
            ev(EventKind::PeerDown),
        ),
    ]);
}
