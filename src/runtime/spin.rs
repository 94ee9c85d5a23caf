//! When a waiting thread may spin. Spinning saves the wakeup (an event and a
//! syscall or two) only while every spinner has a CPU of its own; with more
//! spinning threads than CPUs, a spinner steals the time slice the thread it
//! waits for needs (a kv mix of four clients fell to 2,500 operations per
//! second). So a thread spins only while
//! - the process's spinning threads are no more than its CPUs, and
//! - the machine's runnable threads (every process's, `/proc/loadavg`,
//!   looked at no more than once per [`LOOK_EVERY`] by the whole process)
//!   are no more than its CPUs, and
//! - it has not lately lost its CPU, in its spins, for more than a third
//!   of a [`BACK_OFF`] window ([`LOST_SHARE`]; gaps add up from the
//!   first), which is how spinners of other processes on the same CPUs
//!   show between two looks: gaps between two polls far longer than a
//!   poll, slice after slice (a CPU shared by two spinners is lost half
//!   the time). The thread then waits on its event channel for
//!   [`BACK_OFF`] before it spins again. A short gap alone is not enough:
//!   an interrupt's work, a kernel thread or (in a VM) the host taking the
//!   virtual CPU away also make them, and backing off at each left a
//!   request/reply pair waiting on events for most of a run (an echo took
//!   45 us instead of 17 on Soft-RoCE in a VM, a kv GET 70-300 instead of
//!   40).
//!
//! The checks read the clock (vDSO) and atomics; the look at the load is
//! one `pread` per [`LOOK_EVERY`] for the whole process.

use std::cell::Cell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A gap between two polls of a spin this long means the thread was off
/// its CPU (a poll takes microseconds, even under emulation; a time slice
/// is a millisecond or more).
const LOST_CPU: Duration = Duration::from_micros(500);

/// How often the process looks at how many threads the machine runs.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// How long a thread that lost its CPU while spinning waits on events only;
/// also the window in which its losses are added up.
pub(crate) const BACK_OFF: Duration = Duration::from_millis(50);

/// The share of a [`BACK_OFF`] window a spinning thread may lose its CPU
/// before it backs off: between the ~half a spinner sharing its CPU with
/// another loses, and what interrupts and kernel threads take.
const LOST_SHARE: u32 = 3;

/// Environment variable: when set (to anything), a waiting thread spins for
/// its whole `SNOWRDMA_SPIN_US` however many threads spin or run, for
/// threads that have CPUs of their own (pinned, on an otherwise idle
/// machine).
pub(crate) const SPIN_ALWAYS_ENV: &str = "SNOWRDMA_SPIN_ALWAYS";

fn always() -> bool {
    #[cfg(test)]
    if std::thread::current().name() == Some(ALWAYS_SPINNING_TEST_THREAD) {
        return true;
    }
    static ALWAYS: OnceLock<bool> = OnceLock::new();
    *ALWAYS.get_or_init(|| std::env::var_os(SPIN_ALWAYS_ENV).is_some())
}

static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// Threads of this name spin whatever the policy says: the poller's unit
/// tests are about how a spinning thread polls, and run beside many other
/// tests on few CPUs (under TSan, slowly), where the policy would keep them
/// from spinning at all.
#[cfg(test)]
pub(crate) const ALWAYS_SPINNING_TEST_THREAD: &str = "test-poller";

/// What a thread's spins lately cost it.
#[derive(Clone, Copy)]
enum Record {
    /// No CPU lost in the current window.
    Clear,
    /// CPU lost in spins: since when (the window), how long in all.
    Lost { since: Instant, total: Duration },
    /// The losses passed their share: waits on events until then.
    BackingOff { until: Instant },
}

thread_local! {
    static RECORD: Cell<Record> = const { Cell::new(Record::Clear) };
}

/// Adds a loss of `gap` ending at `now` to this thread's window; true when
/// the window's losses passed its share: the thread then backs off for
/// [`BACK_OFF`], and the window after starts afresh.
fn lost(now: Instant, gap: Duration) -> bool {
    RECORD
        .try_with(|record| {
            let (since, total) = match record.get() {
                // A spin nested in another on this thread (a callback's
                // wait inside the poller's spin) already backed off.
                Record::BackingOff { until } if now < until => return true,
                Record::Lost { since, total } if now < since + BACK_OFF => (since, total + gap),
                _ => (now.checked_sub(gap).unwrap_or(now), gap),
            };
            let crowded = total > BACK_OFF / LOST_SHARE;
            record.set(match crowded {
                true => Record::BackingOff {
                    until: now + BACK_OFF,
                },
                false => Record::Lost { since, total },
            });
            crowded
        })
        .unwrap_or(true)
}

fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Whether this thread lost its CPU in a spin less than [`BACK_OFF`] ago.
fn backing_off(now: Instant) -> bool {
    RECORD
        .try_with(|r| matches!(r.get(), Record::BackingOff { until } if now < until))
        .unwrap_or(false)
}

/// Whether the machine lately had more runnable threads than this process
/// has CPUs (as `/proc/loadavg` counts them); looked at again when the
/// last look is [`LOOK_EVERY`] old, by whichever thread gets there first.
fn crowded(now: Instant) -> bool {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    static LOOKED_AT: AtomicU64 = AtomicU64::new(0);
    static CROWDED: AtomicBool = AtomicBool::new(false);
    static LOADAVG: OnceLock<Option<File>> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(|| now);
    let at = now.saturating_duration_since(epoch).as_micros() as u64 + 1;
    let last = LOOKED_AT.load(Ordering::Relaxed);
    let due = last == 0 || at.saturating_sub(last) >= LOOK_EVERY.as_micros() as u64;
    if due
        && LOOKED_AT
            .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let file = LOADAVG.get_or_init(|| File::open("/proc/loadavg").ok());
        let mut buf = [0u8; 128];
        let running = file
            .as_ref()
            .and_then(|f| f.read_at(&mut buf, 0).ok())
            .and_then(|n| runnable(&buf[..n]));
        CROWDED.store(running.is_some_and(|r| r > cpus()), Ordering::Relaxed);
    }
    CROWDED.load(Ordering::Relaxed)
}

/// The runnable threads in `/proc/loadavg` ("0.52 0.58 0.59 3/467 1234":
/// the 3).
fn runnable(loadavg: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(loadavg).ok()?;
    let field = text.split_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

/// A thread's spin, from [`Spin::start`] until dropped.
pub(crate) struct Spin {
    prev: Instant,
    /// [`SPIN_ALWAYS_ENV`] is set: never stands down.
    always: bool,
}

impl Spin {
    /// Starts spinning, if this thread may now; `None`: wait on events.
    pub(crate) fn start(now: Instant) -> Option<Spin> {
        if always() {
            SPINNING.fetch_add(1, Ordering::Relaxed);
            return Some(Spin {
                prev: now,
                always: true,
            });
        }
        if backing_off(now) || crowded(now) {
            return None;
        }
        if SPINNING.fetch_add(1, Ordering::Relaxed) >= cpus() {
            SPINNING.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Spin {
            prev: now,
            always: false,
        })
    }

    /// Called on every pass: false when the thread should stop spinning
    /// (it lost its CPU since the last pass, which made its losses pass
    /// their share, and now backs off).
    pub(crate) fn pass(&mut self, now: Instant) -> bool {
        if self.always {
            return true;
        }
        let gap = now.saturating_duration_since(self.prev);
        self.prev = now;
        gap < LOST_CPU || !lost(now, gap)
    }
}

/// Polls `take` for up to `budget` while the policy lets this thread spin:
/// what `take` found, or `None` (the budget ran out, or the thread may not
/// spin now) for the caller to wait its own way.
pub(crate) fn poll_for<T>(budget: Duration, mut take: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    let mut spin = Spin::start(start)?;
    loop {
        if let Some(found) = take() {
            return Some(found);
        }
        let now = Instant::now();
        if now.duration_since(start) >= budget || !spin.pass(now) {
            return None;
        }
        std::hint::spin_loop();
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
    fn a_thread_that_lost_its_cpu_a_third_of_the_time_backs_off_then_spins_again() {
        let t0 = Instant::now();
        let mut s = Spin {
            prev: t0,
            always: false,
        };
        SPINNING.fetch_add(1, Ordering::Relaxed); // As start() would.
        let mut now = t0 + Duration::from_micros(10);
        assert!(s.pass(now));
        // Kernel work now and then: a few gaps, adding up to under a third
        // of the window.
        for _ in 0..5 {
            now += LOST_CPU;
            assert!(s.pass(now), "a gap now and then is no crowd");
            now += Duration::from_millis(2);
            assert!(s.pass(now));
        }
        // A later spin, a window on, that loses its CPU slice after slice
        // (3 ms gaps): it backs off once they pass a third of the window.
        now += BACK_OFF;
        s.prev = now;
        let mut passes = 0;
        loop {
            now += Duration::from_millis(3);
            if !s.pass(now) {
                break;
            }
            passes += 1;
            assert!(passes < 20, "never backed off");
            now += Duration::from_micros(100);
            assert!(s.pass(now));
        }
        assert!(passes >= 3, "backed off after {passes} slices");
        drop(s);
        let later = now + Duration::from_millis(1);
        assert!(backing_off(later));
        assert!(Spin::start(later).is_none(), "backing off");
        assert!(!backing_off(later + BACK_OFF), "spins again");
    }

    #[test]
    fn a_nested_spins_loss_does_not_end_a_back_off() {
        // A thread of its own: a fresh record.
        std::thread::spawn(|| {
            let t0 = Instant::now();
            assert!(lost(t0, BACK_OFF), "a whole window lost backs off");
            let ms = Duration::from_millis;
            assert!(backing_off(t0 + ms(1)));
            // A spin inside the backed-off one loses its CPU too.
            assert!(lost(t0 + ms(2), LOST_CPU));
            assert!(backing_off(t0 + ms(3)), "the back-off still runs");
            assert!(!backing_off(t0 + BACK_OFF + ms(1)));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_told_to_spin_always_never_stands_down() {
        let t0 = Instant::now();
        let mut s = Spin {
            prev: t0,
            always: true,
        };
        SPINNING.fetch_add(1, Ordering::Relaxed); // As start() would.
        assert!(s.pass(t0 + LOST_CPU * 10));
        assert!(!backing_off(t0 + LOST_CPU * 11));
    }

    #[test]
    fn poll_for_takes_what_comes_within_its_budget_and_no_longer() {
        std::thread::Builder::new()
            .name(ALWAYS_SPINNING_TEST_THREAD.into())
            .spawn(|| {
                let mut polls = 0;
                let third = poll_for(Duration::from_secs(5), || {
                    polls += 1;
                    (polls == 3).then_some(7)
                });
                assert_eq!((third, polls), (Some(7), 3));
                let t = Instant::now();
                assert_eq!(poll_for(Duration::from_millis(20), || None::<u8>), None);
                assert!(t.elapsed() >= Duration::from_millis(20));
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn the_runnable_threads_are_read_from_loadavg() {
        assert_eq!(runnable(b"0.52 0.58 0.59 3/467 1234\n"), Some(3));
        assert_eq!(runnable(b"0.52 0.58 0.59 12/467 1234"), Some(12));
        assert_eq!(runnable(b"garbage"), None);
        assert_eq!(runnable(b""), None);
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
