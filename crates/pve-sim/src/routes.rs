//! The API the simulator serves, as one table: each route declares, once,
//! its method, its path template, the privileges PVE checks before running
//! it and the handler that answers it. [`ROUTES`], path matching and
//! dispatch all read that table, so an endpoint is added in one place and
//! cannot be served without its checks or listed without a handler.
//!
//! The cut: what each endpoint is lives here; the request pipeline around it
//! (auth, decoding, validation, faults, envelopes) is `server`'s, the
//! privilege rules that depend on the request are `privileges`'s, and the
//! operations themselves are `Shared`'s (`inventory`, `lifecycle`,
//! `migrate`, `vm_config`, `guest_api`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use serde_json::{json, Value};

use crate::params::Params;
use crate::privileges::{self, Privileges};
use crate::sim::Shared;
use crate::state::{ApiError, ApiResult};

use Handler::{Awaits, Now};
use Privileges::{Agent, OnVm, Rule, Unchecked};

/// Every endpoint the simulator serves, as `(METHOD, template)`, in the
/// table's order (the order paths are matched in).
pub const ROUTES: &[(&str, &str)] = &METHOD_TEMPLATES;

/// [`ROUTES`] as an array: built from [`TABLE`] at compile time, so the two
/// cannot disagree.
const METHOD_TEMPLATES: [(&str, &str); TABLE.len()] = method_templates();

const fn method_templates<const N: usize>() -> [(&'static str, &'static str); N] {
    let mut out = [("", ""); N];
    let mut i = 0;
    while i < N {
        out[i] = (TABLE[i].method, TABLE[i].template);
        i += 1;
    }
    out
}

/// One served endpoint.
pub(crate) struct Route {
    pub(crate) method: &'static str,
    /// The path below `/api2/json`, `{name}` for a path parameter.
    pub(crate) template: &'static str,
    pub(crate) privileges: Privileges,
    handler: Handler,
}

/// A handler's answer still to come. It borrows the simulator and the call;
/// `Send` because a late-applied fault runs it on a task of its own.
type Pending<'a> = Pin<Box<dyn Future<Output = ApiResult> + Send + 'a>>;

/// What answers a route.
#[derive(Clone, Copy)]
enum Handler {
    /// Answers without waiting (a worker task, if any, runs on its own).
    Now(fn(&Arc<Shared>, &Call<'_>) -> ApiResult),
    /// Waits before answering: on the config lock (a synchronous config
    /// update) or on the guest agent.
    Awaits(for<'a> fn(&'a Arc<Shared>, &'a Call<'a>) -> Pending<'a>),
}

/// A matched request as its handler reads it: the node and VMID of the
/// path (`""` and 0 on routes without them) and every parameter.
struct Call<'a> {
    node: &'a str,
    vmid: u32,
    p: &'a Params,
}

impl Route {
    /// Run the route's handler on validated, permitted parameters.
    pub(crate) async fn answer(&self, s: &Arc<Shared>, p: &Params) -> ApiResult {
        let call = Call {
            node: p.get("node").unwrap_or_default(),
            vmid: p.u64("vmid").unwrap_or(0) as u32,
            p,
        };
        match self.handler {
            Now(f) => f(s, &call),
            Awaits(f) => f(s, &call).await,
        }
    }
}

const fn get(template: &'static str, privileges: Privileges, handler: Handler) -> Route {
    route("GET", template, privileges, handler)
}

const fn post(template: &'static str, privileges: Privileges, handler: Handler) -> Route {
    route("POST", template, privileges, handler)
}

const fn put(template: &'static str, privileges: Privileges, handler: Handler) -> Route {
    route("PUT", template, privileges, handler)
}

const fn delete(template: &'static str, privileges: Privileges, handler: Handler) -> Route {
    route("DELETE", template, privileges, handler)
}

const fn route(
    method: &'static str,
    template: &'static str,
    privileges: Privileges,
    handler: Handler,
) -> Route {
    Route {
        method,
        template,
        privileges,
        handler,
    }
}

/// Every endpoint: method and template, privileges (see [`Privileges`];
/// from the API schema's `permissions`, the guest agent's by release),
/// handler.
const TABLE: &[Route] = &[
    get("/version", Unchecked, Now(|s, _| Ok(version(s)))),
    get("/nodes", Unchecked, Now(|s, _| Ok(s.nodes()))),
    get(
        "/cluster/nextid",
        Unchecked,
        Now(|s, c| s.nextid(c.p.u64("vmid").map(|v| v as u32))),
    ),
    get(
        "/cluster/resources",
        Unchecked,
        Now(|s, c| Ok(s.resources(c.p.get("type")))),
    ),
    get("/pools", Unchecked, Now(|s, c| s.pools(c.p.get("poolid")))),
    get(
        "/pools/{poolid}",
        Unchecked,
        Now(|s, c| s.pool(c.p.get("poolid").unwrap_or_default())),
    ),
    get(
        "/nodes/{node}/qemu",
        Unchecked,
        Now(|s, c| Ok(s.node_vms(c.node))),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/clone",
        Rule(privileges::clone),
        Now(|s, c| {
            // qemu-server `check_mapping_access` dies (500) on a host
            // device passed through by address, whatever the token holds.
            s.refuse_root_only_devices_of(c.vmid)?;
            s.clone_vm(c.node, c.vmid, c.p)
        }),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/config",
        OnVm("VM.Audit"),
        Now(|s, c| s.config(c.node, c.vmid)),
    ),
    put(
        "/nodes/{node}/qemu/{vmid}/config",
        Rule(privileges::config),
        Awaits(|s, c| {
            Box::pin(async move {
                // qemu-server `check_hostpci_perm` / `check_usb_perm`.
                crate::mapping::refuse_root_only_params(c.p)?;
                s.update_config_sync(c.node, c.vmid, c.p).await
            })
        }),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/config",
        Rule(privileges::config),
        Now(|s, c| {
            crate::mapping::refuse_root_only_params(c.p)?;
            s.update_config_async(c.node, c.vmid, c.p)
        }),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/status/start",
        OnVm("VM.PowerMgmt"),
        Now(|s, c| s.start(c.node, c.vmid, c.p)),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/status/stop",
        OnVm("VM.PowerMgmt"),
        Now(|s, c| s.stop(c.node, c.vmid, c.p, "qmstop")),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/status/shutdown",
        OnVm("VM.PowerMgmt"),
        Now(|s, c| s.stop(c.node, c.vmid, c.p, "qmshutdown")),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/status/current",
        OnVm("VM.Audit"),
        Now(|s, c| s.status_current(c.node, c.vmid)),
    ),
    delete(
        "/nodes/{node}/qemu/{vmid}",
        OnVm("VM.Allocate"),
        Now(|s, c| s.destroy(c.node, c.vmid, c.p)),
    ),
    get(
        "/nodes/{node}/tasks",
        Unchecked,
        Now(|s, c| s.node_tasks(c.node, c.p)),
    ),
    get(
        "/nodes/{node}/tasks/{upid}/status",
        Unchecked,
        Now(|s, c| {
            let upid = c.p.get("upid").unwrap_or_default();
            check_upid(upid)?;
            s.task_status(c.node, upid)
        }),
    ),
    get(
        "/nodes/{node}/tasks/{upid}/log",
        Unchecked,
        Now(|s, c| {
            let upid = c.p.get("upid").unwrap_or_default();
            check_upid(upid)?;
            let start = c.p.u64("start").unwrap_or(0) as usize;
            let limit = c.p.u64("limit").unwrap_or(50) as usize;
            s.task_log(c.node, upid, start, limit)
        }),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/agent/ping",
        Agent(&["VM.GuestAgent.Audit", "VM.GuestAgent.Unrestricted"]),
        Awaits(|s, c| Box::pin(s.agent_ping(c.node, c.vmid))),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/agent/file-write",
        Agent(&["VM.GuestAgent.FileWrite", "VM.GuestAgent.Unrestricted"]),
        Awaits(|s, c| Box::pin(s.agent_file_write(c.node, c.vmid, c.p))),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/agent/exec",
        Agent(&["VM.GuestAgent.Unrestricted"]),
        Awaits(|s, c| Box::pin(s.agent_exec(c.node, c.vmid, c.p))),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/agent/exec-status",
        Agent(&["VM.GuestAgent.Unrestricted"]),
        Awaits(|s, c| Box::pin(s.agent_exec_status(c.node, c.vmid, c.p.u64("pid").unwrap_or(0)))),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces",
        Unchecked,
        Awaits(|s, c| Box::pin(s.agent_network_interfaces(c.node, c.vmid))),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/agent/get-osinfo",
        Unchecked,
        Awaits(|s, c| Box::pin(s.agent_osinfo(c.node, c.vmid))),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/agent/get-host-name",
        Unchecked,
        Awaits(|s, c| Box::pin(s.agent_host_name(c.node, c.vmid))),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/agent/info",
        Unchecked,
        Awaits(|s, c| Box::pin(s.agent_info(c.node, c.vmid))),
    ),
    get(
        "/nodes/{node}/qemu/{vmid}/status",
        Unchecked,
        Now(|s, c| s.status_index(c.node, c.vmid)),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/migrate",
        Rule(privileges::migrate),
        Now(|s, c| s.migrate(c.node, c.vmid, c.p)),
    ),
    post(
        "/nodes/{node}/qemu/{vmid}/template",
        OnVm("VM.Allocate"),
        Now(|s, c| s.convert_to_template(c.node, c.vmid, c.p)),
    ),
    get(
        "/cluster/status",
        Unchecked,
        Now(|s, _| Ok(s.cluster_status())),
    ),
    get(
        "/nodes/{node}/status",
        Unchecked,
        Now(|s, c| Ok(s.node_status(c.node))),
    ),
    get(
        "/nodes/{node}/storage",
        Unchecked,
        Now(|s, c| Ok(s.node_storages(c.node, c.p))),
    ),
    get(
        "/nodes/{node}/storage/{storage}/status",
        Rule(privileges::storage_status),
        Now(|s, c| s.storage_status(c.node, c.p.get("storage").unwrap_or_default())),
    ),
    get(
        "/access/permissions",
        Unchecked,
        Now(|s, c| Ok(s.permissions(c.p.get("path")))),
    ),
    get(
        "/cluster/options",
        Unchecked,
        Now(|s, _| Ok(s.cluster_options())),
    ),
    // pve-network `API2/Network/SDN/Vnets.pm` (index); not in the official
    // schema file's subset, so validated against `api.json` alone.
    get("/cluster/sdn/vnets", Unchecked, Now(|s, _| s.sdn_vnets())),
    // qemu-server `API2/Qemu.pm` `resize_vm`: `Datastore.AllocateSpace`
    // on the disk's storage is checked by its worker, not here.
    put(
        "/nodes/{node}/qemu/{vmid}/resize",
        OnVm("VM.Config.Disk"),
        Now(|s, c| s.resize(c.node, c.vmid, c.p)),
    ),
    // pve-manager `API2/Cluster/Mapping/PCI.pm` (index): open to every
    // user, it filters by `Mapping.*` on each mapping itself.
    get(
        "/cluster/mapping/pci",
        Unchecked,
        Now(|s, c| s.pci_mapping_index(c.p)),
    ),
];

/// The route `method path` (a path below `/api2/json`) matches, with its
/// percent-decoded path parameters; the first match in table order wins.
pub(crate) fn find(method: &str, path: &str) -> Option<(&'static Route, Vec<(String, String)>)> {
    let segs: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(|s| percent_decode_str(s).decode_utf8_lossy().into_owned())
        .collect();
    'routes: for r in TABLE {
        if r.method != method {
            continue;
        }
        let tsegs: Vec<&str> = r.template.split('/').skip(1).collect();
        if tsegs.len() != segs.len() {
            continue;
        }
        let mut params = Vec::new();
        for (ts, s) in tsegs.iter().zip(&segs) {
            if let Some(name) = ts.strip_prefix('{').and_then(|n| n.strip_suffix('}')) {
                if s.is_empty() {
                    continue 'routes;
                }
                params.push((name.to_string(), s.clone()));
            } else if ts != s {
                continue 'routes;
            }
        }
        return Some((r, params));
    }
    None
}

/// `GET /version`: the release the simulator poses as.
fn version(s: &Shared) -> Value {
    if s.cfg.pve9 {
        json!({"version": "9.0.3", "release": "9.0", "repoid": "025864202ebb6109"})
    } else {
        json!({"version": "8.3.2", "release": "8.3", "repoid": "3e76eec21c4a14a7"})
    }
}

/// PVE parses a UPID before looking the task up; one it cannot parse is a
/// 500, not a missing task.
fn check_upid(upid: &str) -> ApiResult<()> {
    crate::tasks::upid_node(upid)
        .map(|_| ())
        .ok_or_else(|| ApiError::internal(format!("unable to parse worker upid '{upid}'")))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::{find, ROUTES, TABLE};
    use crate::config::SimConfig;
    use crate::endpoints;
    use crate::params::Params;
    use crate::schema::Schema;
    use crate::sim::Shared;

    #[test]
    fn routes_lists_the_table_in_order() {
        let table: Vec<(&str, &str)> = TABLE.iter().map(|r| (r.method, r.template)).collect();
        assert_eq!(ROUTES, table.as_slice());
    }

    /// Every endpoint the embedded description declares has a route, and so
    /// a handler and privileges, and every route is declared: a route
    /// dropped from the table, or one added without its description, fails
    /// here.
    #[test]
    fn the_table_serves_exactly_the_declared_endpoints() {
        let declared: BTreeSet<(String, String)> = Schema::embedded()
            .expect("embedded description parses")
            .endpoints()
            .into_iter()
            .collect();
        let mut served = BTreeSet::new();
        for r in TABLE {
            let key = (r.method.to_string(), r.template.to_string());
            assert!(served.insert(key), "{} {} twice", r.method, r.template);
        }
        let missing: Vec<_> = declared.difference(&served).collect();
        assert!(missing.is_empty(), "declared, no route: {missing:?}");
        let undeclared: Vec<_> = served.difference(&declared).collect();
        assert!(
            undeclared.is_empty(),
            "routed, not declared: {undeclared:?}"
        );
    }

    /// A route's own template, its parameters standing for themselves,
    /// finds that route: no earlier route shadows it.
    #[test]
    fn no_route_shadows_another() {
        for r in TABLE {
            let found = find(r.method, r.template).map(|(f, _)| (f.method, f.template));
            assert_eq!(found, Some((r.method, r.template)));
        }
    }

    /// The names tests count calls and inject faults by name routes.
    #[test]
    fn endpoint_names_name_routes() {
        for name in [
            endpoints::NEXTID,
            endpoints::RESOURCES,
            endpoints::NODES,
            endpoints::POOLS,
            endpoints::POOL,
            endpoints::NODE_VMS,
            endpoints::CLONE,
            endpoints::CONFIG_GET,
            endpoints::CONFIG_PUT,
            endpoints::CONFIG_POST,
            endpoints::START,
            endpoints::STOP,
            endpoints::SHUTDOWN,
            endpoints::STATUS,
            endpoints::DESTROY,
            endpoints::TASK_STATUS,
            endpoints::TASK_LOG,
            endpoints::AGENT_PING,
            endpoints::AGENT_FILE_WRITE,
            endpoints::AGENT_EXEC,
            endpoints::AGENT_EXEC_STATUS,
            endpoints::AGENT_NETWORK,
            endpoints::AGENT_OSINFO,
            endpoints::AGENT_HOST_NAME,
            endpoints::AGENT_INFO,
            endpoints::MIGRATE,
            endpoints::TEMPLATE,
            endpoints::CLUSTER_STATUS,
            endpoints::NODE_STATUS,
            endpoints::NODE_STORAGE,
            endpoints::STORAGE_STATUS,
            endpoints::PERMISSIONS,
            endpoints::SDN_VNETS,
            endpoints::RESIZE,
            endpoints::PCI_MAPPINGS,
        ] {
            let route = name.split_once(' ');
            assert!(route.is_some_and(|r| ROUTES.contains(&r)), "{name}");
        }
    }

    type Pinned = &'static [(
        &'static str,
        &'static [(&'static str, &'static [&'static str])],
    )];

    /// What each route checks for one request that names everything, on
    /// the default template (VM 9000: NIC on `vmbr0`, disk on `local-lvm`).
    /// Routes not listed check nothing.
    const PVE8: Pinned = &[
        (
            "POST /nodes/{node}/qemu/{vmid}/clone",
            &[
                ("/vms/9000", &["VM.Clone"]),
                ("/pool/pool1", &["VM.Allocate"]),
                ("/sdn/zones/localnetwork/vmbr0", &["SDN.Use"]),
                ("/storage/local", &["Datastore.AllocateSpace"]),
            ],
        ),
        (
            "GET /nodes/{node}/qemu/{vmid}/config",
            &[("/vms/9000", &["VM.Audit"])],
        ),
        (
            "PUT /nodes/{node}/qemu/{vmid}/config",
            &[
                ("/vms/9000", &["VM.Config.CPU"]),
                ("/vms/9000", &["VM.Config.Options"]),
            ],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/config",
            &[
                ("/vms/9000", &["VM.Config.CPU"]),
                ("/vms/9000", &["VM.Config.Options"]),
            ],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/status/start",
            &[("/vms/9000", &["VM.PowerMgmt"])],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/status/stop",
            &[("/vms/9000", &["VM.PowerMgmt"])],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/status/shutdown",
            &[("/vms/9000", &["VM.PowerMgmt"])],
        ),
        (
            "GET /nodes/{node}/qemu/{vmid}/status/current",
            &[("/vms/9000", &["VM.Audit"])],
        ),
        (
            "DELETE /nodes/{node}/qemu/{vmid}",
            &[("/vms/9000", &["VM.Allocate"])],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/agent/ping",
            &[("/vms/9000", &["VM.Monitor"])],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/agent/file-write",
            &[("/vms/9000", &["VM.Monitor"])],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/agent/exec",
            &[("/vms/9000", &["VM.Monitor"])],
        ),
        (
            "GET /nodes/{node}/qemu/{vmid}/agent/exec-status",
            &[("/vms/9000", &["VM.Monitor"])],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/migrate",
            &[
                ("/vms/9000", &["VM.Migrate"]),
                ("/vms/9000", &["VM.Config.Disk"]),
                ("/storage/other", &["Datastore.AllocateSpace"]),
            ],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/template",
            &[("/vms/9000", &["VM.Allocate"])],
        ),
        (
            "PUT /nodes/{node}/qemu/{vmid}/resize",
            &[("/vms/9000", &["VM.Config.Disk"])],
        ),
        (
            "GET /nodes/{node}/storage/{storage}/status",
            &[(
                "/storage/local",
                &["Datastore.Audit", "Datastore.AllocateSpace"],
            )],
        ),
    ];

    /// PVE 9 checks the guest agent's own privileges instead of `VM.Monitor`.
    const PVE9_AGENT: Pinned = &[
        (
            "POST /nodes/{node}/qemu/{vmid}/agent/ping",
            &[(
                "/vms/9000",
                &["VM.GuestAgent.Audit", "VM.GuestAgent.Unrestricted"],
            )],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/agent/file-write",
            &[(
                "/vms/9000",
                &["VM.GuestAgent.FileWrite", "VM.GuestAgent.Unrestricted"],
            )],
        ),
        (
            "POST /nodes/{node}/qemu/{vmid}/agent/exec",
            &[("/vms/9000", &["VM.GuestAgent.Unrestricted"])],
        ),
        (
            "GET /nodes/{node}/qemu/{vmid}/agent/exec-status",
            &[("/vms/9000", &["VM.GuestAgent.Unrestricted"])],
        ),
    ];

    /// Each route's declared privileges, pinned: a route whose check is
    /// dropped, changed or moved to another route fails here.
    #[test]
    fn each_route_requires_its_privileges() {
        let mut p = Params::default();
        for (k, v) in [
            ("node", "pve1"),
            ("vmid", "9000"),
            ("newid", "101"),
            ("pool", "pool1"),
            ("storage", "local"),
            ("cores", "4"),
            ("delete", "tags"),
            ("targetstorage", "other"),
        ] {
            p.push(k, v);
        }
        for (pve9, pinned) in [(false, PVE8), (true, PVE9_AGENT)] {
            let scratch = tempfile::tempdir().expect("scratch dir");
            let cfg = SimConfig {
                pve9,
                ..SimConfig::default()
            };
            let schema = Schema::embedded().expect("embedded description parses");
            let s = Shared::new(cfg, schema, scratch.path().into(), String::new())
                .expect("simulator state");
            for (endpoint, _) in pinned {
                let found = endpoint
                    .split_once(' ')
                    .and_then(|(m, t)| TABLE.iter().find(|r| (r.method, r.template) == (m, t)));
                assert!(found.is_some(), "{endpoint}: no route");
            }
            for r in TABLE {
                let endpoint = format!("{} {}", r.method, r.template);
                let want: Vec<(String, Vec<&str>)> = pinned
                    .iter()
                    .find(|(e, _)| *e == endpoint)
                    .map(|(_, checks)| {
                        checks
                            .iter()
                            .map(|(path, any_of)| (path.to_string(), any_of.to_vec()))
                            .collect()
                    })
                    .unwrap_or_default();
                if pve9 && want.is_empty() {
                    continue; // pinned under PVE 8 above
                }
                assert_eq!(
                    r.privileges.required(&s, &p),
                    want,
                    "{endpoint}, pve9 {pve9}"
                );
            }
        }
    }
}
