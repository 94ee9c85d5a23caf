//! A background thread that waits on a set of file descriptors (with epoll)
//! and runs each one's handler when it becomes readable. The runtime has
//! two: one for RDMA CM event channels, one for completion channels.
//!
//! After work the completion thread spins, polling only the sources that
//! had work lately and learning of the others' completions from their
//! events, so a pass costs the same with two connections or a thousand
//! idle ones.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use super::spin::Spin;

mod source;

use source::Guarded;
pub use source::{Ready, Source};

/// The epoll key of the wake eventfd; sources' keys start at 1.
const WAKE_KEY: u64 = 0;
/// Events taken per `epoll_wait`.
const EVENTS: usize = 64;
/// Up to this many sources, a spin pass polls them all (no syscall per
/// pass, and waiters of caller-polled connections are left to themselves,
/// as a busy in-process mix of clients and server runs fastest that way);
/// beyond, only the recently busy ones, with a look at the others' events
/// every [`EVENT_LOOK_INTERVAL`] (time, not passes: a syscall costs far
/// more than a pass over a few busy connections on hardware).
const FEW: usize = 16;
const EVENT_LOOK_INTERVAL: Duration = Duration::from_micros(20);
/// Idle ticks between looks at every source; also the longest an idle
/// thread sleeps when no source wants ticks but some need looks.
const LOOK_ALL_EVERY: u32 = 100;

struct Shared {
    sources: Mutex<FxHashMap<u64, Arc<dyn Source>>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    /// An eventfd that wakes the thread when the set changes.
    wake: RawFd,
    /// Set with every wake, so a spinning thread, which does not read
    /// `wake`, stops to look (at a new connection, at queued work).
    pending: AtomicBool,
    /// Watches `wake` and every source's fd.
    epoll: RawFd,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the eventfd and the epoll fd are ours and closed once.
        unsafe {
            libc::close(self.wake);
            libc::close(self.epoll);
        }
    }
}

impl Shared {
    fn watch(&self, fd: RawFd, key: u64, add: bool) {
        if fd < 0 {
            return;
        }
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: key,
        };
        let op = if add {
            libc::EPOLL_CTL_ADD
        } else {
            libc::EPOLL_CTL_DEL
        };
        // SAFETY: both fds are open (the source is alive); ev is valid.
        if unsafe { libc::epoll_ctl(self.epoll, op, fd, &mut ev) } < 0 {
            log::error!(
                "epoll_ctl({}) on fd {fd}: {}",
                if add { "add" } else { "del" },
                std::io::Error::last_os_error()
            );
        }
    }

    /// Sleeps `nap`, or until woken (a change to the set, queued work, a
    /// stop): the sources' events are left for the next `wait`.
    fn nap(&self, nap: Duration) {
        let mut wake = libc::pollfd {
            fd: self.wake,
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: nap.as_secs() as libc::time_t,
            tv_nsec: nap.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one valid pollfd and a valid timespec; no signal mask.
        unsafe { libc::ppoll(&mut wake, 1, &ts, std::ptr::null()) };
    }

    /// Waits up to `timeout_ms` for events; the count, 0 on an interrupt.
    fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: i32) -> usize {
        // SAFETY: events has events.len() writable entries.
        let n = unsafe {
            libc::epoll_wait(
                self.epoll,
                events.as_mut_ptr(),
                events.len() as i32,
                timeout_ms,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                log::error!("epoll_wait failed in the runtime: {err}");
                std::thread::sleep(Duration::from_millis(timeout_ms.max(1) as u64));
            }
            return 0;
        }
        n as usize
    }
}

/// A running poller thread.
pub struct Poller {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The thread's [`thread_token`], set first thing on it (0 until then).
    token: Arc<AtomicUsize>,
}

thread_local! {
    static THREAD_MARK: u8 = const { 0 };
}

/// A number unique to the calling thread while it lives (never 0): the
/// address of a thread-local, cheaper to compare than a `ThreadId` (which
/// `thread::current()` reaches through a reference-counted handle).
pub(crate) fn thread_token() -> usize {
    THREAD_MARK.with(|m| m as *const u8 as usize)
}

impl Poller {
    /// Starts the thread; `on_start` runs first on it (naming, pinning).
    /// After handling work the thread keeps polling for up to `spin` before
    /// it sleeps: a wakeup costs more than the next message usually takes.
    /// When it may not spin and a source's items came bunched with nobody
    /// waiting on them ([`Source::ready`]), it sleeps `nap` (0: never; a
    /// wake ends it), then polls that source unarmed
    /// ([`Source::nap_poll`]) and naps again for as long as its items keep
    /// coming so, rather than be woken by the next one: a stream's items
    /// are then taken a nap's worth at a time, and the peer's post does
    /// not pay for waking this thread per item or two. Every source of the
    /// thread waits out the nap; the others' events are taken after it.
    pub fn start(
        name: &str,
        tick: Duration,
        spin: Duration,
        nap: Duration,
        on_start: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Poller> {
        // SAFETY: plain syscall.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: plain syscall.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            let err = std::io::Error::last_os_error();
            // SAFETY: ours, not shared yet.
            unsafe { libc::close(wake) };
            return Err(err);
        }
        let shared = Arc::new(Shared {
            sources: Mutex::new(FxHashMap::default()),
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            wake,
            pending: AtomicBool::new(false),
            epoll,
        });
        shared.watch(wake, WAKE_KEY, true);
        let s = shared.clone();
        let token = Arc::new(AtomicUsize::new(0));
        let mine = token.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                /// Clears the token however the thread ends (a panic too):
                /// its value may go to a thread started later.
                struct Clear(Arc<AtomicUsize>);
                impl Drop for Clear {
                    fn drop(&mut self) {
                        self.0.store(0, Ordering::Release);
                    }
                }
                mine.store(thread_token(), Ordering::Release);
                let _clear = Clear(mine);
                on_start();
                run(&s, tick, spin, nap);
            })?;
        Ok(Poller {
            shared,
            thread: Some(thread),
            token,
        })
    }

    /// Watches `source` until [`Poller::remove`]; returns its key.
    pub fn add(&self, source: Arc<dyn Source>) -> u64 {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, Arc::new(Guarded { source }));
        self.wake();
        id
    }

    /// Stops watching a source. The thread may still be inside its handler
    /// for the current round; it holds its own reference meanwhile.
    pub fn remove(&self, id: u64) {
        self.shared
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        self.wake();
    }

    /// Makes the thread run a round now.
    pub fn wake(&self) {
        self.shared.pending.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our eventfd; EAGAIN (counter full) is fine.
        unsafe { libc::write(self.shared.wake, (&one as *const u64).cast(), 8) };
    }

    /// Whether the calling thread is this poller's thread.
    pub fn is_current(&self) -> bool {
        self.token.load(Ordering::Acquire) == thread_token()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.wake();
        // Dropped on its own thread (the last reference let go in a
        // callback), it cannot wait for itself.
        let on_own_thread = self.is_current();
        if let Some(t) = self.thread.take() {
            if !on_own_thread {
                let _ = t.join();
            }
        }
    }
}

fn run(shared: &Shared, tick: Duration, spin: Duration, nap: Duration) {
    let tick_ms = tick.as_millis().clamp(1, i32::MAX as u128) as i32;
    // Compared, not subtracted, on every round: cheaper by half. Bounded as
    // the wait's timeout is, so the sum cannot overflow.
    let tick = tick.min(Duration::from_millis(i32::MAX as u64));
    let mut next_tick = Instant::now() + tick;
    // The sources in the epoll set, by key. Removed ones are kept until
    // taken out of the set, so their fds stay open (not yet reused) until
    // then.
    let mut watched: FxHashMap<u64, Arc<dyn Source>> = FxHashMap::default();
    // Sources polled while spinning, with when they last had work; while
    // non-empty the thread spins. With more than FEW sources, every other
    // source is armed, so its completions raise events.
    let mut hot: Vec<Hot> = Vec::new();
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; EVENTS];
    let mut idle_ticks = 0u32;
    let spins = !spin.is_zero();
    // The last round ended in a nap: take the events raised meanwhile
    // without waiting.
    let mut napped = false;
    // The sources napped on (their items came bunched), polled unarmed
    // after each nap while their items keep coming.
    let mut napping: Vec<(u64, Arc<dyn Source>)> = Vec::new();
    // Of those, the ones whose fd was readable after the nap.
    let mut napping_evented: Vec<u64> = Vec::with_capacity(EVENTS);
    // Sources whose items came bunched in this round, napped on from now.
    let mut bunched: Vec<(u64, Arc<dyn Source>)> = Vec::new();
    // Sources that stopped at their share with items left (`Ready::More`):
    // `ready`d again on the next round, after the events.
    let mut again = Turns::default();
    // This round's turns, taken from `again`; kept for its room.
    let mut turns = Turns::default();
    while !shared.stop.load(Ordering::SeqCst) {
        let spinning = !hot.is_empty();
        // Ticks waited for when this wait times out.
        let ticks = if spinning || watched.values().any(|s| s.wants_tick()) {
            1
        } else {
            LOOK_ALL_EVERY
        };
        let timeout = if spinning || napped || !again.is_empty() {
            0
        } else if ticks == LOOK_ALL_EVERY && !watched.values().any(|s| s.needs_looks()) {
            -1 // Until an event, or a wake (a change to the set, a stop).
        } else {
            tick_ms.saturating_mul(ticks as i32)
        };
        let n = shared.wait(&mut events, timeout);
        shared.pending.store(false, Ordering::SeqCst);
        let now = Instant::now();
        let mut changed = false;
        napping_evented.clear();
        // This round's turns for what had items left: a source whose event
        // came too gets the one turn, below.
        again.move_into(&mut turns);
        for ev in &events[..n] {
            let key = ev.u64;
            if key == WAKE_KEY {
                let mut buf = 0u64;
                // SAFETY: reads 8 bytes from our eventfd.
                unsafe { libc::read(shared.wake, (&mut buf as *mut u64).cast(), 8) };
                changed = true;
            } else if napping.iter().any(|(k, _)| *k == key) {
                napping_evented.push(key);
            } else if let Some(source) = watched.get(&key) {
                if turns.owes(key) {
                    continue;
                }
                match source.ready() {
                    Ready::Bunched if !nap.is_zero() => bunched.push((key, source.clone())),
                    Ready::More => again.owe(key, source),
                    _ => {}
                }
                if spins {
                    mark_hot(&mut hot, key, source, now);
                }
            }
        }
        if changed {
            for (key, source) in update_watched(shared, &mut watched) {
                // Armed, and whatever came before handled.
                if source.ready() == Ready::More {
                    again.owe(key, &source);
                }
            }
            hot.retain(|h| watched.contains_key(&h.key));
            napping.retain(|(key, _)| watched.contains_key(key));
            bunched.retain(|(key, _)| watched.contains_key(key));
            turns.retain_watched(&watched);
            again.retain_watched(&watched);
            // A wake may carry work queued by another thread.
            for (key, source) in &watched {
                if source.poll_once() && spins {
                    mark_hot(&mut hot, *key, source, now);
                }
            }
        }
        // Idle only if the wait timed out (a round for owed turns did not
        // wait).
        if n == 0 && timeout != 0 {
            idle_ticks += ticks;
            if idle_ticks >= LOOK_ALL_EVERY {
                idle_ticks = 0;
                // Every source gets a look now and then, which bounds the
                // cost of any lost wakeup; not on every tick, as that
                // costs a syscall or two per connection.
                for (key, source) in &watched {
                    if source.ready() == Ready::More {
                        again.owe(*key, source);
                    }
                }
            }
        }
        for (key, source) in turns.drain() {
            match source.ready() {
                Ready::Bunched if !nap.is_zero() => bunched.push((key, source)),
                Ready::More => again.owe(key, &source),
                _ => {}
            }
        }
        if napped {
            // Napped on and still busy, or (armed again by `ready`) bunched
            // again; the rest leave.
            napping.retain(|(key, source)| {
                if source.nap_poll(napping_evented.contains(key)) {
                    return true;
                }
                match source.ready() {
                    Ready::Done => false,
                    Ready::Bunched => true,
                    Ready::More => {
                        again.owe(*key, source);
                        false
                    }
                }
            });
        }
        napping.append(&mut bunched);
        napped = false;
        let mut spun = false;
        if !hot.is_empty() {
            let mut allowed = Spin::start(Instant::now());
            spun = allowed.is_some();
            spin_passes(
                shared,
                &watched,
                spin,
                allowed.as_mut(),
                &mut hot,
                &mut events,
                &mut again,
            );
        }
        let nap_now = !spun
            && hot.is_empty()
            && again.is_empty()
            && !shared.pending.load(Ordering::SeqCst)
            && !shared.stop.load(Ordering::SeqCst);
        if nap_now && !napping.is_empty() {
            shared.nap(nap);
            napped = true;
        } else {
            // A spin took over, or something else needs the thread: armed
            // again, unless the spin did it or still polls them (a spin
            // over many sources leaves the ones it did not poll as they
            // were).
            let few = watched.len() <= FEW;
            for (key, source) in drain_if_any(&mut napping) {
                let spin_has_it = spun && (few || hot.iter().any(|h| h.key == key));
                if !spin_has_it && source.ready() == Ready::More {
                    again.owe(key, &source);
                }
            }
        }
        // The clock read after the wait serves, unless the thread spun
        // since (a spin may last `spin`): a read costs ~100 ns in a VM.
        let at = if spun { Instant::now() } else { now };
        if at >= next_tick {
            next_tick = at + tick;
            for source in watched.values() {
                source.tick();
            }
        }
    }
}

/// Brings the epoll set in line with the sources; returns the new ones.
fn update_watched(
    shared: &Shared,
    watched: &mut FxHashMap<u64, Arc<dyn Source>>,
) -> Vec<(u64, Arc<dyn Source>)> {
    let current: FxHashMap<u64, Arc<dyn Source>> = shared
        .sources
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|(&key, s)| (key, s.clone()))
        .collect();
    // Removals first: a new source may have been given a removed one's fd
    // number only if that fd was closed, which took it out of the set.
    watched.retain(|key, source| {
        let keep = current.contains_key(key);
        if !keep {
            shared.watch(source.fd(), *key, false);
        }
        keep
    });
    let mut added = Vec::new();
    for (key, source) in current {
        if let std::collections::hash_map::Entry::Vacant(slot) = watched.entry(key) {
            shared.watch(source.fd(), key, true);
            added.push((key, source.clone()));
            slot.insert(source);
        }
    }
    added
}

/// Sources owed a turn because they stopped with items left
/// ([`Ready::More`]), each once however many times it said so, in the
/// order they said it; looked up by key in constant time (a flood over many
/// connections owes many turns a round).
#[derive(Default)]
struct Turns {
    order: Vec<(u64, Arc<dyn Source>)>,
    owed: FxHashSet<u64>,
    /// Room for [`Turns::serve`]'s list, kept so that serving allocates
    /// nothing.
    spare: Vec<(u64, Arc<dyn Source>)>,
}

impl Turns {
    fn owe(&mut self, key: u64, source: &Arc<dyn Source>) {
        if self.owed.insert(key) {
            self.order.push((key, source.clone()));
        }
    }

    fn owes(&self, key: u64) -> bool {
        self.owed.contains(&key)
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Drops the turns of sources no longer watched.
    fn retain_watched(&mut self, watched: &FxHashMap<u64, Arc<dyn Source>>) {
        self.order.retain(|(key, _)| watched.contains_key(key));
        self.owed.retain(|key| watched.contains_key(key));
    }

    /// Moves the turns owed into `into` (emptied first, its room kept for
    /// the next round), leaving none owed.
    fn move_into(&mut self, into: &mut Turns) {
        into.order.clear();
        into.owed.clear();
        std::mem::swap(self, into);
    }

    /// Gives every owed turn, in order, to `ready`; the ones it answers
    /// [`Ready::More`] are owed again, after the others.
    fn serve(&mut self, mut ready: impl FnMut(u64, &Arc<dyn Source>) -> Ready) {
        let mut serving = std::mem::take(&mut self.spare);
        std::mem::swap(&mut serving, &mut self.order);
        self.owed.clear();
        for (key, source) in serving.drain(..) {
            if ready(key, &source) == Ready::More {
                self.owe(key, &source);
            }
        }
        self.spare = serving;
    }

    /// The turns, in order; none is owed afterwards.
    fn drain(&mut self) -> impl Iterator<Item = (u64, Arc<dyn Source>)> + '_ {
        self.owed.clear();
        drain_if_any(&mut self.order)
    }
}

/// Drains `v`, without a drain (whose drop is not free) when it is empty.
fn drain_if_any<T>(v: &mut Vec<T>) -> impl Iterator<Item = T> + '_ {
    let any = !v.is_empty();
    any.then(|| v.drain(..)).into_iter().flatten()
}

/// A source the spinning thread polls on every pass.
struct Hot {
    key: u64,
    source: Arc<dyn Source>,
    /// When it last had work.
    last: Instant,
}

fn mark_hot(hot: &mut Vec<Hot>, key: u64, source: &Arc<dyn Source>, now: Instant) {
    match hot.iter_mut().find(|h| h.key == key) {
        Some(h) => h.last = now,
        None => hot.push(Hot {
            key,
            source: source.clone(),
            last: now,
        }),
    }
}

/// How many times `spin` a source stays among those polled on every pass
/// after its last work, while the thread spins for others: a client that
/// sends every few hundred microseconds is then found by polling, not by
/// an event (a syscall or two each way).
const HOT_FOR_SPINS: u32 = 8;

/// Polls without waiting until no source has had work for `spin` (then
/// every source is armed and `hot` empty), or until the thread is stopped
/// or woken (then `hot` is left as it is, for the caller to come straight
/// back, with the sources not in it armed). Without `allowed` (too many
/// threads spin) or once it says the thread lost its CPU, one pass, then
/// every source armed. A source `ready`d here that had items left goes to
/// `again`.
fn spin_passes(
    shared: &Shared,
    watched: &FxHashMap<u64, Arc<dyn Source>>,
    spin: Duration,
    mut allowed: Option<&mut Spin>,
    hot: &mut Vec<Hot>,
    events: &mut [libc::epoll_event],
    again: &mut Turns,
) {
    let few = watched.len() <= FEW;
    let hot_for = spin * HOT_FOR_SPINS;
    let mut last_work = hot.iter().map(|h| h.last).max();
    let mut last_look: Option<Instant> = None;
    let mut last_turns: Option<Instant> = None;
    // Whatever leaves the polled set below, or is not in `hot` when this
    // returns, is `ready`d; the rest is polled again at once.
    if few {
        watched.values().for_each(|s| s.spun());
    } else {
        hot.iter().for_each(|h| h.source.spun());
    }
    loop {
        let now = Instant::now();
        if few {
            for (key, source) in watched {
                if source.poll_once() {
                    mark_hot(hot, *key, source, now);
                    last_work = Some(now);
                }
            }
        } else {
            for h in hot.iter_mut() {
                if h.source.poll_once() {
                    h.last = now;
                    last_work = Some(now);
                }
            }
            if last_look.is_none_or(|at| now.duration_since(at) >= EVENT_LOOK_INTERVAL) {
                last_look = Some(now);
                // The wake is left to the caller: it is level-triggered,
                // and `pending` ends this loop.
                let n = shared.wait(events, 0);
                for ev in &events[..n] {
                    let key = ev.u64;
                    let Some(source) = watched.get(&key) else {
                        continue;
                    };
                    match source.woken() {
                        None => {
                            source.spun();
                            mark_hot(hot, key, source, now);
                            last_work = Some(now);
                        }
                        Some(Ready::More) => again.owe(key, source),
                        Some(_) => {}
                    }
                }
            }
        }
        // Turns owed (sources this spin does not poll, such as those left
        // to their callers) come round while it lasts, not only after.
        if !again.is_empty()
            && last_turns.is_none_or(|at| now.duration_since(at) >= EVENT_LOOK_INTERVAL)
        {
            last_turns = Some(now);
            again.serve(|key, source| match watched.contains_key(&key) {
                true => source.ready(),
                false => Ready::Done,
            });
        }
        let may_spin = allowed.as_mut().is_some_and(|s| s.pass(now));
        let quiet = !may_spin || last_work.is_none_or(|at| now.duration_since(at) >= spin);
        hot.retain(|h| {
            let keep = !quiet && now.duration_since(h.last) < hot_for;
            if !keep && !few && h.source.ready() == Ready::More {
                // Armed, so its next completion raises an event; what it
                // left gets its turn.
                again.owe(h.key, &h.source);
            }
            keep
        });
        let stopping = shared.stop.load(Ordering::Relaxed);
        if hot.is_empty() || stopping || shared.pending.load(Ordering::Relaxed) {
            if few {
                // Polled on every pass, so none is armed; the ones still
                // busy are polled again at once.
                for (key, source) in watched {
                    if !hot.iter().any(|h| h.key == *key) && source.ready() == Ready::More {
                        again.owe(*key, source);
                    }
                }
            }
            return;
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests;
