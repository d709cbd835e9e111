//! Observability, black-box: metrics after a full lifecycle (the OpenMetrics
//! answer checked with a validating exposition parser), the plain scrape of
//! the real backend on the simulator through `promtool check metrics`, probes
//! and gRPC health, graceful shutdown on SIGTERM, one log line per RPC,
//! secrets never logged or exported; plus the panic layer in-process.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bigfleet_proto::raw::{EncodedMachine, EncodedMachineList};
use bigfleet_proto::serving;
use bigfleet_proto::serving::capacity_provider_server::{CapacityProvider, CapacityProviderServer};
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest, ListFilter, Machine, MachineRef,
    MachineState,
};
use bigfleet_proxmox::layers::{CatchPanicLayer, ObserveLayer};
use bigfleet_proxmox::metrics::{Format, Metrics};
use provider_testkit::field;
use provider_testkit::wait::Wait;
use pve_sim::{PveSim, SimConfig};
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::common::{
    self, http_get, plain_channel, promtool_check_metrics, promtool_or_skip, run_to_exit,
    sim_backend_args, sim_ca_file, start_blocking, wait_state, Provider, POLL,
};

const SECRET_BLOB: &str = "SECRET-BLOB-7f3a";
const SECRET_TOKEN: &str = "SECRET-TOKEN-91c2";
const LIFECYCLE_DEADLINE: Duration = Duration::from_secs(30);
/// Prometheus' own preference: OpenMetrics first, the text format after.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,\
                                 text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

// ---------------------------------------------------------------------------
// A small validating parser for the Prometheus / OpenMetrics text format.

#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug, Default)]
pub(crate) struct Exposition {
    /// family name -> TYPE
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

fn suffixes(kind: &str) -> &'static [&'static str] {
    match kind {
        "counter" => &["_total", "_created"],
        "histogram" | "gaugehistogram" => {
            &["_bucket", "_count", "_sum", "_created", "_gcount", "_gsum"]
        }
        "summary" => &["_count", "_sum", "_created", ""],
        "info" => &["_info"],
        _ => &[""],
    }
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s
            .parse::<f64>()
            .map_err(|_| format!("value {s:?} is not a float")),
    }
}

/// `k="v",k2="v2"` (the text between the braces).
fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once("=\"")
            .ok_or_else(|| format!("label set {s:?}: expected k=\"v\""))?;
        if !is_name(key) {
            return Err(format!("label name {key:?} is invalid"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("label set {s:?}: unterminated value")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?} in {s:?}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(key.to_string(), value).is_some() {
            return Err(format!("label {key} repeated in {s:?}"));
        }
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    Ok(labels)
}

fn parse_exposition(text: &str) -> Result<Exposition, String> {
    let body = text
        .strip_suffix("# EOF\n")
        .or_else(|| text.strip_suffix("# EOF"))
        .ok_or("the exposition does not end with `# EOF`")?;
    let mut exp = Exposition::default();
    let mut helps = BTreeSet::new();
    let mut finished = BTreeSet::new(); // families whose block has ended
    let mut current: Option<String> = None;
    for (n, line) in body.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.is_empty() {
            return Err(at("empty line".into()));
        }
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let (kw, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let arg = parts.next().unwrap_or("");
            if !is_name(name) {
                return Err(at(format!("bad family name {name:?}")));
            }
            if current.as_deref() != Some(name) {
                if let Some(prev) = current.take() {
                    finished.insert(prev);
                }
                if finished.contains(name) {
                    return Err(at(format!("family {name} is split")));
                }
                current = Some(name.to_string());
            }
            match kw {
                "HELP" => {
                    if !helps.insert(name.to_string()) {
                        return Err(at("second HELP".into()));
                    }
                }
                "TYPE" => {
                    const KINDS: &[&str] = &[
                        "counter",
                        "gauge",
                        "histogram",
                        "gaugehistogram",
                        "summary",
                        "info",
                        "stateset",
                        "unknown",
                    ];
                    if !KINDS.contains(&arg) {
                        return Err(at(format!("unknown type {arg:?}")));
                    }
                    if exp
                        .types
                        .insert(name.to_string(), arg.to_string())
                        .is_some()
                    {
                        return Err(at("second TYPE".into()));
                    }
                }
                "UNIT" => {}
                other => return Err(at(format!("unknown comment keyword {other:?}"))),
            }
            continue;
        }
        if line.starts_with('#') {
            return Err(at("stray comment".into()));
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) if line[..open].find(' ').is_none() => {
                let close = line
                    .rfind('}')
                    .ok_or_else(|| at("unclosed label set".into()))?;
                (
                    &line[..open],
                    parse_labels(&line[open + 1..close]).map_err(at)?,
                    &line[close + 1..],
                )
            }
            _ => {
                let (name, _) = line.split_once(' ').ok_or_else(|| at("no value".into()))?;
                (name, BTreeMap::new(), &line[name.len()..])
            }
        };
        if !is_name(name) {
            return Err(at(format!("bad metric name {name:?}")));
        }
        let mut fields = rest
            .strip_prefix(' ')
            .ok_or_else(|| at("no space before the value".into()))?
            .split(' ');
        let value = parse_value(fields.next().unwrap_or("")).map_err(at)?;
        if let Some(ts) = fields.next() {
            parse_value(ts).map_err(at)?;
        }
        if fields.next().is_some() {
            return Err(at("trailing fields".into()));
        }
        let family = family_of(&exp, name)
            .ok_or_else(|| at(format!("sample {name} has no TYPE declared before it")))?;
        if !helps.contains(&family) {
            return Err(at(format!("sample of {family} before its HELP")));
        }
        if current.as_deref() != Some(family.as_str()) {
            return Err(at(format!("sample of {family} outside its block")));
        }
        if exp.types[&family] == "counter" && (value.is_nan() || value < 0.0) {
            return Err(at("negative counter".into()));
        }
        exp.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    check_histograms(&exp)?;
    Ok(exp)
}

/// The declared family a sample name belongs to.
fn family_of(exp: &Exposition, sample: &str) -> Option<String> {
    exp.types.iter().find_map(|(family, kind)| {
        suffixes(kind)
            .iter()
            .any(|suf| {
                sample.strip_suffix(suf) == Some(family.as_str())
                    || (suf.is_empty() && sample == family)
            })
            .then(|| family.clone())
    })
}

/// Buckets are cumulative, end at +Inf, and +Inf equals _count.
fn check_histograms(exp: &Exposition) -> Result<(), String> {
    for (family, kind) in &exp.types {
        if kind != "histogram" {
            continue;
        }
        let mut series: BTreeMap<BTreeMap<String, String>, Vec<(f64, f64)>> = BTreeMap::new();
        for s in exp
            .samples
            .iter()
            .filter(|s| s.name == format!("{family}_bucket"))
        {
            let mut key = s.labels.clone();
            let le = key
                .remove("le")
                .ok_or(format!("{family} bucket without le"))?;
            series
                .entry(key)
                .or_default()
                .push((parse_value(&le)?, s.value));
        }
        for (key, buckets) in series {
            for pair in buckets.windows(2) {
                if pair[1].0 <= pair[0].0 || pair[1].1 < pair[0].1 {
                    return Err(format!(
                        "{family}{key:?}: buckets not cumulative: {buckets:?}"
                    ));
                }
            }
            let last = buckets
                .last()
                .ok_or(format!("{family}{key:?}: no buckets"))?;
            if last.0 != f64::INFINITY {
                return Err(format!("{family}{key:?}: no +Inf bucket"));
            }
            let count = exp
                .samples
                .iter()
                .find(|s| s.name == format!("{family}_count") && s.labels == key)
                .ok_or(format!("{family}{key:?}: no _count"))?;
            if count.value != last.1 {
                return Err(format!(
                    "{family}{key:?}: +Inf bucket {} != count {}",
                    last.1, count.value
                ));
            }
        }
    }
    Ok(())
}

impl Exposition {
    /// The value of the sample with exactly these labels.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    pub(crate) fn must(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in:\n{:#?}", self.samples))
    }

    fn sum(&self, name: &str, label: (&str, &str)) -> f64 {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name && s.labels.get(label.0).map(String::as_str) == Some(label.1)
            })
            .map(|s| s.value)
            .sum()
    }
}

#[test]
fn parser_rejects_malformed_expositions() {
    let good = "# HELP a x\n# TYPE a counter\na_total{k=\"v\"} 1\n# EOF\n";
    let g = parse_exposition(good).expect("good");
    assert_eq!(g.must("a_total", &[("k", "v")]), 1.0);
    let h = "# HELP a x\n# TYPE a counter\n";
    for (bad, why) in [
        (format!("{h}a_total 1\n"), "EOF"),
        (format!("a_total 1\n{h}# EOF\n"), "no TYPE"),
        ("# TYPE a counter\na_total 1\n# EOF\n".to_string(), "HELP"),
        (format!("{h}a_total one\n# EOF\n"), "not a float"),
        (format!("{h}a_total{{k=\"v}} 1\n# EOF\n"), "unterminated"),
        (format!("{h}a_total -1\n# EOF\n"), "negative"),
        (
            "# HELP a x\n# TYPE a gauge\na 1\n# HELP b x\n# TYPE b gauge\nb 1\na 2\n# EOF\n".to_string(),
            "outside its block",
        ),
        (
            "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\nh_sum 0\n# EOF\n".to_string(),
            "cumulative",
        ),
        (
            "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 1\nh_sum 0\n# EOF\n".to_string(),
            "!= count",
        ),
    ] {
        let err = parse_exposition(&bad).expect_err(&bad);
        assert!(err.contains(why), "{bad:?}: wrong reason {err:?}, wanted {why:?}");
    }
}

// ---------------------------------------------------------------------------

/// Scrapes as Prometheus does (asking for OpenMetrics) and parses the answer.
pub(crate) fn scrape(p: &Provider) -> (String, Exposition) {
    let answer = provider_testkit::http::get_accepting(p.metrics, "/metrics", PROMETHEUS_ACCEPT)
        .expect("GET /metrics");
    let body = answer.body;
    assert_eq!(answer.status, 200, "{body}");
    assert_eq!(
        answer.headers.get("content-type").map(String::as_str),
        Some(OPENMETRICS_CONTENT_TYPE)
    );
    let exp = parse_exposition(&body).unwrap_or_else(|e| panic!("{e}\n--- exposition:\n{body}"));
    (body, exp)
}

/// One Create -> Configure -> Drain -> Delete cycle on a SPECULATIVE slot,
/// then one Get of an unknown id (NotFound). Returns the machine id.
async fn lifecycle(p: &Provider) -> String {
    let mut c = p.client().await;
    let id = common::speculative_id(&mut c).await;
    let ack = c
        .create(CreateRequest {
            machine_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("Create")
        .into_inner();
    assert!(!ack.operation_id.is_empty());
    let idle: Machine = wait_state(&mut c, &id, MachineState::Idle, LIFECYCLE_DEADLINE).await;
    assert!(idle.host.is_some_and(|h| !h.r#ref.is_empty()));
    c.configure(ConfigureRequest {
        machine_id: id.clone(),
        cluster_id: "cluster-obs".into(),
        bootstrap_blob: format!("#!/bin/sh\necho {SECRET_BLOB}\n").into_bytes(),
        ..Default::default()
    })
    .await
    .expect("Configure");
    wait_state(&mut c, &id, MachineState::Configured, LIFECYCLE_DEADLINE).await;
    c.drain(DrainRequest {
        machine_id: id.clone(),
        grace_period_seconds: 30,
        ..Default::default()
    })
    .await
    .expect("Drain");
    wait_state(&mut c, &id, MachineState::Idle, LIFECYCLE_DEADLINE).await;
    c.delete(DeleteRequest {
        machine_id: id.clone(),
        ..Default::default()
    })
    .await
    .expect("Delete");
    wait_state(&mut c, &id, MachineState::Speculative, LIFECYCLE_DEADLINE).await;
    let missing = c
        .get(MachineRef {
            id: "proxmox/OnDemand/pve.small/pve-a/999".into(),
        })
        .await
        .expect_err("Get of an unknown id");
    assert_eq!(missing.code(), Code::NotFound);
    id
}

fn rpc_lines(p: &Provider, method: &str) -> Vec<String> {
    p.logs
        .lines()
        .into_iter()
        .filter(|l| field(l, "method").as_deref() == Some(method) && l.contains(" msg=rpc"))
        .collect()
}

/// `curl -s :9090/metrics | promtool check metrics` on the real backend,
/// once a Create on the simulator has given the Proxmox families their
/// series; and its OpenMetrics answer through the validating parser.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_backend_scrape_passes_promtool_and_the_openmetrics_parser() {
    let sim = PveSim::start(SimConfig::default())
        .await
        .expect("simulator");
    let (_dir, ca) = sim_ca_file(&sim);
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &["--seed-count", "1", "--proxmox-poll-interval", "50ms"],
    );
    let p = start_blocking(args).await;
    let mut c = p.client().await;
    let id = common::create_speculative(&mut c).await;
    wait_state(&mut c, &id, MachineState::Idle, LIFECYCLE_DEADLINE).await;

    let (_, exp) = scrape(&p);
    assert!(
        exp.must(
            "bigfleet_proxmox_api_calls_total",
            &[("op", "CloneVM"), ("outcome", "success")]
        ) >= 1.0
    );
    // The default template is on pve1's local-lvm: its clone slots are
    // pve1's, adaptive from 2 once learning gave up (this simulator's
    // fixed-length clones print no progress), so no pace; none used or
    // waited for once the clone ended.
    let slots = [("node", "pve1"), ("storage", "local-lvm")];
    assert_eq!(exp.must("bigfleet_proxmox_clone_slots", &slots), 2.0);
    assert_eq!(
        exp.get("bigfleet_proxmox_clone_pace_seconds", &slots),
        None,
        "nothing learnt, nothing paced"
    );
    assert_eq!(exp.must("bigfleet_proxmox_clone_slots_used", &slots), 0.0);
    assert_eq!(
        exp.must("bigfleet_proxmox_clone_slots_waiting", &slots),
        0.0
    );
    let plain = provider_testkit::http::get(p.metrics, "/metrics").expect("GET /metrics");
    assert_eq!(plain.status, 200, "{}", plain.body);
    assert_eq!(
        plain.headers.get("content-type").map(String::as_str),
        Some(TEXT_CONTENT_TYPE)
    );
    assert!(
        plain
            .body
            .lines()
            .any(|l| l.starts_with("bigfleet_proxmox_api_calls_total{op=\"CloneVM\"")),
        "{}",
        plain.body
    );
    if let Some(promtool) = promtool_or_skip() {
        let (clean, report) = promtool_check_metrics(&promtool, &plain.body);
        assert!(
            clean,
            "promtool check metrics:\n{report}\n--- scrape:\n{}",
            plain.body
        );
    }
    drop(c);
    drop(p);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_metrics_logs_and_secrets() {
    // The token secret is accepted (and ignored) by the fake backend: it is
    // on the command line for the whole run and must surface nowhere.
    let p = Provider::start(&[
        "--use-fake-backend",
        "--seed-count",
        "4",
        "--fake-latency",
        "50ms",
        "--reconcile-interval",
        "200ms",
        "--proxmox-token-secret",
        SECRET_TOKEN,
    ]);
    let id = lifecycle(&p).await;

    // Wait (bounded) for a background reconcile pass to be counted.
    let (text, exp) = Wait::new("a successful reconcile counted", Duration::from_secs(20))
        .every(POLL)
        .try_ok(|| {
            let (text, exp) = scrape(&p);
            if exp
                .get(
                    "bigfleet_proxmox_reconcile_total",
                    &[("outcome", "success")],
                )
                .is_some_and(|v| v >= 1.0)
            {
                Ok((text, exp))
            } else {
                Err(text)
            }
        })
        .await
        .unwrap_or_else(|t| panic!("no successful reconcile counted:\n{}", t.last));

    // The machine gauge: every state of every zone present, summing to the
    // inventory (the lifecycle ended on SPECULATIVE: all 4 are).
    assert_eq!(
        exp.types
            .get("bigfleet_proxmox_machines")
            .map(String::as_str),
        Some("gauge"),
        "{text}"
    );
    let machines: Vec<&Sample> = exp
        .samples
        .iter()
        .filter(|s| s.name == "bigfleet_proxmox_machines")
        .collect();
    let zones: std::collections::BTreeSet<&str> = machines
        .iter()
        .filter_map(|s| s.labels.get("zone").map(String::as_str))
        .collect();
    assert!(!zones.is_empty(), "{text}");
    for zone in &zones {
        for state in [
            "SPECULATIVE",
            "CREATING",
            "IDLE",
            "CONFIGURING",
            "CONFIGURED",
            "DRAINING",
            "DELETING",
            "FAILED",
        ] {
            assert!(
                exp.get(
                    "bigfleet_proxmox_machines",
                    &[("state", state), ("zone", zone)]
                )
                .is_some(),
                "machines{{state={state},zone={zone}}} missing:\n{text}"
            );
        }
    }
    assert_eq!(machines.iter().map(|s| s.value).sum::<f64>(), 4.0, "{text}");
    assert_eq!(
        machines
            .iter()
            .filter(|s| s.labels.get("state").map(String::as_str) == Some("SPECULATIVE"))
            .map(|s| s.value)
            .sum::<f64>(),
        4.0,
        "{text}"
    );

    // Families and their types.
    for (family, kind) in [
        ("bigfleet_proxmox_grpc_requests", "counter"),
        (
            "bigfleet_proxmox_grpc_request_duration_seconds",
            "histogram",
        ),
        ("bigfleet_proxmox_api_calls", "counter"),
        ("bigfleet_proxmox_api_duration_seconds", "histogram"),
        ("bigfleet_proxmox_panics", "counter"),
        ("bigfleet_proxmox_reconcile", "counter"),
        ("process_resident_memory_bytes", "gauge"),
    ] {
        assert_eq!(
            exp.types.get(family).map(String::as_str),
            Some(kind),
            "{family}"
        );
    }

    // gRPC: each lifecycle RPC once, OK; the unknown Get as NotFound.
    let grpc = "bigfleet_proxmox_grpc_requests_total";
    for method in ["Create", "Configure", "Drain", "Delete"] {
        assert_eq!(
            exp.must(grpc, &[("method", method), ("code", "OK")]),
            1.0,
            "{method}"
        );
        assert_eq!(exp.sum(grpc, ("method", method)), 1.0, "{method}: only OK");
    }
    assert!(exp.must(grpc, &[("method", "List"), ("code", "OK")]) >= 1.0);
    assert!(exp.must(grpc, &[("method", "Get"), ("code", "OK")]) >= 4.0);
    assert_eq!(
        exp.must(grpc, &[("method", "Get"), ("code", "NotFound")]),
        1.0
    );
    assert!(
        !exp.samples.iter().any(|s| s.name == grpc
            && s.labels
                .get("method")
                .is_some_and(|m| m.contains('/') || m.contains("Health"))),
        "method must be the short name of a CapacityProvider RPC:\n{text}"
    );
    // The duration histogram counts every request of the method.
    let dur = "bigfleet_proxmox_grpc_request_duration_seconds";
    for method in ["Create", "Configure", "Drain", "Delete", "Get", "List"] {
        assert_eq!(
            exp.must(&format!("{dur}_count"), &[("method", method)]),
            exp.sum(grpc, ("method", method)),
            "{method}"
        );
        assert!(exp
            .get(&format!("{dur}_sum"), &[("method", method)])
            .is_some());
    }

    // Substrate calls: one of each lifecycle step, EnsureRunning before
    // Configure and before Drain, DescribeManaged at startup and reconcile.
    let api = "bigfleet_proxmox_api_calls_total";
    let ok = |op: &str| exp.get(api, &[("op", op), ("outcome", "success")]);
    assert_eq!(ok("CloneVM"), Some(1.0));
    assert_eq!(ok("Configure"), Some(1.0));
    assert_eq!(ok("Drain"), Some(1.0));
    assert_eq!(ok("DeleteVM"), Some(1.0));
    assert_eq!(ok("EnsureRunning"), Some(2.0));
    // The fake backend has no readiness gate: no probe, and none counted.
    assert_eq!(ok("NodeReady"), Some(0.0));
    assert!(ok("DescribeManaged").is_some_and(|v| v >= 2.0), "{text}");
    assert!(
        !exp.samples
            .iter()
            .any(|s| s.name == api && s.labels["outcome"] != "success" && s.value != 0.0),
        "a clean lifecycle recorded API errors:\n{text}"
    );
    // Every op's error series and every error kind exist from the start, at 0.
    let errors = "bigfleet_proxmox_api_errors_total";
    for op in [
        "CloneVM",
        "DeleteVM",
        "DescribeManaged",
        "EnsureRunning",
        "Configure",
        "NodeReady",
        "Drain",
    ] {
        assert_eq!(
            exp.get(api, &[("op", op), ("outcome", "error")]),
            Some(0.0),
            "{op}"
        );
        for kind in ["transient", "permanent", "not_found", "refused"] {
            assert_eq!(
                exp.get(errors, &[("op", op), ("kind", kind)]),
                Some(0.0),
                "{op} {kind}"
            );
        }
    }
    for outcome in ["success", "error"] {
        assert!(
            exp.get("bigfleet_proxmox_reconcile_total", &[("outcome", outcome)])
                .is_some(),
            "reconcile_total{{outcome={outcome}}} missing: labelled counters start at 0:\n{text}"
        );
    }
    let api_dur = "bigfleet_proxmox_api_duration_seconds";
    for op in [
        "CloneVM",
        "Configure",
        "Drain",
        "DeleteVM",
        "EnsureRunning",
        "DescribeManaged",
    ] {
        assert_eq!(
            exp.must(&format!("{api_dur}_count"), &[("op", op)]),
            exp.sum(api, ("op", op)),
            "{op}"
        );
    }
    // The fake clone takes --fake-latency (50ms): the histogram saw it.
    assert!(exp.must(&format!("{api_dur}_sum"), &[("op", "CloneVM")]) >= 0.045);

    assert_eq!(exp.must("bigfleet_proxmox_panics_total", &[]), 0.0);
    assert!(exp.must("process_resident_memory_bytes", &[]) > 0.0);
    assert!(exp.must("process_start_time_seconds", &[]) > 1.6e9);
    assert!(exp.get("process_cpu_seconds_total", &[]).is_some());
    assert!(exp.must("process_open_fds", &[]) > 0.0);
    assert_eq!(
        exp.must("bigfleet_proxmox_log_lines_dropped_total", &[]),
        0.0
    );

    // Logs: one line per lifecycle RPC at info, with code and duration.
    for method in ["Create", "Configure", "Drain", "Delete"] {
        let lines = rpc_lines(&p, method);
        assert_eq!(lines.len(), 1, "{method}: {lines:#?}");
        let l = &lines[0];
        assert!(l.contains("level=info"), "{l}");
        assert_eq!(field(l, "code").as_deref(), Some("OK"), "{l}");
        let ms: f64 = field(l, "dur_ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0);
        assert!(ms >= 0.0, "dur_ms is not a duration: {l}");
        assert_eq!(field(l, "machine_id").as_deref(), Some(id.as_str()), "{l}");
        assert_eq!(field(l, "error"), None, "{l}");
    }
    // Get/List successes stay below INFO; the failed Get is a WARN.
    let gets = rpc_lines(&p, "Get");
    assert_eq!(gets.len(), 1, "{gets:#?}");
    assert!(
        gets[0].contains("level=warn") && field(&gets[0], "code").as_deref() == Some("NotFound")
    );
    assert_eq!(
        field(&gets[0], "machine_id").as_deref(),
        Some("proxmox/OnDemand/pve.small/pve-a/999"),
        "{}",
        gets[0]
    );
    assert_eq!(
        field(&gets[0], "error").as_deref(),
        Some(r#"machine "proxmox/OnDemand/pve.small/pve-a/999" not found"#),
        "{}",
        gets[0]
    );
    assert!(rpc_lines(&p, "List").is_empty());

    // Startup line fields.
    let s = &p.startup_line;
    assert!(s.contains("level=info"), "{s}");
    assert_eq!(field(s, "provider").as_deref(), Some("proxmox"), "{s}");
    assert_eq!(field(s, "proxmox_backend").as_deref(), Some("fake"), "{s}");
    assert_eq!(field(s, "security").as_deref(), Some("insecure"), "{s}");
    assert_eq!(field(s, "offerings").as_deref(), Some("4"), "{s}");
    assert_eq!(field(s, "zones").as_deref(), Some("pve-a,pve-b"), "{s}");
    assert_eq!(
        field(s, "metrics_addr").as_deref(),
        Some(p.metrics.to_string().as_str()),
        "{s}"
    );
    assert!(
        p.logs
            .lines()
            .iter()
            .any(|l| l.contains("level=warn") && l.contains("FAKE BACKEND")),
        "the fake backend must be announced loudly"
    );

    // Secrets: not in any log line, not in the exposition, in no encoding.
    let logs = p.stderr();
    let blob_bytes = format!("{:?}", SECRET_BLOB.as_bytes());
    let blob_bytes = &blob_bytes[1..blob_bytes.len() - 1];
    let blob_hex: String = SECRET_BLOB.bytes().map(|b| format!("{b:02x}")).collect();
    for haystack in [&logs, &text] {
        for needle in [SECRET_BLOB, SECRET_TOKEN, blob_bytes, &blob_hex] {
            assert!(
                !haystack.contains(needle),
                "secret {needle:?} leaked:\n{haystack}"
            );
        }
    }
}

#[test]
fn token_secret_is_not_echoed_by_failed_startups() {
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{SECRET_TOKEN}\n")).expect("write token");
    let token_file = token_file.to_str().expect("utf-8 path");
    let base = [
        "--addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--proxmox-api-url",
        "https://pve1.test:8006/api2/json",
        "--proxmox-token-id",
        "bigfleet@pve!provider",
    ];
    let inline = ["--proxmox-token-secret", SECRET_TOKEN];
    let file = ["--proxmox-token-file", token_file];
    // No trust material; no nodes; an unknown flag (clap's own error) —
    // with the secret inline and from a file.
    let later_failures: [&[&str]; 3] = [
        &["--nodes", "pve1"],
        &["--proxmox-tls-fingerprint", "AB:CD"],
        &["--nodes", "pve1", "--no-such-flag"],
    ];
    for secret in [&inline, &file] {
        for extra in later_failures {
            let mut args = base.to_vec();
            args.extend_from_slice(secret);
            args.extend_from_slice(extra);
            let run = run_to_exit(&args, Duration::from_secs(30));
            assert!(!run.status.success(), "{args:?}: {}", run.stderr);
            assert!(!run.stderr.is_empty(), "{args:?}: silent failure");
            assert!(
                !run.stderr.contains(SECRET_TOKEN),
                "{args:?}: token secret echoed:\n{}",
                run.stderr
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_also_shuts_down_gracefully() {
    let mut p = Provider::start(&["--use-fake-backend", "--seed-count", "2"]);
    p.signal(libc::SIGINT);
    let status = p
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("no exit after SIGINT:\n{}", p.stderr()));
    assert!(status.success(), "exit {status:?}:\n{}", p.stderr());
    let logs = p.stderr();
    assert!(logs.contains("shutdown requested"), "{logs}");
    assert!(
        logs.lines().last().is_some_and(|l| l.contains("stopped")),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_health_and_graceful_sigterm() {
    let mut p = Provider::start(&["--use-fake-backend", "--seed-count", "2"]);
    assert_eq!(
        http_get(p.metrics, "/healthz").expect("healthz"),
        (200, "ok".into())
    );
    assert_eq!(
        http_get(p.metrics, "/readyz").expect("readyz"),
        (200, "ready".into())
    );

    let channel = plain_channel(p.grpc).await;
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "bigfleet.v1alpha1.CapacityProvider"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health check")
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner();
    let first = watch.message().await.expect("watch").expect("first status");
    assert_eq!(first.status, ServingStatus::Serving as i32);

    p.signal(libc::SIGTERM);

    // gRPC health flips to NOT_SERVING on the open watch.
    let flipped = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match watch.message().await {
                Ok(Some(m)) if m.status == ServingStatus::NotServing as i32 => return true,
                Ok(Some(_)) => continue,
                _ => return false,
            }
        }
    })
    .await
    .unwrap_or(false);
    assert!(
        flipped,
        "health watch never reported NOT_SERVING:\n{}",
        p.stderr()
    );
    // /readyz answers 503 `not ready` (or the listener is already gone).
    Wait::new(
        "/readyz to leave 200 after SIGTERM",
        Duration::from_secs(10),
    )
    .every(POLL)
    .try_ok_blocking(|| match http_get(p.metrics, "/readyz") {
        Ok((503, body)) => {
            assert_eq!(body, "not ready");
            Ok(())
        }
        Err(_) => Ok(()),
        Ok((200, _)) => Err(()),
        Ok(other) => panic!("/readyz during shutdown: {other:?}"),
    })
    .unwrap_or_else(|_| panic!("/readyz still 200 after SIGTERM"));
    drop(watch);
    drop(health);
    drop(channel);

    let status = p
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("no exit after SIGTERM:\n{}", p.stderr()));
    assert!(status.success(), "exit {status:?}:\n{}", p.stderr());
    let logs = p.stderr();
    assert!(
        logs.lines()
            .any(|l| l.contains("level=info") && l.contains("shutdown requested")),
        "{logs}"
    );
    assert!(
        logs.lines().last().is_some_and(|l| l.contains("stopped")),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_a_health_watch_is_open_still_exits() {
    let mut p = Provider::start(&["--use-fake-backend", "--seed-count", "2"]);
    let mut health = HealthClient::new(plain_channel(p.grpc).await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner();
    watch.message().await.expect("watch").expect("first status");
    p.signal(libc::SIGTERM);
    // The client keeps its stream open, as a long-lived watcher would.
    let status = p.wait_exit(Duration::from_secs(30));
    drop(watch);
    let status =
        status.unwrap_or_else(|| panic!("an open health watch blocks shutdown:\n{}", p.stderr()));
    assert!(status.success(), "{status:?}");
}

// ---------------------------------------------------------------------------
// The panic layer, in-process: a handler that panics on Get.

struct PanicsOnGet;

#[tonic::async_trait]
impl CapacityProvider for PanicsOnGet {
    async fn create(
        &self,
        _: Request<serving::CreateRequest>,
    ) -> Result<Response<serving::TransitionAck>, Status> {
        Err(Status::unimplemented("create"))
    }
    async fn configure(
        &self,
        _: Request<serving::ConfigureRequest>,
    ) -> Result<Response<serving::TransitionAck>, Status> {
        Err(Status::unimplemented("configure"))
    }
    async fn drain(
        &self,
        _: Request<serving::DrainRequest>,
    ) -> Result<Response<serving::TransitionAck>, Status> {
        Err(Status::unimplemented("drain"))
    }
    async fn delete(
        &self,
        _: Request<serving::DeleteRequest>,
    ) -> Result<Response<serving::TransitionAck>, Status> {
        Err(Status::unimplemented("delete"))
    }
    async fn get(
        &self,
        request: Request<serving::MachineRef>,
    ) -> Result<Response<EncodedMachine>, Status> {
        panic!("boom on Get {}", request.into_inner().id);
    }
    async fn list(
        &self,
        _: Request<serving::ListFilter>,
    ) -> Result<Response<EncodedMachineList>, Status> {
        Ok(Response::new(EncodedMachineList::default()))
    }
}

#[tokio::test]
async fn panicking_handler_answers_internal_and_the_server_survives() {
    let metrics = Metrics::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Same layer order as the binary: observe outside, catch panics inside.
    let server = tonic::transport::Server::builder()
        .layer(ObserveLayer::new(metrics.clone()))
        .layer(CatchPanicLayer {
            metrics: metrics.clone(),
        })
        .add_service(CapacityProviderServer::new(PanicsOnGet))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let server = tokio::spawn(server);

    let mut client = CapacityProviderClient::new(plain_channel(addr).await);
    let get = |id: &str| MachineRef { id: id.into() };
    let first = client.get(get("m-1")).await.expect_err("Get panics");
    assert_eq!(first.code(), Code::Internal, "{first:?}");
    assert!(
        !first.message().contains("boom"),
        "panic detail leaked to the client"
    );
    let exp = parse_exposition(&metrics.encode(Format::OpenMetrics).expect("encode"))
        .expect("valid exposition");
    assert_eq!(exp.must("bigfleet_proxmox_panics_total", &[]), 1.0);
    assert_eq!(
        exp.must(
            "bigfleet_proxmox_grpc_requests_total",
            &[("method", "Get"), ("code", "Internal")]
        ),
        1.0
    );

    // Still serving, on the same connection and a fresh one.
    client
        .list(ListFilter::default())
        .await
        .expect("List after a panic");
    let mut fresh = CapacityProviderClient::new(plain_channel(addr).await);
    fresh
        .list(ListFilter::default())
        .await
        .expect("List on a new connection");
    let second = fresh.get(get("m-2")).await.expect_err("Get panics again");
    assert_eq!(second.code(), Code::Internal);
    let exp = parse_exposition(&metrics.encode(Format::OpenMetrics).expect("encode"))
        .expect("valid exposition");
    assert_eq!(exp.must("bigfleet_proxmox_panics_total", &[]), 2.0);
    assert!(!server.is_finished(), "the server stopped after a panic");
    server.abort();
}

/// Nobody reads the provider's stderr: once the pipe is full, a blocking
/// logger would stall every RPC that logs. Thousands of Creates (two info
/// lines each, far more than a pipe holds) must still be acknowledged and
/// land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_log_pipe_does_not_stall_rpcs() {
    const MACHINES: usize = 3000;
    let (held, addr) = common::held_listener();
    drop(held);
    let mut child = std::process::Command::new(common::BIN)
        .args([
            "--use-fake-backend",
            "--fake-latency",
            "0",
            "--metrics-addr",
            "",
        ])
        .args(["--seed-count", &MACHINES.to_string()])
        .args(["--addr", &addr.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn bigfleet-proxmox");
    // Held open and never read.
    let _stderr = child.stderr.take().expect("stderr");
    let result = tokio::time::timeout(Duration::from_secs(120), async {
        // The port answers UNAVAILABLE while start-up runs: wait for a
        // List that succeeds (the log, which would say when, is not read).
        let (mut client, listed) = Wait::new(
            format!("the provider to serve on {addr}"),
            common::STARTUP_DEADLINE,
        )
        .every(POLL)
        .ok_async(|| async {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .expect("endpoint")
                .connect()
                .await
                .map_err(|e| e.to_string())?;
            let mut client = CapacityProviderClient::new(channel);
            let listed = client
                .list(ListFilter::default())
                .await
                .map_err(|s| s.to_string())?;
            Ok::<_, String>((client, listed))
        })
        .await;
        let ids: Vec<String> = listed
            .into_inner()
            .machines
            .into_iter()
            .map(|m| m.id)
            .collect();
        assert_eq!(ids.len(), MACHINES);
        for id in &ids {
            client
                .create(CreateRequest {
                    machine_id: id.clone(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|s| panic!("Create {id}: {s}"));
        }
        // Bounded by the timeout around this block, whose failure names
        // the stall; this wait's own bound is past it.
        Wait::new(
            format!("all {MACHINES} machines IDLE"),
            Duration::from_secs(240),
        )
        .every(POLL)
        .ok_async(|| {
            let mut client = client.clone();
            async move {
                let idle = client
                    .list(ListFilter {
                        states: vec![MachineState::Idle as i32],
                        ..Default::default()
                    })
                    .await
                    .expect("List IDLE")
                    .into_inner()
                    .machines
                    .len();
                if idle == MACHINES {
                    Ok(())
                } else {
                    Err(idle)
                }
            }
        })
        .await;
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    result.expect("RPCs stalled behind the unread log pipe");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpc_warnings_name_the_machine_and_the_status_message() {
    let p = Provider::start(&["--use-fake-backend", "--seed-count", "2"]);
    let mut c = p.client().await;
    let id = common::speculative_id(&mut c).await;
    let refused = c
        .delete(DeleteRequest {
            machine_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect_err("Delete of a SPECULATIVE machine");
    assert_eq!(refused.code(), Code::Aborted);
    // The blob follows the machine id on the wire; it must not reach the line.
    let refused = c
        .configure(ConfigureRequest {
            machine_id: id.clone(),
            cluster_id: "cluster-obs".into(),
            bootstrap_blob: format!("{SECRET_BLOB}{}", "x".repeat(64 * 1024)).into_bytes(),
            ..Default::default()
        })
        .await
        .expect_err("Configure of a SPECULATIVE machine");
    assert_eq!(refused.code(), Code::Aborted);
    for method in ["Delete", "Configure"] {
        let line = p
            .logs
            .wait_for(LIFECYCLE_DEADLINE, |l| {
                l.contains(" msg=rpc") && field(l, "method").as_deref() == Some(method)
            })
            .unwrap_or_else(|| panic!("no {method} line:\n{}", p.stderr()));
        assert!(line.contains("level=warn"), "{line}");
        assert_eq!(field(&line, "code").as_deref(), Some("Aborted"), "{line}");
        assert_eq!(
            field(&line, "machine_id").as_deref(),
            Some(id.as_str()),
            "{line}"
        );
        assert_eq!(
            field(&line, "error"),
            Some(format!(
                "machine {id:?} is SPECULATIVE; {method} needs IDLE"
            )),
            "{line}"
        );
        assert!(!line.contains(SECRET_BLOB), "{line}");
    }
}
