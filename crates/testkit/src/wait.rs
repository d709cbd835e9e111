//! Awaiting a condition instead of sleeping and hoping: poll state the test
//! can observe until it holds, failing the test by name after a generous
//! bound: `timed out after 5s waiting for <what>`, with the last value
//! observed where the probe reports one.
//!
//! One loop serves every kind of wait:
//! - [`until`] and [`until_some`]: a cheap in-process condition, polled
//!   every [`POLL`] on tokio's clock;
//! - [`Wait`]: the same with a poll period of its own (a condition that
//!   costs an RPC, an HTTP request or a process), a condition that must
//!   await ([`Wait::until_async`], [`Wait::ok_async`]), or a blocking test
//!   on a plain thread ([`Wait::until_blocking`], [`Wait::ok_blocking`]);
//! - the `try_` forms hand the last observed value back instead of
//!   panicking, for a caller whose failure message says more (a child's
//!   stderr) or who asserts on what was last seen.
//!
//! The async forms bound the wait on tokio time, so under a paused clock
//! the bound is reached without waiting, and a condition that never holds
//! still fails. The blocking forms use the wall clock.

use std::fmt;
use std::future::Future;
use std::process::{Child, ExitStatus};
use std::time::Duration;

/// How often a condition is polled by default: often, because a condition
/// reads in-process state (a mutex, a counter), which is cheap.
pub const POLL: Duration = Duration::from_millis(1);

/// A wait that ran out: what it waited for, its bound, and the last value
/// the probe reported instead.
#[derive(Debug)]
pub struct TimedOut<E> {
    pub what: String,
    pub within: Duration,
    pub last: E,
}

impl<E: fmt::Debug> fmt::Display for TimedOut<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}; last observed: {:?}",
            self.within, self.what, self.last
        )
    }
}

/// A probe that saw nothing worth reporting (a false condition, a None).
struct Nothing;

/// What a wait is for, how long it may take and how often it looks.
#[derive(Clone, Debug)]
pub struct Wait {
    what: String,
    within: Duration,
    every: Duration,
}

impl Wait {
    /// A wait for `what` (named on timeout) of at most `within`, polling
    /// every [`POLL`].
    pub fn new(what: impl Into<String>, within: Duration) -> Wait {
        Wait {
            what: what.into(),
            within,
            every: POLL,
        }
    }

    /// Polls every `period` instead: for a condition that costs a request
    /// or a process, or that must be seen twice some time apart.
    pub fn every(mut self, period: Duration) -> Wait {
        self.every = period;
        self
    }

    fn timed_out<E>(self, last: E) -> TimedOut<E> {
        TimedOut {
            what: self.what,
            within: self.within,
            last,
        }
    }

    fn fail(&self) -> ! {
        panic!(
            "timed out after {:?} waiting for {}",
            self.within, self.what
        )
    }

    // -- async, on tokio's clock --------------------------------------------

    /// Awaits `probe` until it returns Ok and returns its value; Err with
    /// the last Err it returned once `within` has passed (tokio time).
    pub async fn try_ok_async<T, E, F, Fut>(self, mut probe: F) -> Result<T, TimedOut<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let deadline = tokio::time::Instant::now() + self.within;
        loop {
            let last = match probe().await {
                Ok(value) => return Ok(value),
                Err(last) => last,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(self.timed_out(last));
            }
            tokio::time::sleep(self.every).await;
        }
    }

    /// [`Wait::try_ok_async`], panicking with the last Err on timeout.
    pub async fn ok_async<T, E, F, Fut>(self, probe: F) -> T
    where
        E: fmt::Debug,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.try_ok_async(probe)
            .await
            .unwrap_or_else(|t| panic!("{t}"))
    }

    /// Awaits `probe` until it yields a value and returns it.
    pub async fn some_async<T, F, Fut>(self, mut probe: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let wait = self.clone();
        let got = self
            .try_ok_async(|| {
                let fut = probe();
                async move { fut.await.ok_or(Nothing) }
            })
            .await;
        got.unwrap_or_else(|_| wait.fail())
    }

    /// Awaits `cond` until it holds.
    pub async fn until_async<F, Fut>(self, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        self.some_async(|| {
            let fut = cond();
            async move { fut.await.then_some(()) }
        })
        .await
    }

    /// Polls `probe` until it returns Ok and returns its value; Err with
    /// the last Err once `within` has passed (tokio time).
    pub async fn try_ok<T, E>(
        self,
        mut probe: impl FnMut() -> Result<T, E>,
    ) -> Result<T, TimedOut<E>> {
        self.try_ok_async(|| std::future::ready(probe())).await
    }

    /// [`Wait::try_ok`], panicking with the last Err on timeout.
    pub async fn ok<T, E: fmt::Debug>(self, probe: impl FnMut() -> Result<T, E>) -> T {
        self.try_ok(probe).await.unwrap_or_else(|t| panic!("{t}"))
    }

    /// Polls `probe` until it yields a value and returns it.
    pub async fn some<T>(self, mut probe: impl FnMut() -> Option<T>) -> T {
        self.some_async(|| std::future::ready(probe())).await
    }

    /// Polls `cond` until it holds.
    pub async fn until(self, mut cond: impl FnMut() -> bool) {
        self.until_async(|| std::future::ready(cond())).await
    }

    // -- blocking, on the wall clock, for a test on a plain thread ----------

    /// Polls `probe` on this thread until it returns Ok and returns its
    /// value; Err with the last Err once `within` has passed.
    pub fn try_ok_blocking<T, E>(
        self,
        mut probe: impl FnMut() -> Result<T, E>,
    ) -> Result<T, TimedOut<E>> {
        let deadline = std::time::Instant::now() + self.within;
        loop {
            let last = match probe() {
                Ok(value) => return Ok(value),
                Err(last) => last,
            };
            if std::time::Instant::now() >= deadline {
                return Err(self.timed_out(last));
            }
            std::thread::sleep(self.every);
        }
    }

    /// [`Wait::try_ok_blocking`], panicking with the last Err on timeout.
    pub fn ok_blocking<T, E: fmt::Debug>(self, probe: impl FnMut() -> Result<T, E>) -> T {
        self.try_ok_blocking(probe)
            .unwrap_or_else(|t| panic!("{t}"))
    }

    /// Polls `probe` on this thread until it yields a value and returns it.
    pub fn some_blocking<T>(self, mut probe: impl FnMut() -> Option<T>) -> T {
        let wait = self.clone();
        self.try_ok_blocking(|| probe().ok_or(Nothing))
            .unwrap_or_else(|_| wait.fail())
    }

    /// Polls `cond` on this thread until it holds.
    pub fn until_blocking(self, mut cond: impl FnMut() -> bool) {
        self.some_blocking(|| cond().then_some(()))
    }
}

/// Polls `cond` until it holds; panics naming `what` once `within` has
/// passed without it (tokio time).
pub async fn until(what: &str, within: Duration, cond: impl FnMut() -> bool) {
    Wait::new(what, within).until(cond).await
}

/// Polls `probe` until it yields a value and returns it; panics naming
/// `what` once `within` has passed without one (tokio time).
pub async fn until_some<T>(what: &str, within: Duration, probe: impl FnMut() -> Option<T>) -> T {
    Wait::new(what, within).some(probe).await
}

/// How often [`child_exit`] looks at a child: a `waitpid` is cheap, but
/// the process is a whole program.
const CHILD_POLL: Duration = Duration::from_millis(20);

/// Waits on this thread for `child` to exit, for at most `within`: its exit
/// status, or None if it is still running then (left running: the caller
/// decides whether to kill it and what to report).
pub fn child_exit(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    Wait::new("the child to exit", within)
        .every(CHILD_POLL)
        .try_ok_blocking(|| child.try_wait().expect("try_wait on a child").ok_or(()))
        .ok()
}

/// Lets `d` of tokio time pass on a paused clock, as it would pass: every
/// timer due on the way fires at its own instant, in order
/// (`tokio::time::advance` jumps instead, firing them all at the end). The
/// engine under test runs on the same clock, so a test steps past its
/// deadlines without waiting for them. Panics on a running clock, where
/// this would be a wall-clock sleep.
pub async fn elapse(d: Duration) {
    assert_paused("elapse()");
    tokio::time::sleep(d).await;
}

fn assert_paused(who: &str) {
    let frozen = tokio::time::Instant::now();
    // A running clock moves between a thousand readings; a paused one never.
    assert!(
        (0..1000).all(|_| tokio::time::Instant::now() == frozen),
        "{who} needs tokio's paused clock (#[tokio::test(start_paused = true)])"
    );
}

/// Lets every task of this runtime run until none can make progress: each
/// is waiting on something (a lock, a semaphore, a channel, I/O, a later
/// timer). A task that has not finished afterwards is blocked, not slow:
/// this is how a test shows that something does NOT happen.
///
/// Needs tokio's paused clock (`#[tokio::test(start_paused = true)]`): a
/// paused clock moves only once no task can run, so the short timer below
/// fires exactly then. On a running clock it would prove nothing, so it
/// panics there.
pub async fn settle() {
    assert_paused("settle()");
    tokio::time::sleep(POLL).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_once_the_condition_holds() {
        let mut polls = 0;
        until("the third poll", Duration::from_secs(1), || {
            polls += 1;
            polls == 3
        })
        .await;
        assert_eq!(polls, 3);
        let mut n = 0;
        let got = until_some("a value", Duration::from_secs(1), || {
            n += 1;
            (n > 1).then_some(n)
        })
        .await;
        assert_eq!(got, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn settle_returns_once_every_task_waits() {
        let gate = std::sync::Arc::new(tokio::sync::Notify::new());
        let (steps, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let task = {
            let gate = std::sync::Arc::clone(&gate);
            tokio::spawn(async move {
                for step in 0..100 {
                    steps.send(step).expect("receiver");
                    tokio::task::yield_now().await;
                }
                gate.notified().await;
            })
        };
        settle().await;
        // Every step ran, and the task now waits for the gate.
        let mut last = None;
        while let Ok(step) = seen.try_recv() {
            last = Some(step);
        }
        assert_eq!(last, Some(99));
        assert!(!task.is_finished());
        gate.notify_one();
        task.await.expect("task");
    }

    #[tokio::test]
    #[should_panic(expected = "settle() needs tokio's paused clock")]
    async fn settle_refuses_a_running_clock() {
        settle().await;
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 5s waiting for never")]
    async fn fails_by_name_after_the_bound() {
        until("never", Duration::from_secs(5), || false).await;
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 2s waiting for an answer; last observed: 7")]
    async fn names_the_last_value_observed() {
        let mut n = 0;
        Wait::new("an answer", Duration::from_secs(2))
            .every(Duration::from_millis(100))
            .ok(|| -> Result<(), i32> {
                n += 1;
                Err(n.min(7))
            })
            .await;
    }

    #[tokio::test(start_paused = true)]
    async fn awaits_a_condition_that_awaits() {
        let (tx, rx) = tokio::sync::watch::channel(0);
        let feeder = tokio::spawn(async move {
            for i in 1..=5 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                tx.send(i).expect("receiver");
            }
        });
        let got = Wait::new("the fifth value", Duration::from_secs(1))
            .ok_async(|| {
                let rx = rx.clone();
                async move {
                    tokio::task::yield_now().await;
                    let v = *rx.borrow();
                    if v == 5 {
                        Ok(v)
                    } else {
                        Err(v)
                    }
                }
            })
            .await;
        assert_eq!(got, 5);
        feeder.await.expect("feeder");
        let err = Wait::new("never", Duration::from_millis(50))
            .try_ok_async(|| async { Err::<(), _>("still no") })
            .await
            .expect_err("never holds");
        assert_eq!(err.last, "still no");
        assert_eq!(
            err.to_string(),
            "timed out after 50ms waiting for never; last observed: \"still no\""
        );
    }

    #[test]
    fn blocking_waits_poll_on_the_thread() {
        let mut polls = 0;
        Wait::new("the third poll", Duration::from_secs(5)).until_blocking(|| {
            polls += 1;
            polls == 3
        });
        assert_eq!(polls, 3);
        let err = Wait::new("never", Duration::from_millis(20))
            .every(Duration::from_millis(5))
            .try_ok_blocking(|| Err::<(), _>(polls))
            .expect_err("never holds");
        assert_eq!(err.last, 3);
    }

    #[test]
    #[should_panic(expected = "timed out after 10ms waiting for nothing")]
    fn blocking_waits_fail_by_name() {
        Wait::new("nothing", Duration::from_millis(10)).until_blocking(|| false);
    }

    #[test]
    fn child_exit_waits_for_the_status_or_says_none() {
        let mut quick = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let status = child_exit(&mut quick, Duration::from_secs(30)).expect("true exits");
        assert!(status.success());
        let mut slow = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        assert!(child_exit(&mut slow, Duration::from_millis(50)).is_none());
        slow.kill().expect("kill");
        slow.wait().expect("reap");
    }

    #[tokio::test(start_paused = true)]
    async fn elapse_fires_each_timer_at_its_instant() {
        let start = tokio::time::Instant::now();
        let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        for ms in [300u64, 100, 200] {
            let seen = std::sync::Arc::clone(&seen);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                seen.lock().push(start.elapsed());
            });
        }
        elapse(Duration::from_millis(250)).await;
        assert_eq!(
            *seen.lock(),
            [Duration::from_millis(100), Duration::from_millis(200)]
        );
        assert_eq!(start.elapsed(), Duration::from_millis(250));
    }

    #[tokio::test]
    #[should_panic(expected = "elapse() needs tokio's paused clock")]
    async fn elapse_refuses_a_running_clock() {
        elapse(Duration::from_millis(1)).await;
    }
}
