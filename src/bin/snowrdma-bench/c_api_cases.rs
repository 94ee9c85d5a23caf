//! The cases through the public C API: sync one-sided operations, echoes
//! (against our server and against a legacy-protocol peer), streaming.

use std::ffi::{c_void, CString};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use snowrdma::ffi::rdma::*;
use snowrdma::runtime::legacy_peer::LegacyPeer;

use super::cost::Window;
use super::{device_addr, median, timed_stream, us};

static RECEIVED: AtomicU64 = AtomicU64::new(0);
static RECEIVED_BYTES: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn echo_back(conn: *mut RdmaConnFwd, data: *mut c_void, len: usize) {
    rdmaConnSend(conn.cast(), data, len);
}

unsafe extern "C" fn count(_conn: *mut RdmaConnFwd, _data: *mut c_void, len: usize) {
    RECEIVED.fetch_add(1, Ordering::Release);
    RECEIVED_BYTES.fetch_add(len as u64, Ordering::Release);
}

/// An in-process server and a connected client through the public C API.
struct CPair {
    listener: *mut RdmaListener,
    conn: *mut RdmaConn,
    server: Option<std::thread::JoinHandle<()>>,
}

impl CPair {
    fn new(
        port: u16,
        server_recv: RdmaRecvCallbackFunc,
        client_recv: RdmaRecvCallbackFunc,
    ) -> CPair {
        let ip = CString::new(device_ip().to_string()).unwrap();
        // SAFETY: zeroed options are the C programs' `{0}`.
        unsafe {
            rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
            let mut opt: RdmaServerOptions = std::mem::zeroed();
            opt.recv_callback = server_recv;
            let mut listener = std::ptr::null_mut();
            assert_eq!(
                rdmaServer(&mut listener, ip.as_ptr(), port as i32, &opt),
                RDMA_OK
            );
            let l = listener as usize;
            let server = std::thread::spawn(move || {
                rdmaServerStart(l as *mut RdmaListener);
            });
            let mut copt: RdmaConnOptions = std::mem::zeroed();
            copt.recv_callback = client_recv;
            let conn = rdmaConn(&copt);
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(
                rdmaConnect(conn, ip.as_ptr() as *mut _, port as i32),
                RDMA_OK
            );
            CPair {
                listener,
                conn,
                server: Some(server),
            }
        }
    }
}

impl Drop for CPair {
    fn drop(&mut self) {
        // SAFETY: handles from CPair::new.
        unsafe {
            rdmaConnClose(self.conn);
            rdmaServerStop(self.listener);
            if let Some(t) = self.server.take() {
                let _ = t.join();
            }
            rdmaServerRelease(self.listener);
        }
    }
}

/// Post-to-completion latency of one synchronous READ (or WRITE) of the
/// ring of a sink another process runs on the device at `port`.
pub(crate) fn sync_lat(read: bool, iters: usize, size: usize, port: u16) -> f64 {
    // SAFETY: the connection is live until closed below.
    let conn = unsafe {
        rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
        connect_remote(port, Some(count))
    };
    // SAFETY: the connection is live; the MR is ours.
    unsafe {
        let mr = rdmaConnRegMem(conn, size.max(64));
        let (local, lkey) = ((*mr).addr as u64, (*mr).lkey);
        let (remote, rkey) = ((*conn).tx_addr as u64, (*conn).tx_key);
        let mut lat = Vec::with_capacity(iters);
        let op = || {
            let r = if read {
                rdmaSyncReadSignaled(conn, local, lkey, remote, rkey, size as u32)
            } else {
                rdmaSyncWriteSignaled(conn, local, lkey, remote, rkey, size as u32)
            };
            assert_eq!(r, size as i32);
        };
        for _ in 0..iters / 10 {
            op();
        }
        let window = Window::open();
        for _ in 0..iters {
            let t = Instant::now();
            op();
            lat.push(us(t.elapsed()));
        }
        window.close(iters);
        rdmaConnDeregMem(conn, mr);
        rdmaConnClose(conn);
        median(&mut lat)
    }
}

pub(crate) fn echo_lat(iters: usize, size: usize, port: u16) -> f64 {
    let p = CPair::new(port, Some(echo_back), Some(echo_returned));
    // SAFETY: the pair keeps the connection live.
    unsafe { ping_pong(p.conn, iters, size) }
}

/// A ping-pong driven from the client's receive callback: each echo that
/// returns sends the next message, as perftest's single thread does, so
/// each end has one busy thread (its completion thread), not also a caller
/// spinning beside it for a flag.
struct PingPong {
    conn: usize,
    msg: Vec<u8>,
    /// Round trips before the window opens, then in it.
    warm_up: usize,
    left: usize,
    sent_at: Instant,
    /// Half round trips, in microseconds (room reserved: nothing is
    /// allocated in the window).
    lat: Vec<f64>,
    window: Option<Window>,
    done: bool,
    /// What `rdmaConnSend` returned when it did not take a message (a
    /// panic cannot leave a C callback: it would abort the process).
    failed: Option<usize>,
}

static PING_PONG: Mutex<Option<PingPong>> = Mutex::new(None);
static PING_PONG_DONE: Condvar = Condvar::new();

/// The client's receive callback of a ping-pong (completion thread): takes
/// the time of the echo and sends the next message, opening the cost
/// window after the warm-up and closing it after the last echo.
unsafe extern "C" fn echo_returned(_conn: *mut RdmaConnFwd, _data: *mut c_void, _len: usize) {
    let mut guard = PING_PONG.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(pp) = guard.as_mut() else { return };
    if pp.warm_up > 0 {
        pp.warm_up -= 1;
        if pp.warm_up == 0 {
            pp.window = Some(Window::open());
        }
    } else {
        pp.lat.push(us(pp.sent_at.elapsed()) / 2.0);
        pp.left -= 1;
        if pp.left == 0 {
            if let Some(window) = pp.window.take() {
                window.close(pp.lat.len());
            }
            pp.done = true;
            PING_PONG_DONE.notify_all();
            return;
        }
    }
    let (conn, msg, len) = (pp.conn as *mut RdmaConn, pp.msg.as_ptr(), pp.msg.len());
    pp.sent_at = Instant::now();
    drop(guard);
    // SAFETY: the connection is live until the ping-pong is done; the
    // message is not freed before then (nor moved: it is a Vec's buffer).
    let sent = rdmaConnSend(conn, msg as *mut _, len);
    if sent != len {
        let mut guard = PING_PONG.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pp) = guard.as_mut() {
            pp.failed = Some(sent);
            pp.done = true;
        }
        PING_PONG_DONE.notify_all();
    }
}

/// Median half round trip of `iters` messages of `size` bytes that a
/// server echoes back to `conn` (whose receive callback is
/// `echo_returned`), after `iters / 10` to warm up.
///
/// # Safety
/// `conn` must be a live connection.
unsafe fn ping_pong(conn: *mut RdmaConn, iters: usize, size: usize) -> f64 {
    let iters = iters.max(1);
    let msg = vec![7u8; size];
    let first = msg.as_ptr();
    *PING_PONG.lock().unwrap_or_else(PoisonError::into_inner) = Some(PingPong {
        conn: conn as usize,
        msg,
        warm_up: (iters / 10).max(1),
        left: iters,
        sent_at: Instant::now(),
        lat: Vec::with_capacity(iters),
        window: None,
        done: false,
        failed: None,
    });
    assert_eq!(rdmaConnSend(conn, first as *mut _, size), size);
    // An echo is lost when none comes for 10 s, however long the run.
    let progress = |pp: &PingPong| (pp.warm_up, pp.left);
    let mut guard = PING_PONG.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        let before = guard.as_ref().map(progress);
        let (g, waited) = PING_PONG_DONE
            .wait_timeout_while(guard, Duration::from_secs(10), |pp| {
                pp.as_ref()
                    .is_some_and(|p| !p.done && Some(progress(p)) == before)
            })
            .unwrap_or_else(PoisonError::into_inner);
        guard = g;
        assert!(!waited.timed_out(), "an echo was lost");
        if guard.as_ref().is_none_or(|p| p.done) {
            break;
        }
    }
    let pp = guard.take().expect("the ping-pong's state");
    assert_eq!(pp.failed, None, "rdmaConnSend did not take a message");
    let mut lat = pp.lat;
    median(&mut lat)
}

/// A client connection, whose receive callback is `recv`, to a server
/// another process runs on the device at `port`.
///
/// # Safety
/// The caller closes the connection.
unsafe fn connect_remote(port: u16, recv: RdmaRecvCallbackFunc) -> *mut RdmaConn {
    let ip = CString::new(device_ip().to_string()).unwrap();
    // SAFETY: zeroed options are the C programs' `{0}`.
    let mut copt: RdmaConnOptions = std::mem::zeroed();
    copt.recv_callback = recv;
    let conn = rdmaConn(&copt);
    assert_eq!(
        rdmaConnect(conn, ip.as_ptr() as *mut _, port as i32),
        RDMA_OK
    );
    conn
}

/// As [`echo_lat`], against an echo server another process runs on the
/// device at `port`.
pub(crate) fn echo_remote_lat(iters: usize, size: usize, port: u16) -> f64 {
    // SAFETY: the connection is live until closed below.
    unsafe {
        let conn = connect_remote(port, Some(echo_returned));
        let half_rtt = ping_pong(conn, iters, size);
        rdmaConnClose(conn);
        half_rtt
    }
}

/// Accepts one client on `port` as a legacy-protocol peer and echoes what
/// it sends until it leaves (or two minutes pass), polling while it waits,
/// as the echo_server it is compared with does.
pub(crate) fn serve_legacy_peer(port: u16) -> snowrdma::runtime::Result<()> {
    let addr = SocketAddr::new(device_ip(), port);
    let mut peer = LegacyPeer::accept(addr, Duration::from_secs(30), |a| {
        println!("listening on {a}")
    })?;
    peer.spin_while_waiting();
    peer.echo(Instant::now() + Duration::from_secs(120))?;
    Ok(())
}

fn device_ip() -> IpAddr {
    device_addr(0).ip()
}

/// Streams `iters` messages of `size` bytes to a server that only counts;
/// returns (MiB/s, Mpps) from the first send until the last byte arrived.
pub(crate) fn stream(iters: usize, size: usize, port: u16) -> (f64, f64) {
    unsafe extern "C" fn sink(_c: *mut RdmaConnFwd, _d: *mut c_void, len: usize) {
        RECEIVED.fetch_add(1, Ordering::Release);
        RECEIVED_BYTES.fetch_add(len as u64, Ordering::Release);
    }
    let p = CPair::new(port, Some(sink), Some(count));
    let msg = vec![1u8; size];
    let send_all = |n: usize| {
        RECEIVED.store(0, Ordering::Release);
        let mut sent = 0;
        while sent < n {
            // SAFETY: live connection, readable message.
            match unsafe { rdmaConnSend(p.conn, msg.as_ptr() as *mut _, size) } {
                0 => std::hint::spin_loop(),
                m if m == size => sent += 1,
                m => panic!("rdmaConnSend returned {m}"),
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while RECEIVED.load(Ordering::Acquire) < n as u64 {
            assert!(Instant::now() < deadline, "messages were lost");
            std::hint::spin_loop();
        }
    };
    timed_stream(iters, size, send_all)
}

/// The 1-byte message that ends a stream: the sink echoes it back.
const END_OF_STREAM: u8 = 0xee;

unsafe extern "C" fn sink_or_echo_end(conn: *mut RdmaConnFwd, data: *mut c_void, len: usize) {
    if len == 1 {
        rdmaConnSend(conn.cast(), data, len);
    }
}

/// Serves streams on `port` until killed: takes every message, and echoes
/// each 1-byte one (the end of a stream) so the sender learns that all
/// before it arrived.
pub(crate) fn serve_sink(port: u16) -> Result<(), String> {
    let ip = CString::new(device_ip().to_string()).unwrap();
    // SAFETY: zeroed options are the C programs' `{0}`; the listener lives
    // until the process is killed.
    unsafe {
        rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
        let mut opt: RdmaServerOptions = std::mem::zeroed();
        opt.recv_callback = Some(sink_or_echo_end);
        let mut listener = std::ptr::null_mut();
        if rdmaServer(&mut listener, ip.as_ptr(), port as i32, &opt) != RDMA_OK {
            return Err(format!("cannot listen on port {port}"));
        }
        println!("listening on {port}");
        rdmaServerStart(listener);
    }
    Ok(())
}

/// As [`stream`], to a sink another process runs on the device at `port`:
/// the clock stops when the sink has echoed the 1-byte message sent after
/// the stream.
pub(crate) fn stream_remote(iters: usize, size: usize, port: u16) -> (f64, f64) {
    // SAFETY: the connection is live until closed below.
    unsafe {
        rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
        let conn = connect_remote(port, Some(count));
        let msg = vec![1u8; size];
        let end = [END_OF_STREAM];
        let send_all = |n: usize| {
            let before = RECEIVED.load(Ordering::Acquire);
            let mut sent = 0;
            while sent < n {
                match rdmaConnSend(conn, msg.as_ptr() as *mut _, size) {
                    0 => std::hint::spin_loop(),
                    m if m == size => sent += 1,
                    m => panic!("rdmaConnSend returned {m}"),
                }
            }
            while rdmaConnSend(conn, end.as_ptr() as *mut _, 1) != 1 {
                std::hint::spin_loop();
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            while RECEIVED.load(Ordering::Acquire) == before {
                assert!(Instant::now() < deadline, "the end of the stream was lost");
                std::hint::spin_loop();
            }
        };
        let rates = timed_stream(iters, size, send_all);
        rdmaConnClose(conn);
        rates
    }
}
