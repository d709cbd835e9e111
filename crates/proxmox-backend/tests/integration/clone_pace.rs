//! A node's own storage learns how fast one copy runs and how many copies
//! fill it from its first clones' progress (the lines PVE prints into a
//! full clone's task log), then starts one clone each time the disk has
//! copied one's worth, with one more slot than the fill: the clones end
//! one after another, not in rounds of copies that shared the disk.

use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::PveSubstrate;
use proxmox_backend::substrate::Substrate;
use pve_sim::SimConfig;
use tokio::time::Instant;

use crate::common::{client, fast_sim, opts, req, sim_with};

/// The template's 32 GiB disk at 32 GiB/s: a second a copy at the disk's
/// whole rate.
const DISK_RATE: u64 = 32 << 30;

/// Six Creates at once on `pve1`, a copy's stream reaching `stream` (none:
/// the disk's whole rate). The domain's slots after them, and when each
/// Create's clone was done (seconds from the first POST), in order. The
/// pace learnt must be the disk's second per clone.
async fn burst(stream: Option<u64>) -> (usize, Vec<f64>) {
    let sim = sim_with(SimConfig {
        storage_bandwidth: vec![("local-lvm".into(), DISK_RATE)],
        storage_stream_bandwidth: stream
            .map(|s| vec![("local-lvm".into(), s)])
            .unwrap_or_default(),
        volume_alloc_time: Duration::from_millis(100),
        max_parallel_local_clones: None,
        ..fast_sim(Duration::from_millis(100), Duration::from_millis(20))
    })
    .await;
    let sub: Arc<PveSubstrate> = Arc::new(PveSubstrate::new(
        client(&sim),
        opts(Duration::from_secs(30)),
    ));
    let t0 = Instant::now();
    let creates: Vec<_> = (0..6)
        .map(|i| {
            let sub = Arc::clone(&sub);
            tokio::spawn(async move {
                let id = format!("p/OnDemand/pve.small/pve1/{i:03}");
                sub.clone_vm(&req(&id, "pve1")).await.expect("create");
                t0.elapsed().as_secs_f64()
            })
        })
        .collect();
    let mut done = Vec::new();
    for c in creates {
        done.push(c.await.expect("task"));
    }
    done.sort_by(f64::total_cmp);
    let view = sub
        .clone_slots()
        .into_iter()
        .find(|v| v.node == "pve1" && v.storage == "local-lvm")
        .expect("the node's local-lvm slots");
    let pace = view.pace.map(|p| p.as_secs_f64());
    assert!(
        pace.is_some_and(|p| (0.85..1.2).contains(&p)),
        "a clone each second: {pace:?} ({done:?})"
    );
    let slots = view.limit;
    sim.shutdown().await;
    (slots, done)
}

/// Gaps between consecutive Creates done after the learning (the last
/// three): paced, about a copy's second each; in rounds, some near 0.
fn gaps(done: &[f64]) -> Vec<f64> {
    done[done.len() - 4..]
        .windows(2)
        .map(|w| w[1] - w[0])
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_one_copy_fills_gets_one_copy_at_a_time_and_one_allocating() {
    let (slots, done) = burst(None).await;
    assert_eq!(slots, 2, "fill 1, and one allocating beside it: {done:?}");
    let gaps = gaps(&done);
    assert!(
        gaps.iter().all(|g| *g > 0.5),
        "one after another, a copy's time apart: {gaps:?} ({done:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_two_copies_fill_gets_two_copies_at_a_time_staggered() {
    let (slots, done) = burst(Some(DISK_RATE / 2)).await;
    assert_eq!(slots, 3, "fill 2, and one allocating beside them: {done:?}");
    let gaps = gaps(&done);
    assert!(
        gaps.iter().all(|g| *g > 0.5),
        "staggered, half a copy's time apart at the stream's rate: {gaps:?} ({done:?})"
    );
}
