//! When to look first at something that takes about as long each time on
//! a node (a guest agent's boot after a start, a VM's stop): a tracked
//! high quantile of how long it took there lately, so one look usually
//! finds it done.
//!
//! A first look that finds it done pulls the estimate down a little
//! ([`HIT`]); one that does not pushes it up a lot ([`MISS`]), so about one
//! in ten needs a second look, and the estimate follows the thing getting
//! slower or faster. A node with nothing learnt yet takes the cluster's
//! (its nodes' mean): a template's guest boots, and a VM stops, about
//! alike wherever it runs.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// A first look that found it done: the estimate shrinks by this. With
/// [`MISS`], the estimate settles where one first look in ten misses (a
/// 90th percentile: `0.1 * MISS == 0.9 * HIT`). Smaller steps sit closer
/// to the quantile but come down slower after an outlier: at 3 % an
/// estimate ten times too long is back in about 75 looks (as the smoothed
/// boot time this replaces, which lost 5 % a boot), and a steady length
/// is overshot by about an eighth of it on average.
const HIT: f64 = 0.03;

/// A first look that found it not done yet: the estimate grows by this at
/// least (more, towards what it took, when that is far).
const MISS: f64 = 0.27;

/// Per node, when to look first.
#[derive(Default)]
pub(super) struct FirstLook {
    per_node: Mutex<HashMap<String, Duration>>,
    /// Told when a node learns its first estimate.
    learnt: Notify,
}

impl FirstLook {
    /// When to look first on `node`: the node's estimate, else the
    /// cluster's, else `None` (nothing learnt yet).
    pub(super) fn at(&self, node: &str) -> Option<Duration> {
        let learnt = self.per_node.lock();
        if let Some(own) = learnt.get(node) {
            return Some(*own);
        }
        let n = u32::try_from(learnt.len()).ok().filter(|n| *n > 0)?;
        Some(learnt.values().sum::<Duration>() / n)
    }

    /// Resolves when some node learns its first estimate.
    pub(super) async fn learnt(&self) {
        self.learnt.notified().await;
    }

    /// Learns from one on `node` seen done `took` after it began: looked
    /// at first at `planned` (an estimate) and done then (`first_hit`) or
    /// not, or looked at until done with nothing planned.
    ///
    /// Ones begun together were looked at at the same estimate, and their
    /// outcomes are one observation, not many: a hit moves the estimate
    /// only if nobody moved it since it was planned, and a miss never
    /// lowers it, so a burst that was all done at once lowers it once, not
    /// once each (and then misses all at once too).
    pub(super) fn learn(
        &self,
        node: &str,
        planned: Option<Duration>,
        first_hit: bool,
        took: Duration,
    ) {
        let mut learnt = self.per_node.lock();
        let current = learnt.get(node).copied();
        let next = match planned {
            // Done at the first look, maybe much earlier: look a little
            // sooner next time.
            Some(at) if first_hit => match current {
                Some(now) if now != at => return,
                _ => at.mul_f64(1.0 - HIT),
            },
            // Not done at the first look: later, and at least halfway to
            // what this one took (twice as slow as before is caught up
            // with in a few, not a dozen).
            Some(at) => {
                let raised = at.mul_f64(1.0 + MISS).max((at + took) / 2);
                current.map_or(raised, |now| now.max(raised))
            }
            // The first learnt: it was done by `took`.
            None => current.unwrap_or(took),
        };
        learnt.insert(node.to_string(), next);
        drop(learnt);
        if current.is_none() {
            self.learnt.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_node_with_nothing_learnt_takes_the_clusters_mean() {
        let looks = FirstLook::default();
        assert_eq!(looks.at("pve1"), None);
        looks.learn("pve1", None, false, 3 * S);
        looks.learn("pve2", None, false, 5 * S);
        assert_eq!(looks.at("pve3"), Some(4 * S));
        assert_eq!(looks.at("pve1"), Some(3 * S));
    }

    #[test]
    fn hits_look_sooner_and_a_miss_catches_up_with_a_slower_one() {
        let looks = FirstLook::default();
        looks.learn("pve1", Some(10 * S), true, 10 * S);
        assert_eq!(looks.at("pve1"), Some(Duration::from_millis(9700)));
        // Missed at 10 s, answered at 11: up by 27 %.
        looks.learn("pve1", Some(10 * S), false, 11 * S);
        assert_eq!(looks.at("pve1"), Some(Duration::from_millis(12_700)));
        // Missed at 10 s, answered at 40: halfway.
        looks.learn("pve1", Some(10 * S), false, 40 * S);
        assert_eq!(looks.at("pve1"), Some(25 * S));
    }

    #[test]
    fn a_burst_looked_at_one_estimate_moves_it_once() {
        let looks = FirstLook::default();
        looks.learn("pve1", None, false, 10 * S);
        for _ in 0..6 {
            looks.learn("pve1", Some(10 * S), true, 10 * S);
        }
        assert_eq!(looks.at("pve1"), Some(Duration::from_millis(9700)));
        // A miss of the same burst, after its hits, raises it all the same.
        looks.learn("pve1", Some(10 * S), false, 11 * S);
        looks.learn("pve1", Some(10 * S), true, 10 * S);
        assert_eq!(looks.at("pve1"), Some(Duration::from_millis(12_700)));
    }

    #[test]
    fn a_steady_duration_costs_about_one_look_and_little_time() {
        // A boot of 3 s, first pinged at the estimate and then an eighth
        // of it apart: about one boot in ten pings twice, and the answer
        // comes within a sixth of the boot on average.
        let looks = FirstLook::default();
        looks.learn("pve1", None, false, 4 * S);
        let boot = 3 * S;
        let (mut pings, mut late) = (0u32, Duration::ZERO);
        for _ in 0..1000 {
            let at = looks.at("pve1").expect("learnt");
            let mut t = at;
            let mut n = 1;
            while t < boot {
                t += at / 8;
                n += 1;
            }
            pings += n;
            late += t - boot;
            looks.learn("pve1", Some(at), n == 1, t);
        }
        assert!(pings <= 1150, "{pings} pings for 1000 boots");
        assert!(late / 1000 < boot / 6, "{:?} late on average", late / 1000);
    }

    #[test]
    fn an_estimate_ten_times_too_long_comes_back_within_80_looks() {
        let looks = FirstLook::default();
        looks.learn("pve1", None, false, 30 * S);
        let boot = 3 * S;
        let back = (1..=80).find(|_| {
            let at = looks.at("pve1").expect("learnt");
            looks.learn("pve1", Some(at), at >= boot, at.max(boot));
            at < boot
        });
        assert!(back.is_some(), "still at {:?}", looks.at("pve1"));
    }
}
