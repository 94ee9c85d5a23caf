//! Building the full mesh: thread `t` of every server connects to thread
//! `t` of every other server, one RC queue pair per pair of servers. A
//! server connects to those listed before it and accepts those listed after
//! it, so each pair has exactly one queue pair whatever the start order;
//! refused attempts are retried until the init timeout.
//!
//! Each side tells the other, in a hello (RDMA CM private data, or the first
//! bytes on the TCP socket), who it is and where its data region is.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::peer::Peer;
use super::{BrokerError, ConnectMode, Result, Shared};
use crate::tcp::{connect_from, read_exact_by};
use crate::verbs::{
    CmEvent, CmEventKind, CmId, ConnParam, QpInfo, RemoteRegion, QP_INFO_WIRE_LEN,
    REMOTE_REGION_WIRE_LEN,
};

const HELLO_MAGIC: [u8; 4] = *b"SNBK";
const HELLO_LEN: usize = 4 + 2 + 2 + REMOTE_REGION_WIRE_LEN;
/// Between connection attempts to a peer that is not listening yet.
const RETRY: Duration = Duration::from_millis(20);
/// Most one socket handshake may take (a failed one is tried again).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// Who a peer says it is, and its data region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub server_id: u16,
    pub thread_id: u16,
    pub region: RemoteRegion,
}

impl Hello {
    pub(crate) fn to_bytes(self) -> [u8; HELLO_LEN] {
        let mut b = [0; HELLO_LEN];
        b[..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&self.server_id.to_be_bytes());
        b[6..8].copy_from_slice(&self.thread_id.to_be_bytes());
        b[8..].copy_from_slice(&self.region.to_bytes());
        b
    }

    /// Parses a hello (CM private data may carry trailing padding).
    pub(crate) fn parse(b: &[u8]) -> Option<Hello> {
        let b = b.get(..HELLO_LEN)?;
        if b[..4] != HELLO_MAGIC {
            return None;
        }
        let region = RemoteRegion::from_bytes(&b[8..]).ok()?;
        // Addresses in it are computed as `addr + offset`.
        region.addr.checked_add(region.len)?;
        Some(Hello {
            server_id: u16::from_be_bytes([b[4], b[5]]),
            thread_id: u16::from_be_bytes([b[6], b[7]]),
            region,
        })
    }
}

impl Shared {
    fn addr_of(&self, server: usize) -> SocketAddr {
        let mut a = self.config.hosts[server];
        a.set_port(a.port() + self.config.thread_id);
        a
    }

    fn my_hello(&self) -> Hello {
        Hello {
            server_id: self.config.server_id as u16,
            thread_id: self.config.thread_id,
            region: self.data_remote,
        }
    }

    /// Whether a hello, from a peer at `from`, is from one this side
    /// should accept now: a server not yet connected, at the address
    /// `hosts` gives it (each server connects from its own, [`Self::source`]),
    /// so that nobody elsewhere can take its place and write our data
    /// region.
    fn acceptable(&self, h: &Hello, from: Option<IpAddr>, peers: &[Option<Peer>]) -> bool {
        let s = h.server_id as usize;
        h.thread_id == self.config.thread_id
            && s > self.config.server_id
            && s < self.config.hosts.len()
            && from.is_some_and(|ip| self.listed_at(s, ip))
            && peers[s].is_none()
    }

    /// Whether `hosts` gives server `s` the address `ip`.
    fn listed_at(&self, s: usize, ip: IpAddr) -> bool {
        self.config.hosts[s].ip().to_canonical() == ip.to_canonical()
    }

    /// The address this server connects from: its own in `hosts`, any
    /// port (an IPv6 scope kept).
    fn source(&self) -> SocketAddr {
        let mut src = self.config.hosts[self.config.server_id];
        src.set_port(0);
        src
    }

    /// Whether a connection from `from` may be from a server this side
    /// accepts (one listed after it): anyone else is refused before it
    /// hears our hello or a queue pair is made for it. Which server it is
    /// [`Self::acceptable`] settles, from its hello.
    fn may_be_a_peer(&self, from: IpAddr) -> bool {
        (self.config.server_id + 1..self.config.hosts.len()).any(|s| self.listed_at(s, from))
    }

    /// Connects to every other server, until `deadline`.
    /// The peers, and in CM mode the listener, whose channel reports the
    /// accepted connections' events from then on.
    pub(crate) fn build_mesh(
        &self,
        deadline: Instant,
    ) -> Result<(Vec<Option<Peer>>, Option<CmId>)> {
        match self.config.mode {
            ConnectMode::Cm => self.mesh_cm(deadline).map(|(p, l)| (p, Some(l))),
            ConnectMode::Socket => self.mesh_socket(deadline).map(|p| (p, None)),
        }
    }

    fn missing(&self, peers: &[Option<Peer>]) -> Vec<usize> {
        (0..self.config.hosts.len())
            .filter(|&s| s != self.config.server_id && peers[s].is_none())
            .collect()
    }

    fn timed_out(&self, peers: &[Option<Peer>], heard: &Complaints) -> BrokerError {
        let missing = self.missing(peers);
        let why = heard.about(&missing);
        BrokerError::InitTimeout { missing, why }
    }

    fn mesh_cm(&self, deadline: Instant) -> Result<(Vec<Option<Peer>>, CmId)> {
        let me = self.config.server_id;
        let mut peers: Vec<Option<Peer>> = (0..self.config.hosts.len()).map(|_| None).collect();
        let listener = CmId::listen_on(self.addr_of(me), 64)?;
        // Accepted, waiting for ESTABLISHED.
        let mut accepting: Vec<(CmId, Peer)> = Vec::new();
        // Connecting, waiting for ESTABLISHED or a refusal.
        let mut connecting: Vec<(usize, CmId, Peer)> = Vec::new();
        let mut next_try = vec![Instant::now(); me];
        let mut complaints = Complaints::new(self.config.hosts.len());
        let param = |hello: Hello| ConnParam {
            private_data: hello.to_bytes().to_vec(),
            rnr_retry_count: 7,
            ..ConnParam::default()
        };
        while !self.missing(&peers).is_empty() {
            if Instant::now() >= deadline {
                return Err(self.timed_out(&peers, &complaints));
            }
            // Requests and ESTABLISHED events of accepted ids.
            while let Ok(mut ev) = listener.channel().get_event(Duration::ZERO) {
                if ev.kind == CmEventKind::CONNECT_REQUEST {
                    let Some(id) = ev.take_new_id() else { continue };
                    let from = id.peer_addr().map(|a| a.ip());
                    match Hello::parse(&ev.private_data) {
                        Some(h)
                            if self.acceptable(&h, from, &peers)
                                && !accepting
                                    .iter()
                                    .any(|(_, p)| p.server == h.server_id as usize) =>
                        {
                            // One request that cannot be taken (its QP, or
                            // the accept, failed) is refused; the peer tries
                            // again, and the others' setup goes on.
                            let accept = || -> Result<Peer> {
                                let peer = Peer::on_cm(self, &id, h)?;
                                id.accept(&param(self.my_hello()))?;
                                Ok(peer)
                            };
                            match accept() {
                                Ok(peer) => accepting.push((id, peer)),
                                Err(e) => {
                                    complaints.warn(
                                        h.server_id as usize,
                                        format!("accepting server {}: {e}", h.server_id),
                                    );
                                    let _ = id.reject(&[]);
                                }
                            }
                        }
                        other => {
                            let from =
                                from.map_or("an unknown address".into(), |ip| ip.to_string());
                            log::warn!("broker: refused a connect request from {from}");
                            if let Some(h) = other {
                                let s = h.server_id as usize;
                                complaints.note(
                                    s,
                                    format!(
                                        "refused a connect request from {from} claiming to be \
                                         server {s} (thread {})",
                                        h.thread_id
                                    ),
                                );
                            }
                            let _ = id.reject(&[]);
                        }
                    }
                } else if ev.kind == CmEventKind::ESTABLISHED {
                    if let Some(i) = accepting.iter().position(|(id, _)| id.id_ref() == ev.id) {
                        let (_, peer) = accepting.swap_remove(i);
                        let s = peer.server;
                        peers[s] = Some(peer);
                    }
                } else {
                    // A failed accept: the peer will try again.
                    accepting.retain(|(id, _)| id.id_ref() != ev.id);
                    forget_if_left(&mut peers, &ev, &mut complaints);
                }
            }
            // Peers we connected to report on channels of their own.
            for s in 0..me {
                let ev = match peers[s].as_ref().and_then(|p| p.cm_id.as_ref()) {
                    Some(id) => id.channel().get_event(Duration::ZERO),
                    None => continue,
                };
                if let Ok(ev) = ev {
                    forget_if_left(&mut peers, &ev, &mut complaints);
                }
            }
            // Our own attempts.
            let mut i = 0;
            while i < connecting.len() {
                match connecting[i].1.channel().get_event(Duration::ZERO) {
                    Ok(ev) if ev.kind == CmEventKind::ESTABLISHED => {
                        let (s, _, mut peer) = connecting.swap_remove(i);
                        match Hello::parse(&ev.private_data) {
                            Some(h)
                                if h.server_id as usize == s
                                    && h.thread_id == self.config.thread_id =>
                            {
                                peer.remote = h.region;
                                peers[s] = Some(peer);
                            }
                            // Dropped (the server hears us leave), and tried
                            // again: a server that keeps answering so is
                            // missing when the deadline comes.
                            _ => {
                                complaints.warn(s, format!("server {s} answered with a bad hello"));
                                next_try[s] = Instant::now() + RETRY;
                            }
                        }
                    }
                    Ok(ev) => {
                        let (s, ..) = connecting.swap_remove(i);
                        complaints.note(s, format!("server {s} answered {}", ev.kind));
                        next_try[s] = Instant::now() + RETRY;
                    }
                    Err(_) => i += 1,
                }
            }
            for s in 0..me {
                if peers[s].is_some()
                    || connecting.iter().any(|c| c.0 == s)
                    || Instant::now() < next_try[s]
                {
                    continue;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let src = self.source();
                match CmId::resolve(self.addr_of(s), Some(src), left.min(Duration::from_secs(2))) {
                    Ok(id) => {
                        let connect = || -> Result<Peer> {
                            let hello = Hello {
                                server_id: s as u16,
                                thread_id: self.config.thread_id,
                                region: RemoteRegion {
                                    addr: 0,
                                    len: 0,
                                    rkey: 0,
                                },
                            };
                            let peer = Peer::on_cm(self, &id, hello)?;
                            id.connect(&param(self.my_hello()))?;
                            Ok(peer)
                        };
                        match connect() {
                            Ok(peer) => connecting.push((s, id, peer)),
                            Err(e) => {
                                complaints.warn(s, format!("connecting to server {s}: {e}"));
                                next_try[s] = Instant::now() + RETRY;
                            }
                        }
                    }
                    Err(e) => {
                        log::debug!("broker: resolving server {s}: {e}");
                        complaints.note(s, format!("resolving server {s}: {e}"));
                        next_try[s] = Instant::now() + RETRY;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((peers, listener))
    }

    fn mesh_socket(&self, deadline: Instant) -> Result<Vec<Option<Peer>>> {
        let me = self.config.server_id;
        let mut peers: Vec<Option<Peer>> = (0..self.config.hosts.len()).map(|_| None).collect();
        let listener = TcpListener::bind(self.addr_of(me))?;
        listener.set_nonblocking(true)?;
        let mut complaints = Complaints::new(self.config.hosts.len());
        while !self.missing(&peers).is_empty() {
            if Instant::now() >= deadline {
                return Err(self.timed_out(&peers, &complaints));
            }
            // A peer that left while we still wait for others (its own
            // setup gave up) is forgotten, to be connected afresh.
            for slot in peers.iter_mut() {
                if let Some(why) = slot.as_ref().and_then(Peer::socket_end) {
                    forget(slot, &why, &mut complaints);
                }
            }
            while let Ok((tcp, from)) = listener.accept() {
                if !self.may_be_a_peer(from.ip()) {
                    log::warn!(
                        "broker: refused a connection from {from}: no server to accept is there"
                    );
                    continue;
                }
                if let Err(e) = self.handshake(tcp, None, deadline, &mut peers) {
                    log::warn!("broker: the handshake with {from} failed: {e}");
                }
            }
            for s in 0..me {
                if peers[s].is_some() {
                    continue;
                }
                match connect_from(self.source(), self.addr_of(s), Duration::from_millis(200)) {
                    Ok(tcp) => {
                        if let Err(e) = self.handshake(tcp, Some(s), deadline, &mut peers) {
                            complaints.warn(s, format!("handshake with server {s}: {e}"));
                        }
                    }
                    Err(e) => complaints.note(s, format!("connecting to server {s}: {e}")),
                }
            }
            std::thread::sleep(RETRY);
        }
        Ok(peers)
    }

    /// One socket handshake: hellos and QP endpoints both ways, connect,
    /// then one byte each way so neither sends before the other can receive.
    fn handshake(
        &self,
        mut tcp: TcpStream,
        expect: Option<usize>,
        deadline: Instant,
        peers: &mut [Option<Peer>],
    ) -> Result<()> {
        tcp.set_nonblocking(false)?;
        // Bounded on its own: the handshakes run one at a time, and one
        // with a peer that says nothing (or a byte now and then) must not
        // hold up the others until the init deadline.
        // The side that connected waits longer: the server it connected
        // to may first spend its own deadline on another client, and if we
        // gave up while it went on to finish with us, it would count us
        // connected and we would not.
        let wait = match expect {
            Some(_) => 3 * HANDSHAKE_TIMEOUT,
            None => HANDSHAKE_TIMEOUT,
        };
        let until = deadline.min(Instant::now() + wait);
        let (peer_qp, local) = Peer::manual(self)?;
        let mut out = Vec::with_capacity(HELLO_LEN + QP_INFO_WIRE_LEN);
        out.extend_from_slice(&self.my_hello().to_bytes());
        out.extend_from_slice(&local.to_bytes());
        tcp.write_all(&out)?;
        let mut inb = [0u8; HELLO_LEN + QP_INFO_WIRE_LEN];
        read_exact_by(&tcp, &mut inb, until)?;
        let hello = Hello::parse(&inb[..HELLO_LEN])
            .ok_or_else(|| BrokerError::Protocol("a peer sent a bad hello".into()))?;
        let ok = match expect {
            Some(s) => hello.server_id as usize == s && hello.thread_id == self.config.thread_id,
            None => self.acceptable(&hello, tcp.peer_addr().ok().map(|a| a.ip()), peers),
        };
        if !ok {
            return Err(BrokerError::Protocol(format!("unexpected hello {hello:?}")));
        }
        let remote = QpInfo::from_bytes(&inb[HELLO_LEN..])?;
        let mut peer = peer_qp.connect(self, hello, &remote)?;
        tcp.write_all(&[1])?;
        read_exact_by(&tcp, &mut [0u8], until)?;
        tcp.set_nonblocking(true)?;
        peer.tcp = Some(tcp);
        peers[hello.server_id as usize] = Some(peer);
        Ok(())
    }
}

/// The last thing that went wrong with each server during setup: what a
/// timed-out init says of each missing one, and what is logged (each
/// different failure once rather than at every retry).
struct Complaints {
    last: Vec<Option<String>>,
    logged: Vec<Option<String>>,
}

impl Complaints {
    fn new(servers: usize) -> Complaints {
        Complaints {
            last: vec![None; servers],
            logged: vec![None; servers],
        }
    }

    /// A failure worth a warning: logged unless it was the last one logged
    /// for that server.
    fn warn(&mut self, server: usize, what: String) {
        if let Some(logged) = self.logged.get_mut(server) {
            if logged.as_deref() != Some(&what) {
                log::warn!("broker: {what} (retrying until the init deadline)");
                *logged = Some(what.clone());
            }
        }
        self.note(server, what);
    }

    /// A failure expected while servers start (one not listening yet):
    /// kept for a timed-out init to tell, not logged.
    fn note(&mut self, server: usize, what: String) {
        if let Some(last) = self.last.get_mut(server) {
            *last = Some(what);
        }
    }

    /// The last failure of each of `servers`.
    fn about(&self, servers: &[usize]) -> Vec<String> {
        servers
            .iter()
            .map(|&s| match self.last.get(s).cloned().flatten() {
                Some(what) => what,
                None => format!("server {s}: never heard from"),
            })
            .collect()
    }
}

/// A peer that left while we still wait for others (its own setup gave up)
/// is forgotten, to be connected or accepted afresh when it comes back,
/// never handed on dead.
fn forget_if_left(peers: &mut [Option<Peer>], ev: &CmEvent, heard: &mut Complaints) {
    if !matches!(
        ev.kind,
        CmEventKind::DISCONNECTED | CmEventKind::DEVICE_REMOVAL
    ) {
        return;
    }
    let left = peers.iter_mut().find(|p| {
        p.as_ref()
            .and_then(|p| p.cm_id.as_ref())
            .is_some_and(|id| id.id_ref() == ev.id)
    });
    if let Some(slot) = left {
        forget(slot, &format!("RDMA CM reported {}", ev.kind), heard);
    }
}

/// Drops a peer that left before the mesh was complete, for it to be
/// connected or accepted afresh.
fn forget(slot: &mut Option<Peer>, why: &str, heard: &mut Complaints) {
    if let Some(peer) = slot.take() {
        let s = peer.server;
        log::warn!(
            "broker: server {s} left before the mesh was complete ({why}); waiting for it again"
        );
        heard.note(s, format!("server {s} left during setup ({why})"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(addr: u64, len: u64) -> Hello {
        Hello {
            server_id: 3,
            thread_id: 1,
            region: RemoteRegion {
                addr,
                len,
                rkey: 0x1234,
            },
        }
    }

    #[test]
    fn a_hello_survives_the_wire_with_padding() {
        let h = hello(0x7f00_0000_0000, 1 << 20);
        let mut padded = h.to_bytes().to_vec();
        padded.extend_from_slice(&[0; 8]);
        assert_eq!(Hello::parse(&padded), Some(h));
        assert_eq!(Hello::parse(&padded[..HELLO_LEN - 1]), None);
        padded[0] ^= 1;
        assert_eq!(Hello::parse(&padded), None, "bad magic");
    }

    #[test]
    fn a_region_past_the_end_of_the_address_space_is_refused() {
        assert_eq!(Hello::parse(&hello(u64::MAX - 10, 64).to_bytes()), None);
        let top = hello(u64::MAX - 64, 64);
        assert_eq!(Hello::parse(&top.to_bytes()), Some(top));
    }

    #[test]
    fn a_timed_out_init_tells_the_last_failure_of_each_missing_server() {
        let mut heard = Complaints::new(4);
        heard.note(1, "server 1 answered REJECTED".into());
        heard.warn(1, "connecting to server 1: no QP".into());
        heard.note(3, "resolving server 3: unreachable".into());
        let why = heard.about(&[1, 2, 3]);
        assert_eq!(
            why,
            [
                "connecting to server 1: no QP",
                "server 2: never heard from",
                "resolving server 3: unreachable"
            ]
        );
        let e = BrokerError::InitTimeout {
            missing: vec![1, 2, 3],
            why,
        };
        assert_eq!(
            e.to_string(),
            "init timed out; not connected to servers [1, 2, 3] (connecting to server 1: no QP; \
             server 2: never heard from; resolving server 3: unreachable)"
        );
        assert_eq!(heard.about(&[9]), ["server 9: never heard from"]);
    }
}
