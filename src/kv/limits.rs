//! The server's limits against clients it does not control: how many may
//! connect, how long their setup may take, how much may wait for them
//! (replies, requests), how much memory values outside the pool and leases
//! may hold. Each limit, when hit, is counted in [`super::Stats`] and logged
//! once per episode. Also the largest worker settings a server accepts
//! ([`MAX_WORKERS`], [`MAX_WORKER_QUEUE`]): both come from callers (the C
//! `kv_config` and `kv_limits`), and both are allocated up front.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::store::Block;

/// The most worker threads a server starts ([`super::ServerConfig::workers`]).
/// A worker beyond the machine's CPUs only takes turns on them, and 1024 is
/// above the hardware threads of today's largest two-socket servers; every
/// worker is spawned at start with its queue preallocated, so a million
/// asked for would be a million threads.
pub const MAX_WORKERS: usize = 1024;

/// The deepest worker queue a server accepts ([`Limits::worker_queue`]).
/// The queue is preallocated (every slot, at start), and an allocation that
/// fails aborts the process, so the depth must stay modest: 65,536 slots of
/// a few dozen bytes are a few MiB per worker. Depth beyond that buys
/// nothing: a full queue only makes the completion thread wait (nothing is
/// lost), and at the default [`Limits::client_jobs`] it already holds the
/// whole share of 256 clients.
pub const MAX_WORKER_QUEUE: usize = 1 << 16;

/// The limits of a server ([`super::ServerConfig::limits`]); `Default`
/// gives the defaults listed in the README.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Clients connected (or still setting up) at once; beyond, a new one
    /// is refused (RDMA CM reject, or its socket closed).
    pub max_connections: usize,
    /// Clients from one IP address connected (or still setting up) at
    /// once; beyond, a new one from it is refused as above. The per-client
    /// shares ([`Limits::target_bytes`], [`Limits::lease_bytes`],
    /// [`Limits::client_jobs`]) are per connection, so this bounds what
    /// one host can take by opening many. Default `usize::MAX`: no limit
    /// besides [`Limits::max_connections`], as before it existed; set it
    /// where each host runs few clients.
    pub host_connections: usize,
    /// Time a client has to finish connecting (handshake, QP exchange,
    /// ring advertisement); a silent one is dropped after it.
    pub setup_deadline: Duration,
    /// Replies waiting for room in one client's ring, in bytes; a client
    /// that lets more pile up (it withholds credit) is disconnected.
    pub reply_queue_bytes: usize,
    /// Requests waiting for each worker thread; when full, the completion
    /// thread waits for room (back-pressure: everyone slows, nobody is
    /// dropped). At most [`MAX_WORKER_QUEUE`].
    pub worker_queue: usize,
    /// Requests of one client waiting for its worker (or served, their
    /// answers held a moment to share a doorbell); beyond, its requests
    /// are answered `KV_ERR_NO_MEMORY` until its queue drains (releases of
    /// leases are always taken).
    pub client_jobs: usize,
    /// Bytes of values stored outside the slab pool (large values, write
    /// targets, superseded values still leased); beyond, a PUT of a large
    /// value gets `KV_ERR_NO_MEMORY`.
    pub large_value_quota: u64,
    /// Bytes one client may hold leased (values it GETs and READs
    /// remotely); beyond, its oldest leases end. A client's newest lease is
    /// always kept.
    pub lease_bytes: u64,
    /// Bytes of values one client may hold in write targets (the server
    /// memory it writes a value larger than its request buffer into,
    /// before the PUT that stores it); beyond, its request for another
    /// gets `KV_ERR_NO_MEMORY`. A client holding none always gets one.
    /// Without it one client could take the whole
    /// [`Limits::large_value_quota`] and keep every other client's large
    /// PUTs out for as long as it stayed connected.
    pub target_bytes: u64,
    /// A lease not released after this long ends.
    pub lease_time: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            host_connections: usize::MAX,
            setup_deadline: crate::runtime::DEFAULT_SETUP_DEADLINE,
            reply_queue_bytes: 1 << 20,
            worker_queue: 4096,
            client_jobs: 256,
            large_value_quota: 8 << 30,
            lease_bytes: 256 << 20,
            // A quarter of the quota: two values of the default largest
            // size in flight per client.
            target_bytes: 2 << 30,
            lease_time: Duration::from_secs(30),
        }
    }
}

/// Quiet time after which a limit hit again is logged again.
const EPISODE_GAP: Duration = Duration::from_secs(10);

/// Logs the first hit of a limit, then only counts hits until it has been
/// quiet for [`EPISODE_GAP`]: one line per episode, not a flood.
#[derive(Default)]
pub(crate) struct Episode {
    last: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
}

impl Episode {
    /// A hit: `line` is logged (as a warning) when a new episode starts.
    pub fn hit(&self, line: impl FnOnce() -> String) {
        let now = Instant::now();
        let mut last = self.last.lock().expect("episode lock");
        let fresh = last.is_none_or(|t| now.duration_since(t) >= EPISODE_GAP);
        *last = Some(now);
        drop(last);
        if fresh {
            let before = self.unlogged.swap(0, Ordering::Relaxed);
            let also = if before > 0 {
                format!(" ({before} earlier hits not logged)")
            } else {
                String::new()
            };
            log::warn!(
                "{}{also}; further hits within {EPISODE_GAP:?} are only counted",
                line()
            );
        } else {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct Lease {
    token: u64,
    block: Arc<Block>,
    since: Instant,
}

/// One client's leases, oldest first. Tokens only grow, so a lease is
/// appended and nearly always released from the front; the queue keeps its
/// room, so a steady stream of leases allocates nothing (a tree's nodes
/// were allocated and freed as it went).
#[derive(Default)]
pub(crate) struct Leases {
    queue: VecDeque<Lease>,
    bytes: u64,
}

impl Leases {
    /// Adds a lease; ends the oldest ones while the client holds more than
    /// `cap` bytes or `max` leases. Returns how many ended.
    pub fn insert(&mut self, token: u64, block: Arc<Block>, cap: u64, max: usize) -> u64 {
        self.bytes += block.len() as u64;
        let lease = Lease {
            token,
            block,
            since: Instant::now(),
        };
        // Two threads serving one client could take their tokens in one
        // order and insert in the other.
        match self.queue.back() {
            Some(last) if last.token > token => {
                let at = self.queue.partition_point(|l| l.token < token);
                self.queue.insert(at, lease);
            }
            _ => self.queue.push_back(lease),
        }
        let mut ended = 0;
        while self.queue.len() > 1 && (self.bytes > cap || self.queue.len() > max) {
            self.pop_first();
            ended += 1;
        }
        ended
    }

    /// Ends lease `token`; returns its value, for the caller to let go
    /// once it has let go of the lock (a large value's unmapping is slow).
    pub fn remove(&mut self, token: u64) -> Option<Arc<Block>> {
        let at = self.queue.binary_search_by_key(&token, |l| l.token).ok()?;
        let lease = self.queue.remove(at)?;
        self.bytes -= lease.block.len() as u64;
        Some(lease.block)
    }

    /// Ends the leases older than `ttl`; returns how many.
    pub fn expire(&mut self, ttl: Duration) -> u64 {
        let now = Instant::now();
        let mut ended = 0;
        while self
            .queue
            .front()
            .is_some_and(|l| now.duration_since(l.since) >= ttl)
        {
            self.pop_first();
            ended += 1;
        }
        ended
    }

    /// When the oldest lease (the one `expire` looks at first) reaches
    /// `ttl`; `None` while none is held.
    pub fn first_end(&self, ttl: Duration) -> Option<Instant> {
        self.queue.front().and_then(|l| l.since.checked_add(ttl))
    }

    fn pop_first(&mut self) {
        if let Some(lease) = self.queue.pop_front() {
            self.bytes -= lease.block.len() as u64;
        }
    }
}
/// Clients connected (or setting up) per IP address, against
/// [`Limits::host_connections`]. An IPv4 address mapped into IPv6 counts
/// as the IPv4 one, so a host cannot double its share by the family it
/// connects with.
#[derive(Default)]
pub(crate) struct HostConnections(Mutex<HashMap<IpAddr, usize>>);

impl HostConnections {
    /// Counts a client from `ip` in, unless `cap` from it are connected.
    pub(crate) fn admit(&self, ip: IpAddr, cap: usize) -> bool {
        let mut hosts = self.0.lock().expect("hosts lock");
        let count = hosts.entry(ip.to_canonical()).or_insert(0);
        if *count >= cap {
            return false;
        }
        *count += 1;
        true
    }

    /// Counts a client [`Self::admit`] let in out again.
    pub(crate) fn leave(&self, ip: IpAddr) {
        let mut hosts = self.0.lock().expect("hosts lock");
        let ip = ip.to_canonical();
        if let Some(count) = hosts.get_mut(&ip) {
            *count -= 1;
            if *count == 0 {
                hosts.remove(&ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn a_host_gets_its_cap_whatever_the_family_and_others_are_counted_apart() {
        let hosts = HostConnections::default();
        let v4 = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));
        let mapped = IpAddr::V6(Ipv4Addr::new(198, 18, 0, 1).to_ipv6_mapped());
        let other = IpAddr::V6(Ipv6Addr::LOCALHOST);
        assert!(hosts.admit(v4, 2));
        assert!(hosts.admit(mapped, 2));
        assert!(!hosts.admit(v4, 2), "a third from one host");
        assert!(!hosts.admit(mapped, 2), "the same host as IPv6");
        assert!(hosts.admit(other, 2), "another host is counted apart");
        hosts.leave(mapped);
        assert!(hosts.admit(v4, 2), "a slot came back");
        assert!(!hosts.admit(v4, 2));
        for _ in 0..2 {
            hosts.leave(v4);
        }
        hosts.leave(other);
        assert!(hosts.0.lock().unwrap().is_empty(), "nothing kept per host");
    }
}
