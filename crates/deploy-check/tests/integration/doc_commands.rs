//! The README's example commands run: its provider command starts the
//! fake backend, and each `ctl` command after it, run in order against that
//! provider, exits 0. Only the listen addresses are this test's (free
//! ports instead of the fixed ones), and `cargo run ... --` is the built
//! binary.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use deploy_check::tools::provider_binary;
use deploy_check::workspace_root;

/// The README's `sh` blocks, comments cut, one command a line.
fn readme_commands() -> Vec<String> {
    let text = std::fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") {
            in_sh = !in_sh && t == "```sh";
            continue;
        }
        if in_sh {
            let cmd = t.split("  #").next().unwrap_or_default().trim();
            if !cmd.is_empty() {
                out.push(cmd.to_string());
            }
        }
    }
    out
}

/// The arguments after `cargo run ... --`, split as a shell would split
/// these (words, and single-quoted words).
fn provider_args(command: &str) -> Option<Vec<String>> {
    let (_, args) = command.split_once(" -- ")?;
    let mut words = Vec::new();
    let mut rest = args.trim();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('\'') {
            let end = quoted.find('\'')?;
            words.push(quoted[..end].to_string());
            rest = quoted[end + 1..].trim_start();
        } else {
            let end = rest.find(' ').unwrap_or(rest.len());
            words.push(rest[..end].to_string());
            rest = rest[end..].trim_start();
        }
    }
    Some(words)
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the provider with `args` (its listeners moved to free ports);
/// the process and its gRPC address.
fn start(args: &[String]) -> (Running, String) {
    let mut args = args.to_vec();
    for (i, a) in args.clone().iter().enumerate() {
        if (a == "--addr" || a == "--metrics-addr") && i + 1 < args.len() {
            args[i + 1] = "127.0.0.1:0".into();
        }
    }
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(&bin)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let stderr = child.stderr.take().expect("piped stderr");
    let running = Running(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if provider_testkit::is_startup_line(&line) => {
                let addr =
                    provider_testkit::addr_field(&line, "addr").unwrap_or_else(|e| panic!("{e}"));
                return (running, addr.to_string());
            }
            Ok(line) => seen.push(line),
            Err(_) => panic!("`{}` did not start:\n{}", args.join(" "), seen.join("\n")),
        }
    }
}

#[test]
fn the_readme_commands_run_on_the_fake_backend() {
    let commands = readme_commands();
    let serve = commands
        .iter()
        .find(|c| c.contains("--use-fake-backend") && !c.contains(" ctl "))
        .expect("the README starts the provider on the fake backend");
    let (_provider, addr) = start(&provider_args(serve).expect("cargo run ... -- ARGS"));
    let ctl: Vec<&String> = commands.iter().filter(|c| c.contains(" -- ctl ")).collect();
    assert!(ctl.len() >= 3, "the README's ctl examples: {ctl:?}");
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    for command in ctl {
        let args = provider_args(command).expect("cargo run ... -- ctl ARGS");
        let out = Command::new(&bin)
            .args(&args[..1])
            .args(["--target", &addr])
            .args(&args[1..])
            .output()
            .expect("run ctl");
        assert!(
            out.status.success(),
            "`{command}` failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
