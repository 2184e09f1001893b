//! Test harness for chosen: throwaway PostgreSQL clusters started from the server
//! binaries, and helpers shared by the end-to-end tests and the examples.
//!
//! * [`PgCluster::start`] uses `DATABASE_URL` when set, else starts a local cluster.
//! * [`PgCluster::start_local`] always starts a local cluster (for tests that stop,
//!   restart or reconfigure the server).
//!
//! Local clusters: the binaries are found in `PG_BIN_DIR`, via `pg_config --bindir`,
//! under `/usr/lib/postgresql/<version>/bin` (newest first), or on `PATH`. When they (or
//! pgbouncer, openssl, setpriv) are missing, the harness installs the Debian/Ubuntu
//! package itself if it runs as root with `apt-get` (announced in one line on stderr;
//! `CHOSEN_NO_INSTALL=1` forbids it), else fails naming the command to run. When running as root they run
//! as the `postgres` user (else `nobody`), because `initdb` refuses to run as root.
//! One `initdb` per machine and version is cached as a template and copied for each
//! cluster. Clusters listen on 127.0.0.1 only, are removed on drop, and clusters left
//! behind by a test process that died are swept by the next start.

pub mod checker;
mod clock;
mod cluster;
pub mod nemesis;
mod packages;
mod proxy;

pub use clock::{monotonic_us, signal};
pub use cluster::{PgBouncer, PgCluster, PgClusterBuilder, SUPERUSER, SUPERUSER_PASSWORD};
pub use proxy::{FaultProxy, ProxyMode};
/// Re-exported for examples that build connection settings by hand.
pub use tokio_postgres::Config as PgConfig;
/// Re-exported for examples that inspect connection settings.
pub use tokio_postgres::config::Host as PgHost;

/// The options every test manager starts from: `url` (a test URL, so a parse failure
/// is a bug in the test) and `node` as the node id, other settings the defaults. The
/// presets built on it ([`eager_options`], [`fast_options`], [`fault_options`],
/// [`unheld_options`], [`prompt_options`]) set the timings tests share; a test adds its
/// own on top.
///
/// # Panics
///
/// When `url` does not parse.
#[must_use]
pub fn manager_options(url: &str, node: &str) -> chosen_core::ManagerOptions {
    try_manager_options(url, node).expect("a valid test URL")
}

/// [`manager_options`] that returns a URL that does not parse as an error (for the
/// benchmarks, which may be pointed at any server).
///
/// # Errors
///
/// When `url` does not parse.
pub fn try_manager_options(
    url: &str,
    node: &str,
) -> chosen_core::Result<chosen_core::ManagerOptions> {
    Ok(chosen_core::ManagerOptions::from_url(url)?.node_id(node))
}

/// [`manager_options`] polling every 50 ms, so that a waiter finds a lock free soon
/// after its release even without the announcement. Other timings are the defaults.
///
/// # Panics
///
/// When `url` does not parse.
#[must_use]
pub fn eager_options(url: &str, node: &str) -> chosen_core::ManagerOptions {
    manager_options(url, node).poll_interval(std::time::Duration::from_millis(50))
}

/// [`eager_options`] that also reconnects fast (20 ms, backing off to 200 ms), for tests
/// that end sessions and wait for the node's next one.
///
/// # Panics
///
/// When `url` does not parse.
#[must_use]
pub fn fast_options(url: &str, node: &str) -> chosen_core::ManagerOptions {
    eager_options(url, node).reconnect_backoff(
        std::time::Duration::from_millis(20),
        std::time::Duration::from_millis(200),
    )
}

/// [`manager_options`] polling every 100 ms and reconnecting fast (50 ms, backing off to
/// 500 ms), for tests that cut, restart or fail over the server.
///
/// # Panics
///
/// When `url` does not parse.
#[must_use]
pub fn fault_options(url: &str, node: &str) -> chosen_core::ManagerOptions {
    manager_options(url, node)
        .poll_interval(std::time::Duration::from_millis(100))
        .reconnect_backoff(
            std::time::Duration::from_millis(50),
            std::time::Duration::from_millis(500),
        )
}

/// [`manager_options`] with no term hold (`term_grant_delay(Duration::ZERO)`): a test's
/// cluster has just started, and its grants must not wait for the young term. Other
/// timings are the defaults.
///
/// # Panics
///
/// When `url` does not parse.
#[must_use]
pub fn unheld_options(url: &str, node: &str) -> chosen_core::ManagerOptions {
    manager_options(url, node).term_grant_delay(std::time::Duration::ZERO)
}

/// [`unheld_options`] polling every 100 ms.
///
/// # Panics
///
/// When `url` does not parse.
#[must_use]
pub fn prompt_options(url: &str, node: &str) -> chosen_core::ManagerOptions {
    unheld_options(url, node).poll_interval(std::time::Duration::from_millis(100))
}

/// The one node of `elections` that leads, once one does, and how long that took;
/// fails on two leaders at once, or on nobody leading within `limit`.
pub async fn leader_of(
    elections: &[(&str, chosen_core::Election)],
    limit: std::time::Duration,
) -> (String, std::time::Duration) {
    let t0 = std::time::Instant::now();
    loop {
        let leading: Vec<&str> = elections
            .iter()
            .filter(|(_, e)| e.leadership().is_leader())
            .map(|(n, _)| *n)
            .collect();
        assert!(leading.len() <= 1, "two leaders: {leading:?}");
        if let [one] = leading.as_slice() {
            return ((*one).to_owned(), t0.elapsed());
        }
        assert!(t0.elapsed() < limit, "nobody leads after {limit:?}");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// `true` when running in CI (`CI=true`, as `.ci/run` is run): there no test may skip
/// itself for a missing tool.
#[must_use]
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// A lock name unique to this process and call, so tests can share a database.
#[must_use]
pub fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Connects a plain `tokio-postgres` client (for inspecting `pg_locks`, terminating
/// backends, ...), driving its connection on a spawned task.
///
/// # Errors
///
/// When the connection fails.
pub async fn connect_admin(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The environment that runs a child process with its wall clock `offset_secs` off
/// (ahead when positive), through libfaketime (found, or installed as the other
/// packages are). The monotonic clock is left as it is, as on a machine whose wall
/// clock was set wrong.
///
/// # Errors
///
/// When libfaketime is missing and cannot be installed (the error names the command).
pub fn shifted_clock_env(offset_secs: i64) -> std::io::Result<Vec<(String, String)>> {
    let library = packages::find_or_install(packages::LIBFAKETIME, || {
        let found = std::fs::read_dir("/usr/lib")?
            .filter_map(Result::ok)
            .map(|dir| dir.path().join("faketime/libfaketimeMT.so.1"))
            .find(|path| path.exists());
        found.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "libfaketime"))
    })?;
    Ok(vec![
        ("LD_PRELOAD".to_owned(), library.display().to_string()),
        ("FAKETIME".to_owned(), format!("{offset_secs:+}")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
        ("FAKETIME_NO_CACHE".to_owned(), "1".to_owned()),
    ])
}

/// The path of a workspace example binary. `cargo test --workspace` builds examples
/// next to the test binaries; a missing one is built with `cargo build --example`, and
/// one older than the sources is an error that says how to rebuild it (running only
/// `-p chosen-tests` does not rebuild another package's examples).
///
/// # Errors
///
/// When the binary is stale, or cannot be found or built.
pub fn example_binary(name: &str) -> std::io::Result<std::path::PathBuf> {
    built_binary(Binary::Example, name)
}

/// The path of one of this package's fixture binaries (`src/bin`: `node`, `cron_node`,
/// `chosen-holder`). `cargo test -p chosen-tests` builds them before it runs the tests;
/// a missing one is built with `cargo build -p chosen-tests --bin`, and one older than
/// the sources is an error that says how to rebuild it.
///
/// # Errors
///
/// When the binary is stale, or cannot be found or built.
pub fn test_binary(name: &str) -> std::io::Result<std::path::PathBuf> {
    built_binary(Binary::Fixture, name)
}

/// Where a binary comes from: the examples package, or this package's `src/bin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binary {
    Example,
    Fixture,
}

fn built_binary(kind: Binary, name: &str) -> std::io::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> -> target/<profile>
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .ok_or_else(|| std::io::Error::other("unexpected test binary location"))?;
    let path = match kind {
        Binary::Example => profile_dir.join("examples").join(name),
        Binary::Fixture => profile_dir.join(name),
    };
    let release = profile_dir.ends_with("release");
    let (package, flag, what) = match kind {
        Binary::Example => ("chosen-examples", "--example", "example"),
        Binary::Fixture => ("chosen-tests", "--bin", "test fixture"),
    };
    let build = format!(
        "cargo build{} -p {package} {flag} {name}",
        if release { " --release" } else { "" }
    );
    if !path.exists() {
        let mut cmd = std::process::Command::new(
            std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()),
        );
        cmd.args(["build", "-q", "-p", package, flag, name]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status()?;
        if !status.success() || !path.exists() {
            return Err(std::io::Error::other(format!(
                "could not build {what} {name:?} ({status}): `{build}`"
            )));
        }
    }
    let built = std::fs::metadata(&path)?.modified()?;
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| std::io::Error::other("no workspace root"))?;
    let newest = match kind {
        Binary::Example => newest_rs(&workspace.join("examples"), None),
        // The library and this binary's own source; the other binaries are not in it.
        Binary::Fixture => {
            let src = workspace.join("tests/src");
            let own = src.join("bin").join(format!("{name}.rs"));
            let own = std::fs::metadata(own).and_then(|m| m.modified()).ok();
            newest_rs(&src, Some(&src.join("bin"))).max(own)
        }
    };
    // The libraries it is built from (the fixtures do not use chosen-tower).
    let libraries: &[&str] = match kind {
        Binary::Example => &["chosen-core/src", "chosen-apalis/src", "chosen-tower/src"],
        Binary::Fixture => &["chosen-core/src", "chosen-apalis/src"],
    };
    let libraries = libraries
        .iter()
        .filter_map(|dir| newest_rs(&workspace.join(dir), None));
    for newest in newest.into_iter().chain(libraries) {
        if newest > built {
            let rebuilt_by = match kind {
                Binary::Example => "the whole `cargo test --workspace`, which builds examples",
                Binary::Fixture => "`cargo test -p chosen-tests`, which builds the fixtures",
            };
            return Err(std::io::Error::other(format!(
                "the {name:?} {what} binary is older than its sources: run `{build}` (or {rebuilt_by}) and try again"
            )));
        }
    }
    Ok(path)
}

/// The newest modification time of the `.rs` files under `dir`, but those under `skip`.
fn newest_rs(
    dir: &std::path::Path,
    skip: Option<&std::path::Path>,
) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if skip == Some(path.as_path()) {
            None
        } else if path.is_dir() {
            newest_rs(&path, skip)
        } else if path.extension().is_some_and(|e| e == "rs") {
            entry.metadata().ok()?.modified().ok()
        } else {
            None
        };
        newest = newest.max(t);
    }
    newest
}

/// A `node` fixture process (`src/bin/node.rs`, its events in `examples/README.md`), or
/// an example that prints the same kind of event lines, and its event lines.
#[derive(Debug)]
pub struct NodeProcess {
    /// The process.
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl NodeProcess {
    /// Starts `node` with `args` against `url` (as `DATABASE_URL`).
    ///
    /// # Errors
    ///
    /// When the binary is missing or stale, or does not start.
    pub fn spawn(url: &str, args: &[&str]) -> std::io::Result<Self> {
        Self::spawn_binary(&test_binary("node")?, url, args)
    }

    /// Starts another example that prints JSON event lines on stdout (`service`), with
    /// `args` against `url` (as `DATABASE_URL`).
    ///
    /// # Errors
    ///
    /// When the binary is missing or stale, or does not start.
    pub fn spawn_example(example: &str, url: &str, args: &[&str]) -> std::io::Result<Self> {
        Self::spawn_binary(&example_binary(example)?, url, args)
    }

    fn spawn_binary(binary: &std::path::Path, url: &str, args: &[&str]) -> std::io::Result<Self> {
        let (child, stdout) = spawn_piped(binary, url, args)?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, lines })
    }

    /// Waits up to `limit` for the next line with `"event":"<event>"`, skipping others.
    #[must_use]
    pub fn wait(&self, event: &str, limit: std::time::Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + limit;
        let needle = format!("\"event\":\"{event}\"");
        loop {
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(&needle) => return Some(line),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// Every line received so far that no [`wait`](Self::wait) consumed, without waiting.
    #[must_use]
    pub fn drain(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    /// Every line not consumed yet, up to the end of the output (the process closed its
    /// stdout, e.g. it exited), waiting at most `limit` for that end.
    #[must_use]
    pub fn rest(&self, limit: std::time::Duration) -> Vec<String> {
        let deadline = std::time::Instant::now() + limit;
        let mut lines = Vec::new();
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(_) => break,
            }
        }
        lines
    }
}

/// An HTTP/1.1 response read by [`http_request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// The status line and headers, as sent.
    pub head: String,
    /// The body.
    pub body: String,
}

impl HttpResponse {
    /// The value of header `name` (case-insensitive), if sent.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// A plain HTTP/1.1 request with an empty body on loopback (`Connection: close`), for
/// the tests of the examples' and layers' HTTP endpoints: connecting, writing and
/// reading each give up after 5 s.
///
/// # Errors
///
/// When the connection or the exchange fails, or the answer is not HTTP.
pub fn http_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
) -> std::io::Result<HttpResponse> {
    use std::io::{Read, Write};
    let limit = std::time::Duration::from_secs(5);
    let mut stream = std::net::TcpStream::connect_timeout(&addr, limit)?;
    stream.set_read_timeout(Some(limit))?;
    stream.set_write_timeout(Some(limit))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
    Ok(HttpResponse {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    })
}

/// [`http_request`] from async code, on a blocking thread (so that a server in the
/// same runtime keeps its workers).
///
/// # Errors
///
/// As [`http_request`].
pub async fn http_request_async(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
) -> std::io::Result<HttpResponse> {
    let (method, path) = (method.to_owned(), path.to_owned());
    tokio::task::spawn_blocking(move || http_request(addr, &method, &path))
        .await
        .map_err(std::io::Error::other)?
}

/// Starts `binary` with `args` against `url` (as `DATABASE_URL`), stdout piped,
/// stderr inherited.
fn spawn_piped(
    binary: &std::path::Path,
    url: &str,
    args: &[&str],
) -> std::io::Result<(std::process::Child, std::process::ChildStdout)> {
    let mut child = std::process::Command::new(binary)
        .args(args)
        .env("DATABASE_URL", url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().expect("BUG: stdout is piped");
    Ok((child, stdout))
}

/// Events of several `node` processes, parsed into one history (in arrival order).
pub type History = std::sync::Arc<std::sync::Mutex<Vec<checker::Event>>>;

/// A `node` fixture process whose event lines go into a shared [`History`] (stamped with
/// `instance`); killed on drop.
#[derive(Debug)]
pub struct LoggedNode {
    /// The process.
    pub child: std::process::Child,
}

impl LoggedNode {
    /// Starts `node` with `args` against `url` (as `DATABASE_URL`); its stderr is
    /// inherited.
    ///
    /// # Errors
    ///
    /// When the binary is missing or stale, or does not start.
    pub fn spawn(
        url: &str,
        args: &[&str],
        history: &History,
        instance: u32,
    ) -> std::io::Result<Self> {
        let (child, stdout) = spawn_piped(&test_binary("node")?, url, args)?;
        let history = std::sync::Arc::clone(history);
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(e) = checker::Event::parse(&line, instance) {
                    history.lock().expect("history lock").push(e);
                }
            }
        });
        Ok(Self { child })
    }
}

impl Drop for LoggedNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time (user and system, every thread) of this process so far, read from
/// `/proc/self/stat` (zero where it cannot be read). For the benchmarks.
#[must_use]
pub fn process_cpu_time() -> std::time::Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            Some(rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    std::time::Duration::from_millis(ticks * 10) // USER_HZ = 100 on Linux
}
