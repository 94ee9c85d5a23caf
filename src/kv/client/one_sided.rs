//! GETs without the server's CPU: the client READs the key's index bucket,
//! then the block it points at, and takes the value only if the block
//! verifies as the key's current value (key, length, checksum, and not
//! superseded). Where a key's block was found is remembered, so the next
//! GET of it is one READ.

use rustc_hash::FxHashMap;

use smallvec::SmallVec;

use crate::copy;
use crate::kv::pool::SLAB_PAGE;
use crate::kv::proto::{
    decode_bucket, key_hash, u32_at, verify_block, BLOCK_HEADER_LEN, BLOCK_MAGIC, BUCKET_LEN,
    SUPERSEDED_MAGIC,
};
use crate::kv::{check_key, KvError, Result};
use crate::verbs::RemoteAddr;

use super::bounce::BounceGuard;
use super::{collect_batch, copy_into, Client, Each, GetResult, BATCH_WINDOW, GROUP_BYTES};

/// One-sided lookups retried this often (a torn read) before asking the
/// server.
const ONE_SIDED_TRIES: usize = 8;

/// Keys whose location a client remembers; past this the memory is dropped
/// and refilled (a bound, not a policy: one-sided GETs of a working set
/// larger than this take two round trips).
const MAX_LOCATIONS: usize = 4096;

/// Where a key's block sat in the server's pool when last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Location {
    addr: u64,
    /// At most a slab page (checked before it is remembered).
    len: u64,
}

/// Where blocks were last read, by their key's hash ([`key_hash`]): a hash
/// of our own program's keys, so a multiply of it is hash enough, and no
/// key is copied to remember it. Two keys of one hash share a place; the
/// READ's verification (the block names its key) tells whose it is, and
/// the other key's GET looks its block up again.
pub(super) type Locations = FxHashMap<u64, Location>;

/// Indexes of a window of keys, on the stack (a batch allocates nothing in
/// its steady state).
type Chunk = SmallVec<[usize; BATCH_WINDOW]>;

/// A block a window will READ.
#[derive(Debug, Clone, Copy)]
struct BlockRead {
    /// The key's index.
    key: usize,
    /// Its [`key_hash`], computed once per key.
    hash: u64,
    at: Location,
    /// Read from where the key was remembered, not from its bucket.
    remembered: bool,
}

type Reads = SmallVec<[BlockRead; BATCH_WINDOW]>;

/// What a key's index bucket says about it.
#[derive(Debug, PartialEq, Eq)]
enum InBucket {
    /// Blocks in the pool that may hold the key (its hash tag, a plausible
    /// length).
    Maybe(Vec<Location>),
    /// Not in the index (no slot has its tag and nothing overflowed).
    Missing,
    /// A slot with its tag held nonsense: a torn read of the bucket.
    Torn,
    /// In the bucket's overflow, or in a block outside the pool: only the
    /// server can answer.
    AskServer,
}

impl Client {
    /// A GET without the server's CPU: READs the key's index bucket, then
    /// the block it points at, and verifies what it read (key, length,
    /// checksum). A torn or recycled read is retried; a key in the bucket's
    /// overflow, or a value outside the slab pool, is asked of the server.
    pub fn get_one_sided(&self, key: &[u8]) -> Result<(Vec<u8>, u64)> {
        self.get_one_sided_with(key, copy::to_vec)
    }

    /// [`Client::get_one_sided`], lending the value to `take` as
    /// [`Client::get_with`] does.
    pub fn get_one_sided_with<T>(
        &self,
        key: &[u8],
        take: impl FnOnce(&[u8]) -> T,
    ) -> Result<(T, u64)> {
        check_key(key)?;
        let hash = key_hash(key);
        // Used up only by the read that finds the value, which returns.
        let mut take = Some(take);
        if let Some(at) = self.known_location(hash) {
            // A remembered block is one READ, which counts only if it
            // verifies as the key's current value (the server marks a block
            // superseded before it answers the write or delete that replaced
            // it, so nothing older than the two-step lookup could return is
            // taken); if it moved, look it up.
            let mut b = self.lock_bounce(at.len as usize)?;
            if let Some(found) = self.read_at(&mut b, key, hash, at, true, &mut take)? {
                return Ok(found);
            }
            // Moved, or the place of another key of the same hash.
            self.forget_if(hash, at);
        }
        for _ in 0..ONE_SIDED_TRIES {
            // Room for the bucket and for any block of the pool.
            let mut b = self.lock_bounce(SLAB_PAGE)?;
            self.transfer(true, &b, 0, self.bucket_of(hash), BUCKET_LEN)?;
            match look_in_bucket(b.bytes(BUCKET_LEN), key.len(), hash, self.info.pool_rkey) {
                InBucket::Missing => {
                    self.forget(hash);
                    return Err(KvError::NotFound);
                }
                InBucket::AskServer => break,
                InBucket::Torn => continue,
                InBucket::Maybe(places) => {
                    for at in places {
                        if let Some(found) =
                            self.read_at(&mut b, key, hash, at, false, &mut take)?
                        {
                            return Ok(found);
                        }
                    }
                }
            }
        }
        match take {
            Some(take) => self.get_with(key, take),
            None => unreachable!("the value was taken without being returned"),
        }
    }

    /// [`Client::get_one_sided`] into `buf`, as [`Client::get_into`] does.
    pub fn get_one_sided_into(&self, key: &[u8], buf: &mut [u8]) -> Result<(usize, u64)> {
        let (copied, version) = self.get_one_sided_with(key, |v| copy_into(buf, v))?;
        Ok((copied?, version))
    }

    /// GETs several keys as [`Client::get_one_sided`] does, up to 64 at a
    /// time: the buckets of the keys whose block is not remembered are READ
    /// together, then the blocks, each verified as it arrives while the
    /// later ones are still in flight. A remembered block that moved is
    /// looked up again; what the index cannot answer at once (a torn read,
    /// a key in overflow or outside the pool) is GET from the server in one
    /// [`Client::batch_get`]. One result per key, in order.
    pub fn batch_get_one_sided(&self, keys: &[&[u8]]) -> Vec<GetResult> {
        collect_batch(keys.len(), |each| self.batch_get_one_sided_with(keys, each))
    }

    /// [`Client::batch_get_one_sided`], lending each value to `each` as
    /// [`Client::batch_get_with`] does.
    pub fn batch_get_one_sided_with(
        &self,
        keys: &[&[u8]],
        mut each: impl FnMut(usize, Result<(&[u8], u64)>),
    ) {
        // Allocated only for keys the index cannot answer.
        let mut ask_server = Vec::new();
        let mut next = 0;
        while next < keys.len() {
            // The valid keys' indexes, up to a window of them, on the stack.
            let mut chunk = Chunk::new();
            while next < keys.len() && chunk.len() < BATCH_WINDOW {
                match check_key(keys[next]) {
                    Ok(()) => chunk.push(next),
                    Err(e) => each(next, Err(e)),
                }
                next += 1;
            }
            if chunk.is_empty() {
                break;
            }
            let asked = ask_server.len();
            let mut answered = [false; BATCH_WINDOW];
            let mut answer = |i: usize, r: Result<(&[u8], u64)>| {
                if let Ok(n) = chunk.binary_search(&i) {
                    answered[n] = true;
                }
                each(i, r);
            };
            if let Err(e) = self.one_sided_chunk(keys, &chunk, &mut answer, &mut ask_server) {
                // The connection failed: what this chunk has not answered
                // yet gets the error (the server would not answer it either).
                ask_server.truncate(asked);
                for (n, &i) in chunk.iter().enumerate() {
                    if !answered[n] {
                        each(i, Err(e.clone()));
                    }
                }
            }
        }
        if !ask_server.is_empty() {
            let server_keys: Vec<&[u8]> = ask_server.iter().map(|&i| keys[i]).collect();
            self.batch_get_with(&server_keys, |j, r| each(ask_server[j], r));
        }
    }

    /// [`Client::batch_get_one_sided`] for the keys `chunk` (indexes into
    /// `keys`); the keys it leaves to the server go to `ask_server`. An
    /// error here (the connection failed, or no transfer buffer) is one for
    /// the keys of the chunk not answered yet.
    fn one_sided_chunk(
        &self,
        keys: &[&[u8]],
        chunk: &[usize],
        each: &mut Each<'_>,
        ask_server: &mut Vec<usize>,
    ) -> Result<()> {
        let mut bounce = self.lock_bounce(GROUP_BYTES)?;
        let mut reads = Reads::new();
        let mut unknown = Chunk::new();
        {
            let known = self.locations.lock().expect("location lock");
            for &key in chunk {
                let hash = key_hash(keys[key]);
                match known.get(&hash) {
                    Some(&at) => reads.push(BlockRead {
                        key,
                        hash,
                        at,
                        remembered: true,
                    }),
                    None => unknown.push(key),
                }
            }
        }
        self.find_blocks(&mut bounce, keys, &unknown, &mut reads, each, ask_server)?;
        let mut moved = Chunk::new();
        for r in self.read_blocks(&mut bounce, keys, &reads, each)? {
            if r.remembered {
                self.forget_if(r.hash, r.at);
                moved.push(r.key);
            } else {
                ask_server.push(r.key);
            }
        }
        // A remembered block that moved: its key is looked up in the index
        // once more; what does not verify then is the server's to answer.
        reads.clear();
        self.find_blocks(&mut bounce, keys, &moved, &mut reads, each, ask_server)?;
        let missed = self.read_blocks(&mut bounce, keys, &reads, each)?;
        ask_server.extend(missed.into_iter().map(|r| r.key));
        Ok(())
    }

    /// READs the index buckets of `keys[i]` for each `i` in `unknown` (one
    /// doorbell) and adds the block each points at to `reads`; a missing
    /// key's result becomes not-found, and what the bucket cannot answer
    /// goes to `ask_server`.
    fn find_blocks(
        &self,
        bounce: &mut BounceGuard<'_>,
        keys: &[&[u8]],
        unknown: &[usize],
        reads: &mut Reads,
        each: &mut Each<'_>,
        ask_server: &mut Vec<usize>,
    ) -> Result<()> {
        if unknown.is_empty() {
            return Ok(());
        }
        let hashes: SmallVec<[u64; BATCH_WINDOW]> =
            unknown.iter().map(|&i| key_hash(keys[i])).collect();
        let ops: SmallVec<[_; BATCH_WINDOW]> = hashes
            .iter()
            .enumerate()
            .map(|(n, &hash)| {
                let local = bounce.addr + (n * BUCKET_LEN) as u64;
                (local, self.bucket_of(hash), BUCKET_LEN as u32)
            })
            .collect();
        self.conn.read_sync_many(bounce.lkey, &ops)?;
        for (n, (&i, &hash)) in unknown.iter().zip(&hashes).enumerate() {
            let bucket = bounce.at(n * BUCKET_LEN, BUCKET_LEN);
            match look_in_bucket(bucket, keys[i].len(), hash, self.info.pool_rkey) {
                InBucket::Missing => each(i, Err(KvError::NotFound)),
                // A tag shared by two slots is for the server to sort out.
                InBucket::Maybe(places) if places.len() == 1 => reads.push(BlockRead {
                    key: i,
                    hash,
                    at: places[0],
                    remembered: false,
                }),
                _ => ask_server.push(i),
            }
        }
        Ok(())
    }

    /// READs the blocks `reads` names side by side into the bounce buffer,
    /// up to its size at a time with one doorbell, and verifies and copies
    /// out each while the later ones are still in flight. Returns the reads
    /// whose block did not verify.
    fn read_blocks(
        &self,
        bounce: &mut BounceGuard<'_>,
        keys: &[&[u8]],
        reads: &[BlockRead],
        each: &mut Each<'_>,
    ) -> Result<Reads> {
        let mut moved = SmallVec::new();
        let mut rest = reads;
        while !rest.is_empty() {
            // Every block is at most a slab page, so at least one fits.
            let mut used = 0;
            let group = rest
                .iter()
                .take_while(|r| {
                    used += r.at.len as usize;
                    used <= bounce.len
                })
                .count()
                .max(1);
            let (now, later) = rest.split_at(group);
            rest = later;
            let mut offset = 0;
            let ops: SmallVec<[_; BATCH_WINDOW]> = now
                .iter()
                .map(|&BlockRead { at, .. }| {
                    let local = bounce.addr + offset as u64;
                    offset += at.len as usize;
                    let remote = RemoteAddr {
                        addr: at.addr,
                        rkey: self.info.pool_rkey,
                    };
                    (local, remote, at.len as u32)
                })
                .collect();
            // SAFETY: each range is looked at only after `wait_through` has
            // waited for its READ, and the guard is dropped (waiting for
            // all) before the bounce buffer can be used again.
            let mut pending = unsafe { self.conn.start_reads(bounce.lkey, &ops)? };
            for (n, (r, &(local, _, len))) in now.iter().zip(&ops).enumerate() {
                pending.wait_through(n)?;
                let offset = (local - bounce.addr) as usize;
                match verify_block(bounce.at(offset, len as usize), keys[r.key]) {
                    Some((version, value)) => {
                        each(r.key, Ok((value, version)));
                        if !r.remembered {
                            self.remember(r.hash, r.at);
                        }
                    }
                    None => moved.push(*r),
                }
            }
        }
        Ok(moved)
    }

    /// Where `hash`'s index bucket is on the server.
    fn bucket_of(&self, hash: u64) -> RemoteAddr {
        let bucket = hash % self.info.buckets.max(1);
        RemoteAddr {
            addr: self.info.index_addr + bucket * BUCKET_LEN as u64,
            rkey: self.info.index_rkey,
        }
    }

    /// READs the block at `at` and, if it verifies as the key's current
    /// one, lends its value to `take` (and remembers where it was for the
    /// key's `hash`, unless it was `remembered` there); `None` otherwise.
    fn read_at<T>(
        &self,
        b: &mut BounceGuard<'_>,
        key: &[u8],
        hash: u64,
        at: Location,
        remembered: bool,
        take: &mut Option<impl FnOnce(&[u8]) -> T>,
    ) -> Result<Option<(T, u64)>> {
        let len = at.len as usize;
        let remote = RemoteAddr {
            addr: at.addr,
            rkey: self.info.pool_rkey,
        };
        self.transfer(true, b, 0, remote, len)?;
        let Some((version, value)) = verify_block(b.bytes(len), key) else {
            return Ok(None);
        };
        // A remembered place is already known: not inserted again.
        if !remembered {
            self.remember(hash, at);
        }
        Ok(take.take().map(|take| (take(value), version)))
    }

    /// Where the block of the key of `hash` was last read.
    fn known_location(&self, hash: u64) -> Option<Location> {
        self.locations
            .lock()
            .expect("location lock")
            .get(&hash)
            .copied()
    }

    fn remember(&self, hash: u64, at: Location) {
        let mut known = self.locations.lock().expect("location lock");
        if known.len() >= MAX_LOCATIONS && !known.contains_key(&hash) {
            known.clear();
        }
        known.insert(hash, at);
    }

    fn forget(&self, hash: u64) {
        self.locations.lock().expect("location lock").remove(&hash);
    }

    /// Forgets `at` as the place of the key of `hash`, unless another place
    /// was remembered for that hash since (by another key of the hash, or
    /// another thread).
    fn forget_if(&self, hash: u64, at: Location) {
        let mut known = self.locations.lock().expect("location lock");
        if known.get(&hash) == Some(&at) {
            known.remove(&hash);
        }
    }
}

/// Checks a block READ under a lease (a copy in `block`, ours to change)
/// as fully as one READ by address: key, lengths and checksum. A lease can
/// end before the READ lands (the server caps and expires leases), and the
/// block may then be freed and reused: only the checksum tells. A block
/// superseded since the lease was given is still whole; it was sealed as
/// current, so it is checked with the current mark restored in the copy.
pub(super) fn verify_leased<'a>(block: &'a mut [u8], key: &[u8]) -> Option<(u64, &'a [u8])> {
    if block.len() >= 4 && u32_at(block, 0) == SUPERSEDED_MAGIC {
        block[..4].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    }
    verify_block(block, key)
}

/// Reads a key's bucket: the slots with the key's hash tag (`hash`) whose
/// block lies in the pool (`pool_rkey`) with room for a `key_len`-byte key.
fn look_in_bucket(bucket: &[u8], key_len: usize, hash: u64, pool_rkey: u32) -> InBucket {
    let (overflow, slots) = decode_bucket(bucket);
    let mut places = Vec::new();
    let mut torn = false;
    for slot in slots.iter().filter(|s| s.tag == hash) {
        if slot.rkey != pool_rkey {
            return InBucket::AskServer;
        }
        if (BLOCK_HEADER_LEN + key_len..=SLAB_PAGE).contains(&(slot.len as usize)) {
            places.push(Location {
                addr: slot.addr,
                len: slot.len,
            });
        } else {
            torn = true;
        }
    }
    if !places.is_empty() {
        InBucket::Maybe(places)
    } else if torn {
        InBucket::Torn
    } else if overflow > 0 {
        InBucket::AskServer
    } else {
        InBucket::Missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::index::Index;
    use crate::kv::proto::{block_len, seal_block, value_checksum, Slot};

    const POOL: u32 = 7;

    fn slot(tag: u64, addr: u64, len: u64, rkey: u32) -> Slot {
        Slot {
            tag,
            addr,
            len,
            rkey,
        }
    }

    fn look(ix: &Index, hash: u64) -> InBucket {
        // SAFETY: test, single thread.
        let bytes = unsafe { ix.mapping().bytes_mut(0, BUCKET_LEN) }.to_vec();
        look_in_bucket(&bytes, 3, hash, POOL)
    }

    #[test]
    fn a_bucket_answers_found_missing_torn_or_ask_the_server() {
        let ix = Index::new(1).unwrap();
        assert_eq!(look(&ix, 5), InBucket::Missing);
        ix.insert(0, slot(5, 4096, 100, POOL));
        let at = Location {
            addr: 4096,
            len: 100,
        };
        assert_eq!(look(&ix, 5), InBucket::Maybe(vec![at]));
        assert_eq!(look(&ix, 6), InBucket::Missing, "another tag");
        // Too short for the header and key, or longer than a slab page: a
        // torn read of the slot.
        ix.insert(0, slot(8, 8192, 10, POOL));
        ix.insert(0, slot(9, 8192, SLAB_PAGE as u64 + 1, POOL));
        assert_eq!(look(&ix, 8), InBucket::Torn);
        assert_eq!(look(&ix, 9), InBucket::Torn);
        // A value in its own registration, not the pool.
        ix.insert(0, slot(10, 0, 100, POOL + 1));
        assert_eq!(look(&ix, 10), InBucket::AskServer);
        // Two slots with one tag: both are candidates.
        ix.insert(0, slot(5, 12288, 200, POOL));
        let second = Location {
            addr: 12288,
            len: 200,
        };
        assert_eq!(look(&ix, 5), InBucket::Maybe(vec![at, second]));
        // Full bucket: a key not in a slot may be in the overflow.
        for t in 20..30 {
            ix.insert(0, slot(t, 4096, 100, POOL));
        }
        assert_eq!(look(&ix, 99), InBucket::AskServer);
    }

    #[test]
    fn a_leased_block_is_checksummed_superseded_or_not() {
        let (key, value) = (b"big", vec![5u8; 5000]);
        let mut block = vec![0u8; block_len(key.len(), value.len())];
        block[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + key.len()].copy_from_slice(key);
        block[BLOCK_HEADER_LEN + key.len()..].copy_from_slice(&value);
        seal_block(&mut block, key.len(), value_checksum(&value), 4);
        let mut read = block.clone();
        assert_eq!(verify_leased(&mut read, key), Some((4, &value[..])));
        let mut superseded = block.clone();
        superseded[..4].copy_from_slice(&SUPERSEDED_MAGIC.to_le_bytes());
        assert_eq!(verify_leased(&mut superseded, key), Some((4, &value[..])));
        // The lease ended and the memory was reused under the same header:
        // the value no longer matches the checksum.
        for mut reused in [block.clone(), superseded] {
            let at = reused.len() - 100;
            reused[at] ^= 0x40;
            assert_eq!(verify_leased(&mut reused, key), None);
        }
    }
}
