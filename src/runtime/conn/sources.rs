//! What the runtime's threads watch: a connection's completion channel, and
//! RDMA CM event channels.

use std::time::Duration;

use crate::runtime::poller::{Ready, Source};
use crate::runtime::DRAIN_BUDGET;
use crate::verbs::{self};

use super::Connection;

/// The completion channel of one connection, watched by the completion thread.
pub(crate) struct CqSource(pub(crate) Connection);

impl Source for CqSource {
    fn fd(&self) -> std::os::fd::RawFd {
        self.0.inner.recv_cq.channel().map_or(-1, |c| c.fd())
    }

    /// Ends a spin's unarmed polling of the connection first: what
    /// `async_posted` left unarmed because of it is armed here.
    fn ready(&self) -> Ready {
        self.0.set_spun_on(false);
        self.0.process_completions()
    }

    fn poll_once(&self) -> bool {
        // A caller-polled connection is left to its waiters (both polling one
        // CQ would only fight over its lock); sleeping ones arm it.
        !self.0.inner.opts.caller_polls && self.0.poll_round()
    }

    fn spun(&self) {
        // Not polled, so nothing may be left to the spinner.
        if !self.0.inner.opts.caller_polls {
            self.0.set_spun_on(true);
        }
    }

    fn woken(&self) -> Option<Ready> {
        if self.0.inner.opts.caller_polls {
            return Some(self.ready());
        }
        // The spinning thread polls it from now on: no re-arming.
        self.0.take_cq_event();
        self.0.poll_round();
        None
    }

    /// A stream's messages are taken unarmed between the completion
    /// thread's naps; an event the last arming raised is taken first.
    fn nap_poll(&self, evented: bool) -> bool {
        if self.0.inner.opts.caller_polls {
            return false;
        }
        if evented {
            self.0.take_cq_event();
        }
        self.0.nap_round()
    }

    /// Always: credit owed to the peer goes out on a tick once nothing
    /// carried it, and the thread that read the messages it is owed for
    /// may be any (a blocking call that polls), not this one; and nobody
    /// may be waiting on a caller-polled connection.
    fn wants_tick(&self) -> bool {
        true
    }

    fn tick(&self) {
        if self.0.inner.opts.caller_polls {
            // Nobody may be waiting on it: what came meanwhile is handled
            // now, a drain's worth (each round takes up to 4 from each CQ);
            // more waits for the next tick, as this thread serves others.
            for _ in 0..DRAIN_BUDGET / 4 {
                if !self.0.poll_round() {
                    break;
                }
            }
        }
        self.0.maybe_send_credit(true);
        self.0.expire_unsettled_windows();
    }

    fn panicked(&self) {
        self.0
            .fail("the completion thread hit a defect while serving it");
    }
}

/// RDMA CM event sources: a client connection's own channel, or a listener's
/// (which also carries its accepted connections' events).
pub(crate) enum CmSource {
    Client(Connection),
    Listener(crate::runtime::listener::Listener),
}

impl Source for CmSource {
    fn fd(&self) -> std::os::fd::RawFd {
        match self {
            CmSource::Client(c) => c.cm_id().map_or(-1, |id| id.channel().fd()),
            CmSource::Listener(l) => l.fd(),
        }
    }

    /// Connection events come one at a time: never a reason to nap. At most
    /// [`CM_EVENT_BUDGET`] per turn: a peer that floods a listener with
    /// connect requests shares the CM thread with every other channel.
    fn ready(&self) -> Ready {
        match self.take_events() {
            true => Ready::More,
            false => Ready::Done,
        }
    }

    /// Its fd stays readable while an event waits.
    fn needs_looks(&self) -> bool {
        false
    }

    fn panicked(&self) {
        // A listener goes on accepting; the event that hit the defect is gone.
        if let CmSource::Client(c) = self {
            c.fail("the CM thread hit a defect while serving it");
        }
    }
}

/// How many RDMA CM events (or socket-mode connections) one CM source takes
/// per turn of the CM thread. Each connect request builds a connection (a
/// QP and registered memory: tens of milliseconds under emulation), so a
/// flood of them would otherwise hold the thread for as long as it lasts.
pub(crate) const CM_EVENT_BUDGET: usize = 8;

impl CmSource {
    /// Takes up to [`CM_EVENT_BUDGET`] events; true when it stopped with
    /// more perhaps waiting.
    fn take_events(&self) -> bool {
        let channel = match self {
            CmSource::Client(c) => match c.cm_id() {
                Some(id) => id.channel().clone(),
                None => return false,
            },
            CmSource::Listener(l) => match l.cm_id() {
                Some(id) => id.channel().clone(),
                None => return l.accept_sockets(CM_EVENT_BUDGET),
            },
        };
        for _ in 0..CM_EVENT_BUDGET {
            let ev = match channel.get_event(Duration::ZERO) {
                Ok(ev) => ev,
                Err(verbs::Error::Timeout { .. }) => return false,
                Err(e) => {
                    log::error!("RDMA CM event channel: {e}");
                    return false;
                }
            };
            match self {
                CmSource::Client(c) => c.on_cm_event(&ev),
                CmSource::Listener(l) => l.on_cm_event(ev),
            }
        }
        true
    }
}
