//! The image, proven without a Docker engine. `make image-rootfs` builds the
//! static binary and stages the image's files with scripts/build-static.sh,
//! the script the Dockerfile's builder stage runs. This test then:
//!
//! - reads the binary's ELF headers (`readelf`, binutils): no program
//!   interpreter, no NEEDED libraries;
//! - assembles the image's root filesystem as the Dockerfile's last stage
//!   does, by carrying out its `COPY --from=builder` instructions (with their
//!   `--chown`) on the staged files, and checks it holds nothing else: no
//!   shell, no libc;
//! - runs the Dockerfile's ENTRYPOINT from there as its USER (65532), chrooted
//!   into a private mount namespace where the root is read-only, with the
//!   state directory writable as a volume would be and `/proc` and a `/tmp`
//!   tmpfs mounted as a container runtime and `docker run --tmpfs /tmp` would;
//!   and sees the start-up line, `/healthz` 200 and a Create through `ctl`
//!   whose state lands in the 65532-owned state directory.
//!
//! The musl release build takes minutes, so the test does not build: without
//! the staged files it is skipped with the command that makes them, except
//! under `CI=true`, where `make test` runs `make image-rootfs` first and a
//! missing root filesystem is a failure. Running as uid 65532 in a chroot
//! needs root (CI runs as root); elsewhere that part is skipped the same way.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use deploy_check::dockerfile::{instructions, stages, DOCKERFILE};
use deploy_check::tools::{image_rootfs, in_ci};
use deploy_check::workspace_root;

/// A machine of the fake backend's built-in catalog (as in the README).
const MACHINE: &str = "proxmox/OnDemand/pve.small/pve-a/000";
const DEADLINE: Duration = Duration::from_secs(60);

/// The staged files, or `None` (skipped) outside CI when they are missing.
fn staged_or_skip(check: &str) -> Option<PathBuf> {
    match image_rootfs() {
        Ok(dir) => Some(dir),
        Err(e) if in_ci() => panic!("{e} (CI=true: {check} must run)"),
        Err(e) => {
            provider_testkit::skip::report(check, &e);
            None
        }
    }
}

fn readelf(args: &[&str], bin: &Path) -> String {
    let out = Command::new("readelf")
        .args(args)
        .arg(bin)
        .output()
        .unwrap_or_else(|e| panic!("run readelf (binutils): {e}"));
    assert!(
        out.status.success(),
        "readelf {args:?} {}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn staged_binary_is_static() {
    let Some(staged) = staged_or_skip("the static binary check") else {
        return;
    };
    let bin = staged.join("usr/local/bin/bigfleet-proxmox");
    let header = readelf(&["-hW"], &bin);
    assert!(
        header.contains("ELF64") && header.contains("Advanced Micro Devices X86-64")
            || header.contains("AArch64"),
        "not a 64-bit ELF executable for this machine:\n{header}"
    );
    let program_headers = readelf(&["-lW"], &bin);
    assert!(
        !program_headers.contains("INTERP"),
        "the binary asks for a program interpreter:\n{program_headers}"
    );
    let dynamic = readelf(&["-dW"], &bin);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(
        needed.is_empty(),
        "the binary needs shared libraries: {needed:?}"
    );
}

/// One `COPY --from=builder` of the last stage.
struct CopyFromBuilder {
    /// The path in the builder stage.
    from: String,
    to: String,
    /// `--chown` as (uid, gid).
    chown: Option<(u32, u32)>,
}

/// What the Dockerfile's last stage does, read from it.
struct FinalStage {
    copies: Vec<CopyFromBuilder>,
    user: (u32, u32),
    entrypoint: String,
}

fn final_stage() -> FinalStage {
    let text = std::fs::read_to_string(workspace_root().join(DOCKERFILE)).expect(DOCKERFILE);
    let all = stages(&instructions(&text));
    let (_, fin) = all.last().expect("a final stage");
    let ids = |spec: &str| -> (u32, u32) {
        let (u, g) = spec.split_once(':').unwrap_or((spec, spec));
        (
            u.parse()
                .unwrap_or_else(|_| panic!("numeric uid in {spec}")),
            g.parse()
                .unwrap_or_else(|_| panic!("numeric gid in {spec}")),
        )
    };
    let mut copies = Vec::new();
    let mut user = None;
    let mut entrypoint = None;
    for i in fin {
        if let Some(rest) = i.strip_prefix("COPY ") {
            let words: Vec<&str> = rest.split_whitespace().collect();
            assert!(
                words.contains(&"--from=builder"),
                "the final stage copies from outside the builder: {i}"
            );
            let chown = words
                .iter()
                .find_map(|w| w.strip_prefix("--chown="))
                .map(ids);
            let paths: Vec<&str> = words
                .iter()
                .filter(|w| !w.starts_with("--"))
                .copied()
                .collect();
            let [from, to] = paths[..] else {
                panic!("COPY with one source and one destination expected: {i}");
            };
            copies.push(CopyFromBuilder {
                from: from.to_owned(),
                to: to.to_owned(),
                chown,
            });
        } else if let Some(u) = i.strip_prefix("USER ") {
            user = Some(ids(u.trim()));
        } else if let Some(e) = i.strip_prefix("ENTRYPOINT ") {
            let argv: Vec<String> = serde_json::from_str(e).expect("exec-form ENTRYPOINT");
            entrypoint = argv.into_iter().next();
        }
    }
    FinalStage {
        copies,
        user: user.expect("a USER in the final stage"),
        entrypoint: entrypoint.expect("an ENTRYPOINT in the final stage"),
    }
}

/// Where the builder stage stages the root filesystem (`rootfs DIR`).
fn builder_staging_dir() -> String {
    let text = std::fs::read_to_string(workspace_root().join(DOCKERFILE)).expect(DOCKERFILE);
    instructions(&text)
        .iter()
        .find_map(|i| {
            i.split("scripts/build-static.sh rootfs ")
                .nth(1)
                .map(|d| d.trim().to_owned())
        })
        .expect("the builder runs scripts/build-static.sh rootfs DIR")
}

/// Copies `from` to `to` as Docker's COPY does: a directory's contents
/// (not the directory itself) into `to`, created as needed; `chown` applied
/// to everything it creates.
fn docker_copy(from: &Path, to: &Path, chown: Option<(u32, u32)>) {
    let own = |p: &Path| {
        if let Some((uid, gid)) = chown {
            std::os::unix::fs::chown(p, Some(uid), Some(gid))
                .unwrap_or_else(|e| panic!("chown {}: {e}", p.display()));
        }
    };
    if from.is_dir() {
        std::fs::create_dir_all(to).expect("create a destination directory");
        own(to);
        for entry in std::fs::read_dir(from).expect("read a staged directory") {
            let entry = entry.expect("a staged entry");
            docker_copy(&entry.path(), &to.join(entry.file_name()), chown);
        }
    } else {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).expect("create a parent directory");
        }
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
        own(to);
    }
}

/// Every path under `root`, relative, directories with a trailing `/`.
fn tree(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).expect("read a directory") {
            let path = entry.expect("an entry").path();
            let rel = path
                .strip_prefix(root)
                .expect("under root")
                .display()
                .to_string();
            if path.is_dir() {
                out.insert(format!("{rel}/"));
                walk(root, &path, out);
            } else {
                out.insert(rel);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// The image's root filesystem, assembled from `staged` into `image`.
fn assemble(staged: &Path, image: &Path, stage: &FinalStage) {
    let builder_dir = builder_staging_dir();
    for CopyFromBuilder { from, to, chown } in &stage.copies {
        let rel = from
            .strip_prefix(&builder_dir)
            .unwrap_or_else(|| panic!("COPY source {from} is not under {builder_dir}"))
            .trim_start_matches('/');
        docker_copy(
            &staged.join(rel),
            &image.join(to.trim_start_matches('/')),
            *chown,
        );
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Starts `argv` chrooted into `image` as `uid:gid`, in a private mount
/// namespace where the root is read-only and `/var/lib/bigfleet` (the
/// volume), `/proc` and a `/tmp` tmpfs are mounted as a runtime would. The
/// shell that sets this up is the host's; every `exec` keeps the pid, so the
/// child is the provider itself.
fn run_in_image(image: &Path, (uid, gid): (u32, u32), argv: &[&str]) -> Child {
    // The mount points a runtime creates in the container's writable layer.
    for dir in ["proc", "tmp"] {
        std::fs::create_dir_all(image.join(dir)).expect("create a mount point");
    }
    let setup = r#"
        root="$1"; shift
        mount --bind "$root" "$root"
        mount --bind "$root/var/lib/bigfleet" "$root/var/lib/bigfleet"
        mount -t proc proc "$root/proc"
        mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
        mount -o remount,bind,ro "$root"
        exec chroot --userspec="$USERSPEC" --groups="$GROUPS_LIST" "$root" "$@"
    "#;
    Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-euc",
            setup,
            "sh",
        ])
        .arg(image)
        .args(argv)
        .env("USERSPEC", format!("{uid}:{gid}"))
        .env("GROUPS_LIST", gid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run unshare (util-linux)")
}

struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    fn wait_for(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no {what} from the provider in the image root:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }
}

/// `GET path` over HTTP/1.1: the status code.
fn http_status(addr: SocketAddr, path: &str) -> u16 {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read the answer");
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A `/proc/<pid>/status` field.
fn status_field(pid: u32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("read /proc/<pid>/status")
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
        .unwrap_or_default()
}

#[test]
fn provider_boots_from_the_image_root_as_65532_read_only_without_a_shell() {
    let Some(staged) = staged_or_skip("booting the provider from the image's root filesystem")
    else {
        return;
    };
    if !is_root() {
        let why = "chrooting as uid 65532 needs root";
        assert!(!in_ci(), "{why} (CI=true: the image boot must run)");
        provider_testkit::skip::report(
            "booting the provider from the image's root filesystem",
            why,
        );
        return;
    }
    let stage = final_stage();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("image");
    assemble(&staged, &image, &stage);

    // Exactly the files the image promises: no shell, no libc, nothing else.
    let want: BTreeSet<String> = [
        "etc/",
        "etc/group",
        "etc/passwd",
        "etc/ssl/",
        "etc/ssl/certs/",
        "etc/ssl/certs/ca-certificates.crt",
        "usr/",
        "usr/local/",
        "usr/local/bin/",
        "usr/local/bin/bigfleet-proxmox",
        "var/",
        "var/lib/",
        "var/lib/bigfleet/",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(tree(&image), want);
    let (uid, gid) = stage.user;
    assert_eq!((uid, gid), (65532, 65532), "the image's USER");
    let passwd = std::fs::read_to_string(image.join("etc/passwd")).expect("passwd");
    assert!(passwd.contains(&format!(":{uid}:{gid}:")), "{passwd}");
    let group = std::fs::read_to_string(image.join("etc/group")).expect("group");
    assert!(group.contains(&format!(":{gid}:")), "{group}");
    let state_dir = std::fs::metadata(image.join("var/lib/bigfleet")).expect("state dir");
    assert_eq!((state_dir.uid(), state_dir.gid()), (uid, gid));
    let ca = std::fs::read_to_string(image.join("etc/ssl/certs/ca-certificates.crt"))
        .expect("CA bundle");
    assert!(
        ca.contains("BEGIN CERTIFICATE"),
        "the CA bundle holds no certificate"
    );

    // No shell to fall back on: running one in the image fails.
    let shell = Command::new("chroot")
        .arg(&image)
        .args(["/bin/sh", "-c", "true"])
        .output()
        .expect("run chroot");
    assert!(!shell.status.success(), "a shell ran inside the image root");

    let entrypoint = stage.entrypoint.as_str();
    let mut child = run_in_image(
        &image,
        stage.user,
        &[
            entrypoint,
            "--use-fake-backend",
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--state",
            "/var/lib/bigfleet/state.db",
        ],
    );
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut running = Running {
        child,
        lines,
        seen: Vec::new(),
    };
    let startup = running.wait_for("start-up line", provider_testkit::is_startup_line);
    let addr = |key| provider_testkit::addr_field(&startup, key).unwrap_or_else(|e| panic!("{e}"));
    let (grpc, metrics) = (addr("addr"), addr("metrics_addr"));
    let pid = running.child.id();

    // It is the provider, as 65532 with no capabilities, under a read-only root.
    assert_eq!(
        status_field(pid, "Uid:"),
        format!("{uid}\t{uid}\t{uid}\t{uid}")
    );
    assert_eq!(
        status_field(pid, "Gid:"),
        format!("{gid}\t{gid}\t{gid}\t{gid}")
    );
    assert_eq!(status_field(pid, "Groups:"), gid.to_string());
    assert_eq!(status_field(pid, "CapEff:"), "0000000000000000");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root_options = mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 5 && f[4] == "/")
        .map(|f| f[5].to_owned())
        .next_back()
        .expect("the process's root mount");
    assert!(
        root_options.split(',').any(|o| o == "ro"),
        "the root is mounted {root_options}"
    );

    assert_eq!(http_status(metrics, "/healthz"), 200);
    let ctl = Command::new(image.join(entrypoint.trim_start_matches('/')))
        .args(["ctl", "--target", &grpc.to_string()])
        .args(["create", MACHINE, "--wait", "--wait-timeout", "60s"])
        .output()
        .expect("run ctl");
    assert!(
        ctl.status.success(),
        "ctl create {MACHINE} --wait failed:\n{}{}\n--- provider:\n{}",
        String::from_utf8_lossy(&ctl.stdout),
        String::from_utf8_lossy(&ctl.stderr),
        running.seen.join("\n")
    );
    // The Create was made durable in the image's state directory, as 65532.
    let state = std::fs::metadata(image.join("var/lib/bigfleet/state.db")).expect("state.db");
    assert_eq!(state.uid(), uid, "state.db is not the runtime user's");
    // Nothing was written outside the volume and the tmpfs.
    let mut after = tree(&image);
    after.retain(|p| !p.starts_with("var/lib/bigfleet/state.db") && p != "proc/" && p != "tmp/");
    assert_eq!(after, want);
}
