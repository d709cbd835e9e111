//! Renders deploy/helm/bigfleet-proxmox with several value sets, parses every
//! document as YAML and validates it against the Kubernetes API types:
//! each object must deserialise into its k8s-openapi type and survive a
//! round-trip unchanged (so a misspelt or misplaced field fails the test),
//! then the fields the provider depends on are asserted. The Prometheus
//! Operator objects are checked field by field against their documented shape
//! (`deploy_check::operator`). Values are validated against values.schema.json
//! first, as helm does.

use std::collections::BTreeMap;

use deploy_check::helm::{merge, Chart, Cluster, Document, Release};
use deploy_check::operator::{self, strip_nulls, PrometheusRule, ServiceMonitor};
use deploy_check::workspace_root;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, PersistentVolumeClaim, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value as Json;

use crate::common::workspace_package_field;

fn chart() -> Chart {
    Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")).expect("load chart")
}

fn values(y: &str) -> serde_yaml::Value {
    serde_yaml::from_str(y).expect("test values parse")
}

const MINIMAL_CA: &str = r#"
proxmox:
  apiURL: https://pve1.example.internal:8006/api2/json
  tokenID: bigfleet@pve!autoscaler
  nodes: [pve1, pve2]
  pool: bigfleet
credentials:
  token: {secretName: pve-token}
  ca: {secretName: pve-ca}
"#;

/// Deserialises into `T` and checks nothing was dropped or altered on the way.
fn strict<T: DeserializeOwned + Serialize>(doc: &Document, json: &Json) -> T {
    let typed: T = serde_json::from_value(json.clone())
        .unwrap_or_else(|e| panic!("{}: not a valid object: {e}\n{}", doc.template, doc.yaml));
    let mut back = serde_json::to_value(&typed).expect("serialise");
    strip_nulls(&mut back);
    let mut orig = json.clone();
    strip_nulls(&mut orig);
    assert_eq!(
        orig, back,
        "{}: fields not in the Kubernetes schema (or of the wrong type)\n{}",
        doc.template, doc.yaml
    );
    typed
}

#[derive(Default)]
struct Rendered {
    deployment: Option<Deployment>,
    service: Option<Service>,
    service_account: Option<ServiceAccount>,
    config_maps: Vec<ConfigMap>,
    pvcs: Vec<PersistentVolumeClaim>,
    network_policy: Option<NetworkPolicy>,
    pdb: Option<PodDisruptionBudget>,
    service_monitor: Option<ServiceMonitor>,
    prometheus_rule: Option<PrometheusRule>,
    /// PrometheusRule and ConfigMaps as rendered, for content checks.
    raw: BTreeMap<String, Json>,
}

impl Rendered {
    fn deployment(&self) -> &Deployment {
        self.deployment.as_ref().expect("a Deployment is rendered")
    }
    fn container(&self) -> &Container {
        let spec = self.deployment().spec.as_ref().unwrap();
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.containers.len(), 1);
        &pod.containers[0]
    }
    fn args(&self) -> Vec<String> {
        self.container().args.clone().unwrap_or_default()
    }
    /// `--flag=value` args as a map; bare flags map to "".
    fn flags(&self) -> BTreeMap<String, String> {
        self.args()
            .iter()
            .map(|a| match a.split_once('=') {
                Some((k, v)) => (k.to_owned(), v.to_owned()),
                None => (a.clone(), String::new()),
            })
            .collect()
    }
}

fn render(overrides: &str) -> Rendered {
    render_in(overrides, &Cluster::new())
}

fn render_in(overrides: &str, cluster: &Cluster) -> Rendered {
    let docs = chart()
        .render_in(&values(overrides), &Release::default(), cluster)
        .unwrap_or_else(|e| panic!("render failed: {e}"));
    let mut out = Rendered::default();
    for doc in &docs {
        let json: Json = serde_yaml::from_str(&doc.yaml)
            .unwrap_or_else(|e| panic!("{}: invalid YAML: {e}\n{}", doc.template, doc.yaml));
        let kind = json["kind"].as_str().unwrap_or_default().to_owned();
        let name = json["metadata"]["name"].as_str().unwrap_or_default();
        out.raw.insert(format!("{kind}/{name}"), json.clone());
        match kind.as_str() {
            "Deployment" => {
                assert!(out.deployment.is_none(), "two Deployments");
                out.deployment = Some(strict(doc, &json));
            }
            "Service" => out.service = Some(strict(doc, &json)),
            "ServiceAccount" => out.service_account = Some(strict(doc, &json)),
            "ConfigMap" => out.config_maps.push(strict(doc, &json)),
            "PersistentVolumeClaim" => out.pvcs.push(strict(doc, &json)),
            "NetworkPolicy" => out.network_policy = Some(strict(doc, &json)),
            "PodDisruptionBudget" => out.pdb = Some(strict(doc, &json)),
            "ServiceMonitor" | "PrometheusRule" => {
                operator::check(&json)
                    .unwrap_or_else(|e| panic!("{}: {e}\n{}", doc.template, doc.yaml));
                if kind == "ServiceMonitor" {
                    out.service_monitor = Some(strict(doc, &json));
                } else {
                    out.prometheus_rule = Some(strict(doc, &json));
                }
            }
            other => panic!("{}: unexpected kind {other:?}\n{}", doc.template, doc.yaml),
        }
    }
    out
}

fn render_err(overrides: &str) -> String {
    match chart().render(&values(overrides), &Release::default()) {
        Ok(docs) => panic!(
            "expected the chart to refuse these values, got {} documents",
            docs.len()
        ),
        Err(e) => e.to_string(),
    }
}

/// Asserts the invariants every value set must keep.
fn common(r: &Rendered) {
    let d = r.deployment();
    assert_eq!(d.metadata.namespace.as_deref(), Some("bigfleet"));
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(1));
    assert_eq!(
        spec.strategy.as_ref().unwrap().type_.as_deref(),
        Some("Recreate")
    );
    let sel = spec.selector.match_labels.as_ref().unwrap();
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    for (k, v) in sel {
        assert_eq!(pod_labels.get(k), Some(v), "selector label {k} on the pod");
    }

    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.automount_service_account_token, Some(false));
    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(psc.run_as_user, Some(65532));
    assert_eq!(psc.fs_group, Some(65532));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );

    let c = r.container();
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.run_as_user, Some(65532));
    assert_eq!(sc.run_as_group, Some(65532));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_owned()][..])
    );
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    assert_eq!(c.image.as_deref(), Some("bigfleet-proxmox:0.1.0"));

    let ports: BTreeMap<_, _> = c
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect();
    assert_eq!(ports.get("grpc"), Some(&9000));
    assert_eq!(ports.get("metrics"), Some(&9090));

    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let g = p.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(
            g.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("metrics".into())
        );
        g.path.clone().unwrap()
    };
    assert_eq!(probe_path(&c.liveness_probe), "/healthz");
    assert_eq!(probe_path(&c.readiness_probe), "/readyz");
    assert!(c.resources.as_ref().unwrap().limits.is_some());

    let flags = r.flags();
    assert_eq!(flags.get("--addr").map(String::as_str), Some(":9000"));
    assert_eq!(
        flags.get("--metrics-addr").map(String::as_str),
        Some(":9090")
    );

    // Every mount except the scratch dir and state is read-only.
    for m in c.volume_mounts.as_ref().unwrap() {
        if m.name != "tmp" && m.name != "state" {
            assert_eq!(
                m.read_only,
                Some(true),
                "mount {} must be read-only",
                m.name
            );
        }
    }

    let svc = r.service.as_ref().expect("a Service");
    let sspec = svc.spec.as_ref().unwrap();
    assert_eq!(sspec.selector.as_ref(), Some(sel));
    let sports: BTreeMap<_, _> = sspec
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| (p.name.clone().unwrap(), p.port))
        .collect();
    assert_eq!(sports.get("grpc"), Some(&9000));
    assert_eq!(sports.get("metrics"), Some(&9090));

    let sa = r.service_account.as_ref().expect("a ServiceAccount");
    assert_eq!(
        pod.service_account_name.as_deref(),
        sa.metadata.name.as_deref()
    );
}

fn mount<'a>(r: &'a Rendered, name: &str) -> Option<&'a k8s_openapi::api::core::v1::VolumeMount> {
    r.container()
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == name)
}

fn volume<'a>(r: &'a Rendered, name: &str) -> Option<&'a k8s_openapi::api::core::v1::Volume> {
    r.deployment()
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == name)
}

#[test]
fn minimal_with_ca_bundle() {
    let r = render(MINIMAL_CA);
    common(&r);
    let f = r.flags();
    assert_eq!(f["--proxmox-backend"], "proxmox");
    assert_eq!(
        f["--proxmox-api-url"],
        "https://pve1.example.internal:8006/api2/json"
    );
    assert_eq!(f["--proxmox-token-id"], "bigfleet@pve!autoscaler");
    assert_eq!(
        f["--proxmox-token-file"],
        "/etc/bigfleet/proxmox-token/token"
    );
    assert_eq!(f["--proxmox-ca-file"], "/etc/bigfleet/proxmox-ca/ca.crt");
    assert!(!f.contains_key("--proxmox-tls-fingerprint"));
    assert!(
        !f.contains_key("--proxmox-token-secret"),
        "secret never on the command line"
    );
    assert!(!f.contains_key("--use-fake-backend"));
    assert_eq!(f["--nodes"], "pve1,pve2");
    assert_eq!(f["--proxmox-pool"], "bigfleet");
    assert_eq!(f["--template-vmid"], "9000");
    assert_eq!(f["--state"], "/var/lib/bigfleet/state.db");
    assert!(
        !f.contains_key("--offerings"),
        "built-in offerings by default"
    );
    assert!(!f.contains_key("--tls-cert"));

    // Secrets: mounted read-only where the flags point.
    let tm = mount(&r, "proxmox-token").expect("token mount");
    assert_eq!(tm.mount_path, "/etc/bigfleet/proxmox-token");
    assert_eq!(tm.read_only, Some(true));
    let tv = volume(&r, "proxmox-token")
        .unwrap()
        .secret
        .as_ref()
        .unwrap();
    assert_eq!(tv.secret_name.as_deref(), Some("pve-token"));
    assert_eq!(tv.items.as_ref().unwrap()[0].key, "token");
    assert_eq!(tv.default_mode, Some(0o440));
    let cm = mount(&r, "proxmox-ca").expect("ca mount");
    assert_eq!(cm.read_only, Some(true));
    let cv = volume(&r, "proxmox-ca").unwrap().secret.as_ref().unwrap();
    assert_eq!(cv.secret_name.as_deref(), Some("pve-ca"));
    assert_eq!(cv.items.as_ref().unwrap()[0].path, "ca.crt");

    // State PVC created and mounted writable at the state directory.
    assert_eq!(r.pvcs.len(), 1);
    let pvc = &r.pvcs[0];
    let ps = pvc.spec.as_ref().unwrap();
    assert_eq!(
        ps.access_modes.as_deref(),
        Some(&["ReadWriteOnce".to_owned()][..])
    );
    assert_eq!(
        ps.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0,
        "1Gi"
    );
    assert!(ps.storage_class_name.is_none());
    let sv = volume(&r, "state").unwrap();
    assert_eq!(
        sv.persistent_volume_claim.as_ref().unwrap().claim_name,
        pvc.metadata.name.clone().unwrap()
    );
    assert_eq!(mount(&r, "state").unwrap().mount_path, "/var/lib/bigfleet");
    assert!(r.config_maps.is_empty());

    // Default scrape annotations on the Service.
    let ann = r
        .service
        .as_ref()
        .unwrap()
        .metadata
        .annotations
        .as_ref()
        .unwrap();
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], "9090");
    assert_eq!(ann["prometheus.io/path"], "/metrics");
}

#[test]
fn tls_and_mtls() {
    let r = render(&format!(
        "{MINIMAL_CA}\ntls: {{enabled: true, mtls: true, secretName: provider-tls}}\n"
    ));
    common(&r);
    let f = r.flags();
    assert_eq!(f["--tls-cert"], "/etc/bigfleet/tls/tls.crt");
    assert_eq!(f["--tls-key"], "/etc/bigfleet/tls/tls.key");
    assert_eq!(f["--tls-ca"], "/etc/bigfleet/tls/ca.crt");
    assert_eq!(mount(&r, "tls").unwrap().read_only, Some(true));
    assert_eq!(
        volume(&r, "tls")
            .unwrap()
            .secret
            .as_ref()
            .unwrap()
            .secret_name
            .as_deref(),
        Some("provider-tls")
    );

    // TLS without client verification: no --tls-ca.
    let r = render(&format!(
        "{MINIMAL_CA}\ntls: {{enabled: true, secretName: provider-tls}}\n"
    ));
    let f = r.flags();
    assert!(f.contains_key("--tls-cert") && f.contains_key("--tls-key"));
    assert!(!f.contains_key("--tls-ca"));
}

#[test]
fn client_identity_renders_a_flag_only_when_it_is_any_under_mtls() {
    let mtls = |identity: &str| {
        render(&format!(
            "{MINIMAL_CA}\ntls: {{enabled: true, mtls: true, secretName: s{identity}}}\n"
        ))
    };
    // The provider's default, spelt out or not: no flag.
    for identity in ["", ", clientIdentity: bigfleet"] {
        let r = mtls(identity);
        common(&r);
        assert!(
            !r.flags().contains_key("--tls-client-identity"),
            "{identity}"
        );
    }
    let r = mtls(", clientIdentity: any");
    common(&r);
    assert_eq!(r.flags()["--tls-client-identity"], "any");
    // Without mtls there is no client certificate to check: no flag.
    let r = render(&format!(
        "{MINIMAL_CA}\ntls: {{enabled: true, secretName: s, clientIdentity: any}}\n"
    ));
    assert!(!r.flags().contains_key("--tls-client-identity"));
}

#[test]
fn fingerprint_instead_of_ca() {
    let r = render(
        r#"
proxmox:
  apiURL: https://10.0.0.5:8006/api2/json
  tokenID: bigfleet@pve!autoscaler
  nodes: [pve1]
  tlsFingerprint: "AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89"
credentials:
  token: {secretName: pve-token, secretKey: secret}
"#,
    );
    common(&r);
    let f = r.flags();
    assert!(f["--proxmox-tls-fingerprint"].starts_with("AB:CD:EF"));
    assert!(!f.contains_key("--proxmox-ca-file"));
    assert!(mount(&r, "proxmox-ca").is_none() && volume(&r, "proxmox-ca").is_none());
    assert_eq!(
        f["--proxmox-token-file"],
        "/etc/bigfleet/proxmox-token/secret"
    );
    assert!(!f.contains_key("--proxmox-pool"));
}

#[test]
fn state_disabled_has_no_pvc_and_no_state_flag() {
    let r = render(&format!("{MINIMAL_CA}\nstate: {{enabled: false}}\n"));
    common(&r);
    assert!(r.pvcs.is_empty());
    assert!(!r.flags().contains_key("--state"));
    assert!(volume(&r, "state").is_none() && mount(&r, "state").is_none());
}

#[test]
fn existing_claim_and_storage_class() {
    let r = render(&format!(
        "{MINIMAL_CA}\nstate: {{persistence: {{existingClaim: my-claim}}}}\n"
    ));
    assert!(r.pvcs.is_empty(), "no PVC when reusing a claim");
    assert_eq!(
        volume(&r, "state")
            .unwrap()
            .persistent_volume_claim
            .as_ref()
            .unwrap()
            .claim_name,
        "my-claim"
    );

    let r = render(&format!(
        "{MINIMAL_CA}\nstate: {{persistence: {{storageClass: fast, size: 5Gi}}}}\n"
    ));
    let ps = r.pvcs[0].spec.as_ref().unwrap();
    assert_eq!(ps.storage_class_name.as_deref(), Some("fast"));
    assert_eq!(
        ps.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0,
        "5Gi"
    );
}

#[test]
fn offerings_and_instance_types_configmap() {
    let r = render(&format!(
        r#"{MINIMAL_CA}
offerings:
  content: |
    [{{"instance_type": "pve.medium", "zone": "pve1", "count": 4}}]
instanceTypes:
  content: |
    {{"pve.medium": {{"vcpu": 4, "memory_mib": 8192, "template_vmid": 9001}}}}
extraArgs: ["--reconcile-interval=5m"]
"#
    ));
    common(&r);
    let f = r.flags();
    assert_eq!(f["--offerings"], "/etc/bigfleet/config/offerings.json");
    assert_eq!(
        f["--instance-types"],
        "/etc/bigfleet/config/instance-types.json"
    );
    assert_eq!(f["--reconcile-interval"], "5m");
    assert_eq!(r.config_maps.len(), 1);
    let data = r.config_maps[0].data.as_ref().unwrap();
    let offerings: Json = serde_json::from_str(&data["offerings.json"]).unwrap();
    assert_eq!(offerings[0]["count"], 4);
    let types: Json = serde_json::from_str(&data["instance-types.json"]).unwrap();
    assert_eq!(types["pve.medium"]["template_vmid"], 9001);
    assert_eq!(mount(&r, "config").unwrap().read_only, Some(true));
    assert_eq!(
        volume(&r, "config")
            .unwrap()
            .config_map
            .as_ref()
            .unwrap()
            .name,
        r.config_maps[0].metadata.name.clone().unwrap()
    );
    // The pod template changes with the content, so a config change rolls it.
    let base = render(MINIMAL_CA);
    assert_ne!(
        pod_annotations(&r)["checksum/config"],
        pod_annotations(&base)["checksum/config"]
    );
}

fn pod_annotations(r: &Rendered) -> BTreeMap<String, String> {
    r.deployment()
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .clone()
        .unwrap_or_default()
}

#[test]
fn fake_backend_for_testing() {
    let r = render("fakeBackend: {enabled: true}\nstate: {enabled: false}\n");
    common(&r);
    let f = r.flags();
    assert!(f.contains_key("--use-fake-backend"));
    for k in [
        "--proxmox-api-url",
        "--proxmox-token-file",
        "--proxmox-backend",
        "--nodes",
    ] {
        assert!(
            !f.contains_key(k),
            "{k} must not be passed to the fake backend"
        );
    }
    assert!(volume(&r, "proxmox-token").is_none());
}

#[test]
fn scrape_annotations_optional_and_pod_extras() {
    let r = render(&format!(
        "{MINIMAL_CA}\nmetrics: {{prometheusScrape: false}}\nnodeSelector: {{disk: ssd}}\npodAnnotations: {{team: infra}}\n"
    ));
    common(&r);
    assert!(r.service.as_ref().unwrap().metadata.annotations.is_none());
    let pod = r
        .deployment()
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(pod.node_selector.as_ref().unwrap()["disk"], "ssd");
}

#[test]
fn refuses_real_backend_without_trust_material() {
    let e = render_err(
        r#"
proxmox: {apiURL: "https://pve1:8006/api2/json", tokenID: "a@pve!b", nodes: [pve1]}
credentials: {token: {secretName: pve-token}}
"#,
    );
    assert!(e.contains("TLS verification material is required"), "{e}");
}

#[test]
fn refuses_real_backend_without_connection_settings() {
    let cases = [
        ("proxmox: {apiURL: \"\"}", "proxmox.apiURL is required"),
        ("proxmox: {tokenID: \"\"}", "proxmox.tokenID is required"),
        ("proxmox: {nodes: []}", "proxmox.nodes is required"),
        (
            "credentials: {token: {secretName: \"\"}}",
            "credentials.token.secretName is required",
        ),
    ];
    for (broken, want) in cases {
        let mut v = values(MINIMAL_CA);
        let b = values(broken);
        merge(&mut v, &b);
        let yaml = serde_yaml::to_string(&v).unwrap();
        let e = render_err(&yaml);
        assert!(e.contains(want), "{broken}: got {e}");
    }
    // Chart defaults alone describe no cluster.
    assert!(render_err("{}").contains("proxmox.apiURL is required"));
}

/// The args the clone and storage values render, in order.
fn clone_args(r: &Rendered) -> Vec<String> {
    r.args()
        .into_iter()
        .filter(|a| {
            [
                "--template-replicas",
                "--clone-mode",
                "--node-storage",
                "--storage-overcommit",
            ]
            .iter()
            .any(|f| a == f || a.starts_with(&format!("{f}=")))
        })
        .collect()
}

#[test]
fn the_node_memory_limit_renders_its_flag_only_when_set() {
    let limit = |r: &Rendered| -> Vec<String> {
        r.args()
            .into_iter()
            .filter(|a| a.starts_with("--node-memory-limit"))
            .collect()
    };
    assert!(limit(&render(MINIMAL_CA)).is_empty());
    for (value, want) in [
        ("\"0\"", "--node-memory-limit=0"),
        ("\"1.5\"", "--node-memory-limit=1.5"),
    ] {
        let r = render(&with_minimal(&format!(
            "proxmox: {{nodeMemoryLimit: {value}}}"
        )));
        assert_eq!(limit(&r), [want], "{value}");
    }
    let e = render_err(&with_minimal("proxmox: {nodeMemoryLimit: \"lots\"}"));
    assert!(e.contains("nodeMemoryLimit"), "{e}");
}

#[test]
fn clone_values_render_no_flag_at_the_provider_defaults() {
    for extra in [
        "{}",
        // The defaults spelt out.
        "proxmox: {templateReplicas: true, cloneMode: full, nodeStorage: {}, storageOvercommit: {}}",
    ] {
        let r = render(&with_minimal(extra));
        common(&r);
        assert_eq!(clone_args(&r), Vec::<String>::new(), "{extra}");
    }
    // A null override drops the chart's default (helm's merge); the
    // provider's own default then holds, so still no flag.
    let mut v = values(MINIMAL_CA);
    for key in [
        "templateReplicas",
        "cloneMode",
        "nodeStorage",
        "storageOvercommit",
    ] {
        v["proxmox"][key] = serde_yaml::Value::Null;
    }
    let nulls = serde_yaml::to_string(&v).unwrap();
    assert!(nulls.contains("cloneMode: null"), "{nulls}");
    let r = render(&nulls);
    common(&r);
    assert_eq!(clone_args(&r), Vec::<String>::new(), "{nulls}");
    let r = render("fakeBackend: {enabled: true}\nstate: {enabled: false}\n");
    assert_eq!(clone_args(&r), Vec::<String>::new());
}

#[test]
fn clone_values_render_exactly_their_flags() {
    let cases: &[(&str, &[&str])] = &[
        (
            "proxmox: {templateReplicas: false}",
            &["--template-replicas=false"],
        ),
        ("proxmox: {cloneMode: linked}", &["--clone-mode=linked"]),
        (
            "proxmox: {nodeStorage: {pve1: local-lvm}}",
            &["--node-storage=pve1=local-lvm"],
        ),
        // One flag for every node, in node-name order whatever the map's.
        (
            "proxmox: {nodeStorage: {pve2: fast-zfs, pve10: nvme.1, pve1: local_lvm}}",
            &["--node-storage=pve1=local_lvm,pve10=nvme.1,pve2=fast-zfs"],
        ),
        (
            "proxmox: {templateReplicas: false, nodeStorage: {pve2: fast-zfs, pve1: local-lvm}}",
            &[
                "--template-replicas=false",
                "--node-storage=pve1=local-lvm,pve2=fast-zfs",
            ],
        ),
        (
            "proxmox: {templateReplicas: false, cloneMode: linked}",
            &["--template-replicas=false", "--clone-mode=linked"],
        ),
        // In storage-id order, each factor as written.
        (
            "proxmox: {storageOvercommit: {local-lvm: 2.5, ceph: 1}}",
            &["--storage-overcommit=ceph=1,local-lvm=2.5"],
        ),
    ];
    for (extra, want) in cases {
        // Rendered afresh each time: a map's iteration order varies per render.
        for _ in 0..4 {
            let r = render(&with_minimal(extra));
            common(&r);
            assert_eq!(clone_args(&r), *want, "{extra}");
        }
    }
    // The fake backend gets them too, as it gets --proxmox-pool (and ignores them).
    let r = render(
        "fakeBackend: {enabled: true}\nstate: {enabled: false}\nproxmox: {cloneMode: linked}\n",
    );
    assert_eq!(clone_args(&r), ["--clone-mode=linked"]);
}

#[test]
fn instance_type_storage_reaches_the_catalog_file() {
    let r = render(&with_minimal(
        r#"instanceTypes: {content: '{"db.large": {"vcpu": 8, "memory_mib": 32768, "storage": "nvme"}}'}"#,
    ));
    common(&r);
    let data = r.config_maps[0].data.as_ref().unwrap();
    let types: Json = serde_json::from_str(&data["instance-types.json"]).unwrap();
    assert_eq!(types["db.large"]["storage"], "nvme");
    assert_eq!(
        r.flags()["--instance-types"],
        "/etc/bigfleet/config/instance-types.json"
    );
}

#[test]
fn refuses_linked_clones_with_node_storage() {
    let e = render_err(&with_minimal(
        "proxmox: {cloneMode: linked, nodeStorage: {pve1: local-lvm}}",
    ));
    assert!(
        e.contains("proxmox.cloneMode linked")
            && e.contains("empty proxmox.nodeStorage, or set proxmox.cloneMode full"),
        "{e}"
    );
    // Either alone renders.
    render(&with_minimal("proxmox: {cloneMode: linked}"));
    render(&with_minimal(
        "proxmox: {cloneMode: full, nodeStorage: {pve1: local-lvm}}",
    ));
}

#[test]
fn refuses_inconsistent_tls_and_backend_settings() {
    let e = render_err(&format!("{MINIMAL_CA}\ntls: {{enabled: true}}\n"));
    assert!(e.contains("tls.secretName is required"), "{e}");
    let e = render_err(&format!(
        "{MINIMAL_CA}\ntls: {{mtls: true, secretName: x}}\n"
    ));
    assert!(e.contains("tls.mtls requires tls.enabled"), "{e}");
    let e = render_err(&format!("{MINIMAL_CA}\nfakeBackend: {{enabled: true}}\n"));
    assert!(e.contains("mutually exclusive"), "{e}");
}

#[test]
fn strict_check_catches_schema_mistakes() {
    // A misspelt field and a wrongly typed one must both fail the round-trip.
    for bad in [
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {selektor: {a: b}}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: \"9000\"}]}\n",
    ] {
        let doc = Document {
            template: "bad.yaml".into(),
            yaml: bad.into(),
        };
        let json: Json = serde_yaml::from_str(bad).unwrap();
        let caught = std::panic::catch_unwind(|| {
            let _: Service = strict(&doc, &json);
        });
        assert!(caught.is_err(), "strict check accepted {bad}");
    }
    let good =
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 9000}]}\n";
    let doc = Document {
        template: "good.yaml".into(),
        yaml: good.into(),
    };
    let _: Service = strict(&doc, &serde_yaml::from_str(good).unwrap());
}

#[test]
fn notes_warn_about_fake_backend_and_volatile_state() {
    let chart = chart();
    let notes = chart
        .render_notes(&values(MINIMAL_CA), &Release::default())
        .unwrap();
    assert!(
        notes.contains("pve-bigfleet-proxmox.bigfleet.svc:9000"),
        "{notes}"
    );
    assert!(!notes.contains("WARNING"), "{notes}");
    assert!(notes.contains("networkPolicy.grpc.from"), "{notes}");
    let open = chart
        .render_notes(
            &values(&with_minimal("networkPolicy: {enabled: false}")),
            &Release::default(),
        )
        .unwrap();
    assert!(!open.contains("NetworkPolicy"), "{open}");
    let notes = chart
        .render_notes(
            &values("fakeBackend: {enabled: true}\nstate: {enabled: false}\n"),
            &Release::default(),
        )
        .unwrap();
    assert!(notes.contains("fakeBackend.enabled is set"), "{notes}");
    assert!(notes.contains("state.enabled is false"), "{notes}");
}

fn with_minimal(extra: &str) -> String {
    let mut v = values(MINIMAL_CA);
    merge(&mut v, &values(extra));
    serde_yaml::to_string(&v).unwrap()
}

#[test]
fn schema_rejects_unknown_keys_at_every_level() {
    for (typo, key, at) in [
        // The issue's example: without the schema this silently kept 9000.
        ("proxmox: {templateVmid: 9100}", "templateVmid", "/proxmox"),
        ("fakebackend: {enabled: true}", "fakebackend", "/"),
        (
            "credentials: {token: {secret: x}}",
            "secret",
            "/credentials/token",
        ),
        (
            "state: {persistence: {sise: 5Gi}}",
            "sise",
            "/state/persistence",
        ),
        (
            "metrics: {serviceMonitor: {enable: true}}",
            "enable",
            "/metrics/serviceMonitor",
        ),
        (
            "networkPolicy: {grpc: {from: [{podSelectr: {}}]}}",
            "podSelectr",
            "/networkPolicy/grpc/from/0",
        ),
        (
            "securityContext: {capabilities: {dorp: [ALL]}}",
            "dorp",
            "/securityContext/capabilities",
        ),
        (
            "livenessProbe: {periodSecond: 5}",
            "periodSecond",
            "/livenessProbe",
        ),
        ("proxmox: {cloneMod: linked}", "cloneMod", "/proxmox"),
        (
            "proxmox: {templateReplica: false}",
            "templateReplica",
            "/proxmox",
        ),
    ] {
        let e = render_err(&with_minimal(typo));
        assert!(
            e.contains("values don't meet the specifications of the schema"),
            "{typo}: {e}"
        );
        assert!(e.contains(key), "{typo}: the error names {key}: {e}");
        assert!(
            e.contains(&format!("at '{at}'")),
            "{typo}: located at {at}: {e}"
        );
    }
    // The right spelling renders and reaches the flag.
    let r = render(&with_minimal("proxmox: {templateVMID: 9100}"));
    assert_eq!(r.flags()["--template-vmid"], "9100");
}

#[test]
fn schema_rejects_wrong_types_and_values() {
    for (bad, at) in [
        ("proxmox: {templateVMID: \"9100\"}", "/proxmox/templateVMID"),
        ("proxmox: {templateVMID: 12}", "/proxmox/templateVMID"),
        ("proxmox: {nodes: pve1}", "/proxmox/nodes"),
        ("state: {enabled: \"yes\"}", "/state/enabled"),
        ("service: {grpcPort: 70000}", "/service/grpcPort"),
        ("log: {format: yaml}", "/log/format"),
        ("extraArgs: \"--seed-count=4\"", "/extraArgs"),
        ("extraArgs: [\"seed-count=4\"]", "/extraArgs/0"),
        ("podAnnotations: {team: 7}", "/podAnnotations/team"),
        (
            "networkPolicy: {grpc: {from: []}}",
            "/networkPolicy/grpc/from",
        ),
        (
            "metrics: {serviceMonitor: {interval: often}}",
            "/metrics/serviceMonitor/interval",
        ),
        (
            "resources: {limits: {memory: [256Mi]}}",
            "/resources/limits/memory",
        ),
        (
            "proxmox: {templateReplicas: \"false\"}",
            "/proxmox/templateReplicas",
        ),
        ("tls: {clientIdentity: none}", "/tls/clientIdentity"),
        // The provider refuses plain HTTP: so does the schema.
        (
            "proxmox: {apiURL: \"http://pve1:8006/api2/json\"}",
            "/proxmox/apiURL",
        ),
        ("proxmox: {cloneMode: thin}", "/proxmox/cloneMode"),
        ("proxmox: {cloneMode: Linked}", "/proxmox/cloneMode"),
        // The flag's syntax is not the value's: a map, node to storage.
        (
            "proxmox: {nodeStorage: \"pve1=local-lvm\"}",
            "/proxmox/nodeStorage",
        ),
        (
            "proxmox: {nodeStorage: [pve1, local-lvm]}",
            "/proxmox/nodeStorage",
        ),
        (
            "proxmox: {nodeStorage: {pve1: 7}}",
            "/proxmox/nodeStorage/pve1",
        ),
        (
            "proxmox: {nodeStorage: {pve1: {name: local-lvm}}}",
            "/proxmox/nodeStorage/pve1",
        ),
        // Not a PVE storage id; ',' and '=' would corrupt the flag.
        (
            "proxmox: {nodeStorage: {pve1: \"local-lvm,pve2=x\"}}",
            "/proxmox/nodeStorage/pve1",
        ),
        (
            "proxmox: {nodeStorage: {pve1: 9fast}}",
            "/proxmox/nodeStorage/pve1",
        ),
        (
            "proxmox: {nodeStorage: {\"pve1=x\": local-lvm}}",
            "/proxmox/nodeStorage",
        ),
    ] {
        let e = render_err(&with_minimal(bad));
        assert!(
            e.contains(&format!("at '{at}'")),
            "{bad}: expected an error at {at}: {e}"
        );
    }
}

#[test]
fn schema_accepts_the_defaults_and_every_documented_option() {
    let chart = chart();
    chart
        .validate_values(&chart.values)
        .unwrap_or_else(|e| panic!("values.yaml against its own schema: {e}"));
    let everything = with_minimal(
        r#"
global: {imageRegistry: mirror.example}
image: {repository: registry.example/bigfleet-proxmox, tag: "0.1.1", pullPolicy: Always}
imagePullSecrets: [{name: regcred}]
nameOverride: pve
provider: pve-dc1
proxmox: {templateVMID: 9001, tlsFingerprint: "AB:CD", templateReplicas: false, cloneMode: full, nodeStorage: {pve1: local-lvm, pve2: fast.zfs_1}}
credentials: {token: {secretName: pve-token, secretKey: secret}, ca: {secretName: pve-ca, secretKey: ca.pem}}
offerings: {content: '[{"instance_type": "pve.small", "zone": "pve1", "count": 2}]'}
instanceTypes: {content: '{"pve.small": {"vcpu": 2, "memory_mib": 2048, "storage": "nvme"}}'}
replicaCount: 2
state:
  persistence: {size: 2Gi, storageClass: fast, accessModes: [ReadWriteOncePod]}
  postgres:
    url: postgres://bf@db.example:5432/bigfleet?sslmode=verify-full
    password: {secretName: pg, secretKey: pw}
    ca: {secretName: pg-ca, configMapName: "", key: ca.pem}
    leaseTTL: 1m30s
rollingUpdate: {maxUnavailable: 100%, maxSurge: 1}
podDisruptionBudget: {enabled: true, minAvailable: 50%}
podAntiAffinity: {enabled: true, topologyKey: topology.kubernetes.io/zone}
tls: {enabled: true, mtls: true, secretName: provider-tls}
log: {format: json, level: debug}
extraArgs: ["--reconcile-interval=5m"]
service: {type: ClusterIP, grpcPort: 9000, metricsPort: 9090, annotations: {a: b}}
metrics:
  prometheusScrape: false
  serviceMonitor: {enabled: true, labels: {release: kps}, interval: 1m, scrapeTimeout: 15s}
  prometheusRule: {enabled: true, labels: {release: kps}}
  grafanaDashboard: {enabled: true, labels: {grafana_dashboard: "1"}, annotations: {grafana_folder: BigFleet}, namespace: monitoring}
networkPolicy:
  enabled: true
  grpc:
    from:
      - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: bigfleet-system}}
        podSelector: {matchExpressions: [{key: app.kubernetes.io/name, operator: In, values: [bigfleet]}]}
  metrics:
    from: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}}]
serviceAccount: {create: true, name: sa, annotations: {x: y}}
podAnnotations: {team: infra}
podLabels: {tier: control}
podSecurityContext: {supplementalGroups: [1000]}
securityContext: {procMount: Default}
resources: {requests: {cpu: 100m, memory: 64Mi}, limits: {cpu: "1", memory: 512Mi}}
livenessProbe: {successThreshold: 1}
readinessProbe: {periodSeconds: 10}
terminationGracePeriodSeconds: 60
nodeSelector: {disk: ssd}
tolerations: [{key: dedicated, operator: Equal, value: infra, effect: NoSchedule}]
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms: [{matchExpressions: [{key: disk, operator: In, values: [ssd]}]}]
"#,
    );
    let r = render(&everything);
    assert!(r.network_policy.is_some() && r.service_monitor.is_some());
    assert!(r.prometheus_rule.is_some());
    assert_eq!(r.flags()["--provider"], "pve-dc1");
    let rolling = r
        .deployment()
        .spec
        .as_ref()
        .unwrap()
        .strategy
        .as_ref()
        .unwrap();
    assert_eq!(
        rolling.rolling_update.as_ref().unwrap().max_unavailable,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("100%".into()))
    );
    // The values' node affinity and the chart's anti-affinity side by side.
    let affinity = pod_spec(&r).affinity.as_ref().unwrap();
    assert!(affinity.node_affinity.is_some() && affinity.pod_anti_affinity.is_some());
    // The provider's shutdown bound follows the pod's grace, 10 s inside it.
    assert_eq!(r.flags()["--shutdown-grace"], "50s");
}

#[test]
fn the_shutdown_grace_stays_inside_the_pods() {
    let fake = "fakeBackend: {enabled: true}\nstate: {enabled: false}\n";
    assert_eq!(render(fake).flags()["--shutdown-grace"], "20s");
    let short = format!("{fake}terminationGracePeriodSeconds: 5\n");
    assert_eq!(render(&short).flags()["--shutdown-grace"], "1s");
}

/// Resolves a local `$ref` (`#/definitions/x`).
fn resolve<'a>(root: &'a Json, node: &'a Json) -> &'a Json {
    match node["$ref"].as_str() {
        Some(r) => root
            .pointer(r.trim_start_matches('#'))
            .unwrap_or_else(|| panic!("dangling $ref {r}")),
        None => node,
    }
}

#[test]
fn schema_closes_every_object() {
    let schema = chart().schema.expect("values.schema.json");
    // Pass-through values whose fields the Kubernetes API (and the strict
    // round-trip above) validates; nothing else may stay open.
    let open = ["/properties/global", "/definitions/k8sObject"];
    fn walk(node: &Json, at: &str, open: &[&str], seen: &mut usize) {
        match node {
            Json::Object(m) => {
                if m.get("type") == Some(&Json::from("object")) && !open.contains(&at) {
                    *seen += 1;
                    assert!(
                        m.get("additionalProperties")
                            .is_some_and(|a| a == &Json::Bool(false) || a.is_object()),
                        "{at}: an object without additionalProperties (false, or a schema for map values)"
                    );
                }
                for (k, v) in m {
                    walk(v, &format!("{at}/{k}"), open, seen);
                }
            }
            Json::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    walk(v, &format!("{at}/{i}"), open, seen);
                }
            }
            _ => {}
        }
    }
    let mut seen = 0;
    walk(&schema, "", &open, &mut seen);
    assert!(seen > 20, "only {seen} objects in the schema");
}

#[test]
fn schema_and_values_yaml_describe_the_same_keys() {
    let chart = chart();
    let schema = chart.schema.clone().unwrap();
    let values: Json = serde_json::to_value(&chart.values).unwrap();
    // Kubernetes types the chart passes through: the schema knows more of
    // their fields than values.yaml sets.
    const K8S_TYPES: &[&str] = &[
        "/podSecurityContext",
        "/securityContext",
        "/resources",
        "/livenessProbe",
        "/readinessProbe",
        "/affinity",
    ];
    fn walk(root: &Json, node: &Json, v: &Json, at: &str) {
        let via_ref = node.get("$ref").is_some();
        let node = resolve(root, node);
        let (Some(props), Some(vm)) = (node["properties"].as_object(), v.as_object()) else {
            return;
        };
        for (k, sub) in vm {
            let p = props
                .get(k)
                .unwrap_or_else(|| panic!("values.yaml {at}/{k} is not in the schema"));
            walk(root, p, sub, &format!("{at}/{k}"));
        }
        if via_ref || K8S_TYPES.iter().any(|t| at.starts_with(t)) {
            return;
        }
        for k in props.keys() {
            if at.is_empty() && k == "global" {
                continue;
            }
            assert!(
                vm.contains_key(k),
                "the schema allows {at}/{k}, which values.yaml neither sets nor documents"
            );
        }
    }
    walk(&schema, &schema, &values, "");
}

#[test]
fn network_policy_is_on_by_default() {
    let r = render(MINIMAL_CA);
    let np = r
        .network_policy
        .as_ref()
        .expect("a NetworkPolicy by default");
    let spec = np.spec.as_ref().unwrap();
    let pod_labels = r
        .deployment()
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in spec
        .pod_selector
        .as_ref()
        .unwrap()
        .match_labels
        .as_ref()
        .unwrap()
    {
        assert_eq!(
            pod_labels.get(k),
            Some(v),
            "the policy selects the provider pod"
        );
    }
    assert_eq!(
        spec.policy_types.as_deref(),
        Some(&["Ingress".to_owned()][..])
    );
    let ingress = spec.ingress.as_ref().unwrap();
    assert_eq!(ingress.len(), 2);
    let rule_for = |port: &str| {
        ingress
            .iter()
            .find(|i| {
                i.ports.as_ref().unwrap().iter().any(|p| {
                    p.port
                        == Some(
                            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                                port.into(),
                            ),
                        )
                })
            })
            .unwrap_or_else(|| panic!("no ingress rule for port {port}"))
    };
    for rule in ingress {
        assert_eq!(rule.ports.as_ref().unwrap().len(), 1, "one port per rule");
        assert!(
            rule.from.as_ref().is_some_and(|f| !f.is_empty()),
            "a rule without peers admits everyone"
        );
    }
    // gRPC: pods of the release's namespace only (no namespaceSelector).
    let grpc = &rule_for("grpc").from.as_ref().unwrap()[0];
    assert!(grpc.namespace_selector.is_none());
    assert_eq!(grpc.pod_selector, Some(LabelSelector::default()));
    // Metrics: any namespace, for Prometheus.
    let metrics = &rule_for("metrics").from.as_ref().unwrap()[0];
    assert_eq!(metrics.namespace_selector, Some(LabelSelector::default()));

    // Opened to BigFleet's namespace and pods instead.
    let r = render(&with_minimal(
        r#"
networkPolicy:
  grpc:
    from:
      - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: bigfleet-system}}
        podSelector: {matchLabels: {app.kubernetes.io/name: bigfleet}}
  metrics:
    from:
      - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}
"#,
    ));
    let spec = r.network_policy.as_ref().unwrap().spec.clone().unwrap();
    let peers: Vec<_> = spec
        .ingress
        .unwrap()
        .into_iter()
        .map(|i| i.from.unwrap())
        .collect();
    let ns = |p: &k8s_openapi::api::networking::v1::NetworkPolicyPeer| {
        p.namespace_selector
            .as_ref()
            .unwrap()
            .match_labels
            .clone()
            .unwrap()["kubernetes.io/metadata.name"]
            .clone()
    };
    assert_eq!(ns(&peers[0][0]), "bigfleet-system");
    assert_eq!(
        peers[0][0]
            .pod_selector
            .as_ref()
            .unwrap()
            .match_labels
            .as_ref()
            .unwrap()["app.kubernetes.io/name"],
        "bigfleet"
    );
    assert_eq!(ns(&peers[1][0]), "monitoring");

    let r = render(&with_minimal("networkPolicy: {enabled: false}"));
    assert!(r.network_policy.is_none());
}

#[test]
fn monitoring_objects_are_off_by_default() {
    let r = render(MINIMAL_CA);
    assert!(r.service_monitor.is_none());
    assert!(r.prometheus_rule.is_none());
    assert!(r.config_maps.is_empty(), "no dashboard ConfigMap");
}

#[test]
fn service_monitor_scrapes_the_metrics_port_as_the_rules_job() {
    let r = render(&with_minimal(
        "metrics: {serviceMonitor: {enabled: true, labels: {release: kps}, interval: 1m}}",
    ));
    let sm = r.service_monitor.as_ref().unwrap();
    assert_eq!(sm.api_version, "monitoring.coreos.com/v1");
    assert_eq!(sm.metadata.labels.as_ref().unwrap()["release"], "kps");
    assert_eq!(sm.spec.namespace_selector.match_names, ["bigfleet"]);
    let svc = r.service.as_ref().unwrap();
    let svc_labels = svc.metadata.labels.as_ref().unwrap();
    for (k, v) in sm.spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            svc_labels.get(k),
            Some(v),
            "the ServiceMonitor selects the Service"
        );
    }
    let ep = &sm.spec.endpoints[0];
    assert!(svc
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .any(|p| p.name.as_deref() == Some(ep.port.as_str())));
    assert_eq!(ep.path, "/metrics");
    assert_eq!(ep.interval, "1m");
    assert_eq!(ep.scrape_timeout, "10s");
    let job = &ep.relabelings[0];
    assert_eq!(
        (job.target_label.as_str(), job.replacement.as_str()),
        ("job", "bigfleet-proxmox")
    );
    // The alert rules select exactly that job.
    let rules =
        std::fs::read_to_string(workspace_root().join("deploy/monitoring/alerts.yaml")).unwrap();
    assert!(rules.contains(r#"up{job="bigfleet-proxmox"}"#));
}

#[test]
fn prometheus_rule_ships_the_rules_file_verbatim() {
    let r = render(&with_minimal(
        "metrics: {prometheusRule: {enabled: true, labels: {release: kps}}}",
    ));
    let pr = r.prometheus_rule.as_ref().unwrap();
    assert_eq!(pr.metadata.labels.as_ref().unwrap()["release"], "kps");
    let raw = &r.raw["PrometheusRule/pve-bigfleet-proxmox"];
    let file: Json = serde_yaml::from_str(
        &std::fs::read_to_string(workspace_root().join("deploy/monitoring/alerts.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(raw["spec"], file, "spec is the rule file");
    let alerts = pr.spec.groups[0]
        .rules
        .iter()
        .filter(|r| r.alert.is_some())
        .count();
    assert!(alerts >= 8, "{alerts} alerts");
    // Prometheus' templates survive the chart untouched.
    assert!(
        pr.spec.groups[0].rules[0].annotations.as_ref().unwrap()["summary"]
            .contains("{{ $labels.instance }}")
    );
}

#[test]
fn dashboard_configmap_for_the_grafana_sidecar() {
    let r = render(&with_minimal(
        "metrics: {grafanaDashboard: {enabled: true, annotations: {grafana_folder: BigFleet}, namespace: monitoring}}",
    ));
    assert_eq!(r.config_maps.len(), 1);
    let cm = &r.config_maps[0];
    assert_eq!(cm.metadata.namespace.as_deref(), Some("monitoring"));
    assert_eq!(
        cm.metadata.labels.as_ref().unwrap()["grafana_dashboard"],
        "1"
    );
    assert_eq!(
        cm.metadata.annotations.as_ref().unwrap()["grafana_folder"],
        "BigFleet"
    );
    let shipped: Json =
        serde_json::from_str(&cm.data.as_ref().unwrap()["bigfleet-proxmox.json"]).unwrap();
    let file: Json = serde_json::from_str(
        &std::fs::read_to_string(workspace_root().join("deploy/monitoring/dashboard.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(shipped, file);
    let r = render(&with_minimal(
        "metrics: {grafanaDashboard: {enabled: true}}",
    ));
    assert_eq!(
        r.config_maps[0].metadata.namespace.as_deref(),
        Some("bigfleet")
    );
}

fn secret(
    name: &str,
    key: &str,
    data: &str,
) -> ((String, String, String, String), serde_yaml::Value) {
    (
        ("v1".into(), "Secret".into(), "bigfleet".into(), name.into()),
        values(&format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: bigfleet}}\ndata: {{{key}: {data}}}\n"
        )),
    )
}

#[test]
fn checksums_roll_the_pod_when_config_or_secrets_change() {
    let base = pod_annotations(&render(MINIMAL_CA));
    for k in [
        "checksum/config",
        "checksum/proxmox-token",
        "checksum/proxmox-ca",
    ] {
        assert!(base.contains_key(k), "{k} on the pod template: {base:?}");
    }
    assert!(!base.contains_key("checksum/tls"));
    let changed = |extra: &str, key: &str| {
        let a = pod_annotations(&render(&with_minimal(extra)));
        assert_ne!(a[key], base[key], "{extra} must change {key}");
        for (k, v) in &a {
            if k != key && k.starts_with("checksum/") && base.contains_key(k) {
                assert_eq!(v, &base[k], "{extra} must change only {key}, not {k}");
            }
        }
    };
    changed("offerings: {content: '[]'}", "checksum/config");
    changed("instanceTypes: {content: '{}'}", "checksum/config");
    changed(
        "credentials: {token: {secretName: pve-token-2}}",
        "checksum/proxmox-token",
    );
    changed(
        "credentials: {token: {secretKey: secret}}",
        "checksum/proxmox-token",
    );
    changed(
        "credentials: {ca: {secretName: pve-ca-2}}",
        "checksum/proxmox-ca",
    );

    // At install and upgrade helm reads the Secrets: new content, new checksum.
    let cluster = |token: &str| -> Cluster {
        [
            secret("pve-token", "token", token),
            secret("pve-ca", "ca.crt", "Y2E="),
        ]
        .into_iter()
        .collect()
    };
    let v1 = pod_annotations(&render_in(MINIMAL_CA, &cluster("c2VjcmV0MQ==")));
    let v2 = pod_annotations(&render_in(MINIMAL_CA, &cluster("c2VjcmV0Mg==")));
    assert_ne!(v1["checksum/proxmox-token"], v2["checksum/proxmox-token"]);
    assert_ne!(v1["checksum/proxmox-token"], base["checksum/proxmox-token"]);
    assert_eq!(v1["checksum/proxmox-ca"], v2["checksum/proxmox-ca"]);
    // The Secret's content never appears in the rendered output.
    let docs = chart()
        .render_in(
            &values(MINIMAL_CA),
            &Release::default(),
            &cluster("c2VjcmV0MQ=="),
        )
        .unwrap();
    assert!(docs.iter().all(|d| !d.yaml.contains("c2VjcmV0MQ==")));

    let tls = pod_annotations(&render(&with_minimal(
        "tls: {enabled: true, secretName: provider-tls}",
    )));
    assert!(tls.contains_key("checksum/tls"));
    let fake = pod_annotations(&render(
        "fakeBackend: {enabled: true}\nstate: {enabled: false}\n",
    ));
    assert!(!fake.contains_key("checksum/proxmox-token"));
    assert!(fake.contains_key("checksum/config"));
}

#[test]
fn chart_metadata_is_complete() {
    let chart = chart();
    let m = &chart.metadata;
    let get = |k: &str| m.get(k).unwrap_or_else(|| panic!("Chart.yaml has no {k}"));
    assert_eq!(get("apiVersion").as_str(), Some("v2"));
    assert_eq!(get("type").as_str(), Some("application"));
    assert!(get("description").as_str().unwrap().len() > 40);
    assert!(get("kubeVersion").as_str().unwrap().starts_with(">="));
    let field = workspace_package_field;
    assert_eq!(
        get("appVersion").as_str(),
        Some(field("version").as_str()),
        "appVersion is the provider's version"
    );
    assert!(get("keywords").as_sequence().unwrap().len() >= 3);
    for maint in get("maintainers").as_sequence().unwrap() {
        assert!(maint["name"].as_str().is_some_and(|n| !n.is_empty()));
    }
    let ann = get("annotations");
    assert_eq!(
        ann["artifacthub.io/license"].as_str(),
        Some(field("license").as_str())
    );
    let images: serde_yaml::Value =
        serde_yaml::from_str(ann["artifacthub.io/images"].as_str().unwrap()).unwrap();
    assert_eq!(
        images[0]["image"].as_str(),
        Some(format!("bigfleet-proxmox:{}", field("version")).as_str())
    );
}

#[test]
fn templates_use_only_values_that_values_yaml_defines() {
    // A misspelt `.Values.x` renders as empty instead of failing; every path
    // the templates read must exist in values.yaml (and so in the schema).
    let chart = chart();
    let mut sources: Vec<(String, String)> = chart.templates.clone();
    sources.push(("_helpers.tpl".into(), chart.helpers.clone()));
    sources.push(("NOTES.txt".into(), chart.notes.clone().unwrap_or_default()));
    let mut checked = 0;
    for (name, src) in sources {
        for (i, _) in src.match_indices(".Values.") {
            let path: String = src[i + 8..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '_')
                .collect();
            let mut v = &chart.values;
            for seg in path.trim_end_matches('.').split('.') {
                v = v.get(seg).unwrap_or_else(|| {
                    panic!("{name}: .Values.{path} is not defined in values.yaml")
                });
            }
            checked += 1;
        }
    }
    assert!(checked > 50, "only {checked} value references found");
}

/// PostgreSQL state with three replicas, the password from a Secret and
/// the CA from CloudNativePG's `<cluster>-ca` Secret.
const POSTGRES_HA: &str = r#"
replicaCount: 3
state:
  postgres:
    url: postgres://bigfleet@pg-rw.databases.svc:5432/bigfleet?sslmode=verify-full
    password: {secretName: pg-app, secretKey: password}
    ca: {secretName: pg-ca}
    leaseTTL: 8s
"#;

fn pod_spec(r: &Rendered) -> &k8s_openapi::api::core::v1::PodSpec {
    r.deployment()
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
}

#[test]
fn postgres_state_replaces_the_volume_with_the_url_its_password_and_ca() {
    let r = render(&format!("{MINIMAL_CA}{POSTGRES_HA}"));
    let f = r.flags();
    assert_eq!(
        f["--state"],
        "postgres://bigfleet@pg-rw.databases.svc:5432/bigfleet?sslmode=verify-full\
         &sslrootcert=/etc/bigfleet/postgres-ca/ca.crt"
    );
    assert_eq!(
        f["--state-password-file"],
        "/etc/bigfleet/postgres-password/password"
    );
    assert_eq!(f["--lease-ttl"], "8s");
    assert!(r.pvcs.is_empty(), "no PVC with PostgreSQL");
    assert!(volume(&r, "state").is_none() && mount(&r, "state").is_none());
    let pm = mount(&r, "postgres-password").expect("password mount");
    assert_eq!(pm.mount_path, "/etc/bigfleet/postgres-password");
    assert_eq!(pm.read_only, Some(true));
    let pv = volume(&r, "postgres-password")
        .unwrap()
        .secret
        .as_ref()
        .unwrap();
    assert_eq!(pv.secret_name.as_deref(), Some("pg-app"));
    assert_eq!(pv.items.as_ref().unwrap()[0].key, "password");
    assert_eq!(pv.default_mode, Some(0o440));
    let cm = mount(&r, "postgres-ca").expect("CA mount");
    assert_eq!(cm.mount_path, "/etc/bigfleet/postgres-ca");
    assert_eq!(cm.read_only, Some(true));
    let cv = volume(&r, "postgres-ca").unwrap().secret.as_ref().unwrap();
    assert_eq!(cv.secret_name.as_deref(), Some("pg-ca"));
    assert_eq!(cv.items.as_ref().unwrap()[0].path, "ca.crt");
    // Rotating the password restarts the pods, as the token's does.
    assert!(pod_annotations(&r).contains_key("checksum/postgres-password"));
}

#[test]
fn several_replicas_roll_and_spread_over_nodes_and_a_budget_is_opt_in() {
    let r = render(&format!("{MINIMAL_CA}{POSTGRES_HA}"));
    let spec = r.deployment().spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(3));
    let strategy = spec.strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().unwrap();
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    // Only the leader is ever Ready: a lower maxUnavailable stalls.
    assert_eq!(
        rolling.max_unavailable,
        Some(IntOrString::String("100%".into()))
    );
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    // A budget would keep a drain from ever evicting the leader.
    assert!(r.pdb.is_none(), "no budget by default");

    let with_budget = render(&format!(
        "{MINIMAL_CA}{POSTGRES_HA}podDisruptionBudget: {{enabled: true}}\n"
    ));
    let pdb = with_budget.pdb.as_ref().expect("a PodDisruptionBudget");
    let pdb_spec = pdb.spec.as_ref().unwrap();
    assert_eq!(pdb_spec.min_available, Some(IntOrString::Int(1)));
    assert_eq!(
        pdb_spec.selector.as_ref().unwrap().match_labels,
        spec.selector.match_labels
    );

    let anti = pod_spec(&r)
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .expect("pod anti-affinity");
    assert!(anti
        .required_during_scheduling_ignored_during_execution
        .is_none());
    let preferred = anti
        .preferred_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap();
    assert_eq!(preferred.len(), 1);
    let term = &preferred[0].pod_affinity_term;
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    assert_eq!(
        term.label_selector.as_ref().unwrap().match_labels,
        spec.selector.match_labels
    );
    // The readiness probe (/readyz: 503 on a standby) is what keeps the
    // Service on the leader.
    let probe = r.container().readiness_probe.as_ref().unwrap();
    assert_eq!(
        probe.http_get.as_ref().unwrap().path.as_deref(),
        Some("/readyz")
    );
}

#[test]
fn one_replica_on_postgres_rolls_without_a_budget_or_spreading() {
    let r = render(&format!(
        "{MINIMAL_CA}state: {{postgres: {{url: 'postgresql://bf@db:5432/bf'}}}}\n"
    ));
    let spec = r.deployment().spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(1));
    assert_eq!(
        spec.strategy.as_ref().unwrap().type_.as_deref(),
        Some("RollingUpdate")
    );
    assert!(r.pdb.is_none());
    assert!(pod_spec(&r).affinity.is_none());
    let f = r.flags();
    assert_eq!(f["--state"], "postgresql://bf@db:5432/bf");
    assert!(!f.contains_key("--state-password-file") && !f.contains_key("--lease-ttl"));
    assert!(volume(&r, "postgres-password").is_none() && volume(&r, "postgres-ca").is_none());
    assert!(r.pvcs.is_empty());
}

#[test]
fn a_ca_from_a_config_map_starts_the_query_when_the_url_has_none() {
    let r = render(&format!(
        "{MINIMAL_CA}state: {{postgres: {{url: 'postgres://bf@db/bf', ca: {{configMapName: db-ca, key: root.pem}}}}}}\n"
    ));
    assert_eq!(
        r.flags()["--state"],
        "postgres://bf@db/bf?sslrootcert=/etc/bigfleet/postgres-ca/root.pem"
    );
    let v = volume(&r, "postgres-ca").unwrap();
    assert!(v.secret.is_none());
    let cm = v.config_map.as_ref().unwrap();
    assert_eq!(cm.name, "db-ca");
    assert_eq!(cm.items.as_ref().unwrap()[0].key, "root.pem");
}

#[test]
fn anti_affinity_yields_to_the_values_own_and_can_be_off() {
    let theirs = format!(
        "{MINIMAL_CA}{POSTGRES_HA}affinity:\n  podAntiAffinity:\n    \
         requiredDuringSchedulingIgnoredDuringExecution:\n      \
         - topologyKey: topology.kubernetes.io/zone\n        \
         labelSelector: {{matchLabels: {{app: x}}}}\n"
    );
    let r = render(&theirs);
    let anti = pod_spec(&r)
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .unwrap();
    assert!(anti
        .preferred_during_scheduling_ignored_during_execution
        .is_none());
    assert_eq!(
        anti.required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()[0]
            .topology_key,
        "topology.kubernetes.io/zone"
    );
    let off = render(&format!(
        "{MINIMAL_CA}{POSTGRES_HA}podAntiAffinity: {{enabled: false}}\npodDisruptionBudget: {{enabled: false}}\n"
    ));
    assert!(pod_spec(&off).affinity.is_none());
    assert!(off.pdb.is_none());
}

#[test]
fn several_replicas_without_postgres_are_refused_naming_the_fix() {
    // The template's own refusal names replicaCount and what it needs. The
    // schema must not refuse first: helm would then print only
    // `at '/state/postgres/url': "" is shorter than 1 character`.
    let want = "replicaCount above 1 needs the state in PostgreSQL: set state.postgres.url";
    let e = render_err(&format!("{MINIMAL_CA}replicaCount: 2\n"));
    assert!(e.contains(want), "{e}");
    assert!(!e.contains("shorter than"), "{e}");
    // The same without the schema (helm --skip-schema-validation).
    let mut chart = chart();
    chart.schema = None;
    let e = chart
        .render(
            &values(&format!("{MINIMAL_CA}replicaCount: 2\n")),
            &Release::default(),
        )
        .expect_err("refused")
        .to_string();
    assert!(e.contains(want), "{e}");
    // Nor with the state switched off, even with a URL left in the values.
    let e = render_err(&format!(
        "{MINIMAL_CA}replicaCount: 2\nstate: {{enabled: false, postgres: {{url: 'postgres://bf@db/bf'}}}}\n"
    ));
    assert!(
        e.contains("state.postgres.url needs state.enabled: true"),
        "{e}"
    );
}

#[test]
fn postgres_values_that_cannot_work_are_refused() {
    for (values, why) in [
        (
            "state: {postgres: {url: 'postgres://bf:hunter2@db/bf'}}",
            "/state/postgres/url",
        ),
        ("state: {postgres: {url: 'mysql://bf@db/bf'}}", "/state/postgres/url"),
        (
            "state: {postgres: {url: 'postgres://bf@db/bf', leaseTTL: 'soon'}}",
            "/state/postgres/leaseTTL",
        ),
        ("replicaCount: 0", "/replicaCount"),
        (
            "state: {postgres: {url: 'postgres://bf@db/bf', ca: {secretName: a, configMapName: b}}}",
            "set secretName or configMapName, not both",
        ),
        (
            "state: {postgres: {url: 'postgres://bf@db/bf?sslrootcert=/x', ca: {secretName: a}}}",
            "drop sslrootcert= from the URL",
        ),
        (
            "state: {enabled: false, postgres: {url: 'postgres://bf@db/bf'}}",
            "state.postgres.url needs state.enabled: true",
        ),
    ] {
        let e = render_err(&format!("{MINIMAL_CA}{values}\n"));
        assert!(e.contains(why), "{values}: {e}");
    }
}
