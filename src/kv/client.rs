//! The key-value client: requests as runtime messages, a key and value under
//! 4 KiB together inside them, larger values by RDMA WRITE into the client's request buffer
//! on the server (one round trip) or into a target the server allocates,
//! and by RDMA READ of the stored block. GETs can also be served without the
//! server's CPU ([`Client::get_one_sided`]).
//!
//! A client may be used from several threads; each call waits for its own
//! reply. Calls moving large values take turns (they share one registered
//! bounce buffer).

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::copy;
use crate::runtime::{thread_token, CommMode, ConnHandler, Connection, Options, PendingReads};
use crate::verbs::RemoteAddr;

use super::proto::{
    block_len, is_inline, value_checksum, verify_leased_block, Op, Reply, Request, ServerInfo,
    Source,
};
use super::{check_key, ConnMode, KvError, Result, TIMEOUT_ENV};

mod one_sided;

use one_sided::Locations;

/// Largest single RDMA READ or WRITE: keeps every one well inside the
/// runtime's per-operation time bound even on a slow link.
const MAX_TRANSFER: usize = 16 << 20;
/// Bounce buffer kept between calls; larger ones are freed after use.
const KEEP_BOUNCE: usize = 64 << 20;
/// Requests of a batch in flight at once.
const BATCH_WINDOW: usize = 64;
/// Leases one release message ends at most (1 KiB of them after the
/// header), so a batch ends its leases in one message, not one per value.
const RELEASES_PER_MESSAGE: usize = 128;
/// The bounce buffer a batch's values are READ into side by side, and the
/// largest value read that way (a larger one is read alone).
const GROUP_BYTES: usize = 4 << 20;
/// Staged values of a batch start at multiples of this in the request
/// buffer.
const SLOT_ALIGN: usize = 64;
/// The assumed slowest link, for the time allowed to move a large value.
const SLOWEST_BYTES_PER_SEC: u64 = 4 << 20;

/// How a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    pub mode: ConnMode,
    /// Device name (socket mode); `None`: the first device.
    pub device: Option<String>,
    /// How long to wait for a reply (`SNOWRDMA_KV_TIMEOUT_MS`, default
    /// 10 s), plus time in proportion to the bytes a call moves.
    pub timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        let ms = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(10_000);
        ClientOptions {
            mode: ConnMode::Cm,
            device: None,
            timeout: Duration::from_millis(ms),
        }
    }
}

/// Hashes a request id as itself: ids are sequential, so they spread over
/// the buckets anyway, and SipHash on both sides of every reply is a cost
/// each request pays on its critical path.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }
}

type ById<T> = HashMap<u64, T, BuildHasherDefault<IdHasher>>;

/// Replies by request id, filled by whichever thread polls the connection
/// (a waiting caller, or the completion thread).
#[derive(Default)]
struct Replies {
    inbox: Mutex<Inbox>,
    arrived: AtomicU64,
    dead: AtomicBool,
    /// Whether `abandoned` may hold ids: spares the sending path the lock.
    any_abandoned: AtomicBool,
}

#[derive(Default)]
struct Inbox {
    ready: ById<(Reply, Vec<u8>)>,
    /// Requests whose callers gave up waiting: their replies, if they
    /// come, are dropped, and what they hold on the server is released.
    abandoned: HashSet<u64, BuildHasherDefault<IdHasher>>,
}

impl Replies {
    /// Gives up on request `id`: returns its reply if it came after all.
    fn abandon(&self, id: u64) -> Option<(Reply, Vec<u8>)> {
        let mut inbox = self.inbox.lock().expect("reply lock");
        let reply = inbox.ready.remove(&id);
        if reply.is_none() {
            inbox.abandoned.insert(id);
            self.any_abandoned.store(true, Ordering::Release);
        }
        reply
    }

    /// Ids wrap: a request taking the id of one whose reply never came
    /// must not have its own reply dropped.
    fn reuse(&self, id: u64) {
        if self.any_abandoned.load(Ordering::Acquire) {
            let mut inbox = self.inbox.lock().expect("reply lock");
            inbox.abandoned.remove(&id);
            if inbox.abandoned.is_empty() {
                self.any_abandoned.store(false, Ordering::Release);
            }
        }
    }
}

struct ReplyHandler(Arc<Replies>);

impl ConnHandler for ReplyHandler {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let Ok((reply, payload)) = Reply::decode(data) else {
            log::warn!("ignoring a malformed reply from the server");
            return;
        };
        let mut inbox = self.0.inbox.lock().expect("reply lock");
        if inbox.abandoned.remove(&reply.req_id) {
            drop(inbox);
            // A lease or write target nobody will use: ended now, rather
            // than held until we disconnect (and counted against our
            // limit of targets meanwhile).
            // On this connection's polling thread the send never waits: a
            // full ring queues it.
            if reply.status == 0 && reply.lease != 0 {
                send_releases(conn, &[reply.lease]);
            }
            return;
        }
        inbox.ready.insert(reply.req_id, (reply, payload.to_vec()));
        drop(inbox);
        self.0.arrived.fetch_add(1, Ordering::Release);
    }

    fn disconnected(&self, _conn: &Connection) {
        self.0.dead.store(true, Ordering::Release);
    }
}

/// Ends leases or write targets, up to [`RELEASES_PER_MESSAGE`] in one
/// message. Releases get no reply, so they take no request id; losing one
/// only keeps the memory a little longer (until we disconnect).
fn send_releases(conn: &Connection, leases: &[u64]) {
    for part in leases.chunks(RELEASES_PER_MESSAGE) {
        let (release, more) = Request::release(part);
        let _ = conn.send(&release.encode(&more, &[]));
    }
}

/// Registered memory large values pass through.
struct Bounce {
    raw: *mut rdma_sys::ibv_mr,
    addr: u64,
    len: usize,
    lkey: u32,
}

// SAFETY: the registration is only used under the client's bounce lock.
unsafe impl Send for Bounce {}

impl Bounce {
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        self.at(0, len)
    }

    /// `len` bytes from `offset` (cut short at the buffer's end).
    fn at(&mut self, offset: usize, len: usize) -> &mut [u8] {
        let offset = offset.min(self.len);
        // SAFETY: registered memory of `self.len` bytes owned by the
        // connection; the bounce lock makes us its only user.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.addr as *mut u8).add(offset),
                len.min(self.len - offset),
            )
        }
    }

    /// The bytes from `offset` as the value to RDMA WRITE to `remote`.
    fn staged(&self, offset: usize, remote: RemoteAddr, len: usize) -> Staged {
        Staged {
            local: self.addr + offset as u64,
            lkey: self.lkey,
            remote,
            len,
        }
    }
}

/// A value in the bounce buffer to RDMA WRITE ahead of its request.
struct Staged {
    local: u64,
    lkey: u32,
    remote: RemoteAddr,
    len: usize,
}

/// The locked bounce buffer; a buffer over [`KEEP_BOUNCE`] is freed when
/// the guard goes.
struct BounceGuard<'c> {
    slot: MutexGuard<'c, Option<Bounce>>,
    conn: &'c Connection,
    holder: &'c AtomicUsize,
}

impl std::ops::Deref for BounceGuard<'_> {
    type Target = Bounce;
    fn deref(&self) -> &Bounce {
        self.slot.as_ref().expect("bounce buffer")
    }
}

impl std::ops::DerefMut for BounceGuard<'_> {
    fn deref_mut(&mut self) -> &mut Bounce {
        self.slot.as_mut().expect("bounce buffer")
    }
}

impl Drop for BounceGuard<'_> {
    fn drop(&mut self) {
        self.holder.store(0, Ordering::Release);
        if self.slot.as_ref().is_some_and(|b| b.len > KEEP_BOUNCE) {
            if let Some(big) = self.slot.take() {
                self.conn.deregister(big.raw);
            }
        }
    }
}

/// A batch's leased blocks being READ side by side into the bounce buffer,
/// each as soon as its reply is in, so the server answers the batch's later
/// requests while the earlier values move.
struct BlockReads<'c> {
    client: &'c Client,
    /// Key index, offset in the bounce buffer, block length, and the READ
    /// (declared before `bounce`: dropped, so waited for, first).
    pending: Vec<(usize, usize, usize, PendingReads<'c>)>,
    leases: Vec<u64>,
    used: usize,
    bounce: BounceGuard<'c>,
}

impl BlockReads<'_> {
    /// Starts the READ of `keys[i]`'s block, after finishing the earlier
    /// ones when the buffer is full. Its answer goes to `each`, now if
    /// posting fails, otherwise at [`BlockReads::finish`].
    fn start(&mut self, keys: &[&[u8]], i: usize, reply: &Reply, each: &mut Each<'_>) {
        let len = block_len(keys[i].len(), reply.value_len as usize);
        if self.used + len > self.bounce.len {
            self.finish(keys, each);
        }
        self.leases.push(reply.lease);
        let remote = RemoteAddr {
            addr: reply.addr,
            rkey: reply.rkey,
        };
        let local = self.bounce.addr + self.used as u64;
        // SAFETY: the range is looked at only after `finish` has waited for
        // its READ, and the guard is dropped before the bounce lock is let go
        // (field order).
        let read = unsafe {
            self.client
                .conn
                .start_reads(self.bounce.lkey, &[(local, remote, len as u32)])
        };
        match read {
            Ok(read) => {
                self.pending.push((i, self.used, len, read));
                self.used += len;
            }
            Err(e) => each(i, Err(e.into())),
        }
    }

    /// Waits for the READs in order, hands each verified value to `each`
    /// (the later READs still in flight), and ends the leases.
    fn finish(&mut self, keys: &[&[u8]], each: &mut Each<'_>) {
        for (i, at, len, mut read) in self.pending.drain(..) {
            let answer = match read.wait_through(0) {
                Err(e) => Err(e.into()),
                Ok(()) => verify_leased_block(self.bounce.at(at, len), keys[i])
                    .map(|(version, value)| (value, version))
                    .ok_or_else(failed_verification),
            };
            each(i, answer);
        }
        send_releases(&self.client.conn, &self.leases);
        self.leases.clear();
        self.used = 0;
    }
}

/// One key's answer in a batch: the value and its version.
type GetResult = Result<(Vec<u8>, u64)>;

/// Where a batched GET hands each key's answer: the key's index, and the
/// value (lent for the call) with its version, or the error. Called once
/// per key, in no particular order.
type Each<'a> = dyn FnMut(usize, Result<(&[u8], u64)>) + 'a;

fn failed_verification() -> KvError {
    KvError::Internal("the value read from the server failed verification".into())
}

/// A connection to a key-value server.
pub struct Client {
    conn: Connection,
    replies: Arc<Replies>,
    info: ServerInfo,
    next_id: AtomicU64,
    bounce: Mutex<Option<Bounce>>,
    /// The thread holding `bounce` (0: none), so a value callback that
    /// calls back into its client gets an error instead of a deadlock.
    bounce_holder: AtomicUsize,
    /// Where each key's block was last found by a one-sided GET.
    locations: Mutex<Locations>,
    timeout: Duration,
}

/// A request on its way. Its reply's deadline counts from when it was
/// sent, so the replies of a batch time out together, not one timeout
/// after another.
#[derive(Clone, Copy)]
struct Sent {
    id: u64,
    at: Instant,
}

/// A batch's sends: once one has waited out its time for room in the
/// server's ring (a server that stopped taking requests), the rest fail
/// with that error at once instead of each waiting as long again.
#[derive(Default)]
struct BatchSends {
    stuck: Option<KvError>,
}

impl BatchSends {
    fn send(&mut self, send: impl FnOnce() -> Result<Sent>) -> Result<Sent> {
        if let Some(e) = &self.stuck {
            return Err(e.clone());
        }
        let sent = send();
        if let Err(e @ KvError::Timeout(_)) = &sent {
            self.stuck = Some(e.clone());
        }
        sent
    }
}

/// A GET's answer before its value is fetched.
enum Found {
    Inline(Vec<u8>, u64),
    Remote(Reply),
}

impl Client {
    /// Connects over RDMA CM.
    pub fn connect(addr: SocketAddr) -> Result<Client> {
        Client::connect_with(addr, &ClientOptions::default())
    }

    pub fn connect_with(addr: SocketAddr, opts: &ClientOptions) -> Result<Client> {
        let replies = Arc::new(Replies::default());
        // Every call waits for its reply, so the caller may as well take
        // it off the completion queue itself.
        let rt_opts = Options {
            comm_mode: CommMode::Blocking,
            caller_polls: true,
            max_inline_data: super::MESSAGE_INLINE,
            ..Options::default()
        };
        let handler = Arc::new(ReplyHandler(replies.clone()));
        let conn = match opts.mode {
            ConnMode::Cm => Connection::connect(addr, &rt_opts, handler),
            ConnMode::Socket => {
                Connection::connect_socket(addr, opts.device.as_deref(), &rt_opts, handler)
            }
        }
        .map_err(|e| KvError::Disconnected(format!("connecting to {addr}: {e}")))?;
        let mut client = Client {
            conn,
            replies,
            // Filled from the HELLO reply below.
            info: ServerInfo::default(),
            next_id: AtomicU64::new(1),
            bounce: Mutex::new(None),
            bounce_holder: AtomicUsize::new(0),
            locations: Mutex::new(Locations::new()),
            timeout: opts.timeout,
        };
        let (_, payload) = client.call(Request::new(Op::Hello, 0), &[], &[], 0)?;
        client.info = ServerInfo::decode(&payload)
            .ok_or_else(|| KvError::Internal("the server's HELLO reply is malformed".into()))?;
        Ok(client)
    }

    /// Connects as `kv_open` does: `name` is "host" or "host:port" (port
    /// 4792, or `SNOWRDMA_KV_PORT`, by default).
    pub fn open(name: &str) -> Result<Client> {
        Client::connect(super::server_addr(name)?)
    }

    /// Stores a string (as `kv_set`); returns the new version.
    pub fn set(&self, key: &str, value: &str) -> Result<u64> {
        self.put(key.as_bytes(), value.as_bytes())
    }

    /// A string value (as `kv_get`): "" for a missing key; a value that is
    /// not UTF-8 is an [`KvError::InvalidArgument`].
    pub fn get_string(&self, key: &str) -> Result<String> {
        match self.get(key.as_bytes()) {
            Ok((v, _)) => String::from_utf8(v).map_err(|_| {
                KvError::InvalidArgument(format!("the value of {key:?} is not UTF-8"))
            }),
            Err(KvError::NotFound) => Ok(String::new()),
            Err(e) => Err(e),
        }
    }

    /// What the server said about itself at connect time.
    pub fn server_info(&self) -> &ServerInfo {
        &self.info
    }

    /// Time allowed for a call that moves `bytes`.
    fn allowance(&self, bytes: usize) -> Duration {
        self.timeout + Duration::from_secs(bytes as u64 / SLOWEST_BYTES_PER_SEC)
    }

    fn send(&self, req: Request, key: &[u8], inline: &[u8]) -> Result<Sent> {
        self.send_after(req, key, inline, None)
    }

    /// Sends a request, after RDMA WRITing `staged` when given (one
    /// doorbell).
    fn send_after(
        &self,
        mut req: Request,
        key: &[u8],
        inline: &[u8],
        staged: Option<Staged>,
    ) -> Result<Sent> {
        // Ids wrap at 32 bits so replies can carry them in a compact header;
        // far fewer than 2^32 requests are ever outstanding at once.
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) & u64::from(u32::MAX);
        self.replies.reuse(id);
        req.req_id = id;
        let at = Instant::now();
        let msg = req.encode(key, inline);
        let sent = match staged {
            // SAFETY: the bounce buffer stays untouched (the caller holds its
            // lock) until the reply, which comes after the server has the
            // request.
            Some(v) => unsafe {
                self.conn
                    .write_then_send(v.local, v.lkey, v.remote, v.len as u32, &msg)?
            },
            None => self.conn.send(&msg)?,
        };
        match sent {
            0 => Err(KvError::Timeout(self.conn.options().timeout)),
            _ => Ok(Sent { id, at }),
        }
    }

    /// Waits for the reply to `sent`, until `allowed` after it was sent.
    fn wait(&self, sent: Sent, allowed: Duration) -> Result<(Reply, Vec<u8>)> {
        let mut seen = u64::MAX;
        let mut reply = None;
        let mut ended = false;
        self.conn.wait_for(sent.at + allowed, || {
            // The map is only looked at when something arrived.
            let arrived = self.replies.arrived.load(Ordering::Acquire);
            if arrived != seen {
                seen = arrived;
                reply = self
                    .replies
                    .inbox
                    .lock()
                    .expect("reply lock")
                    .ready
                    .remove(&sent.id);
            }
            ended = self.replies.dead.load(Ordering::Acquire);
            reply.is_some() || ended
        });
        match reply {
            Some(r) => Ok(r),
            // The server went away, or this client was closed.
            None if ended => Err(KvError::Disconnected("the connection has ended".into())),
            None => self
                .replies
                .abandon(sent.id)
                .ok_or(KvError::Timeout(allowed)),
        }
    }

    /// Sends a request and waits for its reply; a reply with an error
    /// status becomes that error.
    fn call(
        &self,
        req: Request,
        key: &[u8],
        inline: &[u8],
        moves: usize,
    ) -> Result<(Reply, Vec<u8>)> {
        self.call_after(req, key, inline, None, moves)
    }

    /// [`Client::call`], after a write as [`Client::send_after`] makes it.
    fn call_after(
        &self,
        req: Request,
        key: &[u8],
        inline: &[u8],
        staged: Option<Staged>,
        moves: usize,
    ) -> Result<(Reply, Vec<u8>)> {
        let sent = self.send_after(req, key, inline, staged)?;
        let (reply, payload) = self.wait(sent, self.allowance(moves))?;
        status(&reply)?;
        Ok((reply, payload))
    }

    /// The bounce buffer, grown to at least `len` bytes, locked until the
    /// guard is dropped.
    fn lock_bounce(&self, len: usize) -> Result<BounceGuard<'_>> {
        let me = thread_token();
        if self.bounce_holder.load(Ordering::Acquire) == me {
            return Err(KvError::InvalidArgument(
                "a callback lent a value called back into the same client".into(),
            ));
        }
        // Poisoned only by a panic in a user's callback lent a value; the
        // buffer is scratch space and still whole.
        let mut slot = self.bounce.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_none_or(|b| b.len < len) {
            if let Some(old) = slot.take() {
                self.conn.deregister(old.raw);
            }
            let size = len.next_power_of_two().max(1 << 20);
            let raw = self.conn.register(size).map_err(|_| KvError::NoMemory)?;
            // SAFETY: `register` returned a live registration.
            let (addr, lkey) = unsafe { ((*raw).addr as u64, (*raw).lkey) };
            *slot = Some(Bounce {
                raw,
                addr,
                len: size,
                lkey,
            });
        }
        self.bounce_holder.store(me, Ordering::Release);
        Ok(BounceGuard {
            slot,
            conn: &self.conn,
            holder: &self.bounce_holder,
        })
    }

    /// Runs `f` with the bounce buffer grown to at least `len` bytes.
    fn with_bounce<T>(&self, len: usize, f: impl FnOnce(&mut Bounce) -> Result<T>) -> Result<T> {
        let mut bounce = self.lock_bounce(len)?;
        f(&mut bounce)
    }

    /// Moves `len` bytes between the bounce buffer (from `local`) and the
    /// server, in pieces, waiting for each.
    fn transfer(
        &self,
        read: bool,
        bounce: &Bounce,
        local: usize,
        remote: RemoteAddr,
        len: usize,
    ) -> Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_TRANSFER);
            let at = RemoteAddr {
                addr: remote.addr + done as u64,
                rkey: remote.rkey,
            };
            let laddr = bounce.addr + (local + done) as u64;
            if read {
                self.conn.read_sync(laddr, bounce.lkey, at, n as u32)?;
            } else {
                self.conn.write_sync(laddr, bounce.lkey, at, n as u32)?;
            }
            done += n;
        }
        Ok(())
    }

    fn check_value(&self, value: &[u8]) -> Result<()> {
        if value.len() as u64 > self.info.max_value {
            return Err(KvError::ValueTooLong {
                max: self.info.max_value,
            });
        }
        Ok(())
    }

    /// Asks the server for `key`.
    fn lookup(&self, key: &[u8]) -> Result<Found> {
        check_key(key)?;
        let (reply, payload) = self.call(Request::new(Op::Get, 0), key, &[], 0)?;
        Ok(if reply.remote {
            Found::Remote(reply)
        } else {
            Found::Inline(payload, reply.version)
        })
    }

    /// READs a block the server leased us, verifies it, hands the value and
    /// its version to `take`, and ends the lease.
    fn fetch<T>(&self, key: &[u8], reply: &Reply, take: impl FnOnce(&[u8], u64) -> T) -> Result<T> {
        let total = block_len(key.len(), reply.value_len as usize);
        let result = self.with_bounce(total, |b| {
            self.transfer(
                true,
                b,
                0,
                RemoteAddr {
                    addr: reply.addr,
                    rkey: reply.rkey,
                },
                total,
            )?;
            let block = b.bytes(total);
            let (version, value) =
                verify_leased_block(block, key).ok_or_else(failed_verification)?;
            // A panicking `take` still lets the lease go first.
            Ok(catch_unwind(AssertUnwindSafe(|| take(value, version))))
        });
        self.release(reply.lease);
        result.map(|taken| taken.unwrap_or_else(|payload| resume_unwind(payload)))
    }

    fn release(&self, lease: u64) {
        send_releases(&self.conn, &[lease]);
    }

    /// The value and version of `key`.
    pub fn get(&self, key: &[u8]) -> Result<(Vec<u8>, u64)> {
        match self.lookup(key)? {
            // Already the caller's own copy.
            Found::Inline(v, version) => Ok((v, version)),
            Found::Remote(reply) => {
                self.fetch(key, &reply, |v, version| (copy::to_vec(v), version))
            }
        }
    }

    /// Lends the value of `key` to `take` (for the call only; no copy is
    /// made first) and returns what it made, with the version. `take` runs
    /// on the calling thread while the client's transfer buffer may be
    /// lent to it: a large-value call on the same client from inside it
    /// fails with [`KvError::InvalidArgument`] (rather than deadlocking).
    pub fn get_with<T>(&self, key: &[u8], take: impl FnOnce(&[u8]) -> T) -> Result<(T, u64)> {
        match self.lookup(key)? {
            Found::Inline(v, version) => Ok((take(&v), version)),
            Found::Remote(reply) => self.fetch(key, &reply, |v, version| (take(v), version)),
        }
    }

    /// Copies the value of `key` into `buf`; returns its length and version.
    /// A value longer than `buf` is not copied at all:
    /// [`KvError::BufferTooSmall`] reports its length.
    pub fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<(usize, u64)> {
        match self.lookup(key)? {
            Found::Inline(v, version) => Ok((copy_into(buf, &v)?, version)),
            Found::Remote(reply) => {
                if reply.value_len > buf.len() as u64 {
                    self.release(reply.lease);
                    return Err(KvError::BufferTooSmall {
                        needed: reply.value_len,
                    });
                }
                let n = reply.value_len as usize;
                self.fetch(key, &reply, |v, version| {
                    copy::copy(&mut buf[..n], v);
                    (n, version)
                })
            }
        }
    }

    /// Stores `value` under `key`; returns the new version.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write(key, value, None)
    }

    /// Stores `value` only if the key's version is `expected` (0: only if the
    /// key is absent). Fails with [`KvError::CasFailed`] carrying the current
    /// version otherwise.
    pub fn cas(&self, key: &[u8], expected: u64, value: &[u8]) -> Result<u64> {
        self.write(key, value, Some(expected))
    }

    fn write(&self, key: &[u8], value: &[u8], cas: Option<u64>) -> Result<u64> {
        check_key(key)?;
        self.check_value(value)?;
        let mut req = Request::new(Op::Write, 0);
        req.value_len = value.len() as u64;
        req.cas = cas;
        if is_inline(key.len(), value.len()) {
            return self.call(req, key, value, 0).map(|(r, _)| r.version);
        }
        if value.len() as u64 <= self.info.request_buf_len {
            // One round trip: the value goes by RDMA WRITE into our request
            // buffer, the request right behind it on the same QP (so the
            // value has landed when the server reads the request).
            return self.with_bounce(value.len(), |b| {
                copy::copy(b.bytes(value.len()), value);
                let remote = RemoteAddr {
                    addr: self.info.request_buf,
                    rkey: self.info.request_buf_rkey,
                };
                req.source = Source::Staged {
                    offset: 0,
                    checksum: value_checksum(value),
                };
                let staged = Some(b.staged(0, remote, value.len()));
                self.call_after(req, key, &[], staged, value.len())
                    .map(|(r, _)| r.version)
            });
        }
        // Larger than the request buffer: the server makes a target first.
        let mut alloc = Request::new(Op::Alloc, 0);
        alloc.value_len = value.len() as u64;
        // The server maps and registers memory for it first: time in
        // proportion to its size.
        let (target, _) = self.call(alloc, key, &[], value.len())?;
        let put = self.with_bounce(value.len(), |b| {
            copy::copy(b.bytes(value.len()), value);
            let remote = RemoteAddr {
                addr: target.addr,
                rkey: target.rkey,
            };
            self.transfer(false, b, 0, remote, value.len())?;
            req.source = Source::Allocated {
                token: target.lease,
            };
            self.call(req, key, &[], value.len())
                .map(|(r, _)| r.version)
        });
        if put.is_err() {
            // The server takes our requests in order: a release behind a
            // commit it has not seen yet finds the target already used.
            self.release(target.lease);
        }
        put
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.call(Request::new(Op::Delete, 0), key, &[], 0)
            .map(|_| ())
    }

    /// GETs several keys with up to 64 requests in flight; one result per
    /// key, in order. A value the server leases is READ as soon as its
    /// reply is in, while the later replies are still coming; up to the
    /// bounce buffer's size of them are in flight, and a value larger than
    /// [`GROUP_BYTES`] is read alone at the end of its chunk.
    pub fn batch_get(&self, keys: &[&[u8]]) -> Vec<GetResult> {
        collect_batch(keys.len(), |each| self.batch_get_with(keys, each))
    }

    /// [`Client::batch_get`], lending each value to `each` (with the key's
    /// index and the version, or the error) instead of copying it out of
    /// the transfer buffer first: `each` runs once per key, in no
    /// particular order, on the calling thread, under the same rule as
    /// [`Client::get_with`]'s `take`.
    ///
    /// Should `each` panic, the batch is still finished without it (every
    /// reply taken, every value the server lent us given back), and then
    /// the panic goes on.
    pub fn batch_get_with(
        &self,
        keys: &[&[u8]],
        mut each: impl FnMut(usize, Result<(&[u8], u64)>),
    ) {
        let mut panic = None;
        self.batch_get_each(keys, &mut |i, r| {
            if panic.is_none() {
                panic = catch_unwind(AssertUnwindSafe(|| each(i, r))).err();
            }
        });
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    fn batch_get_each(&self, keys: &[&[u8]], each: &mut Each<'_>) {
        let mut sends = BatchSends::default();
        // A chunk at a time, so the server holds at most a chunk's leases
        // for us.
        for (n, chunk) in keys.chunks(BATCH_WINDOW).enumerate() {
            let base = n * BATCH_WINDOW;
            let ids: Vec<Result<Sent>> = chunk
                .iter()
                .map(|key| {
                    check_key(key)?;
                    sends.send(|| self.send(Request::new(Op::Get, 0), key, &[]))
                })
                .collect();
            let mut answer = |i: usize, r: Result<(&[u8], u64)>| each(base + i, r);
            let mut reads: Option<BlockReads> = None;
            let mut alone = Vec::new();
            for (i, id) in ids.iter().enumerate() {
                let reply = self.collect(i, id, &mut |_, reply, payload| Ok((reply, payload)));
                let reply = match reply {
                    Ok((reply, payload)) if !reply.remote => {
                        answer(i, Ok((&payload, reply.version)));
                        continue;
                    }
                    Ok((reply, _)) => reply,
                    Err(e) => {
                        answer(i, Err(e));
                        continue;
                    }
                };
                if block_len(chunk[i].len(), reply.value_len as usize) > GROUP_BYTES {
                    alone.push((i, reply));
                    continue;
                }
                if reads.is_none() {
                    match self.lock_bounce(GROUP_BYTES) {
                        Ok(bounce) => {
                            reads = Some(BlockReads {
                                client: self,
                                pending: Vec::new(),
                                leases: Vec::new(),
                                used: 0,
                                bounce,
                            })
                        }
                        Err(e) => {
                            answer(i, Err(e));
                            self.release(reply.lease);
                            continue;
                        }
                    }
                }
                if let Some(r) = reads.as_mut() {
                    r.start(chunk, i, &reply, &mut answer);
                }
            }
            if let Some(mut r) = reads {
                r.finish(chunk, &mut answer);
            }
            for (i, reply) in alone {
                let fetched = self.fetch(chunk[i], &reply, |v, version| {
                    answer(i, Ok((v, version)));
                });
                if let Err(e) = fetched {
                    answer(i, Err(e));
                }
            }
        }
    }

    /// PUTs several pairs; one result (the new version) per pair, in order.
    /// Values up to the size of our request buffer on the server are
    /// pipelined, up to 64 requests in flight; a larger value is put alone,
    /// in its place, so a key written twice in a batch ends with its last
    /// value.
    pub fn batch_put(&self, pairs: &[(&[u8], &[u8])]) -> Vec<Result<u64>> {
        let mut results = Vec::with_capacity(pairs.len());
        let mut rest = pairs;
        while let Some(((key, value), after)) = rest.split_first() {
            let run = rest
                .iter()
                .take_while(|(_, v)| v.len() as u64 <= self.info.request_buf_len)
                .count();
            if run == 0 {
                results.push(self.put(key, value));
                rest = after;
            } else {
                results.extend(self.put_pipelined(&rest[..run]));
                rest = &rest[run..];
            }
        }
        results
    }

    /// Pipelined PUTs of values that fit in a request or in the request
    /// buffer. A value that does not fit in a request is staged in a slot of
    /// the bounce buffer and RDMA WRITTEN to the same slot of the request
    /// buffer; a slot is reused only after the reply to the request that
    /// used it (the window is at most the number of slots).
    fn put_pipelined(&self, pairs: &[(&[u8], &[u8])]) -> Vec<Result<u64>> {
        let start_request = |key: &[u8], value: &[u8]| -> Result<Request> {
            check_key(key)?;
            self.check_value(value)?;
            let mut req = Request::new(Op::Write, 0);
            req.value_len = value.len() as u64;
            Ok(req)
        };
        let version = |_, reply: Reply, _| Ok(reply.version);
        let slot = pairs
            .iter()
            .filter(|(k, v)| !is_inline(k.len(), v.len()))
            .map(|(_, v)| v.len().next_multiple_of(SLOT_ALIGN))
            .max();
        let Some(slot) = slot else {
            return self.pipelined(
                pairs.len(),
                BATCH_WINDOW,
                |i| {
                    let (key, value) = pairs[i];
                    self.send(start_request(key, value)?, key, value)
                },
                version,
            );
        };
        let buf_len = usize::try_from(self.info.request_buf_len).unwrap_or(usize::MAX);
        let slots = (buf_len / slot).clamp(1, BATCH_WINDOW);
        let staged = self.with_bounce(slots * slot, |b| {
            let mut next_slot = 0;
            Ok(self.pipelined(
                pairs.len(),
                slots,
                |i| {
                    let (key, value) = pairs[i];
                    let mut req = start_request(key, value)?;
                    if is_inline(key.len(), value.len()) {
                        return self.send(req, key, value);
                    }
                    let offset = next_slot % slots * slot;
                    next_slot += 1;
                    copy::copy(b.at(offset, value.len()), value);
                    req.source = Source::Staged {
                        offset: offset as u64,
                        checksum: value_checksum(value),
                    };
                    let remote = RemoteAddr {
                        addr: self.info.request_buf + offset as u64,
                        rkey: self.info.request_buf_rkey,
                    };
                    self.send_after(req, key, &[], Some(b.staged(offset, remote, value.len())))
                },
                version,
            ))
        });
        staged.unwrap_or_else(|e| pairs.iter().map(|_| Err(e.clone())).collect())
    }

    /// Sends `count` requests with `start` (which returns the request id),
    /// keeping up to `window` in flight, and turns each reply into a result
    /// with `finish`.
    fn pipelined<T>(
        &self,
        count: usize,
        window: usize,
        mut start: impl FnMut(usize) -> Result<Sent>,
        mut finish: impl FnMut(usize, Reply, Vec<u8>) -> Result<T>,
    ) -> Vec<Result<T>> {
        let mut ids: Vec<Result<Sent>> = Vec::with_capacity(count);
        let mut results: Vec<Result<T>> = Vec::with_capacity(count);
        let mut sends = BatchSends::default();
        for i in 0..count {
            ids.push(sends.send(|| start(i)));
            if ids.len() - results.len() >= window {
                let j = results.len();
                results.push(self.collect(j, &ids[j], &mut finish));
            }
        }
        while results.len() < count {
            let j = results.len();
            results.push(self.collect(j, &ids[j], &mut finish));
        }
        results
    }

    fn collect<T>(
        &self,
        i: usize,
        sent: &Result<Sent>,
        finish: &mut impl FnMut(usize, Reply, Vec<u8>) -> Result<T>,
    ) -> Result<T> {
        let sent = sent.as_ref().map_err(Clone::clone)?;
        let (reply, payload) = self.wait(*sent, self.timeout)?;
        status(&reply)?;
        finish(i, reply, payload)
    }

    /// Disconnects (also done on drop). Calls other threads have in flight
    /// on this client end at once with [`KvError::Disconnected`], and later
    /// ones fail the same way.
    pub fn close(&self) {
        // Before the close wakes the waiters: a local close fires no
        // `disconnected` callback to say so.
        self.replies.dead.store(true, Ordering::Release);
        self.conn.close();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

/// The results of a batched GET, one per key in order, from the `_with`
/// form that lends each value.
fn collect_batch(count: usize, run: impl FnOnce(&mut Each<'_>)) -> Vec<GetResult> {
    let mut results: Vec<Option<GetResult>> = (0..count).map(|_| None).collect();
    run(&mut |i, r| results[i] = Some(r.map(|(value, version)| (copy::to_vec(value), version))));
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(KvError::Internal("no answer for this key".into()))))
        .collect()
}

/// Copies `value` to the front of `buf`, if it fits (nothing is copied if
/// not: [`KvError::BufferTooSmall`] reports its length); returns its length.
fn copy_into(buf: &mut [u8], value: &[u8]) -> Result<usize> {
    let dst = buf.get_mut(..value.len()).ok_or(KvError::BufferTooSmall {
        needed: value.len() as u64,
    })?;
    copy::copy(dst, value);
    Ok(value.len())
}

/// The error a reply reports, if any.
fn status(reply: &Reply) -> Result<()> {
    if reply.status == 0 {
        return Ok(());
    }
    let detail = match reply.status {
        -3 => reply.version,
        _ => reply.value_len,
    };
    Err(KvError::from_code(reply.status, detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(id: u64) -> (Reply, Vec<u8>) {
        let r = Reply {
            req_id: id,
            ..Reply::default()
        };
        (r, b"late".to_vec())
    }

    #[test]
    fn an_abandoned_id_is_remembered_until_reused() {
        let replies = Replies::default();
        // A reply that came at the last moment is still taken.
        replies.inbox.lock().unwrap().ready.insert(1, reply(1));
        assert_eq!(replies.abandon(1).unwrap().1, b"late");
        assert!(!replies.any_abandoned.load(Ordering::Acquire));
        // One that has not come is remembered, so its reply is dropped.
        assert!(replies.abandon(2).is_none());
        assert!(replies.inbox.lock().unwrap().abandoned.contains(&2));
        replies.reuse(3);
        assert!(replies.inbox.lock().unwrap().abandoned.contains(&2));
        // Until a new request takes its id after the ids wrap.
        replies.reuse(2);
        assert!(replies.inbox.lock().unwrap().abandoned.is_empty());
        assert!(!replies.any_abandoned.load(Ordering::Acquire));
    }
}
