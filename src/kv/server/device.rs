//! Which RDMA device a server serves: its memory is registered with one
//! device's context, and every client must come through that context.

use std::net::SocketAddr;

use crate::kv::store::Store;
use crate::runtime;
use crate::verbs::{self, CmId, Context, EventChannel};

/// The device a wildcard listener will serve when the machine has just one:
/// RDMA CM's own context for it (the one accepted connections get), from an
/// id bound to the device's address. `None` when that is not clear.
pub(super) fn only_device(listen: SocketAddr) -> Option<Context> {
    if !listen.ip().is_unspecified() {
        return None;
    }
    let devices = verbs::devices().ok()?;
    let [only] = &devices[..] else {
        return None;
    };
    let ip = Context::open(Some(&only.name))
        .ok()?
        .ipv4_address(1)
        .ok()??;
    let channel = EventChannel::new().ok()?;
    let id = CmId::new(&channel).ok()?;
    id.bind(SocketAddr::new(ip.into(), 0)).ok()?;
    id.context()
}

/// The device a socket-mode listener makes its clients' QPs on: the one
/// the store is registered with once it is (a server started again gets
/// the same context, which its memory's registration belongs to), else
/// `name` (or the first device).
pub(super) fn socket_device(store: &Store, name: Option<&str>) -> runtime::Result<Context> {
    match store.device() {
        Some(dev) => Ok(dev.pd.context().clone()),
        None => Ok(Context::open(name)?),
    }
}
