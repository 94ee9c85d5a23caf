//! Waiting on a connection: waking waiters, spinning then sleeping, and
//! waits that drive the connection's completions themselves inside a
//! callback (where nobody else would).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crate::runtime::spin::Spin;
use crate::runtime::{thread_token, Error, Result};
use crate::verbs::CompletionQueue;

use super::{Connection, State};

impl Connection {
    /// Wakes every thread waiting on this connection.
    pub(super) fn wake(&self) {
        self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
        if self.inner.sleepers.load(Ordering::SeqCst) > 0 {
            // Under the sleep lock: a sleeper checks `wakeups` under it, so
            // it has either seen this wake or is already waiting.
            let _guard = self.inner.sleep_lock.lock().expect("sleep lock");
            self.inner.cond.notify_all();
        }
    }

    /// Releases the lock until something changes or `deadline`: spins
    /// first (`Options::spin`, from `now`, the caller's reading of the
    /// clock), since completions usually come sooner than a sleeping thread
    /// can be woken, then sleeps in short bounded waits.
    pub(super) fn park<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        deadline: Instant,
        now: Instant,
    ) -> MutexGuard<'a, State> {
        let _waiting = Waiting::on(self);
        let seen = self.inner.wakeups.load(Ordering::SeqCst);
        // Places a write's completion left while we held the lock: look
        // again at once (its wake is already counted in `seen`).
        if self.inner.sq_done.load(Ordering::SeqCst) != 0 {
            return self.settled(st);
        }
        // Credit owed goes now: the completion thread leaves it to the
        // holder of the lock when it finds it taken, and this holder is
        // about to wait, perhaps for a peer that waits for this credit.
        self.send_owed_credit(&mut st);
        drop(st);
        let caller_polls = self.inner.opts.caller_polls;
        // Polls first, then reads the clock: a reading costs as much as a
        // poll of an empty CQ (far more under emulation).
        let spin_until = (now + self.inner.opts.spin).min(deadline);
        loop {
            // A caller-polled connection's round covers the send CQ too.
            let polled = if caller_polls {
                self.poll_round()
            } else {
                self.poll_send(false)
            };
            if polled || self.inner.wakeups.load(Ordering::SeqCst) != seen {
                return self.lock();
            }
            if Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        self.sleep(seen, deadline);
        self.lock()
    }

    /// Sleeps until a wake after the one numbered `seen`, or `deadline`, or
    /// 10 ms. With `caller_polls` the CQs are armed first, since a sleeping
    /// caller leaves its completions to the completion thread.
    pub(super) fn sleep(&self, seen: u64, deadline: Instant) {
        self.inner.sleepers.fetch_add(1, Ordering::SeqCst);
        // Completions that came before arming raise no event. (Polling
        // also when nothing was armed just now lets a reply that is on its
        // way be taken here rather than through the completion thread.)
        if self.inner.opts.caller_polls {
            self.arm_send();
            if !self.arm_recv() {
                log::warn!("arming the receive CQ failed; waiting in 10 ms steps");
            }
            while self.poll_round() {}
        } else {
            self.arm_send_and_take(false);
        }
        let guard = self.inner.sleep_lock.lock().expect("sleep lock");
        if self.inner.wakeups.load(Ordering::SeqCst) == seen {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(10));
            drop(
                self.inner
                    .cond
                    .wait_timeout(guard, left)
                    .expect("sleep lock"),
            );
        }
        self.inner.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Waits until `done` returns true (then true) or `deadline` passes (then
    /// false), for a caller whose answer a callback brings, such as the reply
    /// to its request. With [`Options::caller_polls`](crate::runtime::Options::caller_polls) the caller polls the
    /// connection itself meanwhile and may run callbacks (see there).
    pub fn wait_for(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
        let _waiting = Waiting::on(self);
        let spin = self.inner.opts.spin;
        // Without spinning, the clock is read only to check the deadline.
        let start_spin = || match spin.is_zero() {
            true => None,
            false => {
                let now = Instant::now();
                Spin::start(now).map(|s| (s, now + spin))
            }
        };
        let mut spinning = start_spin();
        loop {
            // Read before `done`, so a wake in between is not slept through.
            let seen = self.inner.wakeups.load(Ordering::SeqCst);
            if done() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if let Some((s, until)) = &mut spinning {
                if now < *until && s.pass(now) {
                    if self.inner.opts.caller_polls {
                        self.poll_round();
                    }
                    std::hint::spin_loop();
                    continue;
                }
            }
            // Its place among the spinners is given up before it sleeps.
            drop(spinning.take());
            self.sleep(seen, deadline);
            spinning = start_spin();
        }
    }

    /// An operation whose completion owes a callback is about to be
    /// posted: counted, so the send CQ
    /// is armed while it is out, and armed now, before the post, so its
    /// completion raises an event. Not when the completion thread is
    /// polling this connection (a handler's answer): it polls that CQ while
    /// it spins and arms it at the end of a drain (`drain`), and
    /// arming is a system call each of a handler's posts would pay. Nor
    /// while the completion thread spins on this connection (`spun_on`):
    /// it polls the CQ on every pass, and clears the flag before it looks
    /// at `async_pending` to arm (both SeqCst, so one of the two sides
    /// sees the other).
    pub(super) fn async_posted(&self) {
        self.inner.async_pending.fetch_add(1, Ordering::SeqCst);
        let polling_here = self.inner.rt.cq.is_current() && self.polled_here();
        if !polling_here && !self.inner.spun_on.load(Ordering::SeqCst) {
            self.arm_send();
        }
    }

    /// The completion thread starts (true) or stops (false) polling this
    /// connection on every pass of its spin; see `spun_on`.
    pub(crate) fn set_spun_on(&self, on: bool) {
        if self.inner.spun_on.load(Ordering::Relaxed) != on {
            self.inner.spun_on.store(on, Ordering::SeqCst);
        }
    }

    /// Arms the send CQ unless it already is.
    pub(super) fn arm_send(&self) {
        if !arm_once(&self.inner.send_armed, &self.inner.send_cq) {
            log::warn!("arming the send CQ failed; its completions wait for the next tick");
        }
    }

    /// Arms the send CQ and takes everything that completed before the
    /// arming (it raises no event), a batch at a time ([`Connection::poll_send`]
    /// with `in_turn`); whether there was anything.
    pub(super) fn arm_send_and_take(&self, in_turn: bool) -> bool {
        self.arm_send();
        let mut took = false;
        while self.poll_send(in_turn) {
            took = true;
        }
        took
    }

    /// Arms the receive CQ unless it already is; false when arming failed.
    pub(super) fn arm_recv(&self) -> bool {
        arm_once(&self.inner.recv_armed, &self.inner.recv_cq)
    }

    /// Runs `f` holding the receive-poll role: at once when this thread
    /// already holds it, `None` when another thread does.
    pub(super) fn with_recv_poll<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        struct Release<'a>(&'a AtomicUsize);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(0, Ordering::Release);
            }
        }
        let me = thread_token();
        if self.inner.recv_poller.load(Ordering::Acquire) == me {
            return Some(f());
        }
        let _guard = match self.inner.recv_poll.try_lock() {
            Ok(g) => g,
            // A callback panicked while polling: the lock itself is sound.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        self.inner.recv_poller.store(me, Ordering::Release);
        let _release = Release(&self.inner.recv_poller);
        Some(f())
    }

    /// Whether callbacks of this connection run on this thread: the
    /// completion thread, or a caller polling it.
    pub(super) fn on_callback_thread(&self) -> bool {
        self.inner.rt.cq.is_current() || self.polled_here()
    }

    /// Whether this thread holds the receive-poll role of this connection:
    /// it is in a round of it (a drain, a spin's pass, a caller's poll),
    /// and handles the connection's completions and owed callbacks when
    /// the round ends.
    pub(super) fn polled_here(&self) -> bool {
        self.inner.recv_poller.load(Ordering::Acquire) == thread_token()
    }

    /// Waits until `check` gives a value, or `until` passes. On the
    /// completion thread (inside a callback) it handles this connection's
    /// completions itself, since nobody else will.
    pub(super) fn wait_on<T>(
        &self,
        until: Until,
        mut check: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T> {
        let on_cq_thread = self.on_callback_thread();
        let mut deadline = None;
        loop {
            {
                let mut st = self.lock();
                if let Some(v) = check(&mut st) {
                    return Ok(v);
                }
                let now = Instant::now();
                let deadline = *deadline.get_or_insert(match until {
                    Until::At(at) => at,
                    Until::Within(timeout) => now + timeout,
                });
                if now >= deadline {
                    return Err(Error::Timeout("waiting on the connection".into()));
                }
                if !on_cq_thread {
                    drop(self.park(st, deadline, now));
                    continue;
                }
            }
            if self.drive_inline() == 0 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// When a wait ends.
#[derive(Clone, Copy)]
pub(super) enum Until {
    At(Instant),
    /// This long after the wait's first look: the clock is read once, where
    /// the wait reads it anyway.
    Within(Duration),
}

/// Arms `cq` unless `flag` says it is armed (the flag is cleared when one
/// of its events is taken); false when arming failed (the flag is clear
/// again).
fn arm_once(flag: &AtomicBool, cq: &CompletionQueue) -> bool {
    if flag.swap(true, Ordering::SeqCst) {
        return true;
    }
    if cq.arm(false).is_err() {
        flag.store(false, Ordering::SeqCst);
        return false;
    }
    true
}

/// A thread waiting on a connection, spinning or asleep, from [`Waiting::on`]
/// until dropped: the completion thread does not nap after a round of the
/// connection's messages while one waits (a reply may be among them).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn on(conn: &'a Connection) -> Self {
        conn.inner.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(&conn.inner.waiting)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
