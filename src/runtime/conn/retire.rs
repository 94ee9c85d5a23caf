//! Waiting until the device is done with what was sent: a caller that gave
//! up on a reply (a kv request's timeout) may reuse the memory a write
//! ahead of its request reads, but only once the device will not read it
//! again (an unacknowledged request is retransmitted from that memory).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::verbs::{SendOp, SendRequest};

use super::{wr_id, Connection, CMD_RESERVE, K_DATA, MAX_SEND_WR};

/// How often a wait for the send queue looks again for room for its
/// marker (taken by other requests when it first looked).
const MARKER_RETRY: Duration = Duration::from_millis(10);

impl Connection {
    /// Returns true once every message, and every write ahead of one, posted
    /// before the call has completed. Returns false once the connection has
    /// ended, or when `within` passed without that: the connection is then
    /// failed. Either way its QP was stopped, so the device starts no more
    /// work on those requests' memory. Requests posted without a completion
    /// at the end of the send queue are given one: a signaled zero-length
    /// RDMA WRITE behind them, which touches no memory on either side. From
    /// a program thread, not a callback (as [`Connection::wait_for`]).
    pub fn retire_sends(&self, within: Duration) -> bool {
        let retired = || self.inner.data_retired.load(Ordering::Acquire);
        let target = self.lock().data_posted;
        let deadline = Instant::now() + within;
        loop {
            if retired() >= target {
                return true;
            }
            if self.has_ended() {
                return false;
            }
            if let Err(e) = self.mark_sends_through(target) {
                self.fail(&format!("posting a send-queue marker: {e}"));
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                self.fail("sends did not complete in time");
                return false;
            }
            self.wait_for((now + MARKER_RETRY).min(deadline), || {
                retired() >= target || self.has_ended()
            });
        }
    }

    /// Posts the marker that gives a completion to data requests up to
    /// number `target` that have none coming, if there are such and the
    /// send queue has room for it (else a later call tries again).
    fn mark_sends_through(&self, target: u64) -> crate::runtime::Result<()> {
        let mut st = self.lock();
        // The unsignaled requests are the last `unsignaled_data` posted.
        let uncovered = st.data_posted - u64::from(st.unsignaled_data) < target;
        let room = st.sq_used < MAX_SEND_WR - CMD_RESERVE;
        let Some(peer) = st.peer_ring.filter(|_| uncovered && room) else {
            return Ok(());
        };
        let covered = Self::take_data_places(&mut st, 1, true);
        let marker = [SendRequest::new(
            wr_id(K_DATA, u64::from(covered)),
            SendOp::Write(peer.at(0)),
            &[],
        )];
        // SAFETY: a zero-length write reads and writes nothing.
        unsafe { self.post_unlocked(st, &marker) }
    }
}
