//! The messages: a [`Request`] header, the key, then (inline writes) the
//! value; a [`Reply`] header, then (inline GETs, HELLO) a payload; compact
//! forms of both for the common small cases; the server's HELLO answer.

use crate::kv::{KvError, MAX_KEY_LEN};

use super::{u32_at, u64_at};

pub const REQUEST_MAGIC: u32 = 0x3152_564b; // "KVR1"
pub const REPLY_MAGIC: u32 = 0x3141_564b; // "KVA1"
pub const REQUEST_LEN: usize = 56;

pub const REPLY_LEN: usize = 56;

/// Leases (or write targets) one RELEASE names at most: one in its header
/// and one per 8-byte word of its key, which is no longer than any key
/// ([`MAX_KEY_LEN`]). A longer one is malformed: the server answers a
/// RELEASE on the thread every client's requests come in on.
pub const RELEASED_AT_MOST: usize = 1 + MAX_KEY_LEN / 8;

/// A request's or reply's header, in an array of its own: the key and the
/// payload are sent after it as they are, never copied in beside it.
#[derive(Clone, Copy)]
pub struct Header {
    bytes: [u8; HEADER_MAX],
    len: usize,
}

/// The longest header.
const HEADER_MAX: usize = if REQUEST_LEN > REPLY_LEN {
    REQUEST_LEN
} else {
    REPLY_LEN
};

impl Default for Header {
    fn default() -> Self {
        Header {
            bytes: [0; HEADER_MAX],
            len: 0,
        }
    }
}

impl Header {
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    fn push(&mut self, b: &[u8]) {
        self.bytes[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }
}

/// First byte of a compact request: one whose only facts are its op, key,
/// id and inline value (GET, DELETE, a plain small PUT). Its 8-byte header
/// is the tag, the op, the key length in 2 bytes and the request id in 4;
/// the value is the rest of the message. A full header starts with
/// [`REQUEST_MAGIC`]'s low byte, which is not this one.
pub(super) const COMPACT_REQUEST_TAG: u8 = 0xb1;

pub const COMPACT_REQUEST_LEN: usize = 8;

/// First byte of a compact reply: a success whose only facts are the
/// version and an inline payload (a small GET's value, a PUT's new
/// version). Its 12-byte header is the tag, the version in 7 bytes and the
/// request id in 4, so a 64 B value goes back in a 76 B message instead of
/// 120 B (on Soft-RoCE a payload of 80 B or more takes the kernel's slower
/// ICRC routine, about 2 us per message under emulation). A full header
/// starts with [`REPLY_MAGIC`]'s low byte, which is not this one.
pub(super) const COMPACT_REPLY_TAG: u8 = 0xa1;

pub const COMPACT_REPLY_LEN: usize = 12;

/// Versions a compact header can carry (7 bytes).
pub(super) const COMPACT_VERSION_LIMIT: u64 = 1 << 56;

/// A key and value shorter than this together travel inside the request
/// and reply messages (the legacy "eager" protocol); longer ones move by
/// one-sided RDMA ("rendezvous").
pub const INLINE_MAX: usize = 4096;

/// Whether a value travels inside the messages.
pub fn is_inline(key_len: usize, value_len: usize) -> bool {
    key_len + value_len < INLINE_MAX
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// First request of a connection; the reply carries [`ServerInfo`].
    Hello = 1,
    Get = 2,
    /// PUT, or CAS with [`Request::cas`]; the value's place is in `source`.
    Write = 3,
    /// Asks for a write target of `value_len` bytes (values larger than the
    /// request buffer); the reply gives its address, rkey and a token.
    Alloc = 4,
    Delete = 5,
    /// Ends leases of values read remotely, or write targets not used:
    /// the header's, and any more as 8-byte words in the key's place; no
    /// reply.
    Release = 6,
}

impl Op {
    pub(super) fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Hello,
            2 => Op::Get,
            3 => Op::Write,
            4 => Op::Alloc,
            5 => Op::Delete,
            6 => Op::Release,
            _ => return None,
        })
    }
}

/// Where the value of a write is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// After the key in the message.
    Inline,
    /// In the client's request buffer at this offset (RDMA WRITE before the
    /// request, so it has landed when the request arrives).
    Staged { offset: u64, checksum: u64 },
    /// In the target an [`Op::Alloc`] granted.
    Allocated { token: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub req_id: u64,
    pub key_len: u32,
    pub value_len: u64,
    /// `Some(expected version)`: a CAS (0 expects the key to be absent).
    pub cas: Option<u64>,
    pub source: Source,
    /// Release: the lease.
    pub lease: u64,
}

pub(super) const FLAG_CAS: u8 = 1;

pub(super) const SRC_INLINE: u8 = 0;

pub(super) const SRC_STAGED: u8 = 1;

pub(super) const SRC_ALLOCATED: u8 = 2;

impl Request {
    pub fn new(op: Op, req_id: u64) -> Request {
        Request {
            op,
            req_id,
            key_len: 0,
            value_len: 0,
            cas: None,
            source: Source::Inline,
            lease: 0,
        }
    }

    /// The header (compact when it can say everything) followed by `key`
    /// and `inline_value`.
    pub fn encode(&self, key: &[u8], inline_value: &[u8]) -> Vec<u8> {
        let h = self.header(key.len(), inline_value.len());
        [h.as_slice(), key, inline_value].concat()
    }

    /// The header of a request for a `key_len`-byte key carrying
    /// `inline_len` bytes of value: compact when it can say everything.
    /// The key and the value follow it on the wire.
    pub fn header(&self, key_len: usize, inline_len: usize) -> Header {
        let mut h = Header::default();
        let plain = self.source == Source::Inline
            && self.cas.is_none()
            && self.lease == 0
            && self.value_len == inline_len as u64;
        if let (true, Ok(key_len), Ok(id)) =
            (plain, u16::try_from(key_len), u32::try_from(self.req_id))
        {
            h.push(&[COMPACT_REQUEST_TAG, self.op as u8]);
            h.push(&key_len.to_le_bytes());
            h.push(&id.to_le_bytes());
        } else {
            self.encode_full_header(key_len, &mut h);
        }
        h
    }

    pub(super) fn encode_full_header(&self, key_len: usize, h: &mut Header) {
        let (src, a, c) = match self.source {
            Source::Inline => (SRC_INLINE, 0, 0),
            Source::Staged { offset, checksum } => (SRC_STAGED, offset, checksum),
            Source::Allocated { token } => (SRC_ALLOCATED, token, 0),
        };
        h.push(&REQUEST_MAGIC.to_le_bytes());
        h.push(&[
            self.op as u8,
            if self.cas.is_some() { FLAG_CAS } else { 0 },
            src,
            0,
        ]);
        h.push(&self.req_id.to_le_bytes());
        h.push(&(key_len as u32).to_le_bytes());
        h.push(&[0; 4]);
        h.push(&self.value_len.to_le_bytes());
        h.push(&self.cas.unwrap_or(self.lease).to_le_bytes());
        h.push(&a.to_le_bytes());
        h.push(&c.to_le_bytes());
        debug_assert_eq!(h.len, REQUEST_LEN);
    }

    /// A release of `leases` (at least one): the first in the header, the
    /// rest as 8-byte words in the key's place, written to the front of
    /// `words` (8 bytes per lease after the first; a caller's stack buffer,
    /// so ending leases allocates nothing), which go with it as the
    /// returned bytes.
    ///
    /// # Panics
    /// When `leases` is empty or `words` is shorter than its other leases
    /// need.
    pub fn release<'w>(leases: &[u64], words: &'w mut [u8]) -> (Request, &'w [u8]) {
        let mut req = Request::new(Op::Release, 0);
        req.lease = leases[0];
        let more = &mut words[..(leases.len() - 1) * 8];
        for (word, lease) in more.chunks_exact_mut(8).zip(&leases[1..]) {
            word.copy_from_slice(&lease.to_le_bytes());
        }
        (req, more)
    }

    /// The leases a release names, given its key bytes (whole words:
    /// [`Request::decode`] refuses a release with a stray remainder).
    pub fn released<'a>(&self, key: &'a [u8]) -> impl Iterator<Item = u64> + 'a {
        std::iter::once(self.lease).chain(key.chunks_exact(8).map(|w| u64_at(w, 0)))
    }

    /// Parses a request; returns it with its key and inline value. Anything
    /// malformed is an error, never a panic.
    pub fn decode(msg: &[u8]) -> Result<(Request, &[u8], &[u8]), &'static str> {
        if msg.first() == Some(&COMPACT_REQUEST_TAG) {
            return Request::decode_compact(msg);
        }
        if msg.len() < REQUEST_LEN {
            return Err("request shorter than its header");
        }
        if u32_at(msg, 0) != REQUEST_MAGIC {
            return Err("bad request magic");
        }
        let op = Op::from_u8(msg[4]).ok_or("unknown request opcode")?;
        let key_len = u32_at(msg, 16);
        let value_len = u64_at(msg, 24);
        let arg = u64_at(msg, 32);
        let a = u64_at(msg, 40);
        let c = u64_at(msg, 48);
        let source = match msg[6] {
            SRC_INLINE => Source::Inline,
            SRC_STAGED => Source::Staged {
                offset: a,
                checksum: c,
            },
            SRC_ALLOCATED => Source::Allocated { token: a },
            _ => return Err("unknown value source"),
        };
        let key_end = REQUEST_LEN
            .checked_add(key_len as usize)
            .filter(|&e| e <= msg.len())
            .ok_or("key runs past the message")?;
        let key = &msg[REQUEST_LEN..key_end];
        if op == Op::Release && (key.len() > MAX_KEY_LEN || key.len() % 8 != 0) {
            return Err("a release names more leases than it may, or part of one");
        }
        let rest = &msg[key_end..];
        let inline = if op == Op::Write && source == Source::Inline {
            if rest.len() as u64 != value_len {
                return Err("inline value length does not match");
            }
            rest
        } else {
            &rest[..0]
        };
        let req = Request {
            op,
            req_id: u64_at(msg, 8),
            key_len,
            value_len,
            cas: (msg[5] & FLAG_CAS != 0).then_some(arg),
            source,
            lease: arg,
        };
        Ok((req, key, inline))
    }

    /// The id and key length of a compact plain PUT, from its header and
    /// the message's length (the value is the rest of the message): `None`
    /// for any other request, and for one whose key runs past the message
    /// ([`Request::decode`] says what is wrong with those).
    pub fn compact_put(head: &[u8; COMPACT_REQUEST_LEN], msg_len: usize) -> Option<(u64, usize)> {
        if head[0] != COMPACT_REQUEST_TAG || head[1] != Op::Write as u8 {
            return None;
        }
        let key_len = usize::from(u16::from_le_bytes([head[2], head[3]]));
        (COMPACT_REQUEST_LEN + key_len <= msg_len).then(|| (u64::from(u32_at(head, 4)), key_len))
    }

    pub(super) fn decode_compact(msg: &[u8]) -> Result<(Request, &[u8], &[u8]), &'static str> {
        if msg.len() < COMPACT_REQUEST_LEN {
            return Err("request shorter than its header");
        }
        let op = Op::from_u8(msg[1]).ok_or("unknown request opcode")?;
        let key_len = u16::from_le_bytes([msg[2], msg[3]]);
        let key_end = COMPACT_REQUEST_LEN + usize::from(key_len);
        let key = msg
            .get(COMPACT_REQUEST_LEN..key_end)
            .ok_or("key runs past the message")?;
        let rest = &msg[key_end..];
        if op != Op::Write && !rest.is_empty() {
            return Err("bytes after the key of a request that carries no value");
        }
        let mut req = Request::new(op, u64::from(u32_at(msg, 4)));
        req.key_len = u32::from(key_len);
        req.value_len = rest.len() as u64;
        Ok((req, key, rest))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reply {
    pub status: i32,
    pub req_id: u64,
    pub version: u64,
    pub value_len: u64,
    /// A GET served remotely, or an ALLOC: where to READ or WRITE.
    pub addr: u64,
    pub rkey: u32,
    pub remote: bool,
    /// Remote GET: the lease to release; ALLOC: the token to commit with.
    pub lease: u64,
}

impl Reply {
    pub fn error(req_id: u64, e: KvError) -> Reply {
        Reply {
            status: e.code(),
            req_id,
            ..Reply::default()
        }
    }

    /// Whether the reply says nothing a [`COMPACT_REPLY_LEN`] header cannot.
    pub(super) fn fits_compact(&self, payload: &[u8]) -> bool {
        let plain = Reply {
            req_id: self.req_id,
            version: self.version,
            value_len: payload.len() as u64,
            ..Reply::default()
        };
        *self == plain && self.version < COMPACT_VERSION_LIMIT && u32::try_from(self.req_id).is_ok()
    }

    /// The header (compact when it fits) followed by `payload`.
    pub fn encode(&self, payload: &[u8]) -> Vec<u8> {
        [self.header(payload).as_slice(), payload].concat()
    }

    /// The header of this reply carrying `payload` (compact when it fits);
    /// the payload follows it on the wire.
    pub fn header(&self, payload: &[u8]) -> Header {
        let mut h = Header::default();
        if self.fits_compact(payload) {
            h.push(&((self.version << 8) | u64::from(COMPACT_REPLY_TAG)).to_le_bytes());
            h.push(&(self.req_id as u32).to_le_bytes());
        } else {
            h.push(&REPLY_MAGIC.to_le_bytes());
            h.push(&self.status.to_le_bytes());
            h.push(&self.req_id.to_le_bytes());
            h.push(&self.version.to_le_bytes());
            h.push(&self.value_len.to_le_bytes());
            h.push(&self.addr.to_le_bytes());
            h.push(&self.rkey.to_le_bytes());
            h.push(&u32::from(self.remote).to_le_bytes());
            h.push(&self.lease.to_le_bytes());
        }
        h
    }

    /// The reply a compact header `head` starts, carrying `payload_len`
    /// bytes after it; `None` when `head` is not a compact header.
    pub fn decode_compact(head: &[u8; COMPACT_REPLY_LEN], payload_len: usize) -> Option<Reply> {
        (head[0] == COMPACT_REPLY_TAG).then(|| Reply {
            req_id: u64::from(u32_at(head, 8)),
            version: u64_at(head, 0) >> 8,
            value_len: payload_len as u64,
            ..Reply::default()
        })
    }

    pub fn decode(msg: &[u8]) -> Result<(Reply, &[u8]), &'static str> {
        if let Some((head, payload)) = msg.split_first_chunk::<COMPACT_REPLY_LEN>() {
            if let Some(reply) = Reply::decode_compact(head, payload.len()) {
                return Ok((reply, payload));
            }
        }
        if msg.len() < REPLY_LEN || u32_at(msg, 0) != REPLY_MAGIC {
            return Err("malformed reply");
        }
        let reply = Reply {
            status: u32_at(msg, 4) as i32,
            req_id: u64_at(msg, 8),
            version: u64_at(msg, 16),
            value_len: u64_at(msg, 24),
            addr: u64_at(msg, 32),
            rkey: u32_at(msg, 40),
            remote: u32_at(msg, 44) != 0,
            lease: u64_at(msg, 48),
        };
        Ok((reply, &msg[REPLY_LEN..]))
    }
}

/// What a client learns at HELLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerInfo {
    /// The client's own request buffer (it may only WRITE here).
    pub request_buf: u64,
    pub request_buf_len: u64,
    pub request_buf_rkey: u32,
    /// The hash index (READ only).
    pub index_addr: u64,
    pub index_rkey: u32,
    pub buckets: u64,
    /// The slab pool (READ only); only values here may be read one-sidedly.
    pub pool_rkey: u32,
    pub max_key: u32,
    pub max_value: u64,
}

pub const SERVER_INFO_LEN: usize = 56;

impl ServerInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(SERVER_INFO_LEN);
        b.extend_from_slice(&self.request_buf.to_le_bytes());
        b.extend_from_slice(&self.request_buf_len.to_le_bytes());
        b.extend_from_slice(&self.request_buf_rkey.to_le_bytes());
        b.extend_from_slice(&self.index_rkey.to_le_bytes());
        b.extend_from_slice(&self.index_addr.to_le_bytes());
        b.extend_from_slice(&self.buckets.to_le_bytes());
        b.extend_from_slice(&self.pool_rkey.to_le_bytes());
        b.extend_from_slice(&self.max_key.to_le_bytes());
        b.extend_from_slice(&self.max_value.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<ServerInfo> {
        (b.len() >= SERVER_INFO_LEN).then(|| ServerInfo {
            request_buf: u64_at(b, 0),
            request_buf_len: u64_at(b, 8),
            request_buf_rkey: u32_at(b, 16),
            index_rkey: u32_at(b, 20),
            index_addr: u64_at(b, 24),
            buckets: u64_at(b, 32),
            pool_rkey: u32_at(b, 40),
            max_key: u32_at(b, 44),
            max_value: u64_at(b, 48),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn release_names_every_lease() {
        let mut words = [0u8; 16];
        let (req, more) = Request::release(&[5, 6, 7], &mut words);
        let msg = req.encode(more, &[]);
        let (back, key, _) = Request::decode(&msg).unwrap();
        assert_eq!(back.op, Op::Release);
        assert_eq!(back.released(key).collect::<Vec<_>>(), vec![5, 6, 7]);
    }

    #[test]
    fn a_release_names_at_most_its_share_and_whole_words() {
        let leases: Vec<u64> = (1..=RELEASED_AT_MOST as u64 + 1).collect();
        let mut words = vec![0u8; leases.len() * 8];
        let most = &leases[..RELEASED_AT_MOST];
        let (req, more) = Request::release(most, &mut words);
        let msg = req.encode(more, &[]);
        let (back, key, _) = Request::decode(&msg).unwrap();
        assert_eq!(back.released(key).collect::<Vec<_>>(), most);
        let (req, more) = Request::release(&leases, &mut words);
        assert!(
            Request::decode(&req.encode(more, &[])).is_err(),
            "one too many"
        );
        let (req, _) = Request::release(&[5], &mut []);
        assert!(
            Request::decode(&req.encode(&[1, 2, 3], &[])).is_err(),
            "part of a word"
        );
    }

    #[test]
    fn request_round_trip() {
        let mut r = Request::new(Op::Write, 7);
        r.value_len = 3;
        r.cas = Some(5);
        let msg = r.encode(b"key", b"abc");
        let (d, key, value) = Request::decode(&msg).unwrap();
        assert_eq!(
            (d.op, d.req_id, d.cas, key, value),
            (Op::Write, 7, Some(5), &b"key"[..], &b"abc"[..])
        );
        let mut s = Request::new(Op::Write, 8);
        s.value_len = 10_000;
        s.source = Source::Staged {
            offset: 64,
            checksum: 99,
        };
        let msg = s.encode(b"k", &[]);
        assert_eq!(Request::decode(&msg).unwrap().0.source, s.source);
    }

    #[test]
    fn requests_are_compact_when_they_can_be() {
        let mut put = Request::new(Op::Write, 7);
        put.value_len = 64;
        let msg = put.encode(&[1; 16], &[2; 64]);
        assert_eq!(msg.len(), COMPACT_REQUEST_LEN + 16 + 64);
        let (d, key, value) = Request::decode(&msg).unwrap();
        assert_eq!(
            (d.op, d.req_id, d.key_len, d.value_len, d.cas, key, value),
            (Op::Write, 7, 16, 64, None, &[1u8; 16][..], &[2u8; 64][..])
        );
        let get = Request::new(Op::Get, u64::from(u32::MAX));
        let msg = get.encode(b"key", &[]);
        assert_eq!(msg.len(), COMPACT_REQUEST_LEN + 3);
        assert_eq!(
            Request::decode(&msg).unwrap().0,
            Request { key_len: 3, ..get }
        );
        // What a compact header cannot say takes the full one.
        let mut cas = put.clone();
        cas.cas = Some(3);
        let (release, more) = Request::release(&[5], &mut []);
        let mut alloc = Request::new(Op::Alloc, 1);
        alloc.value_len = 1 << 20;
        for (r, key, value) in [
            (cas, &[1u8; 16][..], &[2u8; 64][..]),
            (Request::new(Op::Get, 1 << 32), b"key", &[]),
            (Request::new(Op::Get, 1), &[0u8; 70_000][..], &[]),
            (release, more, &[]),
            (alloc, b"key", &[]),
        ] {
            let msg = r.encode(key, value);
            assert_eq!(msg.len(), REQUEST_LEN + key.len() + value.len(), "{r:?}");
        }
    }

    #[test]
    fn compact_puts_are_told_from_their_header() {
        let mut put = Request::new(Op::Write, 7);
        put.value_len = 64;
        let msg = put.encode(&[1; 16], &[2; 64]);
        let head = |m: &[u8]| -> [u8; COMPACT_REQUEST_LEN] {
            m[..COMPACT_REQUEST_LEN].try_into().unwrap()
        };
        assert_eq!(Request::compact_put(&head(&msg), msg.len()), Some((7, 16)));
        // The key must fit the message; the value may be empty.
        assert_eq!(Request::compact_put(&head(&msg), 23), None);
        assert_eq!(Request::compact_put(&head(&msg), 24), Some((7, 16)));
        let get = Request::new(Op::Get, 7).encode(&[1; 16], &[]);
        assert_eq!(Request::compact_put(&head(&get), get.len()), None);
        let mut cas = put.clone();
        cas.cas = Some(1);
        let full = cas.encode(&[1; 16], &[2; 64]);
        assert_eq!(Request::compact_put(&head(&full), full.len()), None);
    }

    #[test]
    fn malformed_compact_requests_are_errors() {
        let msg = Request::new(Op::Get, 1).encode(b"key", &[]);
        assert!(Request::decode(&msg[..5]).is_err());
        assert!(Request::decode(&msg[..10]).is_err()); // key cut short
        let mut extra = msg.clone();
        extra.push(0); // a GET carries no value
        assert!(Request::decode(&extra).is_err());
        let mut op = msg;
        op[1] = 99;
        assert!(Request::decode(&op).is_err());
    }

    #[test]
    fn malformed_requests_are_errors() {
        assert!(Request::decode(&[]).is_err());
        // An id past 32 bits takes the full header.
        let get = Request::new(Op::Get, 1 << 32);
        let mut msg = get.encode(b"key", &[]);
        msg[16] = 200; // key length beyond the message
        assert!(Request::decode(&msg).is_err());
        let mut msg = get.encode(b"key", &[]);
        msg[4] = 99;
        assert!(Request::decode(&msg).is_err());
        let mut w = Request::new(Op::Write, 1);
        w.value_len = 100; // says 100, carries 3
        assert!(Request::decode(&w.encode(b"k", b"abc")).is_err());
    }

    #[test]
    fn replies_round_trip_compact_when_they_can() {
        let get = Reply {
            req_id: 9,
            version: (1 << 56) - 1,
            value_len: 64,
            ..Reply::default()
        };
        let msg = get.encode(&[3; 64]);
        assert_eq!(msg.len(), COMPACT_REPLY_LEN + 64);
        assert_eq!(Reply::decode(&msg).unwrap(), (get, &[3u8; 64][..]));
        // Anything a compact header cannot say takes the full one.
        let full = [
            Reply {
                version: 1 << 56,
                ..get
            },
            Reply {
                req_id: 1 << 32,
                ..get
            },
            Reply {
                value_len: 1000,
                ..get
            },
            Reply {
                lease: 4,
                remote: true,
                addr: 8,
                rkey: 2,
                ..get
            },
            Reply::error(9, KvError::NotFound),
        ];
        for r in full {
            let msg = r.encode(&[3; 64]);
            assert_eq!(msg.len(), REPLY_LEN + 64, "{r:?}");
            assert_eq!(Reply::decode(&msg).unwrap(), (r, &[3u8; 64][..]));
        }
        assert!(Reply::decode(&[COMPACT_REPLY_TAG; 11]).is_err());
        assert!(Reply::decode(&[0; 12]).is_err());
    }
}
