//! A background thread that waits on a set of file descriptors and runs each
//! one's handler when it becomes readable. The runtime has two: one for RDMA
//! CM event channels, one for completion channels.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Something with a file descriptor to watch.
pub trait Source: Send + Sync {
    fn fd(&self) -> RawFd;
    /// Called on the poller's thread when `fd` is readable (or on every tick
    /// when the poll times out, so a missed wakeup costs at most one tick).
    fn ready(&self);
    /// Handles what is pending without waiting or re-arming; true when there
    /// was something. Called in a loop while the thread spins.
    fn poll_once(&self) -> bool {
        false
    }
    /// Called about once per tick, busy or not.
    fn tick(&self) {}
}

struct Shared {
    sources: Mutex<HashMap<u64, Arc<dyn Source>>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    /// An eventfd that wakes the thread when the set changes.
    wake: RawFd,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the eventfd is ours and closed once.
        unsafe { libc::close(self.wake) };
    }
}

/// A running poller thread.
pub struct Poller {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Starts the thread; `on_start` runs first on it (naming, pinning).
    /// After handling work the thread keeps polling for up to `spin` before
    /// it sleeps: a wakeup costs more than the next message usually takes.
    pub fn start(
        name: &str,
        tick: Duration,
        spin: Duration,
        on_start: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Poller> {
        // SAFETY: plain syscall.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            sources: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            wake,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                on_start();
                run(&s, tick, spin)
            })?;
        Ok(Poller {
            shared,
            thread: Some(thread),
        })
    }

    /// Watches `source` until [`Poller::remove`]; returns its key.
    pub fn add(&self, source: Arc<dyn Source>) -> u64 {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared
            .sources
            .lock()
            .expect("poller lock")
            .insert(id, source);
        self.wake();
        id
    }

    /// Stops watching a source. The thread may still be inside its handler
    /// for the current round; it holds its own reference meanwhile.
    pub fn remove(&self, id: u64) {
        self.shared.sources.lock().expect("poller lock").remove(&id);
        self.wake();
    }

    /// Makes the thread run a round now.
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our eventfd; EAGAIN (counter full) is fine.
        unsafe { libc::write(self.shared.wake, (&one as *const u64).cast(), 8) };
    }

    /// Whether the calling thread is this poller's thread.
    pub fn is_current(&self) -> bool {
        self.thread
            .as_ref()
            .is_some_and(|t| t.thread().id() == std::thread::current().id())
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.wake();
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn run(shared: &Shared, tick: Duration, spin: Duration) {
    let tick_ms = tick.as_millis().clamp(1, i32::MAX as u128) as i32;
    let mut last_tick = Instant::now();
    while !shared.stop.load(Ordering::SeqCst) {
        let snapshot: Vec<Arc<dyn Source>> = shared
            .sources
            .lock()
            .expect("poller lock")
            .values()
            .cloned()
            .collect();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(snapshot.len() + 1);
        fds.push(libc::pollfd {
            fd: shared.wake,
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(snapshot.iter().map(|s| libc::pollfd {
            fd: s.fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: fds holds fds.len() valid entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tick_ms) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                log::error!("poll failed in the runtime: {err}");
                std::thread::sleep(tick);
            }
            continue;
        }
        let mut changed = false;
        if fds[0].revents != 0 {
            let mut buf = 0u64;
            // SAFETY: reads 8 bytes from our eventfd.
            unsafe { libc::read(shared.wake, (&mut buf as *mut u64).cast(), 8) };
            changed = true;
        }
        let mut worked = false;
        for (pfd, source) in fds[1..].iter().zip(&snapshot) {
            // On a timeout every source gets a look: cheap, and it bounds the
            // cost of any lost wakeup.
            if n == 0 || pfd.revents != 0 {
                source.ready();
                worked = true;
            }
        }
        if changed {
            // A wake may carry work queued by another thread.
            for source in &snapshot {
                worked |= source.poll_once();
            }
        }
        if worked && !spin.is_zero() {
            let mut until = Instant::now() + spin;
            while Instant::now() < until && !shared.stop.load(Ordering::Relaxed) {
                let mut any = false;
                for source in &snapshot {
                    any |= source.poll_once();
                }
                if any {
                    until = Instant::now() + spin;
                }
                std::hint::spin_loop();
            }
            // Re-arm before sleeping.
            for source in &snapshot {
                source.ready();
            }
        }
        if last_tick.elapsed() >= tick {
            last_tick = Instant::now();
            for source in &snapshot {
                source.tick();
            }
        }
    }
}
