//! Message buffers kept per thread: a request or reply is encoded into the
//! thread's spare buffer and handed back once sent, so a steady stream of
//! messages allocates nothing (the buffer keeps the largest small message's
//! capacity).

use std::cell::RefCell;

/// Buffers beyond this are not kept: one large value must not pin its
/// memory to a thread for good.
const KEEP_UP_TO: usize = 64 << 10;

thread_local! {
    static SPARE: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// An empty buffer with room for `len` bytes: this thread's spare if it has
/// one.
pub fn take(len: usize) -> Vec<u8> {
    let mut b = SPARE
        .try_with(|s| s.borrow_mut().take())
        .ok()
        .flatten()
        .unwrap_or_default();
    b.clear();
    b.reserve(len);
    b
}

/// Keeps `b` as this thread's spare (for the next [`take`]).
pub fn give_back(b: Vec<u8>) {
    if b.capacity() <= KEEP_UP_TO {
        let _ = SPARE.try_with(|s| *s.borrow_mut() = Some(b));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_buffer_handed_back_is_taken_again_empty() {
        let mut b = super::take(100);
        b.extend_from_slice(b"hello");
        let at = b.as_ptr();
        super::give_back(b);
        let again = super::take(10);
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), at, "the same memory, reused");
    }

    #[test]
    fn a_large_buffer_is_not_kept() {
        super::give_back(vec![0; super::KEEP_UP_TO + 1]);
        assert!(super::take(0).capacity() <= super::KEEP_UP_TO);
    }
}
