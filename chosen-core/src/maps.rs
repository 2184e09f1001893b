//! The manager's hash maps: seeded at random in the library, with fixed keys in its
//! tests.
//!
//! The manager's rules iterate their maps (the lock table's slots, a group's members),
//! and the order of what they do follows. In the library the maps keep std's random
//! keys: lock keys derive from names an application may take from its users, and a
//! fixed, public hash would let someone pick names that collide. In chosen-core's own
//! tests (the simulations) the keys are fixed, so that a seed replays exactly, in one
//! build on one target (std's hasher may change between releases).

#[cfg(not(test))]
type State = std::hash::RandomState;
#[cfg(test)]
type State = std::hash::BuildHasherDefault<std::hash::DefaultHasher>;

/// A `HashMap` of the manager's rules (build with `HashMap::default()`).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, State>;

/// A `HashSet` of the manager's rules (build with `HashSet::default()`).
pub(crate) type HashSet<T> = std::collections::HashSet<T, State>;
