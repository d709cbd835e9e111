//! A live scrape of the provider passes `promtool check metrics` as it is
//! served (the Prometheus text format, nothing rewritten), its OpenMetrics
//! answer passes the OpenMetrics parser of Prometheus' own Python client with
//! the same families and series, and every `bigfleet_proxmox_*` family it
//! exposes is in docs/observability.md's catalogue with the documented type
//! and labels.
//!
//! Boots the built provider (`cargo build -p bigfleet-proxmox`) on the fake
//! backend, bound to 127.0.0.1 only, checks /readyz, serves a few RPCs
//! through `bigfleet-proxmox ctl` so the gRPC series exist, and GETs /metrics
//! twice: with no `Accept`, as `curl` does, and asking for OpenMetrics, as
//! Prometheus does.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::process::{Command, Stdio};

use deploy_check::monitoring::{catalogue, read, MACHINE_STATES};
use deploy_check::tools::{
    find_or_skip, provider_binary, python_module_or_skip, PROMETHEUS_CLIENT_INSTALL,
    PROMTOOL_INSTALL,
};
use provider_testkit::http::{get, get_accepting, Response};

use crate::common::{start_provider, Provider};

/// Reads an exposition with Prometheus' Python client (see its docstring).
const EXPOSITION_PY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/exposition.py");
/// What Prometheus 2.x sends: OpenMetrics preferred, the text format accepted.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,\
                                 application/openmetrics-text;version=0.0.1;q=0.75,\
                                 text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// The provider on the fake backend, bound to 127.0.0.1 (the ports picked
/// by the kernel), once it has logged its serving line.
fn start() -> Provider {
    let args = [
        "--use-fake-backend",
        "--addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--fake-latency",
        "1ms",
    ]
    .map(String::from);
    start_provider(&args).unwrap_or_else(|e| panic!("the provider did not start: {e}"))
}

/// `bigfleet-proxmox ctl --target <provider> <args>`: (success, stdout+stderr).
fn ctl(p: &Provider, args: &[&str]) -> (bool, String) {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(bin)
        .args(["ctl", "--target", &p.grpc])
        .args(args)
        .output()
        .expect("run bigfleet-proxmox ctl");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The same provider scraped twice: as `curl` does and as Prometheus does.
struct Scrapes {
    text: Response,
    openmetrics: Response,
}

fn scrape() -> Scrapes {
    let p = start();
    let metrics = p
        .metrics
        .expect("the serving line names the metrics listener");
    // The provider turns ready before it logs its serving line.
    let ready = get(metrics, "/readyz").expect("GET /readyz");
    assert_eq!(ready.status, 200, "not ready once serving: {}", ready.body);
    // A List that succeeds and a Get that is NotFound, so the gRPC families
    // have series (they appear with the first request).
    let (ok, out) = ctl(&p, &["list", "--max", "3"]);
    assert!(ok, "ctl list failed: {out}");
    let (ok, out) = ctl(&p, &["get", "no-such-machine"]);
    assert!(!ok, "ctl get of an unknown machine succeeded: {out}");
    let scrape = |accept: Option<&str>| {
        let r = match accept {
            None => get(metrics, "/metrics"),
            Some(accept) => get_accepting(metrics, "/metrics", accept),
        }
        .expect("GET /metrics");
        assert_eq!(r.status, 200, "{}", r.body);
        for want in [
            r#"method="List",code="OK""#,
            r#"method="Get",code="NotFound""#,
        ] {
            assert!(
                r.body
                    .lines()
                    .any(|l| l.starts_with("bigfleet_proxmox_grpc_requests_total{")
                        && l.contains(want)),
                "no bigfleet_proxmox_grpc_requests_total{{{want}}} in the scrape:\n{}",
                r.body
            );
        }
        r
    };
    Scrapes {
        text: scrape(None),
        openmetrics: scrape(Some(PROMETHEUS_ACCEPT)),
    }
}

/// Families as name -> (type, label names seen), from `# TYPE` and samples.
fn families(text: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
    let mut out: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
    for l in text.lines() {
        if let Some((name, kind)) = l.strip_prefix("# TYPE ").and_then(|r| r.split_once(' ')) {
            out.entry(name.to_owned()).or_default().0 = kind.trim().to_owned();
        }
    }
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let name: String = l
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let family = out
            .keys()
            .filter(|f| name.starts_with(f.as_str()))
            .max_by_key(|f| f.len())
            .cloned();
        let Some(family) = family else { continue };
        if let Some(labels) = l
            .split_once('{')
            .and_then(|(_, r)| r.split_once('}'))
            .map(|(ls, _)| ls)
        {
            for kv in labels.split(',').filter(|kv| !kv.is_empty()) {
                let k = kv.split('=').next().unwrap().trim();
                if k != "le" && k != "quantile" {
                    out.get_mut(&family).unwrap().1.insert(k.to_owned());
                }
            }
        }
    }
    out
}

/// The label values of `label` on samples of `metric`.
fn label_values(text: &str, metric: &str, label: &str) -> BTreeSet<String> {
    let key = format!("{label}=\"");
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter_map(|l| {
            let i = l.find(&key)?;
            Some(
                l[i + key.len()..]
                    .chars()
                    .take_while(|c| *c != '"')
                    .collect(),
            )
        })
        .collect()
}

/// `promtool check metrics` on `text`: (clean exit, report).
fn lint(promtool: &std::path::Path, text: &str) -> (bool, String) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool check metrics");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), report)
}

/// The lint the live scrape must pass does catch naming mistakes.
#[test]
fn promtool_check_metrics_catches_a_misnamed_counter() {
    let Some(promtool) = find_or_skip(
        "promtool",
        PROMTOOL_INSTALL,
        "promtool check metrics on a bad exposition",
    ) else {
        return;
    };
    let bad = "# HELP bigfleet_proxmox_things Things.\n# TYPE bigfleet_proxmox_things counter\n\
               bigfleet_proxmox_things 1\n";
    let (ok, report) = lint(&promtool, bad);
    assert!(!ok, "promtool accepted a counter without _total");
    assert!(report.contains("_total"), "{report}");
}

/// `curl -s :9090/metrics | promtool check metrics`, exactly.
#[test]
fn live_scrape_passes_promtool_check_metrics() {
    let Some(promtool) = find_or_skip(
        "promtool",
        PROMTOOL_INSTALL,
        "promtool check metrics on a live scrape",
    ) else {
        return;
    };
    let r = scrape().text;
    assert_eq!(
        r.headers.get("content-type").map(String::as_str),
        Some("text/plain; version=0.0.4; charset=utf-8"),
        "a scrape without Accept gets the Prometheus text format"
    );
    let (ok, report) = lint(&promtool, &r.body);
    assert!(
        ok && report.trim().is_empty(),
        "promtool check metrics:\n{report}\n--- scrape:\n{}",
        r.body
    );
}

/// One family as Prometheus' Python client parsed it.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ParsedFamily {
    name: String,
    kind: String,
    /// Series: sample name and labels (values differ between two scrapes).
    series: BTreeSet<(String, BTreeMap<String, String>)>,
}

/// Parses `exposition` with the client's `format` parser (`text` or
/// `openmetrics`); the error is the parser's reason.
fn parse_with_prometheus_client(
    format: &str,
    exposition: &str,
) -> Result<Vec<ParsedFamily>, String> {
    let mut child = Command::new("python3")
        .args([EXPOSITION_PY, format])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3 exposition.py");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(exposition.as_bytes())
        .expect("write the exposition");
    let out = child.wait_with_output().expect("exposition.py ran");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let mut families = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let f: serde_json::Value = serde_json::from_str(line).expect("exposition.py prints JSON");
        let series = f["samples"]
            .as_array()
            .expect("samples")
            .iter()
            .map(|s| {
                let labels = s["labels"]
                    .as_object()
                    .expect("labels")
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                    .collect();
                (s["name"].as_str().unwrap_or_default().to_owned(), labels)
            })
            .collect();
        families.push(ParsedFamily {
            name: f["name"].as_str().unwrap_or_default().to_owned(),
            kind: f["type"].as_str().unwrap_or_default().to_owned(),
            series,
        });
    }
    families.sort();
    Ok(families)
}

/// The parser the OpenMetrics check relies on does reject what promtool
/// cannot see in that format.
#[test]
fn prometheus_client_rejects_bad_openmetrics() {
    if !python_module_or_skip(
        "prometheus_client",
        PROMETHEUS_CLIENT_INSTALL,
        "the OpenMetrics parser on bad expositions",
    ) {
        return;
    }
    let good = "# HELP a x.\n# TYPE a counter\na_total{k=\"v\"} 1\n# EOF\n";
    let parsed = parse_with_prometheus_client("openmetrics", good).expect("a good exposition");
    assert_eq!(parsed.len(), 1);
    assert_eq!(
        (parsed[0].name.as_str(), parsed[0].kind.as_str()),
        ("a", "counter")
    );
    for (bad, why) in [
        ("# HELP a x.\n# TYPE a counter\na_total 1\n", "EOF"),
        ("# HELP a x.\n# TYPE a counter\na 1\n# EOF\n", "Clashing name"),
        (
            "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\nh_sum 0\n# EOF\n",
            "out of order",
        ),
    ] {
        let err = parse_with_prometheus_client("openmetrics", bad).expect_err(bad);
        assert!(err.contains(why), "{bad:?}: {err}");
    }
}

/// Prometheus' Accept gets OpenMetrics, valid for the strict parser, with the
/// very families and series of the text answer.
#[test]
fn live_openmetrics_scrape_passes_the_prometheus_client_parser() {
    if !python_module_or_skip(
        "prometheus_client",
        PROMETHEUS_CLIENT_INSTALL,
        "the OpenMetrics parser on a live scrape",
    ) {
        return;
    }
    let s = scrape();
    assert_eq!(
        s.openmetrics
            .headers
            .get("content-type")
            .map(String::as_str),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "Prometheus' Accept gets OpenMetrics"
    );
    let openmetrics = parse_with_prometheus_client("openmetrics", &s.openmetrics.body)
        .unwrap_or_else(|e| panic!("{e}\n--- scrape:\n{}", s.openmetrics.body));
    let text = parse_with_prometheus_client("text", &s.text.body)
        .unwrap_or_else(|e| panic!("{e}\n--- scrape:\n{}", s.text.body));
    assert!(
        openmetrics
            .iter()
            .filter(|f| f.name.starts_with("bigfleet_proxmox_"))
            .count()
            >= 3,
        "{openmetrics:#?}"
    );
    assert_eq!(openmetrics, text, "the two formats carry different data");
}

#[test]
fn live_scrape_matches_the_documented_catalogue() {
    let r = scrape().text;
    let scraped = families(&r.body);
    let docs = catalogue(&read("docs/observability.md"));
    let documented: BTreeMap<&str, _> = docs.iter().map(|e| (e.name.as_str(), e)).collect();
    let mut checked = 0;
    for (family, (kind, labels)) in &scraped {
        if !family.starts_with("bigfleet_proxmox_") {
            continue;
        }
        // The docs name counters by their series (`_total`), as PromQL sees them.
        let name = if kind == "counter" && !family.ends_with("_total") {
            format!("{family}_total")
        } else {
            family.clone()
        };
        let entry = documented
            .get(name.as_str())
            .unwrap_or_else(|| panic!("{name} is exposed but not in docs/observability.md"));
        assert_eq!(&entry.kind, kind, "{name}: documented type");
        for l in labels {
            assert!(
                entry.labels.contains(l),
                "{name}: label {l} is not documented (documented: {:?})",
                entry.labels
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 3,
        "only {checked} provider families in the scrape"
    );
    // The machine gauge's state values are the wire names the rules match on.
    for s in label_values(&r.body, "bigfleet_proxmox_machines", "state") {
        assert!(
            MACHINE_STATES.contains(&s.as_str()),
            "bigfleet_proxmox_machines has state={s}, not one of {MACHINE_STATES:?}"
        );
    }
}
