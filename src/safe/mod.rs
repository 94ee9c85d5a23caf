//! The safe RDMA API: no `unsafe` in the program.
//!
//! - **Typed memory.** [`ProtectionDomain::allocate`] and
//!   [`ProtectionDomain::register`] give a [`MemoryRegion<T>`] of
//!   plain-old-data `T` ([`bytemuck::Pod`]).
//! - **Segments.** [`MemoryRegion::ro`] and [`MemoryRegion::rw`] lend out
//!   parts of a region: read-only ones may overlap, a read-write one
//!   overlaps nothing, a conflict is an `Err` naming both ranges.
//! - **Operations are futures.** Posting takes the segments by value; the
//!   [`Op`] resolves to a [`Completion`] that gives them back, or to an
//!   `Err` with the failed status. Dropping a pending `Op` is safe: its
//!   memory stays parked with the completion queue until the device is done.
//!   The futures run under any executor; see [`Progress`] for who reaps the
//!   completions.
//! - **Queue pairs whose state is a type.** `Qp<Rc | Uc | Ud, Init | Rtr |
//!   Rts>`: `send` exists only in RTS, `recv` from RTR on.
//! - **Remote memory with bounds.** A [`RemoteRegion`] carries its length;
//!   an access outside it is refused before posting. Memory is lent to a
//!   peer only through an [`Offer`] (a memory window bound to one queue
//!   pair), which can be revoked.
//! - **Batches.** [`Qp::batch`] posts many requests with one doorbell, all
//!   but the last unsignaled, holding every segment until the last completes.
//!
//! The `unsafe` [`crate::verbs`] layer stays available as the escape hatch
//! (`verbs()` on every handle; `unsafe` on a completion queue, as a
//! completion polled there never reaches its future).

mod cm;
mod cq;
mod error;
mod offer;
mod op;
mod post;
mod qp;
mod region;
mod segments;
mod slots;
mod srq;
mod ud;

pub use cm::{connect, CmQp, Listener};
pub use cq::{CompletionQueue, CqFd, CqStats, Progress};
pub use error::{Error, Result};
pub use offer::{Offer, OfferOp};
pub use op::{block_on, BatchOp, Completion, Op};
pub use post::Batch;
pub use qp::{CanRecv, Connected, Init, Qp, QpBuilder, Rc, Rtr, Rts, State, Transport, Uc, Ud};
pub use region::{
    AtomicTarget, Local, MemoryRegion, NoBuffer, ProtectionDomain, RoSegment, RwSegment,
    WeakRegion, Writable,
};
pub use segments::SegmentError;
pub use srq::SharedReceiveQueue;
pub use ud::{UdPeer, GRH_LEN};

pub use crate::verbs::{AccessFlags, QpInfo, RemoteRegion, WcStatus};
pub use bytemuck::Pod;

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn handles_and_futures_are_send_sync_static() {
        send_sync::<ProtectionDomain>();
        send_sync::<CompletionQueue>();
        send_sync::<MemoryRegion<u64>>();
        send_sync::<RwSegment<u8>>();
        send_sync::<Qp<Rc, Rts>>();
        send_sync::<Op<RwSegment<u8>>>();
        send_sync::<BatchOp>();
        send_sync::<Offer<RwSegment<u8>>>();
    }
}
