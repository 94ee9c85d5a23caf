//! A safe layer over the RDMA verbs (libibverbs and librdmacm through
//! `rdma-sys`).
//!
//! Every raw object is owned by a Rust value that releases it on drop, and
//! children hold their parents (`Arc` chains, after rust-ibverbs): a memory
//! region holds its protection domain, a QP its PD, CQs and CM id, a CQ its
//! context and completion channel. Dropping handles in any order is therefore
//! safe; the verbs objects are destroyed children first.
//!
//! All handles are `Send + Sync` and cheap to clone. What stays `unsafe` is
//! posting work: the device reads and writes the posted memory after the call
//! returns, and only the caller knows when it stops (see
//! [`QueuePair::post_send`]).
//!
//! Errors name the verb that failed with its errno, or the completion status
//! a work request ended with; every wait takes a timeout.

mod cm;
mod cq;
mod device;
mod error;
mod mr;
mod mw;
mod pd;
mod qp;
pub mod selftest;
mod wr;

pub use cm::{
    CmEvent, CmEventKind, CmId, CmIdRef, ConnParam, EventChannel, MAX_ACCEPT_PRIVATE_DATA,
    MAX_CONNECT_PRIVATE_DATA,
};
pub use cq::{Completion, CompletionChannel, CompletionQueue, CompletionRoom, WcOpcode, WcStatus};
pub use device::{
    devices, Context, DeviceAttr, DeviceInfo, Gid, GidEntry, GidKind, LinkLayer, Mtu, PortAttr,
    PortState, DEVICE_ENV, GID_INDEX_ENV,
};
pub use error::{Error, Result};
pub use mr::{AccessFlags, MemoryRegion, RemoteAddr, RemoteRegion, Sge, REMOTE_REGION_WIRE_LEN};
pub use mw::MemoryWindow;
pub use pd::ProtectionDomain;
pub(crate) use qp::{init_attr, random_psn};
pub use qp::{PreparedQp, QpCaps, QpInfo, QpOptions, QpState, QueuePair, QP_INFO_WIRE_LEN};
pub use wr::{SendOp, SendRequest};
