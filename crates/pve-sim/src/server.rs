//! HTTPS front end: auth, parameter parsing, routing, schema validation, fault
//! injection and PVE's response envelopes.
//!
//! One file past 600 lines on purpose: the request path (auth, decoding,
//! validation, faults, envelope) is one pipeline.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, Method, Response, StatusCode, Uri};
use axum::Router;
use http::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use percent_encoding::percent_decode_str;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use crate::agent::GuestOutput;
use crate::params::Params;
use crate::sim::{RecordedRequest, Shared};
use crate::state::{ApiError, ApiResult};

/// Every endpoint the simulator serves, as `(METHOD, template)`.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/version"),
    ("GET", "/nodes"),
    ("GET", "/cluster/nextid"),
    ("GET", "/cluster/resources"),
    ("GET", "/pools"),
    ("GET", "/pools/{poolid}"),
    ("GET", "/nodes/{node}/qemu"),
    ("POST", "/nodes/{node}/qemu/{vmid}/clone"),
    ("GET", "/nodes/{node}/qemu/{vmid}/config"),
    ("PUT", "/nodes/{node}/qemu/{vmid}/config"),
    ("POST", "/nodes/{node}/qemu/{vmid}/config"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/start"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/stop"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown"),
    ("GET", "/nodes/{node}/qemu/{vmid}/status/current"),
    ("DELETE", "/nodes/{node}/qemu/{vmid}"),
    ("GET", "/nodes/{node}/tasks"),
    ("GET", "/nodes/{node}/tasks/{upid}/status"),
    ("GET", "/nodes/{node}/tasks/{upid}/log"),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping"),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/file-write"),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/exec"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/exec-status"),
    (
        "GET",
        "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces",
    ),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/get-osinfo"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/get-host-name"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/info"),
    ("GET", "/nodes/{node}/qemu/{vmid}/status"),
    ("POST", "/nodes/{node}/qemu/{vmid}/migrate"),
    ("POST", "/nodes/{node}/qemu/{vmid}/template"),
    ("GET", "/cluster/status"),
    ("GET", "/nodes/{node}/status"),
    ("GET", "/nodes/{node}/storage"),
    ("GET", "/nodes/{node}/storage/{storage}/status"),
    ("GET", "/access/permissions"),
    ("GET", "/cluster/options"),
    // pve-network `API2/Network/SDN/Vnets.pm` (index); not in the official
    // schema file's subset, so validated against `api.json` alone.
    ("GET", "/cluster/sdn/vnets"),
];

const API_PREFIX: &str = "/api2/json";

pub fn router(shared: Arc<Shared>) -> Router {
    let limit = shared.cfg.effective_body_limit();
    Router::new()
        .fallback(handle)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(shared)
}

/// How errors are rendered (decided by the simulated pve-http-server version).
#[derive(Clone, Copy, Debug)]
pub struct ErrorStyle {
    /// Put the text in the body's `message` too, not only the reason phrase.
    pub json_message: bool,
}

/// Requests in flight on one connection and when the last one ended: what
/// pveproxy's keep-alive idle timeout is measured against.
struct ConnIdle {
    in_flight: AtomicUsize,
    last_done: parking_lot::Mutex<tokio::time::Instant>,
}

impl ConnIdle {
    fn new() -> ConnIdle {
        ConnIdle {
            in_flight: AtomicUsize::new(0),
            last_done: parking_lot::Mutex::new(tokio::time::Instant::now()),
        }
    }

    fn end(&self) {
        *self.last_done.lock() = tokio::time::Instant::now();
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// Resolves once no request has been in flight for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let due = *self.last_done.lock() + idle;
            if self.in_flight.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() >= due {
                return;
            }
            let next = due.max(tokio::time::Instant::now() + idle / 8);
            tokio::time::sleep_until(next.min(tokio::time::Instant::now() + idle)).await;
        }
    }
}

/// Accept TLS connections until the returned task is aborted; aborting it drops
/// the JoinSet, which aborts every open connection too. A connection idle for
/// `keepalive_idle` is closed, as pveproxy does.
pub async fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, app: Router) {
    serve_with(listener, tls, app, None, Arc::default()).await
}

/// [`serve`] with pveproxy's keep-alive idle timeout, counting accepted
/// connections in `connections`.
pub async fn serve_with(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    keepalive_idle: Option<Duration>,
    connections: Arc<AtomicU64>,
) {
    let acceptor = TlsAcceptor::from(tls);
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let (tcp, _peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        connections.fetch_add(1, Ordering::SeqCst);
        let acceptor = acceptor.clone();
        let idle = Arc::new(ConnIdle::new());
        let router = app.clone();
        let tracked = Arc::clone(&idle);
        let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let router = router.clone();
            let tracked = Arc::clone(&tracked);
            tracked.in_flight.fetch_add(1, Ordering::SeqCst);
            async move {
                let res = tower::ServiceExt::oneshot(router, req.map(Body::new)).await;
                tracked.end();
                res
            }
        });
        conns.spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(error = %e, "TLS handshake failed");
                    return;
                }
            };
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder = builder.http1_only();
            let conn = builder.serve_connection(TokioIo::new(tls), svc);
            tokio::pin!(conn);
            let ended = match keepalive_idle {
                Some(d) => tokio::select! {
                    r = conn.as_mut() => Some(r),
                    () = idle.idle_for(d) => None,
                },
                None => Some(conn.await),
            };
            match ended {
                Some(Err(e)) => tracing::debug!(error = %e, "connection ended with error"),
                Some(Ok(())) => {}
                None => tracing::debug!("closing an idle keep-alive connection"),
            }
        });
    }
}

/// Bind `addr`; helper so callers get the port before serving.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))
}

async fn handle(
    State(s): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response<Body> {
    let style = ErrorStyle {
        json_message: s.cfg.http_server_version.json_error_message(),
    };
    let close = s.cfg.close_after_error;
    let error_response = |e: &ApiError| {
        let mut r = error_response(e, style);
        if close {
            // pveproxy: no keep-alive after a response >= 400.
            r.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        r
    };
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            let status = e.status().as_u16();
            let msg = if status == 413 {
                format!(
                    "request too large (limit {} bytes)",
                    s.cfg.effective_body_limit()
                )
            } else {
                e.body_text()
            };
            return error_response(&ApiError::Status(status, msg));
        }
    };
    if !authorized(&s, &headers) {
        if !s.cfg.auth_failure_delay.is_zero() {
            tokio::time::sleep(s.cfg.auth_failure_delay).await;
        }
        let msg = if headers.contains_key(header::AUTHORIZATION) {
            "authentication failure"
        } else {
            "No ticket"
        };
        return error_response(&ApiError::Status(401, msg.into()));
    }
    let path = uri.path().to_string();
    let mut params = Params::default();
    if let Some(q) = uri.query() {
        params.extend_form(q.as_bytes(), s.cfg.form_semicolon_separator);
    }
    if !body.is_empty() {
        let is_json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/json"));
        if is_json {
            let parsed: Result<Value, _> = serde_json::from_slice(&body);
            match parsed
                .map_err(|e| e.to_string())
                .and_then(|v| params.extend_json(&v))
            {
                Ok(()) => {}
                Err(e) => {
                    return error_response(&ApiError::Status(
                        400,
                        format!("invalid JSON body: {e}"),
                    ))
                }
            }
        } else {
            params.extend_form(&body, s.cfg.form_semicolon_separator);
        }
    }
    if let Some(rest) = path.strip_prefix("/_sim/") {
        return match admin(&s, &method, rest, &body) {
            Ok(v) => ok_response(v),
            Err(e) => error_response(&e),
        };
    }
    let Some(api_path) = path.strip_prefix(API_PREFIX) else {
        return error_response(&ApiError::Status(404, "Not Found".into()));
    };
    let Some((template, path_params)) = route(method.as_str(), api_path) else {
        s.requests.lock().push(RecordedRequest {
            method: method.to_string(),
            path: path.clone(),
            endpoint: None,
            params,
            schema_errors: None,
        });
        return error_response(&ApiError::Status(
            501,
            format!("Method '{method} {api_path}' not implemented"),
        ));
    };
    let endpoint = format!("{method} {template}");
    for (k, v) in &path_params {
        params.0.insert(k.clone(), vec![v.clone()]);
    }
    let schema_errors = s.schema.validate(method.as_str(), template, &params).err();
    s.requests.lock().push(RecordedRequest {
        method: method.to_string(),
        path: path.clone(),
        endpoint: Some(endpoint.clone()),
        params: params.clone(),
        schema_errors: schema_errors.clone(),
    });
    let (latency, injected) = s.faults.on_call(&endpoint);
    if let Some(d) = latency {
        tokio::time::sleep(d).await;
    }
    if let Some((status, msg)) = injected {
        return error_response(&ApiError::Status(status, msg));
    }
    if let Some(node) = path_params
        .iter()
        .find(|(k, _)| k == "node")
        .map(|(_, v)| v.clone())
    {
        if let Err(e) = check_node(&s, &node) {
            return error_response(&e);
        }
    }
    if let Some(errs) = schema_errors {
        return error_response(&ApiError::Params(errs));
    }
    if let Err(e) = check_acl(&s, template, &params)
        .and_then(|()| check_privileges(&s, method.as_str(), template, &params))
    {
        return error_response(&e);
    }
    if let Some((status, msg, delay)) = s.faults.take_apply_late(&endpoint) {
        let (late, method, template) = (Arc::clone(&s), method.to_string(), template.to_string());
        let params = params.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = dispatch(&late, &method, &template, &params).await;
            late.faults.note_late_applied();
        });
        return error_response(&ApiError::Status(status, msg));
    }
    let res = dispatch(&s, method.as_str(), template, &params).await;
    if res.is_ok() {
        if let Some((status, msg)) = s.faults.take_fail_after(&endpoint) {
            return error_response(&ApiError::Status(status, msg));
        }
    }
    // Parameters may carry secrets (bootstrap content): log only the route.
    match &res {
        Ok(_) => tracing::debug!(%method, path = %path, "ok"),
        Err(e) => tracing::debug!(%method, path = %path, error = ?e, "error"),
    }
    match res {
        Ok(v) => ok_response(v),
        Err(e) => error_response(&e),
    }
}

fn authorized(s: &Shared, headers: &HeaderMap) -> bool {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(tok) = v.strip_prefix("PVEAPIToken=") else {
        return false;
    };
    // USER@REALM!TOKENID=SECRET; the id cannot contain '='.
    let Some((id, secret)) = tok.split_once('=') else {
        return false;
    };
    let (want_id, want_secret) = (s.cfg.token_id.as_bytes(), s.cfg.token_secret.as_bytes());
    constant_eq(id.as_bytes(), want_id) & constant_eq(secret.trim().as_bytes(), want_secret)
}

fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn check_node(s: &Shared, node: &str) -> ApiResult<()> {
    let c = s.cluster.lock();
    match c.nodes.get(node) {
        None => Err(ApiError::internal(format!(
            "hostname lookup '{node}' failed - failed to get address info for: {node}: Name or service not known"
        ))),
        Some(n) if !n.online => Err(ApiError::Status(595, "No route to host".into())),
        Some(_) => Ok(()),
    }
}

/// Under [`crate::SimConfig::pool_acl`], a VM path outside the token's pool is
/// a 403 whether or not the VM exists (PVE checks the privilege on
/// `/vms/{vmid}` before looking the VM up).
fn check_acl(s: &Shared, template: &str, p: &Params) -> ApiResult<()> {
    if !s.cfg.pool_acl || !template.starts_with("/nodes/{node}/qemu/{vmid}") {
        return Ok(());
    }
    let vmid = p.u64("vmid").unwrap_or(0) as u32;
    if s.visible(&s.cluster.lock(), vmid) {
        return Ok(());
    }
    Err(ApiError::Status(
        403,
        format!("Permission check failed (/vms/{vmid}, VM.Audit)"),
    ))
}

/// The privilege checks PVE makes on the VM calls a lifecycle client uses
/// (from the API schema's `permissions`; the guest agent's by release), on
/// `/vms/{vmid}` (which a pool's ACL covers for its members). Each entry is
/// a set of alternatives; every entry must hold.
fn required_privileges(
    s: &Shared,
    method: &str,
    template: &str,
    p: &Params,
) -> Vec<(String, Vec<&'static str>)> {
    let vmid = p.u64("vmid").unwrap_or(0);
    let vm = format!("/vms/{vmid}");
    let agent = |pve9: &'static [&'static str]| -> Vec<&'static str> {
        if s.cfg.pve9 {
            pve9.to_vec()
        } else {
            vec!["VM.Monitor"]
        }
    };
    let one = |path: &str, privs: Vec<&'static str>| vec![(path.to_string(), privs)];
    match (method, template) {
        ("POST", "/nodes/{node}/qemu/{vmid}/clone") => {
            let mut out = one(&vm, vec!["VM.Clone"]);
            let target = match p.get("pool") {
                Some(pool) => format!("/pool/{pool}"),
                None => format!("/vms/{}", p.u64("newid").unwrap_or(0)),
            };
            out.push((target, vec!["VM.Allocate"]));
            // PVE 8 and newer: the clone's NICs need SDN.Use on their
            // bridge, in the VNet's zone or `localnetwork`; on the VLAN
            // below it for a NIC with a tag, and on each VLAN of its trunks
            // (pve-guest-common `check_vnet_access`).
            for path in sdn_paths(s, vmid as u32) {
                out.push((path, vec!["SDN.Use"]));
            }
            // qemu-server `check_storage_access_clone`: the storage the
            // disks go to, `storage` when given, else the source's.
            let storage = p.get("storage").map(str::to_string).or_else(|| {
                let c = s.cluster.lock();
                c.vms.get(&(vmid as u32)).map(|v| v.storage.clone())
            });
            if let Some(st) = storage.filter(|st| !st.is_empty()) {
                out.push((format!("/storage/{st}"), vec!["Datastore.AllocateSpace"]));
            }
            // The host's CD-ROM drive is a device, not a volume: PVE asks
            // for Sys.Console on `/` (check_storage_access).
            let physical_cdrom = s
                .cluster
                .lock()
                .vms
                .get(&(vmid as u32))
                .is_some_and(|vm| vm.has_physical_cdrom());
            if physical_cdrom {
                out.push(("/".to_string(), vec!["Sys.Console"]));
            }
            out
        }
        ("GET", "/nodes/{node}/qemu/{vmid}/config")
        | ("GET", "/nodes/{node}/qemu/{vmid}/status/current") => one(&vm, vec!["VM.Audit"]),
        ("PUT" | "POST", "/nodes/{node}/qemu/{vmid}/config") => {
            let mut out = Vec::new();
            for (key, privilege) in [
                ("cores", "VM.Config.CPU"),
                ("memory", "VM.Config.Memory"),
                ("description", "VM.Config.Options"),
                ("tags", "VM.Config.Options"),
                ("protection", "VM.Config.Options"),
            ] {
                let deleted = p
                    .get("delete")
                    .is_some_and(|d| d.split([',', ';', ' ']).any(|k| k == key));
                if p.get(key).is_some() || deleted {
                    out.push((vm.clone(), vec![privilege]));
                }
            }
            out
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/status/start")
        | ("POST", "/nodes/{node}/qemu/{vmid}/status/stop")
        | ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown") => one(&vm, vec!["VM.PowerMgmt"]),
        ("DELETE", "/nodes/{node}/qemu/{vmid}") => one(&vm, vec!["VM.Allocate"]),
        ("POST", "/nodes/{node}/qemu/{vmid}/migrate") => {
            let mut out = one(&vm, vec!["VM.Migrate"]);
            // qemu-server migrate_vm: a `targetstorage` other than the
            // identity map `1` moves disks, so it needs VM.Config.Disk on
            // the VM and room on each target storage.
            if let Some(ts) = p.get("targetstorage").filter(|t| *t != "1") {
                out.push((vm.clone(), vec!["VM.Config.Disk"]));
                for entry in ts.split(',') {
                    let target = entry.rsplit(':').next().unwrap_or(entry).trim();
                    if !target.is_empty() && target != "1" {
                        out.push((
                            format!("/storage/{target}"),
                            vec!["Datastore.AllocateSpace"],
                        ));
                    }
                }
            }
            out
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/template") => one(&vm, vec!["VM.Allocate"]),
        ("GET", "/nodes/{node}/storage/{storage}/status") => one(
            &format!("/storage/{}", p.get("storage").unwrap_or_default()),
            vec!["Datastore.Audit", "Datastore.AllocateSpace"],
        ),
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping") => one(
            &vm,
            agent(&["VM.GuestAgent.Audit", "VM.GuestAgent.Unrestricted"]),
        ),
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/file-write") => one(
            &vm,
            agent(&["VM.GuestAgent.FileWrite", "VM.GuestAgent.Unrestricted"]),
        ),
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/exec")
        | ("GET", "/nodes/{node}/qemu/{vmid}/agent/exec-status") => {
            one(&vm, agent(&["VM.GuestAgent.Unrestricted"]))
        }
        _ => Vec::new(),
    }
}

/// The SDN paths the NICs of VM `vmid` are checked on (see the clone's
/// privileges in [`required_privileges`]): as pve-guest-common
/// `check_vnet_access`, `/sdn/zones/<zone>/<bridge>/<tag>` for the `tag`
/// and for each VLAN of `trunks` (`10;20-30`), and the bridge's own path
/// only for a NIC with neither.
fn sdn_paths(s: &Shared, vmid: u32) -> Vec<String> {
    let config = match s.cluster.lock().vms.get(&vmid) {
        Some(vm) => vm.config_json(),
        None => return Vec::new(),
    };
    let Some(keys) = config.as_object() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, value) in keys {
        let is_nic = key
            .strip_prefix("net")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        let Some(nic) = value.as_str().filter(|_| is_nic) else {
            continue;
        };
        let field = |name: &str| {
            nic.split(',')
                .find_map(|part| part.strip_prefix(name))
                .filter(|v| !v.is_empty())
        };
        let Some(bridge) = field("bridge=") else {
            continue;
        };
        let path = format!("/sdn/zones/{}/{bridge}", s.sdn_zone_of(bridge));
        let mut vlans: Vec<String> = field("tag=").map(str::to_string).into_iter().collect();
        vlans.extend(field("trunks=").map(trunk_vlans).unwrap_or_default());
        if vlans.is_empty() {
            out.push(path);
        } else {
            out.extend(vlans.iter().map(|vlan| format!("{path}/{vlan}")));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The VLANs of a NIC's `trunks` (`10;20-30`), as pve-guest-common's
/// `get_tags_from_trunk` expands them: a range whose end is not above its
/// start is its start alone.
fn trunk_vlans(trunks: &str) -> Vec<String> {
    let mut out = Vec::new();
    for trunk in trunks.split(';').filter(|t| !t.is_empty()) {
        let (start, end) = trunk.split_once('-').unwrap_or((trunk, ""));
        match (start.parse::<u32>(), end.parse::<u32>()) {
            (Ok(a), Ok(b)) if b > a => out.extend((a..=b).map(|v| v.to_string())),
            _ => out.push(start.to_string()),
        }
    }
    out
}

/// 403 `Permission check failed (PATH, PRIV)` for a privilege the token
/// lacks (see [`crate::SimConfig::dropped_privileges`]).
fn check_privileges(s: &Shared, method: &str, template: &str, p: &Params) -> ApiResult<()> {
    for (path, any_of) in required_privileges(s, method, template, p) {
        let held = s.effective_privileges(&path);
        if !any_of.iter().any(|want| held.iter().any(|h| h == want)) {
            return Err(ApiError::Status(
                403,
                format!("Permission check failed ({path}, {})", any_of.join("|")),
            ));
        }
    }
    Ok(())
}

/// Match an API path against [`ROUTES`]; returns the template and path params.
pub fn route(method: &str, path: &str) -> Option<(&'static str, Vec<(String, String)>)> {
    let segs: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(|s| percent_decode_str(s).decode_utf8_lossy().into_owned())
        .collect();
    'routes: for (m, t) in ROUTES {
        if *m != method {
            continue;
        }
        let tsegs: Vec<&str> = t.split('/').skip(1).collect();
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
        return Some((t, params));
    }
    None
}

async fn dispatch(s: &Arc<Shared>, method: &str, template: &str, p: &Params) -> ApiResult {
    let node = p.get("node").unwrap_or_default().to_string();
    let vmid = p.u64("vmid").unwrap_or(0) as u32;
    match (method, template) {
        ("GET", "/version") if s.cfg.pve9 => {
            Ok(json!({"version": "9.0.3", "release": "9.0", "repoid": "025864202ebb6109"}))
        }
        ("GET", "/version") => {
            Ok(json!({"version": "8.3.2", "release": "8.3", "repoid": "3e76eec21c4a14a7"}))
        }
        ("GET", "/nodes") => Ok(s.nodes()),
        ("GET", "/cluster/nextid") => s.nextid(p.u64("vmid").map(|v| v as u32)),
        ("GET", "/cluster/resources") => Ok(s.resources(p.get("type"))),
        ("GET", "/pools") => s.pools(p.get("poolid")),
        ("GET", "/pools/{poolid}") => s.pool(p.get("poolid").unwrap_or_default()),
        ("GET", "/nodes/{node}/qemu") => Ok(s.node_vms(&node)),
        ("POST", "/nodes/{node}/qemu/{vmid}/clone") => s.clone_vm(&node, vmid, p),
        ("GET", "/nodes/{node}/qemu/{vmid}/config") => s.config(&node, vmid),
        ("PUT", "/nodes/{node}/qemu/{vmid}/config") => s.update_config_sync(&node, vmid, p).await,
        ("POST", "/nodes/{node}/qemu/{vmid}/config") => s.update_config_async(&node, vmid, p),
        ("POST", "/nodes/{node}/qemu/{vmid}/status/start") => s.start(&node, vmid, p),
        ("POST", "/nodes/{node}/qemu/{vmid}/status/stop") => s.stop(&node, vmid, p, "qmstop"),
        ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown") => {
            s.stop(&node, vmid, p, "qmshutdown")
        }
        ("GET", "/nodes/{node}/qemu/{vmid}/status/current") => s.status_current(&node, vmid),
        ("DELETE", "/nodes/{node}/qemu/{vmid}") => s.destroy(&node, vmid, p),
        ("GET", "/nodes/{node}/tasks") => s.node_tasks(&node, p),
        ("GET", "/nodes/{node}/tasks/{upid}/status") => {
            let upid = p.get("upid").unwrap_or_default();
            check_upid(upid)?;
            s.task_status(&node, upid)
        }
        ("GET", "/nodes/{node}/tasks/{upid}/log") => {
            let upid = p.get("upid").unwrap_or_default();
            check_upid(upid)?;
            let start = p.u64("start").unwrap_or(0) as usize;
            let limit = p.u64("limit").unwrap_or(50) as usize;
            s.task_log(&node, upid, start, limit)
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping") => s.agent_ping(&node, vmid).await,
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/file-write") => {
            s.agent_file_write(&node, vmid, p).await
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/exec") => s.agent_exec(&node, vmid, p).await,
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/exec-status") => {
            s.agent_exec_status(&node, vmid, p.u64("pid").unwrap_or(0))
                .await
        }
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces") => {
            s.agent_network_interfaces(&node, vmid).await
        }
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/get-osinfo") => s.agent_osinfo(&node, vmid).await,
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/get-host-name") => {
            s.agent_host_name(&node, vmid).await
        }
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/info") => s.agent_info(&node, vmid).await,
        ("GET", "/nodes/{node}/qemu/{vmid}/status") => s.status_index(&node, vmid),
        ("POST", "/nodes/{node}/qemu/{vmid}/migrate") => s.migrate(&node, vmid, p),
        ("POST", "/nodes/{node}/qemu/{vmid}/template") => s.convert_to_template(&node, vmid, p),
        ("GET", "/cluster/status") => Ok(s.cluster_status()),
        ("GET", "/nodes/{node}/status") => Ok(s.node_status(&node)),
        ("GET", "/nodes/{node}/storage") => Ok(s.node_storages(&node, p)),
        ("GET", "/nodes/{node}/storage/{storage}/status") => {
            s.storage_status(&node, p.get("storage").unwrap_or_default())
        }
        ("GET", "/access/permissions") => Ok(s.permissions(p.get("path"))),
        ("GET", "/cluster/options") => Ok(s.cluster_options()),
        ("GET", "/cluster/sdn/vnets") => s.sdn_vnets(),
        _ => Err(ApiError::Status(
            501,
            format!("Method '{method} {template}' not implemented"),
        )),
    }
}

fn check_upid(upid: &str) -> ApiResult<()> {
    crate::tasks::upid_node(upid)
        .map(|_| ())
        .ok_or_else(|| ApiError::internal(format!("unable to parse worker upid '{upid}'")))
}

fn ok_response(data: Value) -> Response<Body> {
    json_response(StatusCode::OK, &json!({ "data": data }))
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Body::from(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json;charset=UTF-8"),
    );
    r
}

/// PVE error: message in the reason phrase and (pve-http-server 5.2 and
/// later) in the body's `message`.
pub fn error_response(e: &ApiError, style: ErrorStyle) -> Response<Body> {
    let (code, msg, errors) = match e {
        ApiError::Status(c, m) => (*c, m.clone(), None),
        ApiError::Params(errs) => (
            400,
            "Parameter verification failed.".to_string(),
            Some(errs),
        ),
    };
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body = json!({ "data": null });
    if style.json_message {
        body["message"] = json!(format!("{msg}\n"));
    }
    if let Some(errs) = errors {
        body["errors"] = json!(errs);
    }
    let mut r = json_response(status, &body);
    if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(reason_phrase(&msg)) {
        r.extensions_mut().insert(reason);
    }
    r
}

/// Reason phrases allow only visible ASCII, space and tab on one line.
fn reason_phrase(msg: &str) -> String {
    let one_line: String = msg
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                ' '
            }
        })
        .collect();
    one_line.chars().take(512).collect()
}

// ---- admin endpoint (/_sim/...) for the binary and out-of-process tests ----
//
// Same token auth as the API; JSON bodies; `{"data": ...}` replies.
//   POST   /_sim/faults            {"endpoint","count"(=1),"status","message"}
//   POST   /_sim/faults-after-apply {"endpoint","count","status","message"}: run, then fail
//   POST   /_sim/task-faults       {"kind","count","message"}: fail the next workers
//   DELETE /_sim/faults            clear faults and latencies
//   POST   /_sim/latency           {"endpoint","ms"}
//   POST   /_sim/drop-exec-status  {"count"}
//   GET    /_sim/counters | DELETE /_sim/counters
//   GET    /_sim/requests | DELETE /_sim/requests
//   POST   /_sim/nodes/{node}/offline | /online
//   POST   /_sim/vms/{vmid}/stop | /start      (out of band)
//   POST   /_sim/vms/{vmid}/lock  {"lock": "clone"|null}
//   POST   /_sim/vms/{vmid}/ha    {"state": "started"|"stopped"|null}
//   POST   /_sim/guest-commands   {"match","exitcode","stdout","stderr","delay_ms"}
//   DELETE /_sim/guest-commands

#[derive(Deserialize)]
struct FailReq {
    endpoint: String,
    #[serde(default = "one")]
    count: u32,
    status: u16,
    message: String,
}

#[derive(Deserialize)]
struct LatencyReq {
    endpoint: String,
    ms: u64,
}

#[derive(Deserialize)]
struct CountReq {
    count: u32,
}

#[derive(Deserialize)]
struct LockReq {
    lock: Option<String>,
}

#[derive(Deserialize)]
struct HaReq {
    state: Option<String>,
}

fn admin_vmid(v: &str) -> ApiResult<u32> {
    v.parse()
        .map_err(|_| ApiError::Status(400, format!("bad vmid '{v}'")))
}

fn found(ok: bool, vmid: u32) -> ApiResult {
    if ok {
        Ok(Value::Null)
    } else {
        Err(ApiError::Status(404, format!("no such VM {vmid}")))
    }
}

#[derive(Deserialize)]
struct GuestCmdReq {
    /// Substring of the space-joined argv that selects the command.
    #[serde(rename = "match")]
    pattern: String,
    #[serde(default)]
    exitcode: i32,
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stderr: String,
    #[serde(default)]
    delay_ms: u64,
}

fn one() -> u32 {
    1
}

fn admin_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::Status(400, format!("bad admin request: {e}")))
}

fn admin(s: &Arc<Shared>, method: &Method, rest: &str, body: &[u8]) -> ApiResult {
    let parts: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    match (method.as_str(), parts.as_slice()) {
        ("POST", ["faults"]) => {
            let r: FailReq = admin_json(body)?;
            s.faults
                .fail_next(&r.endpoint, r.count, r.status, &r.message);
            Ok(Value::Null)
        }
        ("POST", ["faults-after-apply"]) => {
            let r: FailReq = admin_json(body)?;
            s.faults
                .fail_after_apply(&r.endpoint, r.count, r.status, &r.message);
            Ok(Value::Null)
        }
        ("POST", ["task-faults"]) => {
            let r: crate::faults::TaskFailRule = admin_json(body)?;
            s.faults.fail_next_task(&r.kind, r.count, &r.message);
            Ok(Value::Null)
        }
        ("DELETE", ["faults"]) => {
            s.faults.clear();
            Ok(Value::Null)
        }
        ("POST", ["latency"]) => {
            let r: LatencyReq = admin_json(body)?;
            s.faults
                .set_latency(&r.endpoint, Duration::from_millis(r.ms));
            Ok(Value::Null)
        }
        ("POST", ["drop-exec-status"]) => {
            let r: CountReq = admin_json(body)?;
            s.faults.drop_exec_status_replies(r.count);
            Ok(Value::Null)
        }
        ("GET", ["counters"]) => Ok(json!(s.faults.counts())),
        ("DELETE", ["counters"]) => {
            s.faults.reset_counts();
            Ok(Value::Null)
        }
        ("GET", ["requests"]) => Ok(json!(*s.requests.lock())),
        ("DELETE", ["requests"]) => {
            s.requests.lock().clear();
            Ok(Value::Null)
        }
        ("POST", ["nodes", node, state @ ("offline" | "online")]) => {
            if s.set_node_online(node, *state == "online") {
                Ok(Value::Null)
            } else {
                Err(ApiError::Status(404, format!("no such node '{node}'")))
            }
        }
        ("POST", ["vms", vmid, action @ ("stop" | "start")]) => {
            let vmid: u32 = vmid
                .parse()
                .map_err(|_| ApiError::Status(400, format!("bad vmid '{vmid}'")))?;
            if s.set_running_out_of_band(vmid, *action == "start") {
                Ok(Value::Null)
            } else {
                Err(ApiError::Status(404, format!("no such VM {vmid}")))
            }
        }
        ("POST", ["vms", vmid, "lock"]) => {
            let vmid = admin_vmid(vmid)?;
            let r: LockReq = admin_json(body)?;
            found(s.update_vm(vmid, |vm| vm.lock = r.lock), vmid)
        }
        ("POST", ["vms", vmid, "ha"]) => {
            let vmid = admin_vmid(vmid)?;
            let r: HaReq = admin_json(body)?;
            found(s.update_vm(vmid, |vm| vm.ha = r.state), vmid)
        }
        ("POST", ["guest-commands"]) => {
            let r: GuestCmdReq = admin_json(body)?;
            let out = GuestOutput::exit(r.exitcode)
                .with_stdout(r.stdout)
                .with_stderr(r.stderr)
                .with_delay(Duration::from_millis(r.delay_ms));
            let pattern = r.pattern;
            s.guest.add(Arc::new(move |e| {
                e.command_line().contains(&pattern).then(|| out.clone())
            }));
            Ok(Value::Null)
        }
        ("DELETE", ["guest-commands"]) => {
            s.guest.clear();
            Ok(Value::Null)
        }
        _ => Err(ApiError::Status(
            404,
            format!("no admin route {method} /_sim/{rest}"),
        )),
    }
}
