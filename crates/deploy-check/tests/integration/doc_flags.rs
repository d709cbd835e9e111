//! Every provider flag named in docs/*.md and deploy/ must exist, every
//! flag the provider has must be documented in docs/configuration.md, and
//! every default the docs state for a flag (in a flag table or in a sentence)
//! must be the one the binary's `--help` shows.
//!
//! Two sources of truth:
//! - `SPEC_FLAGS`, the flag table of the product spec plus the operational
//!   flags the binary adds (checked always, no build needed);
//! - the built binary's `--help` (the `bigfleet-proxmox` test below), found
//!   next to this test executable, in `$CARGO_TARGET_DIR/debug`, in
//!   `<workspace>/target/debug`, or at `$BIGFLEET_PROXMOX_BIN`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use deploy_check::flags::{
    documented_defaults, help_defaults, help_flags, markdown_mentions, plain_mentions, Mention,
};
use deploy_check::tools::provider_binary;
use deploy_check::workspace_root;

/// The spec's flag table, then the flags the binary adds to it.
const SPEC_FLAGS: &[&str] = &[
    "--addr",
    "--provider",
    "--proxmox-backend",
    "--use-fake-backend",
    "--proxmox-api-url",
    "--proxmox-token-id",
    "--proxmox-token-secret",
    "--proxmox-token-file",
    "--proxmox-ca-file",
    "--proxmox-tls-fingerprint",
    "--proxmox-pool",
    "--nodes",
    "--default-zone",
    "--offerings",
    "--seed-count",
    "--instance-types",
    "--template-vmid",
    "--prices",
    "--price-per-vcpu-hour",
    "--price-per-gib-hour",
    "--bootstrap-path",
    "--bootstrap-exec",
    "--reconcile-interval",
    "--state",
    "--state-password-file",
    "--lease-ttl",
    "--replica-name",
    "--metrics-addr",
    "--reflection",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    // Added by the binary:
    "--adaptive-clones",
    "--tls-client-identity",
    "--fake-latency",
    "--log-format",
    "--log-level",
    "--core-dumps",
    "--max-connections",
    "--max-connections-per-peer",
    "--create-timeout",
    "--configure-timeout",
    "--drain-timeout",
    "--delete-timeout",
    "--hostname-command",
    "--readiness-command",
    "--drain-command",
    "--max-parallel-clones",
    "--vmid-range",
    "--shutdown-grace",
    "--proxmox-poll-interval",
    "--reclaim-failed-after",
    "--template-replicas",
    "--clone-mode",
    "--node-storage",
    "--node-memory-limit",
    "--storage-overcommit",
    "--fake-node-memory",
];

/// Flags of `bigfleet-proxmox ctl <sub>` (the operator CLI); `--state`,
/// `--zone` and `--type` are `ctl list`'s filters.
const CTL_FLAGS: &[&str] = &[
    "--target",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--tls-domain",
    "--state",
    "--zone",
    "--type",
    "--output",
    "--wait",
    "--wait-timeout",
    "--until",
    "--max",
    "--cluster",
    "--blob-file",
];

/// Flags of `bigfleet-proxmox state copy`. A Job's manifest in the docs
/// names them one per line, away from the program, so they are accepted
/// there too.
const STATE_COPY_FLAGS: &[&str] = &[
    "--from",
    "--to",
    "--from-password-file",
    "--to-password-file",
];

/// Flags of other tools that prose mentions on their own, outside a command:
/// kubectl drain's grace period and timeout (the provider appends them to
/// --drain-command), pveum's token option, and the conformance runner's
/// endpoint.
const OTHER_TOOL_FLAGS: &[&str] = &["--grace-period", "--timeout", "--privsep", "--target"];

/// Options of deploy/host-setup/setup-token.sh, read from its `case` arms.
fn setup_script_options() -> BTreeSet<String> {
    let text =
        std::fs::read_to_string(workspace_root().join("deploy/host-setup/setup-token.sh")).unwrap();
    text.lines()
        .filter_map(|l| {
            let t = l.trim_start();
            let arm = t.split(')').next()?;
            if t.starts_with("--") || t.starts_with("-h |") {
                Some(
                    arm.split('|')
                        .map(str::trim)
                        .filter(|o| o.starts_with("--"))
                        .map(str::to_owned)
                        .collect::<Vec<_>>(),
                )
            } else {
                None
            }
        })
        .flatten()
        .collect()
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// All flag mentions in docs/ and deploy/, attributed to their command.
fn mentions() -> Vec<Mention> {
    let root = workspace_root();
    let mut paths = Vec::new();
    files(&root.join("docs"), &mut paths);
    files(&root.join("deploy"), &mut paths);
    let mut out = Vec::new();
    for p in paths {
        let rel = p.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.ends_with(".md") {
            out.extend(markdown_mentions(&text, &rel));
        } else if name == "Dockerfile" {
            // Instructions carry cargo/apt flags; provider flags only appear in comments.
            let comments: String = text
                .lines()
                .map(|l| {
                    if l.trim_start().starts_with('#') {
                        l
                    } else {
                        ""
                    }
                })
                .collect::<Vec<_>>()
                .join("\n");
            out.extend(plain_mentions(&comments, &rel));
        } else if name == "setup-token.sh" {
            // Its own options and pveum's are not the provider's; only the
            // closing "Provider flags" message names provider flags.
            let tail = text
                .rsplit_once("Provider flags:")
                .map(|(_, t)| t)
                .unwrap_or("");
            out.extend(plain_mentions(tail, &rel));
        } else {
            out.extend(plain_mentions(&text, &rel));
        }
    }
    assert!(
        out.iter().any(|m| m.flag == "--proxmox-api-url"),
        "the scan found no provider flag at all; is it reading the right tree?"
    );
    out
}

/// Mentions whose flag is not in the allowed set, one line each.
fn unknown(
    mentions: &[Mention],
    provider: &BTreeSet<String>,
    ctl: &dyn Fn(Option<&str>) -> BTreeSet<String>,
    state_copy: &BTreeSet<String>,
) -> Vec<String> {
    let extra: BTreeSet<String> = setup_script_options()
        .into_iter()
        .chain(OTHER_TOOL_FLAGS.iter().map(|s| s.to_string()))
        .collect();
    let mut bad = Vec::new();
    for m in mentions {
        let ok = if m.ctl {
            ctl(m.ctl_sub.as_deref()).contains(&m.flag)
        } else if let Some(sub) = &m.state_sub {
            sub == "copy" && state_copy.contains(&m.flag)
        } else if m.explicit {
            provider.contains(&m.flag)
        } else {
            provider.contains(&m.flag) || extra.contains(&m.flag) || state_copy.contains(&m.flag)
        };
        if !ok {
            bad.push(format!(
                "{}:{}: {}{}",
                m.file,
                m.line,
                if m.ctl {
                    "ctl "
                } else if m.state_sub.is_some() {
                    "state "
                } else {
                    ""
                },
                m.flag
            ));
        }
    }
    bad
}

/// Flags documented in the tables of docs/configuration.md.
fn documented_in_configuration() -> BTreeSet<String> {
    let text = std::fs::read_to_string(workspace_root().join("docs/configuration.md")).unwrap();
    text.lines()
        .filter(|l| l.starts_with("| `--"))
        .flat_map(|l| {
            let first_cell = l.split('|').nth(1).unwrap_or("");
            deploy_check::flags::scan(first_cell)
        })
        .collect()
}

#[test]
fn documented_flags_are_in_the_spec_table() {
    let spec: BTreeSet<String> = SPEC_FLAGS.iter().map(|s| s.to_string()).collect();
    let ctl: BTreeSet<String> = CTL_FLAGS.iter().map(|s| s.to_string()).collect();
    let state_copy: BTreeSet<String> = STATE_COPY_FLAGS.iter().map(|s| s.to_string()).collect();
    let bad = unknown(&mentions(), &spec, &|_| ctl.clone(), &state_copy);
    assert!(
        bad.is_empty(),
        "flags that are not provider flags:\n{}",
        bad.join("\n")
    );

    let documented = documented_in_configuration();
    let missing: Vec<_> = spec.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "flags missing from docs/configuration.md: {missing:?}"
    );
}

fn help(bin: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(bin).args(args).arg("--help").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn documented_flags_are_accepted_by_the_binary() {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let text = help(&bin, &[]).unwrap_or_else(|| panic!("{} --help failed", bin.display()));
    let provider = help_flags(&text);
    assert!(
        provider.contains("--addr"),
        "{} --help lists no --addr; is it the provider?\n{text}",
        bin.display()
    );

    let mentions = mentions();
    // `ctl` may not exist yet; its flags then fall back to the planned list.
    let mut ctl_cache: BTreeMap<Option<String>, BTreeSet<String>> = BTreeMap::new();
    for m in mentions.iter().filter(|m| m.ctl) {
        ctl_cache.entry(m.ctl_sub.clone()).or_insert_with(|| {
            let mut args = vec!["ctl"];
            if let Some(s) = m.ctl_sub.as_deref() {
                args.push(s);
            }
            match help(&bin, &args) {
                Some(h) => help_flags(&h),
                None => {
                    eprintln!(
                        "note: `{} {} --help` failed; checking ctl flags against the planned list",
                        bin.display(),
                        args.join(" ")
                    );
                    CTL_FLAGS.iter().map(|s| s.to_string()).collect()
                }
            }
        });
    }
    let ctl = |sub: Option<&str>| {
        ctl_cache
            .get(&sub.map(str::to_owned))
            .cloned()
            .unwrap_or_default()
    };
    let state_copy = help_flags(
        &help(&bin, &["state", "copy"])
            .unwrap_or_else(|| panic!("{} state copy --help failed", bin.display())),
    );
    let listed: BTreeSet<String> = STATE_COPY_FLAGS.iter().map(|s| s.to_string()).collect();
    let state_copy_own: BTreeSet<String> = state_copy
        .iter()
        .filter(|f| *f != "--help")
        .cloned()
        .collect();
    assert_eq!(
        state_copy_own, listed,
        "`state copy --help` and STATE_COPY_FLAGS disagree"
    );
    let bad = unknown(&mentions, &provider, &ctl, &state_copy);
    assert!(
        bad.is_empty(),
        "flags named in docs/ or deploy/ that `bigfleet-proxmox --help` does not list:\n{}",
        bad.join("\n")
    );

    // Every real flag is documented, and the spec's flags all exist.
    let documented = documented_in_configuration();
    let undocumented: Vec<_> = provider
        .iter()
        .filter(|f| *f != "--help" && *f != "--version")
        .filter(|f| !documented.contains(*f))
        .collect();
    assert!(
        undocumented.is_empty(),
        "flags the binary accepts but docs/configuration.md does not document: {undocumented:?}"
    );
    let missing: Vec<_> = SPEC_FLAGS
        .iter()
        .filter(|f| !provider.contains(**f))
        .collect();
    assert!(
        missing.is_empty(),
        "spec flags the binary does not accept: {missing:?}"
    );
}

/// Two spellings of one default: equal as text, or as numbers (`0.0030` and
/// `0.003`).
fn same_default(documented: &str, actual: &str) -> bool {
    documented == actual
        || matches!(
            (documented.parse::<f64>(), actual.parse::<f64>()),
            (Ok(a), Ok(b)) if a == b
        )
}

#[test]
fn documented_defaults_are_the_binarys() {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let provider = help_defaults(
        &help(&bin, &[]).unwrap_or_else(|| panic!("{} --help failed", bin.display())),
    );
    let mut ctl_cache: BTreeMap<Option<String>, BTreeMap<String, Option<String>>> = BTreeMap::new();
    let mut ctl_defaults = |sub: Option<&str>| {
        ctl_cache
            .entry(sub.map(str::to_owned))
            .or_insert_with(|| {
                let mut args = vec!["ctl"];
                args.extend(sub);
                help_defaults(&help(&bin, &args).unwrap_or_else(|| {
                    panic!("{} {} --help failed", bin.display(), args.join(" "))
                }))
            })
            .clone()
    };
    let root = workspace_root();
    let mut pages = vec![root.join("README.md"), root.join("deploy/README.md")];
    files(&root.join("docs"), &mut pages);
    let mut checked = 0;
    let mut wrong = Vec::new();
    for page in pages
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
    {
        let rel = page.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(page).unwrap_or_else(|e| panic!("{rel}: {e}"));
        for d in documented_defaults(&text, &rel) {
            let actual = match (&d.ctl_sub, provider.get(&d.flag)) {
                (None, Some(actual)) => actual.clone(),
                (sub, _) => match ctl_defaults(sub.as_deref()).get(&d.flag) {
                    Some(actual) => actual.clone(),
                    None => {
                        wrong.push(format!(
                            "{}:{}: {} is neither the provider's nor `ctl {}`'s flag",
                            d.file,
                            d.line,
                            d.flag,
                            sub.as_deref().unwrap_or("")
                        ));
                        continue;
                    }
                },
            };
            checked += 1;
            // clap shows an empty default as `""`; the docs write `—`.
            let actual = actual.filter(|a| !a.is_empty());
            let agrees = match (&d.value, &actual) {
                (None, None) => true,
                (Some(doc), Some(actual)) => same_default(doc, actual),
                _ => false,
            };
            if !agrees {
                wrong.push(format!(
                    "{}:{}: {} documented default {:?}, the binary's is {:?}",
                    d.file, d.line, d.flag, d.value, actual
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "documented defaults the code contradicts:\n{}",
        wrong.join("\n")
    );
    assert!(checked >= 30, "only {checked} documented defaults found");
}
