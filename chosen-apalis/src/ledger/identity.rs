//! Who a ledgered job is: the key of its rows and the name its transactions are fenced
//! under, one injective encoding of (namespace, lock, job name).
//!
//! Two jobs share rows only if they are the same job: the same lock (its name *and* the
//! namespace its key was derived in: two applications in two namespaces that both lock
//! `billing` hold two locks, each with its own leader) and the same job name under it.
//! Do not change the encoding: rows written under one key are not found under another.

use chosen_core::DEFAULT_NAMESPACE;

/// The beginning of every encoded key: it begins with `chosen.`, which no lock of an
/// application may (chosen-core refuses such lock names), so no other fence name is
/// one, and it differs from the older named-job fence names (`chosen.job/…`).
const ENCODED: &str = "chosen.job:";

/// The key of a job's rows and its fence name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobKey {
    /// The ledger's `job` column.
    pub(crate) job: String,
    /// The fence name of the job's transactions.
    pub(crate) fence: String,
}

/// The key of the job named `job` (`None`: the lock's only job) under the lock `lock`
/// whose key was derived in `namespace` (`None`: a raw key, one lock in every
/// namespace).
///
/// * In the default namespace (or for a raw key), with no `/` in the names, the forms
///   earlier versions wrote, so that their rows keep working: the lock's name (fenced
///   under it), or `lock/job` (fenced under `chosen.job/lock/job`).
/// * Otherwise `chosen.job:` then the namespace (`*` for a raw key), the lock and the
///   job name if any, each percent-encoded (`%`, `/`, `*` and NUL) and joined by `/`:
///   `chosen.job:tenant-a/billing`, `chosen.job:chosen/a%2Fb/nightly`; fenced under the
///   same text.
///
/// The three forms cannot meet: the first has no `/`, the second exactly one and does
/// not begin with `chosen.` (nor does a lock name; the library's own lock names that
/// do have a `/`, and take the third form), the third begins with `chosen.job:`.
pub(crate) fn job_key(namespace: Option<&str>, lock: &str, job: Option<&str>) -> JobKey {
    let plain = |s: &str| !s.contains('/') && !s.contains('\0');
    let legacy = namespace.is_none_or(|ns| ns == DEFAULT_NAMESPACE)
        && plain(lock)
        && !lock.starts_with("chosen.")
        && job.is_none_or(plain);
    if legacy {
        return match job {
            None => JobKey {
                job: lock.to_owned(),
                fence: lock.to_owned(),
            },
            Some(job) => JobKey {
                job: format!("{lock}/{job}"),
                fence: format!("chosen.job/{lock}/{job}"),
            },
        };
    }
    let mut key = String::from(ENCODED);
    match namespace {
        Some(ns) => escape(&mut key, ns),
        None => key.push('*'),
    }
    key.push('/');
    escape(&mut key, lock);
    if let Some(job) = job {
        key.push('/');
        escape(&mut key, job);
    }
    JobKey {
        job: key.clone(),
        fence: key,
    }
}

/// Appends `s` with `%`, `/`, `*` and NUL percent-encoded.
fn escape(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '*' => out.push_str("%2A"),
            '\0' => out.push_str("%00"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Frozen: rows written under these keys must be found by every later version.
    #[test]
    fn the_keys_are_frozen() {
        /// (namespace, lock, job) and the key and fence name they must give.
        type Case<'a> = (Option<&'a str>, &'a str, Option<&'a str>, &'a str, &'a str);
        let cases: [Case<'_>; 10] = [
            (Some("chosen"), "billing", None, "billing", "billing"),
            (
                Some("chosen"),
                "billing",
                Some("nightly"),
                "billing/nightly",
                "chosen.job/billing/nightly",
            ),
            (None, "key(1, 2)", None, "key(1, 2)", "key(1, 2)"),
            (
                Some("tenant-a"),
                "billing",
                None,
                "chosen.job:tenant-a/billing",
                "chosen.job:tenant-a/billing",
            ),
            (
                Some("tenant-a"),
                "billing",
                Some("nightly"),
                "chosen.job:tenant-a/billing/nightly",
                "chosen.job:tenant-a/billing/nightly",
            ),
            (
                Some("chosen"),
                "x/y",
                None,
                "chosen.job:chosen/x%2Fy",
                "chosen.job:chosen/x%2Fy",
            ),
            (
                Some("chosen"),
                "x",
                Some("y/z"),
                "chosen.job:chosen/x/y%2Fz",
                "chosen.job:chosen/x/y%2Fz",
            ),
            (
                None,
                "key(7)",
                Some("a/%b*"),
                "chosen.job:*/key(7)/a%2F%25b%2A",
                "chosen.job:*/key(7)/a%2F%25b%2A",
            ),
            (
                None,
                "key(7)",
                Some("a%b*"),
                "key(7)/a%b*",
                "chosen.job/key(7)/a%b*",
            ),
            (
                Some("chosen"),
                "chosen.group/g/m",
                None,
                "chosen.job:chosen/chosen.group%2Fg%2Fm",
                "chosen.job:chosen/chosen.group%2Fg%2Fm",
            ),
        ];
        for (ns, lock, job, key, fence) in cases {
            let got = job_key(ns, lock, job);
            assert_eq!(
                (got.job.as_str(), got.fence.as_str()),
                (key, fence),
                "{ns:?} {lock:?} {job:?}"
            );
        }
    }

    #[test]
    fn the_collisions_of_the_old_encoding_are_apart() {
        // The unnamed job of lock `x/y` and job `y` of lock `x`.
        assert_ne!(
            job_key(Some("chosen"), "x/y", None).job,
            job_key(Some("chosen"), "x", Some("y")).job
        );
        // Lock `a/b` with job `c`, and lock `a` with job `b/c`.
        assert_ne!(
            job_key(Some("chosen"), "a/b", Some("c")).job,
            job_key(Some("chosen"), "a", Some("b/c")).job
        );
        // One lock name in two namespaces: two locks, two jobs, two fences.
        let (a, b) = (
            job_key(Some("chosen"), "jobs", None),
            job_key(Some("other"), "jobs", None),
        );
        assert_ne!(a.job, b.job);
        assert_ne!(a.fence, b.fence);
    }

    fn part() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just("a"),
                Just("b"),
                Just("/"),
                Just("%"),
                Just("%2F"),
                Just("*"),
                Just("\0"),
                Just("chosen."),
                Just("chosen.job:"),
                Just("chosen"),
                Just("key(1, 2)"),
            ],
            0..4,
        )
        .prop_map(|v| v.concat())
    }

    proptest! {
        /// Distinct (namespace, lock, job) give distinct keys and distinct fence names,
        /// and no encoded fence name is a lock name an application may fence under.
        #[test]
        fn the_encoding_is_injective(
            ids in proptest::collection::vec(
                (proptest::option::of(part()), part(), proptest::option::of(part())),
                1..40,
            )
        ) {
            let mut keys: HashMap<String, (Option<String>, String, Option<String>)> = HashMap::new();
            let mut fences: HashMap<String, (Option<String>, String, Option<String>)> = HashMap::new();
            for (ns, lock, job) in ids {
                // What chosen-core lets through: a lock name is not empty, has no NUL and
                // (an application's) does not begin with `chosen.`; a namespace has no
                // NUL nor that prefix. The library's own lock names begin with it and
                // have a `/`.
                let ns = ns.filter(|n| !n.contains('\0') && !n.starts_with("chosen."));
                let lock = if lock.is_empty() || lock.contains('\0') { "l".to_owned() } else { lock };
                let lock = if lock.starts_with("chosen.") && !lock.contains('/') { format!("x{lock}") } else { lock };
                // A raw key's leadership is named after the key (`key(..)`), a name
                // chosen-core refuses for a named lock.
                let lock = match &ns {
                    None => format!("key({})", lock.len()),
                    Some(_) if lock.starts_with("key(") => format!("x{lock}"),
                    Some(_) => lock,
                };
                let id = (ns.clone(), lock.clone(), job.clone());
                let key = job_key(ns.as_deref(), &lock, job.as_deref());
                if let Some(other) = keys.insert(key.job.clone(), id.clone()) {
                    prop_assert_eq!(&other, &id, "two jobs share the key {:?}", key.job);
                }
                if let Some(other) = fences.insert(key.fence.clone(), id.clone()) {
                    prop_assert_eq!(&other, &id, "two jobs share the fence {:?}", key.fence);
                }
                if key.fence != lock {
                    prop_assert!(key.fence.starts_with("chosen.job"), "{:?}", key.fence);
                }
            }
        }
    }
}
