//! TCP helpers shared by the runtime's and the broker's socket-mode
//! handshakes.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

/// Connects to `dst` from `src` (port 0: any), within `timeout`: the peer
/// then sees the address it was told we connect from, whichever route the
/// system would pick.
pub(crate) fn connect_from(
    src: SocketAddr,
    dst: SocketAddr,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))?;
    socket.bind(&src.into())?;
    socket.connect_timeout(&dst.into(), timeout)?;
    Ok(socket.into())
}

/// Fills `buf` from `stream` by `deadline`, however the peer trickles its
/// bytes (a timeout per read would let one byte at a time stretch it).
pub(crate) fn read_exact_by(
    mut stream: &TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Err(ErrorKind::TimedOut.into()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::QP_INFO_WIRE_LEN;
    use std::io::Write;
    use std::net::TcpListener;
    use std::thread;
    use std::time::Duration;

    /// A peer on localhost that sends `bytes` one at a time, `gap` apart.
    fn trickler(bytes: usize, gap: Duration) -> TcpStream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            for _ in 0..bytes {
                if s.write_all(&[7]).is_err() {
                    return;
                }
                thread::sleep(gap);
            }
            thread::sleep(Duration::from_secs(1));
        });
        TcpStream::connect(addr).unwrap()
    }

    #[test]
    fn a_trickling_peer_cannot_stretch_a_read_past_its_deadline() {
        let stream = trickler(QP_INFO_WIRE_LEN, Duration::from_millis(40));
        let start = Instant::now();
        let mut buf = [0u8; QP_INFO_WIRE_LEN];
        let e = read_exact_by(&stream, &mut buf, start + Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        assert!(
            start.elapsed() < Duration::from_millis(600),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn bytes_in_pieces_are_read_whole_within_the_deadline() {
        let stream = trickler(4, Duration::from_millis(10));
        let mut buf = [0u8; 4];
        read_exact_by(&stream, &mut buf, Instant::now() + Duration::from_secs(5)).unwrap();
        assert_eq!(buf, [7; 4]);
    }

    #[test]
    fn a_peer_that_closes_early_is_an_unexpected_end() {
        let stream = trickler(2, Duration::ZERO);
        let mut buf = [0u8; 4];
        let e =
            read_exact_by(&stream, &mut buf, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnexpectedEof);
    }
}
