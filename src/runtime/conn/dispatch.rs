//! Completions: polling the CQs, what each completion means, and commands
//! from the peer; the handler gets what they bring in deliver.rs.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::{PoisonError, TryLockError};
use std::time::Duration;

use crate::runtime::poller::Ready;
use crate::runtime::proto::{Cmd, Opcode, CMD_LEN, VERSION};
use crate::runtime::ring::{wrap_point, RecvRing};
use crate::verbs::{Completion, CompletionRoom, RemoteRegion, WcOpcode, WcStatus};

use super::{
    ConnState, Connection, Deferred, KIND_SHIFT, K_BIND, K_CMD, K_CREDIT, K_DATA, K_READ, K_RECV,
    K_SYNC, K_WRITE, LOW_MASK, MAX_POLL_BATCH, PEER_CMD_RESERVE,
};

/// Receives in one drain that tell the completion thread messages come
/// faster than it is woken for each (see `process_completions`).
const BUNCHED: usize = 2;

/// Completions one drain handles before it gives the completion thread
/// back with the rest left for its next turn: a peer that sends faster
/// than its messages are handled (a slow callback, a flood) would
/// otherwise keep the drain, and the thread, from every other connection.
/// Two polls' worth: a drain of a quiet connection rarely comes near it.
pub const DRAIN_BUDGET: usize = 2 * MAX_POLL_BATCH;

/// What a drain did.
#[derive(Clone, Copy, Default)]
pub(super) struct Drained {
    /// Receives handled (messages and commands).
    pub(super) received: usize,
    /// It stopped at [`DRAIN_BUDGET`], perhaps with completions left that
    /// raise no event.
    pub(super) more: bool,
}

impl Connection {
    /// Polls one CQ once for up to `max` completions (at most the room's)
    /// and dispatches what it got; the send CQ under its lock. Returns how
    /// many completions there were.
    pub(super) fn poll_cq<const N: usize>(
        &self,
        send: bool,
        room: &mut CompletionRoom<N>,
        max: usize,
        inline: bool,
    ) -> usize {
        let _guard = send.then(|| {
            self.inner
                .send_poll
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        });
        let cq = if send {
            &self.inner.send_cq
        } else {
            &self.inner.recv_cq
        };
        let wcs = match room.poll_up_to(cq, max) {
            Ok(wcs) => wcs,
            Err(e) => {
                log::error!("polling the CQ failed: {e}");
                return 0;
            }
        };
        let n = wcs.len();
        if send {
            let failed = self.dispatch_sends(wcs, inline);
            drop(_guard);
            if let Some(reason) = failed {
                self.fail(&reason);
            }
            return n;
        }
        // Receive completions go through one queue in arrival order: a
        // callback that waits (a sync operation) polls again from inside
        // this loop, and must handle the rest of this batch before what it
        // polls itself, or messages would be delivered out of order.
        let backlog = || {
            self.inner
                .recv_backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        let backlogged = &self.inner.recv_backlogged;
        // Most polls of a spinning thread, and most of a drain: nothing, and
        // nothing of an outer batch left to handle (only the `recv_poll`
        // holder touches the backlog, so its flag is current here).
        if n == 0 && !backlogged.load(Ordering::Relaxed) {
            return 0;
        }
        {
            let mut queued = backlog();
            if queued.is_empty() {
                match n {
                    0 => return 0,
                    // Alone: no rest of a batch to go first, and the queue
                    // would hand it straight back (only this thread polls).
                    1 => {
                        drop(queued);
                        self.dispatch(&wcs[0], inline);
                        return 1;
                    }
                    _ => {}
                }
            }
            queued.extend(wcs.iter().cloned());
            backlogged.store(true, Ordering::Relaxed);
        }
        loop {
            let next = {
                let mut queued = backlog();
                let wc = queued.pop_front();
                if queued.is_empty() {
                    backlogged.store(false, Ordering::Relaxed);
                }
                wc
            };
            let Some(wc) = next else {
                return n;
            };
            self.dispatch(&wc, inline);
        }
    }

    /// A thread outside a round of the connection (a waiter, one ending
    /// it, a sender) takes a batch of send completions; callbacks they owe
    /// are queued for the completion thread. Whether there was anything.
    /// When another thread is polling, it leaves them to that one, unless
    /// `in_turn`: then it waits for its turn (the other's poll may have
    /// started before a completion came that arrived before our arming, so
    /// neither would see it), for a thread that holds none of the
    /// runtime's locks and runs no callback.
    pub(super) fn poll_send(&self, in_turn: bool) -> bool {
        let (took, failed) = self.poll_send_batch(in_turn);
        if let Some(reason) = failed {
            self.fail(&reason);
        }
        took
    }

    /// One batch of [`Connection::poll_send`]: whether there was anything, and the first failure
    /// that ends the connection, for the caller to act on (the poll lock is
    /// let go by then).
    pub(super) fn poll_send_batch(&self, in_turn: bool) -> (bool, Option<String>) {
        let locked = if in_turn {
            Ok(self
                .inner
                .send_poll
                .lock()
                .unwrap_or_else(PoisonError::into_inner))
        } else {
            self.inner.send_poll.try_lock()
        };
        let _guard = match locked {
            Ok(guard) => guard,
            // It guards no data: a panic while it was held left nothing half-done.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return (false, None),
        };
        let mut room = CompletionRoom::<4>::new();
        let Ok(wcs) = room.poll(&self.inner.send_cq) else {
            return (false, None);
        };
        (!wcs.is_empty(), self.dispatch_sends(wcs, false))
    }

    /// Dispatches send completions (under the send poll lock); returns the
    /// first failure that ends the connection, for the caller to act on
    /// once the lock is let go.
    fn dispatch_sends(&self, wcs: &[Completion], inline: bool) -> Option<String> {
        let mut failed = None;
        for wc in wcs {
            if let Some(reason) = self.dispatch_held(wc, inline) {
                failed.get_or_insert(reason);
            }
        }
        failed
    }

    /// Handles a pass of this connection's pending completions from inside
    /// a callback (callbacks are queued to run after the current one
    /// returns); the waiting caller checks its deadline between passes, so
    /// a peer that keeps sending cannot hold it past that.
    pub(super) fn drive_inline(&self) -> usize {
        let mut room = CompletionRoom::<16>::new();
        self.with_recv_poll(|| self.poll_cq(false, &mut room, usize::MAX, true))
            .unwrap_or(0)
            + self.poll_cq(true, &mut room, usize::MAX, true)
    }

    /// Handles what both CQs hold, up to [`DRAIN_BUDGET`] completions
    /// (completion thread, top level), unless a caller is polling the
    /// connection right now. Returns whether the
    /// peer's messages came bunched ([`BUNCHED`] or more receives) with nothing
    /// waiting on them: no thread waiting on the connection, no message or
    /// command posted in answer during the round. A request/reply peer
    /// waits on every answer, and a nap would stretch each round trip; a
    /// stream's sender does not. Or that it stopped at its budget with
    /// completions left ([`Ready::More`]).
    pub(crate) fn process_completions(&self) -> Ready {
        self.take_cq_event();
        let (drained, unanswered) = self.drain_unanswered(true);
        if drained.more {
            Ready::More
        } else if unanswered && drained.received >= BUNCHED {
            Ready::Bunched
        } else {
            Ready::Done
        }
    }

    /// The completion thread's look at the connection after a nap on its
    /// stream (`Source::nap_poll`): handles what both CQs hold, up to
    /// [`DRAIN_BUDGET`] completions, without arming them. Returns whether there was something, with nothing
    /// posted in answer and nobody waiting on the connection: the stream
    /// goes on, and the thread naps again. False too when the drain
    /// stopped at its budget: the thread's `ready` then takes the rest in
    /// turns with the other connections, without a nap in between.
    pub(crate) fn nap_round(&self) -> bool {
        let (drained, unanswered) = self.drain_unanswered(false);
        !drained.more && unanswered && drained.received >= 1
    }

    /// Drains the connection (arming its CQs when `arm`) unless a caller
    /// polls it right now; and whether nothing was posted in answer during
    /// the drain, with nobody waiting on the connection.
    fn drain_unanswered(&self, arm: bool) -> (Drained, bool) {
        let posts = self.inner.posts.load(Ordering::Relaxed);
        let drained = self.with_recv_poll(|| self.drain(arm)).unwrap_or_default();
        let unanswered = self.inner.posts.load(Ordering::Relaxed) == posts
            && self.inner.waiting.load(Ordering::SeqCst) == 0;
        (drained, unanswered)
    }

    /// Takes the completion channel's event, if there is one.
    pub(super) fn take_cq_event(&self) {
        let channel = self
            .inner
            .recv_cq
            .channel()
            .expect("connections have a completion channel");
        match channel.get_event(Duration::ZERO) {
            // The event disarmed the CQ it came from.
            Ok(Some(cq)) if cq == self.inner.recv_cq.as_raw() => {
                self.inner.recv_armed.store(false, Ordering::SeqCst)
            }
            Ok(Some(_)) => self.inner.send_armed.store(false, Ordering::SeqCst),
            Ok(None) => {}
            Err(e) => log::error!("completion channel: {e}"),
        }
    }

    /// Arms the CQs when `arm` (unless callers poll the connection and none
    /// sleeps), then handles what they hold: a completion that arrives
    /// meanwhile raises an event, one that came before is polled here,
    /// up to [`DRAIN_BUDGET`] completions.
    pub(super) fn drain(&self, arm: bool) -> Drained {
        thread_local! {
            /// A drain's room, kept by its thread: a fresh one is 1.5 KiB to
            /// zero per drain.
            static ROOM: RefCell<CompletionRoom<MAX_POLL_BATCH>> =
                const { RefCell::new(CompletionRoom::new()) };
        }
        let kept = ROOM.try_with(|room| {
            let mut room = room.try_borrow_mut().ok()?;
            Some(self.drain_into(&mut room, arm))
        });
        // A drain inside a callback of another on this thread has its own.
        kept.ok()
            .flatten()
            .unwrap_or_else(|| self.drain_into(&mut CompletionRoom::<MAX_POLL_BATCH>::new(), arm))
    }

    fn drain_into(&self, room: &mut CompletionRoom<MAX_POLL_BATCH>, arm: bool) -> Drained {
        let take = (self.inner.opts.max_concurrent_work_requests as usize).clamp(1, MAX_POLL_BATCH);
        // Callers poll their own connection while they wait and arm it when
        // they sleep; unwatched, it is looked at every tick.
        let unwatched = !arm || self.left_to_callers();
        if !unwatched {
            if !self.arm_recv() {
                log::warn!("arming the receive CQ failed; its completions wait for the next tick");
            }
            if self.inner.async_pending.load(Ordering::SeqCst) > 0
                || self.inner.sleepers.load(Ordering::SeqCst) > 0
                || self.inner.queued.load(Ordering::SeqCst)
                || self.inner.windows_unsettled.load(Ordering::SeqCst)
            {
                self.arm_send();
            }
        }
        let mut received = None;
        let mut rearmed = false;
        let mut budget = DRAIN_BUDGET;
        loop {
            let got = self.poll_cq(false, room, take, false);
            let n = got + self.poll_cq(true, room, take, false);
            // An empty round after a busy one owes nothing more.
            if n > 0 || received.is_none() {
                self.after_round();
                *received.get_or_insert(0) += got;
            }
            if n > 0 {
                budget = budget.saturating_sub(n);
                if budget == 0 {
                    return Drained {
                        received: received.unwrap_or(0),
                        more: true,
                    };
                }
                continue;
            }
            // This drain's callbacks may have put an async one-sided
            // operation in flight after the arming above, without arming
            // (`async_posted`), or queued messages whose room a send
            // completion may bring (a READ of the peer's credit, which
            // nothing arms for): armed now, and polled once more for what
            // completed before.
            if !unwatched && !rearmed && self.send_event_wanted() {
                self.arm_send();
                rearmed = true;
                continue;
            }
            return Drained {
                received: received.unwrap_or(0),
                more: false,
            };
        }
    }

    /// Whether nobody but the connection's callers looks at it: they poll
    /// it while they wait and arm it when they sleep, and the completion
    /// thread looks at it every tick.
    fn left_to_callers(&self) -> bool {
        self.inner.opts.caller_polls && self.inner.sleepers.load(Ordering::SeqCst) == 0
    }

    /// Whether the send CQ is unarmed while an async one-sided operation is
    /// in flight (`async_posted` does not arm for one a callback posts in a
    /// round), or while messages wait in the queue for room that a send
    /// completion brings (one that frees the send queue, or a READ of the
    /// peer's credit, which nothing arms for), or while windows are kept
    /// for their binds' completions.
    fn send_event_wanted(&self) -> bool {
        (self.inner.async_pending.load(Ordering::SeqCst) > 0
            || self.inner.queued.load(Ordering::SeqCst)
            || self.inner.windows_unsettled.load(Ordering::SeqCst))
            && !self.inner.send_armed.load(Ordering::SeqCst)
    }

    pub(super) fn dispatch(&self, wc: &Completion, inline: bool) {
        if let Some(reason) = self.dispatch_held(wc, inline) {
            self.fail(&reason);
        }
    }

    /// [`Connection::dispatch`], but a failure that ends the connection is
    /// returned rather than acted on: the send CQ's poller ends it once it
    /// let go of that CQ's poll lock, since `disconnected` runs inside the
    /// end, and a handler that waits there polls that CQ.
    fn dispatch_held(&self, wc: &Completion, inline: bool) -> Option<String> {
        let kind = wc.wr_id() >> KIND_SHIFT;
        let low = wc.wr_id() & LOW_MASK;
        if !wc.is_ok() {
            if self.reposts_no_receives() && wc.status() == WcStatus::WR_FLUSH_ERR {
                // Flushed by the end: a synchronous operation gets its
                // outcome here if the end did not give it one.
                if kind == K_SYNC {
                    let reason = format!("completed with {}", wc.status());
                    if let Some(slot) = self.lock().sync_ops.get_mut(low) {
                        slot.get_or_insert(Err(reason));
                    }
                }
                self.wake();
                return None;
            }
            // The failure ends the connection, which fails a synchronous
            // operation with it, under the lock that ends the state: its
            // caller never has the failure while the state shows none.
            return Some(format!(
                "work request {:#x} completed with {}",
                wc.wr_id(),
                wc.status()
            ));
        }
        match kind {
            K_RECV => match wc.opcode() {
                WcOpcode::RECV_RDMA_WITH_IMM => self.handle_message(
                    wc.imm().unwrap_or(0),
                    wc.byte_len() as usize,
                    low as u32,
                    inline,
                ),
                WcOpcode::RECV => {
                    self.handle_cmd(low as u32, wc.byte_len() as usize);
                    self.repost_cmd_slot(low as u32);
                }
                other => {
                    log::warn!("unexpected receive completion {other}");
                    self.repost_cmd_slot(low as u32);
                }
            },
            K_DATA => {
                self.inner.data_retired.fetch_add(low, Ordering::Release);
                // Not worth waiting for a sender's post: the next holder of
                // the lock gives the places back.
                match self.try_lock() {
                    Some(mut st) => st.sq_used = st.sq_used.saturating_sub(low as u32),
                    None => {
                        self.inner.sq_done.fetch_add(low as u32, Ordering::AcqRel);
                    }
                }
                self.wake();
            }
            K_CMD => {
                let mut st = self.lock();
                st.sq_used -= 1;
                st.cmd_free.push(low as u16);
                self.command_slot_freed(&mut st);
                drop(st);
                // A closing thread waits for its goodbye to complete.
                self.wake();
            }
            K_WRITE | K_READ => {
                self.inner.async_pending.fetch_sub(1, Ordering::SeqCst);
                self.lock().sq_used -= 1;
                self.wake();
                let done = if kind == K_WRITE {
                    Deferred::WriteDone(low as usize)
                } else {
                    Deferred::ReadDone(low as usize)
                };
                // Queued, run once the send CQ's poll lock is let go: a
                // callback that waits (a sync READ, a send short of room)
                // polls that CQ itself.
                self.callback(done, true);
            }
            K_BIND => {
                let mut st = self.lock();
                st.sq_used -= 1;
                st.binds_done += 1;
                let settled = self.take_settled_windows(&mut st);
                drop(st);
                // Unregistered and unmapped outside the lock.
                drop(settled);
                // A window dropped meanwhile may wait for this bind (binds
                // are rare: one per exposed region).
                self.wake();
            }
            K_CREDIT => return self.credit_read_done().err(),
            K_SYNC => {
                let mut st = self.lock();
                st.sq_used -= 1;
                if let Some(slot) = st.sync_ops.get_mut(low) {
                    *slot = Some(Ok(()));
                }
                drop(st);
                self.wake();
            }
            _ => log::error!("completion with unknown work request id {:#x}", wc.wr_id()),
        }
        None
    }

    pub(super) fn handle_cmd(&self, slot: u32, len: usize) {
        // Copied out of the slot alone: the device may be writing the
        // buffer's other receive slots meanwhile.
        let mut bytes = [0u8; CMD_LEN];
        if !self
            .inner
            .cmd_recv
            .copy_out_to(slot as usize * CMD_LEN, &mut bytes)
        {
            return self.fail(&format!(
                "a command completed in slot {slot}, which is not ours"
            ));
        }
        let cmd = match Cmd::decode(&bytes[..len.min(CMD_LEN)]) {
            Ok(c) => c,
            Err(e) => return self.fail(&format!("bad command from the peer: {e}")),
        };
        if let Err(why) = self.apply_cmd(&cmd) {
            self.fail(&format!("the peer broke the protocol: {why}"));
        }
    }

    /// Acts on a command after checking it against what this side knows;
    /// `Err` names the violation, and nothing has changed then.
    fn apply_cmd(&self, cmd: &Cmd) -> std::result::Result<(), String> {
        match cmd.opcode {
            Opcode::RegLocalAddr => {
                let ring = RemoteRegion {
                    addr: cmd.addr,
                    len: cmd.length as u64,
                    rkey: cmd.key,
                };
                // A newer peer speaks our version with us.
                let version = cmd
                    .version
                    .min(VERSION)
                    .min(self.inner.opts.protocol_version);
                if ring.len == 0 {
                    return Err("it advertised an empty receive buffer".into());
                }
                if version >= 1 && u64::from(cmd.recv_depth) <= PEER_CMD_RESERVE {
                    return Err(format!(
                        "its receive depth {} leaves no room for messages",
                        cmd.recv_depth
                    ));
                }
                let first = {
                    let mut st = self.lock();
                    // Once per connection, as the legacy library does: a
                    // second one would rewind our sender over messages the
                    // peer has not consumed.
                    if st.peer_ring.is_some() {
                        return Err("it advertised its receive buffer twice".into());
                    }
                    st.peer_ring = Some(ring);
                    st.peer_version = version;
                    st.peer_recv_depth = cmd.recv_depth;
                    // Our staging buffer bounds how much of the peer's ring
                    // we use.
                    st.tx
                        .reset((cmd.length as usize).min(self.inner.staging.len()));
                    // On the accepting side the peer's advertisement can be
                    // handled before the CM thread has seen ESTABLISHED, and
                    // on the connecting side before the connecting thread
                    // posted ours: ours goes now, ahead of anything
                    // `connected` sends (the QP is ready to send once the
                    // peer could reach it).
                    let first = matches!(st.state, ConnState::Connected | ConnState::Accepting);
                    if first {
                        // Also offers our credit slot, now that the peer's
                        // version is known.
                        if let Err(e) = self.advertise_ring(&mut st) {
                            drop(st);
                            self.fail(&format!("advertising the receive buffer: {e}"));
                            return Ok(());
                        }
                        st.state = ConnState::MrReady;
                        // The peer wraps where its staging buffer ends, when
                        // that is before the end of our ring (RC delivers
                        // this before any of its messages).
                        st.rx = RecvRing::new(wrap_point(self.inner.recv_ring.len(), cmd.ring_use));
                    }
                    first
                };
                self.wake();
                self.call_handler("peer buffer", |h| h.peer_buffer(self, ring));
                if first {
                    self.call_handler("state", |h| h.state_changed(self, ConnState::MrReady));
                    self.call_handler("connected", |h| h.connected(self));
                }
            }
            Opcode::RegPhysAddr => {
                self.lock().peer_pa_rkey = Some(cmd.key);
                log::info!("peer offers physical-address access (rkey {:#x}); PA operations are unavailable here", cmd.key);
            }
            Opcode::ConnGoodbye => log::debug!("peer said goodbye"),
            Opcode::Credit => {
                let mut st = self.lock();
                if st.peer_ring.is_none() || st.peer_version < 1 {
                    return Err("credit from a peer that cannot give it".into());
                }
                self.take_credit(&mut st, cmd.addr, cmd.length)?;
                drop(st);
                self.wake();
            }
            Opcode::CreditSlot => Self::learn_peer_slot(&mut self.lock(), cmd)?,
            Opcode::CreditWanted => self.credit_wanted(cmd)?,
        }
        Ok(())
    }

    /// Commands' receives go back at once: the peer's reserve for them is
    /// not covered by credit.
    fn repost_cmd_slot(&self, slot: u32) {
        if !self.reposts_no_receives() {
            if let Err(e) = self.post_recv_slot(slot) {
                self.fail(&format!("reposting a receive: {e}"));
            }
        }
    }

    /// After completions were handled: owed callbacks and the end of the
    /// handler's round (what it held back goes, and credit rides with it),
    /// then credit, then messages that waited for room.
    /// Last, a wake, for callers waiting on what a callback did.
    pub(super) fn after_round(&self) {
        // A `round_done` that waits (a sync operation, a close) defers the
        // messages it meets: they are delivered, and their round ended,
        // before this round is over.
        loop {
            self.deliver_deferred();
            if !(self.inner.delivered.load(Ordering::Relaxed)
                && self.inner.delivered.swap(false, Ordering::Relaxed))
            {
                break;
            }
            self.call_handler("round", |h| h.round_done(self));
        }
        self.maybe_send_credit(false);
        self.flush_queued();
        if self.inner.peer_left.load(Ordering::SeqCst) {
            self.finish_peer_left();
        }
        self.finish_owed_end();
        self.wake();
    }

    /// One non-blocking pass over both CQs (a spinning thread): returns
    /// whether there was anything; drain with `while poll_round() {}`.
    pub(crate) fn poll_round(&self) -> bool {
        self.with_recv_poll(|| {
            // Small: this runs in spin loops, mostly finding nothing.
            let mut room = CompletionRoom::<4>::new();
            // One pass, not until empty: the caller's loop comes back at
            // once, and a waiting caller gets to see its reply a pass sooner.
            let n = self.poll_cq(false, &mut room, usize::MAX, false)
                + self.poll_cq(true, &mut room, usize::MAX, false);
            // Checked without the state lock: this runs in the spin loop.
            let owed = self.inner.owed.swap(false, Ordering::AcqRel);
            if n > 0 || owed {
                self.after_round();
                // A spin polls the connection again on its next pass, but a
                // round the thread ran for a wake (spinning off, or nothing
                // to spin for) arms nothing after it, as a drain does: what
                // its callbacks left waiting on a send completion would wait
                // for the look at every connection.
                if !self.inner.spun_on.load(Ordering::SeqCst)
                    && !self.left_to_callers()
                    && self.send_event_wanted()
                {
                    self.arm_send();
                    // What completed before the arming raises no event:
                    // all of it is taken now.
                    while self.poll_cq(true, &mut room, usize::MAX, false) > 0 {
                        self.after_round();
                    }
                }
            }
            n > 0
        })
        .unwrap_or(false)
    }
}
