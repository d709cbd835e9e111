//! What waiting on tasks costs pveproxy (#41 item 1): a burst of Creates
//! on one node is watched through the node's active task list, one request
//! per tick for all of them, and each task's own status is read once, when
//! it ends; not one status poll per task per tick.

use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::Substrate;
use pve_sim::{endpoints, SimConfig};

use crate::common::{assert_no_violations, client, fast_sim, opts, req, sim_with};

/// `GET /nodes/{node}/tasks` (the node's task list).
const NODE_TASKS: &str = "GET /nodes/{node}/tasks";

#[tokio::test]
async fn a_burst_of_tasks_on_a_node_costs_one_list_per_tick() {
    const BURST: usize = 8;
    let clone = Duration::from_millis(1000);
    let sim = Arc::new(
        sim_with(SimConfig {
            max_parallel_local_clones: None,
            ..fast_sim(clone, Duration::from_millis(50))
        })
        .await,
    );
    let poll = Duration::from_millis(50);
    let sub = Arc::new(PveSubstrate::new(
        client(&sim),
        PveOptions {
            max_parallel_clones: BURST,
            poll_interval: poll,
            ..opts(Duration::from_secs(20))
        },
    ));
    sim.reset_counts();
    let creates: Vec<_> = (0..BURST)
        .map(|i| {
            let sub = Arc::clone(&sub);
            tokio::spawn(async move {
                let id = format!("p/OnDemand/pve.small/pve1/{i:03}");
                sub.clone_vm(&req(&id, "pve1")).await
            })
        })
        .collect();
    for c in creates {
        c.await.expect("task").expect("create");
    }
    // Each Create waits on two tasks, a clone (1 s) and a start: polled one
    // by one every 50 ms that would be about 20 status reads per clone.
    let tasks = 2 * BURST as u64;
    let status_reads = sim.call_count(endpoints::TASK_STATUS);
    let lists = sim.call_count(NODE_TASKS);
    println!(
        "{BURST} Creates on one node: {status_reads} task status reads, {lists} task list reads"
    );
    assert!(
        status_reads <= tasks,
        "{status_reads} task status reads for {tasks} tasks: one each at most"
    );
    // The list is read once per tick while any task runs: about the
    // clone's duration over the poll interval (plus the starts), however
    // many run at once.
    let ticks = (clone.as_millis() / poll.as_millis()) as u64;
    assert!(
        lists <= 3 * ticks,
        "{lists} task list reads for {BURST} clones of {clone:?} at a {poll:?} poll"
    );
    assert!(
        status_reads + lists < tasks * ticks / 4,
        "{status_reads} + {lists} requests: not one per task per tick"
    );
    assert_no_violations(&sim);
}
