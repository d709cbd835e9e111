//! The examples in docs/ are real: YAML and JSON blocks parse, the values
//! example in install.md renders through the chart, the offerings and
//! instance-type examples follow the documented schema, and every metric
//! name the docs use is one the provider exports.

use std::collections::BTreeSet;

use deploy_check::helm::{Chart, Release};
use deploy_check::manifests::fences;
use deploy_check::workspace_root;
use serde_json::Value as Json;

/// The metric catalogue, as the spec names it.
const METRICS: &[(&str, &str)] = &[
    ("bigfleet_proxmox_api_calls_total", "counter"),
    ("bigfleet_proxmox_api_errors_total", "counter"),
    ("bigfleet_proxmox_api_duration_seconds", "histogram"),
    ("bigfleet_proxmox_grpc_requests_total", "counter"),
    (
        "bigfleet_proxmox_grpc_request_duration_seconds",
        "histogram",
    ),
    ("bigfleet_proxmox_panics_total", "counter"),
    ("bigfleet_proxmox_reconcile_total", "counter"),
    ("bigfleet_proxmox_log_lines_dropped_total", "counter"),
    ("bigfleet_proxmox_machines", "gauge"),
    ("bigfleet_proxmox_identity_rejected_total", "counter"),
    ("bigfleet_proxmox_destroy_leftover_volumes_total", "counter"),
    ("bigfleet_proxmox_resumed_total", "counter"),
    ("bigfleet_proxmox_leader", "gauge"),
    ("bigfleet_proxmox_node_memory_committed_bytes", "gauge"),
    ("bigfleet_proxmox_node_memory_limit_bytes", "gauge"),
    ("bigfleet_proxmox_storage_avail_bytes", "gauge"),
    ("bigfleet_proxmox_storage_allowed_bytes", "gauge"),
    ("bigfleet_proxmox_storage_in_flight_bytes", "gauge"),
    ("bigfleet_proxmox_node_up", "gauge"),
    ("bigfleet_proxmox_clone_slots", "gauge"),
    ("bigfleet_proxmox_clone_slots_used", "gauge"),
    ("bigfleet_proxmox_clone_slots_waiting", "gauge"),
    ("bigfleet_proxmox_clone_pace_seconds", "gauge"),
    ("bigfleet_proxmox_step_duration_seconds", "histogram"),
    ("bigfleet_proxmox_pve_requests_total", "counter"),
];

fn doc(name: &str) -> String {
    std::fs::read_to_string(workspace_root().join("docs").join(name))
        .unwrap_or_else(|e| panic!("docs/{name}: {e}"))
}

fn all_docs() -> Vec<(String, String)> {
    let mut names: Vec<String> = std::fs::read_dir(workspace_root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .collect();
    names.sort();
    names.into_iter().map(|n| (n.clone(), doc(&n))).collect()
}

#[test]
fn docs_list_every_page() {
    let index = doc("index.md");
    for page in [
        "install.md",
        "configuration.md",
        "credentials.md",
        "observability.md",
        "security.md",
        "troubleshooting.md",
        "certification.md",
    ] {
        assert!(
            index.contains(&format!("({page})")),
            "index.md does not link {page}"
        );
        assert!(!doc(page).is_empty());
    }
}

#[test]
fn relative_links_resolve() {
    for (name, text) in all_docs() {
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(0)];
            if target.starts_with('#') || target.contains("://") || target.is_empty() {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let linked = doc(file);
            if !anchor.is_empty() {
                // GitHub-style anchors: lowercase, spaces to '-', punctuation dropped.
                let anchors: BTreeSet<String> = linked
                    .lines()
                    .filter_map(|l| l.strip_prefix('#'))
                    .map(|h| {
                        h.trim_start_matches('#')
                            .trim()
                            .to_lowercase()
                            .chars()
                            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                            .map(|c| if c == ' ' { '-' } else { c })
                            .collect()
                    })
                    .collect();
                assert!(
                    anchors.contains(anchor),
                    "{name}: link {target}: no heading #{anchor}"
                );
            }
        }
    }
}

#[test]
fn yaml_and_json_blocks_parse() {
    let mut yaml_blocks = 0;
    for (name, text) in all_docs() {
        for (lang, body, line) in fences(&text) {
            let body = dedent(&body);
            match lang.as_str() {
                "yaml" => {
                    yaml_blocks += 1;
                    serde_yaml::from_str::<serde_yaml::Value>(&body)
                        .unwrap_or_else(|e| panic!("{name}:{line}: YAML does not parse: {e}"));
                }
                "json" => {
                    serde_json::from_str::<Json>(&body)
                        .unwrap_or_else(|e| panic!("{name}:{line}: JSON does not parse: {e}"));
                }
                _ => {}
            }
        }
    }
    assert!(
        yaml_blocks >= 4,
        "expected the values, scrape and alert examples"
    );
}

fn dedent(body: &str) -> String {
    let indent = body
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    body.lines()
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn install_values_example_renders() {
    let text = doc("install.md");
    let (_, body, line) = fences(&text)
        .into_iter()
        .find(|(lang, body, _)| lang == "yaml" && body.contains("credentials:"))
        .expect("a values example in install.md");
    let chart = Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")).unwrap();
    let values: serde_yaml::Value = serde_yaml::from_str(&body).unwrap();
    let docs = chart
        .render(&values, &Release::default())
        .unwrap_or_else(|e| panic!("install.md:{line}: the example values do not render: {e}"));
    let cm = docs
        .iter()
        .find(|d| d.yaml.contains("kind: ConfigMap"))
        .expect("offerings ConfigMap");
    let cm: serde_yaml::Value = serde_yaml::from_str(&cm.yaml).unwrap();
    let offerings: Json =
        serde_json::from_str(cm["data"]["offerings.json"].as_str().unwrap()).unwrap();
    check_offerings(&offerings, "install.md");
}

fn check_offerings(v: &Json, at: &str) {
    let arr = v
        .as_array()
        .unwrap_or_else(|| panic!("{at}: offerings must be an array"));
    assert!(!arr.is_empty());
    for o in arr {
        let m = o.as_object().unwrap();
        for k in m.keys() {
            assert!(
                [
                    "instance_type",
                    "zone",
                    "capacity_type",
                    "count",
                    "resources",
                    "labels"
                ]
                .contains(&k.as_str()),
                "{at}: unknown offering field {k}"
            );
        }
        assert!(!m["instance_type"].as_str().unwrap().is_empty());
        assert!(!m["zone"].as_str().unwrap().is_empty());
        assert!(m["count"].as_i64().unwrap() > 0);
    }
}

#[test]
fn configuration_file_examples_follow_the_schema() {
    let text = doc("configuration.md");
    let blocks: Vec<Json> = fences(&text)
        .into_iter()
        .filter(|(lang, _, _)| lang == "json")
        .map(|(_, b, _)| serde_json::from_str(&b).unwrap())
        .collect();
    let offerings = blocks
        .iter()
        .find(|b| b.is_array())
        .expect("offerings example");
    check_offerings(offerings, "configuration.md");
    let types = blocks
        .iter()
        .find(|b| b.is_object())
        .expect("instance-types example");
    for (name, t) in types.as_object().unwrap() {
        let t = t.as_object().unwrap();
        for k in t.keys() {
            assert!(
                [
                    "vcpu",
                    "memory_mib",
                    "template_vmid",
                    "storage",
                    "balloon_mib",
                    "disk_gib",
                    "pci"
                ]
                .contains(&k.as_str()),
                "{name}: unknown field {k}"
            );
        }
        if let Some(pci) = t.get("pci") {
            let pci = pci.as_object().expect("pci is an object");
            assert!(pci["mapping"].is_string(), "{name}: pci.mapping");
            assert!(
                pci["count"].as_u64().is_some_and(|c| (1..=16).contains(&c)),
                "{name}: pci.count"
            );
            assert!(
                pci["resource"].as_str().is_some_and(|r| r.contains('/')),
                "{name}: pci.resource is DOMAIN/NAME"
            );
        }
        assert!(t["vcpu"].as_i64().unwrap() > 0, "{name}");
        assert!(t["memory_mib"].as_i64().unwrap() > 0, "{name}");
    }
}

/// `bigfleet_proxmox_*` identifiers in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("bigfleet_proxmox_") {
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

#[test]
fn metric_names_are_the_catalogue() {
    let mut allowed = BTreeSet::new();
    for (name, kind) in METRICS {
        allowed.insert(name.to_string());
        if *kind == "histogram" {
            for s in ["_bucket", "_sum", "_count"] {
                allowed.insert(format!("{name}{s}"));
            }
        }
    }
    for (name, text) in all_docs() {
        for m in metric_names(&text) {
            assert!(
                allowed.contains(&m),
                "{name}: {m} is not an exported metric"
            );
        }
    }
    // The observability page lists the whole catalogue with its types.
    let obs = doc("observability.md");
    for (name, kind) in METRICS {
        assert!(
            obs.contains(&format!("| `{name}` | {kind} |")),
            "observability.md does not list {name} as a {kind}"
        );
    }
    // The alert rules and the dashboard are checked in monitoring.rs beside this.
}

/// The values example of install.md, as a YAML value.
fn install_values() -> serde_yaml::Value {
    let (_, body, _) = fences(&doc("install.md"))
        .into_iter()
        .find(|(lang, body, _)| lang == "yaml" && body.contains("credentials:"))
        .expect("a values example in install.md");
    serde_yaml::from_str(&body).unwrap()
}

/// Renders install.md's values example with the first yaml block of `page`
/// that contains `needle` merged over it; returns the documents as JSON.
fn render_doc_example(page: &str, needle: &str) -> Vec<Json> {
    let (_, body, line) = fences(&doc(page))
        .into_iter()
        .find(|(lang, body, _)| lang == "yaml" && body.contains(needle))
        .unwrap_or_else(|| panic!("{page} has no yaml example with {needle}"));
    let mut values = install_values();
    deploy_check::helm::merge(&mut values, &serde_yaml::from_str(&body).unwrap());
    let chart = Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")).unwrap();
    chart
        .render(&values, &Release::default())
        .unwrap_or_else(|e| panic!("{page}:{line}: the example does not render: {e}"))
        .iter()
        .map(|d| serde_yaml::from_str(&d.yaml).unwrap())
        .collect()
}

#[test]
fn network_policy_example_renders() {
    let docs = render_doc_example("install.md", "networkPolicy:");
    let np = docs
        .iter()
        .find(|d| d["kind"] == "NetworkPolicy")
        .expect("a NetworkPolicy");
    let grpc = &np["spec"]["ingress"][0];
    assert_eq!(grpc["ports"][0]["port"], "grpc");
    let peer = &grpc["from"][0];
    assert_eq!(
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "bigfleet-system"
    );
    assert_eq!(
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "bigfleet"
    );
    assert_eq!(
        np["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]
            ["kubernetes.io/metadata.name"],
        "monitoring"
    );
}

#[test]
fn storage_example_renders_its_flag_and_catalog() {
    let docs = render_doc_example("install.md", "nodeStorage:");
    let dep = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment");
    let args: Vec<&str> = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Json::as_str)
        .collect();
    assert!(
        args.contains(&"--node-storage=pve1=local-lvm,pve2=fast-zfs"),
        "{args:?}"
    );
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .expect("the config ConfigMap");
    let types: Json =
        serde_json::from_str(cm["data"]["instance-types.json"].as_str().unwrap()).unwrap();
    assert_eq!(types["db.large"]["storage"], "nvme");
    // The install example's offerings still find their types.
    let offerings: Json =
        serde_json::from_str(cm["data"]["offerings.json"].as_str().unwrap()).unwrap();
    for o in offerings.as_array().unwrap() {
        let t = o["instance_type"].as_str().unwrap();
        assert!(
            types.get(t).is_some(),
            "offering type {t} not in the catalog"
        );
    }
}

#[test]
fn prometheus_operator_example_renders() {
    let docs = render_doc_example("observability.md", "serviceMonitor:");
    let kinds: BTreeSet<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for k in ["ServiceMonitor", "PrometheusRule"] {
        assert!(
            kinds.contains(k),
            "observability.md's example renders no {k}"
        );
    }
    assert!(docs
        .iter()
        .any(|d| d["kind"] == "ConfigMap" && d["metadata"]["labels"]["grafana_dashboard"] == "1"));
    let svc = docs.iter().find(|d| d["kind"] == "Service").unwrap();
    assert!(
        svc["metadata"]["annotations"].is_null(),
        "prometheusScrape: false drops the scrape annotations"
    );
}

#[test]
fn values_reference_names_every_value() {
    let text = doc("install.md");
    // First cells of the reference table, `a.b.c` and shorthand `.d` (a
    // sibling of the previous full name) expanded.
    let mut documented = BTreeSet::new();
    let start = text
        .find("### Values reference")
        .expect("a values reference");
    for line in text[start..].lines().skip(1) {
        if line.starts_with('#') {
            break;
        }
        let Some(cell) = line.strip_prefix('|').and_then(|l| l.split('|').next()) else {
            continue;
        };
        let mut parent = String::new();
        for name in cell.split('`').skip(1).step_by(2) {
            if let Some(short) = name.strip_prefix('.') {
                documented.insert(format!("{parent}.{short}"));
            } else {
                parent = name.rsplit_once('.').map_or("", |(p, _)| p).to_owned();
                documented.insert(name.to_owned());
            }
        }
    }
    let chart = Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")).unwrap();
    fn check(v: &serde_yaml::Value, path: &str, documented: &BTreeSet<String>) {
        if documented.contains(path) {
            return;
        }
        match v.as_mapping() {
            Some(m) if !m.is_empty() => {
                for (k, sub) in m {
                    let k = k.as_str().unwrap();
                    let p = if path.is_empty() {
                        k.to_owned()
                    } else {
                        format!("{path}.{k}")
                    };
                    check(sub, &p, documented);
                }
            }
            _ => panic!("values.yaml's {path} is not in install.md's values reference"),
        }
    }
    check(&chart.values, "", &documented);
}
