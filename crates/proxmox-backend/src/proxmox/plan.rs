//! Where a Create clones from, and what it claims first: the template or
//! its copy on the Create's node (`replicas`), what a full clone's disks
//! need on each storage (`placement`), the storage guard's claim at
//! admission and at the clone step (`storage_guard`), and the clone itself
//! (`clone`). Owns nothing but the replicas part; the composition asks it.

use std::collections::BTreeMap;
use std::sync::Arc;

use pve::{ClusterVm, PveError};
use tokio::time::Instant;

use super::api::QUICK_READ;
use super::clone::Cloner;
use super::inventory::Inventory;
use super::options::{PveOptions, TypeDisk};
use super::placement::{Layout, Placement};
use super::replica::Replicas;
use super::storage_guard::{SpaceError, SpaceRequest, StorageClaim, StorageGuard};
use crate::capacity::{NoSpace, StorageSpace};
use crate::substrate::{CloneRequest, SubstrateError, VmRef};

/// Where one Create clones from. Holds its claim on the storages its disks
/// land on until dropped (when the clone task has ended).
struct ClonePlan {
    source_vmid: u32,
    source_node: String,
    space: Option<StorageClaim>,
}

/// The parts a Create's plan asks.
pub(super) struct Planner {
    pub(super) opts: Arc<PveOptions>,
    pub(super) inventory: Arc<Inventory>,
    pub(super) placement: Arc<Placement>,
    pub(super) storage: Arc<StorageGuard>,
    pub(super) replicas: Replicas,
    pub(super) cloner: Arc<Cloner>,
}

impl Planner {
    /// Each storage as the storage guard last checked it.
    pub(super) fn spaces(&self) -> Vec<StorageSpace> {
        self.storage.spaces()
    }

    /// Reads the storages full clones on `nodes` land on (those the
    /// configuration names) now; returns every storage as then known.
    pub(super) async fn observe(&self, nodes: &[String]) -> Vec<StorageSpace> {
        let deadline = Instant::now() + QUICK_READ;
        for node in nodes {
            for storage in self.placement.full_clone_storages(node) {
                self.storage.observe(node, &storage, deadline).await;
            }
        }
        self.storage.spaces()
    }

    /// Whether a Create clones from a copy of its template on its own node
    /// rather than from the template. A clone to another node needs the
    /// template's disks on shared storage, and a `storage` given with
    /// `target` must be shared too (qemu-server clone_vm: "can't clone to
    /// non-shared storage"): a node's own storage is reached through a copy
    /// of the template on the node, cloned locally.
    async fn uses_replica(
        &self,
        req: &CloneRequest,
        template_node: &str,
        layout: &Layout,
        storage: Option<&str>,
        deadline: Instant,
    ) -> Result<bool, SubstrateError> {
        if !self.opts.template_replicas || req.node == template_node {
            return Ok(false);
        }
        let at_template = self
            .placement
            .node_storages(template_node, deadline)
            .await?;
        Ok(!layout.shared(&at_template)
            || self
                .placement
                .needs_local_source(&req.node, template_node, storage, deadline)
                .await?)
    }

    /// What a full clone of `layout` for `req` takes, bytes per storage:
    /// its disks where they land (the type's storage, else a replica's
    /// node storage, else the same ids) with the boot disk as the type
    /// sizes it.
    fn full_clone_needs(
        &self,
        req: &CloneRequest,
        layout: &Layout,
        storage: Option<&str>,
        replica: bool,
    ) -> BTreeMap<String, u64> {
        let node_storage = self.opts.node_storage.get(&req.node);
        let grown = self
            .opts
            .type_disk
            .get(&req.instance_type)
            .map(TypeDisk::bytes);
        layout.needs(
            |s| {
                storage
                    .or_else(|| {
                        replica
                            .then_some(node_storage)
                            .flatten()
                            .map(String::as_str)
                    })
                    .unwrap_or(s)
                    .to_string()
            },
            grown,
        )
    }

    /// The storage guard's claim for a Create being admitted: `Ok(None)`
    /// for a linked clone, or when the guard cannot tell now (template or
    /// storage unreadable within [`QUICK_READ`]): the clone
    /// step checks again.
    pub(super) async fn admit_space(
        &self,
        req: &CloneRequest,
    ) -> Result<Option<StorageClaim>, NoSpace> {
        let (full, storage) = self.placement.clone_options(req);
        if !full {
            return Ok(None);
        }
        let deadline = Instant::now() + QUICK_READ;
        let check = async {
            // Known since the start-up check's listing; else listed once.
            let template_node = match self.inventory.template_node(req.template_vmid, &[]) {
                Ok(node) => node,
                Err(_) => {
                    let (list, _) = self.inventory.scan(|_| false).await?;
                    self.inventory.template_node(req.template_vmid, &list)?
                }
            };
            if self.inventory.offline_nodes().contains(&template_node) {
                // Its Create fails naming the node; nothing to check.
                return Ok(None);
            }
            let layout = self
                .placement
                .layout(req.template_vmid, &template_node, None, deadline)
                .await?;
            let replica = self
                .uses_replica(req, &template_node, &layout, storage.as_deref(), deadline)
                .await?;
            let needs = self.full_clone_needs(req, &layout, storage.as_deref(), replica);
            let node = if replica { &req.node } else { &template_node };
            self.storage
                .claim(&space_request(req, node, &needs), deadline)
                .await
        };
        match tokio::time::timeout(QUICK_READ, check).await {
            Ok(Ok(held)) => Ok(held),
            Ok(Err(SpaceError::NoSpace(no_space))) => Err(no_space),
            Ok(Err(SpaceError::Unread(e))) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, error = %e, "the storage guard cannot check the Create now; admitting it, its clone checks again");
                Ok(None)
            }
            Err(_) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, "the storage guard cannot check the Create now; admitting it, its clone checks again");
                Ok(None)
            }
        }
    }

    /// Decides the clone's source (the template, or its replica on the
    /// target node) and, for a full clone, checks and claims the room its
    /// disks need (its admission's claim, when it has one).
    async fn plan_clone(
        &self,
        req: &CloneRequest,
        template_node: &str,
        list: &[ClusterVm],
        deadline: Instant,
    ) -> Result<ClonePlan, SubstrateError> {
        let layout = self
            .placement
            .layout(req.template_vmid, template_node, None, deadline)
            .await?;
        let (full, storage) = self.placement.clone_options(req);
        let replica = self
            .uses_replica(req, template_node, &layout, storage.as_deref(), deadline)
            .await?;
        let (source_vmid, source_node, layout) = if replica {
            let (vmid, layout) = self
                .replicas
                .for_create(req, template_node, list, deadline)
                .await?;
            (vmid, req.node.clone(), layout)
        } else {
            (req.template_vmid, template_node.to_string(), layout)
        };
        let mut space = None;
        if full {
            // A replica's disks are on the node's storage (or the template's
            // ids). The clone worker allocates on the node it runs on: the
            // source's (a clone to another node is on shared storage, the
            // same pool from every node).
            let needs = self.full_clone_needs(req, &layout, storage.as_deref(), replica);
            space = self
                .storage
                .claim(&space_request(req, &source_node, &needs), deadline)
                .await
                .map_err(SpaceError::into_substrate)?;
        }
        Ok(ClonePlan {
            source_vmid,
            source_node,
            space,
        })
    }

    /// Plans the clone and clones: from the template, or from its replica on
    /// the target node. A replica that vanished since it was last seen
    /// (destroyed out of band) is forgotten and staged again, once.
    pub(super) async fn clone_planned(
        &self,
        req: &CloneRequest,
        template_node: &str,
        list: &[ClusterVm],
        name: &str,
        deadline: Instant,
    ) -> Result<VmRef, SubstrateError> {
        let mut again = true;
        loop {
            let plan = self.plan_clone(req, template_node, list, deadline).await?;
            let source = CloneRequest {
                template_vmid: plan.source_vmid,
                ..req.clone()
            };
            let out = self
                .cloner
                .clone_new(&source, &plan.source_node, name, deadline)
                .await;
            if out.is_ok() {
                if let Some(space) = plan.space {
                    space.landed();
                }
            }
            match out {
                Err(e)
                    if again
                        && plan.source_vmid != req.template_vmid
                        && PveError::find_in(&e)
                            .is_some_and(|p| p.is_vm_config_missing(plan.source_vmid)) =>
                {
                    tracing::warn!(replica = plan.source_vmid, node = %req.node, "the template replica is gone; staging it again");
                    self.replicas.forget(plan.source_vmid);
                    again = false;
                }
                out => return out,
            }
        }
    }
}

/// The storage guard's request for `req`'s full clone, run on `node`.
fn space_request<'a>(
    req: &'a CloneRequest,
    node: &'a str,
    needs: &'a BTreeMap<String, u64>,
) -> SpaceRequest<'a> {
    SpaceRequest {
        holder: &req.machine_id,
        node,
        needs,
        what: format!(
            "the full clone of template {} for machine {} (instance type {})",
            req.template_vmid, req.machine_id, req.instance_type
        ),
    }
}
