//! Lints deploy/Dockerfile with hadolint and checks the properties the
//! image promises: static binary on an empty base, uid 65532, no shell,
//! the binary as entrypoint, both ports exposed, OCI labels, a build context
//! that carries every workspace member, a dependency layer that depends
//! on the manifests only, and one build script shared with
//! `make image-rootfs` (tests/image_rootfs.rs boots what it stages). Docker itself is not needed: the planner stage's
//! commands are run on a copy of the workspace and cargo must accept the
//! stub workspace they leave with the same Cargo.lock.

use std::process::Command;

use deploy_check::dockerfile::{instructions, stages};
use deploy_check::tools::{find_or_skip, HADOLINT_INSTALL};
use deploy_check::workspace_root;

use crate::common::workspace_package_field;

fn stage<'a>(all: &'a [(String, Vec<String>)], name: &str) -> &'a [String] {
    &all.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no stage {name}"))
        .1
}

/// The one script the image's builder stage and `make image-rootfs` run.
const BUILD_SCRIPT: &str = "scripts/build-static.sh";

fn build_script() -> String {
    std::fs::read_to_string(workspace_root().join(BUILD_SCRIPT)).expect(BUILD_SCRIPT)
}

fn dockerfile() -> String {
    std::fs::read_to_string(workspace_root().join("deploy/Dockerfile")).expect("deploy/Dockerfile")
}

#[test]
fn hadolint_passes() {
    // Outside CI a missing hadolint is a reported skip, under CI=true a
    // failure: a fresh machine's `make test` must not fail for want of it.
    let Some(hadolint) = find_or_skip("hadolint", HADOLINT_INSTALL, "hadolint deploy/Dockerfile")
    else {
        return;
    };
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
        builder
            .iter()
            .any(|i| i.starts_with("RUN ") && i.contains("scripts/build-static.sh rootfs ")),
        "builder must build and stage the binary with `scripts/build-static.sh rootfs`"
    );
    let script = build_script();
    assert!(
        script.contains("cargo build --release --locked -p bigfleet-proxmox --target \"$TARGET\""),
        "scripts/build-static.sh must run `cargo build --release --locked -p bigfleet-proxmox`"
    );
    assert!(
        script.contains("-unknown-linux-musl"),
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
    for need in ["Cargo.toml", "Cargo.lock", BUILD_SCRIPT] {
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

#[test]
fn dependencies_build_in_their_own_layer() {
    let all = stages(&instructions(&dockerfile()));
    let builder = stage(&all, "builder");
    let pos = |pred: &dyn Fn(&String) -> bool, what: &str| {
        builder
            .iter()
            .position(pred)
            .unwrap_or_else(|| panic!("builder has no {what}"))
    };
    let stubs = pos(
        &|i| i.starts_with("COPY --from=planner "),
        "COPY --from=planner",
    );
    let deps = pos(
        &|i| i == "RUN scripts/build-static.sh build",
        "dependency build (`RUN scripts/build-static.sh build`)",
    );
    let sources = pos(&|i| i == "COPY . .", "COPY . .");
    let last_build = pos(
        &|i| i.starts_with("RUN ") && i.contains("scripts/build-static.sh rootfs "),
        "final build (`scripts/build-static.sh rootfs`)",
    );
    assert!(
        stubs < deps && deps < sources && sources < last_build,
        "order must be: stub workspace, dependency build, sources, build"
    );
    assert!(
        !builder[..sources].iter().any(|i| i.starts_with("COPY . ")),
        "no source may be copied before the dependency layer"
    );
    // Copied sources keep their mtimes; without a touch cargo could keep the stubs.
    assert!(
        builder[last_build].contains("-exec touch {} +"),
        "the final build must touch the real sources first"
    );
}

/// Copies what deploy/Dockerfile.dockerignore lets into the build context.
fn copy_context(to: &std::path::Path) {
    fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let name = e.file_name();
            let n = name.to_string_lossy();
            if n == "target"
                || n.ends_with(".db")
                || n.ends_with(".db-wal")
                || n.ends_with(".db-shm")
            {
                continue;
            }
            let (src, dst) = (e.path(), to.join(&name));
            if src.is_dir() {
                copy_dir(&src, &dst);
            } else {
                std::fs::copy(&src, &dst).unwrap();
            }
        }
    }
    let root = workspace_root();
    for f in ["Cargo.toml", "Cargo.lock"] {
        std::fs::copy(root.join(f), to.join(f)).unwrap();
    }
    std::fs::create_dir_all(to.join("scripts")).unwrap();
    std::fs::copy(root.join(BUILD_SCRIPT), to.join(BUILD_SCRIPT)).unwrap();
    for d in ["proto", "crates"] {
        copy_dir(&root.join(d), &to.join(d));
    }
}

#[test]
fn planner_stub_workspace_keeps_the_lock_and_every_target() {
    let all = stages(&instructions(&dockerfile()));
    let planner = stage(&all, "planner");
    assert_eq!(
        planner
            .iter()
            .filter(|i| i.starts_with("COPY "))
            .collect::<Vec<_>>(),
        ["COPY . ."],
        "the planner reduces the whole build context"
    );
    let dir = tempfile::tempdir().unwrap();
    copy_context(dir.path());
    // The planner has no SHELL instruction: RUN uses /bin/sh -c.
    for run in planner.iter().filter_map(|i| i.strip_prefix("RUN ")) {
        let out = Command::new("sh")
            .args(["-c", run])
            .current_dir(dir.path())
            .output()
            .expect("run the planner's command");
        assert!(
            out.status.success(),
            "planner RUN failed: {run}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // What is left: manifests, proto/ untouched, and stubs only.
    let root = workspace_root();
    let mut left = Vec::new();
    fn files(d: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    files(&dir.path().join("crates"), &mut left);
    for p in &left {
        let rel = p.strip_prefix(dir.path()).unwrap();
        let text = std::fs::read_to_string(p).unwrap();
        if rel.ends_with("Cargo.toml") {
            assert_eq!(text, std::fs::read_to_string(root.join(rel)).unwrap());
        } else {
            assert!(
                text.is_empty() || text.trim() == "fn main() {}",
                "{}: the stub workspace still holds source: {text:.80}",
                rel.display()
            );
        }
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("proto/build.rs")).unwrap(),
        std::fs::read_to_string(root.join("proto/build.rs")).unwrap()
    );
    // Every target root the real workspace has is still there, stubbed.
    let mut roots = Vec::new();
    files(&root.join("crates"), &mut roots);
    for p in roots {
        let rel = p.strip_prefix(&root).unwrap();
        let s = rel.to_string_lossy();
        if s.contains("/target/") {
            continue;
        }
        let is_root = s.ends_with("/src/lib.rs")
            || s.ends_with("/src/main.rs")
            || (s.contains("/src/bin/") && s.ends_with(".rs"))
            || (s.contains("/benches/") && s.ends_with(".rs"))
            || s.ends_with("/Cargo.toml");
        assert_eq!(
            dir.path().join(rel).exists(),
            is_root,
            "{s}: {} in the stub workspace",
            if is_root { "missing" } else { "left" }
        );
    }

    // cargo resolves the stub workspace to the very same Cargo.lock.
    let host = String::from_utf8(Command::new("rustc").arg("-vV").output().unwrap().stdout)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .unwrap();
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--locked",
            "--offline",
            "-p",
            "bigfleet-proxmox",
            "-e",
            "normal,build",
            "--target",
            &host,
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo does not accept the stub workspace (offline, it needs the provider's \
         dependencies downloaded: run `cargo build -p bigfleet-proxmox` first):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("Cargo.lock")).unwrap(),
        std::fs::read_to_string(root.join("Cargo.lock")).unwrap()
    );
}

#[test]
fn image_carries_oci_labels() {
    let all = stages(&instructions(&dockerfile()));
    let fin = stage(&all, "final");
    let (version, license) = (
        workspace_package_field("version"),
        workspace_package_field("license"),
    );
    let args: Vec<&str> = fin.iter().filter_map(|i| i.strip_prefix("ARG ")).collect();
    assert!(
        args.contains(&format!("VERSION={version}").as_str()),
        "ARG VERSION defaults to the workspace version {version}: {args:?}"
    );
    assert!(
        args.iter().any(|a| a.starts_with("REVISION")),
        "ARG REVISION"
    );
    let labels: String = fin
        .iter()
        .filter_map(|i| i.strip_prefix("LABEL "))
        .collect::<Vec<_>>()
        .join(" ");
    let label = |k: &str| {
        let key = format!("org.opencontainers.image.{k}=\"");
        let i = labels
            .find(&key)
            .unwrap_or_else(|| panic!("no label org.opencontainers.image.{k}"));
        labels[i + key.len()..]
            .split('"')
            .next()
            .unwrap()
            .to_owned()
    };
    assert_eq!(label("title"), "bigfleet-proxmox");
    assert!(label("description").contains("Proxmox VE"));
    assert_eq!(label("licenses"), license);
    assert_eq!(label("version"), "${VERSION}");
    assert_eq!(label("revision"), "${REVISION}");
    assert_eq!(label("source"), "${SOURCE}");
}

/// The image and `make image-rootfs` build through the same script, so what
/// CI boots from the staged root filesystem is what the image holds.
#[test]
fn image_and_make_image_rootfs_share_one_build_script() {
    let all = stages(&instructions(&dockerfile()));
    let builder = stage(&all, "builder");
    let runs: Vec<&String> = builder
        .iter()
        .filter(|i| i.starts_with("RUN ") && i.contains("cargo "))
        .collect();
    assert!(
        runs.is_empty(),
        "the builder runs cargo outside scripts/build-static.sh: {runs:?}"
    );
    let makefile = std::fs::read_to_string(workspace_root().join("Makefile")).expect("Makefile");
    let recipe: Vec<&str> = makefile
        .lines()
        .skip_while(|l| !l.starts_with("image-rootfs:"))
        .skip(1)
        .take_while(|l| l.starts_with('\t'))
        .collect();
    assert!(
        recipe.iter().any(|l| l
            .trim_start()
            .starts_with("scripts/build-static.sh rootfs ")),
        "make image-rootfs must run `scripts/build-static.sh rootfs`: {recipe:?}"
    );
    // The final stage copies what the script staged, from where it staged it.
    let staged = builder
        .iter()
        .find_map(|i| i.split("scripts/build-static.sh rootfs ").nth(1))
        .map(str::trim)
        .expect("the builder stages a root filesystem");
    let fin = stage(&all, "final");
    for copy in fin.iter().filter(|i| i.starts_with("COPY ")) {
        assert!(
            copy.contains(&format!(" {staged}/")),
            "the final stage copies from outside {staged}: {copy}"
        );
    }
}
