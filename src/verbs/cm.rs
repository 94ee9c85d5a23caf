//! RDMA CM: event channels and connection ids. Every event is copied out and
//! acknowledged as soon as it is taken, so no caller can forget an ack (which
//! would make `rdma_destroy_id` block forever).

use std::ffi::CStr;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::cq::{set_nonblocking, wait_readable, CompletionQueue};
use super::device::Context;
use super::error::{check_errno, Error, Result};
use super::pd::ProtectionDomain;
use super::qp::{init_attr, QpCaps, QueuePair};

/// Largest private data in a connect request (the CM REQ message).
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Largest private data in an accept (the CM REP message).
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Least extra time to wait for a resolution event beyond the kernel's own timeout.
const RESOLVE_GRACE: Duration = Duration::from_secs(1);

struct ChannelInner {
    ch: NonNull<sys::rdma_event_channel>,
}

// SAFETY: an event channel is a file descriptor; librdmacm is thread-safe.
unsafe impl Send for ChannelInner {}
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every id on the channel holds an Arc to it, so none is left.
        unsafe { sys::rdma_destroy_event_channel(self.ch.as_ptr()) };
    }
}

/// An RDMA CM event channel. Cheap to clone.
#[derive(Clone)]
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

impl EventChannel {
    pub fn new() -> Result<EventChannel> {
        // SAFETY: no preconditions.
        let ch = unsafe { sys::rdma_create_event_channel() };
        let ch = NonNull::new(ch).ok_or_else(|| Error::last_os("rdma_create_event_channel"))?;
        let channel = EventChannel {
            inner: Arc::new(ChannelInner { ch }),
        };
        set_nonblocking(channel.fd(), "fcntl(rdma event channel)")?;
        Ok(channel)
    }

    /// The file descriptor, readable when an event is pending.
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive.
        unsafe { (*self.inner.ch.as_ptr()).fd }
    }

    /// Waits until an event is pending or `timeout` passes; true when one
    /// is (another thread reading the channel may take it first).
    pub fn wait_readable(&self, timeout: Duration) -> Result<bool> {
        wait_readable(self.fd(), timeout, "poll(rdma event channel)")
    }

    /// Takes the next event, waiting at most `timeout`, and acknowledges it.
    pub fn get_event(&self, timeout: Duration) -> Result<CmEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut ev = std::ptr::null_mut();
            // SAFETY: the channel is alive and non-blocking.
            if unsafe { sys::rdma_get_cm_event(self.inner.ch.as_ptr(), &mut ev) } == 0 {
                // SAFETY: ev is a live event until acknowledged below.
                let event = unsafe { self.copy_event(&*ev) };
                // SAFETY: acknowledged exactly once, after the copy.
                unsafe { sys::rdma_ack_cm_event(ev) };
                return Ok(event);
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EAGAIN) {
                return Err(Error::Verb {
                    verb: "rdma_get_cm_event",
                    source: err,
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.wait_readable(left)? {
                return Err(Error::Timeout {
                    what: "an RDMA CM event",
                    timeout,
                });
            }
        }
    }

    /// # Safety
    /// `ev` must be a live, unacknowledged event from this channel.
    unsafe fn copy_event(&self, ev: &sys::rdma_cm_event) -> CmEvent {
        let kind = CmEventKind(ev.event);
        let conn = &ev.param.conn;
        let private_data = if conn.private_data.is_null() || !kind.carries_conn_param() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                conn.private_data_len as usize,
            )
            .to_vec()
        };
        let (responder_resources, initiator_depth) = if kind.carries_conn_param() {
            (conn.responder_resources, conn.initiator_depth)
        } else {
            (0, 0)
        };
        // A connect request comes with a new id, which is now ours to own.
        let new_id = (kind == CmEventKind::CONNECT_REQUEST)
            .then(|| NonNull::new(ev.id))
            .flatten()
            .map(|id| CmId {
                inner: Arc::new(CmIdInner {
                    id,
                    channel: self.clone(),
                }),
            });
        CmEvent {
            kind,
            status: ev.status,
            id: CmIdRef(ev.id as usize),
            listen_id: NonNull::new(ev.listen_id).map(|p| CmIdRef(p.as_ptr() as usize)),
            private_data,
            responder_resources,
            initiator_depth,
            new_id,
        }
    }
}

/// An RDMA CM event type (`enum rdma_cm_event_type`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmEventKind(pub u32);

impl CmEventKind {
    pub const ADDR_RESOLVED: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED);
    pub const ADDR_ERROR: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR);
    pub const ROUTE_RESOLVED: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED);
    pub const ROUTE_ERROR: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR);
    pub const CONNECT_REQUEST: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST);
    pub const CONNECT_RESPONSE: Self =
        Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE);
    pub const CONNECT_ERROR: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR);
    pub const UNREACHABLE: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE);
    pub const REJECTED: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED);
    pub const ESTABLISHED: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED);
    pub const DISCONNECTED: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED);
    pub const DEVICE_REMOVAL: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL);
    pub const TIMEWAIT_EXIT: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT);
    pub const ADDR_CHANGE: Self = Self(sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_CHANGE);

    fn carries_conn_param(self) -> bool {
        matches!(
            self,
            Self::CONNECT_REQUEST | Self::CONNECT_RESPONSE | Self::ESTABLISHED | Self::REJECTED
        )
    }
}

impl fmt::Display for CmEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: returns a static string for any value.
        let s = unsafe { CStr::from_ptr(sys::rdma_event_str(self.0)) };
        f.write_str(&s.to_string_lossy())
    }
}

impl fmt::Debug for CmEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Identity of a CM id, to match events to the id they are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmIdRef(usize);

/// An RDMA CM event, copied out of librdmacm and already acknowledged.
#[derive(Debug)]
pub struct CmEvent {
    pub kind: CmEventKind,
    /// 0, a negative errno, or (for REJECTED) the reject reason.
    pub status: i32,
    /// The id the event is for (for a connect request: the new id).
    pub id: CmIdRef,
    /// For a connect request, the listening id it arrived on.
    pub listen_id: Option<CmIdRef>,
    /// The peer's private data (connection events).
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    new_id: Option<CmId>,
}

impl CmEvent {
    /// For a connect request, the new connection's id (once; later calls give
    /// `None`). Dropping it unaccepted rejects the request implicitly.
    pub fn take_new_id(&mut self) -> Option<CmId> {
        self.new_id.take()
    }
}

struct CmIdInner {
    id: NonNull<sys::rdma_cm_id>,
    channel: EventChannel,
}

// SAFETY: librdmacm ids may be used from any thread.
unsafe impl Send for CmIdInner {}
unsafe impl Sync for CmIdInner {}

impl Drop for CmIdInner {
    fn drop(&mut self) {
        // SAFETY: a QP made on the id holds an Arc to it and is destroyed
        // first; all events were acknowledged when taken.
        let rc = unsafe { sys::rdma_destroy_id(self.id.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "rdma_destroy_id failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// An RDMA CM id (a listening endpoint or one side of a connection). Cheap to
/// clone; destroyed when the last clone and its QP are gone.
#[derive(Clone)]
pub struct CmId {
    inner: Arc<CmIdInner>,
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .finish()
    }
}

/// Connection parameters for connect and accept. Resources are capped by the
/// device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// Outstanding READs/atomics the peer may target at us.
    pub responder_resources: u8,
    /// Outstanding READs/atomics we may issue.
    pub initiator_depth: u8,
    pub retry_count: u8,
    /// 7 retries forever: avoid it (see [`super::QpOptions::rnr_retry`]).
    pub rnr_retry_count: u8,
    /// Delivered to the peer with its event (at most 56 bytes on connect,
    /// 196 on accept).
    pub private_data: Vec<u8>,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            responder_resources: 16,
            initiator_depth: 16,
            retry_count: 7,
            rnr_retry_count: 6,
            private_data: Vec::new(),
        }
    }
}

impl CmId {
    /// A new id for reliable connections (`RDMA_PS_TCP`) on `channel`.
    pub fn new(channel: &EventChannel) -> Result<CmId> {
        let mut id = std::ptr::null_mut();
        // SAFETY: the channel is alive; id is an out-parameter.
        check_errno("rdma_create_id", unsafe {
            sys::rdma_create_id(
                channel.inner.ch.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        let id = NonNull::new(id).ok_or_else(|| Error::last_os("rdma_create_id"))?;
        Ok(CmId {
            inner: Arc::new(CmIdInner {
                id,
                channel: channel.clone(),
            }),
        })
    }

    /// This id moved to an event channel of its own (`rdma_migrate_id`):
    /// a connection taken from a listener's channel then gets its own
    /// events (ESTABLISHED, DISCONNECTED) there, apart from the listener's
    /// later connect requests and from the other connections' events. Only
    /// for an id nothing else holds (a fresh one, before its QP); an error
    /// otherwise, and if the move fails the id is gone (a connect request
    /// is then rejected).
    pub fn on_own_channel(self) -> Result<CmId> {
        let inner = Arc::try_unwrap(self.inner)
            .map_err(|_| Error::invalid("only an id held nowhere else can change its channel"))?;
        let channel = EventChannel::new()?;
        // SAFETY: both are alive; each event of the id was acknowledged when
        // it was taken, so the call does not wait.
        check_errno("rdma_migrate_id", unsafe {
            sys::rdma_migrate_id(inner.id.as_ptr(), channel.inner.ch.as_ptr())
        })?;
        // The id lives on in the new inner: the old one's drop must not
        // destroy it, only let go of the old channel.
        let old = std::mem::ManuallyDrop::new(inner);
        // SAFETY: read once, from a value that is never dropped or used again.
        drop(unsafe { std::ptr::read(&old.channel) });
        Ok(CmId {
            inner: Arc::new(CmIdInner {
                id: old.id,
                channel,
            }),
        })
    }

    /// The raw `rdma_cm_id`.
    pub fn as_raw(&self) -> *mut sys::rdma_cm_id {
        self.inner.id.as_ptr()
    }

    /// Identity, to compare with [`CmEvent::id`].
    pub fn id_ref(&self) -> CmIdRef {
        CmIdRef(self.as_raw() as usize)
    }

    /// The channel this id reports to.
    pub fn channel(&self) -> &EventChannel {
        &self.inner.channel
    }

    /// The device the id is bound to, once an address is bound or resolved.
    pub fn context(&self) -> Option<Context> {
        // SAFETY: the id is alive; verbs is set by librdmacm and stays open.
        NonNull::new(unsafe { (*self.as_raw()).verbs })
            .map(|ctx| unsafe { Context::from_rdma_cm(ctx) })
    }

    /// The device port the id is bound to.
    pub fn port_num(&self) -> u8 {
        // SAFETY: the id is alive.
        unsafe { (*self.as_raw()).port_num }
    }

    /// Binds to a local address (port 0: any free port).
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let (mut sa, _) = to_sockaddr(addr);
        // SAFETY: the id is alive; sa holds a valid address.
        check_errno("rdma_bind_addr", unsafe {
            sys::rdma_bind_addr(
                self.as_raw(),
                (&mut sa as *mut libc::sockaddr_storage).cast(),
            )
        })
    }

    /// Starts listening; connect requests arrive as events on the channel.
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: the id is alive.
        check_errno("rdma_listen", unsafe {
            sys::rdma_listen(self.as_raw(), backlog)
        })
    }

    /// Starts resolving `dst` (from `src`, if given); completes with
    /// ADDR_RESOLVED or ADDR_ERROR.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let mut src = src.map(|s| to_sockaddr(s).0);
        let (mut dst, _) = to_sockaddr(dst);
        let src_ptr = src.as_mut().map_or(std::ptr::null_mut(), |s| {
            (s as *mut libc::sockaddr_storage).cast()
        });
        // SAFETY: the id is alive; the addresses are valid for the call.
        check_errno("rdma_resolve_addr", unsafe {
            sys::rdma_resolve_addr(
                self.as_raw(),
                src_ptr,
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                timeout_ms(timeout),
            )
        })
    }

    /// Starts resolving the route; completes with ROUTE_RESOLVED or
    /// ROUTE_ERROR.
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        // SAFETY: the id is alive.
        check_errno("rdma_resolve_route", unsafe {
            sys::rdma_resolve_route(self.as_raw(), timeout_ms(timeout))
        })
    }

    /// Creates the id's RC QP in `pd` (which must be on the id's device).
    /// RDMA CM moves it through its states on connect / accept.
    pub fn create_qp(
        &self,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: &QpCaps,
    ) -> Result<QueuePair> {
        let ctx = self
            .context()
            .ok_or_else(|| Error::invalid("the CM id has no device yet: resolve or bind first"))?;
        if ctx.as_raw() != pd.context().as_raw() {
            return Err(Error::invalid(
                "the PD belongs to another device than the CM id",
            ));
        }
        let mut attr = init_attr(send_cq, recv_cq, caps);
        // SAFETY: the id, PD and CQs are alive; attr is filled.
        check_errno("rdma_create_qp", unsafe {
            sys::rdma_create_qp(self.as_raw(), pd.as_raw(), &mut attr)
        })?;
        // SAFETY: rdma_create_qp succeeded, so id->qp is set.
        let qp = NonNull::new(unsafe { (*self.as_raw()).qp })
            .ok_or_else(|| Error::last_os("rdma_create_qp"))?;
        Ok(QueuePair::from_raw(
            qp,
            Some(self.clone()),
            pd,
            send_cq,
            recv_cq,
        ))
    }

    fn conn_param(&self, param: &ConnParam, max_private: usize) -> Result<sys::rdma_conn_param> {
        if param.private_data.len() > max_private {
            return Err(Error::invalid(format!(
                "private data of {} bytes exceeds the {max_private} allowed",
                param.private_data.len()
            )));
        }
        let dev = self
            .context()
            .ok_or_else(|| Error::invalid("the CM id has no device"))?
            .query_device()?;
        let cap = |want: u8, max: i32| (want as i32).min(max).clamp(0, 255) as u8;
        // SAFETY: all-zero is a valid rdma_conn_param.
        let mut p: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = param.private_data.as_ptr().cast();
        p.private_data_len = param.private_data.len() as u8;
        p.responder_resources = cap(param.responder_resources, dev.max_qp_rd_atom);
        p.initiator_depth = cap(param.initiator_depth, dev.max_qp_init_rd_atom);
        p.retry_count = param.retry_count.min(7);
        p.rnr_retry_count = param.rnr_retry_count.min(7);
        Ok(p)
    }

    /// Starts connecting (after the route is resolved); completes with
    /// ESTABLISHED, or REJECTED / UNREACHABLE / CONNECT_ERROR.
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let mut p = self.conn_param(param, MAX_CONNECT_PRIVATE_DATA)?;
        // SAFETY: the id is alive; p and its private data live for the call.
        check_errno("rdma_connect", unsafe {
            sys::rdma_connect(self.as_raw(), &mut p)
        })
    }

    /// Accepts a connect request on this (new) id; ESTABLISHED follows.
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let mut p = self.conn_param(param, MAX_ACCEPT_PRIVATE_DATA)?;
        // SAFETY: as in connect.
        check_errno("rdma_accept", unsafe {
            sys::rdma_accept(self.as_raw(), &mut p)
        })
    }

    /// Rejects a connect request on this (new) id.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::invalid("reject private data over 255 bytes"))?;
        // SAFETY: the id is alive; the data lives for the call.
        check_errno("rdma_reject", unsafe {
            sys::rdma_reject(self.as_raw(), private_data.as_ptr().cast(), len)
        })
    }

    /// Disconnects: the QP goes to error (outstanding work flushes) and the
    /// peer gets DISCONNECTED. This side gets its own DISCONNECTED once the
    /// peer answers by disconnecting too, which it should do on that event.
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: the id is alive.
        check_errno("rdma_disconnect", unsafe {
            sys::rdma_disconnect(self.as_raw())
        })
    }

    /// The local address the id is bound to.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is alive; the address lives inside it.
        unsafe { from_sockaddr(sys::rdma_get_local_addr(&*self.as_raw())) }
    }

    /// The peer's address, once connected or resolved.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above.
        unsafe { from_sockaddr(sys::rdma_get_peer_addr(&*self.as_raw())) }
    }

    /// Waits for the next event on this id's channel and requires it to be
    /// `kind` for this id. Only for ids whose channel no other code reads.
    pub fn expect_event(&self, kind: CmEventKind, timeout: Duration) -> Result<CmEvent> {
        let ev = self.channel().get_event(timeout)?;
        let mine = ev.id == self.id_ref() || ev.listen_id == Some(self.id_ref());
        if ev.kind == kind && mine {
            Ok(ev)
        } else {
            Err(Error::CmEvent {
                expected: kind,
                got: ev.kind,
                status: ev.status,
            })
        }
    }

    /// Creates an id on a channel of its own and resolves the address and
    /// route to `dst`, giving each step `timeout`, as `rdma_resolve_addr` and
    /// `rdma_resolve_route` do. The kernel reports its own timeout as an error
    /// event; we wait a grace period longer for that event, so a busy machine
    /// that delivers a success late (a new process's first resolution opens
    /// the device) is not mistaken for a failure. Bounded by
    /// 2 x (`timeout` + grace) in all.
    pub fn resolve(dst: SocketAddr, src: Option<SocketAddr>, timeout: Duration) -> Result<CmId> {
        let wait = timeout + timeout.max(RESOLVE_GRACE);
        let id = CmId::new(&EventChannel::new()?)?;
        id.resolve_addr(src, dst, timeout)?;
        id.expect_event(CmEventKind::ADDR_RESOLVED, wait)?;
        id.resolve_route(timeout)?;
        id.expect_event(CmEventKind::ROUTE_RESOLVED, wait)?;
        Ok(id)
    }

    /// A listening id on a channel of its own.
    pub fn listen_on(addr: SocketAddr, backlog: i32) -> Result<CmId> {
        let id = CmId::new(&EventChannel::new()?)?;
        id.bind(addr)?;
        id.listen(backlog)?;
        Ok(id)
    }

    /// On a listening id: waits for the next connect request and returns the
    /// new connection's id with the event.
    pub fn get_request(&self, timeout: Duration) -> Result<(CmId, CmEvent)> {
        let mut ev = self.expect_event(CmEventKind::CONNECT_REQUEST, timeout)?;
        let id = ev
            .take_new_id()
            .ok_or_else(|| Error::invalid("connect request without an id"))?;
        Ok((id, ev))
    }
}

fn timeout_ms(t: Duration) -> i32 {
    t.as_millis().clamp(1, i32::MAX as u128) as i32
}

fn to_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// # Safety
/// `sa` must be NULL or point to a valid socket address.
unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    match i32::from((*sa).sa_family) {
        libc::AF_INET => {
            let sin = &*sa.cast::<libc::sockaddr_in>();
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            let sin6 = &*sa.cast::<libc::sockaddr_in6>();
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip() {
        for addr in ["198.18.0.1:7471", "[fe80::1]:9", "0.0.0.0:0"] {
            let addr: SocketAddr = addr.parse().unwrap();
            let (ss, _) = to_sockaddr(addr);
            let back = unsafe { from_sockaddr((&ss as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(addr));
        }
    }
}
