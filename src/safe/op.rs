//! Posted operations as futures.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::cq::{CqShared, Ticket};
use super::error::Result;
use super::region::{Local, RawHold, TOKEN};
use crate::verbs::{self, WcOpcode, WcStatus};

/// A posted operation. It owns its memory until the completion arrives, then
/// resolves to it: `Ok` with the memory back, or `Err` with the failed
/// status (see [`super::Error::status`]).
///
/// Dropping it is safe at any time: the memory stays parked with the CQ
/// until the device is done with it.
#[must_use = "an operation does nothing useful unless awaited; dropping it only parks its memory"]
pub struct Op<S: Local> {
    cq: Arc<CqShared>,
    ticket: Ticket,
    mem: Option<S>,
    /// Something else the device uses until completion (a datagram's
    /// address handle).
    keep: Option<RawHold>,
}

impl<S: Local> Op<S> {
    pub(crate) fn new(cq: Arc<CqShared>, ticket: Ticket, mem: S) -> Self {
        Op {
            cq,
            ticket,
            mem: Some(mem),
            keep: None,
        }
    }

    pub(crate) fn keeping(mut self, keep: RawHold) -> Self {
        self.keep = Some(keep);
        self
    }
}

/// Passes of [`block_on`] per look at the clock.
const CLOCK_EVERY: u32 = 16;

/// Polls `fut` on this thread until it resolves or `timeout` passes (the
/// clock is looked at every 16 polls, so a zero timeout still polls 16
/// times), with no executor: for [`Progress::Poll`](super::Progress::Poll)
/// CQs, whose futures reap their own completions, and for the other modes
/// while their reaper runs elsewhere.
pub fn block_on<F: Future + Unpin>(mut fut: F, timeout: std::time::Duration) -> Option<F::Output> {
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    let deadline = std::time::Instant::now() + timeout;
    // The clock is read every few passes only: a reading costs more than
    // a pass over an empty CQ, and would delay seeing the completion.
    let mut pass = 0u32;
    loop {
        if let Poll::Ready(v) = Pin::new(&mut fut).poll(&mut cx) {
            return Some(v);
        }
        pass = pass.wrapping_add(1);
        if pass % CLOCK_EVERY == 0 && std::time::Instant::now() >= deadline {
            return None;
        }
        std::hint::spin_loop();
    }
}

fn noop_waker() -> std::task::Waker {
    use std::task::{RawWaker, RawWakerVTable, Waker};
    fn clone(_: *const ()) -> RawWaker {
        RawWaker::new(std::ptr::null(), &VTABLE)
    }
    fn noop(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);
    // SAFETY: the vtable's functions ignore the (null) data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

impl<S: Local + Unpin> Future for Op<S> {
    type Output = Result<Completion<S>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.mem.is_none() {
            return Poll::Ready(Err(super::Error::invalid(
                "operation polled after it resolved",
            )));
        }
        let wc = match this.cq.poll_ticket(this.ticket, cx) {
            Poll::Pending => return Poll::Pending,
            // Polling the CQ failed: this operation did not complete, and
            // the device may still use its memory, which it keeps (until
            // a later poll resolves it, or a drop parks it).
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Ready(Ok(wc)) => wc,
        };
        let mem = this.mem.take().expect("checked above");
        this.keep = None;
        let wc = wc.into_result()?;
        Poll::Ready(Ok(Completion { wc, mem }))
    }
}

impl<S: Local> Drop for Op<S> {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            let mut holds = Vec::new();
            mem.park(&mut holds, TOKEN);
            holds.extend(self.keep.take());
            self.cq.cancel(self.ticket, holds);
        }
    }
}

/// A batch posted with one doorbell: resolves when its last request
/// completes, to that completion, or to the first failure in the batch.
/// Holds every segment of the batch until then; dropping it is safe.
#[must_use = "a batch does nothing useful unless awaited; dropping it only parks its memory"]
pub struct BatchOp {
    cq: Arc<CqShared>,
    ticket: Ticket,
    holds: Option<Vec<RawHold>>,
}

impl BatchOp {
    pub(crate) fn new(cq: Arc<CqShared>, ticket: Ticket, holds: Vec<RawHold>) -> Self {
        BatchOp {
            cq,
            ticket,
            holds: Some(holds),
        }
    }
}

impl Future for BatchOp {
    type Output = Result<verbs::Completion>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.holds.is_none() {
            return Poll::Ready(Err(super::Error::invalid("batch polled after it resolved")));
        }
        match this.cq.poll_ticket(this.ticket, cx) {
            Poll::Pending => Poll::Pending,
            // As for an `Op`: the batch is still on the device.
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(wc)) => {
                this.holds = None;
                Poll::Ready(Ok(wc.into_result()?))
            }
        }
    }
}

impl Drop for BatchOp {
    fn drop(&mut self) {
        if let Some(holds) = self.holds.take() {
            self.cq.cancel(self.ticket, holds);
        }
    }
}

/// A successful completion, with the memory the operation used.
#[derive(Debug)]
pub struct Completion<S> {
    wc: verbs::Completion,
    mem: S,
}

impl<S> Completion<S> {
    /// Bytes received (receives) or transferred.
    pub fn byte_len(&self) -> u32 {
        self.wc.byte_len()
    }

    /// The immediate of a SEND or WRITE WITH IMM that was received.
    pub fn imm(&self) -> Option<u32> {
        self.wc.imm()
    }

    pub fn opcode(&self) -> WcOpcode {
        self.wc.opcode()
    }

    /// The queue pair this completion belongs to (for a shared receive
    /// queue: the one that received).
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num()
    }

    /// The sender's queue pair number (unreliable datagram receives).
    pub fn src_qp(&self) -> u32 {
        self.wc.src_qp()
    }

    pub fn status(&self) -> WcStatus {
        self.wc.status()
    }

    /// The raw work completion.
    pub fn wc(&self) -> &verbs::Completion {
        &self.wc
    }

    /// The memory the operation used.
    pub fn memory(&self) -> &S {
        &self.mem
    }

    /// The memory, to read what arrived or to use it again.
    pub fn into_memory(self) -> S {
        self.mem
    }
}
