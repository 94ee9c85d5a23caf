//! The poller thread's own tests: sources over eventfds, no RDMA.

use super::*;
use std::sync::atomic::AtomicUsize;

/// A source over an eventfd: readable once `signal`led; `busy` makes
/// every poll find work; `ready` says its items came `bunched`, or that
/// it has items left while `more` turns remain.
struct Probe {
    fd: RawFd,
    busy: AtomicBool,
    bunched: AtomicBool,
    more: AtomicUsize,
    /// Whether `woken` asks to be polled (else it says what `ready` did,
    /// as a connection left to its callers does).
    pollable: AtomicBool,
    readies: AtomicUsize,
    polls: AtomicUsize,
    wants_tick: AtomicBool,
    ticks: AtomicUsize,
    needs_looks: AtomicBool,
    /// Between `spun` and the next `ready`: polled unarmed.
    spun: AtomicBool,
    /// What `nap_poll` says: its items still come bunched.
    nap_busy: AtomicBool,
    nap_polls: AtomicUsize,
}

impl Probe {
    fn new() -> Arc<Probe> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        Arc::new(Probe {
            fd,
            busy: AtomicBool::new(false),
            bunched: AtomicBool::new(false),
            more: AtomicUsize::new(0),
            pollable: AtomicBool::new(true),
            readies: AtomicUsize::new(0),
            polls: AtomicUsize::new(0),
            wants_tick: AtomicBool::new(false),
            ticks: AtomicUsize::new(0),
            needs_looks: AtomicBool::new(true),
            spun: AtomicBool::new(false),
            nap_busy: AtomicBool::new(false),
            nap_polls: AtomicUsize::new(0),
        })
    }

    fn signal(&self) {
        let one = 1u64;
        // SAFETY: 8 bytes to our eventfd.
        unsafe { libc::write(self.fd, (&one as *const u64).cast(), 8) };
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        // SAFETY: ours, closed once.
        unsafe { libc::close(self.fd) };
    }
}

impl Source for Probe {
    fn fd(&self) -> RawFd {
        self.fd
    }
    fn ready(&self) -> Ready {
        let mut buf = 0u64;
        // SAFETY: 8 bytes from our eventfd (EAGAIN when unsignalled).
        unsafe { libc::read(self.fd, (&mut buf as *mut u64).cast(), 8) };
        self.spun.store(false, Ordering::SeqCst);
        self.readies.fetch_add(1, Ordering::SeqCst);
        let left = self
            .more
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if left.is_ok() {
            Ready::More
        } else if self.bunched.load(Ordering::SeqCst) {
            Ready::Bunched
        } else {
            Ready::Done
        }
    }
    fn spun(&self) {
        self.spun.store(true, Ordering::SeqCst);
    }
    fn poll_once(&self) -> bool {
        self.polls.fetch_add(1, Ordering::SeqCst);
        self.busy.load(Ordering::SeqCst)
    }
    fn woken(&self) -> Option<Ready> {
        let ready = self.ready();
        (!self.pollable.load(Ordering::SeqCst)).then_some(ready)
    }
    fn nap_poll(&self, _evented: bool) -> bool {
        self.nap_polls.fetch_add(1, Ordering::SeqCst);
        self.nap_busy.load(Ordering::SeqCst)
    }
    fn wants_tick(&self) -> bool {
        self.wants_tick.load(Ordering::SeqCst)
    }
    fn tick(&self) {
        self.ticks.fetch_add(1, Ordering::SeqCst);
    }
    fn needs_looks(&self) -> bool {
        self.needs_looks.load(Ordering::SeqCst)
    }
}

fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A poller that never spins, ticking every `tick`.
fn sleeping_poller(name: &str, tick: Duration) -> Poller {
    Poller::start(name, tick, Duration::ZERO, Duration::ZERO, || {}).unwrap()
}

/// A poller that spins `spin` after the last work, with `probes` added
/// and the first of them busy and being polled.
fn spinning_with_busy(probes: &[Arc<Probe>], spin: Duration) -> Poller {
    let poller = Poller::start(
        crate::runtime::spin::ALWAYS_SPINNING_TEST_THREAD,
        Duration::from_millis(10),
        spin,
        Duration::ZERO,
        || {},
    )
    .unwrap();
    for p in probes {
        poller.add(p.clone());
    }
    let busy = &probes[0];
    busy.busy.store(true, Ordering::SeqCst);
    busy.signal();
    until("the busy source is polled", || {
        busy.polls.load(Ordering::SeqCst) > 10_000
    });
    poller
}

/// A poller that spins for good once work came, as `spinning_with_busy`.
fn spinning_for(probes: &[Arc<Probe>]) -> Poller {
    spinning_with_busy(probes, Duration::from_secs(60))
}

#[test]
fn a_spinning_thread_polls_the_busy_source_and_hears_the_quiet_ones() {
    let probes: Vec<Arc<Probe>> = (0..2 * FEW).map(|_| Probe::new()).collect();
    let _poller = spinning_for(&probes);
    // A quiet source's event is heard while the thread spins.
    let quiet = &probes[7];
    let before = quiet.readies.load(Ordering::SeqCst);
    quiet.signal();
    until("the quiet source's event is handled", || {
        quiet.readies.load(Ordering::SeqCst) > before
    });
    // And the quiet ones are not polled on every pass.
    let idle_polls = probes[3].polls.load(Ordering::SeqCst);
    let busy_polls = probes[0].polls.load(Ordering::SeqCst);
    assert!(
        idle_polls * 100 < busy_polls,
        "an idle source was polled {idle_polls} times, the busy one {busy_polls}"
    );
}

#[test]
fn every_source_polled_unarmed_is_made_ready_when_the_spin_ends() {
    // A connection leaves arming to the spinner while it is polled
    // unarmed: one the spinner then dropped without `ready` would
    // raise no event for that work.
    for n in [2, 2 * FEW] {
        let probes: Vec<Arc<Probe>> = (0..n).map(|_| Probe::new()).collect();
        let _poller = spinning_with_busy(&probes, Duration::from_millis(20));
        let busy = &probes[0];
        until("the busy source is polled unarmed", || {
            busy.spun.load(Ordering::SeqCst)
        });
        busy.busy.store(false, Ordering::SeqCst);
        until("the spin ends", || {
            let before = busy.polls.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(100));
            busy.polls.load(Ordering::SeqCst) == before
        });
        for (i, p) in probes.iter().enumerate() {
            assert!(
                !p.spun.load(Ordering::SeqCst),
                "source {i} of {n} was left polled unarmed by a thread that stopped polling it"
            );
        }
    }
}

#[test]
fn a_source_added_while_the_thread_spins_is_served() {
    let busy = Probe::new();
    let poller = spinning_for(std::slice::from_ref(&busy));
    // Before, a spinning thread kept to the sources it started with for
    // as long as any of them was busy.
    let late = Probe::new();
    late.signal();
    poller.add(late.clone());
    until("the new source is served", || {
        late.readies.load(Ordering::SeqCst) > 0
    });
}

#[test]
fn an_idle_thread_ticks_only_while_a_source_wants_ticks() {
    let poller = sleeping_poller("test-idle", Duration::from_millis(5));
    let probe = Probe::new();
    poller.add(probe.clone());
    // Settled: the add's wake handled, the thread asleep.
    std::thread::sleep(Duration::from_millis(50));
    let before = probe.ticks.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(200));
    // Forty ticks' time: at most the one after the wake.
    assert!(probe.ticks.load(Ordering::SeqCst) <= before + 1);
    probe.wants_tick.store(true, Ordering::SeqCst);
    poller.wake();
    until("ticks come while wanted", || {
        probe.ticks.load(Ordering::SeqCst) >= before + 10
    });
    // An event still wakes the sleeping thread at once.
    probe.wants_tick.store(false, Ordering::SeqCst);
    let readies = probe.readies.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(20));
    probe.signal();
    until("the event is served", || {
        probe.readies.load(Ordering::SeqCst) > readies
    });
}

#[test]
fn an_idle_thread_looks_at_its_sources_only_if_one_needs_looks() {
    // A look every 100 ticks of 1 ms.
    let poller = sleeping_poller("test-looks", Duration::from_millis(1));
    let probe = Probe::new();
    probe.needs_looks.store(false, Ordering::SeqCst);
    poller.add(probe.clone());
    // The add's wake handled (one `ready`), the thread asleep.
    until("the add is handled", || {
        probe.readies.load(Ordering::SeqCst) == 1
    });
    let before = 1;
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(
        probe.readies.load(Ordering::SeqCst),
        before,
        "three looks' time, and none"
    );
    // An event still wakes the thread at once.
    probe.signal();
    until("the event is served", || {
        probe.readies.load(Ordering::SeqCst) > before
    });
    // Once a source needs looks, they come without events.
    probe.needs_looks.store(true, Ordering::SeqCst);
    poller.wake();
    let woken = probe.readies.load(Ordering::SeqCst);
    until("looks come", || {
        probe.readies.load(Ordering::SeqCst) >= woken + 3
    });
}

/// Panics whenever it is told its fd is readable.
struct Faulty {
    probe: Arc<Probe>,
    panics: AtomicUsize,
}

impl Source for Faulty {
    fn fd(&self) -> RawFd {
        self.probe.fd
    }
    fn ready(&self) -> Ready {
        self.probe.ready();
        panic!("a defect in a source");
    }
    fn panicked(&self) {
        self.panics.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_panicking_source_does_not_end_the_thread() {
    let poller = sleeping_poller("test-poller", Duration::from_millis(10));
    let faulty = Arc::new(Faulty {
        probe: Probe::new(),
        panics: AtomicUsize::new(0),
    });
    let good = Probe::new();
    poller.add(faulty.clone());
    poller.add(good.clone());
    faulty.probe.signal();
    until("the panic is reported", || {
        faulty.panics.load(Ordering::SeqCst) > 0
    });
    // The thread still serves the other source, and the faulty one too.
    let before = good.readies.load(Ordering::SeqCst);
    good.signal();
    faulty.probe.signal();
    until("the good source is still served", || {
        good.readies.load(Ordering::SeqCst) > before
    });
    until("the faulty one too", || {
        faulty.panics.load(Ordering::SeqCst) > 1
    });
}

/// A poller that never spins and naps `nap`, with one probe added (and
/// made ready once), which needs no looks.
fn napping_poller(name: &str, nap: Duration) -> (Poller, Arc<Probe>) {
    let poller =
        Poller::start(name, Duration::from_millis(10), Duration::ZERO, nap, || {}).unwrap();
    let probe = Probe::new();
    probe.needs_looks.store(false, Ordering::SeqCst);
    poller.add(probe.clone());
    until("the add is handled", || {
        probe.readies.load(Ordering::SeqCst) == 1
    });
    (poller, probe)
}

#[test]
fn a_thread_that_may_not_spin_naps_after_a_bunch_and_only_then() {
    // Long, so that "served at once" cannot be mistaken for a nap on a
    // slow machine.
    const NAP: Duration = Duration::from_secs(2);
    let (poller, probe) = napping_poller("test-nap", NAP);
    let served = |n: usize| {
        probe.signal();
        until("the event is served", || {
            probe.readies.load(Ordering::SeqCst) == n
        });
    };
    // Not bunched: each next event is served at once.
    let t = Instant::now();
    served(2);
    served(3);
    assert!(t.elapsed() < NAP, "single items waited {:?}", t.elapsed());
    // Bunched: the next event waits until the nap ends.
    probe.bunched.store(true, Ordering::SeqCst);
    served(4);
    let bunch = Instant::now();
    served(5);
    assert!(
        bunch.elapsed() >= NAP / 2,
        "the event after a bunch came {:?} after it",
        bunch.elapsed()
    );
    // A wake (a change to the set, queued work, a stop) ends a nap.
    served(6);
    let bunch = Instant::now();
    probe.signal();
    poller.wake();
    until("the event is served", || {
        probe.readies.load(Ordering::SeqCst) == 7
    });
    assert!(bunch.elapsed() < NAP, "a wake did not end the nap");
}

#[test]
fn a_source_napped_on_is_polled_unarmed_until_its_items_stop_coming() {
    const NAP: Duration = Duration::from_millis(5);
    let (_poller, probe) = napping_poller("test-nap-poll", NAP);
    probe.bunched.store(true, Ordering::SeqCst);
    probe.nap_busy.store(true, Ordering::SeqCst);
    probe.signal();
    until("the bunch is served", || {
        probe.readies.load(Ordering::SeqCst) == 2
    });
    // While its items keep coming, each nap ends in an unarmed poll, not
    // in `ready` (which would arm it).
    until("several naps", || {
        probe.nap_polls.load(Ordering::SeqCst) >= 5
    });
    assert_eq!(
        probe.readies.load(Ordering::SeqCst),
        2,
        "armed between naps"
    );
    // The stream stops: armed again once, and the naps end.
    probe.bunched.store(false, Ordering::SeqCst);
    probe.nap_busy.store(false, Ordering::SeqCst);
    until("armed again", || probe.readies.load(Ordering::SeqCst) == 3);
    let polls = probe.nap_polls.load(Ordering::SeqCst);
    std::thread::sleep(NAP * 20);
    assert_eq!(
        probe.nap_polls.load(Ordering::SeqCst),
        polls,
        "still napping"
    );
    assert_eq!(probe.readies.load(Ordering::SeqCst), 3);
    // A bunch again, then an item: taken after the nap by the unarmed poll.
    probe.bunched.store(true, Ordering::SeqCst);
    probe.signal();
    until("the bunch is served", || {
        probe.readies.load(Ordering::SeqCst) == 4
    });
    probe.signal();
    until("the nap's poll", || {
        probe.nap_polls.load(Ordering::SeqCst) > polls
    });
}

#[test]
fn a_source_with_items_left_gets_turns_without_events_and_the_others_theirs() {
    // No ticks or looks for 100 s: only events and turns make `ready` calls.
    let poller = sleeping_poller("test-poller", Duration::from_secs(1));
    let busy = Probe::new();
    let quiet = Probe::new();
    poller.add(busy.clone());
    poller.add(quiet.clone());
    until("both are made ready when added", || {
        busy.readies.load(Ordering::SeqCst) >= 1 && quiet.readies.load(Ordering::SeqCst) >= 1
    });
    busy.more.store(usize::MAX, Ordering::SeqCst);
    let turns = busy.readies.load(Ordering::SeqCst);
    busy.signal();
    until("turns come without events", || {
        busy.readies.load(Ordering::SeqCst) >= turns + 100
    });
    for _ in 0..3 {
        let served = quiet.readies.load(Ordering::SeqCst);
        quiet.signal();
        until(
            "the quiet source is served while the busy one has more",
            || quiet.readies.load(Ordering::SeqCst) > served,
        );
    }
    busy.more.store(0, Ordering::SeqCst);
    // One turn may be under way; then no more.
    std::thread::sleep(Duration::from_millis(20));
    let last = busy.readies.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        busy.readies.load(Ordering::SeqCst),
        last,
        "turns after it had no more"
    );
}

#[test]
fn a_source_not_polled_by_the_spin_gets_its_turns_while_the_thread_spins() {
    // Many sources: the spin polls the busy one and hears the others'
    // events; one of them, not pollable, has items left for 50 turns.
    let probes: Vec<Arc<Probe>> = (0..2 * FEW).map(|_| Probe::new()).collect();
    let _poller = spinning_for(&probes);
    let left = &probes[5];
    left.pollable.store(false, Ordering::SeqCst);
    left.more.store(50, Ordering::SeqCst);
    let before = left.readies.load(Ordering::SeqCst);
    left.signal();
    until(
        "its turns come while the busy source keeps the spin going",
        || left.readies.load(Ordering::SeqCst) > before + 50,
    );
}

#[test]
fn turns_are_owed_once_each_in_order_and_dropped_with_their_source() {
    let sources: Vec<Arc<dyn Source>> = (0..3).map(|_| Probe::new() as Arc<dyn Source>).collect();
    let mut again = Turns::default();
    for key in [2, 0, 2, 1, 0] {
        again.owe(key, &sources[key as usize]);
    }
    let mut turns = Turns::default();
    again.move_into(&mut turns);
    assert!(again.is_empty() && !again.owes(2), "all moved");
    assert!(turns.owes(0) && turns.owes(1) && turns.owes(2));
    // Source 1 is no longer watched.
    let watched: FxHashMap<u64, Arc<dyn Source>> =
        [(0, sources[0].clone()), (2, sources[2].clone())]
            .into_iter()
            .collect();
    turns.retain_watched(&watched);
    assert!(!turns.owes(1));
    let order: Vec<u64> = turns.drain().map(|(key, _)| key).collect();
    assert_eq!(order, [2, 0]);
    assert!(turns.is_empty() && !turns.owes(2));
    turns.owe(2, &sources[2]);
    assert!(turns.owes(2), "owed afresh after a drain");
}

#[test]
fn served_turns_go_in_order_and_the_unfinished_ones_are_owed_again() {
    let sources: Vec<Arc<dyn Source>> = (0..3).map(|_| Probe::new() as Arc<dyn Source>).collect();
    let mut again = Turns::default();
    for key in [1, 0, 2] {
        again.owe(key, &sources[key as usize]);
    }
    let mut seen = Vec::new();
    again.serve(|key, _| {
        seen.push(key);
        if key == 0 {
            Ready::More
        } else {
            Ready::Done
        }
    });
    assert_eq!(seen, [1, 0, 2]);
    assert!(again.owes(0) && !again.owes(1) && !again.owes(2));
    let left: Vec<u64> = again.drain().map(|(key, _)| key).collect();
    assert_eq!(left, [0]);
}
