//! Connecting through RDMA CM: the connection manager moves the queue pair
//! to RTS, so both sides get a `Qp<Rc, Rts>` directly. Receives can be posted
//! before the connection is established, so the peer's first message finds
//! one.

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::error::Result;
use super::op::Op;
use super::qp::{Qp, QpBuilder, QpCore, Rc, Rts};
use super::region::Writable;
use crate::verbs::{self, CmEvent, CmEventKind, CmId, ConnParam};

/// A listening RDMA CM endpoint. Threads may `accept` on it at once: each
/// gets a connect request of its own.
pub struct Listener {
    id: CmId,
    /// Held from taking a connect request off the listener's channel until
    /// its id has a channel of its own: until then the id's next events
    /// (its peer giving up) would come to the listener's channel, for a
    /// concurrent `accept` to take and fail on.
    taking: Mutex<()>,
}

impl Listener {
    /// Listens on `addr` (port 0: any free port).
    pub fn bind(addr: SocketAddr) -> Result<Listener> {
        Ok(Listener {
            id: CmId::listen_on(addr, 16)?,
            taking: Mutex::new(()),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// Waits up to `timeout` for a connect request and makes its queue pair
    /// from `builder` (whose protection domain must be on the device the
    /// request came in on).
    pub fn accept(&self, builder: QpBuilder<Rc>, timeout: Duration) -> Result<CmQp> {
        let deadline = Instant::now() + timeout;
        let (id, ev) = loop {
            if let Some(taken) = self.take_request()? {
                break taken;
            }
            // Waited for without the lock: a request wakes every waiter,
            // and one of them takes it.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.id.channel().wait_readable(left)? {
                return Err(verbs::Error::Timeout {
                    what: "a connect request",
                    timeout,
                }
                .into());
            }
        };
        let core = builder.build_on(&id)?;
        Ok(CmQp {
            core,
            id,
            peer_data: ev.private_data,
            active: false,
        })
    }

    /// The connect request waiting on the listener's channel, if any, its id
    /// moved to a channel of its own: another client's request, coming in
    /// before this one is established, stays on the listener's for the next
    /// `accept`.
    fn take_request(&self) -> Result<Option<(CmId, CmEvent)>> {
        let _taking = self.taking.lock().unwrap_or_else(PoisonError::into_inner);
        match self.id.get_request(Duration::ZERO) {
            Ok((id, ev)) => Ok(Some((id.on_own_channel()?, ev))),
            Err(e) if e.is_timeout() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// Resolves `addr` and makes the queue pair from `builder`; then post
/// receives if needed and [`CmQp::establish`].
pub fn connect(addr: SocketAddr, builder: QpBuilder<Rc>, timeout: Duration) -> Result<CmQp> {
    let id = CmId::resolve(addr, None, timeout)?;
    let core = builder.build_on(&id)?;
    Ok(CmQp {
        core,
        id,
        peer_data: Vec::new(),
        active: true,
    })
}

/// A queue pair of a connection being set up: receives may be posted; then
/// [`CmQp::establish`].
pub struct CmQp {
    core: QpCore,
    id: CmId,
    peer_data: Vec<u8>,
    active: bool,
}

impl CmQp {
    /// What the peer sent with its connect request (the accepting side),
    /// zero-padded by RDMA CM to the size of the CM message.
    pub fn peer_data(&self) -> &[u8] {
        &self.peer_data
    }

    /// Posts a receive before the connection exists.
    pub fn recv<W: Writable>(&self, mem: W) -> Result<Op<W>> {
        self.core.post_recv(mem)
    }

    /// Connects (or accepts) with `private_data` for the peer (at most 56
    /// bytes connecting, 196 accepting), waiting up to `timeout`. Returns the
    /// queue pair in RTS and the peer's private data.
    pub fn establish(
        self,
        private_data: &[u8],
        timeout: Duration,
    ) -> Result<(Qp<Rc, Rts>, Vec<u8>)> {
        let a = &self.core.attrs;
        let param = ConnParam {
            responder_resources: a.max_dest_rd_atomic,
            initiator_depth: a.max_rd_atomic,
            retry_count: a.retry_cnt,
            rnr_retry_count: a.rnr_retry,
            private_data: private_data.to_vec(),
        };
        if self.active {
            self.id.connect(&param)?;
        } else {
            self.id.accept(&param)?;
        }
        let ev = self.id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
        let peer = if self.active {
            ev.private_data
        } else {
            self.peer_data
        };
        Ok((Qp::from_core(self.core), peer))
    }
}

impl QpBuilder<Rc> {
    /// The queue pair on a CM id (RDMA CM drives its states).
    fn build_on(self, id: &CmId) -> Result<QpCore> {
        let (pd, send_cq, recv_cq, attrs) = self.into_parts()?;
        let qp = id.create_qp(
            pd.verbs(),
            send_cq.device_cq(),
            recv_cq.device_cq(),
            &attrs.caps,
        )?;
        Ok(QpCore {
            ctx: pd.verbs().context().clone(),
            qp,
            cm_id: Some(id.clone()),
            _srq: None,
            send: send_cq.shared.clone(),
            recv: recv_cq.shared.clone(),
            attrs,
        })
    }
}

/// Disconnects a CM queue pair on drop; the peer sees DISCONNECTED.
pub(crate) fn disconnect(id: &CmId) {
    if let Err(e) = id.disconnect() {
        log::debug!("dropping a CM queue pair: {e}");
    }
}
