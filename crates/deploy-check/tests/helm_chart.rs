//! Renders deploy/helm/bigfleet-proxmox with several value sets, parses every
//! document as YAML and validates it against the Kubernetes API types:
//! each object must deserialise into its k8s-openapi type and survive a
//! round-trip unchanged (so a misspelt or misplaced field fails the test),
//! then the fields the provider depends on are asserted.

use std::collections::BTreeMap;

use deploy_check::helm::{merge, Chart, Document, Release};
use deploy_check::workspace_root;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, PersistentVolumeClaim, Service, ServiceAccount,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value as Json;

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

/// Drops nulls, which the typed objects legitimately omit on output.
fn strip_nulls(v: &mut Json) {
    match v {
        Json::Object(m) => {
            m.retain(|_, v| !v.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Json::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

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
    let docs = chart()
        .render(&values(overrides), &Release::default())
        .unwrap_or_else(|e| panic!("render failed: {e}"));
    let mut out = Rendered::default();
    for doc in &docs {
        let json: Json = serde_yaml::from_str(&doc.yaml)
            .unwrap_or_else(|e| panic!("{}: invalid YAML: {e}\n{}", doc.template, doc.yaml));
        let kind = json["kind"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "Deployment" => {
                assert!(out.deployment.is_none(), "two Deployments");
                out.deployment = Some(strict(doc, &json));
            }
            "Service" => out.service = Some(strict(doc, &json)),
            "ServiceAccount" => out.service_account = Some(strict(doc, &json)),
            "ConfigMap" => out.config_maps.push(strict(doc, &json)),
            "PersistentVolumeClaim" => out.pvcs.push(strict(doc, &json)),
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
    let ann = |r: &Rendered| {
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
            .unwrap()
    };
    assert_ne!(
        ann(&r)["checksum/offerings"],
        ann(&base)["checksum/offerings"]
    );
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
    let notes = chart
        .render_notes(
            &values("fakeBackend: {enabled: true}\nstate: {enabled: false}\n"),
            &Release::default(),
        )
        .unwrap();
    assert!(notes.contains("fakeBackend.enabled is set"), "{notes}");
    assert!(notes.contains("state.enabled is false"), "{notes}");
}
