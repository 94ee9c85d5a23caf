//! What the poller thread watches: the [`Source`] trait, what a source's
//! `ready` reports, and the guard that keeps one source's panic from
//! ending the thread.

use std::os::fd::RawFd;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// Something with a file descriptor to watch.
pub trait Source: Send + Sync {
    /// Stays the same while the source is watched (-1: nothing to watch).
    fn fd(&self) -> RawFd;
    /// Called on the poller's thread when `fd` is readable (and, when the
    /// thread has been idle a while, now and then regardless if the source
    /// `needs_looks`, so a missed wakeup costs at most about a second).
    /// Re-arms what raises events. Returns whether its items came bunched
    /// (faster than the thread can be woken for each) with nobody waiting
    /// for them or for an answer, as a stream's do: then a thread that may
    /// not spin naps before it looks again (see [`Poller::start`]); or
    /// that it stopped at its share of the thread with items left.
    fn ready(&self) -> Ready;
    /// Handles what is pending without waiting or re-arming; true when there
    /// was something. Called in a loop while the thread spins.
    fn poll_once(&self) -> bool {
        false
    }
    /// Called instead of `ready` when `fd` became readable while the thread
    /// spins: handles what is pending, and returns `None` if the thread
    /// should poll the source with `poll_once` from now on (it then need
    /// not be re-armed until it goes quiet), else what its `ready` said
    /// (a `More` is owed a turn).
    fn woken(&self) -> Option<Ready> {
        Some(self.ready())
    }
    /// The thread polls the source with `poll_once` on its spin's passes
    /// from now on, unarmed (between two runs of passes it may handle its
    /// events and wakes first), and calls `ready` before it stops doing so
    /// (unless the source leaves the set or the thread stops): what the
    /// source would arm meanwhile, it may leave to the spinner.
    fn spun(&self) {}
    /// Called after a nap the thread took because the source's items came
    /// bunched ([`Source::ready`]), instead of `ready`: handles what is
    /// pending without re-arming (`evented`: the source's fd was readable,
    /// an event its last arming raised, to be taken) and returns true while
    /// its items still come with nobody waiting on them, so the thread
    /// naps again. Unarmed, a stream's items raise no events, whose
    /// delivery the peer's post pays on Soft-RoCE. On false the thread
    /// calls `ready`.
    fn nap_poll(&self, _evented: bool) -> bool {
        false
    }
    /// Called about once per tick, busy or not.
    fn tick(&self) {}
    /// Whether `tick` may have work to do now. While no source's has, an
    /// idle thread sleeps until an event (or the look at every source),
    /// not a tick: each tick of a sleeping thread is a system call.
    fn wants_tick(&self) -> bool {
        false
    }
    /// Whether a wakeup of the source can be missed (a completion channel:
    /// an event raised before it was armed), so an idle thread looks at it
    /// now and then. Not for one whose fd stays readable while it has work
    /// (an RDMA CM channel, a socket): while no source needs looks or
    /// ticks, an idle thread sleeps until an event.
    fn needs_looks(&self) -> bool {
        true
    }
    /// One of the calls above panicked (a defect of ours): end what the
    /// source serves, if a panic means it cannot go on.
    fn panicked(&self) {}
}

/// What a source's [`Source::ready`] left.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// Everything handled, and armed.
    #[default]
    Done,
    /// Everything handled; its items came bunched with nobody waiting on
    /// them, so a thread that may not spin naps on it.
    Bunched,
    /// It handled its share and stopped with items left, which may raise
    /// no event: the thread calls `ready` again once every other source
    /// with an event had its turn (while it spins, every 20 us of its
    /// spin), so one busy source (a peer sending faster than its messages
    /// are handled) cannot keep the thread from the rest.
    More,
}

/// A source as the thread calls it: a panic in one source's handler is
/// logged and handed to its `panicked`, and never ends the thread that
/// serves every other one.
pub(super) struct Guarded {
    pub(super) source: Arc<dyn Source>,
}

impl Guarded {
    fn call<R: Default>(&self, what: &str, f: impl FnOnce(&dyn Source) -> R) -> R {
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(&*self.source))) {
            Ok(r) => r,
            Err(_) => {
                log::error!(
                    "a {} source panicked in {what}",
                    std::thread::current().name().unwrap_or("poller")
                );
                let _ = std::panic::catch_unwind(AssertUnwindSafe(|| self.source.panicked()));
                R::default()
            }
        }
    }
}

impl Source for Guarded {
    fn fd(&self) -> RawFd {
        self.source.fd()
    }
    fn ready(&self) -> Ready {
        self.call("ready", |s| s.ready())
    }
    fn poll_once(&self) -> bool {
        self.call("poll_once", |s| s.poll_once())
    }
    fn woken(&self) -> Option<Ready> {
        // A source that panicked is not polled on.
        self.call("woken", |s| Some(s.woken()))
            .unwrap_or(Some(Ready::Done))
    }
    fn spun(&self) {
        self.call("spun", |s| s.spun())
    }
    fn nap_poll(&self, evented: bool) -> bool {
        self.call("nap_poll", |s| s.nap_poll(evented))
    }
    fn tick(&self) {
        self.call("tick", |s| s.tick())
    }
    fn wants_tick(&self) -> bool {
        // A source that cannot say is ticked.
        std::panic::catch_unwind(AssertUnwindSafe(|| self.source.wants_tick())).unwrap_or(true)
    }
    fn needs_looks(&self) -> bool {
        std::panic::catch_unwind(AssertUnwindSafe(|| self.source.needs_looks())).unwrap_or(true)
    }
}
