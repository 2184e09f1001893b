//! The README's first program, run as a user runs it: two processes of the `quickstart`
//! example against one server. One leads, the other names it; Ctrl-C on the leader ends
//! it cleanly and the other takes over at once.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use chosen_tests::{PgCluster, example_binary, signal};

struct Quickstart {
    child: Child,
    lines: Receiver<String>,
}

impl Quickstart {
    fn spawn(url: &str) -> Self {
        let mut child = Command::new(example_binary("quickstart").expect("the quickstart builds"))
            .env("DATABASE_URL", url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the quickstart starts");
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// Waits up to `limit` until lines containing each of `needles` (in any order)
    /// have come since the last wait; returns the line of the first needle.
    fn wait_for(&self, needles: &[&str], limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        let mut found: Vec<Option<String>> = vec![None; needles.len()];
        while found.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no lines with {needles:?} within {limit:?} ({e})"));
            for (needle, slot) in needles.iter().zip(&mut found) {
                if slot.is_none() && line.contains(needle) {
                    *slot = Some(line.clone());
                }
            }
        }
        found.swap_remove(0).unwrap_or_default()
    }
}

impl Drop for Quickstart {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn two_quickstarts_elect_one_leader_and_hand_over_on_ctrl_c() {
    let pg = PgCluster::start().expect("a PostgreSQL server");
    let url = pg.url();
    let mut first = Quickstart::spawn(&url);
    // A fresh server grants its first lock after the term grant delay (6 s).
    let led = first.wait_for(
        &["this node (", "running nightly-report here"],
        Duration::from_secs(60),
    );
    let leader = led["this node (".len()..]
        .split(')')
        .next()
        .unwrap_or_default()
        .to_owned();

    // The follower names the leader (from its look-ups, every 2 s).
    let second = Quickstart::spawn(&url);
    second.wait_for(&[&format!("{leader} leads admin")], Duration::from_secs(30));

    let ctrl_c = Instant::now();
    signal(first.child.id(), "INT").expect("SIGINT reaches the leader");
    second.wait_for(
        &["this node (", "running nightly-report here"],
        Duration::from_secs(10),
    );
    let handed = ctrl_c.elapsed();
    let status = first.child.wait().expect("the leader exits");
    assert!(
        status.success(),
        "Ctrl-C ends the quickstart cleanly: {status}"
    );
    // An announced release: no poll interval, no lease timeout (generous for CI).
    assert!(handed < Duration::from_secs(3), "hand-over took {handed:?}");
}
