//! Percentiles over recorded samples (exact: every sample is kept and sorted).

use std::time::Duration;

#[derive(Default)]
pub struct Samples {
    nanos: Vec<u64>,
}

impl Samples {
    pub fn with_capacity(n: usize) -> Samples {
        Samples {
            nanos: Vec::with_capacity(n),
        }
    }

    pub fn push(&mut self, d: Duration) {
        self.nanos
            .push(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub fn extend(&mut self, other: Samples) {
        self.nanos.extend(other.nanos);
    }

    pub fn len(&self) -> usize {
        self.nanos.len()
    }

    /// Nearest-rank percentile, `q` in [0, 100]. Zero when empty.
    pub fn percentile(&mut self, q: f64) -> Duration {
        if self.nanos.is_empty() {
            return Duration::ZERO;
        }
        self.nanos.sort_unstable();
        let rank = ((q / 100.0) * self.nanos.len() as f64).ceil() as usize;
        let idx = rank.clamp(1, self.nanos.len()) - 1;
        Duration::from_nanos(self.nanos[idx])
    }
}

pub fn us(d: Duration) -> u128 {
    d.as_micros()
}

pub fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut s = Samples::default();
        for i in 1..=100 {
            s.push(Duration::from_micros(i));
        }
        assert_eq!(s.percentile(50.0), Duration::from_micros(50));
        assert_eq!(s.percentile(99.0), Duration::from_micros(99));
        assert_eq!(s.percentile(100.0), Duration::from_micros(100));
        assert_eq!(s.percentile(0.0), Duration::from_micros(1));
    }

    #[test]
    fn empty_is_zero() {
        assert_eq!(Samples::default().percentile(99.0), Duration::ZERO);
    }
}
