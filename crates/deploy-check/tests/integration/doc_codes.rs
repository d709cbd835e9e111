//! Every gRPC status code the docs name is a claim this test proves, as
//! doc_flags.rs does for flags: a documented code that the code contradicts
//! fails here.
//!
//! [`CLAIMS`] lists each statement (the words a page says it with) and its
//! proof. Most are proven live: the built provider (fake backend, bound to
//! 127.0.0.1) is driven through `bigfleet-proxmox ctl` into each documented
//! situation, and the code ctl reports must be the documented one. What
//! cannot be provoked from outside (a state store that cannot commit, a
//! handler panic) is held against the line of code that maps it. Every code
//! name in the docs (`NOT_FOUND`, or a backticked metric label such as
//! `FailedPrecondition`) must lie inside one of the claims, so a new
//! statement cannot go unproven.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use deploy_check::tools::provider_binary;
use deploy_check::workspace_root;

use crate::common::{start_provider, Provider};

/// gRPC's canonical code names, as the docs and `ctl` write them.
const CODES: &[&str] = &[
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// The `code` label values of `bigfleet_proxmox_grpc_requests_total`.
const LABELS: &[&str] = &[
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

/// A situation the live provider is driven into; each ends in one RPC whose
/// code `ctl` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Situation {
    GetUnknown,
    DeleteUnknown,
    CreateIdOverCap,
    DrainSpeculative,
    StaleToken,
    ReclaimIdle,
    ReclaimSpeculative,
    ReclaimUnknown,
    ReclaimIdOverCap,
    MessageOver4MiB,
}

/// How a claim is proven.
#[derive(Debug, Clone, Copy)]
enum Proof {
    /// The live provider answers this situation with one of the claim's codes.
    Live(Situation),
    /// The scrape after the situations has a `grpc_requests_total` series
    /// with this method and code label.
    Series {
        method: &'static str,
        code: &'static str,
    },
    /// Every backticked name in the claim is a `code` label value.
    LabelNames,
    /// The file (relative to the workspace) holds this text: the line that
    /// maps the situation to the code, or the harness's own check.
    Source {
        file: &'static str,
        text: &'static str,
    },
}

struct Claim {
    page: &'static str,
    /// The words the page says it with (whitespace as in one line).
    says: &'static str,
    /// The codes it states; a live answer must be one of them.
    codes: &'static [&'static str],
    proofs: &'static [Proof],
}

use Proof::*;
use Situation::*;

const PANIC_LAYER: Proof = Source {
    file: "crates/provider/src/layers.rs",
    text: "tonic::Status::internal(\"internal error: the handler panicked\")",
};
/// Identities are checked only under mTLS, which the live provider here
/// does not run (the provider's own tests drive every refusal through the
/// binary); the line that answers it is held instead.
const IDENTITY_REFUSED: Proof = Source {
    file: "crates/provider/src/guard.rs",
    text: "Err(Status::permission_denied(refusal.to_string()))",
};
const STORE_UNAVAILABLE: Proof = Source {
    file: "crates/providerkit/src/error.rs",
    text: "KitError::Store(_) | KitError::NotCommitted { .. } => Code::Unavailable",
};

/// A mutation after SIGTERM; the live provider here is never stopping when
/// asked (the engine's own tests drive the refusal), so the mapping is held.
const SHUTTING_DOWN: Proof = Source {
    file: "crates/providerkit/src/error.rs",
    text: "KitError::ShuttingDown(_) => Code::Unavailable",
};

/// A standby's refusal; the live provider here has a state of its own and
/// is never a standby (the provider's failover tests drive it through two
/// replicas), so the line that answers it is held.
const STANDBY_REFUSES: Proof = Source {
    file: "crates/provider/src/leader.rs",
    text: "tonic::Status::unavailable(format!(",
};

/// A Create the node memory guard refuses: the backend's refusal maps here.
const NO_ROOM: Proof = Source {
    file: "crates/providerkit/src/error.rs",
    text: "KitError::Exhausted(_) => Code::ResourceExhausted",
};

/// The guards' refusals are admission refusals (mapped by [`NO_ROOM`]);
/// the provider's end-to-end bursts check each is RESOURCE_EXHAUSTED
/// (`create_burst`), one test per guard.
const BURST_EXHAUSTED: Proof = Source {
    file: "crates/provider/tests/integration/common.rs",
    text: "assert_eq!(status.code(), tonic::Code::ResourceExhausted",
};

/// The storage guard's burst, through `create_burst`.
const NO_STORAGE_ROOM: Proof = Source {
    file: "crates/provider/tests/integration/storage_guard.rs",
    text: "\"storage local-lvm of node pve1 has no room\",",
};

/// The device guard's burst, through `create_burst`.
const NO_DEVICE: Proof = Source {
    file: "crates/provider/tests/integration/gpu.rs",
    text: "&[\"node pve1 has no free device of PCI mapping a10\"],",
};

const CLAIMS: &[Claim] = &[
    Claim {
        page: "DESIGN.md",
        says: "forwards, or answers UNAVAILABLE naming the leader",
        codes: &["UNAVAILABLE"],
        proofs: &[STANDBY_REFUSES],
    },
    Claim {
        page: "configuration.md",
        says: "every RPC `UNAVAILABLE` with `replica B is a standby",
        codes: &["UNAVAILABLE"],
        proofs: &[STANDBY_REFUSES],
    },
    Claim {
        page: "operations.md",
        says:
            "a call that reaches a standby anyway is refused `UNAVAILABLE` with the leader's name",
        codes: &["UNAVAILABLE"],
        proofs: &[STANDBY_REFUSES],
    },
    Claim {
        page: "troubleshooting.md",
        says: "A call that reaches a standby is refused `UNAVAILABLE` naming the leader",
        codes: &["UNAVAILABLE"],
        proofs: &[STANDBY_REFUSES],
    },
    Claim {
        page: "configuration.md",
        says: "is refused at once with `RESOURCE_EXHAUSTED`, before any transition",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM],
    },
    Claim {
        page: "troubleshooting.md",
        says: "The shard's Create fails at once with `RESOURCE_EXHAUSTED`",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM],
    },
    Claim {
        page: "configuration.md",
        says: "the Create RPC answers `RESOURCE_EXHAUSTED` and the machine stays `SPECULATIVE`",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM, BURST_EXHAUSTED, NO_STORAGE_ROOM],
    },
    Claim {
        page: "troubleshooting.md",
        says: "Create answers `RESOURCE_EXHAUSTED`: `storage <s> of node <n> has no room",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM, BURST_EXHAUSTED, NO_STORAGE_ROOM],
    },
    Claim {
        page: "configuration.md",
        says: "and refuses the Create with `RESOURCE_EXHAUSTED`, before anything is cloned, when fewer than `count` are free",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM, BURST_EXHAUSTED, NO_DEVICE],
    },
    Claim {
        page: "troubleshooting.md",
        says: "Create answers `RESOURCE_EXHAUSTED`: `node <n> has no free device of PCI mapping",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM, BURST_EXHAUSTED, NO_DEVICE],
    },
    Claim {
        page: "DESIGN.md",
        says: "`Backend::admit_create`, RESOURCE_EXHAUSTED when refused",
        codes: &["RESOURCE_EXHAUSTED"],
        proofs: &[NO_ROOM, BURST_EXHAUSTED, NO_STORAGE_ROOM],
    },
    Claim {
        page: "configuration.md",
        says: "new mutations are refused (`UNAVAILABLE`) at once",
        codes: &["UNAVAILABLE"],
        proofs: &[SHUTTING_DOWN],
    },
    Claim {
        page: "operations.md",
        says: "refuses every new mutation with `UNAVAILABLE`",
        codes: &["UNAVAILABLE"],
        proofs: &[SHUTTING_DOWN],
    },
    Claim {
        page: "DESIGN.md",
        says: "panics turned into `INTERNAL`",
        codes: &["INTERNAL"],
        proofs: &[PANIC_LAYER],
    },
    Claim {
        page: "certification.md",
        says: "Get of an unknown id is `NOT_FOUND`",
        codes: &["NOT_FOUND"],
        proofs: &[Live(GetUnknown)],
    },
    Claim {
        page: "certification.md",
        says: "Delete of an unknown id is `NOT_FOUND` or `UNIMPLEMENTED`",
        codes: &["NOT_FOUND", "UNIMPLEMENTED"],
        proofs: &[Live(DeleteUnknown)],
    },
    Claim {
        page: "certification.md",
        says: "stale tokens are `FAILED_PRECONDITION`",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(StaleToken)],
    },
    Claim {
        page: "certification.md",
        says: "negative token (`INVALID_ARGUMENT` or accepted)",
        codes: &["INVALID_ARGUMENT"],
        proofs: &[Source {
            file: "crates/conformance/src/suite/matrix.rs",
            text: "(INVALID_ARGUMENT) or lenient (accepted) are both allowed",
        }],
    },
    Claim {
        page: "configuration.md",
        says: "A request over any cap is refused whole with `INVALID_ARGUMENT`",
        codes: &["INVALID_ARGUMENT"],
        proofs: &[Live(CreateIdOverCap)],
    },
    Claim {
        page: "configuration.md",
        says: "a Configure larger than its caps allow is refused from its length prefix, \
               before its body is read (`INVALID_ARGUMENT`",
        codes: &["INVALID_ARGUMENT"],
        proofs: &[Live(MessageOver4MiB)],
    },
    Claim {
        page: "observability.md",
        says: "every CapacityProvider RPC answers `UNAVAILABLE`",
        codes: &["UNAVAILABLE"],
        proofs: &[STORE_UNAVAILABLE],
    },
    Claim {
        page: "configuration.md",
        says: "a request's body, from its headers | 15 s | `DEADLINE_EXCEEDED`",
        codes: &["DEADLINE_EXCEEDED"],
        proofs: &[Source {
            file: "crates/provider/src/intake.rs",
            text: "Status::deadline_exceeded(format!(",
        }],
    },
    Claim {
        page: "configuration.md",
        says: "refused before its body is read (`PERMISSION_DENIED`)",
        codes: &["PERMISSION_DENIED"],
        proofs: &[Source {
            file: "crates/provider/src/intake.rs",
            text: ".admit_before_body(",
        }],
    },
    Claim {
        page: "configuration.md",
        says: "a mutation is refused `UNAVAILABLE` and withdrawn",
        codes: &["UNAVAILABLE"],
        proofs: &[STORE_UNAVAILABLE],
    },
    Claim {
        page: "operations.md",
        says: "A mutation whose acceptance cannot be committed is refused `UNAVAILABLE`",
        codes: &["UNAVAILABLE"],
        proofs: &[STORE_UNAVAILABLE],
    },
    Claim {
        page: "observability.md",
        says: "every CapacityProvider and Admin RPC answers `UNAVAILABLE` at once",
        codes: &["UNAVAILABLE"],
        proofs: &[Source {
            file: "crates/provider/src/leader.rs",
            text: "\"the provider is starting and serves nothing yet: {what}",
        }],
    },
    Claim {
        page: "operations.md",
        says: "Get and List answer `UNAVAILABLE` too while changes wait for a commit",
        codes: &["UNAVAILABLE"],
        proofs: &[STORE_UNAVAILABLE],
    },
    Claim {
        page: "security.md",
        says: "the mutation is answered `UNAVAILABLE` and withdrawn",
        codes: &["UNAVAILABLE"],
        proofs: &[STORE_UNAVAILABLE],
    },
    Claim {
        page: "troubleshooting.md",
        says: "a gRPC client gets `UNAVAILABLE: the provider is starting and serves nothing yet",
        codes: &["UNAVAILABLE"],
        proofs: &[Source {
            file: "crates/provider/src/leader.rs",
            text: "\"the provider is starting and serves nothing yet: {what}",
        }],
    },
    Claim {
        page: "observability.md",
        says: "each became an `INTERNAL` error",
        codes: &["INTERNAL"],
        proofs: &[PANIC_LAYER],
    },
    Claim {
        page: "observability.md",
        says: "the gRPC status code name: `OK`, `InvalidArgument`, `NotFound`, \
               `FailedPrecondition`, `Aborted`, `Unimplemented`, `Internal`",
        codes: &[],
        proofs: &[
            LabelNames,
            Series {
                method: "Drain",
                code: "FailedPrecondition",
            },
            Series {
                method: "Drain",
                code: "Aborted",
            },
            Series {
                method: "Get",
                code: "NotFound",
            },
        ],
    },
    Claim {
        page: "observability.md",
        says: "server errors (`Internal`, `Unknown`, `Unavailable`, `DeadlineExceeded`, \
               `DataLoss`)",
        codes: &[],
        proofs: &[
            LabelNames,
            Source {
                file: "deploy/monitoring/alerts.yaml",
                text: "code=~\"Internal|Unknown|Unavailable|DeadlineExceeded|DataLoss\"",
            },
        ],
    },
    Claim {
        page: "operations.md",
        says: "Refuses a machine that is not `FAILED` (`FAILED_PRECONDITION`)",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(ReclaimIdle)],
    },
    Claim {
        page: "operations.md",
        says: "| `OK` | reclaimed, already `SPECULATIVE`",
        codes: &["OK"],
        proofs: &[Live(ReclaimSpeculative)],
    },
    Claim {
        page: "operations.md",
        says: "| `INVALID_ARGUMENT` | the machine id is empty or over its cap",
        codes: &["INVALID_ARGUMENT"],
        proofs: &[Live(ReclaimIdOverCap)],
    },
    Claim {
        page: "operations.md",
        says: "| `NOT_FOUND` | no such machine",
        codes: &["NOT_FOUND"],
        proofs: &[Live(ReclaimUnknown)],
    },
    Claim {
        page: "operations.md",
        says: "| `FAILED_PRECONDITION` | the machine is not `FAILED`",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(ReclaimIdle)],
    },
    Claim {
        page: "operations.md",
        says: "| `UNAVAILABLE` | destroying its VMs failed or timed out, or the state store \
               could not commit",
        codes: &["UNAVAILABLE"],
        proofs: &[Source {
            file: "crates/providerkit/src/engine/reclaim.rs",
            text: "ReclaimError::Substrate { .. } | ReclaimError::TimedOut { .. } | \
                   ReclaimError::Store { .. } => Code::Unavailable",
        }],
    },
    Claim {
        page: "operations.md",
        says: "| `INTERNAL` | the reclaim task ended unexpectedly",
        codes: &["INTERNAL"],
        proofs: &[Source {
            file: "crates/providerkit/src/engine/reclaim.rs",
            text: "ReclaimError::Aborted { .. } => Code::Internal",
        }],
    },
    Claim {
        page: "operations.md",
        says: "`FAILED_PRECONDITION` is gRPC's code for",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(ReclaimIdle)],
    },
    Claim {
        page: "operations.md",
        says: "`CapacityProvider` keeps it for fencing",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(StaleToken)],
    },
    Claim {
        page: "operations.md",
        says: "a Drain of a `SPECULATIVE` machine, is answered `ABORTED`",
        codes: &["ABORTED"],
        proofs: &[Live(DrainSpeculative)],
    },
    Claim {
        page: "security.md",
        says: "| `PERMISSION_DENIED` | the certificate's identity does not permit the call",
        codes: &["PERMISSION_DENIED"],
        proofs: &[IDENTITY_REFUSED],
    },
    Claim {
        page: "security.md",
        says: "| `FAILED_PRECONDITION` | (unchanged) the caller may act for the shard, but its \
               fencing token is stale",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(StaleToken)],
    },
    Claim {
        page: "troubleshooting.md",
        says: "A refused call is answered `PERMISSION_DENIED`",
        codes: &["PERMISSION_DENIED"],
        proofs: &[IDENTITY_REFUSED],
    },
    Claim {
        page: "troubleshooting.md",
        says: "`Reclaim ...: FAILED_PRECONDITION: machine ... is IDLE, not FAILED`",
        codes: &["FAILED_PRECONDITION"],
        proofs: &[Live(ReclaimIdle)],
    },
    Claim {
        page: "troubleshooting.md",
        says: "`Reclaim ...: UNAVAILABLE: reclaiming machine ...: destroying its hosts failed:",
        codes: &["UNAVAILABLE"],
        proofs: &[Source {
            file: "crates/providerkit/src/engine/reclaim.rs",
            text: "ReclaimError::Substrate { .. } | ReclaimError::TimedOut { .. } | \
                   ReclaimError::Store { .. } => Code::Unavailable",
        }],
    },
    Claim {
        page: "troubleshooting.md",
        says: "the request got `INTERNAL`",
        codes: &["INTERNAL"],
        proofs: &[PANIC_LAYER],
    },
    Claim {
        page: "troubleshooting.md",
        says: "## gRPC `FailedPrecondition` in `bigfleet_proxmox_grpc_requests_total`",
        codes: &[],
        proofs: &[
            LabelNames,
            Series {
                method: "Drain",
                code: "FailedPrecondition",
            },
            Series {
                method: "Reclaim",
                code: "FailedPrecondition",
            },
        ],
    },
    Claim {
        page: "troubleshooting.md",
        says: "(a Drain of a `SPECULATIVE` machine, say) is `Aborted`, not `FailedPrecondition`",
        codes: &[],
        proofs: &[
            LabelNames,
            Series {
                method: "Drain",
                code: "Aborted",
            },
        ],
    },
];

/// Collapses every run of whitespace to one space.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn page(name: &str) -> String {
    let path = workspace_root().join("docs").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Code names in `text` (one line): canonical names as words, label names
/// when backticked (`Internal` is also an English word). (start, end, name)
fn code_mentions(text: &str) -> Vec<(usize, usize, String)> {
    let bytes = text.as_bytes();
    let word = |i: usize| {
        bytes
            .get(i)
            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
    };
    let mut out = Vec::new();
    for name in CODES.iter().filter(|c| **c != "OK") {
        for (at, _) in text.match_indices(name) {
            let end = at + name.len();
            if (at == 0 || !word(at - 1)) && !word(end) {
                out.push((at, end, name.to_string()));
            }
        }
    }
    for name in LABELS {
        let quoted = format!("`{name}`");
        for (at, _) in text.match_indices(&quoted) {
            out.push((at, at + quoted.len(), name.to_string()));
        }
    }
    out
}

#[test]
fn every_code_the_docs_name_is_a_listed_claim() {
    let mut names: Vec<String> = std::fs::read_dir(workspace_root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .collect();
    names.sort();
    let mut unclaimed = Vec::new();
    for name in &names {
        let text = one_line(&page(name));
        let spans: Vec<(usize, usize)> = CLAIMS
            .iter()
            .filter(|c| c.page == name)
            .flat_map(|c| {
                let says = one_line(c.says);
                let found: Vec<(usize, usize)> = text
                    .match_indices(&says)
                    .map(|(at, _)| (at, at + says.len()))
                    .collect();
                assert!(
                    !found.is_empty(),
                    "docs/{name} no longer says {:?}: update CLAIMS with what it says now",
                    c.says
                );
                found
            })
            .collect();
        for (start, end, code) in code_mentions(&text) {
            if !spans.iter().any(|&(s, e)| s <= start && end <= e) {
                unclaimed.push(format!(
                    "docs/{name}: {code} in \"…{}…\"",
                    &text[start.saturating_sub(80)..(end + 40).min(text.len())]
                ));
            }
        }
    }
    assert!(
        unclaimed.is_empty(),
        "codes the docs name that no claim in CLAIMS covers (add the claim and its proof):\n{}",
        unclaimed.join("\n")
    );
}

#[test]
fn claims_proven_by_source_and_label_names_hold() {
    for c in CLAIMS {
        for proof in c.proofs {
            match proof {
                Source { file, text } => {
                    let source = std::fs::read_to_string(workspace_root().join(file))
                        .unwrap_or_else(|e| panic!("{file}: {e}"));
                    assert!(
                        one_line(&source).contains(&one_line(text)),
                        "{}: {:?} rests on `{text}` in {file}, which is gone: is the doc still true?",
                        c.page,
                        c.says
                    );
                }
                LabelNames => {
                    for (_, _, name) in code_mentions(&one_line(c.says)) {
                        assert!(
                            LABELS.contains(&name.as_str()) || CODES.contains(&name.as_str()),
                            "{}: {name} is no gRPC code label",
                            c.page
                        );
                    }
                }
                Live(_) | Series { .. } => {}
            }
        }
    }
    // The label names are the provider's own.
    let layers = std::fs::read_to_string(workspace_root().join("crates/provider/src/layers.rs"))
        .expect("layers.rs");
    for label in LABELS {
        assert!(
            layers.contains(&format!("=> \"{label}\"")),
            "metric_code_name has no {label}"
        );
    }
}

/// The built provider on the fake backend, bound to 127.0.0.1.
fn start() -> Provider {
    let args = [
        "--use-fake-backend",
        "--fake-latency",
        "1ms",
        "--addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
    ]
    .map(String::from);
    start_provider(&args).unwrap_or_else(|e| panic!("the provider did not start: {e}"))
}

/// `ctl --target <provider> ARGS`: the code it reports (`OK` on success).
fn ctl(p: &Provider, args: &[&str]) -> (String, String) {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(bin)
        .args(["ctl", "--target", &p.grpc])
        .args(args)
        .output()
        .expect("run ctl");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        return ("OK".to_owned(), report);
    }
    // `<RPC> <id>: <CODE>: <message>`: the first code name between colons.
    let code = CODES
        .iter()
        .filter_map(|c| report.find(&format!(": {c}")).map(|at| (at, *c)))
        .filter(|(at, c)| {
            let after = report.as_bytes().get(at + 2 + c.len());
            after.is_none_or(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
        })
        .min()
        .map(|(_, c)| c.to_owned())
        .unwrap_or_else(|| panic!("ctl {args:?} failed without a gRPC code:\n{report}"));
    (code, report)
}

/// Every id string in ctl's JSON output.
fn ids(json: &serde_json::Value, out: &mut Vec<String>) {
    match json {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("id", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => ids(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| ids(v, out)),
        _ => {}
    }
}

fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    body
}

/// Drives the provider into every situation; returns the codes and the scrape.
fn live() -> (BTreeMap<Situation, (String, String)>, String) {
    let p = start();
    let (code, listed) = ctl(
        &p,
        &["-o", "json", "list", "--state", "SPECULATIVE", "--max", "2"],
    );
    assert_eq!(code, "OK", "{listed}");
    let mut found = Vec::new();
    ids(
        &serde_json::from_str(&listed).expect("ctl -o json list"),
        &mut found,
    );
    let [speculative, idle] = &found[..] else {
        panic!("two SPECULATIVE machines expected: {listed}");
    };
    let (code, out) = ctl(
        &p,
        &[
            "create",
            idle,
            "--shard-id",
            "docs",
            "--epoch",
            "5",
            "--sequence",
            "1",
            "--wait",
        ],
    );
    assert_eq!(code, "OK", "{out}");
    let over_cap = "m".repeat(300);
    let dir = tempfile::tempdir().expect("tempdir");
    let blob: PathBuf = dir.path().join("blob");
    std::fs::write(&blob, vec![b'x'; 5 * 1024 * 1024]).expect("write a 5 MiB blob");
    let blob = blob.to_string_lossy().into_owned();
    let runs: Vec<(Situation, Vec<&str>)> = vec![
        (GetUnknown, vec!["get", "no-such-machine"]),
        (DeleteUnknown, vec!["delete", "no-such-machine"]),
        (CreateIdOverCap, vec!["create", &over_cap]),
        (DrainSpeculative, vec!["drain", speculative]),
        (
            StaleToken,
            vec![
                "drain",
                idle,
                "--shard-id",
                "docs",
                "--epoch",
                "4",
                "--sequence",
                "1",
            ],
        ),
        (ReclaimIdle, vec!["reclaim", idle, "--wait"]),
        (ReclaimSpeculative, vec!["reclaim", speculative, "--wait"]),
        (ReclaimUnknown, vec!["reclaim", "no-such-machine"]),
        (ReclaimIdOverCap, vec!["reclaim", &over_cap]),
        (
            MessageOver4MiB,
            vec!["configure", idle, "--cluster", "c", "--blob-file", &blob],
        ),
    ];
    let mut answers = BTreeMap::new();
    for (situation, args) in runs {
        answers.insert(situation, ctl(&p, &args));
    }
    let metrics = scrape(
        &p.metrics
            .expect("the start-up line names the metrics listener")
            .to_string(),
    );
    (answers, metrics)
}

#[test]
fn claims_proven_live_hold_against_the_provider() {
    let (answers, metrics) = live();
    let mut wrong = Vec::new();
    for c in CLAIMS {
        for proof in c.proofs {
            match *proof {
                Live(situation) => {
                    let (code, report) = &answers[&situation];
                    if !c.codes.contains(&code.as_str()) {
                        wrong.push(format!(
                            "docs/{} says {:?}; {situation:?} answered {code}:\n{report}",
                            c.page, c.says
                        ));
                    }
                }
                Series { method, code } => {
                    let series = format!("method=\"{method}\",code=\"{code}\"");
                    if !metrics.lines().any(|l| {
                        l.starts_with("bigfleet_proxmox_grpc_requests_total{")
                            && l.contains(&series)
                    }) {
                        wrong.push(format!(
                            "docs/{} says {:?}; the scrape has no grpc_requests_total{{{series}}}",
                            c.page, c.says
                        ));
                    }
                }
                Source { .. } | LabelNames => {}
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "documented codes the provider contradicts:\n{}\n--- scrape:\n{metrics}",
        wrong.join("\n")
    );
}
