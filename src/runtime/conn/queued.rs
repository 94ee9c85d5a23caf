//! Messages that found no room wait in the connection's send queue, in
//! order, and go as room returns, several to a doorbell.

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use crate::runtime::proto::ExtKind;
use crate::runtime::Result;
use crate::verbs::{SendRequest, Sge};

use super::send::{Parts, StagedMessage};
use super::{Connection, State};

/// Queued messages posted with one doorbell, at most.
const QUEUED_PER_DOORBELL: usize = 16;

impl Connection {
    /// A queued message staged for posting, if there is room for it.
    fn stage_queued(
        &self,
        st: &mut State,
        data: Parts<'_>,
        ext: Option<ExtKind>,
    ) -> Result<Option<StagedMessage>> {
        match Self::reserve(st, data.len(), ext, false) {
            Some(offset) => self
                .stage_message(st, offset, data, ext.map(ExtKind::encode), false, true)
                .map(Some),
            None => Ok(None),
        }
    }

    /// Posts staged messages (at most [`QUEUED_PER_DOORBELL`]), in order,
    /// with one doorbell, a READ of the peer's credit behind them when due.
    fn post_staged(&self, st: &mut State, staged: &[StagedMessage]) -> Result<()> {
        if staged.is_empty() {
            return Ok(());
        }
        // Filled in place, as many as there are messages (a collected
        // SmallVec is moved out with all its room).
        let mut sges: SmallVec<[[Sge; 1]; QUEUED_PER_DOORBELL]> = SmallVec::new();
        sges.extend(staged.iter().map(|m| [m.sge]));
        let read = self.credit_read(st);
        let mut reqs: SmallVec<[SendRequest<'_>; QUEUED_PER_DOORBELL + 1]> = SmallVec::new();
        reqs.extend(staged.iter().zip(&sges).map(|(m, sge)| m.request(sge)));
        if let Some(read) = &read {
            reqs.push(read.request());
        }
        // SAFETY: each staging range stays reserved until the peer returns
        // it, which is after its write has landed; the READ's range is the
        // credit region's, which only its completion reads.
        unsafe { self.post_in_order(st, &reqs) }
    }

    /// Sends queued messages while there is room.
    pub(super) fn flush_queued(&self) {
        if !self.inner.queued.load(Ordering::SeqCst) {
            return;
        }
        let mut st = self.lock();
        if let Err(e) = self.post_queued(&mut st) {
            drop(st);
            self.fail(&format!("sending a queued message: {e}"));
        }
    }

    /// Posts queued messages while there is room, under the state lock.
    /// Several go with one doorbell (up to [`QUEUED_PER_DOORBELL`]).
    pub(super) fn post_queued(&self, st: &mut State) -> Result<()> {
        if !st.queue.is_empty() {
            self.post_queue_head(st)?;
            if !st.queue.is_empty() {
                return Ok(());
            }
        }
        self.inner.queued.store(false, Ordering::SeqCst);
        if let Some(ep) = st.queue.end_episode() {
            log::warn!(
                "connection to {:?}: the send queue drained; {} messages ({} bytes) were refused while it was full",
                self.inner.peer,
                ep.refused,
                ep.refused_bytes
            );
        }
        Ok(())
    }

    /// Posts queued messages, up to [`QUEUED_PER_DOORBELL`] to a doorbell,
    /// while the ring has room for them. Called only with a non-empty queue:
    /// most calls find it empty, and the staging array costs a memset.
    fn post_queue_head(&self, st: &mut State) -> Result<()> {
        let mut staged = [StagedMessage::NONE; QUEUED_PER_DOORBELL];
        let mut n = 0;
        let mut outcome = Ok(());
        while let Some(q) = st.queue.pop() {
            match self.stage_queued(st, Parts::new(&[&q.data]), q.ext) {
                Ok(Some(m)) => {
                    staged[n] = m;
                    n += 1;
                    if n == QUEUED_PER_DOORBELL {
                        self.post_staged(st, &staged[..n])?;
                        n = 0;
                    }
                }
                Ok(None) => {
                    self.want_credit(st, Self::ring_len(q.data.len(), q.ext));
                    st.queue.unpop(q);
                    break;
                }
                Err(e) => {
                    st.queue.unpop(q);
                    outcome = Err(e);
                    break;
                }
            }
        }
        self.post_staged(st, &staged[..n])?;
        outcome
    }
}
