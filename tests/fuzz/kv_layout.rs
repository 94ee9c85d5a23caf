//! What a client READs from the server one-sidedly and must verify before
//! it believes it: value blocks and index buckets.
//!
//! A block corpus file is the key the reader looks for, framed as one
//! length byte and the key, followed by the block as read.

use proptest::prelude::*;
use snowrdma::kv::proto::{
    block_len, decode_bucket, seal_block, value_checksum, verify_block, verify_leased_parts,
    BLOCK_HEADER_LEN, BLOCK_MAGIC, BUCKET_HEADER_LEN, BUCKET_LEN, SLOTS, SLOT_LEN,
    SUPERSEDED_MAGIC,
};

use crate::corpus::{self, within, Input};

/// A block READ whole under a lease, checked as the client checks one READ
/// in two parts (header and key, then the value).
fn verify_leased_block<'a>(b: &'a [u8], key: &[u8]) -> Option<(u64, &'a [u8])> {
    let (head, value) = b.split_at_checked(BLOCK_HEADER_LEN + key.len())?;
    verify_leased_parts(head, key, value).map(|version| (version, value))
}

fn block(key: &[u8], value: &[u8], version: u64) -> Vec<u8> {
    let mut b = vec![0u8; block_len(key.len(), value.len())];
    b[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + key.len()].copy_from_slice(key);
    b[BLOCK_HEADER_LEN + key.len()..].copy_from_slice(value);
    seal_block(&mut b, key.len(), value_checksum(value), version);
    b
}

/// A corpus input: the key, then the block.
fn framed(key: &[u8], block: &[u8]) -> Vec<u8> {
    let mut b = vec![u8::try_from(key.len()).expect("corpus keys are short")];
    b.extend_from_slice(key);
    b.extend_from_slice(block);
    b
}

fn unframe(input: &[u8]) -> (&[u8], &[u8]) {
    let n = input.first().map_or(0, |&n| usize::from(n));
    match input.get(1..1 + n) {
        Some(key) => (key, &input[1 + n..]),
        None => (&[], input.get(1..).unwrap_or_default()),
    }
}

fn block_inputs() -> Vec<Input> {
    let key = b"hello";
    let good = block(key, &[7; 300], 3);
    let edit = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        framed(key, &b)
    };
    let field = |at: usize, bytes: &[u8]| {
        let bytes = bytes.to_vec();
        edit(&move |b: &mut Vec<u8>| b[at..at + bytes.len()].copy_from_slice(&bytes))
    };
    corpus::load(
        "kv_block",
        &[
            ("ok-block", framed(key, &good)),
            ("ok-empty_key_and_value", framed(&[], &block(&[], &[], 0))),
            ("ok-version_max", framed(b"k", &block(b"k", b"v", u64::MAX))),
            ("bad-empty", Vec::new()),
            ("bad-header_only", framed(key, &good[..BLOCK_HEADER_LEN])),
            ("bad-truncated", edit(&|b| b.truncate(b.len() - 1))),
            ("bad-extended", edit(&|b| b.push(0))),
            ("bad-torn_value", edit(&|b| b[200] ^= 1)),
            ("bad-torn_key", edit(&|b| b[BLOCK_HEADER_LEN] ^= 1)),
            ("bad-torn_version", edit(&|b| b[16] ^= 1)),
            ("bad-checksum", edit(&|b| b[24] ^= 0x80)),
            ("bad-other_key", framed(b"hellp", &good)),
            ("bad-key_len_max", field(4, &u32::MAX.to_le_bytes())),
            ("bad-value_len_max", field(8, &u64::MAX.to_le_bytes())),
            ("bad-freed", field(0, &[0; 4])),
            ("bad-superseded", field(0, &SUPERSEDED_MAGIC.to_le_bytes())),
        ],
    )
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// What a verified block must be: its value the block's tail, its header
/// and key as asked. Returns whether [`verify_block`] took it.
fn check_block(input: &[u8]) -> bool {
    let (key, b) = unframe(input);
    let current = verify_block(b, key);
    let leased = verify_leased_block(b, key);
    for (version, value) in current.iter().chain(leased.iter()) {
        assert!(within(value, b));
        assert_eq!(value.as_ptr_range().end, b.as_ptr_range().end);
        assert_eq!(value.len(), b.len() - BLOCK_HEADER_LEN - key.len());
        assert_eq!(&b[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + key.len()], key);
        assert_eq!(*version, le64(b, 16));
        let magic = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
        assert!(magic == BLOCK_MAGIC || magic == SUPERSEDED_MAGIC);
    }
    let Some((version, value)) = current else {
        return false;
    };
    assert_eq!(leased, current, "a current block is readable under a lease");
    assert_eq!(
        block(key, value, version),
        b,
        "only a sealed block verifies"
    );
    true
}

fn bucket(overflow: u64, slots: &[(u64, u64, u64, u32)]) -> Vec<u8> {
    let mut b = vec![0u8; BUCKET_LEN];
    b[..8].copy_from_slice(&overflow.to_le_bytes());
    for (i, &(tag, addr, len, rkey)) in slots.iter().enumerate() {
        let s = &mut b[BUCKET_HEADER_LEN + i * SLOT_LEN..];
        s[..8].copy_from_slice(&tag.to_le_bytes());
        s[8..16].copy_from_slice(&addr.to_le_bytes());
        s[16..24].copy_from_slice(&len.to_le_bytes());
        s[24..28].copy_from_slice(&rkey.to_le_bytes());
    }
    b
}

fn bucket_inputs() -> Vec<Input> {
    let full: Vec<_> = (1..=SLOTS as u64)
        .map(|i| (i, i << 12, 100 + i, i as u32))
        .collect();
    let max = [(u64::MAX, u64::MAX, u64::MAX, u32::MAX); SLOTS];
    let mut longer = bucket(0, &full);
    longer.push(0xff);
    corpus::load(
        "kv_bucket",
        &[
            ("ok-empty", bucket(0, &[])),
            ("ok-one_slot", bucket(0, &full[..1])),
            ("ok-full", bucket(0, &full)),
            ("ok-overflowing", bucket(3, &full)),
            ("ok-max", bucket(u64::MAX, &max)),
            ("ok-longer", longer),
            ("bad-empty", Vec::new()),
            (
                "bad-header_only",
                bucket(0, &full)[..BUCKET_HEADER_LEN].to_vec(),
            ),
            ("bad-truncated", bucket(0, &full)[..BUCKET_LEN - 1].to_vec()),
        ],
    )
}

/// A bucket decodes as its bytes say; a short read gives fewer slots and
/// no overflow count to trust. Returns whether the bucket was whole.
fn check_bucket(b: &[u8]) -> bool {
    let (overflow, slots) = decode_bucket(b);
    let expect_overflow = if b.len() >= 8 { le64(b, 0) } else { u64::MAX };
    assert_eq!(overflow, expect_overflow);
    let present = (b.len().saturating_sub(BUCKET_HEADER_LEN) / SLOT_LEN).min(SLOTS);
    assert_eq!(slots.len(), present);
    for (i, s) in slots.iter().enumerate() {
        let at = BUCKET_HEADER_LEN + i * SLOT_LEN;
        assert_eq!(
            (s.tag, s.addr, s.len),
            (le64(b, at), le64(b, at + 8), le64(b, at + 16))
        );
        assert_eq!(s.rkey.to_le_bytes(), b[at + 24..at + 28]);
    }
    slots.len() == SLOTS
}

#[test]
fn the_block_corpus_verifies_as_named() {
    corpus::check_all(&block_inputs(), check_block);
}

#[test]
fn the_bucket_corpus_decodes_as_named() {
    corpus::check_all(&bucket_inputs(), check_bucket);
}

/// Values of every size class, up to a few pages.
fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => prop::collection::vec(any::<u8>(), 0..300),
        1 => prop::collection::vec(any::<u8>(), 4000..9000),
    ]
}

proptest! {
    #![proptest_config(corpus::config(5000))]

    #[test]
    fn mutated_blocks_never_panic(b in corpus::mutated(&block_inputs())) {
        check_block(&b);
    }

    #[test]
    fn mutated_buckets_never_panic(b in corpus::mutated(&bucket_inputs())) {
        check_bucket(&b);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in corpus::arbitrary_bytes()) {
        check_block(&b);
        check_bucket(&b);
    }

    #[test]
    fn sealed_blocks_verify(
        key in prop::collection::vec(any::<u8>(), 0..300),
        value in value(),
        version in any::<u64>(),
    ) {
        let b = block(&key, &value, version);
        prop_assert_eq!(verify_block(&b, &key), Some((version, &value[..])));
        prop_assert_eq!(verify_leased_block(&b, &key), Some((version, &value[..])));
    }

    /// Any one corrupted byte of a block is caught, under a lease too (the
    /// lease may have ended before the READ landed).
    #[test]
    fn a_corrupted_byte_is_detected(
        key in prop::collection::vec(any::<u8>(), 0..300),
        value in value(),
        version in any::<u64>(),
        at in any::<usize>(),
        flip in 1u8..=255,
    ) {
        let mut b = block(&key, &value, version);
        let at = at % b.len();
        b[at] ^= flip;
        prop_assert_eq!(verify_block(&b, &key), None, "byte {} of {}", at, b.len());
        // A magic that became the superseded one is the single change a
        // leased read accepts.
        let superseded = b[..4] == SUPERSEDED_MAGIC.to_le_bytes();
        if !superseded {
            prop_assert_eq!(verify_leased_block(&b, &key), None);
        }
    }

    #[test]
    fn a_cut_or_extended_block_is_refused(
        key in prop::collection::vec(any::<u8>(), 0..64),
        value in value(),
        cut in any::<usize>(),
        extra in prop::collection::vec(any::<u8>(), 1..16),
    ) {
        let b = block(&key, &value, 1);
        let cut = cut % b.len();
        prop_assert_eq!(verify_block(&b[..cut], &key), None);
        prop_assert_eq!(verify_leased_block(&b[..cut], &key), None);
        let mut longer = b.clone();
        longer.extend_from_slice(&extra);
        prop_assert_eq!(verify_block(&longer, &key), None);
        prop_assert_eq!(verify_leased_block(&longer, &key), None);
    }
}
