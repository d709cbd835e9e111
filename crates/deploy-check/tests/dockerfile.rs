//! Lints deploy/Dockerfile with hadolint and checks the properties the
//! image promises: static binary on an empty base, uid 65532, no shell,
//! the binary as entrypoint, both ports exposed, and a build context that
//! carries every workspace member.

use std::process::Command;

use deploy_check::tools::{find, HADOLINT_INSTALL};
use deploy_check::workspace_root;

fn dockerfile() -> String {
    std::fs::read_to_string(workspace_root().join("deploy/Dockerfile")).expect("deploy/Dockerfile")
}

/// Instructions with comments dropped and `\` continuations joined.
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(t);
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

#[test]
fn hadolint_passes() {
    let hadolint = find("hadolint", HADOLINT_INSTALL).unwrap_or_else(|e| panic!("{e}"));
    let root = workspace_root();
    let out = Command::new(&hadolint)
        .arg("deploy/Dockerfile")
        .current_dir(&root)
        .output()
        .expect("run hadolint");
    assert!(
        out.status.success(),
        "hadolint deploy/Dockerfile reported problems:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn final_stage_is_minimal_and_non_root() {
    let ins = instructions(&dockerfile());
    let last_from = ins
        .iter()
        .rposition(|i| i.starts_with("FROM "))
        .expect("a FROM");
    let builder = &ins[..last_from];
    let fin = &ins[last_from..];

    assert!(
        builder.iter().any(|i| i.starts_with("RUN ")
            && i.contains("cargo build --release --locked -p bigfleet-proxmox")),
        "builder must run `cargo build --release --locked -p bigfleet-proxmox`"
    );
    assert!(
        builder.iter().any(|i| i.contains("unknown-linux-musl")),
        "the binary must be built for musl so it runs without a libc"
    );
    assert_eq!(
        fin[0], "FROM scratch",
        "final stage must start from an empty base"
    );
    // Nothing can run in the final stage: there is no shell in it.
    for i in fin {
        assert!(
            !i.starts_with("RUN ") && !i.starts_with("SHELL "),
            "final stage has a shell instruction: {i}"
        );
    }
    assert!(
        fin.iter().any(|i| i == "USER 65532:65532"),
        "USER 65532:65532"
    );
    assert!(
        fin.iter()
            .any(|i| i == r#"ENTRYPOINT ["/usr/local/bin/bigfleet-proxmox"]"#),
        "exec-form ENTRYPOINT of the binary"
    );
    assert!(
        !fin.iter().any(|i| i.starts_with("CMD ")),
        "flags come from args, no CMD"
    );
    let expose: Vec<&str> = fin
        .iter()
        .filter_map(|i| i.strip_prefix("EXPOSE "))
        .flat_map(|p| p.split_whitespace())
        .collect();
    assert_eq!(expose, ["9000", "9090"]);
    assert!(
        fin.iter()
            .any(|i| i.contains("--chown=65532:65532") && i.ends_with(" /var/lib/bigfleet")),
        "state directory owned by the runtime user"
    );
}

#[test]
fn build_context_includes_every_workspace_member() {
    let root = workspace_root();
    let ignore = std::fs::read_to_string(root.join("deploy/Dockerfile.dockerignore"))
        .expect("deploy/Dockerfile.dockerignore");
    let rules: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(
        rules.first(),
        Some(&"*"),
        "ignore everything, then allow-list"
    );
    let allowed: Vec<&str> = rules
        .iter()
        .filter_map(|r| r.strip_prefix('!'))
        .map(|r| r.trim_end_matches('/'))
        .collect();
    for need in ["Cargo.toml", "Cargo.lock"] {
        assert!(
            allowed.contains(&need),
            "{need} must be in the build context"
        );
    }

    let manifest: String = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = manifest
        .split("members")
        .nth(1)
        .and_then(|s| s.split_once('['))
        .and_then(|(_, s)| s.split(']').next())
        .expect("workspace members");
    for m in members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
    {
        let top = m.split('/').next().unwrap();
        assert!(
            allowed.iter().any(|a| *a == m || *a == top),
            "workspace member {m} is excluded from the image build context; \
             add `!{top}/` to deploy/Dockerfile.dockerignore"
        );
    }
}
