//! The authoritative key-value map: items in shards (each owning a fixed set
//! of index buckets), their blocks in the slab pool or in their own
//! registered mappings, versions and CAS.
//!
//! A block is reference counted: the map holds one reference, and a client
//! reading it remotely holds another (its lease) until it says it is done or
//! goes away, so memory a server-path reader is reading is never reused.

use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::runtime::Window;
use crate::verbs::{AccessFlags, Context, MemoryRegion, ProtectionDomain, RemoteRegion};

use super::index::{Index, Place};
use super::limits::Episode;
use super::pool::{Chunk, Mapping, Pool, SLAB_PAGE};
use super::proto::{
    block_len, key_hash, seal_block, value_checksum, Slot, BLOCK_HEADER_LEN, SUPERSEDED_MAGIC,
};
use super::{check_key, KvError, Result, MAX_KEY_LEN};

const SHARDS: usize = 64;

/// The registrations of the pool and the index on the server's device.
pub struct DeviceMem {
    pub pd: ProtectionDomain,
    pub pool_mr: MemoryRegion,
    pub index_mr: MemoryRegion,
}

enum Memory {
    Pool(Chunk),
    /// A value larger than the largest class, or one written into a target;
    /// held for their drops (deregistration, then unmapping).
    Own {
        _mr: MemoryRegion,
        _map: Mapping,
        _counted: OwnBytes,
    },
}

/// Bytes counted against the large-value quota until dropped.
struct OwnBytes {
    len: u64,
    total: Arc<AtomicU64>,
}

impl Drop for OwnBytes {
    fn drop(&mut self) {
        self.total.fetch_sub(self.len, Ordering::Relaxed);
    }
}

/// A stored block (header, key, value) somewhere a client may READ it.
pub struct Block {
    mem: Memory,
    len: usize,
    pool: Arc<Pool>,
    addr: u64,
    rkey: u32,
}

impl Block {
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The value of a block holding a `key_len`-byte key.
    pub fn value(&self, key_len: usize) -> &[u8] {
        let start = (BLOCK_HEADER_LEN + key_len).min(self.len);
        // SAFETY: after the header, a published block is never written
        // again until freed, which needs this reference gone.
        unsafe { std::slice::from_raw_parts((self.addr as *const u8).add(start), self.len - start) }
    }

    /// Marks the block as no longer its key's current value (replaced or
    /// deleted): a one-sided reader that finds it by a remembered address
    /// then looks the key up again, while a reader holding a lease may
    /// still take it ([`super::proto::verify_leased_parts`]).
    fn supersede(&self) {
        // SAFETY: the block's first four bytes, 4-byte aligned (chunks and
        // mappings are); no Rust reference covers the header once published.
        let magic = unsafe { &*(self.addr as *const AtomicU32) };
        magic.store(
            u32::from_ne_bytes(SUPERSEDED_MAGIC.to_le_bytes()),
            Ordering::Release,
        );
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: not published yet: only we can reach it.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        match self.mem {
            Memory::Pool(chunk) => self.pool.free(chunk),
            // Deregistered, then unmapped, then uncounted (field order).
            Memory::Own { .. } => {}
        }
    }
}

/// A write target handed to one client (values larger than its request
/// buffer): the value part is registered writable for that client only
/// until the commit. Dropped (released), it ends the client's access
/// without waiting for its window's bind: one that waits behind sends the
/// client has not taken leaves the memory with the connection until the
/// bind completes or the connection ends ([`Window::release_with`]).
pub struct Target {
    /// Taken by `commit`; otherwise released as the target drops.
    mem: Option<Exposed>,
    remote: RemoteRegion,
    key_len: usize,
    value_len: usize,
}

/// A target's memory, and the window that exposes its value part.
struct Exposed {
    /// The value part, registered for window binding only, and exposed to
    /// the one client through a window on its QP.
    write: Window,
    map: Mapping,
    counted: OwnBytes,
}

impl Exposed {
    /// Ends the client's access, then lets the memory go (at once, or once
    /// the window's bind completes).
    fn release(self) {
        let Exposed {
            write,
            map,
            counted,
        } = self;
        write.release_with((map, counted));
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            mem.release();
        }
    }
}

impl Target {
    pub fn value_addr(&self) -> u64 {
        self.remote.addr
    }

    pub fn rkey(&self) -> u32 {
        self.remote.rkey
    }

    pub fn value_len(&self) -> usize {
        self.value_len
    }
}

struct Item {
    block: Arc<Block>,
    version: u64,
    place: Place,
}

#[derive(Default)]
struct Shard {
    items: HashMap<Box<[u8]>, Item>,
}

/// Fields drop in order: the registrations (`device`) go before the pool
/// and index mappings they cover.
pub struct Store {
    device: OnceLock<DeviceMem>,
    shards: Vec<Mutex<Shard>>,
    index: Index,
    pool: Arc<Pool>,
    pub max_value: u64,
    items: AtomicU64,
    own_bytes: Arc<AtomicU64>,
    /// Bound of `own_bytes` ([`super::Limits::large_value_quota`]).
    pub large_quota: AtomicU64,
    quota_refusals: AtomicU64,
    quota_episode: Episode,
}

impl Store {
    pub fn new(pool_bytes: usize, huge: bool, buckets: usize, max_value: u64) -> Result<Store> {
        let nomem = |what: &str, e: std::io::Error| match e.kind() {
            std::io::ErrorKind::InvalidInput => KvError::InvalidArgument(format!("{what}: {e}")),
            _ => KvError::Internal(format!("{what}: {e}")),
        };
        Ok(Store {
            device: OnceLock::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            index: Index::new(buckets).map_err(|e| nomem("mapping the index", e))?,
            pool: Arc::new(Pool::new(pool_bytes, huge).map_err(|e| nomem("mapping the pool", e))?),
            max_value,
            items: AtomicU64::new(0),
            own_bytes: Arc::new(AtomicU64::new(0)),
            large_quota: AtomicU64::new(u64::MAX),
            quota_refusals: AtomicU64::new(0),
            quota_episode: Episode::default(),
        })
    }

    /// The protection domain of `ctx`, with the pool and index registered
    /// in it (once: the store serves one device).
    pub fn attach(&self, ctx: &Context) -> Result<ProtectionDomain> {
        if let Some(dev) = self.device.get() {
            if dev.pd.context().as_raw() == ctx.as_raw() {
                return Ok(dev.pd.clone());
            }
            return Err(KvError::Internal(format!(
                "this server serves device {}; a client came through {}",
                dev.pd.context().name(),
                ctx.name()
            )));
        }
        let pd = ctx.alloc_pd()?;
        let read = AccessFlags::REMOTE_READ;
        let pool = self.pool.mapping();
        let ix = self.index.mapping();
        // SAFETY: pool and index live as long as the store, which owns the
        // registrations too.
        let pool_mr = unsafe { pd.register_raw(pool.as_ptr(), pool.len(), read)? };
        let index_mr = unsafe { pd.register_raw(ix.as_ptr(), ix.len(), read)? };
        let dev = DeviceMem {
            pd,
            pool_mr,
            index_mr,
        };
        let _ = self.device.set(dev);
        self.attach(ctx)
    }

    pub fn device(&self) -> Option<&DeviceMem> {
        self.device.get()
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    pub fn items(&self) -> u64 {
        self.items.load(Ordering::Relaxed)
    }

    /// Bytes in values stored outside the pool.
    pub fn own_bytes(&self) -> u64 {
        self.own_bytes.load(Ordering::Relaxed)
    }

    /// Large values refused for the quota.
    pub fn quota_refusals(&self) -> u64 {
        self.quota_refusals.load(Ordering::Relaxed)
    }

    /// Counts `len` more bytes outside the pool, unless that passes the
    /// quota (then: no memory, counted and logged).
    fn count_own(&self, len: usize) -> Result<OwnBytes> {
        let len = len as u64;
        let quota = self.large_quota.load(Ordering::Relaxed);
        let mut now = self.own_bytes.load(Ordering::Relaxed);
        loop {
            if now.saturating_add(len) > quota {
                self.quota_refusals.fetch_add(1, Ordering::Relaxed);
                self.quota_episode.hit(|| {
                    format!(
                        "refusing a {len}-byte value: values outside the pool would pass the \
                         quota of {quota} bytes ({now} in use)"
                    )
                });
                return Err(KvError::NoMemory);
            }
            match self.own_bytes.compare_exchange_weak(
                now,
                now + len,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(seen) => now = seen,
            }
        }
        Ok(OwnBytes {
            len,
            total: self.own_bytes.clone(),
        })
    }

    fn device_or_err(&self) -> Result<&DeviceMem> {
        self.device
            .get()
            .ok_or_else(|| KvError::Internal("no device attached".into()))
    }

    fn shard(&self, bucket: usize) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[bucket % SHARDS].lock().expect("shard lock")
    }

    pub fn check_value_len(&self, len: u64) -> Result<()> {
        if len > self.max_value {
            return Err(KvError::ValueTooLong {
                max: self.max_value,
            });
        }
        Ok(())
    }

    /// The block and version of `key`.
    pub fn get(&self, key: &[u8]) -> Result<(Arc<Block>, u64)> {
        let bucket = self.index.bucket_of(key_hash(key));
        let shard = self.shard(bucket);
        let item = shard.items.get(key).ok_or(KvError::NotFound)?;
        Ok((item.block.clone(), item.version))
    }

    /// Memory for a block of `len` bytes: a pool chunk when it fits the
    /// largest class, its own mapping otherwise.
    fn new_block(&self, len: usize) -> Result<Block> {
        let dev = self.device_or_err()?;
        if len <= SLAB_PAGE {
            let chunk = self.pool.alloc(len).ok_or(KvError::NoMemory)?;
            return Ok(Block {
                mem: Memory::Pool(chunk),
                len,
                pool: self.pool.clone(),
                addr: self.pool.mapping().as_ptr() as u64 + chunk.offset as u64,
                rkey: dev.pool_mr.rkey(),
            });
        }
        let counted = self.count_own(len)?;
        let map = Mapping::new(len, false).map_err(|_| KvError::NoMemory)?;
        self.own_block(map, len, counted)
    }

    fn own_block(&self, map: Mapping, len: usize, counted: OwnBytes) -> Result<Block> {
        let dev = self.device_or_err()?;
        // SAFETY: the registration is dropped before the mapping (Memory::Own
        // field order).
        let mr = unsafe {
            dev.pd
                .register_raw(map.as_ptr(), len, AccessFlags::REMOTE_READ)
                .map_err(|e| {
                    log::warn!("registering a {len}-byte value: {e}");
                    KvError::NoMemory
                })?
        };
        Ok(Block {
            addr: map.as_ptr() as u64,
            rkey: mr.rkey(),
            len,
            mem: Memory::Own {
                _mr: mr,
                _map: map,
                _counted: counted,
            },
            pool: self.pool.clone(),
        })
    }

    /// Stores `value` under `key` (copying it); `cas` makes it conditional
    /// on the current version (0: the key must be absent). Returns the new
    /// version.
    pub fn put(&self, key: &[u8], value: &[u8], cas: Option<u64>) -> Result<u64> {
        self.check_value_len(value.len() as u64)?;
        let mut block = self.new_block(block_len(key.len(), value.len()))?;
        let bytes = block.bytes_mut();
        bytes[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + key.len()].copy_from_slice(key);
        crate::copy::copy(&mut bytes[BLOCK_HEADER_LEN + key.len()..], value);
        self.publish(key, block, value_checksum(value), cas)
    }

    /// Stores under a `key_len`-byte key a `value_len`-byte value that
    /// `fill` writes, the key before it, straight into the new block (their
    /// one copy): `fill` gets the block's key-and-value bytes and says
    /// whether it filled them all. Until it is published only this call can
    /// reach the block, so the key and the value's hash are taken from what
    /// `fill` wrote. `expect`: the hash the value must have (one the client
    /// sent with a value it wrote into our memory), else nothing is stored.
    pub fn put_filled(
        &self,
        key_len: usize,
        value_len: usize,
        fill: impl FnOnce(&mut [u8]) -> bool,
        expect: Option<u64>,
        cas: Option<u64>,
    ) -> Result<u64> {
        let mut key = [0u8; MAX_KEY_LEN];
        let key = key.get_mut(..key_len).ok_or(KvError::KeyTooLong)?;
        check_key(key)?;
        self.check_value_len(value_len as u64)?;
        let mut block = self.new_block(block_len(key_len, value_len))?;
        let bytes = &mut block.bytes_mut()[BLOCK_HEADER_LEN..];
        if !fill(bytes) {
            return Err(KvError::Internal("the value could not be read".into()));
        }
        key.copy_from_slice(&bytes[..key_len]);
        let hash = value_checksum(&bytes[key_len..]);
        if expect.is_some_and(|expected| expected != hash) {
            return Err(KvError::InvalidArgument(
                "the staged value did not arrive whole (checksum mismatch)".into(),
            ));
        }
        self.publish(key, block, hash, cas)
    }

    /// A write target for a value of `value_len` bytes under a key of
    /// `key_len` bytes; `expose` makes its registration writable by the one
    /// client it is for.
    pub fn target(
        &self,
        key_len: usize,
        value_len: u64,
        expose: impl FnOnce(MemoryRegion) -> Result<Window>,
    ) -> Result<Target> {
        self.check_value_len(value_len)?;
        let value_len = usize::try_from(value_len).map_err(|_| KvError::NoMemory)?;
        let dev = self.device_or_err()?;
        let counted = self.count_own(block_len(key_len, value_len))?;
        let map =
            Mapping::new(block_len(key_len, value_len), false).map_err(|_| KvError::NoMemory)?;
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        // SAFETY: the registration lives in the Target beside the mapping and
        // is dropped (or consumed by `commit`) before it.
        let write_mr = unsafe {
            dev.pd
                .register_raw(
                    map.as_ptr().add(BLOCK_HEADER_LEN + key_len),
                    value_len.max(1),
                    access,
                )
                .map_err(|e| {
                    log::warn!("registering a {value_len}-byte write target: {e}");
                    KvError::NoMemory
                })?
        };
        let write = expose(write_mr)?;
        Ok(Target {
            remote: write.remote(),
            mem: Some(Exposed {
                write,
                map,
                counted,
            }),
            key_len,
            value_len,
        })
    }

    /// Stores what the client wrote into `target`: its write access ends
    /// first, so the value cannot change after the checksum is taken.
    /// When the window's bind has not completed (a client that commits
    /// before it had the reply that carries the rkey, or one whose reply's
    /// acknowledgement is still on its way), the access cannot end without
    /// waiting: the value is copied out into a block of its own instead,
    /// and the target released ([`Target`]).
    pub fn commit(&self, key: &[u8], mut target: Target, cas: Option<u64>) -> Result<u64> {
        if key.len() != target.key_len {
            return Err(KvError::InvalidArgument(
                "the key differs from the one the target was made for".into(),
            ));
        }
        let value_len = target.value_len;
        let Some(mem) = target.mem.take() else {
            return Err(KvError::Internal("the target was stored already".into()));
        };
        if !mem.write.drops_at_once() {
            let stored = self.put_filled(
                key.len(),
                value_len,
                |bytes| {
                    bytes[..key.len()].copy_from_slice(key);
                    mem.write.region().copy_out_to(0, &mut bytes[key.len()..])
                },
                None,
                cas,
            );
            mem.release();
            return stored;
        }
        let Exposed {
            write,
            map,
            counted,
        } = mem;
        drop(write);
        let len = block_len(key.len(), value_len);
        let mut block = self.own_block(map, len, counted)?;
        let bytes = block.bytes_mut();
        bytes[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + key.len()].copy_from_slice(key);
        let hash = value_checksum(&bytes[BLOCK_HEADER_LEN + key.len()..]);
        self.publish(key, block, hash, cas)
    }

    /// Seals `block` with the next version and makes it the key's value.
    fn publish(
        &self,
        key: &[u8],
        mut block: Block,
        value_hash: u64,
        cas: Option<u64>,
    ) -> Result<u64> {
        let hash = key_hash(key);
        let bucket = self.index.bucket_of(hash);
        let mut shard = self.shard(bucket);
        // One lookup serves the CAS check and the update.
        let existing = shard.items.get_mut(key);
        let current = existing.as_ref().map_or(0, |item| item.version);
        if let Some(expected) = cas {
            if expected != current {
                return Err(KvError::CasFailed { current });
            }
        }
        let version = current + 1;
        seal_block(block.bytes_mut(), key.len(), value_hash, version);
        // The block is complete before any index slot points at it.
        fence(Ordering::Release);
        let slot = Slot {
            tag: hash,
            addr: block.addr,
            len: block.len as u64,
            rkey: block.rkey,
        };
        match existing {
            Some(item) => {
                self.index.update(bucket, item.place, slot);
                item.version = version;
                // After the index points at the new block, before the
                // writer's reply: whoever reads the old one by a remembered
                // address from now on finds it superseded. Freed at once
                // unless a lease or a reply in flight still holds it; when
                // nothing does, the new block takes its place in the same
                // allocation, so rewriting a key allocates nothing.
                match Arc::get_mut(&mut item.block) {
                    Some(only) => {
                        let old = std::mem::replace(only, block);
                        old.supersede();
                        drop(shard);
                        drop(old);
                    }
                    None => {
                        let old = std::mem::replace(&mut item.block, Arc::new(block));
                        old.supersede();
                        drop(shard);
                        drop(old);
                    }
                }
            }
            None => {
                let place = self.index.insert(bucket, slot);
                shard.items.insert(
                    key.into(),
                    Item {
                        block: Arc::new(block),
                        version,
                        place,
                    },
                );
                self.items.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(version)
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &[u8]) -> Result<()> {
        let bucket = self.index.bucket_of(key_hash(key));
        let mut shard = self.shard(bucket);
        let item = shard.items.remove(key).ok_or(KvError::NotFound)?;
        self.index.remove(bucket, item.place);
        item.block.supersede();
        drop(shard);
        self.items.fetch_sub(1, Ordering::Relaxed);
        drop(item);
        Ok(())
    }
}
