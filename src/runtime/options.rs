//! Connection and server options, with the legacy library's defaults.

use std::time::Duration;

/// Receive buffer (ring) size, `RDMA_DEFAULT_RX_LEN`.
pub const DEFAULT_RECV_BUF_LEN: usize = 1024 * 1024;

/// The inline size a connection asks for when [`Options::max_inline_data`]
/// is 0: a small message's bytes (a request, a reply, an echo) ride in its
/// work request, as perftest's latency tests send them. Well within what
/// RDMA devices take (Soft-RoCE and ConnectX: several hundred bytes); on a
/// device that refuses it the connection goes without inline.
pub const CHOSEN_INLINE_DATA: u32 = 128;

/// How calls that find no room behave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommMode {
    /// `send` waits for room up to [`Options::timeout`] (at least a second),
    /// then returns 0. Inside a callback, where waiting would stall the
    /// connection, it queues as [`CommMode::NonBlocking`] does.
    Blocking,
    /// `send` never waits: a message that finds no room is queued and sent
    /// in order as room returns; 0 only when that queue is full
    /// ([`Options::send_queue_bytes`]).
    NonBlocking,
}

/// Options of a connection or server. `Default` gives the legacy defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub listen_backlog: i32,
    /// Address and route resolution, and each connection-setup wait.
    pub timeout: Duration,
    /// Upper bound of one wait of the runtime threads.
    pub poll_event_timeout: Duration,
    /// Messages up to this many bytes (headers included) go to the device
    /// inside the work request. 0, the legacy default, lets the runtime
    /// choose: [`CHOSEN_INLINE_DATA`] where the device takes it, else none.
    /// Either way a program sees the same bytes arrive; inline saves the
    /// device a fetch of the message and us a copy into the staging buffer.
    pub max_inline_data: u32,
    pub retry_count: u8,
    /// 7 retries forever on the wire.
    pub rnr_retry_count: u8,
    /// Completions taken per poll.
    pub max_concurrent_work_requests: u32,
    /// Receives posted per connection.
    pub recv_depth: u32,
    pub comm_mode: CommMode,
    /// Ask for physical-address access (needs MLNX_OFED experimental verbs).
    pub enable_phys_addr_access: bool,
    /// Outstanding READs/atomics; 0 = the device's maximum.
    pub max_outstanding_rd_atomic: u32,
    /// CPU for the completion thread; `None`: no pinning.
    pub io_affinity_cpu: Option<usize>,
    /// Size of the receive ring peers write messages into.
    pub recv_buf_len: usize,
    /// How long the completion thread, and a thread waiting for a sync
    /// operation or for room, keep polling before they sleep.
    pub spin: Duration,
    /// How long the completion thread, when it may not spin, sleeps after
    /// finding a connection's messages bunched (two or more at once) with
    /// nothing waiting on them, before it looks again (unarmed, napping
    /// again while each look finds messages), rather than be woken for the
    /// next one: a stream is then taken a nap's worth at a time, and the
    /// sender's doorbell does not pay for waking it per message or two. The thread's other connections wait out the nap too, so this
    /// may be added to any completion's latency on a busy, crowded
    /// machine; 0: never; at most 10 ms.
    /// Environment: [`NAP_ENV`]. Runtime-wide, as the completion thread's
    /// spin: taken from [`configure`](crate::runtime::configure).
    pub nap: Duration,
    /// The threads waiting on this connection (for a reply, a sync
    /// operation, room to send) poll its completion queues themselves and
    /// run its callbacks, one at a time and in order, instead of being woken
    /// by the completion thread; that one looks at the connection each tick
    /// and whenever a waiter sleeps. Saves a thread hand-off per message for
    /// request/reply clients. Callbacks then run on whichever thread polls
    /// and must not wait on the connection themselves.
    pub caller_polls: bool,
    /// Bound of the queue of messages that wait for room in the peer's ring
    /// (payload bytes, plus 64 per message); a send that finds it full
    /// returns 0. Environment: [`SEND_QUEUE_ENV`].
    pub send_queue_bytes: usize,
    /// Listeners: how long an accepted connection may take to finish its
    /// setup (RDMA CM handshake or socket-mode QP exchange, then the peer's
    /// ring advertisement); a peer still not ready then is dropped, so
    /// clients that connect and go silent hold nothing for long.
    pub setup_deadline: Duration,
    /// Listeners: how many connections may be setting up at once (accepted,
    /// or exchanging QP information, and not yet ready); a connect request
    /// past them is refused before a QP or a ring is made for it, so a
    /// flood of requests that never finish pins a bounded amount of memory.
    /// 0 takes the default. Environment: [`MAX_SETUPS_ENV`].
    pub max_setups: usize,
    /// The newest protocol version this side speaks
    /// ([`proto::VERSION`](crate::runtime::proto::VERSION) unless lowered),
    /// so a program can talk to a peer on an older snowrdma as that one
    /// would, and the tests can be such a peer.
    pub protocol_version: u8,
}

/// Default [`Options::setup_deadline`]: far beyond a setup's few round
/// trips, even under emulation.
pub const DEFAULT_SETUP_DEADLINE: Duration = Duration::from_secs(10);

/// Environment variable overriding [`Options::max_setups`].
pub const MAX_SETUPS_ENV: &str = "SNOWRDMA_MAX_SETUPS";

/// Default [`Options::max_setups`]: far more setups than legitimate clients
/// start at once (each takes a few round trips), while a flood of requests
/// that never finish pins at most about 512 MiB (2 MiB of rings each).
pub const DEFAULT_MAX_SETUPS: usize = 256;

fn default_max_setups() -> usize {
    std::env::var(MAX_SETUPS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(DEFAULT_MAX_SETUPS)
}

/// Environment variable overriding [`Options::send_queue_bytes`], in bytes.
pub const SEND_QUEUE_ENV: &str = "SNOWRDMA_SEND_QUEUE_BYTES";

/// Default send-queue bound: many rings' worth, so that a peer that keeps
/// more in flight than both rings hold is served without loss, while a peer
/// that never returns credit cannot make us buffer without end.
const DEFAULT_SEND_QUEUE_BYTES: usize = 64 * DEFAULT_RECV_BUF_LEN;

fn default_send_queue_bytes() -> usize {
    std::env::var(SEND_QUEUE_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_SEND_QUEUE_BYTES)
}

/// Environment variable overriding [`Options::spin`], in microseconds.
pub const SPIN_ENV: &str = "SNOWRDMA_SPIN_US";

/// The longest nap the completion thread takes, whatever [`Options::nap`]
/// asks: every other connection it serves waits the nap out too.
pub const MAX_NAP: Duration = Duration::from_millis(10);

/// Environment variable overriding [`Options::nap`], in microseconds.
pub const NAP_ENV: &str = "SNOWRDMA_NAP_US";

/// Default nap: on Soft-RoCE under emulation, with the 2-vCPU VM too
/// crowded to spin, a 64 B stream's receiver woken per message or two
/// held the sender to 0.6 of `ib_write_bw`; napping 100, 200 or 500 us
/// each gave 0.85-1.0. The shortest: on hardware it is a hundred messages.
const DEFAULT_NAP_US: u64 = 100;

fn default_nap() -> Duration {
    micros_from_env(NAP_ENV, DEFAULT_NAP_US)
}

fn micros_from_env(var: &str, default: u64) -> Duration {
    let us = std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default);
    Duration::from_micros(us)
}

/// Default spin: many round trips on hardware, and still more than one
/// under emulation (a kv GET on Soft-RoCE in QEMU TCG takes 130-210 us; at
/// 200 us both ends went to sleep between requests and each request paid a
/// wakeup: 20-30% slower).
const DEFAULT_SPIN_US: u64 = 1000;

fn default_spin() -> Duration {
    micros_from_env(SPIN_ENV, DEFAULT_SPIN_US)
}

/// The least a wait for the device or the peer to finish (a close
/// draining, a send short of room, sends completing) is given, whatever
/// [`Options::timeout`]: a round trip under load, retransmissions
/// included, takes longer than the shortest timeouts programs set.
pub const MIN_DEVICE_WAIT: Duration = Duration::from_secs(1);

impl Options {
    /// How long a wait for the device or the peer to finish may take: the
    /// timeout, but at least [`MIN_DEVICE_WAIT`].
    pub fn device_wait(&self) -> Duration {
        self.timeout.max(MIN_DEVICE_WAIT)
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            listen_backlog: 128,
            timeout: Duration::from_millis(1000),
            poll_event_timeout: Duration::from_millis(10),
            max_inline_data: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            max_concurrent_work_requests: 128 + 2048 * 2,
            recv_depth: 1024,
            comm_mode: CommMode::NonBlocking,
            enable_phys_addr_access: false,
            max_outstanding_rd_atomic: 0,
            io_affinity_cpu: None,
            recv_buf_len: DEFAULT_RECV_BUF_LEN,
            spin: default_spin(),
            nap: default_nap(),
            caller_polls: false,
            send_queue_bytes: default_send_queue_bytes(),
            setup_deadline: DEFAULT_SETUP_DEADLINE,
            max_setups: default_max_setups(),
            protocol_version: crate::runtime::proto::VERSION,
        }
    }
}
