//! The SnowRDMA wire protocol: the 32-byte command messages both sides SEND,
//! and the layout of data messages in the receiver's ring.
//!
//! Legacy peers speak version 0: REG_LOCAL_ADDR, REG_PHYS_ADDR, CONN_GOODBYE,
//! and data as RDMA WRITE WITH IMM whose immediate is the byte offset in the
//! receiver's buffer. Version 1 (ours) announces itself in the version byte of
//! REG_LOCAL_ADDR, with the receive depth and how much of the ring it will use in the reserved bytes, and adds
//! CREDIT (the receiver returns consumed ring space) and extended data
//! messages (immediate bit 31 set: an 8-byte header precedes the payload in
//! the ring). Nothing of version 1 is ever sent to a version-0 peer.
//!
//! Version 2 lets a receiver return credit without posting anything: it
//! publishes what it has consumed in a 16-byte slot ([`CreditWords`]) the
//! sender RDMA READs, with a READ chained to its messages (no doorbell of
//! its own). CREDIT_SLOT tells the peer where the slot is; a sender that
//! finds no room says what it needs with CREDIT_WANTED, and the receiver
//! answers with a CREDIT once it has consumed that much. Nothing of version
//! 2 is sent to an older peer.

/// First byte of every command message ('R'); the C header's
/// `RDMA_CMD_MAGIC` is generated from this constant.
pub const RDMA_CMD_MAGIC: u8 = b'R';
/// The protocol version this library speaks.
pub const VERSION: u8 = 2;
/// Size of a command on the wire.
pub const CMD_LEN: usize = 32;

/// Bit 31 of a data message's immediate: an extended message, whose ring
/// bytes start with an [`ExtKind`] header.
pub const IMM_EXTENDED: u32 = 1 << 31;
/// Size of the [`ExtKind`] header in the ring.
pub const EXT_HEADER_LEN: usize = 8;

/// Command opcodes (`RdmaCmdType`, plus CREDIT from version 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    RegLocalAddr = 0,
    RegPhysAddr = 1,
    ConnGoodbye = 2,
    /// Version 1: `addr` = bytes of the ring consumed so far (cumulative),
    /// `length` = messages consumed so far (cumulative, wrapping).
    Credit = 3,
    /// Version 2: `addr`, `length`, `key`: the receiver's credit slot, which
    /// the sender may READ ([`CreditWords`]); once per connection.
    CreditSlot = 4,
    /// Version 2: the sender found no room: `addr` = the ring bytes and
    /// `length` = the messages (cumulative, wrapping) the receiver must have
    /// consumed before its next message fits.
    CreditWanted = 5,
}

/// One command, as `RdmaCmd`: magic, version, opcode, 13 reserved bytes,
/// `addr` in host order, `length` and `key` in network order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cmd {
    pub version: u8,
    pub opcode: Opcode,
    /// Version 1 REG_LOCAL_ADDR: the sender's receive depth.
    pub recv_depth: u32,
    /// Version 1 REG_LOCAL_ADDR: the most of the receiver's ring the sender
    /// will use (its staging buffer's size), so both wrap at the same
    /// place; 0: all of it.
    pub ring_use: u32,
    pub addr: u64,
    pub length: u32,
    pub key: u32,
}

/// Why a received command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdError {
    #[error("command of {0} bytes, expected {CMD_LEN}")]
    Length(usize),
    #[error("bad magic byte {0:#04x}")]
    Magic(u8),
    #[error("unknown command opcode {0}")]
    Opcode(u8),
}

impl Cmd {
    pub fn new(opcode: Opcode, addr: u64, length: u32, key: u32) -> Cmd {
        Cmd {
            version: VERSION,
            opcode,
            recv_depth: 0,
            ring_use: 0,
            addr,
            length,
            key,
        }
    }

    pub fn encode(&self) -> [u8; CMD_LEN] {
        let mut b = [0u8; CMD_LEN];
        b[0] = RDMA_CMD_MAGIC;
        b[1] = self.version;
        b[2] = self.opcode as u8;
        b[3..7].copy_from_slice(&self.recv_depth.to_be_bytes());
        b[7..11].copy_from_slice(&self.ring_use.to_be_bytes());
        b[16..24].copy_from_slice(&self.addr.to_ne_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b[28..32].copy_from_slice(&self.key.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Cmd, CmdError> {
        if b.len() != CMD_LEN {
            return Err(CmdError::Length(b.len()));
        }
        if b[0] != RDMA_CMD_MAGIC {
            return Err(CmdError::Magic(b[0]));
        }
        let opcode = match b[2] {
            0 => Opcode::RegLocalAddr,
            1 => Opcode::RegPhysAddr,
            2 => Opcode::ConnGoodbye,
            3 => Opcode::Credit,
            4 => Opcode::CreditSlot,
            5 => Opcode::CreditWanted,
            other => return Err(CmdError::Opcode(other)),
        };
        let u32_be =
            |r: std::ops::Range<usize>| u32::from_be_bytes(b[r].try_into().expect("4 bytes"));
        Ok(Cmd {
            version: b[1],
            opcode,
            // Legacy peers leave the reserved bytes zero.
            recv_depth: if b[1] >= 1 { u32_be(3..7) } else { 0 },
            ring_use: if b[1] >= 1 { u32_be(7..11) } else { 0 },
            addr: u64::from_ne_bytes(b[16..24].try_into().expect("8 bytes")),
            length: u32_be(24..28),
            key: u32_be(28..32),
        })
    }
}

/// What a version-2 receiver has consumed, as published in its credit
/// slot: ring bytes and messages, both cumulative. Each is an aligned
/// little-endian u64, so a READ racing the receiver's update sees each
/// count whole, old or new; the sender checks each on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CreditWords {
    pub bytes: u64,
    pub msgs: u64,
}

/// Size of a credit slot on the wire.
pub const CREDIT_SLOT_LEN: usize = 16;

impl CreditWords {
    pub fn encode(self) -> [u8; CREDIT_SLOT_LEN] {
        let mut b = [0u8; CREDIT_SLOT_LEN];
        b[..8].copy_from_slice(&self.bytes.to_le_bytes());
        b[8..].copy_from_slice(&self.msgs.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; CREDIT_SLOT_LEN]) -> CreditWords {
        let word =
            |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        CreditWords {
            bytes: word(0..8),
            msgs: word(8..16),
        }
    }
}

/// What an extended data message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtKind {
    /// A message that carries an application immediate.
    WithImm(u32),
    /// Bytes written with `rdmaConnWrite`: land in the ring, no callback.
    Silent,
}

impl ExtKind {
    pub fn encode(self) -> [u8; EXT_HEADER_LEN] {
        let (kind, imm) = match self {
            ExtKind::WithImm(imm) => (1u32, imm),
            ExtKind::Silent => (2u32, 0),
        };
        let mut b = [0u8; EXT_HEADER_LEN];
        b[..4].copy_from_slice(&kind.to_be_bytes());
        b[4..].copy_from_slice(&imm.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<ExtKind> {
        let kind = u32::from_be_bytes(b.get(..4)?.try_into().ok()?);
        let imm = u32::from_be_bytes(b.get(4..8)?.try_into().ok()?);
        match kind {
            1 => Some(ExtKind::WithImm(imm)),
            2 => Some(ExtKind::Silent),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_have_the_legacy_layout() {
        let mut c = Cmd::new(Opcode::RegLocalAddr, 0x1122_3344_5566_7788, 1 << 20, 0xabcd);
        c.recv_depth = 1024;
        c.ring_use = 64 << 10;
        let b = c.encode();
        assert_eq!(&b[3..11], &[0, 0, 4, 0, 0, 1, 0, 0]);
        assert_eq!(b[0], b'R');
        assert_eq!(b[1], VERSION);
        assert_eq!(b[2], 0);
        assert_eq!(&b[16..24], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&b[24..28], &(1u32 << 20).to_be_bytes());
        assert_eq!(&b[28..32], &0xabcdu32.to_be_bytes());
        assert_eq!(Cmd::decode(&b).unwrap(), c);
    }

    #[test]
    fn a_legacy_command_decodes_without_extensions() {
        let mut b = Cmd::new(Opcode::ConnGoodbye, 0, 0, 0).encode();
        b[1] = 0;
        b[3] = 0xff; // reserved garbage from a legacy peer is ignored
        b[8] = 0xff;
        let c = Cmd::decode(&b).unwrap();
        assert_eq!(
            (c.version, c.opcode, c.recv_depth, c.ring_use),
            (0, Opcode::ConnGoodbye, 0, 0)
        );
    }

    #[test]
    fn malformed_commands_are_refused() {
        let mut b = Cmd::new(Opcode::Credit, 0, 0, 0).encode();
        assert_eq!(Cmd::decode(&b[..31]), Err(CmdError::Length(31)));
        b[2] = 9;
        assert_eq!(Cmd::decode(&b), Err(CmdError::Opcode(9)));
        b[2] = 4;
        assert_eq!(Cmd::decode(&b).unwrap().opcode, Opcode::CreditSlot);
        b[0] = b'X';
        assert_eq!(Cmd::decode(&b), Err(CmdError::Magic(b'X')));
    }

    #[test]
    fn credit_words_round_trip_little_endian() {
        let w = CreditWords {
            bytes: 0x0102_0304_0506_0708,
            msgs: 9,
        };
        let b = w.encode();
        assert_eq!(b[0], 0x08);
        assert_eq!(b[8], 9);
        assert_eq!(CreditWords::decode(&b), w);
    }

    #[test]
    fn extended_headers_round_trip() {
        for k in [ExtKind::WithImm(0xdead_beef), ExtKind::Silent] {
            assert_eq!(ExtKind::decode(&k.encode()), Some(k));
        }
        assert_eq!(ExtKind::decode(&[0, 0, 0, 7, 0, 0, 0, 0]), None);
        assert_eq!(ExtKind::decode(&[0, 0]), None);
    }
}
