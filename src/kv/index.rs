//! The hash index clients read one-sidedly: `buckets` buckets of
//! `proto::BUCKET_LEN` bytes in one mapping, registered read-only for
//! clients. The store's shard locks decide who writes which bucket (a bucket
//! belongs to exactly one shard); this module only lays the bytes out, in the
//! order that keeps a concurrent reader safe (see `proto::Slot`).

use std::sync::atomic::{fence, Ordering};

use super::pool::Mapping;
use super::proto::{Slot, BUCKET_HEADER_LEN, BUCKET_LEN, SLOTS, SLOT_LEN};

/// Where an entry sits: a slot of its bucket, or the bucket's overflow
/// (found only by asking the server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Slot(usize),
    Overflow,
}

pub struct Index {
    mem: Mapping,
    buckets: usize,
}

impl Index {
    /// An index of `buckets` buckets (at least one); an `InvalidInput`
    /// error when their bytes would not fit in the address space.
    pub fn new(buckets: usize) -> std::io::Result<Index> {
        let buckets = buckets.max(1);
        let len = buckets.checked_mul(BUCKET_LEN).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{buckets} buckets of {BUCKET_LEN} bytes pass the address space"),
            )
        })?;
        Ok(Index {
            mem: Mapping::new(len, false)?,
            buckets,
        })
    }

    pub fn mapping(&self) -> &Mapping {
        &self.mem
    }

    pub fn buckets(&self) -> usize {
        self.buckets
    }

    pub fn bucket_of(&self, hash: u64) -> usize {
        (hash % self.buckets as u64) as usize
    }

    fn word(&self, bucket: usize, at: usize) -> *mut u64 {
        debug_assert!(bucket < self.buckets && at + 8 <= BUCKET_LEN);
        // SAFETY: in bounds of the mapping (checked above in debug; bucket is
        // always reduced modulo `buckets` by the callers).
        unsafe { self.mem.as_ptr().add(bucket * BUCKET_LEN + at).cast() }
    }

    fn read(&self, bucket: usize, at: usize) -> u64 {
        // SAFETY: aligned, in bounds; written only under the bucket's shard
        // lock, which the caller holds.
        unsafe { self.word(bucket, at).read_volatile() }
    }

    fn write(&self, bucket: usize, at: usize, v: u64) {
        // SAFETY: as `read`.
        unsafe { self.word(bucket, at).write_volatile(v) }
    }

    fn slot_at(i: usize) -> usize {
        BUCKET_HEADER_LEN + i * SLOT_LEN
    }

    /// Publishes a new entry: in a free slot (fields first, tag last), or in
    /// the overflow when the bucket is full.
    ///
    /// The caller holds the bucket's shard lock.
    pub fn insert(&self, bucket: usize, slot: Slot) -> Place {
        for i in 0..SLOTS {
            let at = Self::slot_at(i);
            if self.read(bucket, at) == 0 {
                self.write_fields(bucket, at, &slot);
                fence(Ordering::Release);
                self.write(bucket, at, slot.tag);
                return Place::Slot(i);
            }
        }
        self.write(bucket, 0, self.read(bucket, 0) + 1);
        Place::Overflow
    }

    /// Points an existing entry at a new block (the tag stays, so readers
    /// never miss the key; a torn read fails verification).
    pub fn update(&self, bucket: usize, place: Place, slot: Slot) {
        if let Place::Slot(i) = place {
            self.write_fields(bucket, Self::slot_at(i), &slot);
        }
    }

    /// Removes an entry (tag first).
    pub fn remove(&self, bucket: usize, place: Place) {
        match place {
            Place::Slot(i) => {
                let at = Self::slot_at(i);
                self.write(bucket, at, 0);
                fence(Ordering::Release);
                self.write_fields(bucket, at, &Slot::default());
            }
            Place::Overflow => self.write(bucket, 0, self.read(bucket, 0).saturating_sub(1)),
        }
    }

    fn write_fields(&self, bucket: usize, at: usize, slot: &Slot) {
        self.write(bucket, at + 8, slot.addr);
        self.write(bucket, at + 16, slot.len);
        self.write(bucket, at + 24, u64::from(slot.rkey));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::proto::decode_bucket;

    fn bucket_bytes(ix: &Index, b: usize) -> Vec<u8> {
        // SAFETY: test, single thread.
        unsafe { ix.mapping().bytes_mut(b * BUCKET_LEN, BUCKET_LEN) }.to_vec()
    }

    #[test]
    fn buckets_past_the_address_space_are_an_error_not_a_wrapped_length() {
        let e = Index::new(usize::MAX / BUCKET_LEN + 1).err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn fills_slots_then_overflows_and_removes() {
        let ix = Index::new(4).unwrap();
        let mut places = Vec::new();
        for t in 1..=SLOTS as u64 + 2 {
            places.push(ix.insert(
                1,
                Slot {
                    tag: t,
                    addr: t * 100,
                    len: 64,
                    rkey: 9,
                },
            ));
        }
        assert_eq!(places[SLOTS], Place::Overflow);
        let (overflow, slots) = decode_bucket(&bucket_bytes(&ix, 1));
        assert_eq!(overflow, 2);
        assert_eq!(slots[3].tag, 4);
        assert_eq!(slots[3].addr, 400);
        ix.remove(1, places[3]);
        ix.remove(1, Place::Overflow);
        let (overflow, slots) = decode_bucket(&bucket_bytes(&ix, 1));
        assert_eq!((overflow, slots[3].tag), (1, 0));
        assert_eq!(decode_bucket(&bucket_bytes(&ix, 0)).1[0].tag, 0);
    }
}
