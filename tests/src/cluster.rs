use std::fs;
use std::io::{self, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::packages;

/// The superuser of local clusters.
pub const SUPERUSER: &str = "postgres";
/// Its password (host connections use scram-sha-256, so a wrong one is rejected).
pub const SUPERUSER_PASSWORD: &str = "chosen-test-password";

/// Bump when the template's initdb arguments change.
const TEMPLATE_VERSION: u32 = 1;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A PostgreSQL server for tests: a throwaway local cluster, or `DATABASE_URL`.
#[derive(Debug)]
pub struct PgCluster {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    External(String),
    Local(Local),
}

#[derive(Debug)]
struct Local {
    bin_dir: PathBuf,
    base: PathBuf,
    data: PathBuf,
    port: u16,
    run_as: Option<RunAs>,
    settings: Vec<(String, String)>,
    child: Option<Child>,
}

#[derive(Debug, Clone)]
struct RunAs {
    user: String,
    uid: u32,
    gid: u32,
}

/// Settings for a local cluster.
#[derive(Debug, Default, Clone)]
pub struct PgClusterBuilder {
    settings: Vec<(String, String)>,
    tls: bool,
    own_initdb: bool,
}

impl PgClusterBuilder {
    /// A server setting passed as `-c name=value` (e.g. `max_locks_per_transaction`).
    #[must_use]
    pub fn setting(mut self, name: &str, value: impl Into<String>) -> Self {
        self.settings.push((name.to_owned(), value.into()));
        self
    }

    /// Serves TLS with a fresh self-signed certificate for `localhost` and 127.0.0.1
    /// (see [`PgCluster::tls_certificate`]). Needs the `openssl` command.
    #[must_use]
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Runs `initdb` for this cluster instead of copying the shared template, so that
    /// it gets its own system identifier (like a cluster made by `pg_upgrade` or a
    /// restore into a new `initdb`). Slower: a second or two.
    #[must_use]
    pub fn own_initdb(mut self) -> Self {
        self.own_initdb = true;
        self
    }

    /// Starts the cluster.
    ///
    /// # Errors
    ///
    /// When the server binaries are missing and could not be installed (run as root
    /// with `apt-get`, the harness installs the `postgresql` package itself, announced
    /// on stderr, unless `CHOSEN_NO_INSTALL` is set; otherwise the message names the
    /// command to run), or the server does not start (the message has its log).
    pub fn start(self) -> io::Result<PgCluster> {
        Local::start(self.settings, self.tls, None, self.own_initdb).map(|l| PgCluster {
            inner: Inner::Local(l),
        })
    }
}

impl PgCluster {
    /// `DATABASE_URL` when set, else a new local cluster.
    ///
    /// # Errors
    ///
    /// See [`PgClusterBuilder::start`].
    pub fn start() -> io::Result<Self> {
        match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => Ok(Self {
                inner: Inner::External(url),
            }),
            _ => Self::start_local(),
        }
    }

    /// Always a new local cluster.
    ///
    /// # Errors
    ///
    /// See [`PgClusterBuilder::start`].
    pub fn start_local() -> io::Result<Self> {
        PgClusterBuilder::default().start()
    }

    /// A builder for a local cluster with extra settings.
    #[must_use]
    pub fn builder() -> PgClusterBuilder {
        PgClusterBuilder::default()
    }

    /// The superuser's connection URL.
    #[must_use]
    pub fn url(&self) -> String {
        match &self.inner {
            Inner::External(url) => url.clone(),
            Inner::Local(l) => l.url(SUPERUSER_PASSWORD),
        }
    }

    /// The URL with another password (for authentication tests).
    #[must_use]
    pub fn url_with_password(&self, password: &str) -> Option<String> {
        match &self.inner {
            Inner::External(_) => None,
            Inner::Local(l) => Some(l.url(password)),
        }
    }

    /// The TCP port (local clusters).
    #[must_use]
    pub fn port(&self) -> Option<u16> {
        match &self.inner {
            Inner::External(_) => None,
            Inner::Local(l) => Some(l.port),
        }
    }

    /// The PEM certificate of the CA that signed the server certificate of a cluster
    /// built with [`PgClusterBuilder::tls`].
    #[must_use]
    pub fn tls_certificate(&self) -> Option<Vec<u8>> {
        match &self.inner {
            Inner::Local(l) => fs::read(l.base.join("ca.crt")).ok(),
            Inner::External(_) => None,
        }
    }

    /// The postmaster's process id (local clusters that are running).
    #[must_use]
    pub fn postmaster_pid(&self) -> Option<u32> {
        match &self.inner {
            Inner::Local(l) => l.child.as_ref().map(Child::id),
            Inner::External(_) => None,
        }
    }

    /// A hot standby of this (local) cluster: `pg_basebackup -R -X stream`, started on
    /// another port. It answers `pg_is_in_recovery() = true`.
    ///
    /// # Errors
    ///
    /// For an external server, or when the backup or the start fails.
    pub fn start_standby(&self) -> io::Result<Self> {
        let Inner::Local(primary) = &self.inner else {
            return Err(io::Error::other(
                "a standby needs a local primary, not DATABASE_URL",
            ));
        };
        Local::start(primary.settings.clone(), false, Some(primary), false).map(|l| Self {
            inner: Inner::Local(l),
        })
    }

    /// `true` for a local cluster this harness controls.
    #[must_use]
    pub fn is_local(&self) -> bool {
        matches!(self.inner, Inner::Local(_))
    }

    /// Stops the server: `mode` is `"fast"` (SIGINT), `"immediate"` (SIGQUIT) or
    /// `"smart"` (SIGTERM); waits until it exited.
    ///
    /// # Errors
    ///
    /// For an external server, or when it does not stop within 60 s.
    pub fn stop(&mut self, mode: &str) -> io::Result<()> {
        self.local()?.stop(mode)
    }

    /// Starts a stopped server again on the same port and data.
    ///
    /// # Errors
    ///
    /// For an external server, or when it does not start.
    pub fn start_again(&mut self) -> io::Result<()> {
        self.local()?.spawn_and_wait()
    }

    /// Stops (`mode` as in [`stop`](Self::stop)) and starts again.
    ///
    /// # Errors
    ///
    /// As [`stop`](Self::stop) and [`start_again`](Self::start_again).
    pub fn restart(&mut self, mode: &str) -> io::Result<()> {
        self.stop(mode)?;
        self.start_again()
    }

    fn local(&mut self) -> io::Result<&mut Local> {
        match &mut self.inner {
            Inner::Local(l) => Ok(l),
            Inner::External(_) => Err(io::Error::other(
                "this needs a local cluster, not DATABASE_URL",
            )),
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if let Inner::Local(l) = &mut self.inner {
            let _ = l.stop("immediate");
            let _ = fs::remove_dir_all(&l.base);
        }
    }
}

impl Local {
    fn start(
        mut settings: Vec<(String, String)>,
        tls: bool,
        standby_of: Option<&Local>,
        own_initdb: bool,
    ) -> io::Result<Self> {
        let bin_dir = find_bin_dir()?;
        let run_as = run_as()?;
        let root = std::env::temp_dir().join("chosen-pg");
        fs::create_dir_all(&root)?;
        set_mode(&root, 0o1777)?;
        sweep_stale(&root);
        let template = ensure_template(&root, &bin_dir, run_as.as_ref())?;

        let base = root.join(format!(
            "c-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base)?;
        let data = base.join("data");
        match standby_of {
            None if own_initdb => {
                if let Some(r) = &run_as {
                    chown(&base, r)?;
                }
                initdb(&bin_dir, &data, &base, run_as.as_ref())?;
            }
            None => run(Command::new("cp").arg("-a").arg(&template).arg(&data))?,
            Some(primary) => {
                if let Some(r) = &run_as {
                    chown(&base, r)?;
                }
                run(command_as(&bin_dir, "pg_basebackup", run_as.as_ref())
                    .arg("-D")
                    .arg(&data)
                    .args(["-R", "-X", "stream", "-h", "127.0.0.1", "-U", SUPERUSER])
                    .arg("-p")
                    .arg(primary.port.to_string())
                    .env("PGPASSWORD", SUPERUSER_PASSWORD))?;
            }
        }
        if tls {
            make_certificates(&base)?;
            set_mode(&base.join("server.key"), 0o600)?;
            settings.push(("ssl".to_owned(), "on".to_owned()));
            settings.push((
                "ssl_cert_file".to_owned(),
                base.join("server.crt").display().to_string(),
            ));
            settings.push((
                "ssl_key_file".to_owned(),
                base.join("server.key").display().to_string(),
            ));
        }
        if let Some(r) = &run_as {
            chown(&base, r)?;
        }
        let mut local = Self {
            bin_dir,
            base,
            data,
            port: 0,
            run_as,
            settings,
            child: None,
        };
        let mut last = None;
        for _ in 0..5 {
            local.port = free_port()?;
            match local.spawn_and_wait() {
                Ok(()) => return Ok(local),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("BUG: five attempts made"))
    }

    fn url(&self, password: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{password}@127.0.0.1:{}/postgres",
            self.port
        )
    }

    fn spawn_and_wait(&mut self) -> io::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let log_path = self.base.join("postgres.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.data)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("port={}", self.port))
            .args(["-c", "unix_socket_directories="])
            .args(["-c", "fsync=off"])
            .args(["-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB"])
            .args(["-c", "max_connections=200"])
            .args(["-c", "log_min_messages=warning"]);
        for (k, v) in &self.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut child = cmd.spawn()?;
        let started = Instant::now();
        let pid_file = self.data.join("postmaster.pid");
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "postgres exited with {status} while starting; log:\n{}",
                    tail(&log_path)
                )));
            }
            // Line 8 of postmaster.pid says "ready" once connections are accepted.
            if let Ok(text) = fs::read_to_string(&pid_file)
                && text
                    .lines()
                    .nth(7)
                    .is_some_and(|l| matches!(l.trim(), "ready" | "standby"))
            {
                self.child = Some(child);
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(format!(
                    "postgres did not become ready within 60 s; log:\n{}",
                    tail(&log_path)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self, mode: &str) -> io::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let signal = match mode {
            "smart" => "TERM",
            "fast" => "INT",
            "immediate" => "QUIT",
            other => {
                self.child = Some(child);
                return Err(io::Error::other(format!(
                    "unknown stop mode {other:?}: use smart, fast or immediate"
                )));
            }
        };
        crate::signal(child.id(), signal)?;
        let started = Instant::now();
        loop {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other("postgres did not stop within 60 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn command(&self, program: &str) -> Command {
        command_as(&self.bin_dir, program, self.run_as.as_ref())
    }
}

fn command_as(bin_dir: &Path, program: &str, run_as: Option<&RunAs>) -> Command {
    let program = bin_dir.join(program);
    match run_as {
        // setpriv execs, so signals sent to the child reach postgres itself.
        Some(r) => {
            let mut cmd = Command::new("setpriv");
            cmd.arg(format!("--reuid={}", r.uid))
                .arg(format!("--regid={}", r.gid))
                .arg("--init-groups")
                .arg("--")
                .arg(program)
                .current_dir("/")
                .env("USER", &r.user);
            cmd
        }
        None => Command::new(program),
    }
}

/// Copies of one `initdb` are much faster than an `initdb` per cluster.
fn ensure_template(root: &Path, bin_dir: &Path, run_as: Option<&RunAs>) -> io::Result<PathBuf> {
    let version = run_output(Command::new(bin_dir.join("postgres")).arg("--version"))?;
    let version: String = version
        .split_whitespace()
        .last()
        .unwrap_or("unknown")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '.')
        .collect();
    let template = root.join(format!("template-v{TEMPLATE_VERSION}-{version}"));
    if template.join("PG_VERSION").exists() && template.join("chosen-template-ready").exists() {
        return Ok(template);
    }
    let scratch = root.join(format!(
        "tmpl-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch)?;
    let data = scratch.join("data");
    if let Some(r) = run_as {
        chown(&scratch, r)?;
    }
    if let Err(e) = initdb(bin_dir, &data, &scratch, run_as) {
        let _ = fs::remove_dir_all(&scratch);
        return Err(e);
    }
    fs::File::create(data.join("chosen-template-ready"))?;
    if let Some(r) = run_as {
        chown(&data, r)?;
    }
    // Another process may have won the race; either template is fine.
    if fs::rename(&data, &template).is_err() && !template.join("chosen-template-ready").exists() {
        let _ = fs::remove_dir_all(&scratch);
        return Err(io::Error::other(format!(
            "could not install the cluster template at {}",
            template.display()
        )));
    }
    let _ = fs::remove_dir_all(&scratch);
    Ok(template)
}

/// `initdb` into `data` (its parent `dir`, owned by the user it runs as, holds the
/// password file).
fn initdb(bin_dir: &Path, data: &Path, dir: &Path, run_as: Option<&RunAs>) -> io::Result<()> {
    let pwfile = dir.join("pw");
    fs::File::create(&pwfile)?.write_all(SUPERUSER_PASSWORD.as_bytes())?;
    if let Some(r) = run_as {
        chown(&pwfile, r)?;
    }
    run(command_as(bin_dir, "initdb", run_as)
        .arg("-D")
        .arg(data)
        .args([
            "-U",
            SUPERUSER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
        ])
        .args(["--encoding=UTF8", "--locale=C", "--no-sync"])
        .arg(format!("--pwfile={}", pwfile.display())))
}

/// Removes clusters whose owning process is gone (a test that was killed).
fn sweep_stale(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("c-")
            .or_else(|| name.strip_prefix("tmpl-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let pid_file = entry.path().join("data").join("postmaster.pid");
        if let Some(postmaster) = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
        {
            let _ = crate::signal(postmaster, "QUIT");
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = fs::remove_dir_all(entry.path());
    }
}

/// The server binaries' directory: `PG_BIN_DIR` as given, else where they are installed,
/// else installed now (see [`packages::find_or_install`]).
fn find_bin_dir() -> io::Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    packages::find_or_install(packages::POSTGRESQL, find_installed_bin_dir)
}

fn find_installed_bin_dir() -> io::Result<PathBuf> {
    if let Ok(out) = run_output(Command::new("pg_config").arg("--bindir")) {
        let dir = PathBuf::from(out.trim());
        if dir.join("initdb").exists() && dir.join("postgres").exists() {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").exists() && dir.join("postgres").exists() {
                return Ok(fs::canonicalize(dir.join("initdb"))?
                    .parent()
                    .map_or(dir, Path::to_path_buf));
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "PostgreSQL server binaries (initdb, postgres) not found on PATH, via pg_config, or under /usr/lib/postgresql/<version>/bin",
    ))
}

fn run_as() -> io::Result<Option<RunAs>> {
    // /proc/self is owned by the effective uid.
    let euid = fs::metadata("/proc/self").map_or(1, |m| std::os::unix::fs::MetadataExt::uid(&m));
    if euid != 0 {
        return Ok(None);
    }
    // The server and pgbouncer are started through setpriv.
    packages::find_or_install(packages::UTIL_LINUX, || packages::find_on_path("setpriv"))?;
    for user in ["postgres", "nobody"] {
        let uid = run_output(Command::new("id").args(["-u", user]));
        let gid = run_output(Command::new("id").args(["-g", user]));
        if let (Ok(uid), Ok(gid)) = (uid, gid)
            && let (Ok(uid), Ok(gid)) = (uid.trim().parse(), gid.trim().parse())
        {
            return Ok(Some(RunAs {
                user: user.to_owned(),
                uid,
                gid,
            }));
        }
    }
    Err(io::Error::other(
        "running as root, and neither a `postgres` nor a `nobody` user exists to run the server as (initdb refuses root)",
    ))
}

fn chown(path: &Path, r: &RunAs) -> io::Result<()> {
    run(Command::new("chown")
        .arg("-R")
        .arg(format!("{}:{}", r.uid, r.gid))
        .arg(path))
}

fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let current = fs::metadata(path)?.permissions().mode() & 0o7777;
    if current != mode {
        // Only the creator may change it; another user's directory is fine as it is.
        let _ = fs::set_permissions(path, fs::Permissions::from_mode(mode));
    }
    Ok(())
}

/// A test CA and a server certificate it signed, for `localhost` and 127.0.0.1 (a
/// self-signed CA certificate cannot serve as the server's own: webpki refuses it).
fn make_certificates(dir: &Path) -> io::Result<()> {
    let openssl =
        packages::find_or_install(packages::OPENSSL, || packages::find_on_path("openssl"))?;
    let ext = dir.join("server.ext");
    fs::write(
        &ext,
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )?;
    run(Command::new(&openssl)
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ])
        .args(["-subj", "/CN=chosen-test-ca"])
        .arg("-keyout")
        .arg(dir.join("ca.key"))
        .arg("-out")
        .arg(dir.join("ca.crt")))?;
    run(Command::new(&openssl)
        .args([
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
        ])
        .arg("-keyout")
        .arg(dir.join("server.key"))
        .arg("-out")
        .arg(dir.join("server.csr")))?;
    run(Command::new(&openssl)
        .args(["x509", "-req", "-days", "2", "-CAcreateserial"])
        .arg("-in")
        .arg(dir.join("server.csr"))
        .arg("-CA")
        .arg(dir.join("ca.crt"))
        .arg("-CAkey")
        .arg(dir.join("ca.key"))
        .arg("-extfile")
        .arg(&ext)
        .arg("-out")
        .arg(dir.join("server.crt")))
}

fn free_port() -> io::Result<u16> {
    // Below the kernel's ephemeral range, so outgoing connections don't take it.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos()) as u64
        ^ (u64::from(std::process::id()) << 16)
        ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(7919);
    for i in 0..200u64 {
        let port = 15_000 + ((seed.wrapping_add(i.wrapping_mul(104_729))) % 15_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::other("no free TCP port found in 15000..30000"))
}

fn run(cmd: &mut Command) -> io::Result<()> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{:?} failed ({}): {}{}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

fn run_output(cmd: &mut Command) -> io::Result<String> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(io::Error::other(format!("{cmd:?} failed ({})", out.status)))
    }
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A PgBouncer in front of a local cluster (the Debian `pgbouncer` package).
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    dir: PathBuf,
    child: Child,
}

/// PgBouncer's settings: listening on `port`, in front of the server on
/// `server_port`. `server_login_retry = 1`: after a failed login (a server restarting
/// behind it), it tries again within a second, not its default 15 s.
fn bouncer_ini(dir: &Path, port: u16, server_port: u16, pool_mode: &str, pool_size: u32) -> String {
    format!(
        "[databases]\n* = host=127.0.0.1 port={server_port}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\nauth_type = plain\nauth_file = {}\npool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 2000\nignore_startup_parameters = extra_float_digits,options\nserver_login_retry = 1\nlogfile = {}\npidfile =\n",
        dir.join("userlist.txt").display(),
        dir.join("pgbouncer.log").display(),
    )
}

impl PgBouncer {
    /// Starts PgBouncer with `pool_mode` (`session` or `transaction`) and at most
    /// `pool_size` server connections, in front of `cluster`.
    ///
    /// # Errors
    ///
    /// `NotFound` when `pgbouncer` is missing and could not be installed (as for the
    /// server binaries, see [`PgClusterBuilder::start`]; the message names the command
    /// to run), or when it does not start.
    pub fn start(cluster: &PgCluster, pool_mode: &str, pool_size: u32) -> io::Result<Self> {
        let port = cluster
            .port()
            .ok_or_else(|| io::Error::other("PgBouncer tests need a local cluster"))?;
        Self::start_to(cluster, port, pool_mode, pool_size)
    }

    /// As [`start`](Self::start), but PgBouncer connects to `server_port` on
    /// loopback (a proxy in front of `cluster`, which a failover moves to the promoted
    /// server, as a virtual IP or a DNS name would be).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_to(
        cluster: &PgCluster,
        server_port: u16,
        pool_mode: &str,
        pool_size: u32,
    ) -> io::Result<Self> {
        let Inner::Local(local) = &cluster.inner else {
            return Err(io::Error::other("PgBouncer tests need a local cluster"));
        };
        // Where Debian installs it, then `PATH` (what `.ci/run` checks with `command -v`).
        let binary = packages::find_or_install(packages::PGBOUNCER, || {
            packages::find_in([Path::new("/usr/sbin"), Path::new("/usr/bin")], "pgbouncer")
                .or_else(|_| packages::find_on_path("pgbouncer"))
        })?;
        // Beside the cluster's directory, not in it: a failover drops the first
        // cluster while PgBouncer goes on (with its settings and log). Named as the
        // clusters' are, so that it is swept as theirs are if this process dies.
        let root = local.base.parent().unwrap_or(&local.base);
        let dir = root.join(format!(
            "c-{}-pgbouncer-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir)?;
        let port = free_port()?;
        fs::write(
            dir.join("userlist.txt"),
            format!("\"{SUPERUSER}\" \"{SUPERUSER_PASSWORD}\"\n"),
        )?;
        fs::write(
            dir.join("pgbouncer.ini"),
            bouncer_ini(&dir, port, server_port, pool_mode, pool_size),
        )?;
        if let Some(r) = &local.run_as {
            chown(&dir, r)?;
        }
        let mut cmd = match &local.run_as {
            Some(r) => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={}", r.uid))
                    .arg(format!("--regid={}", r.gid))
                    .arg("--init-groups")
                    .arg("--")
                    .arg(&binary)
                    .current_dir("/");
                c
            }
            None => Command::new(&binary),
        };
        let mut child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let started = Instant::now();
        while TcpListener::bind(("127.0.0.1", port)).is_ok() {
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "pgbouncer exited with {status}; log:\n{}",
                    tail(&dir.join("pgbouncer.log"))
                )));
            }
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                return Err(io::Error::other(
                    "pgbouncer did not start listening within 20 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self { port, dir, child })
    }

    /// The port PgBouncer listens on (loopback).
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The superuser's URL through PgBouncer.
    #[must_use]
    pub fn url(&self) -> String {
        format!(
            "postgres://{SUPERUSER}:{SUPERUSER_PASSWORD}@127.0.0.1:{}/postgres",
            self.port
        )
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
