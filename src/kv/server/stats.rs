//! The server's counters, the snapshot of them it gives
//! ([`Stats`](crate::kv::Stats)), and the episodes its limits log once.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::kv::limits::Episode;
#[cfg(doc)]
use crate::kv::Limits;

/// A snapshot of the server's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub clients: u64,
    pub clients_total: u64,
    pub gets: u64,
    pub get_misses: u64,
    pub puts: u64,
    pub deletes: u64,
    pub cas_ok: u64,
    pub cas_failed: u64,
    pub errors: u64,
    pub items: u64,
    pub pool_used: u64,
    pub pool_size: u64,
    pub large_bytes: u64,
    pub huge_pages: bool,
    /// Clients refused: [`Limits::max_connections`] reached.
    pub refused_connections: u64,
    /// Clients dropped: setup not finished by [`Limits::setup_deadline`].
    pub setup_timeouts: u64,
    /// Clients disconnected: [`Limits::reply_queue_bytes`] of replies
    /// waiting for them.
    pub reply_overflows: u64,
    /// Requests answered `KV_ERR_NO_MEMORY`: [`Limits::client_jobs`] of
    /// that client's already waiting.
    pub busy_refusals: u64,
    /// Times a worker's queue was full ([`Limits::worker_queue`]) and
    /// requests waited for room.
    pub worker_queue_full: u64,
    /// Large values refused: [`Limits::large_value_quota`] reached.
    pub quota_refusals: u64,
    /// Leases ended early: the client held [`Limits::lease_bytes`].
    pub leases_capped: u64,
    /// Leases ended after [`Limits::lease_time`].
    pub leases_expired: u64,
    /// Write targets refused: the client held [`Limits::target_bytes`].
    pub targets_capped: u64,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "clients {} (total {}) | items {} | gets {} (misses {}) puts {} dels {} cas {}/{} failed | \
             errors {} | pool {:.1}/{:.1} MiB{} | large values {:.1} MiB | limits: refused {} \
             setup timeouts {} reply overflows {} busy {} worker queue full {} quota {} \
             leases capped {} expired {} targets capped {}",
            self.clients,
            self.clients_total,
            self.items,
            self.gets,
            self.get_misses,
            self.puts,
            self.deletes,
            self.cas_ok,
            self.cas_failed,
            self.errors,
            self.pool_used as f64 / 1048576.0,
            self.pool_size as f64 / 1048576.0,
            if self.huge_pages { " (huge pages)" } else { "" },
            self.large_bytes as f64 / 1048576.0,
            self.refused_connections,
            self.setup_timeouts,
            self.reply_overflows,
            self.busy_refusals,
            self.worker_queue_full,
            self.quota_refusals,
            self.leases_capped,
            self.leases_expired,
            self.targets_capped,
        )
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) clients: AtomicU64,
    pub(super) clients_total: AtomicU64,
    pub(super) gets: AtomicU64,
    pub(super) get_misses: AtomicU64,
    pub(super) puts: AtomicU64,
    pub(super) deletes: AtomicU64,
    pub(super) cas_ok: AtomicU64,
    pub(super) cas_failed: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) refused_connections: AtomicU64,
    /// Of listeners already released (the current one counts its own).
    pub(super) setup_timeouts: AtomicU64,
    pub(super) reply_overflows: AtomicU64,
    pub(super) busy_refusals: AtomicU64,
    pub(super) worker_queue_full: AtomicU64,
    pub(super) leases_capped: AtomicU64,
    pub(super) leases_expired: AtomicU64,
    pub(super) targets_capped: AtomicU64,
}

/// One [`Episode`] per limit, so each logs once per episode.
#[derive(Default)]
pub(super) struct Episodes {
    pub(super) refused: Episode,
    pub(super) overflow: Episode,
    pub(super) busy: Episode,
    pub(super) worker_queue: Episode,
    pub(super) leases: Episode,
    pub(super) targets: Episode,
}

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
