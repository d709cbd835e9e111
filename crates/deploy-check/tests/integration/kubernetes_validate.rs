//! The manifests `make chart-render` writes (the chart's defaults and every
//! values example in docs/) pass `kubernetes-validate --strict`, Kubernetes'
//! own OpenAPI schemas as that PyPI package ships them, for every Kubernetes
//! minor version Chart.yaml's `kubeVersion` claims; and the Prometheus
//! Operator objects among them have their documented shape (no package ships
//! the operator's CRD schema, so `deploy_check::operator` checks them field
//! by field).
//!
//! Without `kubernetes-validate` the validation is skipped with the install
//! command, except under `CI=true` (`.ci/run` installs it), where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use deploy_check::helm::Chart;
use deploy_check::manifests::{self, claimed_kube_minors};
use deploy_check::operator;
use deploy_check::tools::find_or_skip;
use deploy_check::workspace_root;

/// How CI installs the validator, pinned: the Kubernetes versions it ships
/// schemas for are those of its release.
const KUBERNETES_VALIDATE_INSTALL: &str = "python3 -m pip install kubernetes-validate==1.37.0";

fn chart() -> Chart {
    Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")).expect("the chart loads")
}

fn rendered(dir: &Path) -> Vec<PathBuf> {
    manifests::write(&chart(), &workspace_root(), dir).unwrap_or_else(|e| panic!("{e}"))
}

/// `kubernetes-validate --strict -k <version> FILES...`: (exit code, output).
fn validate(tool: &Path, version: &str, files: &[PathBuf]) -> (Option<i32>, String) {
    let out = Command::new(tool)
        .args(["--strict", "--kubernetes-version", version])
        .args(files)
        .output()
        .expect("run kubernetes-validate");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Every rendered document as JSON, with the file it is in.
fn documents(files: &[PathBuf]) -> Vec<(PathBuf, serde_json::Value)> {
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).expect("read a rendered file");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let json: serde_json::Value =
                serde::Deserialize::deserialize(doc).expect("rendered YAML parses");
            if !json.is_null() {
                out.push((f.clone(), json));
            }
        }
    }
    out
}

#[test]
fn chart_claims_a_closed_range_of_kubernetes_versions() {
    let minors = claimed_kube_minors(&chart()).unwrap_or_else(|e| panic!("{e}"));
    // NetworkPolicy's namespace label and seccompProfile need 1.25.
    assert!(minors.first().is_some_and(|&m| m >= 25), "{minors:?}");
}

#[test]
fn render_writes_the_defaults_and_every_documented_example() {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = rendered(dir.path());
    let names: Vec<String> = files
        .iter()
        .map(|f| {
            f.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    // The chart's defaults, three replicas on PostgreSQL, install.md's
    // values and its fragments, observability.md's Prometheus Operator
    // example.
    for want in [
        "default.yaml",
        "postgres-ha.yaml",
        "install-1.yaml",
        "install-2.yaml",
        "install-3.yaml",
        "observability-1.yaml",
    ] {
        assert!(names.contains(&want.to_owned()), "{want} not in {names:?}");
    }
    let kinds: Vec<String> = documents(&files)
        .iter()
        .filter_map(|(_, d)| d["kind"].as_str().map(str::to_owned))
        .collect();
    for kind in [
        "Deployment",
        "Service",
        "ServiceAccount",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "ConfigMap",
        "ServiceMonitor",
        "PrometheusRule",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "no {kind} in any rendered file"
        );
    }
}

#[test]
fn operator_objects_have_the_documented_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut checked = 0;
    for (file, doc) in documents(&rendered(dir.path())) {
        if operator::is_operator_kind(doc["kind"].as_str().unwrap_or_default()) {
            operator::check(&doc).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            checked += 1;
        }
    }
    assert!(checked >= 2, "only {checked} operator objects rendered");
}

/// The validator does reject what this test relies on it to catch.
#[test]
fn kubernetes_validate_rejects_unknown_fields_and_wrong_types() {
    let Some(tool) = find_or_skip(
        "kubernetes-validate",
        KUBERNETES_VALIDATE_INSTALL,
        "kubernetes-validate on broken manifests",
    ) else {
        return;
    };
    let minors = claimed_kube_minors(&chart()).unwrap_or_else(|e| panic!("{e}"));
    let version = format!("1.{}.0", minors[0]);
    let dir = tempfile::tempdir().expect("tempdir");
    let pod = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  \
               selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    \
               spec: {containers: [{name: c, image: i}]}\n";
    for (name, broken, why) in [
        (
            "unknown.yaml",
            pod.replace("  selector:", "  replica: 1\n  selector:"),
            "'replica' was unexpected",
        ),
        (
            "type.yaml",
            pod.replace("  selector:", "  replicas: one\n  selector:"),
            "'one' is not of type",
        ),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, &broken).expect("write");
        let (code, report) = validate(&tool, &version, &[path]);
        assert_eq!(code, Some(1), "{name} was not rejected:\n{report}");
        assert!(report.contains(why), "{name}: {report}");
    }
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, pod).expect("write");
    let (code, report) = validate(&tool, &version, &[good]);
    assert_eq!(code, Some(0), "{report}");
}

#[test]
fn rendered_manifests_pass_kubernetes_validate_for_every_claimed_version() {
    let Some(tool) = find_or_skip(
        "kubernetes-validate",
        KUBERNETES_VALIDATE_INSTALL,
        "kubernetes-validate on the rendered manifests",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let files = rendered(dir.path());
    let docs = documents(&files);
    let core = docs
        .iter()
        .filter(|(_, d)| !operator::is_operator_kind(d["kind"].as_str().unwrap_or_default()))
        .count();
    let minors = claimed_kube_minors(&chart()).unwrap_or_else(|e| panic!("{e}"));
    for minor in minors {
        let version = format!("1.{minor}.0");
        let (code, report) = validate(&tool, &version, &files);
        assert!(
            !report.contains("could not be validated"),
            "kubernetes-validate has no schemas for Kubernetes {version}, which Chart.yaml's \
             kubeVersion claims (upgrade the pinned kubernetes-validate, or narrow \
             kubeVersion):\n{report}"
        );
        assert_eq!(code, Some(0), "Kubernetes {version}:\n{report}");
        let passed = report
            .lines()
            .filter(|l| l.starts_with("INFO ") && l.contains(" passed for resource "))
            .count();
        assert_eq!(
            passed, core,
            "Kubernetes {version}: not every object passed:\n{report}"
        );
        // The only objects without a schema are the operator's; they are
        // checked by `operator_objects_have_the_documented_shape`.
        for line in report.lines().filter(|l| !l.starts_with("INFO ")) {
            assert!(
                line.contains("Couldn't find schema for kind ServiceMonitor")
                    || line.contains("Couldn't find schema for kind PrometheusRule"),
                "Kubernetes {version}: {line}\n{report}"
            );
        }
    }
}
