//! The start-up check: before serving, find what would make the first
//! lifecycle fail, and name the fix.
//!
//! Checked: the API answers this token (each way of failing gets its own
//! hint), every zone is a cluster node, every template exists with its agent
//! enabled, the pool exists, the token holds every privilege the lifecycle
//! uses (`GET /access/permissions`, PVE 8 and PVE 9 names), and whether the
//! datacenter's `user-tag-access` lets this token set per-machine tags.
//! Once per start: `/nodes`, `/version`, `/cluster/resources`, a config read
//! per template, a permissions read per checked path and SDN path plus `/`,
//! `/cluster/sdn/vnets` (when a template has a NIC on a bridge), a pool read
//! (with `Pool.Audit`) and `/cluster/options`.
//!
//! Privileges, from the API schema's `permissions` of each call the provider
//! makes (and the qemu-server sources for the agent):
//! - on the clones, i.e. `/pool/{pool}` (or `/vms` without a pool):
//!   `VM.Allocate` (clone into the pool: `/pool/{pool}`; destroy:
//!   `/vms/{vmid}`), `VM.Audit` (status, config, inventory), `VM.Config.CPU`,
//!   `VM.Config.Memory`, `VM.Config.Options` (description and tags),
//!   `VM.PowerMgmt` (start, stop), and the guest agent: `VM.Monitor` on
//!   PVE 8; on PVE 9 `VM.GuestAgent.Audit` (ping), `VM.GuestAgent.FileWrite`
//!   (file-write) and `VM.GuestAgent.Unrestricted` (exec, exec-status; it
//!   also covers the other two);
//! - on each template `/vms/{id}`: `VM.Clone`, `VM.Audit`;
//! - on each storage clones and replicas allocate on, `/storage/{id}`:
//!   the instance types' and nodes' storages, and the templates' disk
//!   storages while some clone goes without `storage`:
//!   `Datastore.AllocateSpace`;
//! - with replicas staged, on the pool: `VM.Clone`, `VM.Migrate`, and
//!   `VM.Config.Disk` when their migration moves disks to `--node-storage`
//!   (qemu-server's migrate_vm, for any `targetstorage`);
//! - with a template whose CD-ROM is the host's drive: `Sys.Console` on `/`
//!   (refused with the fix rather than granted);
//! - PVE 8 and newer, on each bridge the templates' NICs use
//!   (`/sdn/zones/{zone}/{bridge}`, or `.../{bridge}/{vlan}` for a NIC's
//!   VLAN tag and each VLAN of its trunks; `{zone}` an SDN VNet's own, else
//!   `localnetwork`): `SDN.Use`, refused on a VNet the token can see, warned
//!   of elsewhere (see [`sdn`]).
//!
//! - with the node memory guard on, on each node `/nodes/{node}`:
//!   `Sys.Audit` (without it `GET /nodes` hides the node's memory);
//! - on each resource mapping a template uses: `Mapping.Use` (mapped PCI
//!   and USB devices; on PVE 9 a `custom-<name>` CPU model); a device
//!   passed through by host address is refused (only root may clone it).
//!
//! Not needed, so not checked: `Sys.Audit` elsewhere (the status of the
//! token's own tasks is open to every user; `/nodes/{node}/status` is
//! never read), `Pool.Allocate` (the clone's `pool` needs `VM.Allocate`
//! there), `Pool.Audit` (only used, when held, to confirm the pool exists).

mod sdn;
mod types;

use std::collections::BTreeSet;

use std::future::Future;
use std::time::Duration;

use pve::{AccessFailure, ClusterVm, PveClient, PveError, TagAccess, VmConfig};
use tokio::time::Instant;

use super::api::{err, Api};
use super::inventory::Inventory;
use super::marker::TagPolicy;
use super::options::{CloneMode, PveOptions};
use super::placement::Placement;
use crate::substrate::SubstrateError;

/// One job of the lifecycle and the privileges that allow it: any one of
/// them (PVE 8's name first, then PVE 9's).
struct Need {
    job: &'static str,
    any_of: &'static [&'static str],
}

impl Need {
    /// The privilege to grant for this job on PVE `major`.
    fn to_grant(&self, major: u32) -> &'static str {
        let i = usize::from(major >= 9 && self.any_of.len() > 1);
        self.any_of.get(i).copied().unwrap_or_default()
    }
}

const ON_CLONES: &[Need] = &[
    Need {
        job: "clone into the pool and destroy the clones",
        any_of: &["VM.Allocate"],
    },
    Need {
        job: "read status, config and inventory",
        any_of: &["VM.Audit"],
    },
    Need {
        job: "set the clone's cores",
        any_of: &["VM.Config.CPU"],
    },
    Need {
        job: "set the clone's memory",
        any_of: &["VM.Config.Memory"],
    },
    Need {
        job: "write the description marker and tags",
        any_of: &["VM.Config.Options"],
    },
    Need {
        job: "start and stop the clones",
        any_of: &["VM.PowerMgmt"],
    },
    Need {
        job: "ping the guest agent",
        any_of: &[
            "VM.Monitor",
            "VM.GuestAgent.Audit",
            "VM.GuestAgent.Unrestricted",
        ],
    },
    Need {
        job: "write the bootstrap blob through the agent",
        any_of: &[
            "VM.Monitor",
            "VM.GuestAgent.FileWrite",
            "VM.GuestAgent.Unrestricted",
        ],
    },
    Need {
        job: "run the bootstrap, readiness and drain commands through the agent",
        any_of: &["VM.Monitor", "VM.GuestAgent.Unrestricted"],
    },
];

const ON_TEMPLATE: &[Need] = &[
    Need {
        job: "clone the template",
        any_of: &["VM.Clone"],
    },
    Need {
        job: "read the template's config",
        any_of: &["VM.Audit"],
    },
];

/// On the pool, only when a template on local storage serves another node
/// and replicas are on: staging clones a replica and migrates it there.
const ON_REPLICAS: &[Need] = &[
    Need {
        job: "clone a per-node template replica",
        any_of: &["VM.Clone"],
    },
    Need {
        job: "migrate a replica to its node",
        any_of: &["VM.Migrate"],
    },
];

/// On the pool, only when a replica's migration moves its local disks to a
/// node's own storage (`--node-storage`): qemu-server's migrate_vm asks for
/// `VM.Config.Disk` on the VM for any `targetstorage`.
const ON_REPLICA_DISKS: &[Need] = &[Need {
    job: "move a replica's disks to the node's storage (--node-storage)",
    any_of: &["VM.Config.Disk"],
}];

/// On the pool, when an instance type sizes the boot disk (`disk_gib`):
/// `PUT .../resize` needs `VM.Config.Disk` on the VM.
const ON_RESIZE: &[Need] = &[Need {
    job: "grow the clones' boot disk to the instance type's disk_gib",
    any_of: &["VM.Config.Disk"],
}];

/// On each node, with the node memory guard on: without it `GET /nodes`
/// lists the node without `maxmem` and `mem` (pve-manager `API2/Nodes.pm`,
/// `extract_node_stats`), and the guard has nothing to check against.
const ON_NODE: &[Need] = &[Need {
    job: "read the node's memory for the node memory guard (--node-memory-limit)",
    any_of: &["Sys.Audit"],
}];

/// On each resource mapping a template uses (`/mapping/{pci,usb,cpu}/<name>`):
/// qemu-server's `clone_vm` checks it for mapped PCI and USB devices
/// (`check_mapping_access`) and, from qemu-server 9.1.15, for a custom CPU
/// model (`$check_cpu_model_access`).
const ON_MAPPING: &[Need] = &[Need {
    job: "clone a template that uses this resource mapping",
    any_of: &["Mapping.Use"],
}];

const ON_STORAGE: &[Need] = &[Need {
    job: "allocate the clones' and replicas' disks",
    any_of: &["Datastore.AllocateSpace"],
}];

/// Whether Creates will stage per-node template replicas, and whether their
/// migrations move disks to another storage.
#[derive(Default)]
struct ReplicaUse {
    stages: bool,
    moves_disks: bool,
}

/// The needs `held` does not satisfy.
fn missing<'a>(held: &BTreeSet<String>, needs: &'a [Need]) -> Vec<&'a Need> {
    needs
        .iter()
        .filter(|n| !n.any_of.iter().any(|p| held.contains(*p)))
        .collect()
}

/// The hint for a failure to use the API at all, naming the flag to fix.
pub(super) fn access_hint(e: &PveError, url: &str) -> Option<String> {
    let port = url_port(url);
    let hint = match e.access_failure()? {
        AccessFailure::Unauthorized => {
            "the API token was refused (401): check --proxmox-token-id (USER@REALM!TOKENID) and \
             its secret (--proxmox-token-file or --proxmox-token-secret); the token may also have \
             expired or been removed (`pveum user token list USER`)"
                .to_string()
        }
        AccessFailure::WrongPath => format!(
            "{url} is not the API root: --proxmox-api-url must end in /api2/json, e.g. \
             https://pve1.example:8006/api2/json"
        ),
        AccessFailure::ConnectionRefused => format!(
            "nothing listens at {url}: the PVE API listens on port 8006 \
             (https://HOST:8006/api2/json); check the port in --proxmox-api-url and that \
             pveproxy runs on the node"
        ),
        AccessFailure::Unreachable => format!(
            "the host of {url} does not resolve or does not answer: check the host name in \
             --proxmox-api-url and the network path (firewall) to its port {port}"
        ),
        AccessFailure::NotTls => format!(
            "{url} does not speak HTTPS: the PVE API is HTTPS on port 8006; check the port in \
             --proxmox-api-url"
        ),
        AccessFailure::Tls => format!(
            "the API's TLS certificate at {url} failed verification: --proxmox-ca-file must hold \
             the CA that signed it (a node's default is /etc/pve/pve-root-ca.pem) and the URL's \
             host name must be in the certificate, and/or --proxmox-tls-fingerprint must list the \
             SHA-256 of the certificate the node serves (`pvenode cert info` on the node)"
        ),
    };
    Some(hint)
}

/// The port `url` names, or HTTPS's 443 when it names none: the one a
/// firewall must let through (PVE's API listens on 8006, which a URL
/// without a port does not reach).
fn url_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    // `[v6]:port` or `host:port`; a bare IPv6 literal has no port.
    let port = match authority.rsplit_once(']') {
        Some((_, after)) => after.strip_prefix(':'),
        None => authority.rsplit_once(':').map(|(_, p)| p),
    };
    port.filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .unwrap_or("443")
        .to_string()
}

/// The resource mappings the templates' clones are checked on, as
/// qemu-server's `clone_vm` checks them: each mapped PCI or USB device
/// (`/mapping/pci/<name>`, `/mapping/usb/<name>`) and, on PVE 9, a custom
/// CPU model (`/mapping/cpu/<name>`). A device passed through by host
/// address is refused: PVE lets only `root@pam` clone it.
fn mapping_paths(configs: &[(u32, VmConfig)], major: u32) -> Result<Vec<String>, SubstrateError> {
    let mut out = BTreeSet::new();
    for (t, cfg) in configs {
        for dev in cfg.passthrough() {
            if dev.root_only() {
                return Err(SubstrateError::with_kind(
                    providerkit::ErrorKind::Refused,
                    format!(
                        "template VMID {t} passes through a host device ({}: {}), and PVE lets only \
                         root@pam clone such a VM (qemu-server check_mapping_access). Map the device \
                         (Datacenter > Resource Mappings) and use it by name: `qm set {t} --{} mapping=<name>`",
                        dev.key,
                        dev.host.as_deref().unwrap_or("no host or mapping"),
                        dev.key
                    ),
                ));
            }
            if let Some(name) = &dev.mapping {
                out.insert(format!("/mapping/{}/{name}", dev.bus.mapping_kind()));
            }
        }
        if let Some(model) = cfg.custom_cpu_model().filter(|_| major >= 9) {
            out.insert(format!("/mapping/cpu/{model}"));
        }
    }
    Ok(out.into_iter().collect())
}

/// The major release number from `GET /version`'s `release` (`8.3` -> 8).
fn major(release: &str) -> Option<u32> {
    release.split('.').next()?.trim().parse().ok()
}

/// The start-up check over the parts it reads; it holds nothing itself.
/// How long a read after the cluster's first answer retries a transient
/// failure: long enough to ride out a proxy restart or a dropped
/// connection, short enough that a start-up against a sick cluster says
/// so within a minute. The first read (`GET /nodes`) is not retried
/// beyond the client's own attempts: a wrong URL or token fails at once.
const READ_RETRY: Duration = Duration::from_secs(30);

pub(super) struct Preflight<'a> {
    pub(super) api: &'a Api,
    pub(super) opts: &'a PveOptions,
    pub(super) inventory: &'a Inventory,
    pub(super) placement: &'a Placement,
    pub(super) tags: &'a TagPolicy,
}

impl<'a> Preflight<'a> {
    /// A read retried on transient failures for [`READ_RETRY`].
    async fn read<T, F, Fut>(&self, node: Option<&str>, call: F) -> Result<T, PveError>
    where
        F: FnMut(&'a PveClient) -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        let api: &'a Api = self.api;
        api.retry_raw(node, Instant::now() + READ_RETRY, call).await
    }

    /// Startup check. Errors name the problem and the fix; the returned
    /// strings are warnings (offline node, source VM not a template, a check
    /// that could not be made, marker-only ownership).
    pub(super) async fn run(
        &self,
        nodes: &[String],
        templates: &[u32],
    ) -> Result<Vec<String>, SubstrateError> {
        let url = self.api.base_url().to_string();
        // Each step is logged as it starts: a cluster that does not answer
        // leaves a pod live but not ready, and its log must say on what.
        tracing::info!(url = %url, "preflight: listing the cluster's nodes");
        let cluster =
            self.api
                .once(|pve| pve.nodes())
                .await
                .map_err(|e| match access_hint(&e, &url) {
                    Some(hint) => err(format!("{hint} (listing the cluster's nodes)"), &e),
                    None => err(format!("listing the cluster's nodes at {url}"), &e),
                })?;
        let mut warnings = Vec::new();
        let names: Vec<&str> = cluster.iter().map(|n| n.node.as_str()).collect();
        for n in &cluster {
            tracing::info!(node = %n.node, status = %n.status, "Proxmox node");
        }
        for node in nodes {
            match cluster.iter().find(|n| &n.node == node) {
                None => {
                    return Err(SubstrateError::new(format!(
                        "node {node:?} from --nodes is not in the cluster (cluster nodes: {})",
                        names.join(", ")
                    )))
                }
                Some(n) if n.status != "online" => {
                    tracing::warn!(node = %node, status = %n.status,
                        "node is not online: serving the other nodes; Creates there fail until it is back");
                    warnings.push(format!(
                        "node {node:?} is {}: serving the other nodes; Creates aimed at it fail \
                         naming it, Deletes and Drains of its machines wait for it, and its VMs \
                         keep their last known state",
                        n.status
                    ))
                }
                Some(_) => {}
            }
        }
        // The version only picks which privilege names the fix suggests.
        let major = match self.read(None, |pve| pve.release()).await {
            Ok(r) => major(&r).unwrap_or(8),
            Err(_) => 8,
        };

        let wanted: Vec<String> = templates.iter().map(u32::to_string).collect();
        tracing::info!(
            url = %url,
            templates = %wanted.join(","),
            "preflight: reading the cluster's VMs and the templates"
        );
        let (list, _) = self.inventory.scan(|_| false).await?;
        let down = self.inventory.offline_nodes();
        // What is checked through the nodes themselves (template configs,
        // node storages, placement) is checked on the live ones only:
        // every call to a node that is down hangs until the connect fails,
        // and its first Create once it is back checks it.
        let live_nodes: Vec<String> = nodes
            .iter()
            .filter(|n| !down.contains(n))
            .cloned()
            .collect();
        let live_templates: Vec<u32> = templates
            .iter()
            .copied()
            .filter(|t| {
                list.iter()
                    .find(|v| v.vmid == *t)
                    .is_none_or(|v| !down.contains(&v.node))
            })
            .collect();
        let mut storages: BTreeSet<String> = BTreeSet::new();
        // Templates with the host's CD-ROM drive, and its key.
        let mut physical_cdrom: Vec<(u32, String)> = Vec::new();
        // The templates' configs, whose NICs the SDN check reads.
        let mut configs: Vec<(u32, VmConfig)> = Vec::new();
        for t in templates {
            let Some(v) = list.iter().find(|v| v.vmid == *t) else {
                return Err(SubstrateError::new(format!(
                    "template VMID {t} is not in the cluster (or the API token cannot audit it: \
                     grant VM.Audit and VM.Clone on /vms/{t})"
                )));
            };
            if !v.template {
                warnings.push(format!(
                    "source VMID {t} on node {} is not a template: clones copy a live VM",
                    v.node
                ));
            }
            if down.contains(&v.node) {
                // Every call to a node that is down hangs until the connect
                // fails: start serving the other nodes now.
                warnings.push(format!(
                    "template VMID {t} is on node {}, which is offline: its config is not \
                     checked until a restart while the node is online",
                    v.node
                ));
                continue;
            }
            match self
                .read(Some(&v.node), |pve| pve.get_config(&v.node, *t))
                .await
            {
                Ok(cfg) => {
                    if !cfg.agent_enabled() {
                        return Err(SubstrateError::new(format!(
                            "template VMID {t} on node {} has the QEMU guest agent disabled: every \
                             Create would wait for an agent that never answers. Enable it with \
                             `qm set {t} --agent enabled=1` (and install qemu-guest-agent in the \
                             template's OS)",
                            v.node
                        )));
                    }
                    storages.extend(cfg.disk_storages());
                    if let Some(cd) = cfg.cdroms().into_iter().find(pve::Cdrom::is_physical) {
                        physical_cdrom.push((*t, cd.key));
                    }
                    configs.push((*t, cfg));
                }
                // Named below, with the other missing privileges.
                Err(e) if e.is_forbidden() => {}
                Err(e) => {
                    return Err(err(
                        format!("reading the config of template VMID {t} on node {}", v.node),
                        &e,
                    ))
                }
            }
        }

        let pool_path = match &self.opts.pool {
            Some(p) => format!("/pool/{p}"),
            None => "/vms".to_string(),
        };
        let mut paths: Vec<(String, &[Need])> = vec![(pool_path.clone(), ON_CLONES)];
        let replicas = self
            .stages_replicas(&live_nodes, &live_templates, &list)
            .await;
        if replicas.stages {
            paths.push((pool_path.clone(), ON_REPLICAS));
        }
        if replicas.moves_disks {
            paths.push((pool_path.clone(), ON_REPLICA_DISKS));
        }
        paths.extend(templates.iter().map(|t| (format!("/vms/{t}"), ON_TEMPLATE)));
        if !self.opts.type_disk.is_empty() {
            paths.push((pool_path.clone(), ON_RESIZE));
        }
        types::check_disk_sizes(&self.opts.type_disk, &configs)?;
        paths.extend(types::device_paths(self.opts, &pool_path));
        if self.opts.node_memory_limit > 0.0 {
            paths.extend(live_nodes.iter().map(|n| (format!("/nodes/{n}"), ON_NODE)));
        }
        paths.extend(
            mapping_paths(&configs, major)?
                .into_iter()
                .map(|p| (p, ON_MAPPING)),
        );
        paths.extend(
            self.allocated_storages(nodes, storages, replicas.stages)
                .iter()
                .map(|s| (format!("/storage/{s}"), ON_STORAGE)),
        );
        tracing::info!(url = %url, "preflight: checking the API token's privileges");
        let mut held_on_pool = BTreeSet::new();
        let mut sys_modify_on_root = false;
        let mut sys_audit_on_root = false;
        let mut gaps: Vec<(String, Vec<&Need>)> = Vec::new();
        if let Some(held) = self.privileges(&paths, &mut warnings).await {
            for ((path, needs), privs) in paths.iter().zip(&held) {
                let lacking = missing(privs, needs);
                if !lacking.is_empty() {
                    gaps.push((path.clone(), lacking));
                }
            }
            held_on_pool = held.first().cloned().unwrap_or_default();
            let on_root = self
                .read(None, |pve| pve.permissions(Some("/")))
                .await
                .ok()
                .and_then(|mut p| p.remove("/"))
                .unwrap_or_default();
            sys_modify_on_root = on_root.contains("Sys.Modify");
            sys_audit_on_root = on_root.contains("Sys.Audit");
            // The host's CD-ROM drive is a device, not a volume: a clone of
            // it needs Sys.Console on `/` (qemu-server check_storage_access).
            if let Some((t, key)) = physical_cdrom.first() {
                if !on_root.contains("Sys.Console") {
                    return Err(SubstrateError::with_kind(
                        providerkit::ErrorKind::Refused,
                        format!(
                            "template VMID {t} has the host's CD-ROM drive ({key}: cdrom), and PVE lets only \
                             a token with Sys.Console on / clone such a VM, which a provider should not \
                             hold. Empty the drive (`qm set {t} --{key} none,media=cdrom`)"
                        ),
                    ));
                }
            }
        }

        let mut sdn_refusal = None;
        if major >= 8 && !held_on_pool.is_empty() {
            let found = sdn::check(self.api, &configs).await;
            warnings.extend(found.warnings);
            sdn_refusal = found.refusal;
        }
        if let Some(pool) = &self.opts.pool {
            self.check_pool(pool, &held_on_pool, &gaps).await?;
        }
        if !gaps.is_empty() {
            return Err(SubstrateError::with_kind(
                providerkit::ErrorKind::Refused,
                self.privilege_message(&gaps, major),
            ));
        }
        if let Some(refusal) = sdn_refusal {
            return Err(SubstrateError::with_kind(
                providerkit::ErrorKind::Refused,
                refusal,
            ));
        }

        warnings.extend(types::check_devices(self.api, self.opts, &live_nodes).await?);
        tracing::info!(url = %url, "preflight: checking storages and clone placement");
        warnings.extend(
            self.placement
                .check_placement(&live_nodes, &live_templates, &list)
                .await?,
        );
        self.check_tag_policy(sys_modify_on_root, sys_audit_on_root, &mut warnings)
            .await;
        Ok(warnings)
    }

    /// The token's privileges on each path, or `None` (with a warning) when
    /// PVE does not tell (an old release, or the call is refused).
    async fn privileges(
        &self,
        paths: &[(String, &[Need])],
        warnings: &mut Vec<String>,
    ) -> Option<Vec<BTreeSet<String>>> {
        let mut out = Vec::new();
        for (path, _) in paths {
            match self.read(None, |pve| pve.permissions(Some(path))).await {
                Ok(mut p) => out.push(p.remove(path).unwrap_or_default()),
                Err(e) => {
                    warnings.push(format!(
                        "could not read the API token's privileges (GET /access/permissions: {e}); \
                         not checked: a missing privilege shows as a 403 in last_error"
                    ));
                    return None;
                }
            }
        }
        Some(out)
    }

    /// The pool exists. With `Pool.Audit` the pool is read; without, a
    /// token holding no privilege at all on the pool's path is refused (a
    /// misspelt pool and a missing ACL look the same, and both would fail
    /// every Create).
    async fn check_pool(
        &self,
        pool: &str,
        held: &BTreeSet<String>,
        gaps: &[(String, Vec<&Need>)],
    ) -> Result<(), SubstrateError> {
        let path = format!("/pool/{pool}");
        if held.contains("Pool.Audit") {
            return match self.read(None, |pve| pve.pool_members(pool)).await {
                Ok(_) => Ok(()),
                Err(e) if e.is_not_found() => Err(SubstrateError::new(format!(
                    "pool {pool:?} from --proxmox-pool does not exist: fix the name, or create it \
                     with `pveum pool add {pool}` and grant the token its role on {path}"
                ))),
                Err(e) => Err(err(format!("reading pool {pool:?} (--proxmox-pool)"), &e)),
            };
        }
        let nothing_held = gaps
            .iter()
            .find(|(p, _)| *p == path)
            .is_some_and(|(_, lacking)| lacking.len() == ON_CLONES.len());
        if nothing_held {
            return Err(SubstrateError::with_kind(
                providerkit::ErrorKind::Refused,
                format!(
                    "the API token holds no privilege on {path}: pool {pool:?} from \
                     --proxmox-pool does not exist, or the token has no ACL on it. Check the \
                     name (`pveum pool list`), create the pool (`pveum pool add {pool}`), and \
                     grant the provider's role on it (`pveum acl modify {path} --tokens '{}' \
                     --roles <role>`; deploy/host-setup/setup-token.sh does both)",
                    self.api.token_id()
                ),
            ));
        }
        Ok(())
    }

    fn privilege_message(&self, gaps: &[(String, Vec<&Need>)], major: u32) -> String {
        let token = self.api.token_id();
        let user = token.split('!').next().unwrap_or(token);
        let mut parts = Vec::new();
        let mut fixes = Vec::new();
        for (path, lacking) in gaps {
            let named: Vec<String> = lacking
                .iter()
                .map(|n| {
                    let privs = if n.any_of.len() > 1 {
                        format!(
                            "{} (PVE 8) or {} (PVE 9)",
                            n.any_of[0],
                            n.any_of[1..].join(" or ")
                        )
                    } else {
                        n.any_of.join(" or ")
                    };
                    format!("{privs} to {}", n.job)
                })
                .collect();
            parts.push(format!("on {path}: {}", named.join("; ")));
            let mut grant: Vec<&str> = lacking.iter().map(|n| n.to_grant(major)).collect();
            grant.dedup();
            fixes.push(format!(
                "`pveum role modify <role> --append 1 --privs '{}'` for the role granted on \
                 {path}, or `pveum acl modify {path} --tokens '{token}' --roles <role holding \
                 them>`",
                grant.join(",")
            ));
        }
        format!(
            "the API token {token} lacks privileges the lifecycle needs: {}. Fix (PVE {major}): {}. \
             A token without privilege separation uses its user's ACLs (`--users {user}` instead of \
             `--tokens`); deploy/host-setup/setup-token.sh grants exactly these",
            parts.join(" | "),
            fixes.join("; ")
        )
    }

    /// The storages PVE checks `Datastore.AllocateSpace` on for our clones
    /// and migrations: a clone's `storage` parameter when it has one (the
    /// instance type's, else the node's; full clones only), else each of
    /// the template's disk storages (qemu-server `check_storage_access_clone`);
    /// a replica's migration `targetstorage` (the node's storage). The
    /// template's storages count unless every clone names a storage: linked
    /// clones and replica stagings never do, nor a full clone on a node
    /// without `--node-storage` of a type without one.
    fn allocated_storages(
        &self,
        nodes: &[String],
        template_storages: BTreeSet<String>,
        replicas: bool,
    ) -> BTreeSet<String> {
        let opts = self.opts;
        let full = opts.clone_mode == CloneMode::Full;
        let node_storages = nodes.iter().filter_map(|n| opts.node_storage.get(n));
        let mut out = BTreeSet::new();
        if !full || replicas || nodes.iter().any(|n| !opts.node_storage.contains_key(n)) {
            out.extend(template_storages);
        }
        if full || replicas {
            out.extend(node_storages.cloned());
        }
        if full {
            out.extend(opts.type_storage.values().cloned());
        }
        out
    }

    /// Whether some Create will stage a replica: replicas are on and a
    /// template whose disks are not all on shared storage serves another
    /// node. A read that fails here counts as no (the staging itself names
    /// a missing privilege later).
    async fn stages_replicas(
        &self,
        nodes: &[String],
        templates: &[u32],
        list: &[ClusterVm],
    ) -> ReplicaUse {
        let mut out = ReplicaUse::default();
        if !self.opts.template_replicas {
            return out;
        }
        let deadline = self.api.deadline();
        for &t in templates {
            let Some(tnode) = list.iter().find(|v| v.vmid == t).map(|v| v.node.as_str()) else {
                continue;
            };
            if nodes.iter().all(|n| n == tnode) {
                continue;
            }
            let (Ok(layout), Ok(storages)) = (
                self.placement.layout(t, tnode, None, deadline).await,
                self.placement.node_storages(tnode, deadline).await,
            ) else {
                continue;
            };
            let shared = layout.shared(&storages);
            for node in nodes.iter().filter(|n| *n != tnode) {
                if !shared {
                    out.stages = true;
                    // The replica's migration names the node's storage.
                    out.moves_disks |= self.opts.node_storage.contains_key(node);
                    continue;
                }
                for storage in self.placement.full_clone_storages(node) {
                    if self
                        .placement
                        .needs_local_source(node, tnode, Some(&storage), deadline)
                        .await
                        .unwrap_or(false)
                    {
                        out.stages = true;
                    }
                }
            }
        }
        out
    }

    /// Where the datacenter's `user-tag-access` refuses new tags to this
    /// token (no `Sys.Modify` on `/`), every per-machine tag would be a 403.
    /// The provider then owns its VMs by their description marker alone,
    /// with a warning, rather than refusing to start: the marker is the
    /// ownership proof everywhere anyway (nothing is destroyed unless it
    /// names the machine, and the clone's `bigfleet-` name still marks it in
    /// the inventory), so the tags are a convenience, and a restricted
    /// policy is a cluster admin's deliberate choice.
    async fn check_tag_policy(
        &self,
        sys_modify_on_root: bool,
        sys_audit_on_root: bool,
        warnings: &mut Vec<String>,
    ) {
        match self.read(None, |pve| pve.cluster_options()).await {
            // Absent without Sys.Audit on /: PVE hid it, so nothing is known.
            Ok(o) if o.tag_access.is_none() && !sys_audit_on_root && !sys_modify_on_root => {
                warnings.push(
                    "the datacenter option user-tag-access is unknown: without Sys.Audit on / \
                     PVE does not show it to this token. If it refuses new tags, the first \
                     refused marking falls back to marker-only ownership (grant Sys.Audit on / \
                     to know at start-up)"
                        .to_string(),
                );
            }
            Ok(o)
                if o.tag_access.as_ref().is_some_and(|t| t.refuses_new_tags())
                    && !sys_modify_on_root =>
            {
                self.tags.restrict();
                let policy = match o.tag_access.as_ref().unwrap_or(&TagAccess::Free) {
                    TagAccess::Free => "user-allow=free".to_string(),
                    TagAccess::Existing(l) if l.is_empty() => "user-allow=existing".to_string(),
                    TagAccess::Existing(l) => format!("user-allow=existing, list {}", l.join(";")),
                    TagAccess::List(l) => format!("user-allow=list, list {}", l.join(";")),
                    TagAccess::None => "user-allow=none".to_string(),
                };
                warnings.push(format!(
                    "the datacenter option user-tag-access ({policy}) refuses new tags to this token: \
                     VMs are owned by their description marker only, without the bigfleet tags. \
                     To keep the tags, set user-tag-access to free (Datacenter > Options > User \
                     Tag Access) or grant the token Sys.Modify on /"
                ));
            }
            Ok(_) => {}
            Err(e) => warnings.push(format!(
                "could not read the datacenter options (GET /cluster/options: {e}); if \
                 user-tag-access refuses new tags, the first Create falls back to marker-only \
                 ownership"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_port_a_firewall_must_pass_is_the_urls() {
        assert_eq!(
            super::url_port("https://127.0.0.1:18443/api2/json"),
            "18443"
        );
        assert_eq!(
            super::url_port("https://pve1.example:8006/api2/json"),
            "8006"
        );
        assert_eq!(super::url_port("https://pve1.example/api2/json"), "443");
        assert_eq!(super::url_port("https://[fd00::1]:8006/api2/json"), "8006");
        assert_eq!(super::url_port("https://[fd00::1]/api2/json"), "443");
    }

    use super::*;

    fn set(p: &[&str]) -> BTreeSet<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn either_generation_of_agent_privileges_is_accepted() {
        let base = [
            "VM.Allocate",
            "VM.Audit",
            "VM.Config.CPU",
            "VM.Config.Memory",
            "VM.Config.Options",
            "VM.PowerMgmt",
        ];
        let mut pve8 = base.to_vec();
        pve8.push("VM.Monitor");
        assert!(missing(&set(&pve8), ON_CLONES).is_empty());
        let mut pve9 = base.to_vec();
        pve9.extend(["VM.GuestAgent.Audit", "VM.GuestAgent.FileWrite"]);
        let lacking = missing(&set(&pve9), ON_CLONES);
        assert_eq!(lacking.len(), 1, "exec needs Unrestricted");
        assert_eq!(lacking[0].to_grant(9), "VM.GuestAgent.Unrestricted");
        assert_eq!(lacking[0].to_grant(8), "VM.Monitor");
        pve9.push("VM.GuestAgent.Unrestricted");
        assert!(missing(&set(&pve9), ON_CLONES).is_empty());
        assert_eq!(missing(&set(&[]), ON_CLONES).len(), ON_CLONES.len());
    }

    #[test]
    fn releases() {
        assert_eq!(major("8.3"), Some(8));
        assert_eq!(major("9.0"), Some(9));
        assert_eq!(major(""), None);
    }
}
