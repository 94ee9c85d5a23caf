//! The layouts clients READ one-sidedly: the value block (header, key,
//! value, checksums that detect a torn read) and the hash index bucket.

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::{u32_at, u64_at};

// ---- The value block: what a one-sided reader verifies ----

pub const BLOCK_MAGIC: u32 = 0x4b42_564b; // "KVBK"
/// The magic of a block that is no longer its key's current value (replaced
/// or deleted) but stays readable for a lease holder until freed. Set after
/// the index moved on and before the writer is answered.
pub const SUPERSEDED_MAGIC: u32 = 0x5842_564b; // "KVBX"
pub const BLOCK_HEADER_LEN: usize = 32;

/// A stored value as it sits in server memory: magic, key length, value
/// length, version, then a checksum over all of that plus key and value, so a
/// reader racing with an update or with reuse of the memory sees a mismatch
/// instead of a torn value.
pub fn block_len(key_len: usize, value_len: usize) -> usize {
    // Saturating: a length from a reply is the server's word, and a huge
    // one must be refused, not overflow.
    BLOCK_HEADER_LEN
        .saturating_add(key_len)
        .saturating_add(value_len)
}

/// The checksum in a block header: over the header's first 24 bytes, the
/// key, and the value's own hash (so the value can be hashed before the
/// version is known, outside any lock).
pub(super) fn block_checksum(head: &[u8], key: &[u8], value_hash: u64) -> u64 {
    // Usual keys are hashed in one call from a stack copy: the streaming
    // state costs more to set up than the few bytes cost to hash. Both ways
    // give the same digest.
    let mut short = [0u8; 24 + SHORT_KEY + 8];
    let n = head.len() + key.len() + 8;
    if n <= short.len() {
        let (h, rest) = short.split_at_mut(head.len());
        h.copy_from_slice(head);
        rest[..key.len()].copy_from_slice(key);
        rest[key.len()..key.len() + 8].copy_from_slice(&value_hash.to_le_bytes());
        return xxh3_64(&short[..n]);
    }
    let mut h = Xxh3::new();
    h.update(head);
    h.update(key);
    h.update(&value_hash.to_le_bytes());
    h.digest()
}

/// Keys up to this long take [`block_checksum`]'s one-call path.
pub(super) const SHORT_KEY: usize = 200;

pub(super) fn block_head(key_len: usize, value_len: usize, version: u64) -> [u8; 24] {
    let mut head = [0u8; 24];
    head[..4].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    head[4..8].copy_from_slice(&(key_len as u32).to_le_bytes());
    head[8..16].copy_from_slice(&(value_len as u64).to_le_bytes());
    head[16..24].copy_from_slice(&version.to_le_bytes());
    head
}

/// Writes a whole block into `out` (`block_len` bytes).
#[cfg(test)]
pub fn write_block(out: &mut [u8], key: &[u8], value: &[u8], version: u64) {
    let k = BLOCK_HEADER_LEN + key.len();
    out[BLOCK_HEADER_LEN..k].copy_from_slice(key);
    out[k..k + value.len()].copy_from_slice(value);
    seal_block(out, key.len(), value_checksum(value), version);
}

/// Writes the header of a block whose key and value are already in place
/// after it, given the value's hash ([`value_checksum`]).
pub fn seal_block(block: &mut [u8], key_len: usize, value_hash: u64, version: u64) {
    let value_len = block.len() - BLOCK_HEADER_LEN - key_len;
    let head = block_head(key_len, value_len, version);
    let key = &block[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + key_len];
    let sum = block_checksum(&head, key, value_hash);
    block[24..32].copy_from_slice(&sum.to_le_bytes());
    block[..24].copy_from_slice(&head);
}

/// Checks a block read from the server by address alone: it must be the
/// key's current value (not superseded), hold `key`, be complete and match
/// its checksum. Returns the version and the value.
pub fn verify_block<'a>(block: &'a [u8], key: &[u8]) -> Option<(u64, &'a [u8])> {
    let (head, value) = block.split_at_checked(BLOCK_HEADER_LEN + key.len())?;
    verify(head, value, key, false).map(|version| (version, value))
}

/// As [`verify_block`], for a block READ under a lease in two parts (its
/// header and key in `head`, its value elsewhere, as a READ straight into a
/// caller's registered buffer lands): the version. A lease can end before
/// the READ lands (the server caps and expires leases), and the block may
/// then be freed and reused, so the value is hashed as well. A block
/// superseded since the lease was given is still whole: it was sealed as
/// current, and is checked as such.
pub fn verify_leased_parts(head: &[u8], key: &[u8], value: &[u8]) -> Option<u64> {
    verify(head, value, key, true)
}

fn verify(head: &[u8], value: &[u8], key: &[u8], leased: bool) -> Option<u64> {
    if head.len() != BLOCK_HEADER_LEN + key.len() {
        return None;
    }
    let magic = u32_at(head, 0);
    if magic != BLOCK_MAGIC && !(leased && magic == SUPERSEDED_MAGIC) {
        return None;
    }
    let key_len = u32_at(head, 4) as usize;
    let value_len = usize::try_from(u64_at(head, 8)).ok()?;
    let stored_key = &head[BLOCK_HEADER_LEN..];
    if key_len != key.len() || value_len != value.len() || stored_key != key {
        return None;
    }
    // The checksum was taken when the block was sealed, as current.
    let mut sealed = [0u8; 24];
    sealed.copy_from_slice(&head[..24]);
    sealed[..4].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    if block_checksum(&sealed, stored_key, value_checksum(value)) != u64_at(head, 24) {
        return None;
    }
    Some(u64_at(head, 16))
}

/// Checksum of a staged value, so the server can tell it arrived whole.
pub fn value_checksum(value: &[u8]) -> u64 {
    xxh3_64(value)
}

// ---- The hash index: buckets a client may READ ----

/// One bucket: a 32-byte header (overflow count) and [`SLOTS`] slots.
pub const BUCKET_LEN: usize = 256;

pub const SLOT_LEN: usize = 32;

pub const SLOTS: usize = 7;

pub const BUCKET_HEADER_LEN: usize = BUCKET_LEN - SLOTS * SLOT_LEN;

/// The hash of a key, which picks its bucket and (never 0) tags its slot.
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64(key).max(1)
}

/// One index slot: tag 0 is empty. The server writes the other fields
/// before the tag when filling a slot and clears the tag first when emptying
/// it; a reader that still sees a torn slot is caught by [`verify_block`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Slot {
    pub tag: u64,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl Slot {
    /// The slot at the start of `b`; `None` when `b` is shorter than one.
    pub fn decode(b: &[u8]) -> Option<Slot> {
        let b = b.get(..SLOT_LEN)?;
        Some(Slot {
            tag: u64_at(b, 0),
            addr: u64_at(b, 8),
            len: u64_at(b, 16),
            rkey: u32_at(b, 24),
        })
    }
}

/// A bucket as read by a client: its overflow count (entries that did not
/// fit, found only by asking the server) and its slots. A read of fewer
/// than [`BUCKET_LEN`] bytes cannot tell that a key is absent: it gives the
/// slots wholly present and, without its header, an overflow of
/// `u64::MAX` (ask the server).
pub fn decode_bucket(b: &[u8]) -> (u64, Vec<Slot>) {
    let overflow = b.get(..8).map_or(u64::MAX, |h| u64_at(h, 0));
    let slots = b
        .get(BUCKET_HEADER_LEN..)
        .unwrap_or_default()
        .chunks_exact(SLOT_LEN)
        .take(SLOTS)
        .filter_map(Slot::decode)
        .collect();
    (overflow, slots)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn block_checksums_agree_on_both_paths() {
        let head = [5u8; 24];
        for key_len in [0, 16, SHORT_KEY, SHORT_KEY + 1, 1024] {
            let key = vec![9u8; key_len];
            let mut h = Xxh3::new();
            h.update(&head);
            h.update(&key);
            h.update(&77u64.to_le_bytes());
            assert_eq!(block_checksum(&head, &key, 77), h.digest(), "{key_len}");
        }
    }

    #[test]
    fn blocks_detect_tearing() {
        let (key, value) = (b"hello", vec![7u8; 300]);
        let mut block = vec![0u8; block_len(key.len(), value.len())];
        write_block(&mut block, key, &value, 3);
        assert_eq!(verify_block(&block, key), Some((3, &value[..])));
        assert_eq!(verify_block(&block, b"hellp"), None);
        let mut torn = block.clone();
        torn[200] ^= 1;
        assert_eq!(verify_block(&torn, key), None);
        assert_eq!(verify_block(&block[..block.len() - 1], key), None);
    }

    #[test]
    fn superseded_blocks_verify_only_under_a_lease_and_leased_values_are_hashed() {
        let (key, value) = (b"hello", vec![9u8; 64]);
        let mut block = vec![0u8; block_len(key.len(), value.len())];
        write_block(&mut block, key, &value, 5);
        let split = BLOCK_HEADER_LEN + key.len();
        let leased = |b: &[u8], v: &[u8]| verify_leased_parts(&b[..split], key, v);
        assert_eq!(leased(&block, &value), Some(5));
        block[..4].copy_from_slice(&SUPERSEDED_MAGIC.to_le_bytes());
        assert_eq!(verify_block(&block, key), None);
        assert_eq!(leased(&block, &value), Some(5));
        // The lease ended before the value's READ landed: the chunk was
        // freed (zeroed) or holds another value of the same length.
        assert_eq!(leased(&block, &[0u8; 64]), None);
        assert_eq!(leased(&block, &[8u8; 64]), None);
        assert_eq!(leased(&block, &value[..63]), None);
        block[..4].fill(0); // freed
        assert_eq!(leased(&block, &value), None);
    }
}
