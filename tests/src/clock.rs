//! One clock for every process of a test run, and signals without an external binary.

use std::io;

use rustix::process::{Pid, Signal, kill_process};
use rustix::time::{ClockId, clock_gettime};

/// Microseconds of `CLOCK_MONOTONIC`: never jumps backwards (NTP steps do not move it)
/// and is one clock for every process on the machine, so stamps taken by different
/// processes compare. It keeps running while a process is stopped (SIGSTOP). It is the
/// clock behind `std::time::Instant` and tokio's timers on Linux, so the library's
/// lease deadlines run on it too.
#[must_use]
pub fn monotonic_us() -> u64 {
    let t = clock_gettime(ClockId::Monotonic);
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0) / 1000
}

/// Sends a signal by name (`STOP`, `CONT`, `KILL`, `TERM`, `INT`, `QUIT`, `HUP`) to a process,
/// with the `kill(2)` system call (no `kill` binary needed).
///
/// # Errors
///
/// An unknown signal name, a pid that is not a process id, or a failed `kill(2)` (no
/// such process, not permitted).
pub fn signal(pid: u32, name: &str) -> io::Result<()> {
    let sig = match name {
        "STOP" => Signal::STOP,
        "CONT" => Signal::CONT,
        "KILL" => Signal::KILL,
        "TERM" => Signal::TERM,
        "INT" => Signal::INT,
        "QUIT" => Signal::QUIT,
        "HUP" => Signal::HUP,
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("unknown signal {other:?}"),
            ));
        }
    };
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("bad pid {pid}")))?;
    kill_process(pid, sig).map_err(|e| io::Error::other(format!("kill -{name} {pid:?}: {e}")))
}
