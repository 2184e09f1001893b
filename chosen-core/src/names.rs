//! Checks of names and poll intervals: what a lock, group, member or fence may be
//! called, and which names are the library's own.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::key::LockKey;

/// Checks a lock (or group, member or fence) name: not empty, and no NUL character
/// (PostgreSQL text cannot hold one, nor can a metric label). `what` names it in the
/// message (`"the lock name"`).
pub(crate) fn validate_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidName(format!(
            "{what} is empty; give it a name that says what it guards"
        )));
    }
    if name.contains('\0') {
        return Err(Error::InvalidName(format!(
            "{what} contains a NUL character ({name:?}); PostgreSQL text cannot hold one"
        )));
    }
    Ok(())
}

/// The beginning of the names of the library's own locks (`chosen.prefer/<name>`, an
/// election's preferred-node lock; `chosen.group/...`, a group's slots and members) and
/// key namespaces (`chosen.stop-fence`, `chosen.interest`, ...). A lock name or a
/// namespace beginning with it is refused, so that no lock of yours can be one of them.
pub(crate) const RESERVED_PREFIX: &str = "chosen.";

/// [`validate_name`] for the name of a lock to acquire, which must not begin with
/// [`RESERVED_PREFIX`] unless it is one of the library's own (`internal`).
pub(crate) fn validate_lock_name(name: &str, internal: bool) -> Result<()> {
    validate_name("the lock name", name)?;
    if !internal && name.starts_with(RESERVED_PREFIX) {
        return Err(Error::InvalidName(format!(
            "the lock name {name:?} begins with {RESERVED_PREFIX:?}, which is reserved for the library's own locks (an election's preferred-node lock `chosen.prefer/<name>`, a group's `chosen.group/...`); choose a name without that prefix"
        )));
    }
    if names_a_raw_key(name) {
        return Err(Error::InvalidName(format!(
            "the lock name {name:?} is reserved: it is how a raw LockKey's lease, election or singleton is named (and fenced), and another lock under it would share that key's fence row; lock the key itself with LockRequest::from(LockKey::..), or choose another name"
        )));
    }
    Ok(())
}

/// Whether `name` is the name a raw key's lease gets, `key(k)` or `key(a, b)`
/// (`format!("key{key}")`).
fn names_a_raw_key(name: &str) -> bool {
    let Some(inner) = name
        .strip_prefix("key(")
        .and_then(|rest| rest.strip_suffix(')'))
    else {
        return false;
    };
    // Exactly the names keys produce: parsed back into a key, it must print the same.
    let key = match inner.split_once(", ") {
        Some((a, b)) => match (a.parse::<i32>(), b.parse::<i32>()) {
            (Ok(a), Ok(b)) => LockKey::Pair(a, b),
            _ => return false,
        },
        None => match inner.parse::<i64>() {
            Ok(k) => LockKey::Int(k),
            Err(_) => return false,
        },
    };
    format!("key{key}") == name
}

/// The accepted range of a poll interval (a manager's default or a request's own).
pub(crate) const POLL_INTERVAL_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(10)..=Duration::from_secs(3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_the_names_of_raw_keys_are_reserved() {
        for key in [
            LockKey::Int(0),
            LockKey::Int(-7),
            LockKey::Int(i64::MIN),
            LockKey::Int(i64::MAX),
            LockKey::Pair(1, 2),
            LockKey::Pair(i32::MIN, -1),
            LockKey::Pair(0, i32::MAX),
        ] {
            let name = format!("key{key}");
            assert!(names_a_raw_key(&name), "{name}");
            assert!(validate_lock_name(&name, false).is_err(), "{name}");
        }
        for name in [
            "key",
            "key(",
            "key)",
            "key()",
            "key(a)",
            "key(+5)",
            "key(007)",
            "key(-0)",
            "key(1,2)",
            "key(1,  2)",
            "key(3000000000, 1)",
            "key(1, 2, 3)",
            "key(1)x",
            "mykey(1)",
            "Key(1)",
        ] {
            assert!(!names_a_raw_key(name), "{name}");
            assert!(validate_lock_name(name, false).is_ok(), "{name}");
        }
    }
}
