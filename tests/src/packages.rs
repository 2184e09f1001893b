//! The system packages the harness runs (the PostgreSQL server, PgBouncer, openssl,
//! setpriv, libfaketime): found where they are; when one is missing, installed if this process may
//! install packages (root, with `apt-get`, not opted out), else an error naming the one
//! command to run. So the README's two commands work on a fresh Debian/Ubuntu machine
//! with only Rust, and elsewhere say exactly what is missing.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

/// Set to anything but empty or `0` to forbid installing packages: a missing one is then
/// an error naming the command to run.
pub(crate) const NO_INSTALL_ENV: &str = "CHOSEN_NO_INSTALL";

/// A Debian/Ubuntu package the harness needs, and what it is needed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Package {
    /// The package name, as `apt-get install` takes it.
    pub(crate) name: &'static str,
    /// What is missing, for messages: "the PostgreSQL server binaries (initdb, postgres)".
    pub(crate) provides: &'static str,
    /// Other ways out, appended to the error when the package is not installed.
    pub(crate) alternatives: &'static str,
}

/// The PostgreSQL server (14 or newer; Debian's package includes the contrib modules).
pub(crate) const POSTGRESQL: Package = Package {
    name: "postgresql",
    provides: "the PostgreSQL server binaries (initdb, postgres; 14 or newer)",
    alternatives: "; or set PG_BIN_DIR to their directory, or DATABASE_URL to an existing server",
};

/// The connection pooler the pooler tests run.
pub(crate) const PGBOUNCER: Package = Package {
    name: "pgbouncer",
    provides: "pgbouncer",
    alternatives: "",
};

/// The command that makes the TLS tests' certificates.
pub(crate) const OPENSSL: Package = Package {
    name: "openssl",
    provides: "the openssl command",
    alternatives: "",
};

/// libfaketime, which runs a node process with its wall clock shifted.
pub(crate) const LIBFAKETIME: Package = Package {
    name: "libfaketime",
    provides: "libfaketime (to run a node with its clock shifted)",
    alternatives: "",
};

/// `setpriv`, which runs the server as an unprivileged user when the harness is root.
pub(crate) const UTIL_LINUX: Package = Package {
    name: "util-linux",
    provides: "setpriv (to run the server as an unprivileged user, since initdb refuses root)",
    alternatives: "",
};

/// What this process may do about a missing package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Host {
    /// Running as root (effective uid 0).
    pub(crate) root: bool,
    /// `apt-get` is on `PATH`.
    pub(crate) apt_get: bool,
    /// [`NO_INSTALL_ENV`] is set.
    pub(crate) opted_out: bool,
}

impl Host {
    /// This process.
    pub(crate) fn current() -> Self {
        Self {
            root: rustix::process::geteuid().is_root(),
            apt_get: find_on_path("apt-get").is_ok(),
            opted_out: std::env::var_os(NO_INSTALL_ENV)
                .is_some_and(|v| !v.is_empty() && v != OsStr::new("0")),
        }
    }
}

/// The decision for a missing package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Remedy {
    /// Install it with `apt-get`, announcing it.
    Install,
    /// Stop with this message, which names the command to run.
    Refuse(String),
}

/// What to do about `package` missing on `host`: install it only as root with `apt-get`
/// and without the opt-out; otherwise name the one command that installs it.
pub(crate) fn remedy(package: Package, host: Host) -> Remedy {
    let Package {
        name,
        provides,
        alternatives,
    } = package;
    match host {
        Host {
            root: true,
            apt_get: true,
            opted_out: false,
        } => Remedy::Install,
        Host {
            root: true,
            apt_get: true,
            opted_out: true,
        } => Remedy::Refuse(format!(
            "{provides} not found (not installed automatically: {NO_INSTALL_ENV} is set): run `apt-get install -y {name}`{alternatives}"
        )),
        Host {
            root: false,
            apt_get: true,
            ..
        } => Remedy::Refuse(format!(
            "{provides} not found: run `sudo apt-get install -y {name}`{alternatives}"
        )),
        Host { apt_get: false, .. } => Remedy::Refuse(format!(
            "{provides} not found: install the `{name}` package (its name on Debian/Ubuntu) with your system's package manager{alternatives}"
        )),
    }
}

/// `find()`'s answer; when it finds nothing (`NotFound`), installs `package` if this
/// process may and looks again, or fails with `NotFound` and the command to run.
pub(crate) fn find_or_install<T>(
    package: Package,
    find: impl Fn() -> io::Result<T>,
) -> io::Result<T> {
    find_or_install_on(package, Host::current, find)
}

/// [`find_or_install`] on the host `host()` describes (asked only when `find` fails).
fn find_or_install_on<T>(
    package: Package,
    host: impl FnOnce() -> Host,
    find: impl Fn() -> io::Result<T>,
) -> io::Result<T> {
    match find() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        found => return found,
    }
    match remedy(package, host()) {
        Remedy::Refuse(message) => Err(io::Error::new(io::ErrorKind::NotFound, message)),
        Remedy::Install => {
            // One installation at a time; a test that waited may find it installed.
            static INSTALLING: Mutex<()> = Mutex::new(());
            let _one = INSTALLING.lock().unwrap_or_else(PoisonError::into_inner);
            match find() {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                found => return found,
            }
            install(package)?;
            find().map_err(|e| {
                io::Error::other(format!(
                    "installed the `{}` package, but still: {e}",
                    package.name
                ))
            })
        }
    }
}

/// `apt-get install`s `package`, announced in one line; the package lists are updated
/// once per process first (a fresh image has none).
fn install(package: Package) -> io::Result<()> {
    eprintln!(
        "chosen-tests: {} not found; installing the `{}` package with apt-get (set {NO_INSTALL_ENV}=1 not to)",
        package.provides, package.name
    );
    static UPDATED: OnceLock<Result<(), String>> = OnceLock::new();
    let by_hand = format!("run `apt-get install -y {}` by hand", package.name);
    UPDATED
        .get_or_init(|| apt_get(&["update", "-qq"]))
        .clone()
        .map_err(|e| io::Error::other(format!("{e}; {by_hand}")))?;
    apt_get(&[
        "install",
        "-y",
        "-qq",
        // Another process may be installing too: wait for dpkg's lock, not fail.
        "-o",
        "DPkg::Lock::Timeout=600",
        package.name,
    ])
    .map_err(|e| io::Error::other(format!("{e}; {by_hand}")))
}

fn apt_get(args: &[&str]) -> Result<(), String> {
    let out = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("apt-get {} could not start: {e}", args.join(" ")))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(10).collect();
    Err(format!(
        "apt-get {} failed ({}): {}",
        args.join(" "),
        out.status,
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    ))
}

/// `program` in a directory of `PATH`, or `NotFound`.
pub(crate) fn find_on_path(program: &str) -> io::Result<PathBuf> {
    find_in(
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default()
            .iter()
            .map(PathBuf::as_path),
        program,
    )
}

/// The first `dir/program` that is a file, or `NotFound`.
pub(crate) fn find_in<'a>(
    dirs: impl IntoIterator<Item = &'a Path>,
    program: &str,
) -> io::Result<PathBuf> {
    dirs.into_iter()
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{program} not found")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOSTS: [(bool, bool, bool); 8] = [
        (false, false, false),
        (false, false, true),
        (false, true, false),
        (false, true, true),
        (true, false, false),
        (true, false, true),
        (true, true, false),
        (true, true, true),
    ];

    fn host((root, apt_get, opted_out): (bool, bool, bool)) -> Host {
        Host {
            root,
            apt_get,
            opted_out,
        }
    }

    #[test]
    fn installs_only_as_root_with_apt_get_and_no_opt_out() {
        for h in HOSTS {
            let expected = h == (true, true, false);
            assert_eq!(
                remedy(POSTGRESQL, host(h)) == Remedy::Install,
                expected,
                "{h:?}"
            );
        }
    }

    #[test]
    fn a_user_is_told_the_one_command_to_run() {
        let Remedy::Refuse(message) = remedy(POSTGRESQL, host((false, true, false))) else {
            panic!("a user cannot install packages");
        };
        assert!(
            message.contains("run `sudo apt-get install -y postgresql`"),
            "{message}"
        );
        assert!(message.contains("PG_BIN_DIR"), "{message}");
        assert!(message.contains("DATABASE_URL"), "{message}");
    }

    #[test]
    fn root_that_opted_out_is_told_the_command_and_why() {
        let Remedy::Refuse(message) = remedy(PGBOUNCER, host((true, true, true))) else {
            panic!("opted out");
        };
        assert!(
            message.contains("run `apt-get install -y pgbouncer`"),
            "{message}"
        );
        assert!(message.contains(NO_INSTALL_ENV), "{message}");
        assert!(!message.contains("sudo"), "{message}");
    }

    #[test]
    fn without_apt_get_the_package_is_named() {
        for root in [false, true] {
            let Remedy::Refuse(message) = remedy(OPENSSL, host((root, false, false))) else {
                panic!("no apt-get");
            };
            assert!(message.contains("`openssl` package"), "{message}");
            assert!(!message.contains("apt-get install"), "{message}");
        }
    }

    fn missing() -> io::Result<PathBuf> {
        Err(io::Error::new(io::ErrorKind::NotFound, "initdb not found"))
    }

    #[test]
    fn a_found_program_is_used_and_nothing_is_installed() {
        let host = || -> Host { panic!("the host is asked only when something is missing") };
        let found = find_or_install_on(POSTGRESQL, host, || Ok::<_, io::Error>(7)).unwrap();
        assert_eq!(found, 7);
        // Errors other than "not found" are the caller's, unchanged.
        let err = find_or_install_on(POSTGRESQL, host, || {
            Err::<(), _>(io::Error::new(io::ErrorKind::PermissionDenied, "denied"))
        })
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn missing_and_not_allowed_to_install_is_not_found_with_the_command() {
        for (h, command) in [
            ((false, true, false), "sudo apt-get install -y postgresql"),
            ((true, true, true), "apt-get install -y postgresql"),
        ] {
            let err = find_or_install_on(POSTGRESQL, || host(h), missing).unwrap_err();
            // `NotFound`, so tests that may skip without a tool still can.
            assert_eq!(err.kind(), io::ErrorKind::NotFound, "{h:?}");
            assert!(err.to_string().contains(command), "{h:?}: {err}");
        }
    }

    #[test]
    fn programs_are_found_in_the_first_directory_that_has_them() {
        let dir = std::env::temp_dir().join(format!("chosen-find-in-{}", std::process::id()));
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("tool"), "").unwrap();
        assert_eq!(
            find_in([a.as_path(), b.as_path()], "tool").unwrap(),
            b.join("tool")
        );
        assert_eq!(
            find_in([a.as_path()], "tool").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
