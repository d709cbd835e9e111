//! #44 item 2, the storage guard, through the real backend against pve-sim:
//! a storage that holds three full clones admits three Creates and refuses
//! the fourth at admission, before anything is cloned (the engine answers
//! RESOURCE_EXHAUSTED), whether the four come at once or one after another;
//! the clone step rejoins its admission's claim without reading the storage
//! again; a per-storage overcommit factor lets a thin pool take more than
//! its free space; linked clones are not counted.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;
use providerkit::{AdmitCtx, Backend, CreateCtx, DeleteCtx, ErrorKind};
use proxmox_backend::capacity::Refusal;
use proxmox_backend::proxmox::{CloneMode, PveOptions, PveSubstrate};
use proxmox_backend::substrate::Substrate;
use pve_sim::{endpoints, PveSim, SimConfig, StorageKind, StorageSpec};

use crate::common::{clones, fast_sim, opts, req, sim_with, small_backend};

const GIB: u64 = 1 << 30;

/// pve-sim whose `local-lvm` (the template's 32 GiB disk included) has
/// `free_gib` free.
async fn sim_with_free(free_gib: u64) -> PveSim {
    let mut cfg: SimConfig = fast_sim(Duration::from_millis(100), Duration::from_millis(50));
    cfg.storages.retain(|s| s.name != "local-lvm");
    cfg.storages.push(StorageSpec::new(
        "local-lvm",
        StorageKind::LvmThin,
        false,
        32 + free_gib,
    ));
    cfg.max_parallel_local_clones = None;
    sim_with(cfg).await
}

fn options() -> PveOptions {
    PveOptions {
        retry_window: Duration::from_secs(5),
        max_parallel_clones: 8,
        ..opts(Duration::from_secs(20))
    }
}

fn admit_ctx(machine_id: &str) -> AdmitCtx {
    AdmitCtx {
        machine_id: machine_id.into(),
        instance_type: "pve.small".into(),
        zone: "pve1".into(),
    }
}

fn create_ctx(machine_id: &str) -> CreateCtx {
    CreateCtx {
        machine_id: machine_id.into(),
        operation_id: format!("op-{machine_id}"),
        instance_type: "pve.small".into(),
        zone: "pve1".into(),
        resumed: false,
    }
}

/// Four Creates at once on a storage with room for three 32 GiB clones
/// (104 GiB free): three are admitted and the fourth refused while nothing
/// has been cloned yet; the three land, and the room the guard reports
/// follows (in flight while admitted, none once their clones are done).
#[tokio::test]
async fn a_storage_that_holds_three_clones_refuses_the_fourth_of_a_burst() {
    let sim = sim_with_free(104).await;
    let sub = PveSubstrate::new(crate::common::client(&sim), options());
    sub.preflight(&["pve1".into()], &[9000])
        .await
        .expect("preflight");
    let (backend, ids) = small_backend("p", "pve1", 4, &["pve1"], sub);
    let ctxs: Vec<AdmitCtx> = ids.iter().map(|id| admit_ctx(id)).collect();
    let admissions = join_all(ctxs.iter().map(|c| backend.admit_create(c))).await;
    assert_eq!(sim.call_count(endpoints::CLONE), 0, "nothing cloned yet");
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for (id, a) in ids.iter().zip(admissions) {
        match a {
            Ok(held) => admitted.push((id.clone(), held)),
            Err(e) => refused.push(e),
        }
    }
    assert_eq!((admitted.len(), refused.len()), (3, 1), "{refused:?}");
    let e = &refused[0];
    assert_eq!(e.kind(), ErrorKind::Transient, "room may come back: {e}");
    let msg = e.to_string();
    assert!(
        msg.contains("storage local-lvm of node pve1 has no room for the full clone of template 9000")
            && msg.contains("it needs 32.0 GiB and 8.0 GiB is left (104.0 GiB free, 96.0 GiB held by Creates in flight)"),
        "{msg}"
    );
    let space = backend.storage_spaces();
    assert_eq!(space.len(), 1, "{space:?}");
    assert_eq!(
        (space[0].avail_bytes, space[0].in_flight_bytes),
        (104 * GIB, 96 * GIB)
    );

    let reads = sim.call_count(endpoints::STORAGE_STATUS);
    let made = join_all(
        admitted
            .iter()
            .map(|(id, _)| backend.create(create_ctx(id))),
    )
    .await;
    let hosts: Vec<_> = made
        .into_iter()
        .map(|r| r.expect("an admitted Create lands"))
        .collect();
    assert_eq!(
        sim.call_count(endpoints::STORAGE_STATUS),
        reads,
        "each clone step rejoined its admission's claim without reading again"
    );
    assert_eq!(clones(&sim).len(), 3);
    let space = backend.storage_spaces();
    assert_eq!(
        (space[0].avail_bytes, space[0].in_flight_bytes),
        (8 * GIB, 0),
        "claims end with the clones, whose disks PVE holds now"
    );
    drop(admitted);
    for (id, host) in ids.iter().zip(hosts) {
        backend
            .delete(DeleteCtx {
                machine_id: id.clone(),
                operation_id: format!("del-{id}"),
                host_ref: host.host_ref,
            })
            .await
            .expect("delete");
    }
    assert!(clones(&sim).is_empty(), "nothing leaked");
    sim.shutdown().await;
}

/// One Create after another: each lands, PVE's free space shrinks, and the
/// fourth is refused at admission naming what is free (8 GiB); once a VM
/// is deleted the same Create is admitted and lands.
#[tokio::test]
async fn one_after_another_the_fourth_is_refused_until_space_is_freed() {
    let sim = sim_with_free(104).await;
    let sub = PveSubstrate::new(crate::common::client(&sim), options());
    sub.preflight(&["pve1".into()], &[9000])
        .await
        .expect("preflight");
    let (backend, ids) = small_backend("p", "pve1", 4, &["pve1"], sub);
    let mut hosts = BTreeMap::new();
    for id in &ids[..3] {
        let held = backend.admit_create(&admit_ctx(id)).await.expect("fits");
        let host = backend.create(create_ctx(id)).await.expect("lands");
        drop(held);
        hosts.insert(id.clone(), host.host_ref);
    }
    let clones_before = sim.call_count(endpoints::CLONE);
    let e = backend
        .admit_create(&admit_ctx(&ids[3]))
        .await
        .expect_err("no room for a fourth");
    assert!(
        e.to_string()
            .contains("it needs 32.0 GiB and 8.0 GiB is free"),
        "{e}"
    );
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        clones_before,
        "nothing cloned"
    );

    let (first, host) = hosts.pop_first().expect("a VM");
    backend
        .delete(DeleteCtx {
            machine_id: first.clone(),
            operation_id: "del".into(),
            host_ref: host,
        })
        .await
        .expect("delete");
    let held = backend
        .admit_create(&admit_ctx(&ids[3]))
        .await
        .expect("room again");
    let host = backend.create(create_ctx(&ids[3])).await.expect("lands");
    drop(held);
    hosts.insert(ids[3].clone(), host.host_ref);
    for (id, host) in hosts {
        backend
            .delete(DeleteCtx {
                machine_id: id.clone(),
                operation_id: format!("del-{id}"),
                host_ref: host,
            })
            .await
            .expect("delete");
    }
    assert!(clones(&sim).is_empty(), "nothing leaked");
    sim.shutdown().await;
}

/// `--storage-overcommit local-lvm=2`: a thin pool with 40 GiB free takes
/// two 32 GiB clones (64 of 80 GiB) and refuses a third, naming the factor.
#[tokio::test]
async fn an_overcommit_factor_lets_a_thin_pool_take_more_than_its_free_space() {
    let sim = sim_with_free(40).await;
    let mut o = options();
    o.storage_overcommit.insert("local-lvm".into(), 2.0);
    let sub = PveSubstrate::new(crate::common::client(&sim), o);
    let mut held = Vec::new();
    for n in 0..2 {
        let r = req(&format!("p/OnDemand/pve.small/pve1/{n:03}"), "pve1");
        held.push(sub.admit(&r).await.expect("fits under the factor"));
    }
    let r = req("p/OnDemand/pve.small/pve1/002", "pve1");
    let Err(Refusal::Storage(no)) = sub.admit(&r).await else {
        panic!("the third is refused for storage");
    };
    assert_eq!(
        (no.space.allowed_bytes(), no.space.in_flight_bytes),
        (80 * GIB, 64 * GIB)
    );
    assert!(
        no.to_string()
            .contains("16.0 GiB is left (40.0 GiB free x --storage-overcommit local-lvm=2, 64.0 GiB held by Creates in flight)"),
        "{no}"
    );
    // An admission given back frees its room at once.
    held.pop();
    assert!(sub.admit(&r).await.is_ok(), "room again");
    sim.shutdown().await;
}

/// Linked clones start with an empty delta: the storage guard does not
/// count them, and reads no storage for them.
#[tokio::test]
async fn linked_clones_are_not_counted() {
    let sim = sim_with_free(8).await;
    let sub = PveSubstrate::new(
        crate::common::client(&sim),
        PveOptions {
            clone_mode: CloneMode::Linked,
            ..options()
        },
    );
    for n in 0..4 {
        let r = req(&format!("p/OnDemand/pve.small/pve1/{n:03}"), "pve1");
        sub.admit(&r).await.expect("linked clones are not counted");
    }
    assert_eq!(sim.call_count(endpoints::STORAGE_STATUS), 0);
    assert!(sub.storage_spaces().is_empty());
    sim.shutdown().await;
}
