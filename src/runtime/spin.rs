//! When a waiting thread may spin. Spinning saves the wakeup (an event and a
//! syscall or two) only while every spinner has a CPU of its own; with more
//! spinning threads than CPUs, a spinner steals the time slice the thread it
//! waits for needs (a kv mix of four clients fell to 2,500 operations per
//! second). So a thread spins only while
//! - the process's spinning threads are no more than its CPUs, and
//! - it has not lately lost its CPU in the middle of a spin, which is how
//!   spinners of other processes on the same CPUs show: a gap between two
//!   polls far longer than a poll. The thread then waits on its event
//!   channel for [`BACK_OFF`] before it spins again.
//!
//! Both checks read the clock (vDSO) and an atomic: no system call.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A gap between two polls of a spin this long means the thread was off
/// its CPU (a poll takes microseconds, even under emulation).
const LOST_CPU: Duration = Duration::from_millis(2);

/// How long a thread that lost its CPU while spinning waits on events only.
pub(crate) const BACK_OFF: Duration = Duration::from_millis(50);

static SPINNING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static BACKING_OFF_UNTIL: Cell<Option<Instant>> = const { Cell::new(None) };
}

fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Whether this thread lost its CPU in a spin less than [`BACK_OFF`] ago.
fn backing_off(now: Instant) -> bool {
    BACKING_OFF_UNTIL
        .try_with(|b| b.get().is_some_and(|until| now < until))
        .unwrap_or(false)
}

/// A thread's spin, from [`Spin::start`] until dropped.
pub(crate) struct Spin {
    prev: Instant,
}

impl Spin {
    /// Starts spinning, if this thread may now; `None`: wait on events.
    pub(crate) fn start(now: Instant) -> Option<Spin> {
        if backing_off(now) {
            return None;
        }
        if SPINNING.fetch_add(1, Ordering::Relaxed) >= cpus() {
            SPINNING.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Spin { prev: now })
    }

    /// Called on every pass: false when the thread should stop spinning
    /// (it lost its CPU since the last pass, and now backs off).
    pub(crate) fn pass(&mut self, now: Instant) -> bool {
        let gap = now.saturating_duration_since(self.prev);
        self.prev = now;
        if gap < LOST_CPU {
            return true;
        }
        let _ = BACKING_OFF_UNTIL.try_with(|b| b.set(Some(now + BACK_OFF)));
        false
    }
}

impl Drop for Spin {
    fn drop(&mut self) {
        SPINNING.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_lost_its_cpu_backs_off_then_spins_again() {
        let t0 = Instant::now();
        let mut s = Spin { prev: t0 };
        SPINNING.fetch_add(1, Ordering::Relaxed); // As start() would.
        assert!(s.pass(t0 + Duration::from_micros(10)));
        assert!(!s.pass(t0 + Duration::from_micros(10) + LOST_CPU));
        drop(s);
        let later = t0 + LOST_CPU + Duration::from_millis(1);
        assert!(backing_off(later));
        assert!(Spin::start(later).is_none(), "backing off");
        assert!(!backing_off(later + BACK_OFF), "spins again");
    }

    #[test]
    fn no_more_threads_spin_than_there_are_cpus() {
        // Spins on other threads of this test binary may hold some of the
        // places; at most cpus() are ever held at once.
        let now = Instant::now() + BACK_OFF * 4;
        let held: Vec<Spin> = (0..cpus() + 2).filter_map(|_| Spin::start(now)).collect();
        assert!(held.len() <= cpus());
        assert!(SPINNING.load(Ordering::Relaxed) <= cpus());
    }
}
