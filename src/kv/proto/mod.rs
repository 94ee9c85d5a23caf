//! The key-value wire protocol, carried as runtime messages (RDMA WRITE WITH
//! IMM into the peer's ring), and the layouts clients read one-sidedly: the
//! value block and the hash index bucket. All integers little-endian.
//!
//! A request is a [`Request`] header, the key, then (inline writes) the
//! value. A reply is a [`Reply`] header, then (inline GETs, HELLO) a payload.

mod layout;
mod wire;

pub use layout::*;
pub use wire::*;

pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
