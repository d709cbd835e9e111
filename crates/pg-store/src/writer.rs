//! The write path: one task drains everything queued into commit rounds
//! (group commit), and keeps up to [`ROUNDS_IN_FLIGHT`] of them committing
//! at once on separate pooled connections, so a round's WAL flush overlaps
//! the next rounds' work instead of every round waiting for the one before
//! (see `commit` for what makes that safe: round numbers, stamped rows).
//! A new round starts beside others only once the youngest one has sent
//! its COMMIT and waits for the flush, and only with at least as many
//! tickets queued as the youngest carries: a round costs both sides a fixed
//! amount of work whatever its size, so splitting what one round could
//! carry into two small ones only spends it twice. With a fast flush the
//! youngest round ends before that many arrive and rounds run one after
//! the other, each carrying everything queued; with a slow one, rounds
//! overlap and each flush covers several.
//!
//! Tickets are published in the order rounds were formed, so a ticket is
//! acknowledged only when every round before it has ended. A round that
//! fails hands its rows back to be carried by the next round, and every
//! round already in flight then ends with the same failure for its
//! waiters, whether it landed or not: it was formed without the failed
//! rows, and a success would acknowledge a ticket while an earlier one is
//! not durable. The rounds formed afterwards carry everything, so once
//! one of them lands, everything before it is durable. A round whose
//! outcome stays unknown (the read that would tell failed too) stops new
//! rounds until a read settles it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use providerkit::{Change, StoreError, Ticket};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::commit::{commit_round, round_landed, Outcome, Owner, RoundPlan, Rows};
use crate::shared::Shared;

/// Rounds committing at once. A round's time is mostly the server's WAL
/// flush, which PostgreSQL shares between the transactions that wait for
/// it: a few rounds in flight make one flush cover several of them.
pub(crate) const ROUNDS_IN_FLIGHT: usize = 4;

/// Rounds overlap only while the rows in flight and queued stay within
/// this many (see `room_for_a_round`).
const OVERLAP_ROWS: usize = 4096;

/// Every this many rounds, a round also forgets the numbers of the rounds
/// that are settled (far more than [`ROUNDS_IN_FLIGHT`], so two prunes are
/// never in flight together).
const PRUNE_EVERY: i64 = 512;

/// How long the last rounds before the store stops may take: an
/// unreachable database must not hold the process's exit for the pool's
/// timeouts (what they could not commit was never acknowledged).
const SHUTDOWN_ROUND: Duration = Duration::from_secs(10);

/// How long the writer waits before retrying changes whose commit failed
/// when no new submission arrives to carry them.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// A round on its way.
struct Round {
    number: i64,
    /// The tickets it carries: `first..=last`.
    first: Ticket,
    last: Ticket,
    rows: Arc<Rows>,
    /// Its rows are written and it waits for the flush.
    flushing: Arc<AtomicBool>,
    /// Set when an earlier round failed while this one was in flight: its
    /// waiters get that failure whatever this round's outcome.
    poisoned: Option<StoreError>,
    task: JoinHandle<Outcome>,
}

/// What woke the writer.
enum Event {
    /// The oldest round in flight ended.
    Ended(Result<Outcome, tokio::task::JoinError>),
    /// Something was queued (or nothing: look again).
    Woken,
    /// The retry interval passed with rows carried.
    Retry,
}

impl Round {
    fn tickets(&self) -> Ticket {
        (self.last + 1).saturating_sub(self.first)
    }
}

/// What the writer holds between rounds.
struct Writer {
    shared: Arc<Shared>,
    pool: Pool,
    owner: Owner,
    done_tx: watch::Sender<Ticket>,
    /// The next round's number.
    next_number: i64,
    /// The last ticket given to a round (or settled without one).
    formed: Ticket,
    /// The last ticket published.
    done: Ticket,
    /// Rows not yet known to be durable and in no round in flight.
    carry: Rows,
    /// Rounds whose outcome is unknown, with their rows.
    doubts: Vec<(i64, Arc<Rows>)>,
    in_flight: VecDeque<Round>,
}

/// Drain the queue into rounds until shut down. `last_round` is the
/// highest round number committed before this store opened.
pub(crate) async fn writer_loop(
    shared: Arc<Shared>,
    pool: Pool,
    owner: Owner,
    done_tx: watch::Sender<Ticket>,
    last_round: i64,
) {
    let mut writer = Writer {
        shared,
        pool,
        owner,
        done_tx,
        next_number: last_round + 1,
        formed: 0,
        done: 0,
        carry: Rows::default(),
        doubts: Vec::new(),
        in_flight: VecDeque::new(),
    };
    loop {
        let (changes, upto, shutdown) = writer.next_work().await;
        if shutdown {
            writer.take(changes, upto).await;
            let drained = tokio::time::timeout(SHUTDOWN_ROUND, writer.drain()).await;
            if drained.is_err() {
                tracing::error!(
                    state = %writer.shared.target,
                    "stopped before the last changes were committed (no answer within {}s)",
                    SHUTDOWN_ROUND.as_secs()
                );
            }
            return;
        }
        writer.take(changes, upto).await;
    }
}

impl Writer {
    /// Wait until there is something to do: a round to settle (done here),
    /// or changes to send (returned with the last queued ticket, and
    /// whether the store stops). No changes and no new ticket: the retry
    /// interval passed with rows carried and nothing new queued.
    async fn next_work(&mut self) -> (Vec<Change>, Ticket, bool) {
        loop {
            let room = {
                let mut queue = self.shared.queue.lock();
                let queued = queue.issued.saturating_sub(self.formed);
                let room = self.room_for_a_round(queued, queue.pending.len());
                if room && (!queue.pending.is_empty() || queue.shutdown) {
                    let changes = std::mem::take(&mut queue.pending);
                    return (changes, queue.issued, queue.shutdown);
                }
                room
            };
            let retry = room && (!self.carry.is_empty() || !self.doubts.is_empty());
            let event = {
                let front = self.in_flight.front_mut().map(|round| &mut round.task);
                let settling = front.is_some();
                tokio::select! {
                    Some(outcome) = async {
                        match front {
                            Some(task) => Some(task.await),
                            None => None,
                        }
                    }, if settling => Event::Ended(outcome),
                    // A submission, or the youngest round starting its
                    // flush: either may make room.
                    () = self.shared.wake.notified() => Event::Woken,
                    () = tokio::time::sleep(RETRY_INTERVAL), if retry => Event::Retry,
                }
            };
            match event {
                Event::Ended(outcome) => self.settle_front(outcome),
                Event::Woken => {}
                Event::Retry => return (Vec::new(), self.formed, false),
            }
        }
    }

    /// Whether a round may start now, with `queued` tickets waiting.
    fn room_for_a_round(&self, queued: Ticket, queued_changes: usize) -> bool {
        let Some(youngest) = self.in_flight.back() else {
            return true;
        };
        // While a round's outcome is unknown, nothing new starts before the
        // rounds in flight end and a read settles it. Otherwise a round
        // starts beside the ones flushing when it would be no smaller than
        // the youngest (with a fast flush the youngest ends first and rounds
        // stay whole), and only among small rounds: a large round's fixed
        // cost is already shared by its rows, and large rounds side by side
        // would each hold their encoded rows at once.
        let rows_in_flight: usize = self.in_flight.iter().map(|r| r.rows.len()).sum();
        self.in_flight.len() < ROUNDS_IN_FLIGHT
            && youngest.flushing.load(Ordering::Acquire)
            && self.doubts.is_empty()
            && queued >= youngest.tickets().max(1)
            && rows_in_flight + queued_changes <= OVERLAP_ROWS
    }

    /// Form a round of the carried rows and `changes` (tickets up to
    /// `upto`) and start it; or, while a round's outcome is unknown, try to
    /// settle that first.
    async fn take(&mut self, changes: Vec<Change>, upto: Ticket) {
        let number = self.next_number;
        self.next_number += 1;
        self.carry.stamp(changes, number);
        if !self.doubts.is_empty() {
            // A round formed now would not carry the doubtful rows; settle
            // them first (no round is in flight: see `next_work`).
            if let Err(error) = self.settle_doubts().await {
                self.fail_tickets(upto, error);
                return;
            }
        }
        if self.carry.is_empty() {
            // Nothing new and nothing carried (a retry after the doubtful
            // rounds proved landed, or a stop with nothing queued): every
            // ticket is already in a round.
            return;
        }
        let rows = Arc::new(std::mem::take(&mut self.carry));
        // Rounds in flight are numbered below this one, oldest first.
        let lowest_unsettled = self.in_flight.front().map_or(number, |round| round.number);
        let flushing = Arc::new(AtomicBool::new(false));
        let plan = RoundPlan {
            number,
            owner: self.owner,
            prune_below: (number % PRUNE_EVERY == 0).then_some(lowest_unsettled),
            flushing: Arc::clone(&flushing),
        };
        let task = {
            let shared = Arc::clone(&self.shared);
            let pool = self.pool.clone();
            let rows = Arc::clone(&rows);
            tokio::spawn(async move {
                let outcome = commit_round(&shared, &pool, &plan, &rows).await;
                // The writer looks again at whether a round may start.
                shared.wake.notify_one();
                outcome
            })
        };
        self.in_flight.push_back(Round {
            number,
            first: self.formed + 1,
            last: upto.max(self.formed),
            rows,
            flushing,
            poisoned: None,
            task,
        });
        self.formed = upto.max(self.formed);
    }

    /// The oldest round ended with `outcome`.
    fn settle_front(&mut self, outcome: Result<Outcome, tokio::task::JoinError>) {
        let Some(round) = self.in_flight.pop_front() else {
            return;
        };
        let outcome = outcome.unwrap_or_else(|e| {
            Outcome::Unknown(StoreError::unavailable(format!(
                "PostgreSQL state {}: a commit round stopped: {e}",
                self.shared.target
            )))
        });
        match outcome {
            Outcome::Landed { by_reading } => {
                self.count_landed(by_reading);
                match round.poisoned {
                    Some(error) => self.shared.failures.record(round.first, round.last, error),
                    // Formed after every earlier failure was carried into
                    // it: everything before it is durable now.
                    None => self.shared.failures.clear(),
                }
            }
            Outcome::NotLanded(error) => {
                self.carry.absorb_older(&round.rows);
                self.failed(&round, error);
            }
            Outcome::Unknown(error) => {
                self.doubts.push((round.number, Arc::clone(&round.rows)));
                self.failed(&round, error);
            }
        }
        self.publish(round.last);
    }

    /// A round committed; `by_reading`: its answer was lost and a read
    /// found it.
    fn count_landed(&self, by_reading: bool) {
        self.shared.commits.fetch_add(1, Ordering::Relaxed);
        if by_reading {
            self.shared
                .resolved_by_reading
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `round` did not land (or may not have): its waiters and those of
    /// every round in flight get `error`.
    fn failed(&mut self, round: &Round, error: StoreError) {
        tracing::error!(state = %self.shared.target, error = %error, "state commit failed");
        self.shared
            .failures
            .record(round.first, round.last, error.clone());
        for later in &mut self.in_flight {
            later.poisoned.get_or_insert_with(|| error.clone());
        }
    }

    /// Read how every doubtful round ended: the landed ones are done, the
    /// others' rows are carried again.
    async fn settle_doubts(&mut self) -> Result<(), StoreError> {
        while let Some((number, rows)) = self.doubts.pop() {
            match round_landed(&self.shared, &self.pool, number).await {
                Ok(true) => self.count_landed(true),
                Ok(false) => self.carry.absorb_older(&rows),
                Err(error) => {
                    self.doubts.push((number, rows));
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    /// Tickets up to `upto` could not be sent: they fail now, and their
    /// rows stay carried for the next attempt.
    fn fail_tickets(&mut self, upto: Ticket, error: StoreError) {
        tracing::error!(state = %self.shared.target, error = %error, "state commit failed");
        if upto > self.formed {
            self.shared.failures.record(self.formed + 1, upto, error);
            self.formed = upto;
            self.publish(upto);
        }
    }

    fn publish(&mut self, upto: Ticket) {
        if upto > self.done {
            self.done = upto;
            // No receiver left only means nobody is waiting.
            let _ = self.done_tx.send(upto);
        }
    }

    /// Wait for every round in flight (the store is stopping).
    async fn drain(&mut self) {
        while let Some(round) = self.in_flight.front_mut() {
            let outcome = (&mut round.task).await;
            self.settle_front(outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The order of outcomes, without a database: rounds whose commit
    //! tasks end as the test says.
    use super::*;
    use crate::pool::build_pool;
    use crate::{PgOptions, Target};
    use provider_testkit::store_contract::{machine, record};
    use providerkit::State;

    fn writer() -> (Writer, watch::Receiver<Ticket>) {
        // Never connected: nothing here reaches a database.
        let target = Target::parse("postgres://nobody@127.0.0.1:9/none").expect("target");
        let pool = build_pool(&target, &PgOptions::default(), 1).expect("pool");
        let (done_tx, done) = watch::channel(0);
        let writer = Writer {
            shared: Arc::new(Shared::new("test".into(), Some(1))),
            pool,
            owner: Owner::Lease(1),
            done_tx,
            next_number: 1,
            formed: 0,
            done: 0,
            carry: Rows::default(),
            doubts: Vec::new(),
            in_flight: VecDeque::new(),
        };
        (writer, done)
    }

    /// A round of one machine's record for tickets `first..=last` whose
    /// commit ends with `outcome`.
    fn round(number: i64, id: &str, first: Ticket, last: Ticket, outcome: Outcome) -> Round {
        let mut rows = Rows::default();
        rows.stamp(
            vec![machine(record(id, number as u64, State::Idle))],
            number,
        );
        Round {
            number,
            first,
            last,
            rows: Arc::new(rows),
            flushing: Arc::new(AtomicBool::new(true)),
            poisoned: None,
            task: tokio::spawn(async move { outcome }),
        }
    }

    async fn settle_all(writer: &mut Writer) {
        writer.drain().await;
    }

    #[tokio::test]
    async fn a_failed_round_fails_the_rounds_in_flight_behind_it_even_when_they_land() {
        let (mut writer, done) = writer();
        let failure = StoreError::unavailable("connection reset");
        writer
            .in_flight
            .push_back(round(1, "m-1", 1, 2, Outcome::NotLanded(failure)));
        writer
            .in_flight
            .push_back(round(2, "m-2", 3, 3, Outcome::Landed { by_reading: false }));
        settle_all(&mut writer).await;
        assert_eq!(*done.borrow(), 3, "every waiter has its answer");
        for ticket in 1..=3 {
            let error = writer.shared.failures.failure_for(ticket);
            assert!(
                error.is_some_and(|e| e.to_string().contains("connection reset")),
                "ticket {ticket} must not be acknowledged while ticket 1 is not durable"
            );
        }
        // Only the round that did not land is carried again.
        assert_eq!(writer.carry.len(), 1);
        assert!(writer.carry.holds_machine("m-1"));
        assert!(writer.shared.failures.latest().is_some());
    }

    #[tokio::test]
    async fn a_round_formed_after_the_failure_lands_and_clears_it() {
        let (mut writer, _done) = writer();
        writer.in_flight.push_back(round(
            1,
            "m-1",
            1,
            1,
            Outcome::NotLanded(StoreError::unavailable("down")),
        ));
        settle_all(&mut writer).await;
        assert!(writer.shared.failures.failure_for(1).is_some());
        writer
            .in_flight
            .push_back(round(2, "m-1", 2, 2, Outcome::Landed { by_reading: false }));
        settle_all(&mut writer).await;
        assert!(writer.shared.failures.failure_for(1).is_none());
        assert!(writer.shared.failures.latest().is_none());
    }

    #[tokio::test]
    async fn a_round_of_unknown_outcome_is_held_until_a_read_settles_it() {
        let (mut writer, done) = writer();
        writer.in_flight.push_back(round(
            1,
            "m-1",
            1,
            1,
            Outcome::Unknown(StoreError::unavailable("no answer")),
        ));
        settle_all(&mut writer).await;
        assert_eq!(*done.borrow(), 1);
        assert!(writer.shared.failures.failure_for(1).is_some());
        assert_eq!(writer.doubts.len(), 1, "its rows wait for the read");
        assert!(writer.carry.is_empty(), "and are not carried before it");
    }

    #[tokio::test]
    async fn a_round_starts_beside_another_only_while_it_flushes_and_no_smaller() {
        let (mut writer, _done) = writer();
        assert!(writer.room_for_a_round(1, 1), "nothing in flight");
        let youngest = round(1, "m-1", 1, 4, Outcome::Landed { by_reading: false });
        youngest.flushing.store(false, Ordering::Release);
        writer.in_flight.push_back(youngest);
        assert!(
            !writer.room_for_a_round(9, 9),
            "the youngest is still sending its rows: they could carry more"
        );
        writer.in_flight[0].flushing.store(true, Ordering::Release);
        assert!(
            !writer.room_for_a_round(3, 3),
            "3 queued tickets would make a round smaller than the youngest's 4"
        );
        assert!(writer.room_for_a_round(4, 4));
        assert!(
            !writer.room_for_a_round(4, OVERLAP_ROWS),
            "a large round waits for the rounds in flight"
        );
        writer.doubts.push((0, Arc::new(Rows::default())));
        assert!(
            !writer.room_for_a_round(4, 4),
            "a round of unknown outcome is settled before anything new starts"
        );
        writer.doubts.clear();
        for number in 2..=ROUNDS_IN_FLIGHT as i64 {
            writer.in_flight.push_back(round(
                number,
                "m-2",
                5,
                5,
                Outcome::Landed { by_reading: false },
            ));
        }
        assert!(
            !writer.room_for_a_round(100, 100),
            "at most {ROUNDS_IN_FLIGHT} in flight"
        );
    }

    #[test]
    fn every_writer_has_an_id_of_its_own_and_none_is_the_migrations() {
        let ids: std::collections::HashSet<i64> = (0..256)
            .map(|_| Shared::new("test".into(), None).writer_id)
            .collect();
        assert_eq!(ids.len(), 256);
        assert!(!ids.contains(&0));
    }

    #[test]
    fn an_older_version_handed_back_does_not_replace_a_newer_one() {
        let mut carry = Rows::default();
        carry.stamp(vec![machine(record("m-1", 7, State::Idle))], 5);
        let mut failed = Rows::default();
        failed.stamp(vec![machine(record("m-1", 3, State::Creating))], 4);
        failed.stamp(vec![machine(record("m-2", 3, State::Creating))], 4);
        carry.absorb_older(&failed);
        assert_eq!(carry.machine_stamp("m-1"), Some(5));
        assert_eq!(carry.machine_stamp("m-2"), Some(4));
    }
}
