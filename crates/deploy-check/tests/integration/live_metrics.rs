//! A live scrape of the provider passes `promtool check metrics`, and every
//! `bigfleet_proxmox_*` family it exposes is in docs/observability.md's
//! catalogue with the documented type and labels.
//!
//! Boots the built provider (`cargo build -p bigfleet-proxmox`) on the fake
//! backend, bound to 127.0.0.1 only, waits for /readyz, serves a few RPCs
//! through `bigfleet-proxmox ctl` so the gRPC series exist, and GETs /metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use deploy_check::monitoring::{catalogue, openmetrics_to_text, read, MACHINE_STATES};
use deploy_check::tools::{find_or_skip, provider_binary, PROMTOOL_INSTALL};
use provider_testkit::http::{get, Response};

struct Provider {
    child: Child,
    grpc_addr: String,
    metrics_addr: SocketAddr,
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the provider and returns once its serving line names the bound
/// metrics address (the port is picked by the kernel: `127.0.0.1:0`).
fn start() -> Provider {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(&bin)
        .args([
            "--use-fake-backend",
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--fake-latency",
            "1ms",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (grpc_addr, metrics_addr) = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let addrs = provider_testkit::is_startup_line(&line)
                    .then(|| {
                        let grpc = provider_testkit::addr_field(&line, "addr").ok()?;
                        let metrics = provider_testkit::addr_field(&line, "metrics_addr").ok()?;
                        Some((grpc.to_string(), metrics))
                    })
                    .flatten();
                seen.push(line);
                if let Some(a) = addrs {
                    break a;
                }
            }
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the provider did not log its serving line:\n{}",
                    seen.join("\n")
                );
            }
        }
    };
    Provider {
        child,
        grpc_addr,
        metrics_addr,
    }
}

/// Polls /readyz until it answers 200 (the provider flips it once serving).
fn wait_ready(p: &mut Provider) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = get(p.metrics_addr, "/readyz") {
            if r.status == 200 {
                return;
            }
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            panic!("the provider exited before turning ready: {status}");
        }
        assert!(Instant::now() < deadline, "/readyz never answered 200");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `bigfleet-proxmox ctl --target <provider> <args>`: (success, stdout+stderr).
fn ctl(p: &Provider, args: &[&str]) -> (bool, String) {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(bin)
        .args(["ctl", "--target", &p.grpc_addr])
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

fn scrape() -> Response {
    let mut p = start();
    wait_ready(&mut p);
    // A List that succeeds and a Get that is NotFound, so the gRPC families
    // have series (they appear with the first request).
    let (ok, out) = ctl(&p, &["list", "--max", "3"]);
    assert!(ok, "ctl list failed: {out}");
    let (ok, out) = ctl(&p, &["get", "no-such-machine"]);
    assert!(!ok, "ctl get of an unknown machine succeeded: {out}");
    let r = get(p.metrics_addr, "/metrics").expect("GET /metrics");
    assert_eq!(r.status, 200, "{}", r.body);
    for want in [
        r#"method="List",code="OK""#,
        r#"method="Get",code="NotFound""#,
    ] {
        assert!(
            r.body
                .lines()
                .any(|l| l.starts_with("bigfleet_proxmox_grpc_requests_total{") && l.contains(want)),
            "no bigfleet_proxmox_grpc_requests_total{{{want}}} in the scrape:\n{}",
            r.body
        );
    }
    r
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
    let (ok, report) = lint(&promtool, &openmetrics_to_text(bad));
    assert!(!ok, "promtool accepted a counter without _total");
    assert!(report.contains("_total"), "{report}");
}

#[test]
fn live_scrape_passes_promtool_check_metrics() {
    let Some(promtool) = find_or_skip(
        "promtool",
        PROMTOOL_INSTALL,
        "promtool check metrics on a live scrape",
    ) else {
        return;
    };
    let r = scrape();
    let content_type = r.headers.get("content-type").cloned().unwrap_or_default();
    let lint = |text: &str| lint(&promtool, text);

    if content_type.starts_with("application/openmetrics-text") {
        // promtool check metrics reads only the Prometheus text format. In
        // OpenMetrics a counter family `x` has samples `x_total`, which that
        // parser sees as an untyped family without HELP. Those complaints, and
        // only those, are the format's; everything else must be clean.
        let (_, raw_report) = lint(&r.body);
        let counters: BTreeSet<String> = families(&r.body)
            .into_iter()
            .filter(|(_, (t, _))| t == "counter")
            .map(|(n, _)| format!("{n}_total"))
            .collect();
        for line in raw_report.lines().filter(|l| !l.trim().is_empty()) {
            let format_only = line
                .strip_suffix(" no help text")
                .is_some_and(|m| counters.contains(m.trim()));
            assert!(
                format_only,
                "promtool check metrics complains about the raw OpenMetrics scrape beyond the \
                 format difference: {line}\n{raw_report}"
            );
        }
        eprintln!(
            "raw OpenMetrics scrape, complaints that are only the format difference:\n{raw_report}"
        );
        let (ok, report) = lint(&openmetrics_to_text(&r.body));
        assert!(
            ok && report.trim().is_empty(),
            "promtool check metrics on the scrape (as Prometheus text):\n{report}"
        );
    } else {
        let (ok, report) = lint(&r.body);
        assert!(
            ok && report.trim().is_empty(),
            "promtool check metrics:\n{report}"
        );
    }
}

#[test]
fn live_scrape_matches_the_documented_catalogue() {
    let r = scrape();
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
