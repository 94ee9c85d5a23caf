//! Waiting until the device is done with what was sent: a caller that gave
//! up on a reply (a kv request's timeout) may reuse the memory a write
//! ahead of its request reads, but only once the device will not read it
//! again (an unacknowledged request is retransmitted from that memory).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::verbs::{SendOp, SendRequest};

use super::{wr_id, Connection, CMD_RESERVE, K_DATA, MAX_SEND_WR};

impl Connection {
    /// Returns true once every message, and every write ahead of one, posted
    /// before the call has completed; false once the connection has ended,
    /// or `within` passed without that (the connection is then failed,
    /// which stops its QP). Either way the device reads no more of those
    /// requests' memory. A tail of requests posted without a completion is
    /// given one: a signaled zero-length RDMA WRITE behind them, which
    /// touches no memory on either side. From a program thread, not a
    /// callback (as [`Connection::wait_for`]).
    pub fn retire_sends(&self, within: Duration) -> bool {
        let retired = || self.inner.data_retired.load(Ordering::Acquire);
        let mut st = self.lock();
        let target = st.data_posted;
        if retired() >= target {
            return true;
        }
        // A full send queue has a signaled request near its end already.
        let room = st.sq_used < MAX_SEND_WR - CMD_RESERVE;
        if let (Some(peer), true, true) = (st.peer_ring, st.unsignaled_data > 0, room) {
            let covered = st.unsignaled_data + 1;
            st.unsignaled_data = 0;
            st.data_posted += 1;
            st.sq_used += 1;
            let marker = [SendRequest::new(
                wr_id(K_DATA, u64::from(covered)),
                SendOp::Write(peer.at(0)),
                &[],
            )];
            // SAFETY: a zero-length write reads and writes nothing.
            if let Err(e) = unsafe { self.post_unlocked(st, &marker) } {
                self.fail(&format!("posting a send-queue marker: {e}"));
                return false;
            }
        } else {
            drop(st);
        }
        let done = self.wait_for(Instant::now() + within, || {
            retired() >= target || self.has_ended()
        });
        if !done {
            self.fail("sends did not complete in time");
            return false;
        }
        retired() >= target
    }
}
