//! Prometheus metrics, in a registry of our own (never a global one), and
//! the `/metrics` answer: the Prometheus text format (0.0.4) unless the
//! scrape's `Accept` asks for OpenMetrics, both encoded by the library.

use std::sync::Arc;

use parking_lot::RwLock;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use providerkit::{Engine, ErrorKind, State};
use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::substrate::{ApiObserver, API_OPS};
use proxmox_backend::timeline::{Step, StepObserver};

mod backend_gauges;
use backend_gauges::BackendGauges;

/// The exposition formats `/metrics` serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format, version 0.0.4: what a scrape gets unless
    /// it asks for OpenMetrics, because people, scripts, `promtool check
    /// metrics` and older scrapers read only this one.
    Text,
    /// OpenMetrics 1.0.0, for a scrape whose `Accept` prefers it (Prometheus
    /// itself does).
    OpenMetrics,
}

impl Format {
    /// The format for a request's `Accept` header, negotiated as Prometheus'
    /// own client library does: the media ranges in order of preference
    /// (`q`, highest first; `q=0` refuses), the first one served wins, and
    /// the text format when none is (no header, `*/*`, an unparsable one).
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let mut ranges: Vec<(f32, Format)> = accept
            .split(',')
            .filter_map(|range| range.trim().parse::<mime::Mime>().ok())
            .filter_map(|range| {
                let quality = match range.get_param("q") {
                    None => 1.0,
                    Some(q) => q.as_str().parse::<f32>().ok()?,
                };
                let version = range.get_param("version").map(|v| v.as_str());
                let format = match range.essence_str() {
                    "text/plain" if matches!(version, None | Some("0.0.4" | "1.0.0")) => {
                        Format::Text
                    }
                    "application/openmetrics-text"
                        if matches!(version, None | Some("1.0.0" | "0.0.1")) =>
                    {
                        Format::OpenMetrics
                    }
                    _ => return None,
                };
                (quality > 0.0).then_some((quality, format))
            })
            .collect();
        // Stable: among equal qualities the header's own order decides.
        ranges.sort_by(|a, b| b.0.total_cmp(&a.0));
        ranges.first().map_or(Format::Text, |&(_, format)| format)
    }

    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiCallLabels {
    pub op: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiErrorLabels {
    pub op: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MachineLabels {
    pub state: String,
    pub zone: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub step: String,
    pub node: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PveRequestLabels {
    /// The pve client's stable operation name (`clone`, `task_status`,
    /// `agent_ping`, ...): a fixed set, whatever the VMIDs.
    pub endpoint: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdentityLabels {
    pub rpc: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResumedLabels {
    transition: String,
    outcome: String,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~ 4.4 min: gRPC acks at the low end, clones at the high end.
    Histogram::new(exponential_buckets(0.0005, 2.0, 20))
}

pub struct Metrics {
    registry: Registry,
    pub api_calls: Family<ApiCallLabels, Counter>,
    pub api_errors: Family<ApiErrorLabels, Counter>,
    pub api_duration: Family<OpLabels, Histogram>,
    pub grpc_requests: Family<GrpcLabels, Counter>,
    pub grpc_duration: Family<MethodLabels, Histogram>,
    pub panics: Counter,
    pub reconcile: Family<OutcomeLabels, Counter>,
    /// Calls refused under mTLS for their certificate's identity.
    pub identity_rejected: Family<IdentityLabels, Counter>,
    /// Each step of a machine's transitions (see `proxmox_backend::timeline`).
    pub step_duration: Family<StepLabels, Histogram>,
    /// HTTP requests sent to the PVE API, by endpoint and outcome.
    pub pve_requests: Family<PveRequestLabels, Counter>,
    /// The engine the machine gauge counts while this replica leads.
    machines: Arc<RwLock<Option<MachineSource>>>,
    /// 1 while this replica is the leader of a shared state (or serves a
    /// state of its own), 0 while it is a standby or starting.
    pub leader: Gauge,
    /// The backend whose guards (node memory, storage, destroy leftovers,
    /// clone slots) [`BackendGauges`] reads, while this replica leads.
    memory: Arc<RwLock<Option<Arc<ProxmoxBackend>>>>,
    /// The backend and zones (nodes) `bigfleet_proxmox_node_up` reports,
    /// while this replica leads.
    nodes: Arc<RwLock<Option<NodeSource>>>,
}

/// What `bigfleet_proxmox_node_up` is computed from at scrape time.
struct NodeSource {
    backend: Arc<ProxmoxBackend>,
    /// The configured zones, each a node: every one has a series.
    zones: Vec<String>,
}

/// What `bigfleet_proxmox_machines` is computed from at scrape time.
struct MachineSource {
    engine: Arc<Engine>,
    /// Configured zones: each has every state, at 0 when empty.
    zones: Vec<String>,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let api_calls = Family::<ApiCallLabels, Counter>::default();
        let api_errors = Family::<ApiErrorLabels, Counter>::default();
        let api_duration =
            Family::<OpLabels, Histogram>::new_with_constructor(latency_histogram as fn() -> _);
        let grpc_requests = Family::<GrpcLabels, Counter>::default();
        let grpc_duration =
            Family::<MethodLabels, Histogram>::new_with_constructor(latency_histogram as fn() -> _);
        let panics = Counter::default();
        let reconcile = Family::<OutcomeLabels, Counter>::default();
        let identity_rejected = Family::<IdentityLabels, Counter>::default();
        let step_duration =
            Family::<StepLabels, Histogram>::new_with_constructor(latency_histogram as fn() -> _);
        let pve_requests = Family::<PveRequestLabels, Counter>::default();
        registry.register(
            "bigfleet_proxmox_step_duration_seconds",
            "Duration of each step of a machine's transitions (clone, start, agent, bootstrap, \
             readiness, drain, stop, destroy, and waits for a clone slot or a lock), by step, \
             node and outcome",
            step_duration.clone(),
        );
        registry.register(
            "bigfleet_proxmox_pve_requests",
            "HTTP requests sent to the Proxmox VE API, by endpoint and outcome (retried: an \
             attempt that failed and was sent again)",
            pve_requests.clone(),
        );
        registry.register(
            "bigfleet_proxmox_api_calls",
            "Proxmox substrate calls by operation and outcome",
            api_calls.clone(),
        );
        registry.register(
            "bigfleet_proxmox_api_errors",
            "Failed Proxmox substrate calls by operation and error kind",
            api_errors.clone(),
        );
        registry.register(
            "bigfleet_proxmox_api_duration_seconds",
            "Proxmox substrate call duration by operation",
            api_duration.clone(),
        );
        registry.register(
            "bigfleet_proxmox_grpc_requests",
            "gRPC requests by method and status code",
            grpc_requests.clone(),
        );
        registry.register(
            "bigfleet_proxmox_grpc_request_duration_seconds",
            "gRPC request duration by method",
            grpc_duration.clone(),
        );
        registry.register(
            "bigfleet_proxmox_panics",
            "Handler panics turned into INTERNAL",
            panics.clone(),
        );
        registry.register(
            "bigfleet_proxmox_reconcile",
            "Background reconcile passes by outcome",
            reconcile.clone(),
        );
        registry.register(
            "bigfleet_proxmox_identity_rejected",
            "Calls refused under mTLS because the client certificate's bigfleet:// identity \
             does not permit them, by RPC and reason",
            identity_rejected.clone(),
        );
        registry.register_collector(Box::new(ProcessCollector));
        let memory = Arc::new(RwLock::new(None));
        registry.register_collector(Box::new(BackendGauges {
            source: Arc::clone(&memory),
        }));
        let nodes = Arc::new(RwLock::new(None));
        registry.register_collector(Box::new(NodesCollector {
            source: Arc::clone(&nodes),
        }));
        let leader = Gauge::default();
        registry.register(
            "bigfleet_proxmox_leader",
            "1 while this replica serves (the leader of a PostgreSQL state, or the only \
             replica of a state file), 0 while it is a standby or starting",
            leader.clone(),
        );
        let machines = Arc::new(RwLock::new(None));
        registry.register_collector(Box::new(MachinesCollector {
            source: machines.clone(),
        }));
        // Every known label value starts at 0, so rate() and absent()-style
        // alerts see the series from the first scrape on.
        for op in API_OPS {
            for outcome in ["success", "error"] {
                let _ = api_calls.get_or_create(&ApiCallLabels {
                    op: op.to_string(),
                    outcome: outcome.to_string(),
                });
            }
            for kind in ErrorKind::ALL {
                let _ = api_errors.get_or_create(&ApiErrorLabels {
                    op: op.to_string(),
                    kind: kind.name().to_string(),
                });
            }
        }
        for outcome in ["success", "error"] {
            let _ = reconcile.get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            });
        }
        Arc::new(Metrics {
            registry,
            api_calls,
            api_errors,
            api_duration,
            grpc_requests,
            grpc_duration,
            panics,
            reconcile,
            identity_rejected,
            step_duration,
            pve_requests,
            machines,
            leader,
            memory,
            nodes,
        })
    }

    /// The exposition in `format`.
    pub fn encode(&self, format: Format) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        match format {
            Format::Text => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?
            }
            Format::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut out, &self.registry)?
            }
        }
        Ok(out)
    }

    /// The answer to `GET /metrics` for a scrape that sent `accept`.
    pub fn scrape(&self, accept: Option<&HeaderValue>) -> Response {
        let format = Format::negotiate(accept.and_then(|v| v.to_str().ok()));
        match self.encode(format) {
            Ok(body) => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, format.content_type())],
                body,
            )
                .into_response(),
            Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding failed").into_response(),
        }
    }

    pub fn observe_grpc(&self, method: &str, code: &str, elapsed: Duration) {
        self.grpc_requests
            .get_or_create(&GrpcLabels {
                method: method.to_string(),
                code: code.to_string(),
            })
            .inc();
        self.grpc_duration
            .get_or_create(&MethodLabels {
                method: method.to_string(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Count this engine's machines at every scrape from now on. Counting
    /// at scrape time keeps the gauge off every request's path.
    pub fn observe_engine(&self, engine: Arc<Engine>, zones: Vec<String>) {
        self.leader.set(1);
        *self.machines.write() = Some(MachineSource { engine, zones });
    }

    /// This replica stopped leading: its engine is gone and the machine
    /// gauges disappear with it (the leader reports them).
    pub fn forget_engine(&self) {
        self.leader.set(0);
        *self.machines.write() = None;
        *self.memory.write() = None;
        *self.nodes.write() = None;
    }

    /// Report whether each of `zones` (nodes) is up at every scrape from
    /// now on, as the backend's last inventory read found it.
    pub fn observe_nodes(&self, backend: Arc<ProxmoxBackend>, zones: Vec<String>) {
        *self.nodes.write() = Some(NodeSource { backend, zones });
    }

    /// Report the backend's guards at every scrape from now on: the node
    /// memory guard's room per node (as last checked: at start-up and by
    /// each Create), the storage guard's, destroy leftovers, clone slots.
    pub fn observe_memory(&self, backend: Arc<ProxmoxBackend>) {
        *self.memory.write() = Some(backend);
    }

    /// A refusal series that exists at 0 from now on, so an alert on its
    /// rate sees the first refusal.
    pub fn expect_identity_rejection(&self, rpc: &str, reason: &str) {
        let _ = self.identity_rejected.get_or_create(&IdentityLabels {
            rpc: rpc.to_owned(),
            reason: reason.to_owned(),
        });
    }

    pub fn observe_identity_rejected(&self, rpc: &str, reason: &str) {
        self.identity_rejected
            .get_or_create(&IdentityLabels {
                rpc: rpc.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn observe_reconcile(&self, ok: bool) {
        self.reconcile
            .get_or_create(&OutcomeLabels {
                outcome: if ok { "success" } else { "error" }.to_string(),
            })
            .inc();
    }
}

impl ApiObserver for Metrics {
    fn observe(&self, op: &'static str, outcome: Result<(), ErrorKind>, elapsed: Duration) {
        self.api_calls
            .get_or_create(&ApiCallLabels {
                op: op.to_string(),
                outcome: if outcome.is_ok() { "success" } else { "error" }.to_string(),
            })
            .inc();
        if let Err(kind) = outcome {
            self.api_errors
                .get_or_create(&ApiErrorLabels {
                    op: op.to_string(),
                    kind: kind.name().to_string(),
                })
                .inc();
        }
        self.api_duration
            .get_or_create(&OpLabels { op: op.to_string() })
            .observe(elapsed.as_secs_f64());
    }
}

/// `bigfleet_proxmox_machines{state,zone}`, from the engine at scrape time.
struct MachinesCollector {
    source: Arc<RwLock<Option<MachineSource>>>,
}

impl std::fmt::Debug for MachinesCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MachinesCollector")
    }
}

impl Collector for MachinesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let source = self.source.read();
        let Some(source) = source.as_ref() else {
            return Ok(());
        };
        let census = source.engine.census(&source.zones);
        let mut family = encoder.encode_descriptor(
            "bigfleet_proxmox_machines",
            "Machines the provider tracks, by lifecycle state and zone",
            None,
            MetricType::Gauge,
        )?;
        for ((zone, state), count) in &census.counts {
            let labels = MachineLabels {
                state: state_label(*state).to_string(),
                zone: zone.clone(),
            };
            ConstGauge::new(*count as i64).encode(family.encode_family(&labels)?)?;
        }
        // Transitions found in flight at start-up: every pair from 0.
        let mut family = encoder.encode_descriptor(
            "bigfleet_proxmox_resumed",
            "Transitions a provider restart interrupted, by transition and how they ended \
             (landed or failed after resuming, timed_out before the restart ended, not_resumable)",
            None,
            MetricType::Counter,
        )?;
        for (kind, outcome, count) in source.engine.resumed_counts() {
            let labels = ResumedLabels {
                transition: kind.name().to_string(),
                outcome: outcome.name().to_string(),
            };
            ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// `bigfleet_proxmox_node_up{node}`: 0 for a node the last inventory read
/// found down (`GET /nodes`), 1 for every other configured node.
struct NodesCollector {
    source: Arc<RwLock<Option<NodeSource>>>,
}

impl std::fmt::Debug for NodesCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodesCollector")
    }
}

impl Collector for NodesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let source = self.source.read();
        let Some(source) = source.as_ref() else {
            return Ok(());
        };
        let down = source.backend.offline_nodes();
        let mut family = encoder.encode_descriptor(
            "bigfleet_proxmox_node_up",
            "1 while the node answers, 0 while the cluster lists it offline (as the last \
             inventory read found it): its machines are reported as last seen, Creates there \
             fail, Deletes and Drains of its machines wait for it",
            None,
            MetricType::Gauge,
        )?;
        for zone in &source.zones {
            let labels = NodeLabels { node: zone.clone() };
            let up = i64::from(!down.contains(zone));
            ConstGauge::new(up).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The wire name without `MACHINE_STATE_`, as the alert rules match it.
fn state_label(state: State) -> &'static str {
    state.name()
}

/// Standard `process_*` series, read from /proc at scrape time.
#[derive(Debug)]
struct ProcessCollector;

struct ProcessSample {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    open_fds: i64,
    start_time_seconds: i64,
}

#[allow(unsafe_code)] // libc call; see the SAFETY note inside
fn sample_process() -> Option<ProcessSample> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name (which may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    // SAFETY: sysconf reads a configuration value; no memory is shared.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as i64;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let start_ticks: f64 = fields.get(19)?.parse().ok()?;
    let vsize: i64 = fields.get(20)?.parse().ok()?;
    let rss_pages: i64 = fields.get(21)?.parse().ok()?;
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse::<i64>()
        .ok()?;
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    Some(ProcessSample {
        cpu_seconds: (utime + stime) / ticks,
        resident_bytes: rss_pages * page,
        virtual_bytes: vsize,
        open_fds,
        start_time_seconds: boot + (start_ticks / ticks) as i64,
    })
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = sample_process() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?)?;
        ConstCounter::new(crate::logging::dropped_lines()).encode(encoder.encode_descriptor(
            "bigfleet_proxmox_log_lines_dropped",
            "Log lines dropped because stderr did not keep up",
            None,
            MetricType::Counter,
        )?)?;
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
        ] {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

impl StepObserver for Metrics {
    fn observe_step(&self, step: Step, node: &str, duration: Duration, ok: bool) {
        self.step_duration
            .get_or_create(&StepLabels {
                step: step.name().to_string(),
                node: node.to_string(),
                outcome: if ok { "success" } else { "error" }.to_string(),
            })
            .observe(duration.as_secs_f64());
    }
}

/// The pve client's hook: every HTTP request to the PVE API, counted by
/// endpoint, so a lifecycle's cost shows in production as in a benchmark.
pub struct PveRequests(pub Arc<Metrics>);

impl pve::ApiObserver for PveRequests {
    fn observe(&self, call: &pve::ApiCall<'_>) {
        let count = |outcome: &str, n: u64| {
            if n > 0 {
                self.0
                    .pve_requests
                    .get_or_create(&PveRequestLabels {
                        endpoint: call.op.to_string(),
                        outcome: outcome.to_string(),
                    })
                    .inc_by(n);
            }
        };
        // Every attempt but the last failed and was sent again.
        count("retried", u64::from(call.attempts.saturating_sub(1)));
        count(
            if call.result.is_ok() {
                "success"
            } else {
                "error"
            },
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_scrapes_get_the_text_format() {
        for accept in [
            None,
            Some(""),
            Some("*/*"),
            Some("text/plain"),
            Some("text/plain;version=0.0.4"),
            Some("application/json, */*;q=0.5"),
            Some("not a media type"),
            // Refused with q=0.
            Some("application/openmetrics-text;q=0, text/plain"),
            Some("application/openmetrics-text;q=0"),
            // A version of OpenMetrics we do not speak.
            Some("application/openmetrics-text;version=9.9.9"),
            // Preferred by q, whatever the order.
            Some("application/openmetrics-text;q=0.3, text/plain;q=0.9"),
        ] {
            assert_eq!(Format::negotiate(accept), Format::Text, "{accept:?}");
        }
    }

    #[test]
    fn scrapes_that_ask_for_openmetrics_get_it() {
        for accept in [
            "application/openmetrics-text",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            // Prometheus 2.x.
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
             version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
            // Prometheus 3.x.
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,\
             application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;\
             escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
            // A range we do not serve ranks first and is passed over.
            "application/vnd.google.protobuf;q=0.9, application/openmetrics-text;q=0.5",
            // Equal q: the header's order.
            "application/openmetrics-text, text/plain",
        ] {
            assert_eq!(
                Format::negotiate(Some(accept)),
                Format::OpenMetrics,
                "{accept:?}"
            );
        }
    }

    #[test]
    fn each_format_is_the_library_encoding_with_its_content_type() {
        let metrics = Metrics::new();
        metrics.observe_reconcile(true);
        let text = metrics.encode(Format::Text).expect("text");
        assert!(text.contains("# TYPE bigfleet_proxmox_reconcile_total counter\n"));
        assert!(text.contains("bigfleet_proxmox_reconcile_total{outcome=\"success\"} 1\n"));
        assert!(!text.contains("# EOF"), "{text}");
        let openmetrics = metrics.encode(Format::OpenMetrics).expect("openmetrics");
        assert!(openmetrics.contains("# TYPE bigfleet_proxmox_reconcile counter\n"));
        assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");
        assert!(Format::Text
            .content_type()
            .starts_with("text/plain; version=0.0.4"));
        assert!(Format::OpenMetrics
            .content_type()
            .starts_with("application/openmetrics-text; version=1.0.0"));
    }
}
