//! Completion queues, completion channels and work completions.
//!
//! The discipline: a waiter polls; when the CQ is empty it arms the CQ
//! (`ibv_req_notify_cq`), polls once more to close the race with a completion
//! that arrived before arming, and only then sleeps on the channel. Every
//! channel event is acknowledged as soon as it is taken, so destroying a CQ
//! never blocks on unacknowledged events.

use std::ffi::CStr;
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::device::Context;
use super::error::{check_code, Error, Result};

pub(crate) struct ChannelInner {
    ch: NonNull<sys::ibv_comp_channel>,
    _ctx: Context,
}

// SAFETY: a completion channel is a file descriptor; verbs on it are
// thread-safe.
unsafe impl Send for ChannelInner {}
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds an Arc to it.
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.ch.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "ibv_destroy_comp_channel failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// A completion channel: a file descriptor that becomes readable when an
/// armed CQ attached to it gets a completion. Cheap to clone.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl CompletionChannel {
    pub(crate) fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: the context is alive.
        let ch = unsafe { sys::ibv_create_comp_channel(ctx.as_raw()) };
        let ch = NonNull::new(ch).ok_or_else(|| Error::last_os("ibv_create_comp_channel"))?;
        // SAFETY: ch is a live channel; its fd is ours to configure.
        let fd = unsafe { (*ch.as_ptr()).fd };
        set_nonblocking(fd, "fcntl(completion channel)")?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ch,
                _ctx: ctx.clone(),
            }),
        })
    }

    /// The file descriptor, for callers that multiplex it with others.
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive.
        unsafe { (*self.inner.ch.as_ptr()).fd }
    }

    /// Takes one event and acknowledges it, waiting at most `timeout`.
    /// Returns the raw CQ that fired, or `None` when the time ran out.
    pub fn get_event(&self, timeout: Duration) -> Result<Option<*mut sys::ibv_cq>> {
        // Set at the first wait: a caller that was told the channel is
        // readable (the usual case) never reads the clock.
        let mut deadline = None;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut cq_ctx = std::ptr::null_mut();
            // SAFETY: the channel is alive; the fd is non-blocking.
            let rc = unsafe { sys::ibv_get_cq_event(self.inner.ch.as_ptr(), &mut cq, &mut cq_ctx) };
            if rc == 0 {
                // SAFETY: cq came from the event just taken.
                unsafe { sys::ibv_ack_cq_events(cq, 1) };
                return Ok(Some(cq));
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EAGAIN) {
                return Err(Error::Verb {
                    verb: "ibv_get_cq_event",
                    source: err,
                });
            }
            if timeout.is_zero() {
                return Ok(None);
            }
            let now = Instant::now();
            let left = deadline
                .get_or_insert(now + timeout)
                .saturating_duration_since(now);
            if left.is_zero() || !wait_readable(self.fd(), left, "poll(completion channel)")? {
                return Ok(None);
            }
        }
    }
}

pub(crate) fn set_nonblocking(fd: RawFd, verb: &'static str) -> Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(Error::last_os(verb));
    }
    Ok(())
}

/// Waits until `fd` is readable or `timeout` passes; true when readable.
pub(crate) fn wait_readable(fd: RawFd, timeout: Duration, verb: &'static str) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // Round up so that a sub-millisecond remainder still waits.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Verb { verb, source: err });
        }
    }
}

pub(crate) struct CqInner {
    pub(crate) cq: NonNull<sys::ibv_cq>,
    channel: Option<CompletionChannel>,
    _ctx: Context,
}

// SAFETY: CQ verbs are thread-safe in libibverbs.
unsafe impl Send for CqInner {}
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using the CQ holds an Arc to it; all channel events
        // were acknowledged when taken.
        let rc = unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "ibv_destroy_cq failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
}

/// A completion queue. Cheap to clone.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl CompletionQueue {
    pub(crate) fn new(
        ctx: &Context,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<Self> {
        let cqe = i32::try_from(cqe.max(1)).map_err(|_| Error::invalid("CQ size over i32::MAX"))?;
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.inner.ch.as_ptr());
        // SAFETY: the context (and channel, if any) are alive.
        let cq = unsafe { sys::ibv_create_cq(ctx.as_raw(), cqe, std::ptr::null_mut(), ch, 0) };
        let cq = NonNull::new(cq).ok_or_else(|| Error::last_os("ibv_create_cq"))?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                channel: channel.cloned(),
                _ctx: ctx.clone(),
            }),
        })
    }

    /// The raw `ibv_cq`.
    pub fn as_raw(&self) -> *mut sys::ibv_cq {
        self.inner.cq.as_ptr()
    }

    /// The number of entries the CQ holds.
    pub fn capacity(&self) -> usize {
        // SAFETY: the CQ is alive.
        unsafe { (*self.as_raw()).cqe as usize }
    }

    /// The completion channel the CQ reports to, if any.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// Takes up to `out.len()` completions without waiting; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let n = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: Completion is repr(transparent) over ibv_wc and out has room
        // for n entries.
        let rc = unsafe { sys::ibv_poll_cq(self.as_raw(), n, out.as_mut_ptr().cast()) };
        if rc < 0 {
            return Err(Error::from_code("ibv_poll_cq", rc));
        }
        Ok(rc as usize)
    }

    /// Asks for a channel event at the next completion (`solicited_only`:
    /// only at solicited ones).
    pub fn arm(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is alive.
        check_code("ibv_req_notify_cq", unsafe {
            sys::ibv_req_notify_cq(self.as_raw(), i32::from(solicited_only))
        })
    }

    /// Waits up to `timeout` for at least one completion and takes up to
    /// `out.len()`. With a channel it sleeps; without one it spins. A wait that
    /// ends empty-handed is an [`Error::Timeout`].
    ///
    /// Only one thread may wait on a channel at a time.
    pub fn wait(&self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: "a work completion",
                    timeout,
                });
            }
            match &self.inner.channel {
                None => std::thread::yield_now(),
                Some(ch) => {
                    self.arm(false)?;
                    let n = self.poll(out)?;
                    if n > 0 {
                        return Ok(n);
                    }
                    // An event for another CQ on a shared channel just means
                    // polling again; this CQ's own completions are what count.
                    ch.get_event(left)?;
                }
            }
        }
    }

    /// Waits for exactly one completion and turns a failed one into an error.
    pub fn wait_one(&self, timeout: Duration) -> Result<Completion> {
        let mut wc = [Completion::default()];
        self.wait(&mut wc, timeout)?;
        let [wc] = wc;
        wc.into_result()
    }
}

/// A kept place for the completions of one poll, reused poll after poll:
/// zeroed once, then only the entries a poll filled are cleared before the
/// next, so a field a provider leaves unwritten (a failed completion's
/// opcode, a send's `byte_len`; see `ibv_poll_cq(3)`) reads 0, never an
/// earlier completion's, and an empty poll costs no clearing at all.
pub struct CompletionRoom<const N: usize> {
    wcs: [Completion; N],
    filled: usize,
}

impl<const N: usize> CompletionRoom<N> {
    /// A room of `N` zeroed entries (`N * 48` bytes, zeroed here once).
    pub const fn new() -> Self {
        CompletionRoom {
            wcs: [Completion::ZEROED; N],
            filled: 0,
        }
    }

    /// Takes up to `N` completions from `cq` without waiting.
    pub fn poll(&mut self, cq: &CompletionQueue) -> Result<&[Completion]> {
        self.poll_up_to(cq, N)
    }

    /// Takes up to `max` (at most `N`) completions from `cq` without
    /// waiting.
    pub fn poll_up_to(&mut self, cq: &CompletionQueue, max: usize) -> Result<&[Completion]> {
        self.wcs[..self.filled].fill_with(Completion::default);
        let max = max.min(N);
        // A provider may write entries and still fail: all it was offered
        // is cleared next time unless the poll says how many it filled.
        self.filled = max;
        let n = cq.poll(&mut self.wcs[..max])?;
        self.filled = n;
        Ok(&self.wcs[..n])
    }
}

impl<const N: usize> Default for CompletionRoom<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// A work completion, laid out exactly as `struct ibv_wc`.
#[repr(transparent)]
pub struct Completion(sys::ibv_wc);

impl Default for Completion {
    fn default() -> Self {
        Self::ZEROED
    }
}

impl Clone for Completion {
    fn clone(&self) -> Self {
        // SAFETY: ibv_wc is plain data.
        Completion(unsafe { std::ptr::read(&self.0) })
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm", &self.imm())
            .finish()
    }
}

impl Completion {
    // SAFETY: all-zero is a valid ibv_wc.
    const ZEROED: Completion = Completion(unsafe { std::mem::zeroed() });

    /// The id given when the request was posted.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    pub fn status(&self) -> WcStatus {
        WcStatus(self.0.status)
    }

    pub fn is_ok(&self) -> bool {
        self.0.status == sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// What completed. Only meaningful when the status is success.
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode(self.0.opcode)
    }

    /// Bytes received (receive completions).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate, in host byte order, when the message carried one.
    pub fn imm(&self) -> Option<u32> {
        let with_imm = sys::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        if self.0.wc_flags & with_imm != 0 {
            // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate.
            Some(u32::from_be(unsafe {
                self.0.imm_data_invalidated_rkey_union.imm_data
            }))
        } else {
            None
        }
    }

    /// The local QP number the completion belongs to.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// The sender's QP number (unreliable datagram receives).
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }

    /// `Ok(self)` on success, else [`Error::Completion`].
    pub fn into_result(self) -> Result<Completion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(Error::Completion {
                wr_id: self.wr_id(),
                status: self.status(),
                vendor_err: self.vendor_err(),
            })
        }
    }
}

/// A completion status (`enum ibv_wc_status`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcStatus(pub u32);

impl WcStatus {
    pub const SUCCESS: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_SUCCESS);
    pub const LOC_PROT_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_LOC_PROT_ERR);
    pub const WR_FLUSH_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
    pub const REM_ACCESS_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
    pub const REM_INV_REQ_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
    pub const RETRY_EXC_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    pub const RNR_RETRY_EXC_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR);

    /// libibverbs' description, e.g. "remote access error".
    pub fn description(self) -> String {
        // SAFETY: returns a static string for any value.
        let s = unsafe { CStr::from_ptr(sys::ibv_wc_status_str(self.0)) };
        s.to_string_lossy().into_owned()
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "status {} ({})", self.0, self.description())
    }
}

impl fmt::Debug for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What a completion is for (`enum ibv_wc_opcode`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcOpcode(pub u32);

impl WcOpcode {
    pub const SEND: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_SEND);
    pub const RDMA_WRITE: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RDMA_WRITE);
    pub const RDMA_READ: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RDMA_READ);
    pub const COMP_SWAP: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_COMP_SWAP);
    pub const FETCH_ADD: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_FETCH_ADD);
    pub const RECV: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RECV);
    pub const RECV_RDMA_WITH_IMM: WcOpcode =
        WcOpcode(sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM);

    fn name(self) -> &'static str {
        match self {
            Self::SEND => "SEND",
            Self::RDMA_WRITE => "RDMA_WRITE",
            Self::RDMA_READ => "RDMA_READ",
            Self::COMP_SWAP => "COMP_SWAP",
            Self::FETCH_ADD => "FETCH_ADD",
            Self::RECV => "RECV",
            Self::RECV_RDMA_WITH_IMM => "RECV_RDMA_WITH_IMM",
            _ => "other",
        }
    }
}

impl fmt::Display for WcOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name())
    }
}

impl fmt::Debug for WcOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}
