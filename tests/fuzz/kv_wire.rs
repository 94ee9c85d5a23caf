//! The key-value messages: requests (what a client sends the server),
//! replies and the HELLO answer (what the server sends back).

use proptest::prelude::*;
use snowrdma::kv::proto::{
    Op, Reply, Request, ServerInfo, Source, COMPACT_REPLY_LEN, COMPACT_REQUEST_LEN, REPLY_LEN,
    REQUEST_LEN, SERVER_INFO_LEN,
};
use snowrdma::kv::{KvError, MAX_KEY_LEN};

use crate::corpus::{self, within, Input};

fn full(op: Op, req_id: u64) -> Request {
    // An id past 32 bits takes the full header.
    Request::new(op, req_id | 1 << 32)
}

fn request_inputs() -> Vec<Input> {
    let mut put = Request::new(Op::Write, 7);
    put.value_len = 64;
    let mut cas = full(Op::Write, 8);
    cas.value_len = 3;
    cas.cas = Some(5);
    let mut staged = full(Op::Write, 9);
    staged.value_len = 10_000;
    staged.source = Source::Staged {
        offset: 4096,
        checksum: 0x1234_5678_9abc_def0,
    };
    let mut allocated = full(Op::Write, 10);
    allocated.value_len = 1 << 20;
    allocated.source = Source::Allocated { token: 77 };
    let mut alloc = full(Op::Alloc, 11);
    alloc.value_len = 1 << 20;
    let mut words = [0u8; 16];
    let (release, more) = Request::release(&[5, 6, 7], &mut words);
    let get = Request::new(Op::Get, 3).encode(b"key", &[]);
    let get_full = full(Op::Get, 3).encode(b"key", &[]);
    let patch = |b: &[u8], at: usize, bytes: &[u8]| {
        let mut b = b.to_vec();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    };
    let mut get_extra = get.clone();
    get_extra.push(0);
    let mut huge_value = cas.clone();
    huge_value.value_len = u64::MAX;
    corpus::load(
        "kv_request",
        &[
            ("ok-compact_get", get.clone()),
            ("ok-compact_put", put.encode(&[1; 16], &[2; 64])),
            (
                "ok-compact_delete",
                Request::new(Op::Delete, 4).encode(b"k", &[]),
            ),
            (
                "ok-compact_hello",
                Request::new(Op::Hello, 0).encode(&[], &[]),
            ),
            ("ok-full_get", get_full.clone()),
            ("ok-full_cas", cas.encode(b"key", b"abc")),
            ("ok-full_staged", staged.encode(b"key", &[])),
            ("ok-full_allocated", allocated.encode(b"key", &[])),
            ("ok-full_alloc", alloc.encode(b"key", &[])),
            ("ok-full_release", release.encode(more, &[])),
            ("bad-empty", Vec::new()),
            (
                "bad-compact_truncated",
                get[..COMPACT_REQUEST_LEN - 1].to_vec(),
            ),
            (
                "bad-compact_key_cut",
                get[..COMPACT_REQUEST_LEN + 1].to_vec(),
            ),
            ("bad-compact_key_len_max", patch(&get, 2, &[0xff, 0xff])),
            ("bad-compact_opcode_0", patch(&get, 1, &[0])),
            ("bad-compact_get_with_value", get_extra),
            ("bad-full_truncated", get_full[..REQUEST_LEN - 1].to_vec()),
            ("bad-full_magic", patch(&get_full, 0, b"XXXX")),
            ("bad-full_opcode_7", patch(&get_full, 4, &[7])),
            ("bad-full_source_3", patch(&get_full, 6, &[3])),
            (
                "bad-full_key_len_max",
                patch(&get_full, 16, &u32::MAX.to_le_bytes()),
            ),
            ("bad-full_value_len_max", huge_value.encode(b"key", b"abc")),
            ("bad-full_value_len_short", {
                let mut w = cas.clone();
                w.value_len = 100; // says 100, carries 3
                w.encode(b"key", b"abc")
            }),
        ],
    )
}

/// What a decoded request must be: its key and value inside the message,
/// their lengths as announced, and the same request again once re-encoded.
fn check_request(msg: &[u8]) -> bool {
    // What the server tells from a compact PUT's header alone (it stores
    // such a PUT straight from its ring) is what the whole decode says.
    if let Some(head) = msg.first_chunk::<COMPACT_REQUEST_LEN>() {
        if let Some((id, key_len)) = Request::compact_put(head, msg.len()) {
            let (req, key, value) = Request::decode(msg).expect("a compact PUT decodes");
            assert_eq!(
                (req.op, req.source, req.cas),
                (Op::Write, Source::Inline, None)
            );
            assert_eq!((req.req_id, key.len()), (id, key_len));
            assert_eq!(value.len(), msg.len() - COMPACT_REQUEST_LEN - key_len);
        }
    }
    let Ok((req, key, value)) = Request::decode(msg) else {
        return false;
    };
    assert!(within(key, msg) && within(value, msg), "{req:?}");
    assert_eq!(key.len() as u64, u64::from(req.key_len));
    let header = if msg.len() >= REQUEST_LEN && key.as_ptr() == msg[REQUEST_LEN..].as_ptr() {
        REQUEST_LEN
    } else {
        COMPACT_REQUEST_LEN
    };
    assert_eq!(
        key.as_ptr(),
        msg[header..].as_ptr(),
        "the key follows the header"
    );
    if req.op == Op::Write && req.source == Source::Inline {
        assert_eq!(value.len() as u64, req.value_len);
        assert_eq!(
            value.as_ptr_range().end,
            msg.as_ptr_range().end,
            "the value ends the message"
        );
    } else {
        assert!(value.is_empty(), "{req:?} carries no value");
    }
    let more = req.released(key).count();
    assert_eq!(more, 1 + key.len() / 8);
    let again = req.encode(key, value);
    assert_eq!(
        Request::decode(&again),
        Ok((req.clone(), key, value)),
        "re-encoded as {again:?}"
    );
    true
}

fn reply_inputs() -> Vec<Input> {
    let get = Reply {
        req_id: 9,
        version: 3,
        value_len: 64,
        ..Reply::default()
    };
    let put = Reply {
        req_id: 10,
        version: 4,
        ..Reply::default()
    };
    let remote = Reply {
        req_id: 11,
        version: 5,
        value_len: 1 << 20,
        addr: 0x7f00_0000_1000,
        rkey: 0x42,
        remote: true,
        lease: 99,
        ..Reply::default()
    };
    let info = ServerInfo {
        request_buf: 0x7f00_0010_0000,
        request_buf_len: 1 << 20,
        request_buf_rkey: 1,
        index_addr: 0x7f00_0020_0000,
        index_rkey: 2,
        buckets: 1 << 16,
        pool_rkey: 3,
        max_key: 1024,
        max_value: 1 << 30,
    }
    .encode();
    let hello = Reply {
        value_len: info.len() as u64,
        ..Reply::default()
    };
    let compact = get.encode(&[3; 64]);
    let error = Reply::error(12, KvError::NotFound).encode(&[]);
    let mut lying = remote.encode(&[]);
    lying[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    corpus::load(
        "kv_reply",
        &[
            ("ok-compact_get", compact.clone()),
            ("ok-compact_put", put.encode(&[])),
            (
                "ok-compact_version_max",
                Reply {
                    version: (1 << 56) - 1,
                    ..put
                }
                .encode(&[]),
            ),
            ("ok-compact_hello", hello.encode(&info)),
            ("ok-full_error", error.clone()),
            ("ok-full_remote", remote.encode(&[])),
            (
                "ok-full_version_2_56",
                Reply {
                    version: 1 << 56,
                    ..put
                }
                .encode(&[]),
            ),
            // A reply's value length is the server's word: decoding takes
            // it as it is; a client checks it against what it can hold.
            ("ok-full_value_len_max", lying),
            ("bad-empty", Vec::new()),
            (
                "bad-compact_truncated",
                compact[..COMPACT_REPLY_LEN - 1].to_vec(),
            ),
            ("bad-full_truncated", error[..REPLY_LEN - 1].to_vec()),
            ("bad-full_magic", {
                let mut b = error.clone();
                b[..4].copy_from_slice(b"XXXX");
                b
            }),
        ],
    )
}

fn check_reply(msg: &[u8]) -> bool {
    let Ok((reply, payload)) = Reply::decode(msg) else {
        return false;
    };
    assert!(within(payload, msg));
    assert_eq!(
        payload.as_ptr_range().end,
        msg.as_ptr_range().end,
        "the payload ends the message"
    );
    let header = msg.len() - payload.len();
    assert!(
        header == COMPACT_REPLY_LEN || header == REPLY_LEN,
        "{header}"
    );
    if header == COMPACT_REPLY_LEN {
        assert_eq!(reply.value_len, payload.len() as u64);
    }
    let again = reply.encode(payload);
    assert_eq!(Reply::decode(&again), Ok((reply, payload)));
    true
}

fn info_inputs() -> Vec<Input> {
    let all = |v: u64| ServerInfo {
        request_buf: v,
        request_buf_len: v,
        request_buf_rkey: v as u32,
        index_addr: v,
        index_rkey: v as u32,
        buckets: v,
        pool_rkey: v as u32,
        max_key: v as u32,
        max_value: v,
    };
    let typical = ServerInfo {
        request_buf_len: 1 << 20,
        buckets: 1 << 16,
        max_key: 1024,
        max_value: 1 << 30,
        ..all(0x1000)
    }
    .encode();
    let mut longer = typical.clone();
    longer.push(0xaa);
    corpus::load(
        "kv_server_info",
        &[
            ("ok-typical", typical.clone()),
            ("ok-zero", all(0).encode()),
            ("ok-max", all(u64::MAX).encode()),
            ("ok-longer", longer),
            ("bad-empty", Vec::new()),
            ("bad-truncated", typical[..SERVER_INFO_LEN - 1].to_vec()),
        ],
    )
}

fn check_info(b: &[u8]) -> bool {
    let Some(info) = ServerInfo::decode(b) else {
        return false;
    };
    assert_eq!(info.encode(), b[..SERVER_INFO_LEN].to_vec());
    true
}

#[test]
fn the_request_corpus_decodes_as_named() {
    corpus::check_all(&request_inputs(), check_request);
}

#[test]
fn the_reply_corpus_decodes_as_named() {
    corpus::check_all(&reply_inputs(), check_reply);
}

#[test]
fn the_server_info_corpus_decodes_as_named() {
    corpus::check_all(&info_inputs(), check_info);
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Hello),
        Just(Op::Get),
        Just(Op::Write),
        Just(Op::Alloc),
        Just(Op::Delete),
        Just(Op::Release),
    ]
}

fn source() -> impl Strategy<Value = Source> {
    prop_oneof![
        2 => Just(Source::Inline),
        1 => (any::<u64>(), any::<u64>())
            .prop_map(|(offset, checksum)| Source::Staged { offset, checksum }),
        1 => any::<u64>().prop_map(|token| Source::Allocated { token }),
    ]
}

/// Keys of every size class: none, usual, and past what a compact header
/// can say.
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => prop::collection::vec(any::<u8>(), 0..64),
        1 => Just(vec![0x5a; usize::from(u16::MAX) + 1]),
    ]
}

fn small_or_any() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..1 << 20, any::<u64>()]
}

proptest! {
    #![proptest_config(corpus::config(5000))]

    #[test]
    fn mutated_requests_never_panic(b in corpus::mutated(&request_inputs())) {
        check_request(&b);
    }

    #[test]
    fn mutated_replies_never_panic(b in corpus::mutated(&reply_inputs())) {
        check_reply(&b);
    }

    #[test]
    fn mutated_server_infos_never_panic(b in corpus::mutated(&info_inputs())) {
        check_info(&b);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in corpus::arbitrary_bytes()) {
        check_request(&b);
        check_reply(&b);
        check_info(&b);
    }

    #[test]
    fn requests_round_trip(
        op in op(),
        req_id in small_or_any(),
        key in key(),
        value in prop::collection::vec(any::<u8>(), 0..128),
        value_len in small_or_any(),
        cas in proptest::option::of(small_or_any()),
        lease in small_or_any(),
        source in source(),
    ) {
        let mut req = Request::new(op, req_id);
        req.key_len = key.len() as u32;
        req.source = source;
        req.cas = cas;
        // A CAS's expected version and a lease share their field.
        req.lease = cas.unwrap_or(lease);
        let inline = op == Op::Write && source == Source::Inline;
        let value = if inline { value } else { Vec::new() };
        req.value_len = if inline { value.len() as u64 } else { value_len };
        let msg = req.encode(&key, &value);
        // A release's key is the leases it names after the first: whole
        // words, no more than a key's length.
        if op == Op::Release && (key.len() > MAX_KEY_LEN || key.len() % 8 != 0) {
            prop_assert!(Request::decode(&msg).is_err());
        } else {
            prop_assert_eq!(Request::decode(&msg), Ok((req, &key[..], &value[..])));
        }
    }

    #[test]
    fn replies_round_trip(
        status in any::<i32>(),
        req_id in small_or_any(),
        version in prop_oneof![0u64..1 << 56, any::<u64>()],
        value_len in small_or_any(),
        addr in any::<u64>(),
        rkey in any::<u32>(),
        remote in any::<bool>(),
        lease in any::<u64>(),
        payload in prop::collection::vec(any::<u8>(), 0..128),
        plain in any::<bool>(),
    ) {
        let reply = if plain {
            // What a compact header can say.
            Reply { req_id, version, value_len: payload.len() as u64, ..Reply::default() }
        } else {
            Reply { status, req_id, version, value_len, addr, rkey, remote, lease }
        };
        let msg = reply.encode(&payload);
        prop_assert_eq!(Reply::decode(&msg), Ok((reply, &payload[..])));
    }

    #[test]
    fn server_infos_round_trip(words in prop::array::uniform9(any::<u64>())) {
        let info = ServerInfo {
            request_buf: words[0],
            request_buf_len: words[1],
            request_buf_rkey: words[2] as u32,
            index_addr: words[3],
            index_rkey: words[4] as u32,
            buckets: words[5],
            pool_rkey: words[6] as u32,
            max_key: words[7] as u32,
            max_value: words[8],
        };
        prop_assert_eq!(ServerInfo::decode(&info.encode()), Some(info));
    }
}
