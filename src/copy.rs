//! Bulk copies in pieces smaller than glibc's `rep movsb` threshold.
//!
//! For large buffers glibc's `memcpy` switches to `rep movsb`, which some
//! CPUs run slowly and emulators (QEMU TCG, where the Soft-RoCE tests and
//! benchmarks run) run very slowly: a 64 KiB copy took 265-465 us there, and
//! 31 us in pieces, which use the vector loop. On a KVM guest the pieces
//! were faster too (1.9 against 3.4 us for 64 KiB, cache-hot).

/// Below every default `rep movsb` threshold of glibc on AVX machines.
const PIECE: usize = 2048;

/// `dst.copy_from_slice(src)`, in pieces.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice` does).
pub fn copy(dst: &mut [u8], src: &[u8]) {
    crate::costs::copied(src.len());
    copy_pieces(dst, src);
}

/// The concatenation of `parts` into `dst` (one copy of a message gathered
/// from its pieces).
///
/// # Panics
/// If `dst` is not as long as the parts together.
pub fn gather(dst: &mut [u8], parts: &[&[u8]]) {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    assert_eq!(dst.len(), total, "gather into a slice of another length");
    crate::costs::copied(total);
    let mut at = 0;
    for p in parts {
        copy_pieces(&mut dst[at..at + p.len()], p);
        at += p.len();
    }
}

fn copy_pieces(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of unequal length"
    );
    for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
        d.copy_from_slice(s);
    }
}

/// `dst.extend_from_slice(src)`, in pieces.
pub fn extend(dst: &mut Vec<u8>, src: &[u8]) {
    crate::costs::copied_if_any(src.len());
    dst.reserve(src.len());
    for s in src.chunks(PIECE) {
        dst.extend_from_slice(s);
    }
}

/// `src.to_vec()`, in pieces.
pub fn to_vec(src: &[u8]) -> Vec<u8> {
    crate::costs::copied(src.len());
    let mut v = Vec::with_capacity(src.len());
    for s in src.chunks(PIECE) {
        v.extend_from_slice(s);
    }
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_byte_at_every_length_around_a_piece() {
        for len in [
            0,
            1,
            super::PIECE - 1,
            super::PIECE,
            super::PIECE + 1,
            70_001,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            super::copy(&mut dst, &src);
            assert_eq!(dst, src);
            let (a, b) = src.split_at(len / 3);
            let mut gathered = vec![0u8; len];
            super::gather(&mut gathered, &[a, &[], b]);
            assert_eq!(gathered, src);
            assert_eq!(super::to_vec(&src), src);
        }
    }
}
