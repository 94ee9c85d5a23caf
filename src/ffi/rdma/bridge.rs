//! The bridge from the runtime's connection events to the C struct and its
//! callbacks.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::ptr::{addr_of, addr_of_mut};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::ffi::table::CMemory;
use crate::runtime::{ConnHandler, ConnKind, ConnState, Connection, Options, WeakConnection};
use crate::verbs::RemoteRegion;

use super::globals::copy_options;
use super::handles::*;
use super::types::*;

/// Room for the peer's address as text, NUL included (`INET6_ADDRSTRLEN`
/// is 46).
const IP_TEXT: usize = 64;

/// The memory behind an `RdmaConn` handle: the struct C sees, first, so the
/// handle points at it, and the text its `ip` points at. One allocation, so
/// the text lives as long as the struct: a program that kept the pointer
/// may read `conn->ip` after the connection ended, for as long as the
/// handle table's quarantine keeps the struct.
#[repr(C)]
pub(super) struct ConnMemory {
    conn: RdmaConn,
    ip: [c_char; IP_TEXT],
}

/// The library's side of one `RdmaConn`: the struct itself (stable address,
/// freed when the last holder, the handle table's quarantine included, lets
/// go) and the runtime connection.
pub(super) struct FfiConn {
    pub(super) raw: Arc<CMemory<ConnMemory>>,
    pub(super) imm_callback: Mutex<RdmaRecvImmCallbackFunc>,
    /// The connection the handle is bound to: set when it is bound, and
    /// cleared when a client's attempt that got as far as binding fails
    /// after all (a retry binds its own). Read by every C call on the
    /// handle (an uncontended read lock); written, with the struct's
    /// fields, under its write lock, so a call that finds it bound finds
    /// the fields written.
    conn: RwLock<Option<WeakConnection>>,
    pub(super) opts: Options,
    /// Held while `state` is read from the connection and written here.
    state_mirror: Mutex<()>,
}

impl FfiConn {
    pub(super) fn new(opts: Options, c_opts: *const RdmaOptions, kind: ConnKind) -> Arc<FfiConn> {
        // SAFETY: all-zero is a valid RdmaConn (NULL pointers, zero ints,
        // NONE enums, None callbacks, zeroed pthread objects) and an empty
        // string.
        let raw: Arc<CMemory<ConnMemory>> = CMemory::new(unsafe { std::mem::zeroed() });
        let p = raw.get().cast::<RdmaConn>();
        // SAFETY: p is ours; c_opts is NULL or a valid options struct.
        unsafe {
            libc::pthread_cond_init(addr_of_mut!((*p).status_cond), std::ptr::null());
            libc::pthread_mutex_init(addr_of_mut!((*p).status_mutex), std::ptr::null());
            (*p).r#type = kind;
            (*p).max_inline_data = opts.max_inline_data;
            if !c_opts.is_null() {
                let o = copy_options(c_opts);
                (*p).recv_callback = o.recv_callback;
                (*p).write_callback = o.write_callback;
                (*p).read_callback = o.read_callback;
                (*p).connected_callback = o.connected_callback;
                (*p).disconnect_callback = o.disconnect_callback;
                (*p).options = o;
            }
        }
        Arc::new(FfiConn {
            raw,
            imm_callback: Mutex::new(None),
            conn: RwLock::new(None),
            opts,
            state_mirror: Mutex::new(()),
        })
    }

    pub(super) fn ptr(&self) -> *mut RdmaConn {
        // The struct is the memory's first field (`repr(C)`).
        self.raw.get().cast()
    }

    /// Whether C set a write callback on this connection.
    pub(super) fn wants_write_done(&self) -> bool {
        // SAFETY: a plain field of our own struct, which C may set.
        unsafe { std::ptr::read_volatile(addr_of!((*self.ptr()).write_callback)) }.is_some()
    }

    pub(super) fn connection(&self) -> Option<Connection> {
        self.bound().as_ref().and_then(WeakConnection::upgrade)
    }

    fn bound(&self) -> std::sync::RwLockReadGuard<'_, Option<WeakConnection>> {
        self.conn.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets go of a client attempt that failed (`rdmaConnect` returning an
    /// error), however far it got, so the handle may try again; unless the
    /// handle is bound to a connection that lives on, which another
    /// thread's `rdmaConnect` made meanwhile: that one keeps it. Returns
    /// whether the handle is free.
    pub(super) fn unbind_ended(&self) -> bool {
        let mut slot = self.conn.write().unwrap_or_else(PoisonError::into_inner);
        let live = slot
            .as_ref()
            .and_then(WeakConnection::upgrade)
            .is_some_and(|c| !matches!(c.state(), ConnState::Error | ConnState::Closed));
        if !live {
            *slot = None;
        }
        !live
    }

    /// Binds the handle to `conn` and fills the struct's fields from it.
    /// Called from several threads (the completion thread's report,
    /// `rdmaConnect` returning): whichever comes second, and every call
    /// on the handle, waits for the fields the first writes. A connection
    /// already ended (a failed attempt's late report) is not bound.
    pub(super) fn bind(&self, conn: &Connection) {
        let mut slot = self.conn.write().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() || matches!(conn.state(), ConnState::Error | ConnState::Closed) {
            return;
        }
        let p = self.ptr();
        let ring = conn.recv_ring();
        let staging = conn.staging();
        let peer = conn.peer_addr();
        let ip = peer.map(|a| a.ip().to_string());
        // SAFETY: p is ours; the pointers stored live as long as the connection.
        unsafe {
            let id = conn.cm_id().expect("C API connections use RDMA CM");
            (*p).cm_id = id.as_raw();
            (*p).cm_channel = (*id.as_raw()).channel;
            (*p).pd = conn.pd().as_raw();
            (*p).cq = conn.recv_cq().as_raw();
            (*p).comp_channel = (*conn.recv_cq().as_raw()).channel;
            (*p).recv_buf = ring.addr() as *mut c_char;
            (*p).recv_length = ring.len() as c_uint;
            (*p).recv_mr = ring.as_raw();
            (*p).send_buf = staging.addr() as *mut c_char;
            (*p).send_length = staging.len() as u32;
            (*p).send_mr = staging.as_raw();
            (*p).cmd_buf = conn.cmd_buffers().addr() as *mut RdmaCmd;
            (*p).cmd_mr = conn.cmd_buffers().as_raw();
            (*p).port = peer.map_or(0, |a| c_int::from(a.port()));
            (*p).ip = match ip {
                Some(text) => {
                    let room = addr_of_mut!((*self.raw.get()).ip).cast::<c_char>();
                    // An address's text is at most 45 bytes: it always fits.
                    let len = text.len().min(IP_TEXT - 1);
                    std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), room, len);
                    *room.add(len) = 0;
                    room
                }
                None => std::ptr::null_mut(),
            };
        }
        *slot = Some(conn.downgrade());
    }

    /// Writes the connection's state (and errno, on an error) into the
    /// struct.
    pub(super) fn mirror_state(&self, conn: &Connection) {
        // Reports come from several threads (the CM thread's CONNECTED can
        // come after the completion thread's MR_READY): the struct gets the
        // state as it is now, read and written under one lock, so a late
        // report cannot put an older state back.
        let _mirror = self
            .state_mirror
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let state = conn.state();
        // SAFETY: a plain field of our own struct.
        unsafe {
            std::ptr::write_volatile(addr_of_mut!((*self.ptr()).state), state);
            if state == ConnState::Error {
                std::ptr::write_volatile(addr_of_mut!((*self.ptr()).last_errno), conn.last_errno());
            }
        }
    }
}

impl ConnHandler for FfiConn {
    fn connected(&self, conn: &Connection) {
        self.bind(conn);
        // Closed by the program while it connected: `rdmaConnect` closes
        // it, and the program hears no more of a handle it let go of. Or
        // another thread's `rdmaConnect` bound the handle first: this one
        // is closed, not the handle's.
        if CONNS.get(self.ptr()).is_none() || self.connection().is_some_and(|c| &c != conn) {
            return;
        }
        // SAFETY: the callback field is read from our own struct.
        if let Some(cb) =
            unsafe { std::ptr::read_volatile(addr_of!((*self.ptr()).connected_callback)) }
        {
            guard_callback("connected_callback", || unsafe { cb(self.ptr().cast()) });
        }
    }

    fn recv(&self, _conn: &Connection, data: &[u8], imm: Option<u32>) {
        let p = self.ptr();
        let ptr = data.as_ptr() as *mut c_void;
        if let Some(imm) = imm {
            // Copied out: the lock is not held while the callback runs (it
            // may set this very callback).
            let imm_cb = *self.imm_callback.lock().expect("ffi lock");
            if let Some(cb) = imm_cb {
                return guard_callback("recv_imm_callback", || unsafe {
                    cb(p.cast(), imm, ptr, data.len())
                });
            }
        }
        // SAFETY: as above.
        if let Some(cb) = unsafe { std::ptr::read_volatile(addr_of!((*p).recv_callback)) } {
            guard_callback("recv_callback", || unsafe { cb(p.cast(), ptr, data.len()) });
        }
    }

    fn write_done(&self, _conn: &Connection, len: usize) {
        // SAFETY: as above.
        if let Some(cb) = unsafe { std::ptr::read_volatile(addr_of!((*self.ptr()).write_callback)) }
        {
            guard_callback("write_callback", || unsafe { cb(self.ptr().cast(), len) });
        }
    }

    fn read_done(&self, _conn: &Connection, len: usize) {
        // SAFETY: as above.
        if let Some(cb) = unsafe { std::ptr::read_volatile(addr_of!((*self.ptr()).read_callback)) }
        {
            guard_callback("read_callback", || unsafe { cb(self.ptr().cast(), len) });
        }
    }

    fn disconnected(&self, _conn: &Connection) {
        // SAFETY: as above.
        if let Some(cb) =
            unsafe { std::ptr::read_volatile(addr_of!((*self.ptr()).disconnect_callback)) }
        {
            guard_callback("disconnect_callback", || unsafe { cb(self.ptr().cast()) });
        }
    }

    fn state_changed(&self, conn: &Connection, state: ConnState) {
        // A client's attempt is bound only once it has succeeded (and
        // unbound if it fails after all): a program may retry a failed
        // `rdmaConnect` on the same handle (its server was not up yet).
        if conn.kind() == ConnKind::AcceptedConn || state == ConnState::MrReady {
            self.bind(conn);
        }
        // A failed attempt's late reports (its teardown) do not overwrite
        // the state of the one that succeeded.
        if self.bound().as_ref().is_some_and(|bound| !bound.is(conn)) {
            return;
        }
        self.mirror_state(conn);
    }

    fn peer_buffer(&self, _conn: &Connection, buf: RemoteRegion) {
        let p = self.ptr();
        // SAFETY: plain fields of our own struct.
        unsafe {
            (*p).tx_addr = buf.addr as *mut c_char;
            (*p).tx_length = buf.len as u32;
            (*p).tx_key = buf.rkey;
            (*p).tx_offset = 0;
        }
    }

    fn retired(&self, _conn: &Connection) {
        CONNS.remove(self.ptr());
    }
}

/// A C callback must not unwind into Rust either; a Rust panic inside the
/// guard (none expected) is logged.
pub(super) fn guard_callback(name: &'static str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        log::error!("{name}: the callback panicked (caught at the C boundary)");
    }
}
