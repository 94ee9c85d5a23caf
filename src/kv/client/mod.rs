//! The key-value client: requests as runtime messages, a key and value under
//! 4 KiB together inside them, larger values by RDMA WRITE into the client's request buffer
//! on the server (one round trip) or into a target the server allocates,
//! and by RDMA READ of the stored block. GETs can also be served without the
//! server's CPU ([`Client::get_one_sided`]).
//!
//! A client may be used from several threads; each call waits for its own
//! reply. Calls moving large values take turns (they share one registered
//! bounce buffer).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::copy;
use crate::runtime::{BatchMessage, CommMode, Connection, Options, WriteAhead};

use super::proto::{Header, Op, Reply, Request, ServerInfo};
use super::{ConnMode, KvError, Result, LARGEST_MAX_VALUE, LARGEST_REQUEST_BUF, TIMEOUT_ENV};

mod batch;
mod bounce;
mod mixed;
mod one_sided;
mod registered;
mod replies;
mod single;

pub use mixed::BatchOp;
pub use registered::KvMemory;

use batch::BatchSends;
use bounce::Bounce;
use one_sided::Locations;
use replies::{Replies, ReplyHandler};

/// Largest single RDMA READ or WRITE: keeps every one well inside the
/// runtime's per-operation time bound even on a slow link.
const MAX_TRANSFER: usize = 16 << 20;

/// Bounce buffer kept between calls; larger ones are freed after use.
const KEEP_BOUNCE: usize = 64 << 20;

/// Requests of a batch in flight at once.
const BATCH_WINDOW: usize = 64;

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

/// One key's answer in a batch: the value and its version.
type GetResult = Result<(Vec<u8>, u64)>;

/// Where a batched GET hands each key's answer: the key's index, and the
/// value (lent for the call) with its version, or the error. Called once
/// per key, in no particular order.
type Each<'a> = dyn FnMut(usize, Result<(&[u8], u64)>) + 'a;

/// What a server's HELLO reply advertises: refused (and the connection
/// with it) when malformed, or when its request buffer is larger than one
/// RDMA WRITE can fill (a value that fits it goes in one WRITE, whose
/// length is 32 bits). A largest value past [`LARGEST_MAX_VALUE`] (an
/// older server told "no limit") is taken as that bound: the lengths of
/// values size our buffers, and past 2^63 rounding one up to a power of
/// two overflows; each reply's own length is checked anyway.
fn server_info(payload: &[u8]) -> Result<ServerInfo> {
    let mut info = ServerInfo::decode(payload)
        .ok_or_else(|| KvError::Internal("the server's HELLO reply is malformed".into()))?;
    if info.max_value > LARGEST_MAX_VALUE {
        log::warn!(
            "the server advertises values of up to {} bytes, more than the {LARGEST_MAX_VALUE} \
             any client can hold: taking {LARGEST_MAX_VALUE}",
            info.max_value
        );
        info.max_value = LARGEST_MAX_VALUE;
    }
    if info.request_buf_len > LARGEST_REQUEST_BUF {
        return Err(KvError::Internal(format!(
            "refusing the server: it advertises a request buffer of {} bytes, \
             more than one RDMA WRITE can fill",
            info.request_buf_len
        )));
    }
    Ok(info)
}

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

/// A request ready to go: its key and inline value follow its header, and
/// a staged value is RDMA WRITTEN ahead of it.
struct Outgoing<'k> {
    req: Request,
    key: &'k [u8],
    inline: &'k [u8],
    staged: Option<WriteAhead>,
}

impl<'k> Outgoing<'k> {
    fn new(req: Request, key: &'k [u8], inline: &'k [u8]) -> Outgoing<'k> {
        Outgoing {
            req,
            key,
            inline,
            staged: None,
        }
    }
}

/// A request on its way. Its reply's deadline counts from when it was
/// sent, so the replies of a batch time out together, not one timeout
/// after another.
#[derive(Clone, Copy)]
struct Sent {
    id: u64,
    at: Instant,
    /// Replies filed before it was sent ([`Replies::arrived`]): its own
    /// came after, so the inbox is looked at only once that count moves.
    arrived_before: u64,
    /// A value went ahead of it by RDMA WRITE: a call that gives up on its
    /// reply waits until the device is done reading it.
    wrote_ahead: bool,
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
            locations: Mutex::new(Locations::default()),
            timeout: opts.timeout,
        };
        let (_, payload) = client.call(Request::new(Op::Hello, 0), &[], &[], 0)?;
        client.info = server_info(&payload)?;
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

    /// Sends a request, after RDMA WRITing `staged` when given (one
    /// doorbell).
    fn send_after(
        &self,
        req: Request,
        key: &[u8],
        inline: &[u8],
        staged: Option<WriteAhead>,
    ) -> Result<Sent> {
        self.send_with(req, key, inline, staged, None)
    }

    /// [`Client::send_after`], with the reply's payload to land in `landing`
    /// when it fits (then [`Replies::unland`] must follow, on every path).
    fn send_with(
        &self,
        mut req: Request,
        key: &[u8],
        inline: &[u8],
        staged: Option<WriteAhead>,
        landing: Option<&mut [u8]>,
    ) -> Result<Sent> {
        let id = self.new_request_id();
        req.req_id = id;
        let lands = landing.is_some();
        if let Some(buf) = landing {
            // SAFETY: unlanded below if the send fails, else by the caller
            // (call_into) before its buffer goes.
            unsafe { self.replies.land(id, buf) };
        }
        let at = Instant::now();
        let arrived_before = self.replies.arrived.load(Ordering::Acquire);
        let header = req.header(key.len(), inline.len());
        let msg = [header.as_slice(), key, inline];
        let wrote_ahead = staged.is_some();
        let sent = self.post_request(&msg, staged).map(|()| Sent {
            id,
            at,
            arrived_before,
            wrote_ahead,
        });
        if sent.is_err() && lands {
            self.replies.unland(id);
        }
        sent
    }

    /// A new request id. Ids wrap at 32 bits so replies can carry them in a
    /// compact header; far fewer than 2^32 requests are ever outstanding
    /// at once.
    fn new_request_id(&self) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) & u64::from(u32::MAX);
        self.replies.reuse(id);
        self.replies.sent(id);
        id
    }

    /// Sends one request's message, after RDMA WRITing `staged` when given
    /// (one doorbell).
    fn post_request(&self, msg: &[&[u8]], staged: Option<WriteAhead>) -> Result<()> {
        let sent = match staged {
            // SAFETY: the staged value stays untouched (the bounce buffer
            // under its lock, the caller's memory under the callers' rule)
            // until the reply, which comes after the server has the request.
            Some(w) => unsafe {
                self.conn
                    .write_then_send(w.local_addr, w.lkey, w.remote, w.len, msg)
            },
            None => self.conn.send_parts(msg),
        };
        match sent {
            Ok(0) => Err(KvError::Timeout(self.conn.options().timeout)),
            Ok(_) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends `count` requests (`request(i)`: the i-th, ready to go) as one
    /// batch: those that find room in the server's ring go with one
    /// doorbell (per [`MESSAGES_PER_DOORBELL`](crate::runtime::MESSAGES_PER_DOORBELL)
    /// messages), the rest one by one as [`Client::send_after`] sends them.
    /// One outcome per request, in order; allocates nothing for up to
    /// [`BATCH_WINDOW`].
    fn send_batch<'k>(
        &self,
        count: usize,
        mut request: impl FnMut(usize) -> Result<Outgoing<'k>>,
        sends: &mut BatchSends,
    ) -> SmallVec<[Result<Sent>; BATCH_WINDOW]> {
        let at = Instant::now();
        let arrived_before = self.replies.arrived.load(Ordering::Acquire);
        let mut outcomes: SmallVec<[Result<Sent>; BATCH_WINDOW]> = SmallVec::new();
        let mut ready: SmallVec<[(Header, Outgoing<'k>); BATCH_WINDOW]> = SmallVec::new();
        for i in 0..count {
            outcomes.push(request(i).map(|mut out| {
                let id = self.new_request_id();
                out.req.req_id = id;
                let wrote_ahead = out.staged.is_some();
                ready.push((out.req.header(out.key.len(), out.inline.len()), out));
                Sent {
                    id,
                    at,
                    arrived_before,
                    wrote_ahead,
                }
            }));
        }
        let parts: SmallVec<[[&[u8]; 3]; BATCH_WINDOW]> = ready
            .iter()
            .map(|(h, out)| [h.as_slice(), out.key, out.inline])
            .collect();
        let msgs: SmallVec<[BatchMessage<'_>; BATCH_WINDOW]> = parts
            .iter()
            .zip(&ready)
            .map(|(p, (_, out))| (&p[..], out.staged))
            .collect();
        // SAFETY: a staged value stays unchanged until its request's reply
        // (the callers' rule, as for `send_after`).
        let (posted, failed) = match unsafe { self.conn.write_then_send_batch(&msgs) } {
            Ok(n) => (n, None),
            Err(e) => (0, Some(KvError::from(e))),
        };
        // The requests the batch did not post, one by one, in order.
        let mut rest = msgs.iter().skip(posted);
        for outcome in outcomes.iter_mut().filter(|o| o.is_ok()).skip(posted) {
            let Some(&(parts, write)) = rest.next() else {
                break;
            };
            let sent = match &failed {
                Some(e) => Err(e.clone()),
                None => sends.send(|| {
                    self.post_request(parts, write)
                        .and_then(|()| outcome.clone())
                }),
            };
            *outcome = sent;
        }
        outcomes
    }

    /// Waits for the reply to `sent`, until `allowed` after it was sent.
    fn wait(&self, sent: Sent, allowed: Duration) -> Result<(Reply, Vec<u8>)> {
        let mut seen = sent.arrived_before;
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
        let failed = match reply {
            Some(r) => return Ok(r),
            // The server went away, or this client was closed.
            None if ended => KvError::Disconnected("the connection has ended".into()),
            None => match self.replies.abandon(sent.id) {
                Some(r) => return Ok(r),
                None => KvError::Timeout(allowed),
            },
        };
        if sent.wrote_ahead {
            // The device may still read the value written ahead of the
            // request (a retransmission), and the caller reuses that memory
            // once this returns: wait until the sends complete, or the QP
            // is stopped (a close in progress, or a failure after the
            // wait).
            self.conn
                .retire_sends(self.timeout.max(crate::runtime::MIN_DEVICE_WAIT));
        }
        Err(failed)
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
        staged: Option<WriteAhead>,
        moves: usize,
    ) -> Result<(Reply, Vec<u8>)> {
        let sent = self.send_after(req, key, inline, staged)?;
        let (reply, payload) = self.wait(sent, self.allowance(moves))?;
        status(&reply)?;
        Ok((reply, payload))
    }

    /// Sends a request and waits for its reply, whose payload lands in
    /// `buf` when it fits: the reply, how much landed there (`None`: the
    /// payload is in the returned buffer instead).
    fn call_into(
        &self,
        req: Request,
        key: &[u8],
        buf: &mut [u8],
    ) -> Result<(Reply, Option<usize>, Vec<u8>)> {
        let sent = self.send_with(req, key, &[], None, Some(buf))?;
        let waited = self.wait(sent, self.allowance(0));
        // On every path: nothing writes `buf` once this returns.
        let landed = self.replies.unland(sent.id);
        let (reply, payload) = waited?;
        status(&reply)?;
        Ok((reply, landed, payload))
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

    #[test]
    fn a_server_advertising_values_no_client_can_hold_is_held_to_the_bound() {
        let info = |max_value| {
            ServerInfo {
                max_value,
                ..ServerInfo::default()
            }
            .encode()
        };
        assert_eq!(
            server_info(&info(LARGEST_MAX_VALUE)).unwrap().max_value,
            LARGEST_MAX_VALUE
        );
        for hostile in [LARGEST_MAX_VALUE + 1, (1 << 63) + 1, u64::MAX] {
            let got = server_info(&info(hostile)).unwrap();
            assert_eq!(got.max_value, LARGEST_MAX_VALUE, "{hostile}");
        }
        assert!(server_info(&info(1)[..10]).is_err(), "malformed");
    }

    #[test]
    fn a_server_advertising_a_request_buffer_no_write_can_fill_is_refused() {
        let info = |request_buf_len| {
            ServerInfo {
                request_buf_len,
                max_value: 1 << 20,
                ..ServerInfo::default()
            }
            .encode()
        };
        let most = LARGEST_REQUEST_BUF;
        assert_eq!(server_info(&info(most)).unwrap().request_buf_len, most);
        for hostile in [most + 1, u64::MAX] {
            let e = server_info(&info(hostile)).unwrap_err();
            assert!(e.to_string().contains("request buffer"), "{e}");
        }
    }
}
