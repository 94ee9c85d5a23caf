//! One client's write targets: those it holds (asked for, not yet stored
//! or released) and those it has asked for that are still being made.
//!
//! Room is reserved when an ALLOC arrives, before it waits for a worker:
//! a client that sends ALLOCs and RELEASEs of the tokens they will get
//! (tokens are counted, so it can know them) would otherwise have its
//! worker map and register up to its share again for every pair in its
//! queue, while the other clients of that worker wait. So at most its
//! share, and [`MAX_TARGETS`] targets, are held or being made at once.
//!
//! Room comes back as a PUT that commits a target, or a RELEASE that ends
//! it, is queued for the worker (`leaving`), not when the worker reaches
//! it: the worker serves a client's requests in order, so it takes that
//! target before it makes any target asked for after. Threads sharing a
//! client then see an ALLOC granted as soon as another's PUT is on its way,
//! as when room was counted by the worker, and what is registered for the
//! client still stays within its share, but for targets ended while their
//! windows' binds wait behind replies the client does not take: those
//! stay registered with the connection for up to a second, 16 at most
//! (`Window::release_with`).

use std::collections::HashMap;

use crate::kv::store::Target;

/// Write targets one client may hold or have asked for at once.
pub(super) const MAX_TARGETS: usize = 8;

/// What a write target is to its client's list: its size.
pub(super) trait TargetLen {
    fn target_len(&self) -> u64;
}

impl TargetLen for Target {
    fn target_len(&self) -> u64 {
        self.value_len() as u64
    }
}

/// Why an ALLOC found no room.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NoRoom {
    /// [`MAX_TARGETS`] are held or being made.
    Count,
    /// The client holds or has asked for `has` bytes, and may have `cap`.
    Bytes { has: u64, cap: u64 },
}

/// A target made for the client, and whether a request that takes it is
/// already queued for the worker.
struct Held<T> {
    target: T,
    leaving: bool,
}

pub(super) struct Targets<T = Target> {
    held: HashMap<u64, Held<T>>,
    /// ALLOCs taken and not yet answered, and their bytes.
    asking: usize,
    asked: u64,
}

impl<T> Default for Targets<T> {
    fn default() -> Self {
        Targets {
            held: HashMap::new(),
            asking: 0,
            asked: 0,
        }
    }
}

impl<T: TargetLen> Targets<T> {
    /// Reserves room for a target of `len` bytes under a share of `cap`
    /// bytes. A client with none held or asked for always gets one: a
    /// share below the largest value makes large PUTs go one at a time,
    /// and fails none.
    pub(super) fn reserve(&mut self, len: u64, cap: u64) -> Result<(), NoRoom> {
        let staying = self.held.values().filter(|h| !h.leaving);
        if staying.clone().count() + self.asking >= MAX_TARGETS {
            return Err(NoRoom::Count);
        }
        let held: u64 = staying.map(|h| h.target.target_len()).sum();
        let has = self.asked.saturating_add(held);
        if has > 0 && has.saturating_add(len) > cap {
            return Err(NoRoom::Bytes { has, cap });
        }
        self.asking += 1;
        self.asked = self.asked.saturating_add(len);
        Ok(())
    }

    /// The ALLOC that reserved `len` bytes is answered; `made` is its
    /// target, if one was made, filed under `token`.
    pub(super) fn answered(&mut self, len: u64, made: Option<(u64, T)>) {
        self.asking = self.asking.saturating_sub(1);
        self.asked = self.asked.saturating_sub(len);
        if let Some((token, target)) = made {
            let leaving = false;
            self.held.insert(token, Held { target, leaving });
        }
    }

    /// A request that takes the target filed under `token` (a PUT that
    /// commits it, a RELEASE) is queued for the worker: it no longer
    /// counts against the share. Nothing, for a token not held.
    pub(super) fn leaving(&mut self, token: u64) {
        if let Some(held) = self.held.get_mut(&token) {
            held.leaving = true;
        }
    }

    /// Takes the target filed under `token` (to store or release it).
    pub(super) fn take(&mut self, token: u64) -> Option<T> {
        self.held.remove(&token).map(|h| h.target)
    }

    /// Takes every target (the client went away), for the caller to end
    /// once it let go of the list's lock: ending one unregisters and
    /// unmaps memory.
    pub(super) fn take_all(&mut self) -> Vec<T> {
        self.held.drain().map(|(_, h)| h.target).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl TargetLen for u64 {
        fn target_len(&self) -> u64 {
            *self
        }
    }

    #[test]
    fn a_client_with_nothing_gets_one_of_any_size_and_room_comes_back() {
        let mut t = Targets::<u64>::default();
        assert_eq!(t.reserve(10, 4), Ok(()), "the first, past the share");
        assert_eq!(t.reserve(1, 4), Err(NoRoom::Bytes { has: 10, cap: 4 }));
        t.answered(10, Some((1, 10)));
        assert_eq!(t.reserve(1, 4), Err(NoRoom::Bytes { has: 10, cap: 4 }));
        t.leaving(2);
        assert_eq!(
            t.reserve(1, 4),
            Err(NoRoom::Bytes { has: 10, cap: 4 }),
            "a token not held frees nothing"
        );
        t.leaving(1);
        assert_eq!(t.reserve(1, 4), Ok(()), "room back once it is leaving");
        t.answered(1, None);
        assert_eq!(t.take(1), Some(10));
        assert_eq!(t.reserve(3, 4), Ok(()));
        t.answered(3, None);
        assert_eq!(
            t.reserve(4, 4),
            Ok(()),
            "a refused ALLOC gives its room back"
        );
    }

    #[test]
    fn at_most_max_targets_are_held_or_asked_for() {
        let mut t = Targets::<u64>::default();
        for token in 0..MAX_TARGETS as u64 {
            assert_eq!(t.reserve(1, u64::MAX), Ok(()));
            if token % 2 == 0 {
                t.answered(1, Some((token, 1)));
            }
        }
        assert_eq!(t.reserve(1, u64::MAX), Err(NoRoom::Count));
        t.take_all();
        for _ in 0..MAX_TARGETS / 2 {
            assert_eq!(t.reserve(1, u64::MAX), Ok(()), "four held ended");
        }
        assert_eq!(
            t.reserve(1, u64::MAX),
            Err(NoRoom::Count),
            "eight asked for"
        );
    }

    proptest! {
        /// Whatever a client asks for, answers, releases and queues to
        /// leave, what it holds (not leaving) and asks for together stays
        /// within its share (past it only with a single target) and within
        /// MAX_TARGETS.
        #[test]
        fn held_and_asked_stay_within_the_share(
            steps in proptest::collection::vec((0u8..4, 1u64..100), 1..200),
            cap in 1u64..300,
        ) {
            let mut t = Targets::<u64>::default();
            let mut asked: Vec<u64> = Vec::new();
            let mut next = 0u64;
            for (what, len) in steps {
                match what {
                    0 => {
                        if t.reserve(len, cap).is_ok() {
                            asked.push(len);
                        }
                    }
                    1 => {
                        if let Some(len) = asked.pop() {
                            next += 1;
                            t.answered(len, (len % 3 != 0).then_some((next, len)));
                        }
                    }
                    2 => {
                        let some = t.held.keys().next().copied();
                        if let Some(token) = some {
                            t.take(token);
                        }
                    }
                    _ => {
                        let some = t.held.keys().nth(len as usize % 3).copied();
                        if let Some(token) = some {
                            t.leaving(token);
                        }
                    }
                }
                let staying = t.held.values().filter(|h| !h.leaving);
                let held: u64 = staying.clone().map(|h| h.target).sum();
                let count = staying.count() + t.asking;
                prop_assert_eq!(t.asked, asked.iter().sum::<u64>());
                prop_assert!(count <= MAX_TARGETS);
                prop_assert!(held + t.asked <= cap || count == 1);
            }
        }

        /// The claim `leaving` rests on, in a model of one client: room is
        /// reserved as an ALLOC arrives, a PUT or RELEASE marks its target
        /// leaving as it is queued, and one worker serves the queue in
        /// order. Whenever the worker makes a target, what is registered
        /// for the client (leaving targets included) stays within the
        /// share (past it only alone) and within MAX_TARGETS.
        #[test]
        fn what_is_registered_stays_within_the_share_when_a_target_is_made(
            steps in proptest::collection::vec((0u8..4, 1u64..100), 1..300),
            cap in 1u64..300,
        ) {
            enum Job {
                Make(u64),
                Take(u64),
            }
            let mut t = Targets::<u64>::default();
            let mut queue = std::collections::VecDeque::new();
            let mut next = 0u64;
            for (what, n) in steps {
                match what {
                    // An ALLOC arrives.
                    0 => {
                        if t.reserve(n, cap).is_ok() {
                            queue.push_back(Job::Make(n));
                        }
                    }
                    // A PUT or RELEASE of a token, held, asked for or not.
                    1 | 2 => {
                        let token = next.saturating_sub(n % 4) + n % 2;
                        queue.push_back(Job::Take(token));
                        t.leaving(token);
                    }
                    // The worker serves the next request.
                    _ => match queue.pop_front() {
                        Some(Job::Make(len)) => {
                            let registered: u64 = t.held.values().map(|h| h.target).sum();
                            prop_assert!(t.held.len() < MAX_TARGETS);
                            prop_assert!(
                                registered + len <= cap || t.held.is_empty(),
                                "{} registered and {} made, share {}", registered, len, cap
                            );
                            next += 1;
                            t.answered(len, Some((next, len)));
                        }
                        Some(Job::Take(token)) => {
                            t.take(token);
                        }
                        None => {}
                    },
                }
            }
        }
    }
}
