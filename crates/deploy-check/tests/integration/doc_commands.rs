//! Every example command of README.md and docs/*.md runs as written, or
//! is listed in [`NOT_RUN`] with why it cannot run here; a command that is
//! neither, and an entry whose command the docs no longer have, fail.
//!
//! - The provider (`cargo run -p bigfleet-proxmox --`, the binary, `BIN`,
//!   the arguments `docker run` hands the image) starts from the built
//!   binary, answers `/readyz` with 200, and exits 0 on SIGTERM: on the fake
//!   backend, or, given a Proxmox endpoint, against pve-sim.
//! - Each page's `ctl` commands run in page order and exit 0 with output:
//!   against the page's own provider command when it has one (the README),
//!   else against a fake-backend provider that holds the machines the page
//!   names, those it reclaims left FAILED by a Create that timed out,
//!   under mTLS for the commands that pass certificates.
//! - `bigfleet-proxmox state copy` copies a state a stopped fake-backend
//!   provider wrote into a new file.
//! - `make TARGET` is a target of the Makefile (`make -n`: nothing runs).
//! - setup-token.sh and `pveum` run on a fake Proxmox VE 8 node (the
//!   recording `pveum` host_setup.rs holds the script against), and a page's
//!   hand-run `pveum` steps are the calls its setup-token.sh command makes.
//! - The commands of tools these tests already use (`promtool`) run as
//!   written from the workspace root.
//!
//! Only what is this test's is substituted: listen addresses become free
//! ports on 127.0.0.1 (and are added where the command relies on the
//! all-interfaces defaults), files become files in a temp dir, the
//! Proxmox endpoint, token and CA become pve-sim's, `--target` the running
//! provider (in the form written: `:PORT` stays `:PORT`), and
//! certification.md's placeholders (`PORT`, `N`, `PATH`, `[optional]`)
//! values. `cargo run ... --` is the built binary.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use deploy_check::commands::{doc_commands, flag_value, kind, replace_flag, DocCommand, Kind};
use deploy_check::tools::{find_or_skip, provider_binary, pve_sim_binary, PROMTOOL_INSTALL};
use deploy_check::workspace_root;
use provider_testkit::wait::Wait;

use crate::common::{
    setup_token_script, start_provider, FakePveHost, Provider, Running, START_WITHIN,
};

/// The commands no test here can run, each with the reason. Keyed by the
/// command as written (continuations joined, comment cut, whitespace
/// collapsed), so a new or changed command must be run or listed anew.
const NOT_RUN: &[(&str, &str)] = &[
    (
        "cd \"$BIGFLEET_SRC\"",
        "a BigFleet checkout; `BIGFLEET_SRC=... make certify-proxmox` runs its baseline",
    ),
    (
        "go test -tags=conformance -count=1 -run '^TestConformance_' ./test/conformance/... \
         -target=127.0.0.1:PORT",
        "BigFleet's own Go suite, in its checkout and with Go; the certification runner \
         runs it when BIGFLEET_SRC is set",
    ),
    (
        "cargo build -p bigfleet-proxmox -p pve-sim",
        "a build; these tests run the debug binaries it makes",
    ),
    (
        "pve-sim --listen 127.0.0.1:18006 --guest-agent builtin --ca-out \
         ./pve-sim-ca.pem > pve-sim.log 2>&1 &",
        "start_sim starts pve-sim the same way (--guest-agent builtin, --ca-out) for the \
         page's provider command, on a free port",
    ),
    (
        "export PATH=\"$PWD/target/debug:$PATH\"",
        "puts the debug binaries on PATH; these tests run them by path",
    ),
    (
        "sed -n 's/^token_secret: //p' pve-sim.log > token",
        "at_sim writes pve-sim's token secret into the file --proxmox-token-file names",
    ),
    (
        "cargo build --release -p bigfleet-proxmox -p conformance",
        "a release build takes minutes; this test runs the debug build of the same binary",
    ),
    (
        "target/release/bfconformance --target 127.0.0.1:9099",
        "the certification suite takes minutes; `make certify-pve-sim` runs it against this \
         recipe's provider on pve-sim (scripts/certify-pve-sim.sh)",
    ),
    (
        "openssl x509 -in /etc/pve/local/pve-ssl.pem -noout -fingerprint -sha256",
        "reads a Proxmox VE node's certificate; pve's tls tests parse its output as printed",
    ),
    (
        "docker build -f deploy/Dockerfile --build-arg REVISION=\"$(git rev-parse HEAD)\" \
         --build-arg SOURCE=<your-repository-url> -t <your-registry>/bigfleet-proxmox:0.1.0 .",
        "needs a Docker engine; dockerfile.rs lints the Dockerfile and image_rootfs.rs boots \
         the root filesystem its build script stages",
    ),
    (
        "docker push <your-registry>/bigfleet-proxmox:0.1.0",
        "needs a Docker engine and the operator's registry",
    ),
    (
        "kubectl create namespace bigfleet",
        "needs a Kubernetes cluster",
    ),
    (
        "kubectl -n bigfleet create secret generic pve-token --from-file=token=./token",
        "needs a Kubernetes cluster; helm_chart.rs renders the chart reading this Secret",
    ),
    (
        "scp root@pve1:/etc/pve/pve-root-ca.pem .",
        "copies from a Proxmox VE node",
    ),
    (
        "kubectl -n bigfleet create secret generic pve-ca --from-file=ca.crt=./pve-root-ca.pem",
        "needs a Kubernetes cluster; helm_chart.rs renders the chart reading this Secret",
    ),
    (
        "helm install pve-dc1 deploy/helm/bigfleet-proxmox -n bigfleet -f values.yaml",
        "needs a Kubernetes cluster; docs_examples.rs renders these values through the chart \
         and chart_boots_binary.rs boots the binary with the rendered arguments",
    ),
    (
        "kubectl -n bigfleet rollout status deploy/pve-dc1-bigfleet-proxmox",
        "needs a Kubernetes cluster",
    ),
    (
        "kubectl -n bigfleet logs deploy/pve-dc1-bigfleet-proxmox | grep 'serving CapacityProvider'",
        "needs a Kubernetes cluster; every provider this test starts is awaited by that line",
    ),
    (
        "kubectl -n bigfleet port-forward deploy/pve-dc1-bigfleet-proxmox 9090:9090 &",
        "needs a Kubernetes cluster",
    ),
    (
        "curl -s localhost:9090/readyz",
        "through the port-forward above; this test GETs /readyz of every provider it starts",
    ),
    (
        "curl -s localhost:9090/metrics | grep bigfleet_proxmox_reconcile_total",
        "through the port-forward above; live_metrics.rs scrapes the live provider",
    ),
    (
        "helm uninstall pve-dc1 -n bigfleet",
        "needs a Kubernetes cluster",
    ),
    (
        "kubectl -n bigfleet port-forward deploy/pve-dc1-bigfleet-proxmox 9000:9000 &",
        "needs a Kubernetes cluster; the ctl command after it runs here",
    ),
    (
        "kubectl -n bigfleet create secret generic pve-token-2 --from-file=token=./token",
        "needs a Kubernetes cluster",
    ),
    (
        "helm upgrade pve-dc1 deploy/helm/bigfleet-proxmox -n bigfleet --reuse-values \
         --set credentials.token.secretName=pve-token-2",
        "needs a Kubernetes cluster; helm_chart.rs renders credentials.token.secretName",
    ),
    (
        "kubectl -n bigfleet scale deploy/pve-dc1-bigfleet-proxmox --replicas=0",
        "needs a Kubernetes cluster",
    ),
    (
        "kubectl apply -f bigfleet-pg.yaml",
        "needs a Kubernetes cluster with CloudNativePG",
    ),
    (
        "kubectl -n bigfleet wait cluster/bigfleet-pg --for=condition=Ready --timeout=10m",
        "needs a Kubernetes cluster with CloudNativePG",
    ),
    (
        "kubectl -n bigfleet wait --for=delete pod -l app.kubernetes.io/instance=pve-dc1 \
         --timeout=5m",
        "needs a Kubernetes cluster",
    ),
    (
        "kubectl apply -f bigfleet-state-copy.yaml",
        "needs a Kubernetes cluster; configuration.md's `state copy` command runs here, and \
         the binary's tests copy between SQLite and PostgreSQL",
    ),
    (
        "kubectl -n bigfleet wait job/bigfleet-state-copy --for=condition=Complete --timeout=10m",
        "needs a Kubernetes cluster",
    ),
    (
        "kubectl -n bigfleet logs job/bigfleet-state-copy",
        "needs a Kubernetes cluster",
    ),
    (
        "helm upgrade pve-dc1 deploy/helm/bigfleet-proxmox -n bigfleet -f values.yaml -f \
         values-postgres.yaml",
        "needs a Kubernetes cluster; kubernetes_validate.rs validates the manifests of these \
         values and chart_boots_binary.rs runs the binary with the PostgreSQL arguments",
    ),
];

/// Tools these tests already use, whose documented commands run as written
/// from the workspace root: the program and how to install it.
const RUN_AS_WRITTEN: &[(&str, &str)] = &[("promtool", PROMTOOL_INSTALL)];

/// How long a provider may take to exit after SIGTERM (its shutdown grace
/// is 10 s by default).
const STOP_WITHIN: Duration = Duration::from_secs(30);

/// Every documented command with what it runs.
fn commands() -> Vec<(DocCommand, Kind)> {
    let commands = doc_commands(&workspace_root()).unwrap_or_else(|e| panic!("{e}"));
    commands
        .into_iter()
        .map(|c| {
            let k = kind(&c.words);
            (c, k)
        })
        .collect()
}

/// The host setup programs the docs run on a Proxmox VE node, which a
/// [`FakePveHost`] stands in for.
const HOST_SETUP_PROGRAMS: &[&str] = &["setup-token.sh", "pveum"];

/// The host setup program `words` run, if any.
fn host_setup_program(words: &[String]) -> Option<&'static str> {
    let name = Path::new(words.first()?).file_name()?.to_str()?;
    HOST_SETUP_PROGRAMS.iter().copied().find(|p| *p == name)
}

/// The [`RUN_AS_WRITTEN`] entry of the program `words` run, if any.
fn run_as_written(words: &[String]) -> Option<(&'static str, &'static str)> {
    let program = words.first()?;
    RUN_AS_WRITTEN.iter().copied().find(|(p, _)| p == program)
}

/// Whether no test here runs the command.
fn not_run_here(c: &DocCommand, k: &Kind) -> bool {
    *k == Kind::Other
        && host_setup_program(&c.words).is_none()
        && run_as_written(&c.words).is_none()
}

#[test]
fn documented_tool_commands_run_as_written() {
    let mut ran = 0;
    for (c, _) in commands() {
        let Some((program, install)) = run_as_written(&c.words) else {
            continue;
        };
        let Some(bin) = find_or_skip(program, install, &c.text) else {
            continue;
        };
        let out = Command::new(bin)
            .args(&c.words[1..])
            .current_dir(workspace_root())
            .output()
            .unwrap_or_else(|e| panic!("{}: running `{}`: {e}", c.at(), c.text));
        assert!(
            out.status.success(),
            "{}: `{}` failed ({}):\n{}{}",
            c.at(),
            c.text,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ran += 1;
    }
    eprintln!("ran {ran} documented tool commands");
}

#[test]
fn every_doc_command_is_run_or_listed_with_its_reason() {
    let commands = commands();
    let not_run: BTreeMap<&str, &str> = NOT_RUN.iter().copied().collect();
    let unlisted: Vec<String> = commands
        .iter()
        .filter(|(c, k)| not_run_here(c, k) && !not_run.contains_key(c.text.as_str()))
        .map(|(c, _)| format!("{}: {:?}", c.at(), c.text))
        .collect();
    assert!(
        unlisted.is_empty(),
        "documented commands this test neither runs nor lists in NOT_RUN (run them, or \
         add each with the reason it cannot run):\n{}",
        unlisted.join("\n")
    );
    let other: BTreeSet<&str> = commands
        .iter()
        .filter(|(c, k)| not_run_here(c, k))
        .map(|(c, _)| c.text.as_str())
        .collect();
    let stale: Vec<&str> = not_run
        .keys()
        .copied()
        .filter(|t| !other.contains(t))
        .collect();
    assert!(
        stale.is_empty(),
        "NOT_RUN lists commands the docs no longer have (or that now run):\n{}",
        stale.join("\n")
    );
    let count = |want: fn(&Kind) -> bool| commands.iter().filter(|(_, k)| want(k)).count();
    assert!(
        count(|k| matches!(k, Kind::Serve(_))) >= 4
            && count(|k| matches!(k, Kind::Ctl(_))) >= 10
            && count(|k| matches!(k, Kind::Make { .. })) >= 4,
        "too few commands found; is the extraction reading the shell blocks?"
    );
}

#[test]
fn documented_make_targets_exist() {
    let mut checked = 0;
    for (c, k) in commands() {
        let Kind::Make { target, vars } = k else {
            continue;
        };
        checked += 1;
        let out = Command::new("make")
            .arg("-n")
            .arg(&target)
            .args(&vars)
            .current_dir(workspace_root())
            .output()
            .expect("run make -n");
        assert!(
            out.status.success(),
            "{}: `{}`: `make -n {target}` failed: {}",
            c.at(),
            c.text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(checked >= 4, "only {checked} make commands found");
}

/// A free port on 127.0.0.1, picked by the kernel.
const ANY_PORT: &str = "127.0.0.1:0";

/// `args` with `flag` set to `value` where it is given, added where not.
fn set_or_add(args: &[String], flag: &str, value: &str) -> Vec<String> {
    if flag_value(args, flag).is_some() {
        replace_flag(args, flag, |_| value.to_owned())
    } else {
        let mut out = args.to_vec();
        out.extend([flag.to_owned(), value.to_owned()]);
        out
    }
}

/// `path`'s file name inside `dir`: a documented file, made this test's.
fn in_dir(dir: &Path, path: &str) -> String {
    let name = Path::new(path)
        .file_name()
        .map_or_else(|| path.to_owned(), |n| n.to_string_lossy().into_owned());
    dir.join(name).display().to_string()
}

/// The documented provider arguments as this test runs them, one list per
/// reading of its `[optional]` words: without them, then with them.
fn readings(args: &[String]) -> Vec<Vec<String>> {
    let optional = |w: &String| w.starts_with('[') && w.ends_with(']');
    if !args.iter().any(optional) {
        return vec![args.to_vec()];
    }
    let without = args.iter().filter(|w| !optional(w)).cloned().collect();
    let with = args
        .iter()
        .map(|w| {
            if optional(w) {
                w[1..w.len() - 1].to_owned()
            } else {
                w.clone()
            }
        })
        .collect();
    vec![without, with]
}

/// The listeners and files of a documented provider command made this
/// test's, and certification.md's `N` a number.
fn localise(args: &[String], dir: &Path) -> Vec<String> {
    let args = set_or_add(args, "--addr", ANY_PORT);
    let args = set_or_add(&args, "--metrics-addr", ANY_PORT);
    let args = replace_flag(&args, "--state", |path| in_dir(dir, path));
    replace_flag(&args, "--seed-count", |n| {
        if n.parse::<u32>().is_ok() {
            n.to_owned()
        } else {
            "8".to_owned()
        }
    })
}

/// Whether a documented provider command talks to a Proxmox endpoint.
fn is_proxmox(args: &[String]) -> bool {
    flag_value(args, "--proxmox-api-url").is_some()
}

/// Starts the provider for a documented command; the panic names the doc.
fn serve(c: &DocCommand, args: &[String]) -> Provider {
    start_provider(args).unwrap_or_else(|e| {
        panic!(
            "{}: `{}` did not start (run as {args:?}): {e}",
            c.at(),
            c.text
        )
    })
}

/// The provider answers `/readyz` with 200 (it turns ready before logging
/// its start-up line), then exits 0 on SIGTERM.
fn assert_serves_and_stops(c: &DocCommand, p: Provider) {
    let metrics = p
        .metrics
        .unwrap_or_else(|| panic!("{}: `{}` serves no metrics listener", c.at(), c.text));
    let ready = provider_testkit::http::get(metrics, "/readyz")
        .unwrap_or_else(|e| panic!("{}: GET /readyz: {e}", c.at()));
    assert_eq!(
        ready.status,
        200,
        "{}: `{}` is not ready once serving: {}",
        c.at(),
        c.text,
        ready.body
    );
    let what = p.process.what.clone();
    let status = p.process.terminate(STOP_WITHIN);
    assert!(
        status.success(),
        "{}: `{}` ended {status} on SIGTERM (ran `{what}`)",
        c.at(),
        c.text
    );
}

/// Runs `run` on each item in a thread of its own; fails with every
/// item's failure, each named by `name`.
fn in_parallel<T: Sync>(items: &[T], name: impl Fn(&T) -> String, run: impl Fn(&T) + Sync) {
    let failures: Vec<String> = std::thread::scope(|s| {
        let running: Vec<_> = items
            .iter()
            .map(|item| (name(item), s.spawn(|| run(item))))
            .collect();
        running
            .into_iter()
            .filter_map(|(name, thread)| {
                let panic = thread.join().err()?;
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                // Most messages open with the doc line already.
                Some(if message.starts_with(&name) {
                    message
                } else {
                    format!("{name}: {message}")
                })
            })
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn documented_fake_backend_commands_serve_and_stop_on_sigterm() {
    let runs: Vec<(DocCommand, Vec<String>)> = commands()
        .into_iter()
        .filter_map(|(c, k)| match k {
            Kind::Serve(args) if !is_proxmox(&args) => Some((c, args)),
            _ => None,
        })
        .flat_map(|(c, args)| readings(&args).into_iter().map(move |r| (c.clone(), r)))
        .collect();
    assert!(runs.len() >= 3, "the fake-backend commands: {runs:?}");
    in_parallel(
        &runs,
        |(c, _)| c.at(),
        |(c, args)| {
            let dir = tempfile::tempdir().expect("tempdir");
            assert_serves_and_stops(c, serve(c, &localise(args, dir.path())));
        },
    );
}

/// Where pve-sim serves the API the documented Proxmox commands point at.
struct Sim {
    url: String,
    token_id: String,
    secret: String,
    fingerprint: String,
    ca: PathBuf,
}

/// Starts pve-sim with the nodes, pools and templates `commands` name (the
/// defaults where they name none: template 9000); the process, and where
/// it serves.
fn start_sim(dir: &Path, commands: &[(DocCommand, Vec<String>)]) -> (Running, Sim) {
    let mut nodes = BTreeSet::new();
    let mut pools = BTreeSet::new();
    let mut templates = BTreeSet::new();
    for (_, args) in commands {
        nodes.extend(
            flag_value(args, "--nodes")
                .into_iter()
                .flat_map(|n| n.split(',')),
        );
        pools.extend(flag_value(args, "--proxmox-pool"));
        templates.insert(flag_value(args, "--template-vmid").unwrap_or("9000"));
    }
    let join = |set: &BTreeSet<&str>, suffix: &str| {
        set.iter()
            .map(|s| format!("{s}{suffix}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let ca = dir.join("pve-sim-ca.pem");
    let mut args: Vec<String> = ["--listen", ANY_PORT, "--guest-agent", "builtin", "--ca-out"]
        .map(String::from)
        .to_vec();
    args.push(ca.display().to_string());
    args.extend(["--nodes".to_owned(), join(&nodes, "")]);
    args.extend(["--templates".to_owned(), join(&templates, ":shared")]);
    if !pools.is_empty() {
        args.extend(["--pools".to_owned(), join(&pools, "")]);
    }
    let bin = pve_sim_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut process = Running::spawn(&bin, &args);
    // Its `key: value` lines end with `realism:`.
    process
        .wait_for(START_WITHIN, |l| l.starts_with("realism:"))
        .unwrap_or_else(|e| panic!("pve-sim did not start: {e}"));
    let printed = process.seen();
    let field = |key: &str| {
        printed
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .unwrap_or_else(|| panic!("pve-sim printed no {key}:\n{printed}"))
            .to_owned()
    };
    let sim = Sim {
        url: field("base_url"),
        token_id: field("token_id"),
        secret: field("token_secret"),
        fingerprint: field("fingerprint"),
        ca,
    };
    (process, sim)
}

/// A documented Proxmox command pointed at `sim`: its endpoint, token and
/// trust anchors are pve-sim's (a token file is written into `dir`).
fn at_sim(args: &[String], sim: &Sim, dir: &Path) -> Vec<String> {
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{}\n", sim.secret)).expect("write the token file");
    let args = replace_flag(args, "--proxmox-api-url", |_| sim.url.clone());
    let args = replace_flag(&args, "--proxmox-token-id", |_| sim.token_id.clone());
    let args = replace_flag(&args, "--proxmox-token-secret", |_| sim.secret.clone());
    let args = replace_flag(&args, "--proxmox-token-file", |_| {
        token_file.display().to_string()
    });
    let args = replace_flag(&args, "--proxmox-ca-file", |_| sim.ca.display().to_string());
    replace_flag(&args, "--proxmox-tls-fingerprint", |_| {
        sim.fingerprint.clone()
    })
}

#[test]
fn documented_proxmox_commands_start_against_pve_sim() {
    let runs: Vec<(DocCommand, Vec<String>)> = commands()
        .into_iter()
        .filter_map(|(c, k)| match k {
            Kind::Serve(args) if is_proxmox(&args) => Some((c, args)),
            _ => None,
        })
        .collect();
    assert!(runs.len() >= 2, "the Proxmox commands: {runs:?}");
    let sim_dir = tempfile::tempdir().expect("tempdir");
    let (_sim_process, sim) = start_sim(sim_dir.path(), &runs);
    in_parallel(
        &runs,
        |(c, _)| c.at(),
        |(c, args)| {
            let dir = tempfile::tempdir().expect("tempdir");
            let args = at_sim(&localise(args, dir.path()), &sim, dir.path());
            assert_serves_and_stops(c, serve(c, &args));
        },
    );
}

/// A machine id as the provider forms it: `PROVIDER/OnDemand/TYPE/ZONE/NNN`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct MachineId {
    provider: String,
    instance_type: String,
    zone: String,
    index: u32,
    text: String,
}

fn machine_id(word: &str) -> Option<MachineId> {
    let [provider, "OnDemand", instance_type, zone, index] =
        word.split('/').collect::<Vec<_>>()[..]
    else {
        return None;
    };
    Some(MachineId {
        provider: provider.to_owned(),
        instance_type: instance_type.to_owned(),
        zone: zone.to_owned(),
        index: index.parse().ok()?,
        text: word.to_owned(),
    })
}

/// The machine ids among `args`.
fn machine_ids(args: &[String]) -> Vec<MachineId> {
    args.iter().filter_map(|w| machine_id(w)).collect()
}

/// The `ctl` flags that carry TLS material.
const CTL_TLS_FILES: &[&str] = &["--tls-ca", "--tls-cert", "--tls-key"];

fn uses_tls(args: &[String]) -> bool {
    CTL_TLS_FILES.iter().any(|f| flag_value(args, f).is_some())
}

/// One page's `ctl` commands that one provider serves.
struct CtlGroup {
    page: String,
    /// The page's own fake-backend provider command, when it has one.
    serve: Option<(DocCommand, Vec<String>)>,
    /// Whether these commands dial with TLS material.
    tls: bool,
    commands: Vec<(DocCommand, Vec<String>)>,
    /// The machines the page's `ctl` commands name.
    machines: Vec<MachineId>,
    /// Those a `reclaim` of the page names: FAILED when the commands start.
    failed: BTreeSet<String>,
}

/// The `ctl` commands grouped by page, then by whether they use TLS.
fn ctl_groups() -> Vec<CtlGroup> {
    let mut groups: Vec<CtlGroup> = Vec::new();
    let all = commands();
    for (c, k) in &all {
        let Kind::Ctl(args) = k else {
            continue;
        };
        let tls = uses_tls(args);
        let at = groups.iter().position(|g| g.page == c.file && g.tls == tls);
        let group = match at {
            Some(i) => &mut groups[i],
            None => {
                let serve = all.iter().find_map(|(s, k)| match k {
                    Kind::Serve(args) if s.file == c.file && !is_proxmox(args) => {
                        Some((s.clone(), args.clone()))
                    }
                    _ => None,
                });
                let page_ctl: Vec<&[String]> = all
                    .iter()
                    .filter_map(|(p, k)| match k {
                        Kind::Ctl(args) if p.file == c.file => Some(args.as_slice()),
                        _ => None,
                    })
                    .collect();
                groups.push(CtlGroup {
                    page: c.file.clone(),
                    serve,
                    tls,
                    commands: Vec::new(),
                    machines: page_ctl.iter().flat_map(|a| machine_ids(a)).collect(),
                    failed: page_ctl
                        .iter()
                        .filter(|a| a.first().is_some_and(|sub| sub == "reclaim"))
                        .flat_map(|a| machine_ids(a))
                        .map(|m| m.text)
                        .collect(),
                });
                groups.last_mut().expect("just pushed")
            }
        };
        group.commands.push((c.clone(), args.clone()));
    }
    groups
}

/// `bigfleet-proxmox ctl ARGS`: whether it exited 0, and its stdout and stderr.
fn ctl(args: &[String]) -> (bool, String, String) {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(bin)
        .arg("ctl")
        .args(args)
        .output()
        .expect("run bigfleet-proxmox ctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `args` with `--target` set to `target`.
fn at_target(args: &[String], target: &str) -> Vec<String> {
    [args, &["--target".to_owned(), target.to_owned()]].concat()
}

/// The certificates of an mTLS provider and of the `ctl` commands that
/// dial it: one CA; the server's names the `--tls-domain` the commands
/// check; the client's is `bigfleet://admin`, which may call everything.
/// Written where the commands' flags name them (their file names, in
/// `dir`); returns the provider's TLS flags.
fn pki(commands: &[(DocCommand, Vec<String>)], dir: &Path) -> Vec<String> {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "doc commands CA");
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca =
        rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().expect("CA key"))
            .expect("self-signed CA");
    let leaf = |names: Vec<String>, uri: Option<&str>, usage| {
        let mut params = rcgen::CertificateParams::new(names).expect("leaf params");
        if let Some(uri) = uri {
            let uri = rcgen::string::Ia5String::try_from(uri).expect("an ASCII URI");
            params.subject_alt_names.push(rcgen::SanType::URI(uri));
        }
        params.extended_key_usages = vec![usage];
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &ca).expect("sign the leaf");
        (cert.pem(), key.serialize_pem())
    };
    let domains: Vec<String> = commands
        .iter()
        .filter_map(|(_, args)| flag_value(args, "--tls-domain").map(str::to_owned))
        .chain(["localhost".to_owned()])
        .collect();
    let (server_cert, server_key) = leaf(domains, None, rcgen::ExtendedKeyUsagePurpose::ServerAuth);
    let (client_cert, client_key) = leaf(
        Vec::new(),
        Some("bigfleet://admin"),
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    );
    let write = |path: &str, pem: &str| {
        std::fs::write(path, pem).unwrap_or_else(|e| panic!("write {path}: {e}"));
        path.to_owned()
    };
    for (_, args) in commands {
        for (flag, pem) in [
            ("--tls-ca", ca.pem()),
            ("--tls-cert", client_cert.clone()),
            ("--tls-key", client_key.clone()),
        ] {
            if let Some(path) = flag_value(args, flag) {
                write(&in_dir(dir, path), &pem);
            }
        }
    }
    let file = |name: &str| dir.join(name).display().to_string();
    vec![
        "--tls-cert".to_owned(),
        write(&file("provider.crt"), &server_cert),
        "--tls-key".to_owned(),
        write(&file("provider.key"), &server_key),
        "--tls-ca".to_owned(),
        write(&file("provider-clients-ca.pem"), &ca.pem()),
    ]
}

/// A fake-backend provider holding every machine the group's page names (offerings
/// sized to the highest index of each type and zone), those a `reclaim`
/// names FAILED: created while each clone takes an hour and a Create may
/// take 200 ms, so each Create times out (a restart no longer fails what it
/// interrupts: the Create would resume).
fn fleet(group: &CtlGroup, dir: &Path) -> Provider {
    let ids = &group.machines;
    let names: BTreeSet<&str> = ids.iter().map(|m| m.provider.as_str()).collect();
    assert!(
        names.len() <= 1,
        "{}: the ctl commands name machines of several providers: {names:?}",
        group.page
    );
    let mut args = vec!["--use-fake-backend".to_owned()];
    if let Some(name) = names.first() {
        let mut counts: BTreeMap<(&str, &str), u32> = BTreeMap::new();
        for m in ids {
            let count = counts.entry((&m.instance_type, &m.zone)).or_default();
            *count = (*count).max(m.index + 1);
        }
        let offerings: Vec<serde_json::Value> = counts
            .iter()
            .map(|((t, z), n)| serde_json::json!({"instance_type": t, "zone": z, "count": n}))
            .collect();
        let path = dir.join("fleet-offerings.json");
        std::fs::write(&path, serde_json::Value::from(offerings).to_string())
            .expect("write the offerings");
        args.extend([
            "--provider".to_owned(),
            name.to_string(),
            "--offerings".to_owned(),
            path.display().to_string(),
        ]);
    }
    let state = dir.join("fleet-state.db").display().to_string();
    args.extend(["--state".to_owned(), state]);
    args.extend(["--addr", ANY_PORT, "--metrics-addr", ANY_PORT].map(String::from));
    let failed = &group.failed;
    if !failed.is_empty() {
        let slow = [
            args.clone(),
            ["--fake-latency", "1h", "--create-timeout", "200ms"]
                .map(String::from)
                .to_vec(),
        ]
        .concat();
        let p = start_provider(&slow).unwrap_or_else(|e| panic!("the fleet did not start: {e}"));
        for id in failed {
            let (ok, out, err) = ctl(&at_target(&["create".to_owned(), id.clone()], &p.grpc));
            assert!(ok, "{}: creating {id} to fail it: {out}{err}", group.page);
        }
        for id in failed {
            await_failed(id, &p.grpc, &group.page);
        }
        let status = p.process.terminate(STOP_WITHIN);
        assert!(status.success(), "the fleet ended {status} on SIGTERM");
    }
    args.extend(["--fake-latency", "1ms"].map(String::from));
    if group.tls {
        args.extend(pki(&group.commands, dir));
    }
    let p = start_provider(&args).unwrap_or_else(|e| panic!("the fleet did not start: {e}"));
    if !group.tls {
        for id in failed {
            let (ok, out, err) = ctl(&at_target(
                &["-o", "json", "get", id].map(String::from),
                &p.grpc,
            ));
            let state = serde_json::from_str::<serde_json::Value>(&out)
                .ok()
                .and_then(|m| m["state"].as_str().map(str::to_owned));
            assert!(
                ok && state.as_deref() == Some("FAILED"),
                "{}: {id} is not FAILED after its Create timed out: {out}{err}",
                group.page
            );
        }
    }
    p
}

/// Polls `ctl get` until machine `id` is FAILED (its Create timed out), for
/// at most 30 s: the landing is in the provider's background, with nothing
/// to subscribe to.
fn await_failed(id: &str, grpc: &str, page: &str) {
    Wait::new(format!("{id} to be FAILED"), Duration::from_secs(30))
        .every(Duration::from_millis(50))
        .try_ok_blocking(|| {
            let (ok, out, err) = ctl(&at_target(
                &["-o", "json", "get", id].map(String::from),
                grpc,
            ));
            let state = serde_json::from_str::<serde_json::Value>(&out)
                .ok()
                .and_then(|m| m["state"].as_str().map(str::to_owned));
            if ok && state.as_deref() == Some("FAILED") {
                Ok(())
            } else {
                Err(format!("{out}{err}"))
            }
        })
        .unwrap_or_else(|t| {
            panic!(
                "{page}: {id} did not fail its Create within 30 s: {}",
                t.last
            )
        })
}

/// A documented `ctl` command dialling `target`: `--target` set in the form
/// written (`:PORT` stays `:PORT`; a bare host or HOST:PORT becomes the
/// address), added where the command relies on the default; TLS files
/// made this test's.
fn ctl_args(args: &[String], target: &str, dir: &Path) -> Vec<String> {
    let port = target.rsplit(':').next().unwrap_or_default();
    let mut args = if flag_value(args, "--target").is_some() {
        replace_flag(args, "--target", |t| {
            if t.starts_with(':') {
                format!(":{port}")
            } else {
                target.to_owned()
            }
        })
    } else {
        at_target(args, target)
    };
    for flag in CTL_TLS_FILES {
        args = replace_flag(&args, flag, |path| in_dir(dir, path));
    }
    args
}

/// Runs one documented `ctl` command: it must exit 0 and print something;
/// JSON when asked for JSON; every machine it names.
fn assert_ctl_succeeds(c: &DocCommand, args: &[String], target: &str, dir: &Path) {
    let args = ctl_args(args, target, dir);
    let (ok, out, err) = ctl(&args);
    let ran = format!("{}: `{}` (ran ctl {args:?})", c.at(), c.text);
    assert!(ok, "{ran} failed:\n{out}{err}");
    assert!(!out.trim().is_empty(), "{ran} printed nothing:\n{err}");
    let json = flag_value(&args, "-o").or(flag_value(&args, "--output")) == Some("json");
    if json {
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&out) {
            panic!("{ran} printed no JSON ({e}):\n{out}");
        }
    }
    for id in machine_ids(&args) {
        assert!(
            out.contains(&id.text),
            "{ran} does not mention {}:\n{out}",
            id.text
        );
    }
    // The docs list machines to show some: a header and at least one row,
    // each in a state asked for.
    if args.first().is_some_and(|sub| sub == "list") && !json {
        let rows: Vec<&str> = out
            .lines()
            .skip(1)
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert!(!rows.is_empty(), "{ran} listed no machine:\n{out}");
        if let Some(states) = flag_value(&args, "--state") {
            let states: Vec<&str> = states.split(',').collect();
            for row in rows {
                assert!(
                    row.split_whitespace().any(|w| states.contains(&w)),
                    "{ran} listed a machine in another state: {row}"
                );
            }
        }
    }
}

#[test]
fn documented_ctl_commands_succeed_against_a_running_provider() {
    let groups = ctl_groups();
    assert!(
        groups.iter().any(|g| g.serve.is_some()) && groups.iter().any(|g| g.tls),
        "expected the README's ctl commands with its provider, and an mTLS one"
    );
    in_parallel(
        &groups,
        |g| format!("{}{}", g.page, if g.tls { " (mTLS)" } else { "" }),
        |g| {
            let dir = tempfile::tempdir().expect("tempdir");
            let p = match (&g.serve, g.tls) {
                (Some((c, args)), false) => serve(c, &localise(&readings(args)[0], dir.path())),
                _ => fleet(g, dir.path()),
            };
            for (c, args) in &g.commands {
                assert_ctl_succeeds(c, args, &p.grpc, dir.path());
            }
            let status = p.process.terminate(STOP_WITHIN);
            assert!(status.success(), "{}: the provider ended {status}", g.page);
        },
    );
}

/// A recorded `pveum` call as it acts on the cluster: its `--privs` list
/// sorted (their order means nothing), without `--propagate 1` (pveum's
/// default) and `--output-format` (how the answer is printed).
fn normalised(call: Vec<String>) -> Vec<String> {
    let mut out = Vec::with_capacity(call.len());
    let mut args = call.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--privs" => {
                let privs = args.next().unwrap_or_default();
                let mut list: Vec<&str> = privs.split(',').collect();
                list.sort_unstable();
                out.extend([arg.clone(), list.join(",")]);
            }
            "--output-format" => {
                args.next();
            }
            "--propagate" => match args.next() {
                Some(value) if value == "1" => {}
                value => out.extend([arg.clone()].into_iter().chain(value)),
            },
            _ => out.push(arg),
        }
    }
    out
}

/// Each page's setup-token.sh commands exit 0 on a fresh Proxmox VE 8 node
/// (a recording `pveum`), and its `pveum` commands do too, run in order on
/// one; where a page has both ("Doing it by hand: the same steps"), the
/// hand-run calls are the script's.
#[test]
fn documented_host_setup_commands_run_against_a_recording_pveum() {
    let mut pages: BTreeMap<String, Vec<(DocCommand, &str)>> = BTreeMap::new();
    for (c, _) in commands() {
        if let Some(program) = host_setup_program(&c.words) {
            pages.entry(c.file.clone()).or_default().push((c, program));
        }
    }
    assert!(
        pages.values().flatten().any(|(_, p)| *p == "pveum"),
        "expected the hand-run pveum steps"
    );
    for (page, commands) in &pages {
        let run = |host: &FakePveHost, c: &DocCommand, mut cmd: Command| {
            let out = cmd
                .args(&c.words[1..])
                .current_dir(host.dir.path())
                .output()
                .unwrap_or_else(|e| panic!("{}: running `{}`: {e}", c.at(), c.text));
            assert!(
                out.status.success(),
                "{}: `{}` failed on a Proxmox VE 8 node ({}):\n{}{}",
                c.at(),
                c.text,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            host.take_calls().into_iter().map(normalised)
        };
        let mut script_calls = Vec::new();
        let hand = FakePveHost::new("8.2.4");
        let mut hand_calls = Vec::new();
        for (c, program) in commands {
            if *program == "pveum" {
                hand_calls.extend(run(&hand, c, hand.command(hand.pveum())));
            } else {
                let host = FakePveHost::new("8.2.4");
                let mut script = host.command("bash");
                script.arg(setup_token_script());
                let calls: Vec<Vec<String>> = run(&host, c, script).collect();
                if script_calls.is_empty() {
                    script_calls = calls;
                }
            }
        }
        if !script_calls.is_empty() && !hand_calls.is_empty() {
            let (mut by_script, mut by_hand) = (script_calls.clone(), hand_calls.clone());
            by_script.sort();
            by_hand.sort();
            assert_eq!(
                by_hand, by_script,
                "{page}: the pveum steps by hand are not the setup script's calls \
                 (script, in order: {script_calls:?})"
            );
        }
    }
}

/// `args` without `flag` and its value, in either form.
fn without_flag(args: &[String], flag: &str) -> Vec<String> {
    let eq = format!("{flag}=");
    let mut out = Vec::with_capacity(args.len());
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
        } else if a == flag {
            skip_value = true;
        } else if !a.starts_with(&eq) {
            out.push(a.clone());
        }
    }
    out
}

/// The documented `state copy` commands run: from a state a fake-backend
/// provider (run as the docs run it, then stopped) wrote, into a new file.
/// Both sides become files of this test's (a documented PostgreSQL URL is
/// the operator's database; pg-store's and the binary's tests copy to and
/// from PostgreSQL), and the password files go with the URLs.
#[test]
fn documented_state_copy_commands_copy_a_stopped_providers_state() {
    let runs: Vec<(DocCommand, Vec<String>)> = commands()
        .into_iter()
        .filter_map(|(c, k)| match k {
            Kind::StateCopy(args) => Some((c, args)),
            _ => None,
        })
        .collect();
    assert!(!runs.is_empty(), "the docs show no `state copy` command");
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    for (c, args) in runs {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = dir.path().join("source.db");
        let target = dir.path().join("target.db");
        let provider = serve(
            &c,
            &[
                "--use-fake-backend".to_owned(),
                "--addr".to_owned(),
                ANY_PORT.to_owned(),
                "--metrics-addr".to_owned(),
                ANY_PORT.to_owned(),
                "--state".to_owned(),
                source.display().to_string(),
            ],
        );
        assert_serves_and_stops(&c, provider);
        let args = without_flag(&args, "--from-password-file");
        let args = without_flag(&args, "--to-password-file");
        let args = replace_flag(&args, "--from", |_| source.display().to_string());
        let args = replace_flag(&args, "--to", |_| target.display().to_string());
        let out = Command::new(&bin)
            .args(["state", "copy"])
            .args(&args)
            .output()
            .expect("run bigfleet-proxmox state copy");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with("copied "),
            "{}: `{}` (run as {args:?}) failed ({}):\n{stdout}{}",
            c.at(),
            c.text,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            target.exists(),
            "{}: no copy at {}",
            c.at(),
            target.display()
        );
    }
}
