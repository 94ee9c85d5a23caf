//! The SnowRDMA runtime: connections over RDMA CM with a background CM event
//! thread and a completion thread, two-sided messages through a credit-based
//! ring (RDMA WRITE WITH IMM), one-sided READ/WRITE, sync and async.
//!
//! Threads: RDMA CM events (connect requests, established, disconnects) are
//! handled on the thread `snowrdma-cm`; completions, and so the `recv`,
//! `write_done`, `read_done` and `connected` callbacks, on `snowrdma-cq`.
//! Callbacks may call any connection method; a wait inside a callback drives
//! the connection's completions itself instead of deadlocking.

mod conn;
pub mod legacy_peer;
mod listener;
mod options;
mod poller;
pub mod proto;
pub mod ring;
pub mod send_queue;
mod socket;
pub(crate) mod spin;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use conn::{
    BatchMessage, ConnHandler, ConnKind, ConnState, Connection, InRing, PdProvider, PendingReads,
    WeakConnection, Window, WriteAhead, DRAIN_BUDGET, MESSAGES_PER_DOORBELL,
};
pub use listener::{AcceptHook, Listener};
pub use options::{
    CommMode, Options, CHOSEN_INLINE_DATA, DEFAULT_MAX_SETUPS, DEFAULT_RECV_BUF_LEN,
    DEFAULT_SETUP_DEADLINE, MAX_SETUPS_ENV, MIN_DEVICE_WAIT, NAP_ENV, SEND_QUEUE_ENV,
};
pub(crate) use poller::thread_token;
pub use send_queue::SendQueueStats;

use crate::verbs::{self, CmIdRef};
use poller::Poller;

/// What can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    #[error("the connection is not established yet")]
    NotConnected,
    #[error("the connection has ended")]
    Disconnected,
    #[error("a message of {len} bytes exceeds the {max} bytes the peer's ring holds")]
    TooLarge { len: usize, max: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("timed out {0}")]
    Timeout(String),
    #[error("the operation failed: {0}")]
    OperationFailed(String),
    #[error("socket mode: {0}")]
    Socket(String),
    #[error("could not start a runtime thread: {0}")]
    Thread(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The background threads and the table of accepted connections.
pub struct Runtime {
    pub(crate) cm: Poller,
    pub(crate) cq: Poller,
    /// Accepted connections by CM id, with the listener that accepted them:
    /// the listener's channel carries their events.
    accepted: Mutex<HashMap<CmIdRef, (CmIdRef, Connection)>>,
}

static RUNTIME: Mutex<Option<Arc<Runtime>>> = Mutex::new(None);
/// Settings the next runtime starts with (see [`configure`]).
static SETTINGS: Mutex<Option<Options>> = Mutex::new(None);

/// Sets the options the runtime threads start with (poll tick, completion
/// thread CPU). Takes effect at the next start.
pub fn configure(opts: &Options) {
    *SETTINGS.lock().expect("settings lock") = Some(opts.clone());
}

/// The running runtime, started on first use.
pub fn runtime() -> Result<Arc<Runtime>> {
    let mut slot = RUNTIME.lock().expect("runtime lock");
    if let Some(rt) = slot.as_ref() {
        return Ok(rt.clone());
    }
    let opts = SETTINGS
        .lock()
        .expect("settings lock")
        .clone()
        .unwrap_or_default();
    let cpu = opts.io_affinity_cpu;
    let rt = Arc::new(Runtime {
        cm: Poller::start(
            "snowrdma-cm",
            opts.poll_event_timeout,
            Duration::ZERO,
            Duration::ZERO,
            || {},
        )?,
        cq: Poller::start(
            "snowrdma-cq",
            opts.poll_event_timeout,
            opts.spin,
            opts.nap.min(options::MAX_NAP),
            move || {
                if let Some(cpu) = cpu {
                    pin_to_cpu(cpu)
                }
            },
        )?,
        accepted: Mutex::new(HashMap::new()),
    });
    *slot = Some(rt.clone());
    Ok(rt)
}

/// Stops the runtime: closes every accepted connection and lets go of it
/// (its handler's `retired` runs, as at a listener's release), and lets
/// the threads end once no connection uses them. A later call starts a
/// fresh one.
pub fn stop() {
    let Some(rt) = RUNTIME.lock().expect("runtime lock").take() else {
        return;
    };
    let conns: Vec<Connection> = rt
        .accepted
        .lock()
        .expect("table lock")
        .values()
        .map(|(_, c)| c.clone())
        .collect();
    for c in conns {
        c.close();
        // Closed here, its end is no thread's to see: without this, its C
        // handle stayed live, and allocated, for good.
        c.retire();
    }
    // The threads end when the last connection using this runtime is gone.
    drop(rt);
}

impl Runtime {
    pub(crate) fn remember_accepted(&self, listener: CmIdRef, conn: &Connection) {
        self.accepted.lock().expect("table lock").insert(
            conn.cm_id().expect("RDMA CM").id_ref(),
            (listener, conn.clone()),
        );
    }

    pub(crate) fn forget_accepted(&self, conn: &Connection) {
        if let Some(id) = conn.cm_id() {
            self.accepted
                .lock()
                .expect("table lock")
                .remove(&id.id_ref());
        }
    }

    pub(crate) fn accepted_conn(&self, id: CmIdRef) -> Option<Connection> {
        self.accepted
            .lock()
            .expect("table lock")
            .get(&id)
            .map(|(_, c)| c.clone())
    }

    pub(crate) fn accepted_by(&self, listener: CmIdRef) -> Vec<Connection> {
        self.accepted
            .lock()
            .expect("table lock")
            .values()
            .filter(|(l, _)| *l == listener)
            .map(|(_, c)| c.clone())
            .collect()
    }
}

/// Pins the calling thread to `cpu`; a CPU that does not exist is a warning.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET checks nothing, so bound it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            log::warn!("rdma_io_affinity_cpuid {cpu} is not a CPU here; the completion thread is not pinned");
            return;
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            log::warn!(
                "cannot pin the completion thread to CPU {cpu}: {}; running unpinned",
                std::io::Error::last_os_error()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_to_a_cpu_that_does_not_exist_only_warns() {
        std::thread::spawn(|| {
            pin_to_cpu(0);
            // SAFETY: plain libc call.
            assert_eq!(unsafe { libc::sched_getcpu() }, 0);
            pin_to_cpu(1 << 20);
            pin_to_cpu(libc::CPU_SETSIZE as usize - 1);
        })
        .join()
        .unwrap();
    }
}
