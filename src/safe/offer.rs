//! Offering memory to a peer, and taking it back.
//!
//! An offer binds a type-2 memory window over one segment to one queue
//! pair: only that QP's peer can use the rkey, only inside the segment, and
//! only with the rights given. The offer holds the segment, so the program
//! cannot touch what the peer may write. Revoking (or dropping) the offer
//! deallocates the window; afterwards the peer's accesses fail.
//!
//! On a device without memory windows, the segment alone is registered
//! with the rights given (any QP of the protection domain could then use
//! the rkey), and revoking deregisters it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::error::{Error, Result};
use super::op::Op;
use super::qp::{Connected, Qp, Rts};
use super::region::{sealed, Local, RawHold, TOKEN};
use crate::verbs::{AccessFlags, MemoryWindow, QueuePair, RemoteRegion, Sge};

/// The rights an offer can give.
const REMOTE: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

/// What gives the peer its access.
enum Grant {
    /// A type-2 window bound to one queue pair (held for its drop).
    Window { _mw: MemoryWindow },
    /// A registration of the offered bytes alone (devices without windows).
    Registration { _mr: crate::verbs::MemoryRegion },
}

/// Memory lent to a peer: [`Offer::remote`] is what the peer needs.
pub struct Offer<S> {
    // Field order: the grant goes before the QP (a QP destroyed under a
    // bound window stalls the rxe driver), and before the memory it exposes.
    grant: Grant,
    _qp: QueuePair,
    mem: S,
    remote: RemoteRegion,
}

impl<S> std::fmt::Debug for Offer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offer")
            .field("remote", &self.remote)
            .finish()
    }
}

impl<S: Local> Offer<S> {
    /// The remote address, length and rkey, to tell the peer.
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// Ends the peer's access and gives the memory back.
    pub fn revoke(self) -> S {
        let Offer {
            grant, _qp, mem, ..
        } = self;
        drop(grant);
        mem
    }

    /// Whether the peer's access goes through a memory window (else through
    /// a registration of its own).
    pub fn is_window(&self) -> bool {
        matches!(self.grant, Grant::Window { .. })
    }
}

/// The memory and window of an offer while the bind is in flight.
pub struct Binding<S> {
    window: MemoryWindow,
    qp: QueuePair,
    mem: S,
    remote: RemoteRegion,
}

impl<S: Local> sealed::Sealed for Binding<S> {}

impl<S: Local> Local for Binding<S> {
    fn sge(&self, _: sealed::Token) -> Option<Sge> {
        None
    }
    fn park(self, into: &mut Vec<RawHold>, token: sealed::Token) {
        into.push(RawHold::keep((self.window, self.qp)));
        self.mem.park(into, token);
    }
    fn offer_parts(
        &self,
        _: sealed::Token,
    ) -> Option<(
        &crate::verbs::MemoryRegion,
        std::ops::Range<usize>,
        AccessFlags,
    )> {
        None
    }
}

/// An offer being made: resolves to the [`Offer`] once the device has bound
/// the window (at once for a registration).
#[must_use = "the offer is made only when this is awaited"]
pub struct OfferOp<S: Local>(Making<S>);

enum Making<S: Local> {
    Binding(Op<Binding<S>>),
    Ready(Option<Offer<S>>),
}

impl<S: Local + Unpin> Future for OfferOp<S> {
    type Output = Result<Offer<S>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Making::Ready(offer) => Poll::Ready(
                offer
                    .take()
                    .ok_or_else(|| Error::invalid("offer polled after it resolved")),
            ),
            Making::Binding(op) => Pin::new(op).poll(cx).map(|r| {
                r.map(|done| {
                    let b = done.into_memory();
                    Offer {
                        grant: Grant::Window { _mw: b.window },
                        _qp: b.qp,
                        mem: b.mem,
                        remote: b.remote,
                    }
                })
            }),
        }
    }
}

impl<T: Connected> Qp<T, Rts> {
    /// Lends `mem` to this queue pair's peer with `access` (REMOTE_READ,
    /// REMOTE_WRITE, REMOTE_ATOMIC; no more than the region allows, and only
    /// REMOTE_READ for a read-only segment).
    ///
    /// Through a memory window bound to this queue pair; on a device
    /// without memory windows, as [`Qp::offer_registered`].
    pub fn offer<S: Local>(&self, mem: S, access: AccessFlags) -> Result<OfferOp<S>> {
        let (mr, bytes, _) = check_offer(&mem, access)?;
        let window = match mr.pd().alloc_mw() {
            Ok(w) => w,
            Err(e) => {
                log::debug!("no memory window ({e}): offering by registration");
                return self.offer_registered(mem, access);
            }
        };
        let send = &self.core.send;
        let ticket = send.open(self.core.qp.qp_num(), 1)?;
        // SAFETY: the window, the QP and the memory move into the returned
        // Op (parked with the CQ if it is dropped) until the bind completes,
        // then into the Offer, which deallocates the window before releasing
        // them.
        let remote = unsafe {
            self.core.qp.post_bind(
                ticket.wr_id(true),
                &window,
                mr,
                bytes.start,
                bytes.len(),
                access,
            )
        };
        match remote {
            Ok(remote) => Ok(OfferOp(Making::Binding(Op::new(
                send.clone(),
                ticket,
                Binding {
                    window,
                    qp: self.core.qp.clone(),
                    mem,
                    remote,
                },
            )))),
            Err(e) => {
                send.abandon(ticket);
                Err(e.into())
            }
        }
    }

    /// Lends `mem` by registering the offered bytes alone with `access`;
    /// revoking deregisters them. For devices without memory windows: the
    /// rkey is not tied to this queue pair (any QP of the protection domain
    /// could use it), only to these bytes and rights.
    pub fn offer_registered<S: Local>(&self, mem: S, access: AccessFlags) -> Result<OfferOp<S>> {
        let (mr, bytes, _) = check_offer(&mem, access)?;
        let addr = mr.addr() as usize + bytes.start;
        // SAFETY: the bytes lie in the region, which `mem` keeps alive; the
        // Offer drops this registration before it lets go of `mem`.
        let reg = unsafe {
            mr.pd().register_raw(
                addr as *mut u8,
                bytes.len(),
                access | AccessFlags::LOCAL_WRITE,
            )?
        };
        let remote = RemoteRegion {
            addr: addr as u64,
            len: bytes.len() as u64,
            rkey: reg.rkey(),
        };
        Ok(OfferOp(Making::Ready(Some(Offer {
            grant: Grant::Registration { _mr: reg },
            _qp: self.core.qp.clone(),
            mem,
            remote,
        }))))
    }
}

/// The region, bytes and rights of an offer of `mem`, checked.
fn check_offer<S: Local>(
    mem: &S,
    access: AccessFlags,
) -> Result<(
    &crate::verbs::MemoryRegion,
    std::ops::Range<usize>,
    AccessFlags,
)> {
    let (mr, bytes, most) = mem
        .offer_parts(TOKEN)
        .ok_or_else(|| Error::invalid("there is no memory to offer"))?;
    if access.is_empty() || !REMOTE.contains(access) {
        return Err(Error::invalid(format!(
            "{access:?}: an offer gives remote read, write or atomic rights"
        )));
    }
    if !most.contains(access) {
        return Err(Error::invalid(format!(
            "{access:?} asked, but this segment may be offered with {most:?} at most"
        )));
    }
    Ok((mr, bytes, most))
}
