//! Learning a node's own storage before pacing its clones: how fast one
//! copy runs alone, and how many copies at once its bandwidth holds (its
//! fill). A copy's progress is what PVE prints into a full clone's task
//! log (qemu-img's, in percent); the clones read it while they learn.
//!
//! Why: copies that share a disk end together, so a node's clones finish
//! in rounds and the median machine waits for its round's end. The disk
//! does its best for the median when one clone starts each time the disk
//! has copied one clone's worth, with as many copying at once as fill it
//! and one more allocating: then clones end one after another, not in
//! rounds. That needs the disk's time per clone and its fill, and the fill
//! shows only while a copy runs alone (two or more copies at once look the
//! same on a disk one copy fills and on one two fill): so the domain
//! admits one copy, then one more at a time, and reads each copy's rate
//! until the copies slow one another.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// Percentage points each copy of a stage must advance before its rate
/// counts: qemu-img reports whole percents, so a rate over ten points is
/// within a tenth.
const MIN_ADVANCE: f64 = 10.0;

/// A stage's copies run at least this share of a copy alone: the disk had
/// room for them all, and one more is admitted.
const UNSLOWED: f64 = 0.8;

/// How often a learning copy's log is read, at most and at least.
pub(super) const READ_SOONEST: Duration = Duration::from_millis(250);
const READ_LATEST: Duration = Duration::from_secs(2);

/// Clones admitted while learning without a verdict before it gives up.
const PATIENCE: usize = 12;

/// Times a stage's window may start again (a copy of it ended before its
/// rate counted: copies too short to read) before learning gives up.
const RESTARTS: usize = 3;

/// What the domain learnt, or what it does next.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Learnt {
    /// Admit this many copies at once and measure again.
    Stage(usize),
    /// The disk copies one clone each `every` at its whole bandwidth, and
    /// `fill` copies at once reach it.
    Known { every: Duration, fill: usize },
    /// The copies show no progress (a linked clone, a storage PVE prints
    /// none for) or no verdict came in time: adapt as without it.
    GaveUp,
}

/// When a learning copy's log is to be read next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::proxmox) enum Read {
    /// After this long.
    After(Duration),
    /// When the learning next moves on (a stage's window begins, a stage
    /// follows, it ends): nothing this copy shows counts before then.
    OnChange,
    /// No more: its copy is done, or it is not learning.
    Done,
}

/// One learning copy's samples: (when, percent).
#[derive(Default)]
struct Copy {
    /// Its first sample once it copies (above 0 %).
    copying: Option<(Instant, f64)>,
    /// Its first sample in the current stage's window.
    from: Option<(Instant, f64)>,
    last: Option<(Instant, f64)>,
}

impl Copy {
    /// Percent per second over the stage's window, once it advanced enough.
    fn rate(&self) -> Option<f64> {
        let ((t0, p0), (t1, p1)) = (self.from?, self.last?);
        let secs = t1.duration_since(t0).as_secs_f64();
        (p1 - p0 >= MIN_ADVANCE && secs > 0.0).then(|| (p1 - p0) / secs)
    }
}

/// A domain's learning, stage by stage: `stage` copies at once.
pub(super) struct Learner {
    stage: usize,
    /// The most copies a stage may reach (the domain's ceiling).
    most: usize,
    /// Percent per second of one copy alone (stage 1's rate).
    alone: Option<f64>,
    copies: BTreeMap<u64, Copy>,
    /// When every copy of the stage was seen copying: the window's start.
    began: Option<Instant>,
    admitted: usize,
    /// Windows of this stage started again by a copy that left.
    restarts: usize,
    /// Bumped each time a window begins or a stage follows: the copies
    /// waiting on [`Read::OnChange`] are then read.
    generation: u64,
}

impl Learner {
    pub(super) fn new(most: usize) -> Learner {
        Learner {
            stage: 1,
            most: most.max(1),
            alone: None,
            copies: BTreeMap::new(),
            began: None,
            admitted: 0,
            restarts: 0,
            generation: 0,
        }
    }

    /// A clone got one of the stage's slots. `GaveUp` when learning has
    /// taken too many clones.
    pub(super) fn join(&mut self, id: u64) -> Option<Learnt> {
        self.admitted += 1;
        if self.admitted > PATIENCE {
            return Some(Learnt::GaveUp);
        }
        self.copies.insert(id, Copy::default());
        // A new copy in the stage: its window starts again once it copies.
        self.restart();
        None
    }

    /// A learning clone left its slot before its stage's verdict: its
    /// clone ended (`ended`), or failed and gave the slot up. One that
    /// ended without ever showing progress gives the learning up (a linked
    /// clone, a storage PVE prints no progress for, or a copy too short to
    /// read), as do copies that keep ending before their rates count.
    pub(super) fn left(&mut self, id: u64, ended: bool) -> Option<Learnt> {
        let copy = self.copies.remove(&id)?;
        if ended && copy.copying.is_none() {
            return Some(Learnt::GaveUp);
        }
        if copy.copying.is_some() {
            self.restarts += 1;
            if self.restarts > RESTARTS {
                return Some(Learnt::GaveUp);
            }
        }
        self.restart();
        None
    }

    fn restart(&mut self) {
        self.began = None;
        for c in self.copies.values_mut() {
            c.from = None;
        }
    }

    /// See [`Read::OnChange`].
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// A read of copy `id`'s log at `at`: `percent` as its last progress
    /// line said, `None` when it has none yet. A verdict when this read
    /// completes a stage; and when to read this copy next.
    pub(super) fn sample(
        &mut self,
        id: u64,
        at: Instant,
        percent: Option<f64>,
    ) -> (Option<Learnt>, Read) {
        let Some(copy) = self.copies.get_mut(&id) else {
            return (None, Read::Done);
        };
        let percent = percent.unwrap_or(0.0);
        copy.last = Some((at, percent));
        if percent > 0.0 && copy.copying.is_none() {
            copy.copying = Some((at, percent));
        }
        if self.began.is_none()
            && self.copies.len() == self.stage
            && self.copies.values().all(|c| c.copying.is_some())
        {
            self.began = Some(at);
            self.generation += 1;
        }
        if let Some(began) = self.began {
            for c in self.copies.values_mut() {
                if c.from.is_none() {
                    if let Some(last) = c.last.filter(|(t, _)| *t >= began) {
                        c.from = Some(last);
                    }
                }
            }
        }
        let next = self.next_read(id);
        (self.verdict(), next)
    }

    /// When to read copy `id` again: while it allocates, soon; once it
    /// copies, not before the stage's window begins; in the window, about
    /// when it will have advanced the points a rate needs, by its rate so
    /// far; once its rate counts, not before the next stage.
    fn next_read(&self, id: u64) -> Read {
        let Some(copy) = self.copies.get(&id) else {
            return Read::Done;
        };
        let (Some((t0, p0)), Some((t1, p1))) = (copy.copying, copy.last) else {
            return Read::After(READ_SOONEST);
        };
        if p1 >= 100.0 {
            return Read::Done;
        }
        let Some((_, from)) = copy.from else {
            return if self.began.is_none() {
                Read::OnChange
            } else {
                Read::After(READ_SOONEST)
            };
        };
        if copy.rate().is_some() {
            return Read::OnChange;
        }
        let secs = t1.duration_since(t0).as_secs_f64();
        if p1 <= p0 || secs <= 0.0 {
            return Read::After(READ_SOONEST);
        }
        // A little past the points, so one read usually does.
        let left = from + MIN_ADVANCE * 1.1 - p1;
        let wait = Duration::from_secs_f64((left / ((p1 - p0) / secs)).clamp(0.0, 3600.0));
        Read::After(wait.clamp(READ_SOONEST, READ_LATEST))
    }

    fn verdict(&mut self) -> Option<Learnt> {
        if self.began.is_none() || self.copies.len() < self.stage {
            return None;
        }
        let rates: Vec<f64> = self
            .copies
            .values()
            .map(Copy::rate)
            .collect::<Option<_>>()?;
        let rate = rates.iter().sum::<f64>() / rates.len() as f64;
        let alone = *self.alone.get_or_insert(rate);
        if self.stage < self.most && (self.stage == 1 || rate >= UNSLOWED * alone) {
            return Some(self.next_stage());
        }
        // The stage's copies slowed one another (or the ceiling is
        // reached): the disk's whole rate is what they made together.
        let whole = rate * self.stage as f64;
        let fill = ((whole / alone).round() as usize).clamp(1, self.most);
        Some(Learnt::Known {
            every: Duration::from_secs_f64(100.0 / whole),
            fill,
        })
    }

    fn next_stage(&mut self) -> Learnt {
        self.stage += 1;
        self.restarts = 0;
        self.generation += 1;
        self.restart();
        Learnt::Stage(self.stage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    /// Feeds the learner reads of every copy in `ids` each 250 ms from `t`
    /// for `reads` reads, each copy at `rate` percent per second from
    /// `at0` percent. The last verdict.
    fn feed(
        l: &mut Learner,
        t: &mut Instant,
        ids: &[(u64, f64)],
        rate: f64,
        reads: usize,
    ) -> Option<Learnt> {
        let mut verdict = None;
        let start = *t;
        for k in 0..reads {
            *t = start + MS(250) * k as u32;
            for &(id, at0) in ids {
                let pct = (at0 + rate * t.duration_since(start).as_secs_f64()).floor();
                let (v, _) = l.sample(id, *t, Some(pct.min(100.0)));
                verdict = verdict.or(v);
            }
        }
        verdict
    }

    /// Runs a learning whose stage k copies each advance `rates[k - 1]`
    /// percent per second (a copy joins each stage, 20 points behind the
    /// one before): every stage but the last must ask for one copy more;
    /// the last verdict.
    fn learn(rates: &[f64]) -> Learnt {
        let mut l = Learner::new(8);
        let mut t = Instant::now();
        let mut verdict = None;
        for (k, &rate) in rates.iter().enumerate() {
            assert_eq!(l.join(k as u64 + 1), None);
            let copies: Vec<(u64, f64)> = (0..=k)
                .map(|c| (c as u64 + 1, 1.0 + 20.0 * (k - c) as f64))
                .collect();
            verdict = feed(&mut l, &mut t, &copies, rate, 4);
            if k + 1 < rates.len() {
                assert_eq!(verdict, Some(Learnt::Stage(k + 2)), "stage {}", k + 1);
            }
        }
        verdict.unwrap_or(Learnt::GaveUp)
    }

    /// The pace and fill a learning ends with.
    fn known(v: Learnt) -> (f64, usize) {
        match v {
            Learnt::Known { every, fill } => (every.as_secs_f64(), fill),
            other => panic!("{other:?}"),
        }
    }

    /// A disk one copy fills: alone 50 %/s (a 2 s copy), two at once 25 %/s
    /// each. One copy at once fills it; a clone each 2 s.
    #[test]
    fn a_disk_one_copy_fills_is_learnt_in_two_stages() {
        let (every, fill) = known(learn(&[50.0, 25.0]));
        assert_eq!(fill, 1);
        assert!((every - 2.0).abs() < 0.25, "{every}");
    }

    /// A disk two copies fill (a stream reaches half of it): alone and two
    /// at once 25 %/s each, three at once 16.7 %/s.
    #[test]
    fn a_disk_two_copies_fill_is_learnt_in_three_stages() {
        let (every, fill) = known(learn(&[25.0, 25.0, 16.7]));
        assert_eq!(fill, 2);
        assert!((every - 2.0).abs() < 0.25, "{every}");
    }

    /// The window starts again when a copy of the stage ends before its
    /// rate counts, and a copy that never showed progress gives up.
    #[test]
    fn a_copy_that_leaves_restarts_the_window_and_one_without_progress_gives_up() {
        let mut l = Learner::new(8);
        let mut t = Instant::now();
        l.join(1);
        assert_eq!(
            feed(&mut l, &mut t, &[(1, 1.0)], 50.0, 3),
            Some(Learnt::Stage(2))
        );
        l.join(2);
        assert_eq!(feed(&mut l, &mut t, &[(1, 60.0), (2, 1.0)], 25.0, 2), None);
        assert_eq!(l.left(1, true), None, "it had copied: the stage goes on");
        assert_eq!(l.join(3), None);
        assert_eq!(
            feed(&mut l, &mut t, &[(2, 12.0)], 25.0, 2),
            None,
            "3 not copying yet"
        );
        let mut fresh = Learner::new(8);
        fresh.join(7);
        let (v, next) = fresh.sample(7, t, None);
        assert_eq!((v, next), (None, Read::After(READ_SOONEST)));
        assert_eq!(
            fresh.left(7, false),
            None,
            "failed while allocating: nothing to say"
        );
        let mut linked = Learner::new(8);
        linked.join(8);
        linked.sample(8, t, None);
        assert_eq!(
            linked.left(8, true),
            Some(Learnt::GaveUp),
            "ended without a progress line: nothing to learn from"
        );
    }

    /// With one clone at most per node there is no second stage: the lone
    /// copy's rate is the disk's, as far as the provider will use it.
    #[test]
    fn one_clone_at_most_is_learnt_alone() {
        let mut l = Learner::new(1);
        let mut t = Instant::now();
        assert_eq!(l.join(1), None);
        let v = feed(&mut l, &mut t, &[(1, 1.0)], 25.0, 4);
        let Some(Learnt::Known { every, fill }) = v else {
            panic!("{v:?}");
        };
        assert_eq!(fill, 1);
        assert!((every.as_secs_f64() - 4.0).abs() < 0.5, "{every:?}");
    }

    /// Reads follow the copy: soon while it allocates; in its window, about
    /// when it will have advanced the points (within 250 ms to 2 s); not
    /// while its rate cannot count (the others not copying yet, or its rate
    /// counted already); none once it is done.
    #[test]
    fn reads_come_when_a_read_can_count() {
        let t = Instant::now();
        let mut l = Learner::new(8);
        l.join(1);
        assert_eq!(
            l.sample(1, t, None).1,
            Read::After(READ_SOONEST),
            "allocating"
        );
        assert_eq!(
            l.sample(1, t + MS(250), Some(1.0)).1,
            Read::After(READ_SOONEST)
        );
        // 1 %/s: eleven points take 11 s; read no later than 2 s.
        assert_eq!(
            l.sample(1, t + MS(1250), Some(2.0)).1,
            Read::After(READ_LATEST)
        );
        // 20 %/s: the rest of eleven points (from 1 %) in 0.5 s.
        let mut f = Learner::new(8);
        f.join(1);
        f.sample(1, t, Some(1.0));
        assert_eq!(f.sample(1, t + MS(100), Some(3.0)).1, Read::After(MS(450)));
        // Its rate counts: the next stage; until a second copy copies,
        // nothing it shows counts.
        let (v, next) = f.sample(1, t + MS(600), Some(13.0));
        assert_eq!((v, next), (Some(Learnt::Stage(2)), Read::OnChange));
        let before = f.generation();
        f.join(2);
        assert_eq!(
            f.sample(2, t + MS(700), Some(1.0)).1,
            Read::After(READ_SOONEST)
        );
        assert!(
            f.generation() > before,
            "its window began: the first is read"
        );
        assert_eq!(f.sample(1, t + MS(700), Some(100.0)).1, Read::Done, "done");
    }

    #[test]
    fn learning_gives_up_after_its_patience_and_on_copies_too_short_to_read() {
        let mut l = Learner::new(8);
        for id in 0..PATIENCE as u64 {
            assert_eq!(l.join(id), None);
            assert_eq!(l.left(id, false), None);
        }
        assert_eq!(l.join(99), Some(Learnt::GaveUp));
        let mut short = Learner::new(8);
        let t = Instant::now();
        for id in 0..=RESTARTS as u64 {
            short.join(id);
            short.sample(id, t, Some(50.0));
            let v = short.left(id, true);
            assert_eq!(v.is_some(), id == RESTARTS as u64, "{id}: {v:?}");
        }
    }
}
