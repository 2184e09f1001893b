//! Simulated servers for chosen-core's own tests: a model of PostgreSQL's side of
//! chosen's statements ([`server`]), which the engine simulation (`table/sim.rs`)
//! drives event by event, and a [`Backend`](crate::backend::Backend) on it
//! ([`backend`]) that runs the real manager task on tokio's paused clock.

pub(crate) mod backend;
mod fleet;
pub(crate) mod server;

/// Rules of the supervision layer (elections, singletons) a test may switch off, to
/// show that the fleet simulation fails without each: each is load-bearing. Off for
/// the current thread only (the fleet runs on a current-thread runtime).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Guard {
    /// A preferred node that leads does not watch for another preferred node to fail
    /// back to (two preferred nodes would hand the lead back and forth for ever).
    PreferredLeaderKeeps,
    /// A singleton whose child finished for good keeps the lock through a fail-back
    /// (the preferred node would run the child again).
    FinishedKeepsLock,
    /// A preferred node that waits takes its presence lock again when the session it
    /// held it on is lost (else no leader fails back to it until it next leads).
    PresenceRetaken,
    /// A singleton whose child keeps failing on start gives up (releases the lock for
    /// a cooldown) after its restart intensity (else the node sits on the lock running
    /// nothing).
    ChildGivesUp,
    /// A group node above its target releases its surplus (else a node that joins gets
    /// nothing and the others stay above their new targets).
    GroupReleasesSurplus,
    /// A group member stays where it is held unless its node is above its target
    /// (else, placed by its number modulo the live nodes, a member moves between nodes
    /// that stayed when another leaves or joins).
    GroupKeepsPlaced,
    /// A protection of the lock table, switched off in every manager of the thread.
    Engine(crate::table::Protection),
}

thread_local! {
    static OFF: std::cell::RefCell<Vec<Guard>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether `guard` is switched off on this thread.
pub(crate) fn is_off(guard: Guard) -> bool {
    OFF.with(|off| off.borrow().contains(&guard))
}

/// Switches `guards` off on this thread until the returned value is dropped.
pub(crate) fn switch_off(guards: &[Guard]) -> impl Drop + use<> {
    struct On(Vec<Guard>);
    impl Drop for On {
        fn drop(&mut self) {
            OFF.with(|off| off.borrow_mut().retain(|g| !self.0.contains(g)));
        }
    }
    OFF.with(|off| off.borrow_mut().extend_from_slice(guards));
    On(guards.to_vec())
}

/// Virtual microseconds since the start of a run.
pub(crate) type T = u64;
pub(crate) const MS: T = 1_000;
pub(crate) const SEC: T = 1_000_000;

/// `backend_start` as the SQL reports it (microseconds since the Unix epoch).
pub(crate) fn epoch_us(start: T) -> i64 {
    1_700_000_000_000_000 + start as i64
}

/// The simulations' random numbers: xorshift64* (the engine's own jitter generator),
/// seeded through splitmix64 so that neighbouring seeds start far apart.
#[derive(Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        // splitmix64, so that neighbouring seeds start far apart.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        crate::table::next_random(&mut self.0)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Milliseconds between `lo` and `hi`, both included.
    pub(crate) fn millis(&mut self, lo: u64, hi: u64) -> std::time::Duration {
        std::time::Duration::from_millis(self.range(lo, hi))
    }
}
