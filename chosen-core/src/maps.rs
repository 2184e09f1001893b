//! Hash maps whose iteration order is fixed by their history.
//!
//! The manager's rules iterate their maps (the lock table's slots, a group's members),
//! and the order of what they do follows. std's `HashMap` seeds each map at random, so
//! one history could play out in a different order from run to run; these maps hash
//! with fixed keys, so a seed of a simulation replays exactly. The keys are lock keys
//! and ids the application chooses, not input an attacker picks to collide.

use std::hash::{BuildHasherDefault, DefaultHasher};

/// A `HashMap` with a fixed hasher (build with `HashMap::default()`).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<DefaultHasher>>;

/// A `HashSet` with a fixed hasher (build with `HashSet::default()`).
pub(crate) type HashSet<T> = std::collections::HashSet<T, BuildHasherDefault<DefaultHasher>>;
