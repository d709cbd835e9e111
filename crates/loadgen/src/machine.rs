//! How busy and how fast the machine itself was during a run. The figures
//! this tool prints are only comparable between runs on a machine in the
//! same state: on shared vCPUs a neighbour can halve the speed of every
//! process (the hypervisor's steal time, or a slower core under contention),
//! and a build running beside the benchmark takes CPU from it. A reader of
//! two runs needs both readings to tell a change of code from a change of
//! machine.

use std::time::{Duration, Instant};

/// Ticks of the machine-wide `cpu` line of `/proc/stat`, summed over all
/// CPUs.
#[derive(Clone, Copy)]
pub(crate) struct CpuTicks {
    idle: u64,
    steal: u64,
    total: u64,
}

impl CpuTicks {
    /// The current counters; `None` where `/proc/stat` is missing or not in
    /// the documented layout (then the run prints `skipped`).
    pub(crate) fn now() -> Option<CpuTicks> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        parse_cpu_line(stat.lines().next()?)
    }
}

/// ` machine_idle_pct=… steal_pct=…` of the machine between `before` and
/// now: idle includes I/O wait (a CPU waiting for a disk is free to run
/// another process).
pub(crate) fn span_fields(before: Option<CpuTicks>) -> String {
    match (before, CpuTicks::now()) {
        (Some(before), Some(after)) if after.total > before.total => {
            let total = (after.total - before.total) as f64;
            format!(
                " machine_idle_pct={:.0} steal_pct={:.1}",
                after.idle.saturating_sub(before.idle) as f64 * 100.0 / total,
                after.steal.saturating_sub(before.steal) as f64 * 100.0 / total
            )
        }
        _ => " machine_idle_pct=skipped steal_pct=skipped".to_string(),
    }
}

/// `cpu  user nice system idle iowait irq softirq steal guest guest_nice`
/// (proc(5)); guest time is already counted in user and nice.
fn parse_cpu_line(line: &str) -> Option<CpuTicks> {
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let n: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let [user, nice, system, idle, iowait, irq, softirq, steal] = n.try_into().ok()?;
    Some(CpuTicks {
        idle: idle + iowait,
        steal,
        total: user + nice + system + idle + iowait + irq + softirq + steal,
    })
}

/// The best of three timings of a fixed single-threaded job (a xorshift
/// chain the optimiser cannot shorten). On an idle machine it varies by a
/// few percent; a run whose reference is far above another's ran on a
/// slower machine, whatever the code did.
pub(crate) fn cpu_reference() -> Duration {
    const STEPS: u64 = 50_000_000;
    (0..3)
        .map(|_| {
            let started = Instant::now();
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            for _ in 0..STEPS {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x = std::hint::black_box(x);
            }
            std::hint::black_box(x);
            started.elapsed()
        })
        .min()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_line_counts_iowait_as_idle_and_every_column_in_the_total() {
        let t = parse_cpu_line("cpu  100 5 50 1000 20 3 2 40 0 0").expect("parsed");
        assert_eq!(t.idle, 1020);
        assert_eq!(t.steal, 40);
        assert_eq!(t.total, 1220);
    }

    #[test]
    fn a_per_cpu_or_short_line_is_not_taken_for_the_total() {
        assert!(parse_cpu_line("cpu0 100 5 50 1000 20 3 2 40 0 0").is_none());
        assert!(parse_cpu_line("cpu  100 5 50").is_none());
        assert!(parse_cpu_line("cpu  100 x 50 1000 20 3 2 40").is_none());
    }

    #[test]
    fn the_reference_job_takes_measurable_time() {
        assert!(cpu_reference() > Duration::from_millis(1));
    }
}
