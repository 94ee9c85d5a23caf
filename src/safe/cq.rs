//! Completion queues that wake futures: every posted operation owns a slot,
//! named by its work request id; a reaped completion fills the slot and wakes
//! the task, whichever executor it runs on.
//!
//! Progress comes one of three ways ([`Progress`]): the future polls the CQ
//! itself; the program waits on the CQ's file descriptor and calls
//! [`CompletionQueue::service`]; or a background thread sleeps on the
//! completion channel.
//!
//! A dropped future parks its segments in the slot: they are released when
//! the completion (or the flush after an error) is reaped, never before, so
//! the device never writes memory that was given back.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::Duration;

use smallvec::SmallVec;

use super::error::Result;
use super::region::{ProtectionDomain, RawHold};
pub(crate) use super::slots::Ticket;
use super::slots::{decode, Slots};
use crate::verbs::{self, Completion, CompletionRoom};

/// How completions are reaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// A pending future polls the CQ each time it is polled and asks to be
    /// polled again: lowest latency, one core busy while waiting. Works
    /// under any executor.
    Poll,
    /// The CQ reports to a completion channel: wait until
    /// [`CompletionQueue::as_fd`] is readable (with epoll, tokio's
    /// `AsyncFd`, ...), then call [`CompletionQueue::service`]. An idle CQ
    /// costs no CPU.
    Channel,
    /// A background thread sleeps on the completion channel and wakes the
    /// futures; nothing to drive by hand.
    Thread,
}

/// Reaped per `ibv_poll_cq` call.
const BATCH: usize = 32;
/// How often the background thread looks whether its CQ is gone.
const THREAD_TICK: Duration = Duration::from_millis(200);
/// Marks the `qp` of an operation posted to a shared receive queue (the low
/// bits tell which one): no queue pair's flush completes it, and queue pair
/// numbers have 24 bits.
pub(crate) const SRQ_TAG: u32 = 1 << 31;
/// How long a dropped queue pair waits for its flushed work to be reaped.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// A completion queue of the safe layer. Cheap to clone.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) shared: Arc<CqShared>,
}

/// What a completion queue has seen, for tests and statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CqStats {
    /// Completions reaped.
    pub completions: u64,
    /// Completions of operations whose future had been dropped: their
    /// memory was released then.
    pub cancelled: u64,
}

pub(crate) struct CqShared {
    cq: verbs::CompletionQueue,
    progress: Progress,
    table: Mutex<Table>,
    completions: AtomicU64,
    cancelled: AtomicU64,
}

/// What the CQ's lock guards: the operations' slots, and the room polls
/// reap into (kept, so a spinning future's poll zeroes nothing).
#[derive(Default)]
struct Table {
    slots: Slots,
    room: CompletionRoom<BATCH>,
    /// Why [`Progress::Thread`]'s reaper cannot poll the CQ: pending
    /// futures resolve to it, keeping their memory, until a poll succeeds.
    broken: Option<String>,
}

impl ProtectionDomain {
    /// A completion queue of `capacity` entries on this PD's device.
    pub fn create_cq(&self, capacity: u32, progress: Progress) -> Result<CompletionQueue> {
        let ctx = self.verbs().context();
        let channel = match progress {
            Progress::Poll => None,
            Progress::Channel | Progress::Thread => Some(ctx.create_comp_channel()?),
        };
        let cq = ctx.create_cq(capacity, channel.as_ref())?;
        if channel.is_some() {
            cq.arm(false)?;
        }
        let shared = Arc::new(CqShared {
            cq,
            progress,
            table: Mutex::default(),
            completions: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
        });
        if progress == Progress::Thread {
            let weak = Arc::downgrade(&shared);
            std::thread::Builder::new()
                .name("snowrdma-safe-cq".into())
                .spawn(move || background(weak))
                .map_err(|e| verbs::Error::Verb {
                    verb: "spawn(completion thread)",
                    source: e,
                })?;
        }
        Ok(CompletionQueue { shared })
    }
}

/// The background thread of [`Progress::Thread`]: sleeps on the channel,
/// reaps, and ends once the CQ is gone (its last handle and every queue pair
/// on it dropped). It never gives up while the CQ lives: a channel that
/// fails is left for polling at every tick, and while polling fails too,
/// the waiting futures resolve to that error (keeping their memory) until a
/// poll succeeds again.
fn background(weak: Weak<CqShared>) {
    let mut failing = false;
    while let Some(cq) = weak.upgrade() {
        let Err(e) = cq.service(THREAD_TICK) else {
            failing = false;
            continue;
        };
        if !failing {
            log::error!("safe completion thread: {e}: polling every {THREAD_TICK:?} instead");
            failing = true;
        }
        cq.poll_or_break();
        drop(cq);
        std::thread::sleep(THREAD_TICK);
    }
}

impl CompletionQueue {
    /// Reaps what has completed, without waiting; returns how many
    /// completions were reaped. Any progress mode may call it.
    pub fn poll(&self) -> Result<usize> {
        self.shared.drive()
    }

    /// [`Progress::Channel`]: takes the channel's events, reaps, and re-arms
    /// the CQ so the descriptor signals the next completion. Call it when
    /// [`CompletionQueue::as_fd`] is readable; nothing is lost if it is
    /// called at other times too.
    pub fn service(&self) -> Result<usize> {
        self.shared.service(Duration::ZERO)
    }

    /// What the CQ has reaped so far.
    pub fn stats(&self) -> CqStats {
        CqStats {
            completions: self.shared.completions.load(Ordering::Relaxed),
            cancelled: self.shared.cancelled.load(Ordering::Relaxed),
        }
    }

    pub fn progress(&self) -> Progress {
        self.shared.progress
    }

    /// The verbs-layer CQ: the escape hatch.
    ///
    /// # Safety
    /// Completions taken from it (a poll) or events taken from its channel
    /// never reach this layer: their futures would wait for good, and the
    /// memory of dropped ones would stay parked. Do neither. (Nor through
    /// a queue pair's [`Qp::verbs`](super::Qp::verbs), unsafe for the same
    /// reason.) Without `unsafe`, it cannot be reached:
    ///
    /// ```compile_fail
    /// fn steal(cq: &snowrdma::safe::CompletionQueue) {
    ///     let mut room = snowrdma::verbs::CompletionRoom::<4>::new();
    ///     let _ = room.poll(cq.verbs());
    /// }
    /// ```
    pub unsafe fn verbs(&self) -> &verbs::CompletionQueue {
        &self.shared.cq
    }

    pub(crate) fn device_cq(&self) -> &verbs::CompletionQueue {
        &self.shared.cq
    }

    /// The completion channel's descriptor ([`Progress::Channel`] and
    /// [`Progress::Thread`]); `None` in [`Progress::Poll`].
    pub fn as_fd(&self) -> Option<CqFd> {
        self.shared.cq.channel().map(|_| CqFd(self.clone()))
    }
}

#[cfg(feature = "tokio")]
impl CompletionQueue {
    /// [`Progress::Channel`] on tokio: reaps whenever the channel is
    /// readable, until an error. Spawn it (`tokio::spawn(cq.clone()
    /// .reap_on_tokio())`) and abort the task when done; it keeps the CQ
    /// alive meanwhile.
    pub async fn reap_on_tokio(self) -> Result<()> {
        let fd = self
            .as_fd()
            .ok_or_else(|| super::Error::invalid("a CQ in Progress::Poll has no descriptor"))?;
        // SAFETY: `CqFd` holds the CQ, so the channel's descriptor stays open
        // and the same for as long as the AsyncFd owns it.
        let fd =
            unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| verbs::Error::Verb {
                verb: "register(completion channel)",
                source: e.into(),
            })?;
        loop {
            let mut ready = fd.readable().await.map_err(|e| verbs::Error::Verb {
                verb: "poll(completion channel)",
                source: e,
            })?;
            self.service()?;
            ready.clear_ready();
        }
    }
}

/// A CQ's completion channel descriptor, to register with an event loop.
/// Keeps the CQ alive.
#[derive(Clone)]
pub struct CqFd(CompletionQueue);

impl AsRawFd for CqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
            .shared
            .cq
            .channel()
            .expect("made only for CQs with a channel")
            .fd()
    }
}

impl AsFd for CqFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel (and so the descriptor) lives as long as the
        // CQ this value holds.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

impl CqShared {
    fn table(&self) -> MutexGuard<'_, Table> {
        // Every update leaves the table consistent.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for an operation of `wrs` work requests about to be posted on
    /// queue pair `qp`; refused while the CQ has no room for all their
    /// completions (one it overflows loses them, and their futures would
    /// wait for good).
    pub(crate) fn open(&self, qp: u32, wrs: usize) -> Result<Ticket> {
        let mut t = self.table();
        let slots = &mut t.slots;
        let room = self.cq.capacity();
        if slots.in_flight + wrs > room {
            return Err(super::Error::invalid(format!(
                "the completion queue has room for {room} completions and {} are in flight: \
                 wait for some before posting {wrs} more",
                slots.in_flight
            )));
        }
        Ok(slots.open(qp, wrs))
    }

    /// Gives back the slot of an operation whose post failed.
    pub(crate) fn abandon(&self, ticket: Ticket) {
        let slots = &mut self.table().slots;
        slots.reaped(ticket.idx);
        slots.close(ticket.idx);
    }

    /// A batch whose post failed after its first `posted` requests went
    /// out: they complete, if ever, without a signaled tail, so its slot
    /// never settles. Their memory (`holds`) and CQ room stay taken until
    /// the queue pair is dropped ([`CqShared::take_tailless`]), and the
    /// memory until it is destroyed; the room of the requests not posted is
    /// free now.
    pub(crate) fn disown(&self, ticket: Ticket, posted: usize, holds: Vec<RawHold>) {
        let slots = &mut self.table().slots;
        let slot = &mut slots.all[ticket.idx as usize];
        let unposted = slot.wrs.saturating_sub(posted);
        slot.wrs -= unposted;
        slot.tailless = true;
        slot.abandoned = true;
        slot.parked = holds;
        slots.in_flight -= unposted;
    }

    /// Shared receive queue `tag` ([`SRQ_TAG`]) is destroyed: its receives
    /// not completed never will, and the device touches none of their
    /// memory. Dropped ones release it now; pending ones resolve to an
    /// error and release it when dropped.
    pub(crate) fn srq_destroyed(&self, tag: u32) {
        // What completed before is reaped first: those messages arrived.
        if let Err(e) = self.drive() {
            log::warn!("destroying a shared receive queue: reaping its completions: {e}");
        }
        let mut released = Vec::new();
        let mut wake = Vec::new();
        let mut t = self.table();
        let slots = &mut t.slots;
        for idx in 0..slots.all.len() as u32 {
            let slot = &mut slots.all[idx as usize];
            if !slot.busy || slot.qp != tag || slot.done.is_some() {
                continue;
            }
            slots.reaped(idx);
            let slot = &mut slots.all[idx as usize];
            if slot.abandoned {
                released.append(&mut slot.parked);
                slots.close(idx);
            } else {
                slot.gone = true;
                wake.extend(slot.waker.take());
            }
        }
        drop(t);
        drop(released);
        wake.into_iter().for_each(Waker::wake);
    }

    /// Queue pair `qp` is in the error state and its flushed work reaped:
    /// the batches of it that went out without their tail give up their
    /// slots and room, and hand back their memory, which the device may
    /// use until the QP is destroyed (nothing completes to tell sooner).
    pub(crate) fn take_tailless(&self, qp: u32) -> Vec<RawHold> {
        let mut released = Vec::new();
        let mut t = self.table();
        let slots = &mut t.slots;
        for idx in 0..slots.all.len() as u32 {
            let slot = &mut slots.all[idx as usize];
            if slot.busy && slot.tailless && slot.qp == qp {
                released.append(&mut slot.parked);
                slots.reaped(idx);
                slots.close(idx);
            }
        }
        released
    }

    /// The operation's completion, or `Pending` with the task's waker kept
    /// (replaced at every poll, so a future moved between tasks wakes the
    /// right one).
    pub(crate) fn poll_ticket(
        &self,
        ticket: Ticket,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<Completion>> {
        // Declared before the lock's guard, so it wakes and releases after
        // the lock is given back, on every way out.
        let mut reaped = Reaped::default();
        // A waker replaced here is dropped after the lock is given back: it
        // may be a task's last, whose future (a queue pair's owner, say)
        // then drops and takes this lock again.
        let mut replaced = None;
        let mut t = self.table();
        // A polled CQ is reaped (a batch) under the lock the slot is then
        // looked at with: one lock a pass of a spinning future.
        if self.progress == Progress::Poll {
            if let Err(e) = self.reap(&mut t, &mut reaped) {
                return Poll::Ready(Err(e));
            }
        }
        let Table { slots, broken, .. } = &mut *t;
        let slot = &mut slots.all[ticket.idx as usize];
        debug_assert_eq!(slot.gen, ticket.gen);
        let outcome = match slot.done.take() {
            Some(wc) => {
                slots.close(ticket.idx);
                Poll::Ready(Ok(wc))
            }
            None if slot.gone => Poll::Ready(Err(super::Error::invalid(
                "its shared receive queue was destroyed before a message came",
            ))),
            None if broken.is_some() => {
                Poll::Ready(Err(reaper_failed(broken.as_deref().unwrap_or_default())))
            }
            None => {
                match &slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => replaced = slot.waker.replace(cx.waker().clone()),
                }
                Poll::Pending
            }
        };
        drop(t);
        drop(replaced);
        if outcome.is_pending() && self.progress == Progress::Poll {
            cx.waker().wake_by_ref();
        }
        // `reaped` wakes the others on the way out (not moved into a
        // `drop` call: that copies its waker room).
        outcome
    }

    /// The future of `ticket` is gone: release `holds` now if the operation
    /// is done, else when its completion is reaped.
    pub(crate) fn cancel(&self, ticket: Ticket, holds: Vec<RawHold>) {
        let mut t = self.table();
        let slot = &mut t.slots.all[ticket.idx as usize];
        if slot.done.is_some() || slot.gone {
            t.slots.close(ticket.idx);
            drop(t);
            drop(holds);
        } else {
            let waker = slot.waker.take();
            slot.abandoned = true;
            slot.parked = holds;
            // After the lock, as in `poll_ticket`.
            drop(t);
            drop(waker);
        }
    }

    /// Queue pair `qp` is in the error state, about to be destroyed: reaps
    /// until its operations on this CQ have their (flushed) completions,
    /// up to [`FLUSH_WAIT`]. A destroyed QP's work never completes (some
    /// providers also drop its completions not yet reaped), so its futures
    /// would wait, and the memory of dropped ones stay parked, for good.
    pub(crate) fn reap_flushed(&self, qp: u32) {
        let deadline = std::time::Instant::now() + FLUSH_WAIT;
        loop {
            if let Err(e) = self.drive() {
                log::warn!("dropping queue pair {qp}: reaping its flushed work: {e}");
                return;
            }
            let left = self.table().slots.pending_of(qp);
            if left == 0 {
                return;
            }
            if std::time::Instant::now() >= deadline {
                log::warn!("dropping queue pair {qp}: {left} operations were not flushed in time");
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The reaper thread's poll when its channel failed: a poll that fails
    /// too marks the CQ broken and wakes every waiting future (to that
    /// error); one that succeeds mends it.
    fn poll_or_break(&self) {
        let error = self.drive().err().map(|e| e.to_string());
        let mut wake: Vec<Waker> = Vec::new();
        let mut t = self.table();
        if error.is_some() {
            wake.extend(t.slots.all.iter_mut().filter_map(|s| s.waker.take()));
        }
        t.broken = error;
        drop(t);
        wake.into_iter().for_each(Waker::wake);
    }

    /// Reaps everything the CQ holds now, a batch at a time, giving the
    /// lock back and waking each batch's tasks in between.
    fn drive(&self) -> Result<usize> {
        let mut total = 0;
        loop {
            // Dropped in reverse: the lock is given back before `reaped`
            // wakes anyone.
            let mut reaped = Reaped::default();
            let mut t = self.table();
            let n = self.reap(&mut t, &mut reaped)?;
            total += n;
            if n < BATCH {
                return Ok(total);
            }
        }
    }

    /// Polls one batch, settling each operation's slot under the lock
    /// (which keeps a batch's completions in order when several threads
    /// reap); the wakers and releases it owes go in `reaped`, which runs
    /// them when dropped, after the lock is given back. A spinning future
    /// that finds a full batch comes back for the rest at once.
    fn reap(&self, t: &mut Table, reaped: &mut Reaped) -> Result<usize> {
        let wcs = t.room.poll(&self.cq)?;
        for wc in wcs {
            reaped
                .wake
                .extend(self.settle(&mut t.slots, wc, &mut reaped.released));
        }
        if !wcs.is_empty() {
            self.completions
                .fetch_add(wcs.len() as u64, Ordering::Relaxed);
        }
        Ok(wcs.len())
    }

    fn settle(
        &self,
        slots: &mut Slots,
        wc: &Completion,
        released: &mut Vec<RawHold>,
    ) -> Option<Waker> {
        let (idx, gen, tail) = decode(wc.wr_id());
        let Some(slot) = slots.all.get_mut(idx as usize) else {
            log::warn!(
                "safe CQ: completion for unknown work request {:#x}",
                wc.wr_id()
            );
            return None;
        };
        if !slot.busy || slot.gen != gen || slot.done.is_some() {
            log::debug!("safe CQ: stale completion {:#x}", wc.wr_id());
            return None;
        }
        if !tail {
            // Only failures of a batch's unsignaled requests come here; the
            // tail still follows (flushed), and settles the batch.
            if !wc.is_ok() && slot.failed.is_none() {
                slot.failed = Some(wc.clone());
            }
            return None;
        }
        let result = slot.failed.take().unwrap_or_else(|| wc.clone());
        slots.reaped(idx);
        let slot = &mut slots.all[idx as usize];
        if slot.abandoned {
            released.append(&mut slot.parked);
            self.cancelled.fetch_add(1, Ordering::Relaxed);
            slots.close(idx);
            return None;
        }
        slot.done = Some(result);
        slot.waker.take()
    }

    /// Drains the channel's events, reaps, re-arms, and reaps once more
    /// (a completion between the last poll and the arm would otherwise
    /// raise no event). With a `wait`, sleeps up to that long for an event
    /// first when nothing was reaped.
    fn service(&self, wait: Duration) -> Result<usize> {
        let channel = self.cq.channel();
        if let Some(ch) = channel {
            while ch.get_event(Duration::ZERO)?.is_some() {}
        }
        let mut n = self.drive()?;
        if channel.is_some() {
            self.cq.arm(false)?;
            n += self.drive()?;
            if n == 0 && !wait.is_zero() {
                if let Some(ch) = channel {
                    if ch.get_event(wait)?.is_some() {
                        n += self.drive()?;
                        self.cq.arm(false)?;
                        n += self.drive()?;
                    }
                }
            }
        }
        Ok(n)
    }
}

/// The error of a future whose CQ the reaper thread cannot poll.
fn reaper_failed(why: &str) -> super::Error {
    verbs::Error::Verb {
        verb: "ibv_poll_cq (safe completion thread)",
        source: std::io::Error::other(why.to_string()),
    }
    .into()
}

/// What a reap owes once the CQ's lock is given back: tasks to wake and
/// segments of dropped futures to release. Paid when dropped, so it is
/// declared before the lock's guard.
#[derive(Default)]
struct Reaped {
    /// Mostly none or one; more than 8 in one batch spill to the heap
    /// (amortized over that many completions).
    wake: SmallVec<[Waker; 8]>,
    released: Vec<RawHold>,
}

impl Drop for Reaped {
    fn drop(&mut self) {
        self.wake.drain(..).for_each(Waker::wake);
    }
}
