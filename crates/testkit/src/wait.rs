//! Awaiting a condition instead of sleeping and hoping: poll state the test
//! can observe until it holds, failing the test by name after a generous
//! bound.
//!
//! The bound is on tokio time, so under a paused clock it is reached
//! without waiting, and a condition that never holds still fails.

use std::time::Duration;

/// How often a condition is polled: often, because a condition reads
/// in-process state (a mutex, a counter), which is cheap.
pub const POLL: Duration = Duration::from_millis(1);

/// Polls `cond` until it holds; panics naming `what` once `within` has
/// passed without it.
pub async fn until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    until_some(what, within, || cond().then_some(())).await
}

/// Polls `probe` until it yields a value and returns it; panics naming
/// `what` once `within` has passed without one.
pub async fn until_some<T>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what} ({within:?})"
        );
        tokio::time::sleep(POLL).await;
    }
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
    let frozen = tokio::time::Instant::now();
    // A running clock moves between a thousand readings; a paused one never.
    assert!(
        (0..1000).all(|_| tokio::time::Instant::now() == frozen),
        "settle() needs tokio's paused clock (#[tokio::test(start_paused = true)])"
    );
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
    #[should_panic(expected = "timed out waiting for never (5s)")]
    async fn fails_by_name_after_the_bound() {
        until("never", Duration::from_secs(5), || false).await;
    }
}
