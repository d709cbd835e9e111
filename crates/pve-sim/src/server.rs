//! HTTPS front end: auth, parameter parsing, schema validation, fault
//! injection and PVE's response envelopes around the route table, plus the
//! `/_sim/` admin endpoint.
//!
//! The request path (auth, decoding, matching, validation, faults, checks,
//! envelope) is one pipeline and stays in one place, so the order of its
//! steps, which decides which error a client sees, reads top to bottom.
//! What each endpoint is (method, template, privileges, handler) lives in
//! `routes`, the privilege rules in `privileges`.

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
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use crate::agent::GuestOutput;
use crate::params::Params;
use crate::privileges::check_acl;
use crate::routes;
use crate::sim::{RecordedRequest, Shared};
use crate::state::{ApiError, ApiResult};

pub use crate::routes::ROUTES;

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
    let Some((route, path_params)) = routes::find(method.as_str(), api_path) else {
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
    let template = route.template;
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
    let node = path_params
        .iter()
        .find(|(k, _)| k == "node")
        .map(|(_, v)| v.clone());
    if let Some(node) = &node {
        if let Err(e) = check_node(&s, node) {
            if e == offline_node() && !s.cfg.offline_delay.is_zero() {
                // pveproxy's connect to a powered-off host waits out ARP.
                tokio::time::sleep(s.cfg.offline_delay).await;
            }
            return error_response(&e);
        }
    }
    if let Some(errs) = schema_errors {
        return error_response(&ApiError::Params(errs));
    }
    if let Err(e) =
        check_acl(&s, template, &params).and_then(|()| route.privileges.check(&s, &params))
    {
        return error_response(&e);
    }
    if let Some((status, msg, delay)) = s.faults.take_apply_late(&endpoint) {
        let late = Arc::clone(&s);
        let params = params.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = route.answer(&late, &params).await;
            late.faults.note_late_applied();
        });
        return error_response(&ApiError::Status(status, msg));
    }
    let worker = match &node {
        Some(node) if protected(method.as_str(), template) => s.daemon_worker(node).await,
        _ => None,
    };
    let res = route.answer(&s, &params).await;
    drop(worker);
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

/// Whether PVE runs the call in pvedaemon (`protected => 1`): every POST,
/// PUT and DELETE the simulator serves, each guest-agent call and a VM's
/// current status (qemu pid files are root's); other reads run in
/// pveproxy.
fn protected(method: &str, template: &str) -> bool {
    method != "GET" || template.contains("/agent/") || template.ends_with("/status/current")
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
        Some(n) if !n.online => Err(offline_node()),
        Some(_) => Ok(()),
    }
}

/// pveproxy's answer for a call it could not forward to a node.
fn offline_node() -> ApiError {
    ApiError::Status(595, "No route to host".into())
}

/// Match an API path against [`ROUTES`]; returns the template and path params.
pub fn route(method: &str, path: &str) -> Option<(&'static str, Vec<(String, String)>)> {
    routes::find(method, path).map(|(r, params)| (r.template, params))
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
//   POST   /_sim/nodes/{node}/offline | /online   (powered off: calls hang
//          --offline-delay then 595, its tasks die, its samples expire)
//   POST   /_sim/storages/{node}/{storage}/hung | /busy | /ok
//          (a mount that hangs; volumes that cannot be freed; both cleared)
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
        ("POST", ["storages", node, storage, state @ ("hung" | "busy" | "ok")]) => {
            s.set_storage_hung(node, storage, *state == "hung");
            s.set_storage_busy(node, storage, *state == "busy");
            Ok(Value::Null)
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
