//! The HTTP client: configuration, request execution with retries, response
//! decoding, and one typed method per endpoint the provider uses.
//!
//! One file past 600 lines on purpose: every endpoint method goes through
//! the same request, retry and decode path, and reads best beside it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::Rng;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{chain_message, find_rustls_error, is_lock_timeout_text, PveError};
use crate::form::{encode_segment, Params};
use crate::tags::join_tags;
use crate::types::{
    exit_ok, lenient, CloneParams, ClusterOptions, ClusterVm, ConfigParams, ExecStatus,
    FileEncoding, MigrateParams, NodeInfo, Permissions, PoolMember, StorageStatus, TaskLogLine,
    TaskState, TaskStatus, VmConfig, VmStatus,
};
use crate::upid::Upid;

/// Responses larger than this are refused (exec output is at most 16 MiB per stream).
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// Default idle lifetime of a pooled connection (see [`PveConfig::pool_idle_timeout`]).
pub const DEFAULT_POOL_IDLE: Duration = Duration::from_secs(3);
/// Upper bound on the idle lifetime: pveproxy closes idle connections after ~5 s.
pub const MAX_POOL_IDLE: Duration = Duration::from_millis(4500);
/// `agent/file-write` `content` limit.
pub const MAX_FILE_WRITE_CONTENT: usize = 61440;
/// `agent/exec` `input-data` limit.
pub const MAX_EXEC_INPUT: usize = 65536;

/// Retry policy. Only safe cases are ever retried:
/// * any call failing with a lock timeout (nothing was applied);
/// * any call whose connection could not be established (nothing was sent);
/// * any call answered 595 (pveproxy could not connect to the node);
/// * GETs on transport errors, request timeouts, 502-504 and 596/597.
///
/// A POST/PUT/DELETE that may have reached the server is never retried.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Total attempts including the first; `1` disables retries.
    pub max_attempts: u32,
    /// Backoff before the first retry; doubles per retry up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
        }
    }
}

impl RetryPolicy {
    /// No retries.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Jittered exponential backoff before retry number `retry` (1-based):
    /// uniformly in `[d/2, d]` with `d = min(max, initial * 2^(retry-1))`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(30);
        let d = self
            .initial_backoff
            .saturating_mul(1u32 << exp)
            .min(self.max_backoff);
        let half = d / 2;
        let jitter_ns = u64::try_from((d - half).as_nanos()).unwrap_or(u64::MAX);
        let extra = if jitter_ns == 0 {
            0
        } else {
            rand::rng().random_range(0..=jitter_ns)
        };
        half + Duration::from_nanos(extra)
    }
}

/// What the observer learns about each API call (after all retries).
#[derive(Debug)]
pub struct ApiCall<'a> {
    /// Stable operation name, e.g. `clone`, `task_status`, `agent_exec`.
    pub op: &'static str,
    pub method: &'a Method,
    pub result: Result<(), &'a PveError>,
    /// Wall time including retries and backoff.
    pub duration: Duration,
    /// HTTP attempts made (1 = no retry).
    pub attempts: u32,
}

/// Hook called after every API call; the provider's metrics plug in here.
pub trait ApiObserver: Send + Sync {
    fn observe(&self, call: &ApiCall<'_>);
}

impl<F> ApiObserver for F
where
    F: Fn(&ApiCall<'_>) + Send + Sync,
{
    fn observe(&self, call: &ApiCall<'_>) {
        self(call)
    }
}

/// Client configuration. `Debug` never shows the token secret.
#[derive(Clone)]
pub struct PveConfig {
    /// e.g. `https://pve1:8006/api2/json`. Must be `https`.
    pub api_url: String,
    /// `USER@REALM!TOKENID`.
    pub token_id: String,
    pub token_secret: String,
    /// PEM CA bundle the API certificate must chain to (hostname checked).
    pub ca_pem: Option<Vec<u8>>,
    /// Accepted SHA-256 leaf fingerprints (see [`crate::parse_fingerprints`]).
    pub fingerprints: Vec<[u8; 32]>,
    /// Bound on each HTTP attempt (send + full response).
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// How long an idle pooled connection is kept. pveproxy closes idle
    /// keep-alive connections after about 5 s; reusing one it is closing makes
    /// a POST ambiguous, so this stays well under that.
    pub pool_idle_timeout: Duration,
    pub retry: RetryPolicy,
    pub observer: Option<Arc<dyn ApiObserver>>,
}

impl PveConfig {
    /// A config with default timeouts/retries and no trust material yet
    /// (set `ca_pem` and/or `fingerprints` before building the client).
    pub fn new(
        api_url: impl Into<String>,
        token_id: impl Into<String>,
        token_secret: impl Into<String>,
    ) -> Self {
        Self {
            api_url: api_url.into(),
            token_id: token_id.into(),
            token_secret: token_secret.into(),
            ca_pem: None,
            fingerprints: Vec::new(),
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            pool_idle_timeout: DEFAULT_POOL_IDLE,
            retry: RetryPolicy::default(),
            observer: None,
        }
    }
}

impl fmt::Debug for PveConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PveConfig")
            .field("api_url", &self.api_url)
            .field("token_id", &self.token_id)
            .field("token_secret", &"<redacted>")
            .field(
                "ca_pem",
                &self.ca_pem.as_ref().map(|c| format!("{} bytes", c.len())),
            )
            .field(
                "fingerprints",
                &self
                    .fingerprints
                    .iter()
                    .map(crate::tls::format_fingerprint)
                    .collect::<Vec<_>>(),
            )
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_idle_timeout", &self.pool_idle_timeout)
            .field("retry", &self.retry)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

struct Inner {
    http: HttpClient,
    /// Base URL without trailing slash.
    base: String,
    token_id: String,
    auth: HeaderValue,
    request_timeout: Duration,
    retry: RetryPolicy,
    observer: Option<Arc<dyn ApiObserver>>,
}

/// Async PVE API client. Cheap to clone (shared connection pool).
#[derive(Clone)]
pub struct PveClient {
    inner: Arc<Inner>,
}

impl fmt::Debug for PveClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PveClient")
            .field("base", &self.inner.base)
            .field("token_id", &self.inner.token_id)
            .field("token_secret", &"<redacted>")
            .finish()
    }
}

#[derive(Deserialize)]
struct LenientU32(#[serde(deserialize_with = "lenient::u32")] u32);

#[derive(Deserialize)]
struct ExecPid {
    #[serde(deserialize_with = "lenient::u32")]
    pid: u32,
}

#[derive(Deserialize)]
struct PoolEntry {
    #[serde(default)]
    poolid: String,
    #[serde(default)]
    members: Vec<PoolMember>,
}

#[derive(Deserialize)]
struct PoolRead {
    #[serde(default)]
    members: Vec<PoolMember>,
}

fn is_get(m: &Method) -> bool {
    *m == Method::GET
}

/// Whether a failed attempt may be repeated without risking a double apply.
fn retryable(method: &Method, e: &PveError) -> bool {
    match e {
        PveError::Api {
            status, message, ..
        } => {
            is_lock_timeout_text(message)
                // 595: pveproxy could not connect to the node, nothing was sent.
                || *status == 595
                || (is_get(method) && matches!(status, 502..=504 | 596 | 597))
        }
        PveError::Transport { connect: true, .. } => true,
        PveError::Transport { .. } | PveError::Timeout { .. } => is_get(method),
        _ => false,
    }
}

impl PveClient {
    /// Validates the config and builds the client. Fails on a non-https URL, a
    /// malformed token, or missing/invalid TLS trust material.
    pub fn new(cfg: PveConfig) -> Result<PveClient, PveError> {
        let base = cfg.api_url.trim().trim_end_matches('/').to_string();
        let uri: Uri = base
            .parse()
            .map_err(|e| PveError::Config(format!("API URL {base:?} is not a valid URL: {e}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(PveError::Config(format!(
                "API URL {base:?} must use https (TLS is always verified)"
            )));
        }
        if uri.host().is_none_or(|h| h.is_empty()) {
            return Err(PveError::Config(format!("API URL {base:?} has no host")));
        }
        if uri.query().is_some() {
            return Err(PveError::Config(format!(
                "API URL {base:?} must not carry a query string"
            )));
        }
        let token_id = cfg.token_id.trim().to_string();
        let (user, tokname) = token_id.split_once('!').unwrap_or(("", ""));
        if !user.contains('@') || tokname.is_empty() {
            return Err(PveError::Config(format!(
                "token id {token_id:?} must look like USER@REALM!TOKENID"
            )));
        }
        let secret = cfg.token_secret.trim();
        if secret.is_empty() {
            return Err(PveError::Config("token secret is empty".into()));
        }
        // The error deliberately does not echo the value: it contains the secret.
        let mut auth =
            HeaderValue::from_str(&format!("PVEAPIToken={token_id}={secret}")).map_err(|_| {
                PveError::Config(
                    "token id or secret contains characters not allowed in an HTTP header".into(),
                )
            })?;
        auth.set_sensitive(true);

        let tls = crate::tls::client_config(cfg.ca_pem.as_deref(), &cfg.fingerprints)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(cfg.connect_timeout));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(cfg.pool_idle_timeout.min(MAX_POOL_IDLE))
            .build(connector);

        Ok(PveClient {
            inner: Arc::new(Inner {
                http: client,
                base,
                token_id,
                auth,
                request_timeout: cfg.request_timeout,
                retry: cfg.retry,
                observer: cfg.observer,
            }),
        })
    }

    /// The base URL calls are made against.
    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// Runs one API call with the retry policy and reports it to the observer.
    async fn call<T: DeserializeOwned>(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        params: &Params,
    ) -> Result<T, PveError> {
        let start = Instant::now();
        let mut attempts = 0u32;
        let result = loop {
            attempts += 1;
            match self.attempt::<T>(op, &method, path, params).await {
                Ok(v) => break Ok(v),
                Err(e) if attempts < self.inner.retry.max_attempts && retryable(&method, &e) => {
                    let wait = self.inner.retry.backoff(attempts);
                    tracing::debug!(op, %method, attempt = attempts, backoff_ms = wait.as_millis() as u64, error = %e, "retrying PVE call");
                    tokio::time::sleep(wait).await;
                }
                Err(e) => break Err(e),
            }
        };
        let duration = start.elapsed();
        match &result {
            Ok(_) => {
                tracing::debug!(op, %method, path, attempts, dur_ms = duration.as_millis() as u64, "PVE call ok")
            }
            Err(e) => {
                tracing::debug!(op, %method, path, attempts, dur_ms = duration.as_millis() as u64, error = %e, "PVE call failed")
            }
        }
        if let Some(obs) = &self.inner.observer {
            obs.observe(&ApiCall {
                op,
                method: &method,
                result: result.as_ref().map(|_| ()),
                duration,
                attempts,
            });
        }
        result
    }

    async fn attempt<T: DeserializeOwned>(
        &self,
        op: &'static str,
        method: &Method,
        path: &str,
        params: &Params,
    ) -> Result<T, PveError> {
        let has_body = *method == Method::POST || *method == Method::PUT;
        let mut url = format!("{}{}", self.inner.base, path);
        if !has_body && !params.is_empty() {
            url.push('?');
            url.push_str(&params.encode());
        }
        let mut req = Request::builder()
            .method(method.clone())
            .uri(&url)
            .header(AUTHORIZATION, self.inner.auth.clone())
            .header(ACCEPT, "application/json");
        let body = if has_body {
            req = req.header(CONTENT_TYPE, "application/x-www-form-urlencoded");
            Bytes::from(params.encode())
        } else {
            Bytes::new()
        };
        let req = req.body(Full::new(body)).map_err(|e| {
            PveError::InvalidArgument(format!("cannot build request for {op} ({path}): {e}"))
        })?;

        let timeout = self.inner.request_timeout;
        let exchange = async {
            let resp = self
                .inner
                .http
                .request(req)
                .await
                .map_err(|e| transport_error(op, &e, e.is_connect()))?;
            let (parts, body) = resp.into_parts();
            let bytes = Limited::new(body, MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| PveError::Transport {
                    op,
                    message: format!("reading response body: {e}"),
                    connect: false,
                })?
                .to_bytes();
            Ok::<_, PveError>((parts, bytes))
        };
        let (parts, bytes) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| PveError::Timeout { op, timeout })??;

        if parts.status.is_success() {
            decode_data(op, &bytes)
        } else {
            Err(api_error(parts.status, &parts.extensions, &bytes))
        }
    }

    fn vm_path(node: &str, vmid: u32, rest: &str) -> String {
        format!("/nodes/{}/qemu/{vmid}{rest}", encode_segment(node))
    }

    async fn call_upid(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        params: &Params,
    ) -> Result<Upid, PveError> {
        let raw: String = self.call(op, method, path, params).await?;
        Upid::parse(raw.trim()).map_err(|e| PveError::Decode {
            op,
            message: e.to_string(),
        })
    }

    /// `GET /cluster/nextid[?vmid=N]`: the first free VMID, or `vmid` itself if free
    /// (else 400 "VM N already exists"). Reserves nothing.
    pub async fn next_id(&self, vmid: Option<u32>) -> Result<u32, PveError> {
        let mut p = Params::new();
        p.push_opt("vmid", vmid.map(|v| v.to_string()));
        let LenientU32(id) = self
            .call("nextid", Method::GET, "/cluster/nextid", &p)
            .await?;
        Ok(id)
    }

    /// `POST /nodes/{node}/qemu/{template}/clone` (to the template's own node).
    /// Returns the `qmclone` task.
    pub async fn clone_vm(
        &self,
        node: &str,
        template_vmid: u32,
        params: &CloneParams,
    ) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push("newid", params.newid.to_string());
        p.push_opt("name", params.name.as_deref());
        p.push_opt("description", params.description.as_deref());
        p.push_opt("pool", params.pool.as_deref());
        if let Some(full) = params.full {
            p.push_bool("full", full);
        }
        p.push_opt("storage", params.storage.as_deref());
        p.push_opt("target", params.target.as_deref());
        let path = Self::vm_path(node, template_vmid, "/clone");
        self.call_upid("clone", Method::POST, &path, &p).await
    }

    fn config_params(params: &ConfigParams) -> Result<Params, PveError> {
        let mut p = Params::new();
        p.push_opt("cores", params.cores.map(|v| v.to_string()));
        p.push_opt("memory", params.memory.map(|v| v.to_string()));
        p.push_opt("description", params.description.as_deref());
        p.push_opt("tags", params.tags.as_ref().map(|t| join_tags(t)));
        p.push_opt("digest", params.digest.as_deref());
        if p.is_empty() {
            return Err(PveError::InvalidArgument(
                "config update has no fields set".into(),
            ));
        }
        Ok(p)
    }

    /// `PUT /nodes/{node}/qemu/{vmid}/config`: applies synchronously.
    pub async fn set_config_sync(
        &self,
        node: &str,
        vmid: u32,
        params: &ConfigParams,
    ) -> Result<(), PveError> {
        let p = Self::config_params(params)?;
        let _: Value = self
            .call(
                "config_put",
                Method::PUT,
                &Self::vm_path(node, vmid, "/config"),
                &p,
            )
            .await?;
        Ok(())
    }

    /// `POST /nodes/{node}/qemu/{vmid}/config`: applies in a worker task.
    pub async fn set_config_async(
        &self,
        node: &str,
        vmid: u32,
        params: &ConfigParams,
    ) -> Result<Upid, PveError> {
        let p = Self::config_params(params)?;
        self.call_upid(
            "config_post",
            Method::POST,
            &Self::vm_path(node, vmid, "/config"),
            &p,
        )
        .await
    }

    /// `GET /nodes/{node}/qemu/{vmid}/config`.
    pub async fn get_config(&self, node: &str, vmid: u32) -> Result<VmConfig, PveError> {
        self.call(
            "config_get",
            Method::GET,
            &Self::vm_path(node, vmid, "/config"),
            &Params::new(),
        )
        .await
    }

    /// `POST .../status/start` (for HA-managed VMs an `hastart` that only queues).
    pub async fn start(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let path = Self::vm_path(node, vmid, "/status/start");
        self.call_upid("start", Method::POST, &path, &Params::new())
            .await
    }

    /// `POST .../status/stop` (hard stop; `hastop` for HA-managed VMs).
    pub async fn stop(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let path = Self::vm_path(node, vmid, "/status/stop");
        self.call_upid("stop", Method::POST, &path, &Params::new())
            .await
    }

    /// `GET .../status/current`.
    pub async fn status_current(&self, node: &str, vmid: u32) -> Result<VmStatus, PveError> {
        let path = Self::vm_path(node, vmid, "/status/current");
        self.call("status_current", Method::GET, &path, &Params::new())
            .await
    }

    /// `DELETE /nodes/{node}/qemu/{vmid}?purge=1&destroy-unreferenced-disks=1`.
    pub async fn destroy(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push_bool("purge", true);
        p.push_bool("destroy-unreferenced-disks", true);
        self.call_upid(
            "destroy",
            Method::DELETE,
            &Self::vm_path(node, vmid, ""),
            &p,
        )
        .await
    }

    /// `POST .../migrate`: moves the VM to `params.target` (offline unless
    /// `online`). Returns the `qmigrate` task (`hamigrate` for HA-managed VMs).
    pub async fn migrate(
        &self,
        node: &str,
        vmid: u32,
        params: &MigrateParams,
    ) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push("target", params.target.as_str());
        p.push_bool("online", params.online);
        if params.with_local_disks {
            p.push_bool("with-local-disks", true);
        }
        p.push_opt("targetstorage", params.targetstorage.as_deref());
        let path = Self::vm_path(node, vmid, "/migrate");
        self.call_upid("migrate", Method::POST, &path, &p).await
    }

    /// `POST .../template`: converts a stopped VM into a template (its disks
    /// become base volumes). Returns the `qmtemplate` task.
    pub async fn convert_to_template(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let path = Self::vm_path(node, vmid, "/template");
        self.call_upid("template", Method::POST, &path, &Params::new())
            .await
    }

    /// `GET /nodes/{node}/storage`: every storage the node sees, with type,
    /// shared flag and capacity.
    pub async fn node_storages(&self, node: &str) -> Result<Vec<StorageStatus>, PveError> {
        let path = format!("/nodes/{}/storage", encode_segment(node));
        self.call("node_storages", Method::GET, &path, &Params::new())
            .await
    }

    /// `GET /nodes/{node}/storage/{storage}/status`.
    pub async fn storage_status(
        &self,
        node: &str,
        storage: &str,
    ) -> Result<StorageStatus, PveError> {
        let path = format!(
            "/nodes/{}/storage/{}/status",
            encode_segment(node),
            encode_segment(storage)
        );
        let mut st: StorageStatus = self
            .call("storage_status", Method::GET, &path, &Params::new())
            .await?;
        st.storage.get_or_insert_with(|| storage.to_string());
        Ok(st)
    }

    fn task_path(upid: &Upid, rest: &str) -> String {
        format!(
            "/nodes/{}/tasks/{}{rest}",
            encode_segment(&upid.node),
            encode_segment(upid.as_str())
        )
    }

    /// `GET /nodes/{upid.node}/tasks/{upid}/status` (asks the node that runs the task).
    pub async fn task_status(&self, upid: &Upid) -> Result<TaskStatus, PveError> {
        self.call(
            "task_status",
            Method::GET,
            &Self::task_path(upid, "/status"),
            &Params::new(),
        )
        .await
    }

    /// `GET /nodes/{upid.node}/tasks/{upid}/log?start=S&limit=L`.
    pub async fn task_log(
        &self,
        upid: &Upid,
        start: u64,
        limit: u64,
    ) -> Result<Vec<TaskLogLine>, PveError> {
        let mut p = Params::new();
        p.push("start", start.to_string());
        p.push("limit", limit.to_string());
        self.call("task_log", Method::GET, &Self::task_path(upid, "/log"), &p)
            .await
    }

    /// Polls the task every `poll` until it stops or `deadline` passes. `OK` and
    /// `WARNINGS: N` succeed; any other exit status is [`PveError::TaskFailed`].
    /// Transient poll failures (unreachable node, transport, timeout) are polled
    /// through until the deadline; other errors end the wait. A poll in flight at
    /// the deadline is allowed to finish.
    pub async fn wait_task(
        &self,
        upid: &Upid,
        deadline: tokio::time::Instant,
        poll: Duration,
    ) -> Result<TaskStatus, PveError> {
        let poll = poll.max(Duration::from_millis(10));
        loop {
            let last_error = match self.task_status(upid).await {
                Ok(st) if st.status == TaskState::Stopped => {
                    let es = st.exitstatus.clone().unwrap_or_default();
                    if exit_ok(&es) {
                        return Ok(st);
                    }
                    return Err(PveError::TaskFailed {
                        upid: upid.to_string(),
                        exitstatus: if es.is_empty() {
                            "stopped without an exit status".into()
                        } else {
                            es
                        },
                    });
                }
                Ok(_) => None,
                Err(e) if e.is_node_unreachable() || e.is_transport() || e.is_timeout() => {
                    Some(e.to_string())
                }
                Err(e) => return Err(e),
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(PveError::TaskDeadline {
                    upid: upid.to_string(),
                    last_error,
                });
            }
            tokio::time::sleep_until((now + poll).min(deadline)).await;
        }
    }

    /// `GET /cluster/resources?type=vm`, QEMU VMs only (containers are dropped).
    /// Rows of VMs too new to have an RRD sample are completed with
    /// `status/current` (see the body). Statuses of older VMs may still be up to
    /// one sample interval (~10 s) old.
    pub async fn cluster_resources_vms(&self) -> Result<Vec<ClusterVm>, PveError> {
        let mut p = Params::new();
        p.push("type", "vm");
        let all: Vec<ClusterVm> = self
            .call("cluster_resources", Method::GET, "/cluster/resources", &p)
            .await?;
        let mut vms: Vec<ClusterVm> = all
            .into_iter()
            .filter(|v| v.kind == "qemu" || (v.kind.is_empty() && v.id.starts_with("qemu/")))
            .collect();
        // `name`, `status` and `template` come from pvestatd's RRD samples: a VM
        // created in the last ~10 s has none yet. Complete those rows from the
        // owning node, which knows; only brand-new VMs cost a call. A row whose
        // node cannot answer (offline, VM gone meanwhile) stays as listed.
        for v in vms.iter_mut().filter(|v| v.status.is_empty()) {
            match self.status_current(&v.node, v.vmid).await {
                Ok(st) => {
                    v.status = st.status;
                    v.template = st.template;
                    if v.name.is_none() {
                        v.name = st.name;
                    }
                }
                Err(e) => {
                    tracing::debug!(vmid = v.vmid, node = %v.node, error = %e, "could not complete an unsampled /cluster/resources row");
                }
            }
        }
        Ok(vms)
    }

    /// The token id this client authenticates as (`USER@REALM!TOKENID`).
    pub fn token_id(&self) -> &str {
        &self.inner.token_id
    }

    /// `GET /version`: the release, e.g. `8.3` (`release` is missing on
    /// very old servers, where `version` is used).
    pub async fn release(&self) -> Result<String, PveError> {
        let v: Value = self
            .call("version", Method::GET, "/version", &Params::new())
            .await?;
        Ok(v.get("release")
            .or_else(|| v.get("version"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }

    /// `GET /access/permissions[?path=P]`: the calling token's effective
    /// privileges, for one path or for every path PVE lists.
    pub async fn permissions(&self, path: Option<&str>) -> Result<Permissions, PveError> {
        let mut p = Params::new();
        p.push_opt("path", path.map(str::to_string));
        let raw: BTreeMap<String, BTreeMap<String, Value>> = self
            .call("permissions", Method::GET, "/access/permissions", &p)
            .await?;
        Ok(raw
            .into_iter()
            .map(|(path, privs)| (path, privs.into_keys().collect()))
            .collect())
    }

    /// `GET /cluster/options`: the datacenter options (`user-tag-access`).
    pub async fn cluster_options(&self) -> Result<ClusterOptions, PveError> {
        let v: Value = self
            .call(
                "cluster_options",
                Method::GET,
                "/cluster/options",
                &Params::new(),
            )
            .await?;
        Ok(ClusterOptions::from_value(&v))
    }

    /// `GET /nodes`.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, PveError> {
        self.call("nodes", Method::GET, "/nodes", &Params::new())
            .await
    }

    /// Members of a pool: `GET /pools?poolid=P`, falling back to the older
    /// `GET /pools/{P}` when the server lacks the former (404/501, or 400
    /// rejecting the `poolid` parameter).
    pub async fn pool_members(&self, pool: &str) -> Result<Vec<PoolMember>, PveError> {
        let mut p = Params::new();
        p.push("poolid", pool);
        match self
            .call::<Vec<PoolEntry>>("pools", Method::GET, "/pools", &p)
            .await
        {
            Ok(list) => list
                .into_iter()
                .find(|e| e.poolid == pool)
                .map(|e| e.members)
                .ok_or_else(|| PveError::NotFound(format!("pool {pool:?}"))),
            Err(PveError::Api {
                status,
                param_errors,
                ..
            }) if matches!(status, 404 | 501)
                || (status == 400 && param_errors.contains_key("poolid")) =>
            {
                let path = format!("/pools/{}", encode_segment(pool));
                let r: PoolRead = self
                    .call("pool_read", Method::GET, &path, &Params::new())
                    .await?;
                Ok(r.members)
            }
            Err(e) => Err(e),
        }
    }

    /// `POST .../agent/ping`: Ok once the guest agent answers.
    pub async fn agent_ping(&self, node: &str, vmid: u32) -> Result<(), PveError> {
        let path = Self::vm_path(node, vmid, "/agent/ping");
        let _: Value = self
            .call("agent_ping", Method::POST, &path, &Params::new())
            .await?;
        Ok(())
    }

    /// `POST .../agent/file-write`: writes (truncates) `path` in the guest.
    /// Content after encoding must fit in 60 KiB.
    pub async fn agent_file_write(
        &self,
        node: &str,
        vmid: u32,
        path: &str,
        content: &[u8],
        encoding: FileEncoding,
    ) -> Result<(), PveError> {
        if path.is_empty() {
            return Err(PveError::InvalidArgument("file-write path is empty".into()));
        }
        let (payload, encode) = match encoding {
            FileEncoding::PveEncodes => (latin1_text(content), true),
            FileEncoding::Base64 => (
                base64::engine::general_purpose::STANDARD.encode(content),
                false,
            ),
        };
        // PVE's limit counts characters; both encodings use one per byte sent.
        let sent = payload.chars().count();
        if sent > MAX_FILE_WRITE_CONTENT {
            return Err(PveError::InvalidArgument(format!(
                "file-write content for {path} is {sent} bytes after encoding; the limit is {MAX_FILE_WRITE_CONTENT}"
            )));
        }
        let mut p = Params::new();
        p.push("file", path);
        p.push("content", payload);
        p.push_bool("encode", encode);
        let _: Value = self
            .call(
                "agent_file_write",
                Method::POST,
                &Self::vm_path(node, vmid, "/agent/file-write"),
                &p,
            )
            .await?;
        Ok(())
    }

    /// `POST .../agent/exec`: starts `argv` (no shell) with optional stdin and
    /// returns the guest pid. `input_data` (any bytes, at most 64 KiB) reaches
    /// the command's stdin unchanged.
    pub async fn agent_exec<S: AsRef<str>>(
        &self,
        node: &str,
        vmid: u32,
        argv: &[S],
        input_data: Option<&[u8]>,
    ) -> Result<u32, PveError> {
        if argv.is_empty() || argv[0].as_ref().is_empty() {
            return Err(PveError::InvalidArgument("exec command is empty".into()));
        }
        let mut p = Params::new();
        p.push_array("command", argv.iter().map(|a| a.as_ref()));
        if let Some(data) = input_data {
            if data.len() > MAX_EXEC_INPUT {
                return Err(PveError::InvalidArgument(format!(
                    "exec input-data is {} bytes; the limit is {MAX_EXEC_INPUT}",
                    data.len()
                )));
            }
            p.push("input-data", latin1_text(data));
        }
        let r: ExecPid = self
            .call(
                "agent_exec",
                Method::POST,
                &Self::vm_path(node, vmid, "/agent/exec"),
                &p,
            )
            .await?;
        Ok(r.pid)
    }

    /// `GET .../agent/exec-status?pid=N`. The agent forgets the pid after the
    /// first `exited` answer, so a lost answer loses the exit code.
    pub async fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u32,
    ) -> Result<ExecStatus, PveError> {
        let mut p = Params::new();
        p.push("pid", pid.to_string());
        self.call(
            "agent_exec_status",
            Method::GET,
            &Self::vm_path(node, vmid, "/agent/exec-status"),
            &p,
        )
        .await
    }
}

fn transport_error(
    op: &'static str,
    e: &(dyn std::error::Error + 'static),
    connect: bool,
) -> PveError {
    if let Some(tls) = find_rustls_error(e) {
        return PveError::Tls {
            op,
            message: tls.to_string(),
        };
    }
    PveError::Transport {
        op,
        message: chain_message(e),
        connect,
    }
}

fn decode_data<T: DeserializeOwned>(op: &'static str, bytes: &[u8]) -> Result<T, PveError> {
    let mut v: Value = serde_json::from_slice(bytes).map_err(|e| PveError::Decode {
        op,
        message: format!("body is not JSON: {e}"),
    })?;
    let data = match v.get_mut("data") {
        Some(d) => d.take(),
        None => {
            return Err(PveError::Decode {
                op,
                message: "body has no \"data\" field".into(),
            })
        }
    };
    serde_json::from_value(data).map_err(|e| PveError::Decode {
        op,
        message: e.to_string(),
    })
}

/// Builds [`PveError::Api`]: the message comes from the body's `message` field
/// (newer PVE) or else the HTTP reason phrase, where PVE puts it.
fn api_error(status: StatusCode, ext: &http::Extensions, bytes: &[u8]) -> PveError {
    let body: Option<Value> = serde_json::from_slice(bytes).ok();
    let body_msg = body
        .as_ref()
        .and_then(|b| b.get("message"))
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    let reason = ext
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| String::from_utf8_lossy(r.as_bytes()).trim().to_string())
        .filter(|s| !s.is_empty());
    let message = body_msg
        .or(reason)
        .or_else(|| status.canonical_reason().map(str::to_string))
        .unwrap_or_else(|| format!("HTTP {}", status.as_u16()));
    let mut param_errors = BTreeMap::new();
    if let Some(Value::Object(errs)) = body.as_ref().and_then(|b| b.get("errors")) {
        for (k, v) in errs {
            let text = match v {
                Value::String(s) => s.trim().to_string(),
                other => other.to_string(),
            };
            param_errors.insert(k.clone(), text);
        }
    }
    PveError::Api {
        status: status.as_u16(),
        message,
        param_errors,
    }
}

/// Text for a parameter PVE hands to the guest agent through Perl's
/// `encode_base64` (`file-write` content with `encode=1`, exec `input-data`).
/// PVE decodes the request as UTF-8 and `encode_base64` takes every character
/// up to U+00FF as one byte (and dies with "Wide character" above), so sending
/// each byte as the character with that code point delivers the bytes exactly,
/// whatever they are; UTF-8 text sent as-is would arrive re-encoded or fail.
pub(crate) fn latin1_text(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_jittered() {
        let p = RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
        };
        for _ in 0..50 {
            let b1 = p.backoff(1);
            assert!(b1 >= Duration::from_millis(50) && b1 <= Duration::from_millis(100));
            let b3 = p.backoff(3);
            assert!(b3 >= Duration::from_millis(200) && b3 <= Duration::from_millis(400));
            let b9 = p.backoff(9);
            assert!(b9 >= Duration::from_millis(500) && b9 <= Duration::from_millis(1000));
        }
        assert_eq!(RetryPolicy::none().max_attempts, 1);
    }

    #[test]
    fn retry_rules() {
        let lock = PveError::Api {
            status: 500,
            message: "can't lock file '/var/lock/qemu-server/lock-1.conf' - got timeout".into(),
            param_errors: BTreeMap::new(),
        };
        let unreachable = PveError::Api {
            status: 595,
            message: "no route".into(),
            param_errors: BTreeMap::new(),
        };
        let sent = PveError::Transport {
            op: "x",
            message: "reset".into(),
            connect: false,
        };
        let not_sent = PveError::Transport {
            op: "x",
            message: "refused".into(),
            connect: true,
        };
        let tls = PveError::Tls {
            op: "x",
            message: "bad".into(),
        };
        assert!(retryable(&Method::POST, &lock));
        assert!(retryable(&Method::GET, &unreachable));
        assert!(
            retryable(&Method::POST, &unreachable),
            "595: never reached the node"
        );
        let lost = PveError::Api {
            status: 596,
            message: "Connection timed out".into(),
            param_errors: BTreeMap::new(),
        };
        assert!(retryable(&Method::GET, &lost));
        assert!(
            !retryable(&Method::POST, &lost),
            "596 may have been applied"
        );
        assert!(retryable(&Method::GET, &sent));
        assert!(!retryable(&Method::POST, &sent));
        assert!(retryable(&Method::POST, &not_sent));
        assert!(!retryable(&Method::GET, &tls));
    }

    #[test]
    fn api_error_prefers_body_message_then_reason() {
        let mut ext = http::Extensions::new();
        ext.insert(hyper::ext::ReasonPhrase::from_static(
            b"VM 1 already exists",
        ));
        let e = api_error(StatusCode::INTERNAL_SERVER_ERROR, &ext, br#"{"data":null}"#);
        assert!(e.is_already_exists(), "{e}");
        let e = api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &ext,
            br#"{"data":null,"message":"full text\n"}"#,
        );
        assert_eq!(e.to_string(), "PVE API error 500: full text");
        let e = api_error(StatusCode::NOT_FOUND, &http::Extensions::new(), b"");
        assert_eq!(e.to_string(), "PVE API error 404: Not Found");
    }

    #[test]
    fn config_debug_redacts_secret() {
        let cfg = PveConfig::new("https://h:8006/api2/json", "a@pve!t", "s3cr3t-value");
        let d = format!("{cfg:?}");
        assert!(
            !d.contains("s3cr3t-value") && d.contains("<redacted>"),
            "{d}"
        );
    }
}
