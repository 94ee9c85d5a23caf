//! How a connection ends: a failure, the peer leaving, or a local close.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::runtime::proto::{Cmd, Opcode};
use crate::verbs::{CmEvent, CmEventKind, CompletionRoom};

use super::park::Until;
use super::{ConnKind, ConnState, Connection, State, CMD_SLOTS};

impl Connection {
    /// The peer disconnected (RDMA CM DISCONNECTED, or its socket closed;
    /// runtime thread). What it sent before is still in the receive CQ:
    /// the thread that polls completions delivers that first, then ends the
    /// connection ([`Connection::finish_peer_left`]).
    pub(crate) fn peer_left(&self) {
        if self.inner.peer_left.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.inner.cq_source.load(Ordering::SeqCst) == 0 {
            // Nobody polls: end it here.
            return self.peer_disconnected();
        }
        self.ask_for_round();
        self.wake();
    }

    /// Delivers every message the peer sent before it left, then ends the
    /// connection (on the thread holding the receive-poll role).
    pub(super) fn finish_peer_left(&self) {
        let mut room = CompletionRoom::<16>::new();
        while self.poll_cq(false, &mut room, usize::MAX, false) > 0 {}
        self.deliver_before_end();
        self.peer_disconnected();
    }

    /// Ends the connection after a failure: state Error, waiters woken,
    /// the peer told, `disconnected` fired once (here, or next on the
    /// completion thread: [`Connection::ends_here`]).
    pub(crate) fn fail(&self, reason: &str) {
        self.fail_unless(reason, log::Level::Warn, |_| false);
    }

    /// Ends the connection at once, as a failure, for a reason its owner
    /// has logged (a peer that broke the owner's protocol): what is
    /// queued for it is dropped, and nobody waits for it to drain.
    pub(crate) fn drop_peer(&self, reason: &str) {
        self.fail_unless(reason, log::Level::Debug, |_| false);
    }

    /// Ends a connection that has not finished connecting by its deadline;
    /// false when it has meanwhile (its `connected` may have sent already).
    pub(crate) fn fail_setup(&self, reason: &str) -> bool {
        self.fail_unless(reason, log::Level::Warn, |state| {
            state == ConnState::MrReady
        })
    }

    /// [`Connection::fail`], unless the state, checked under the lock that
    /// ends it, is one `spared` keeps: whether it failed it.
    fn fail_unless(
        &self,
        reason: &str,
        level: log::Level,
        spared: impl Fn(ConnState) -> bool,
    ) -> bool {
        self.take_send_completions();
        let here = self.ends_here();
        {
            let mut st = self.lock();
            // Ended already: its QP was stopped as it ended.
            if matches!(st.state, ConnState::Closed | ConnState::Error) || spared(st.state) {
                return false;
            }
            log::log!(
                level,
                "connection to {:?} failed: {reason}",
                self.inner.peer
            );
            self.drop_queued(&mut st, "it failed");
            self.end_state(&mut st, ConnState::Error, reason);
            // Under the lock that ended it: the peer's disconnect, which
            // may come next, must see that the end is owed.
            self.inner.end_owed.store(!here, Ordering::SeqCst);
            st.last_errno = libc::ECONNABORTED;
        }
        self.release_settled_windows();
        self.wake();
        self.disconnect_link();
        self.notify_state(ConnState::Error);
        if here {
            // This thread runs the connection's callbacks: those owed for
            // what completed before the end run first, as the completion
            // thread's owed end does (none is dropped after `disconnected`).
            self.deliver_deferred();
            self.finish_end();
        } else {
            // Only now: `disconnected` sees the state the handler was told.
            self.inner.end_ready.store(true, Ordering::SeqCst);
            self.ask_for_round();
        }
        true
    }

    /// Whether an end's callback runs on this thread. Only where nobody
    /// else would: on a caller-polled connection (its caller runs every
    /// callback), or one the completion thread does not watch. Otherwise
    /// the completion thread runs it at the end of its next round of the
    /// connection ([`Connection::finish_owed_end`]), after the callbacks
    /// queued before: never inside a program's call that found the failure
    /// (the program may hold its own lock around that call and take it in
    /// the callback, and the legacy library ran the callback on its event
    /// thread only), nor inside another callback, and no write callback
    /// comes after it.
    fn ends_here(&self) -> bool {
        self.inner.opts.caller_polls || self.inner.cq_source.load(Ordering::SeqCst) == 0
    }

    /// After an end: `disconnected`, then the runtime lets go of an
    /// accepted connection.
    fn finish_end(&self) {
        self.fire_disconnected();
        // Again, for waiters whose answer the callback gave.
        self.wake();
        if self.inner.kind == ConnKind::AcceptedConn {
            self.retire();
        }
    }

    /// The end a program's thread left to this one ([`Connection::ends_here`]).
    pub(super) fn finish_owed_end(&self) {
        // Looked at first: this runs at the end of every round.
        if self.inner.end_ready.load(Ordering::Relaxed)
            && self.inner.end_ready.swap(false, Ordering::SeqCst)
        {
            self.deliver_before_end();
            self.finish_end();
        }
    }

    /// Runs the callbacks owed for what completed before an end, including
    /// those another thread queued since this round delivered the queue:
    /// none runs after `disconnected` (thread in a round of the connection).
    fn deliver_before_end(&self) {
        self.take_send_completions();
        self.deliver_deferred();
    }

    /// Handles what the send CQ already holds (unless another thread is
    /// at it), before an end gives its reason to the synchronous operations
    /// still open: one that completed keeps its own outcome. A receive's
    /// flush error can be polled first, as the QP's error flushes both
    /// queues at once, while a READ before the failed one sits in the send
    /// CQ, completed.
    fn take_send_completions(&self) {
        // Failures found here (the end's own flush) add nothing: it is
        // ending already, for its own reason. Callbacks owed are queued.
        while self.poll_send_batch(false).0 {}
    }

    pub(super) fn fire_disconnected(&self) {
        if !self.inner.closed_locally.load(Ordering::SeqCst)
            && !self.inner.disconnect_fired.swap(true, Ordering::SeqCst)
        {
            self.call_handler("disconnected", |h| h.disconnected(self));
        }
    }

    /// Ends the connection after the peer left.
    pub(super) fn peer_disconnected(&self) {
        self.take_send_completions();
        let was = {
            let mut st = self.lock();
            let was = st.state;
            if !matches!(was, ConnState::Closed | ConnState::Error) {
                self.end_state(&mut st, ConnState::Closed, "the peer disconnected");
            }
            self.drop_queued(&mut st, "the peer left");
            was
        };
        self.release_settled_windows();
        self.wake();
        // Answer, so the peer's own DISCONNECTED arrives.
        self.disconnect_link();
        if !matches!(was, ConnState::Closed | ConnState::Error) {
            self.notify_state(ConnState::Closed);
            self.fire_disconnected();
            self.wake();
        }
        // A failure's owed end retires it, after its callback.
        if self.inner.kind == ConnKind::AcceptedConn && !self.inner.end_owed.load(Ordering::SeqCst)
        {
            self.retire();
        }
    }

    /// An RDMA CM event for this connection (CM thread).
    pub(crate) fn on_cm_event(&self, ev: &CmEvent) {
        match ev.kind {
            CmEventKind::ESTABLISHED => self.established(),
            CmEventKind::DISCONNECTED => self.peer_left(),
            CmEventKind::REJECTED
            | CmEventKind::UNREACHABLE
            | CmEventKind::CONNECT_ERROR
            | CmEventKind::DEVICE_REMOVAL => {
                self.fail(&format!("{} (status {})", ev.kind, ev.status));
            }
            _ => log::debug!("RDMA CM event {} on a connection", ev.kind),
        }
    }

    /// Stops the CM thread's watch over the connection's link (its RDMA
    /// CM channel, or its TCP stream once that has ended).
    pub(crate) fn unwatch_link(&self) {
        let cm = self.inner.cm_source.swap(0, Ordering::SeqCst);
        if cm != 0 {
            self.inner.rt.cm.remove(cm);
        }
    }

    /// Stops the runtime's watch over this connection.
    pub(super) fn unwatch(&self) {
        self.unwatch_link();
        let cq = self.inner.cq_source.swap(0, Ordering::SeqCst);
        if cq != 0 {
            self.inner.rt.cq.remove(cq);
        }
    }

    /// Says how much the send queue was used, once the connection ended
    /// (how often messages found no room is a measure of flow control).
    pub(super) fn log_queue_use(&self) {
        let s = self.lock().queue.stats();
        if s.queued > 0 || s.refused > 0 {
            log::info!(
                "connection to {:?}: {} messages waited in the send queue (at most {} bytes at once), {} were refused, {} dropped",
                self.inner.peer,
                s.queued,
                s.peak_bytes,
                s.refused,
                s.dropped
            );
        }
    }

    /// Frees what is still queued when the connection ends: it can never be
    /// sent. Counted in the stats, and logged.
    fn drop_queued(&self, st: &mut State, why: &str) {
        let (n, bytes) = st.queue.drop_all();
        if n > 0 {
            log::warn!(
                "connection to {:?} ended with {n} messages ({bytes} bytes) still queued ({why}); they are dropped",
                self.inner.peer
            );
        }
    }

    /// While closing: waits until `done` holds, the connection ends, or
    /// `deadline`, posting queued messages as room returns (inside a
    /// callback no completion round would).
    pub(super) fn wait_closing(&self, deadline: Instant, done: impl Fn(&State) -> bool) {
        let mut failed = None;
        let _ = self.wait_on(Until::At(deadline), |st| {
            if let Err(e) = self.post_queued(st) {
                failed = Some(e);
                return Some(());
            }
            (done(st) || st.state != ConnState::MrReady).then_some(())
        });
        if let Some(e) = failed {
            self.fail(&format!("sending a queued message: {e}"));
        }
    }

    /// Moves the QP to the error state: the device starts no more work on
    /// this connection's buffers, nor the program's.
    pub(super) fn stop_device(&self) {
        if let Err(e) = self.inner.qp.to_error() {
            // It may never have left RESET; an RDMA CM disconnect follows.
            log::debug!("stopping the QP to {:?}: {e}", self.inner.peer);
        }
    }

    /// Waits until no data callback of this connection runs on another
    /// thread (once they are shut: none starts), up to `deadline`, a
    /// timeout of its own: a callback that waits for the closing thread, on
    /// a lock of the program's, would otherwise hold both for good. Those
    /// below us on this thread are not waited for, and on a thread that
    /// runs this connection's callbacks (the completion thread, a caller
    /// polling) none is: it would stall every other connection, or a
    /// callback below us may be one of another connection that called ours.
    fn wait_data_callbacks(&self, deadline: Instant) {
        let inner = &self.inner;
        if self.on_callback_thread() {
            return;
        }
        let mine = self.data_callbacks_here();
        while inner.in_data_callbacks.load(Ordering::SeqCst) > mine {
            if Instant::now() >= deadline {
                log::warn!(
                    "closing the connection to {:?}: a callback still runs on another thread",
                    inner.peer
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// The runtime lets go of an accepted connection that ended (once: a
    /// failure and the peer's disconnect may both get here).
    pub(crate) fn retire(&self) {
        if self.inner.retired.swap(true, Ordering::SeqCst) {
            return;
        }
        self.log_queue_use();
        self.unwatch();
        self.inner.rt.forget_accepted(self);
        self.call_handler("retired", |h| h.retired(self));
    }

    /// Closes the connection: says goodbye to the peer, disconnects, and
    /// frees everything once the last handle is gone. No callback fires for a
    /// local close; a second close does nothing. No data callback (receive,
    /// write, read) starts after it returns, and one running on another
    /// thread is waited for (up to the timeout, at least a second; not on
    /// a thread that runs this connection's callbacks, where it may be
    /// below us).
    pub fn close(&self) {
        if self.inner.closed_locally.swap(true, Ordering::SeqCst) {
            return;
        }
        let deadline = Instant::now() + self.inner.opts.device_wait();
        // Queued messages were accepted: they go first, while the peer
        // returns room (bounded by the timeout).
        self.wait_closing(deadline, |st| st.queue.is_empty());
        let (was, goodbye) = {
            let mut st = self.lock();
            let was = st.state;
            let goodbye = was == ConnState::MrReady
                && matches!(
                    self.post_cmd(&mut st, Cmd::new(Opcode::ConnGoodbye, 0, 0, 0)),
                    Ok(true)
                );
            self.drop_queued(&mut st, "closed before the peer returned room");
            (was, goodbye)
        };
        if goodbye {
            // The goodbye completes after every message before it has
            // landed: disconnecting earlier could flush them unsent.
            self.wait_closing(deadline, |st| st.cmd_free.len() == CMD_SLOTS as usize);
        }
        if !self.on_callback_thread() {
            // Callbacks owed for what went before (a write callback per
            // message) have run when close returns, as the legacy library's
            // completions came before its close finished.
            let _ = self.wait_on(Until::At(deadline), |st| {
                st.deferred.is_empty().then_some(())
            });
        }
        self.take_send_completions();
        // No data callback starts from here on; the synchronous operations
        // still open fail before one running elsewhere is waited for, which
        // may be blocked in one of them.
        self.inner.data_callbacks_shut.store(true, Ordering::SeqCst);
        self.end_state(
            &mut self.lock(),
            ConnState::Closed,
            "the connection was closed",
        );
        self.release_settled_windows();
        self.wake();
        // The peer is told before the wait: with our QP stopped, its own
        // operations would otherwise run out of retries meanwhile.
        if matches!(was, ConnState::Connected | ConnState::MrReady) || self.socket_link().is_some()
        {
            self.disconnect_link();
        }
        self.wait_data_callbacks(Instant::now() + self.inner.opts.device_wait());
        self.notify_state(ConnState::Closed);
        if self.inner.kind == ConnKind::AcceptedConn {
            if self.inner.end_owed.load(Ordering::SeqCst) {
                // A failure left its end to the completion thread, which
                // will not see this connection again: its retirement
                // happens here (its `disconnected` does not, after a close).
                self.retire();
            }
            self.inner.rt.forget_accepted(self);
        }
        self.unwatch();
    }
}
