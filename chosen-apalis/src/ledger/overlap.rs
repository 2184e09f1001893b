//! One run of a job at a time on a node, and what a tick due during a run does.

use std::collections::BTreeMap;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{MutexGuard, watch};

/// What a tick due while the previous run of the job is still running on this node
/// does (runs on two nodes cannot overlap: only the leader runs, and the ledgered gate
/// stops a run when its leadership is lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Overlap {
    /// The tick is not run: recorded `skipped`, reason `previous run still running`
    /// (at once, or, when the running run's transaction holds the job's fence row,
    /// once that run has ended).
    Skip,
    /// The tick waits for the previous run, then runs. One tick at most waits: a
    /// further one is not run now and not recorded, so the next run finds it missing
    /// and the [`Misfire`](crate::Misfire) policy decides about it (`CatchUp` runs it
    /// late, `Skip` records it `skipped`); nothing queues up in memory.
    #[default]
    Buffer,
    /// The previous run is cancelled (its future dropped; recorded `cancelled`, reason
    /// `a newer tick is due`; a previous tick still waiting for the job's readiness was
    /// never claimed, and is left unrecorded, to the misfire policy), then the tick
    /// runs.
    CancelPrevious,
}

/// The reasons recorded for ticks an overlap skipped. Do not change: operators query
/// them.
pub(crate) const SKIP_RUNNING: &str = "previous run still running";
pub(crate) const SKIP_NOT_NEWER: &str =
    "the same tick, or a later one, is running or waiting on this node";
pub(crate) const SKIP_BUFFER_FULL: &str =
    "previous run still running, one tick already waiting: left to the misfire policy";

/// Why a tick does not get the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Record the tick `skipped` with this reason.
    Record(&'static str),
    /// Leave the tick unrecorded, to the misfire policy of the next run.
    Defer(&'static str),
}

/// How often a tick waiting under [`Overlap::CancelPrevious`] repeats its request, so
/// that a run that took the turn just as the request was sent is cancelled too.
const CANCEL_REPEAT: Duration = Duration::from_millis(50);

/// The turn of runs of one job on one node.
#[derive(Debug)]
pub(crate) struct Turn {
    serial: tokio::sync::Mutex<()>,
    waiting: AtomicBool,
    /// The ticks running or waiting for the turn: a tick not newer than all of them is
    /// a duplicate (or out of order), not a newer tick, and must not run beside or
    /// cancel the one it duplicates. Nothing is remembered once they end, so a wall
    /// clock stepped forward and back does not keep real ticks out.
    inflight: std::sync::Mutex<BTreeMap<u64, usize>>,
    cancel: watch::Sender<u64>,
    /// Ticks [`Overlap::Skip`] refused that could not be recorded at once (the running
    /// run's transaction holds the job's fence row), each with the token it was refused
    /// under: recorded by one task once the turn is free, or by the next holder that
    /// looks for missed ticks, whichever comes first.
    skipped: std::sync::Mutex<Vec<(u64, u64)>>,
    /// A task to record [`skipped`](Self::skipped) is on its way.
    recorder: AtomicBool,
}

impl Default for Turn {
    fn default() -> Self {
        Self {
            serial: tokio::sync::Mutex::new(()),
            waiting: AtomicBool::new(false),
            inflight: std::sync::Mutex::default(),
            cancel: watch::Sender::new(0),
            skipped: std::sync::Mutex::default(),
            recorder: AtomicBool::new(false),
        }
    }
}

/// Holding the turn: runs until dropped; [`cancelled`](Held::cancelled) resolves when
/// a newer tick asks for the turn under [`Overlap::CancelPrevious`].
#[derive(Debug)]
pub(crate) struct Held<'a> {
    _serial: MutexGuard<'a, ()>,
    cancel: watch::Receiver<u64>,
    _inflight: Option<Inflight<'a>>,
}

/// A tick in flight on a [`Turn`]: removed when dropped.
#[derive(Debug)]
struct Inflight<'a>(&'a Turn, u64);

impl<'a> Inflight<'a> {
    fn new(turn: &'a Turn, set: &mut BTreeMap<u64, usize>, tick: u64) -> Self {
        *set.entry(tick).or_default() += 1;
        Self(turn, tick)
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        let mut set = self
            .0
            .inflight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = set.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                set.remove(&self.1);
            }
        }
    }
}

impl Held<'_> {
    /// Resolves when a newer tick asks this run to stop.
    pub(crate) async fn cancelled(&mut self) {
        if self.cancel.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Turn {
    /// Takes the turn for a tick, as `overlap` says; `Err` when the tick does not run
    /// now.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (a dropped wait leaves the turn as it was, and a dropped buffered
    /// wait frees the buffer slot).
    pub(crate) async fn take(&self, overlap: Overlap, tick: u64) -> Result<Held<'_>, Refused> {
        let inflight = {
            let mut set = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
            if set
                .last_key_value()
                .is_some_and(|(newest, _)| *newest >= tick)
            {
                return Err(Refused::Defer(SKIP_NOT_NEWER));
            }
            Inflight::new(self, &mut set, tick)
        };
        let held = |serial| Ok(self.held(serial, Some(inflight)));
        if let Ok(serial) = self.serial.try_lock() {
            return held(serial);
        }
        // Held for no tick (a skip being recorded after the run it overlapped): no run
        // to skip for, wait for it as for a run that ends.
        let only_recording = self
            .inflight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .all(|(t, n)| *t == tick && *n == 1);
        match overlap {
            Overlap::Skip if only_recording => held(self.serial.lock().await),
            Overlap::Skip => Err(Refused::Record(SKIP_RUNNING)),
            Overlap::Buffer => {
                if self.waiting.swap(true, Ordering::AcqRel) {
                    return Err(Refused::Defer(SKIP_BUFFER_FULL));
                }
                let slot = WaitingSlot(&self.waiting);
                let serial = self.serial.lock().await;
                drop(slot);
                held(serial)
            }
            Overlap::CancelPrevious => {
                let mut serial = std::pin::pin!(self.serial.lock());
                loop {
                    self.cancel.send_modify(|generation| *generation += 1);
                    tokio::select! {
                        guard = &mut serial => return held(guard),
                        () = tokio::time::sleep(CANCEL_REPEAT) => {}
                    }
                }
            }
        }
    }

    /// Takes the turn whatever runs, waiting as long as needed (catch-up on gaining
    /// leadership, of ticks up to `covering`): meanwhile a tick up to `covering`
    /// delivered again is a duplicate.
    pub(crate) async fn wait(&self, covering: u64) -> Held<'_> {
        let inflight = {
            let mut set = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
            Inflight::new(self, &mut set, covering)
        };
        let serial = self.serial.lock().await;
        self.held(serial, Some(inflight))
    }

    /// Keeps a skipped tick (and the token it was refused under) to record once the
    /// turn is free; `true` when the caller is to start the task that records them
    /// (none is on its way).
    pub(crate) fn defer_skip(&self, tick: u64, token: u64) -> bool {
        self.skipped
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((tick, token));
        !self.recorder.swap(true, Ordering::AcqRel)
    }

    /// The kept skips, to record now: `held` proves the turn is ours, so the runs they
    /// overlapped have ended. A recorder task that takes them is done: a skip kept
    /// after this starts another.
    pub(crate) fn take_skips(&self, held: &Held<'_>, recorder: bool) -> Vec<(u64, u64)> {
        let _ = held;
        if recorder {
            self.recorder.store(false, Ordering::Release);
        }
        std::mem::take(&mut *self.skipped.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Waits until the turn is free, and takes it for no tick (to record the skips the
    /// run that held it kept waiting).
    pub(crate) async fn free(&self) -> Held<'_> {
        let serial = self.serial.lock().await;
        self.held(serial, None)
    }

    fn held<'a>(&'a self, serial: MutexGuard<'a, ()>, inflight: Option<Inflight<'a>>) -> Held<'a> {
        // Subscribed after taking the turn: requests sent before were for the
        // previous holder (and are repeated if still wanted).
        Held {
            _serial: serial,
            cancel: self.cancel.subscribe(),
            _inflight: inflight,
        }
    }
}

/// Frees the buffer slot when the buffered wait ends, or is dropped.
struct WaitingSlot<'a>(&'a AtomicBool);

impl Drop for WaitingSlot<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn skip_refuses_while_a_run_holds_the_turn() {
        let turn = Turn::default();
        let held = turn.take(Overlap::Skip, 1).await.unwrap();
        assert_eq!(
            turn.take(Overlap::Skip, 2).await.unwrap_err(),
            Refused::Record(SKIP_RUNNING)
        );
        drop(held);
        assert!(turn.take(Overlap::Skip, 3).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn buffer_keeps_one_waiting_tick() {
        let turn = Arc::new(Turn::default());
        let held = turn.take(Overlap::Buffer, 4).await.unwrap();
        let waiter = {
            let turn = Arc::clone(&turn);
            tokio::spawn(async move {
                let _held = turn.take(Overlap::Buffer, 5).await.unwrap();
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            turn.take(Overlap::Buffer, 6).await.unwrap_err(),
            Refused::Defer(SKIP_BUFFER_FULL)
        );
        drop(held);
        waiter.await.unwrap();
        // The slot is free again.
        assert!(turn.take(Overlap::Buffer, 7).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn cancel_previous_stops_the_holder_and_takes_the_turn() {
        let turn = Arc::new(Turn::default());
        let mut held = turn.take(Overlap::CancelPrevious, 8).await.unwrap();
        let newer = {
            let turn = Arc::clone(&turn);
            tokio::spawn(async move { turn.take(Overlap::CancelPrevious, 9).await.is_ok() })
        };
        // The holder is asked to stop; when it does, the newer tick runs.
        tokio::time::timeout(Duration::from_secs(1), held.cancelled())
            .await
            .expect("the holder is asked to stop");
        drop(held);
        assert!(newer.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_holder_does_not_see_requests_sent_before_it_took_the_turn() {
        let turn = Turn::default();
        turn.cancel.send_modify(|g| *g += 1);
        let mut held = turn.wait(0).await;
        assert!(
            tokio::time::timeout(Duration::from_secs(1), held.cancelled())
                .await
                .is_err()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_duplicate_or_older_tick_is_refused_without_cancelling() {
        let turn = Turn::default();
        let mut held = turn.take(Overlap::CancelPrevious, 10).await.unwrap();
        for tick in [10, 9] {
            assert_eq!(
                turn.take(Overlap::CancelPrevious, tick).await.unwrap_err(),
                Refused::Defer(SKIP_NOT_NEWER)
            );
        }
        assert!(
            tokio::time::timeout(Duration::from_secs(1), held.cancelled())
                .await
                .is_err(),
            "the running tick was not asked to stop"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_remembered_once_the_ticks_end() {
        let turn = Turn::default();
        let held = turn.take(Overlap::Buffer, 100).await.unwrap();
        drop(held);
        // A clock stepped back: older ticks run again once nothing is in flight.
        assert!(turn.take(Overlap::Buffer, 50).await.is_ok());
    }
}
