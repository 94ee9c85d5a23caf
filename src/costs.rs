//! Counts of what the library does per operation: work requests, doorbells,
//! signaled completions, receive reposts, payload bytes on the wire and
//! payload bytes copied in user space. `make bench` reads them around its
//! steady-state loops to print the per-operation cost report
//! (docs/performance.md); they are exact, not sampled.
//!
//! Each thread counts into its own block (a load and a store, no locked
//! instruction, no shared cache line on the data path); a snapshot sums the
//! blocks of every thread that ever counted, so the counts of exited threads
//! are kept.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rdma_sys as sys;

/// What is counted, one index per figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    /// Send-queue work requests posted.
    SendRequests,
    /// `ibv_post_send` calls.
    SendDoorbells,
    /// Send-queue work requests posted signaled (each makes a completion).
    SignaledRequests,
    /// Receive work requests posted (`ibv_post_recv`, `ibv_post_srq_recv`).
    ReceiveRequests,
    /// `ibv_post_recv` / `ibv_post_srq_recv` calls.
    ReceiveDoorbells,
    /// Payload bytes the posted requests move on the wire: what SENDs and
    /// WRITEs carry, what READs bring back, 8 per atomic.
    WireBytes,
    /// Payload copies in user space (the library's own memcpys of user data).
    Copies,
    /// Bytes those copies moved.
    CopiedBytes,
}

impl Counter {
    pub const ALL: [Counter; 8] = [
        Counter::SendRequests,
        Counter::SendDoorbells,
        Counter::SignaledRequests,
        Counter::ReceiveRequests,
        Counter::ReceiveDoorbells,
        Counter::WireBytes,
        Counter::Copies,
        Counter::CopiedBytes,
    ];

    /// The name in the report and its JSON.
    pub fn name(self) -> &'static str {
        match self {
            Counter::SendRequests => "send_wrs",
            Counter::SendDoorbells => "send_doorbells",
            Counter::SignaledRequests => "signaled",
            Counter::ReceiveRequests => "recv_wrs",
            Counter::ReceiveDoorbells => "recv_doorbells",
            Counter::WireBytes => "wire_bytes",
            Counter::Copies => "copies",
            Counter::CopiedBytes => "copied_bytes",
        }
    }
}

const N: usize = Counter::ALL.len();

/// One thread's counts; only that thread writes them.
#[derive(Default)]
struct Block([AtomicU64; N]);

static BLOCKS: Mutex<Vec<Arc<Block>>> = Mutex::new(Vec::new());

thread_local! {
    static MINE: Arc<Block> = {
        let block = Arc::new(Block::default());
        BLOCKS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(block.clone());
        block
    };
}

/// Adds to several counters with one look-up of the thread's block.
fn add_all(counts: &[(Counter, u64)]) {
    // During thread teardown the block may be gone: that count is lost,
    // which only a snapshot taken after the thread's last post could see.
    let _ = MINE.try_with(|b| {
        for &(c, n) in counts {
            let slot = &b.0[c as usize];
            // Single writer: a plain load and store, not a locked add.
            slot.store(
                slot.load(Ordering::Relaxed).wrapping_add(n),
                Ordering::Relaxed,
            );
        }
    });
}

/// The process's counts so far, summed over its threads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Costs([u64; N]);

impl Costs {
    pub fn get(&self, c: Counter) -> u64 {
        self.0[c as usize]
    }

    /// The counts since `earlier`.
    pub fn since(&self, earlier: &Costs) -> Costs {
        let mut d = Costs::default();
        for (i, v) in d.0.iter_mut().enumerate() {
            *v = self.0[i].wrapping_sub(earlier.0[i]);
        }
        d
    }
}

/// The counts of every thread so far.
pub fn snapshot() -> Costs {
    let mut total = Costs::default();
    for b in BLOCKS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        for (i, v) in total.0.iter_mut().enumerate() {
            *v = v.wrapping_add(b.0[i].load(Ordering::Relaxed));
        }
    }
    total
}

/// The counts of the calling thread alone so far.
pub fn this_thread() -> Costs {
    MINE.try_with(|b| Costs(std::array::from_fn(|i| b.0[i].load(Ordering::Relaxed))))
        .unwrap_or_default()
}

fn sge_bytes(list: *const sys::ibv_sge, n: i32) -> u64 {
    if list.is_null() || n <= 0 {
        return 0;
    }
    // SAFETY: the caller is about to hand the same list to the provider,
    // which reads `n` entries.
    unsafe { std::slice::from_raw_parts(list, n as usize) }
        .iter()
        .map(|s| u64::from(s.length))
        .sum()
}

/// Counts one `ibv_post_send` of the chain starting at `wr`.
///
/// # Safety
/// `wr` is a valid chain of send work requests (as `ibv_post_send` needs).
pub(crate) unsafe fn post_send(mut wr: *const sys::ibv_send_wr) {
    use sys::ibv_wr_opcode as O;
    let (mut wrs, mut signaled, mut bytes) = (0, 0, 0);
    while !wr.is_null() {
        let w = &*wr;
        wrs += 1;
        if w.send_flags & sys::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0 {
            signaled += 1;
        }
        bytes += match w.opcode {
            O::IBV_WR_ATOMIC_CMP_AND_SWP | O::IBV_WR_ATOMIC_FETCH_AND_ADD => 8,
            O::IBV_WR_BIND_MW | O::IBV_WR_LOCAL_INV => 0,
            _ => sge_bytes(w.sg_list, w.num_sge),
        };
        wr = w.next;
    }
    add_all(&[
        (Counter::SendDoorbells, 1),
        (Counter::SendRequests, wrs),
        (Counter::SignaledRequests, signaled),
        (Counter::WireBytes, bytes),
    ]);
}

/// Counts one `ibv_post_recv` or `ibv_post_srq_recv` of the chain at `wr`.
///
/// # Safety
/// `wr` is a valid chain of receive work requests.
pub(crate) unsafe fn post_recv(mut wr: *const sys::ibv_recv_wr) {
    let mut wrs = 0;
    while !wr.is_null() {
        wrs += 1;
        wr = (*wr).next;
    }
    add_all(&[
        (Counter::ReceiveDoorbells, 1),
        (Counter::ReceiveRequests, wrs),
    ]);
}

/// Counts a copy of `bytes` bytes of payload, if there are any.
pub(crate) fn copied_if_any(bytes: usize) {
    if bytes > 0 {
        copied(bytes);
    }
}

/// Counts one user-space copy of `bytes` bytes of payload.
pub(crate) fn copied(bytes: usize) {
    add_all(&[(Counter::Copies, 1), (Counter::CopiedBytes, bytes as u64)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_sees_its_own_counts_and_those_of_exited_threads() {
        let before = snapshot();
        copied(10);
        std::thread::spawn(|| copied(5)).join().unwrap();
        let d = snapshot().since(&before);
        // Other tests may copy concurrently: at least ours are there.
        assert!(d.get(Counter::Copies) >= 2);
        assert!(d.get(Counter::CopiedBytes) >= 15);
    }

    #[test]
    fn a_chain_counts_each_request_once_and_the_doorbell_once() {
        let mut data = [0u8; 64];
        let sge = sys::ibv_sge {
            addr: data.as_mut_ptr() as u64,
            length: 64,
            lkey: 0,
        };
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wrs: [sys::ibv_send_wr; 3] = unsafe { std::mem::zeroed() };
        for w in wrs.iter_mut() {
            w.sg_list = &sge as *const _ as *mut _;
            w.num_sge = 1;
            w.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        }
        wrs[2].send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let (a, b) = wrs.split_at_mut(1);
        a[0].next = &mut b[0];
        let (b0, b1) = b.split_at_mut(1);
        b0[0].next = &mut b1[0];
        let before = this_thread();
        // SAFETY: a valid three-request chain.
        unsafe { post_send(&wrs[0]) };
        let d = this_thread().since(&before);
        assert_eq!(d.get(Counter::SendDoorbells), 1);
        assert_eq!(d.get(Counter::SendRequests), 3);
        assert_eq!(d.get(Counter::SignaledRequests), 1);
        assert_eq!(d.get(Counter::WireBytes), 192);
    }
}
