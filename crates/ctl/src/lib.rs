//! `bigfleet-proxmox ctl`: an operator CLI that drives a running provider
//! over its own gRPC contract (plain, TLS or mTLS). It never prints the
//! bootstrap blob, and every failure is one line naming the RPC, the gRPC
//! code and what to check. (Past 600 lines only with its parser and
//! rendering tests, which stay beside the dispatch they check.)
//!
//! A library of its own that depends only on the wire contract
//! (`bigfleet-proto`): the compiler keeps it from reaching into the provider.

mod args;
mod dial;
mod error;
mod render;
mod wait;

pub use args::{CtlArgs, CtlCommand, Fence, Output, Wait};
pub use error::{CtlError, CtlErrorKind};
pub use render::{canonical_code_name, render_table, state_name};

use std::path::Path;

use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest, ListFilter, Machine,
    MachineState, TransitionAck,
};

use crate::dial::{connect, connect_with_deadline, Session};
use crate::render::{
    attach_rooms, cell, emit, json, list_table, machine_details, room_table, storage_table,
    summarize, summary_table, timeline_table, AckView, MachineView, MachineWithTimeline, StepView,
};
use crate::wait::{wait_for, watch};

/// One accepted-or-refused mutation and what `--wait` awaits after it.
struct Mutation {
    rpc: &'static str,
    id: String,
    target: MachineState,
    wait: Wait,
    ack: Result<tonic::Response<TransitionAck>, tonic::Status>,
}

impl Mutation {
    fn new(
        rpc: &'static str,
        id: String,
        target: MachineState,
        wait: Wait,
        ack: Result<tonic::Response<TransitionAck>, tonic::Status>,
    ) -> Self {
        Mutation {
            rpc,
            id,
            target,
            wait,
            ack,
        }
    }

    async fn finish(self, session: &mut Session, output: Output) -> Result<(), CtlError> {
        let Mutation {
            rpc,
            id,
            target,
            wait,
            ack,
            ..
        } = self;
        let id = id.as_str();
        let ack = ack
            .map_err(|s| session.status_error(&format!("{rpc} {}", cell(id)), &s))?
            .into_inner();
        let snapshot = ack.machine.clone().unwrap_or_else(|| Machine {
            id: id.to_string(),
            ..Machine::default()
        });
        // `None`: a waited-for Delete removed the machine entirely.
        let machine = if wait.wait {
            wait_for(session, rpc, id, target, snapshot, &wait).await?
        } else {
            Some(snapshot)
        };
        let text = match output {
            Output::Json => json(&AckView {
                operation_id: ack.operation_id.clone(),
                machine: machine.as_ref().map(MachineView::from),
            })?,
            Output::Table => {
                let state = machine
                    .as_ref()
                    .map(|m| state_name(m.state))
                    .unwrap_or_else(|| "gone".into());
                format!(
                    "{}: {state} (operation {})\n",
                    cell(id),
                    cell(&ack.operation_id)
                )
            }
        };
        emit(&text)
    }
}

#[derive(serde::Serialize)]
struct ReclaimView {
    machine_id: String,
    status: &'static str,
    revision: u64,
}

async fn reclaim(
    session: &mut Session,
    output: Output,
    id: &str,
    wait: bool,
) -> Result<(), CtlError> {
    use bigfleet_proto::admin::{ReclaimRequest, ReclaimStatus};
    let req = ReclaimRequest {
        machine_id: id.to_string(),
        wait,
    };
    let resp = session
        .admin
        .reclaim(req)
        .await
        .map_err(|s| {
            // The provider's own UNAVAILABLE (the substrate refused the
            // destroy) already says what to do; the generic "is the provider
            // running" hint is for transport failures.
            if s.code() == tonic::Code::Unavailable
                && std::error::Error::source(&s).is_none()
                && !s.message().trim().is_empty()
            {
                let message = format!(
                    "Reclaim {}: {}: {}",
                    cell(id),
                    canonical_code_name(s.code()),
                    cell(s.message().trim())
                );
                return CtlError::new(CtlErrorKind::Rpc(s.code()), message).caused_by(s);
            }
            let hint = if s.code() == tonic::Code::Unimplemented {
                "this provider has no admin service: upgrade it".to_string()
            } else {
                format!(
                    "reclaim only applies to FAILED machines: see `ctl get {}`",
                    cell(id)
                )
            };
            session.status_error_hinted(&format!("Reclaim {}", cell(id)), &s, &hint)
        })?
        .into_inner();
    let status = ReclaimStatus::try_from(resp.status).unwrap_or(ReclaimStatus::Unspecified);
    let (name, text) = match status {
        ReclaimStatus::Reclaimed => ("RECLAIMED", "reclaimed; the machine is SPECULATIVE"),
        ReclaimStatus::AlreadySpeculative => {
            ("ALREADY_SPECULATIVE", "already SPECULATIVE; nothing to do")
        }
        ReclaimStatus::Started => (
            "STARTED",
            "reclaim started; the machine stays FAILED until its VMs are destroyed (--wait \
             waits for it)",
        ),
        ReclaimStatus::Unspecified => ("UNSPECIFIED", "the provider gave no reclaim status"),
    };
    let out = match output {
        Output::Json => json(&ReclaimView {
            machine_id: resp.machine_id,
            status: name,
            revision: resp.revision,
        })?,
        Output::Table => format!("{}: {text} (revision {})\n", cell(id), resp.revision),
    };
    emit(&out)
}

pub(crate) fn read_blob(path: &Path) -> Result<Vec<u8>, CtlError> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf).map_err(|e| {
            CtlError::input(format!("cannot read the bootstrap blob from stdin: {e}")).caused_by(e)
        })?;
        return Ok(buf);
    }
    std::fs::read(path).map_err(|e| {
        CtlError::input(format!("cannot read --blob-file {}: {e}", path.display())).caused_by(e)
    })
}

pub(crate) fn metadata_map(
    pairs: &[(String, String)],
) -> Result<std::collections::HashMap<String, String>, CtlError> {
    let mut map = std::collections::HashMap::new();
    for (k, v) in pairs {
        if map.insert(k.clone(), v.clone()).is_some() {
            return Err(CtlError::input(format!(
                "--metadata key {k:?} is given more than once"
            )));
        }
    }
    Ok(map)
}

/// Run one `ctl` invocation; the error's `Display` is the one line to
/// print and its kind picks the exit code.
pub async fn run(args: CtlArgs) -> Result<(), CtlError> {
    // Local input problems are reported before anything is dialled.
    let blob = match &args.command {
        CtlCommand::Configure { blob_file, .. } => Some(read_blob(blob_file)?),
        _ => None,
    };
    let mut session = match &args.command {
        // A waited-for reclaim answers only once the VMs are destroyed.
        CtlCommand::Reclaim {
            wait: true,
            wait_timeout,
            ..
        } => connect_with_deadline(&args, (*wait_timeout).max(args.timeout)).await?,
        _ => connect(&args).await?,
    };
    let output = args.output;
    match args.command {
        CtlCommand::List {
            states,
            zones,
            types,
            max,
        } => {
            // Zone and type are not on the wire's ListFilter: filter here,
            // and then cap here too.
            let local = !zones.is_empty() || !types.is_empty();
            let filter = ListFilter {
                states: states.iter().map(|s| *s as i32).collect(),
                max_results: if local { 0 } else { max.unwrap_or(0) },
                since_revision: Vec::new(),
            };
            let list = session
                .client
                .list(filter)
                .await
                .map_err(|s| session.status_error("List", &s))?
                .into_inner();
            let mut machines: Vec<Machine> = list
                .machines
                .into_iter()
                .filter(|m| zones.is_empty() || zones.contains(&m.zone))
                .filter(|m| types.is_empty() || types.contains(&m.instance_type))
                .collect();
            if let Some(cap) = max.filter(|&c| local && c > 0) {
                machines.truncate(cap as usize);
            }
            let text = match output {
                Output::Json => json(&machines.iter().map(MachineView::from).collect::<Vec<_>>())?,
                Output::Table => list_table(&machines),
            };
            emit(&text)
        }
        CtlCommand::Summary => {
            let list = session
                .client
                .list(ListFilter::default())
                .await
                .map_err(|s| session.status_error("List", &s))?
                .into_inner();
            let mut rows = summarize(&list.machines);
            // Room per zone, from providers that report it; an older
            // provider (UNIMPLEMENTED) or a refused identity leaves it out.
            let (rooms, storages) = match session
                .admin
                .node_memory(bigfleet_proto::admin::NodeMemoryRequest {})
                .await
            {
                Ok(resp) => {
                    let resp = resp.into_inner();
                    (Some(resp.nodes), resp.storages)
                }
                Err(_) => (None, Vec::new()),
            };
            if let Some(rooms) = &rooms {
                attach_rooms(&mut rows, rooms);
            }
            let text = match output {
                Output::Json => json(&rows)?,
                Output::Table => {
                    // Above the counts, which keep ending on their `(all)` line.
                    let mut text = String::new();
                    if let Some(rooms) = rooms.as_ref().filter(|r| !r.is_empty()) {
                        text.push_str(&room_table(rooms));
                        text.push('\n');
                    }
                    if !storages.is_empty() {
                        text.push_str(&storage_table(&storages));
                        text.push('\n');
                    }
                    text.push_str(&summary_table(&rows));
                    text
                }
            };
            emit(&text)
        }
        CtlCommand::Get { id } => {
            let m = session
                .get(&id)
                .await
                .map_err(|s| session.status_error(&format!("Get {}", cell(&id)), &s))?;
            // Where its time went, from providers that keep it; an older
            // provider (UNIMPLEMENTED) or a refused identity leaves it out.
            let steps = match session
                .admin
                .timeline(bigfleet_proto::admin::TimelineRequest {
                    machine_id: id.clone(),
                })
                .await
            {
                Ok(resp) => Some(resp.into_inner().steps),
                Err(_) => None,
            };
            let text = match output {
                Output::Json => json(&MachineWithTimeline {
                    machine: MachineView::from(&m),
                    timeline: steps
                        .as_deref()
                        .map(|s| s.iter().map(StepView::from).collect()),
                })?,
                Output::Table => {
                    let mut text = machine_details(&m);
                    if let Some(steps) = &steps {
                        text.push_str(&timeline_table(steps));
                    }
                    text
                }
            };
            emit(&text)
        }
        CtlCommand::Create { id, fence, wait } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = CreateRequest {
                machine_id: id.clone(),
                shard_id,
                shard_epoch,
                sequence_number,
            };
            let ack = session.client.create(req).await;
            Mutation::new("Create", id, MachineState::Idle, wait, ack)
                .finish(&mut session, output)
                .await
        }
        CtlCommand::Configure {
            id,
            cluster,
            metadata,
            fence,
            wait,
            ..
        } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = ConfigureRequest {
                machine_id: id.clone(),
                cluster_id: cluster,
                bootstrap_blob: blob.unwrap_or_default(),
                shard_id,
                shard_epoch,
                sequence_number,
                shard_metadata: metadata_map(&metadata)?,
            };
            let ack = session.client.configure(req).await;
            Mutation::new("Configure", id, MachineState::Configured, wait, ack)
                .finish(&mut session, output)
                .await
        }
        CtlCommand::Drain {
            id,
            grace,
            fence,
            wait,
        } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = DrainRequest {
                machine_id: id.clone(),
                grace_period_seconds: grace,
                shard_id,
                shard_epoch,
                sequence_number,
            };
            let ack = session.client.drain(req).await;
            Mutation::new("Drain", id, MachineState::Idle, wait, ack)
                .finish(&mut session, output)
                .await
        }
        CtlCommand::Delete { id, fence, wait } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = DeleteRequest {
                machine_id: id.clone(),
                shard_id,
                shard_epoch,
                sequence_number,
            };
            let ack = session.client.delete(req).await;
            Mutation::new("Delete", id, MachineState::Speculative, wait, ack)
                .finish(&mut session, output)
                .await
        }
        CtlCommand::Watch {
            id,
            interval,
            until,
        } => watch(&mut session, output, &id, interval, until).await,
        CtlCommand::Reclaim { id, wait, .. } => reclaim(&mut session, output, &id, wait).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::*;
    use crate::dial::*;
    use crate::render::*;
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use bigfleet_proto::v1alpha1::{CapacityType, HostRef, Resources};
    use clap::{CommandFactory, Parser, Subcommand};

    /// Mirrors how the binary mounts `ctl`: a parent with its own
    /// --tls-* flags and an optional subcommand.
    #[derive(Parser, Debug)]
    struct Parent {
        #[arg(long)]
        tls_ca: Option<PathBuf>,
        #[arg(long)]
        tls_cert: Option<PathBuf>,
        #[command(subcommand)]
        command: Option<ParentCommand>,
    }

    #[derive(Subcommand, Debug)]
    enum ParentCommand {
        Ctl(CtlArgs),
    }

    /// Parsed arguments for tests elsewhere in the crate.
    pub(crate) fn parse_ctl(argv: &[&str]) -> CtlArgs {
        parse(argv).expect("valid arguments")
    }

    fn parse(argv: &[&str]) -> Result<CtlArgs, clap::Error> {
        let mut full = vec!["bigfleet-proxmox", "ctl"];
        full.extend_from_slice(argv);
        Parent::try_parse_from(full).map(|p| match p.command {
            Some(ParentCommand::Ctl(c)) => c,
            None => panic!("no subcommand parsed"),
        })
    }

    #[test]
    fn clap_definition_is_consistent() {
        Parent::command().debug_assert();
    }

    #[test]
    fn every_global_option_is_listed_under_its_heading() {
        let mut parent = Parent::command();
        let ctl = parent
            .find_subcommand_mut("ctl")
            .expect("ctl is mounted")
            .clone();
        let globals: Vec<_> = ctl.get_arguments().filter(|a| a.is_global_set()).collect();
        assert!(globals.len() >= 7, "{} global options", globals.len());
        for arg in globals {
            assert_eq!(
                arg.get_help_heading(),
                Some("Global options"),
                "--{:?}",
                arg.get_long()
            );
        }
    }

    #[test]
    fn global_options_work_before_and_after_the_subcommand() {
        let a = parse(&[
            "--target", "h:1", "--output", "json", "list", "--state", "idle",
        ])
        .unwrap();
        assert_eq!(a.target, "h:1");
        assert_eq!(a.output, Output::Json);
        let b = parse(&[
            "list",
            "--tls-ca",
            "/ca.pem",
            "--state",
            "IDLE,failed",
            "--max",
            "3",
        ])
        .unwrap();
        assert_eq!(b.tls_ca.as_deref(), Some(Path::new("/ca.pem")));
        match b.command {
            CtlCommand::List { states, max, .. } => {
                assert_eq!(states, vec![MachineState::Idle, MachineState::Failed]);
                assert_eq!(max, Some(3));
            }
            other => panic!("parsed {other:?}"),
        }
        assert_eq!(b.timeout, Duration::from_secs(10));
        assert_eq!(b.target, "127.0.0.1:9000");
    }

    #[test]
    fn mutating_commands_parse_fencing_and_wait() {
        let a = parse(&[
            "configure",
            "m1",
            "--cluster",
            "c1",
            "--blob-file",
            "/b",
            "--metadata",
            "a=1",
            "--metadata",
            "b=x=y",
            "--shard-id",
            "s",
            "--epoch",
            "2",
            "--sequence",
            "9",
            "--wait",
            "--poll-interval",
            "50ms",
        ])
        .unwrap();
        match a.command {
            CtlCommand::Configure {
                id,
                cluster,
                metadata,
                fence,
                wait,
                ..
            } => {
                assert_eq!(id, "m1");
                assert_eq!(cluster, "c1");
                assert_eq!(
                    metadata,
                    vec![("a".into(), "1".into()), ("b".into(), "x=y".into())]
                );
                assert_eq!(fence.token(), ("s".into(), 2, 9));
                assert!(wait.wait);
                assert_eq!(wait.poll_interval, Duration::from_millis(50));
            }
            other => panic!("parsed {other:?}"),
        }
        match parse(&["create", "m1"]).unwrap().command {
            CtlCommand::Create { fence, wait, .. } => {
                assert_eq!(fence.token(), (String::new(), 0, 0));
                assert!(!wait.wait);
            }
            other => panic!("parsed {other:?}"),
        }
    }

    #[test]
    fn bad_input_is_rejected_by_the_parser() {
        assert!(parse(&["list", "--state", "sleeping"]).is_err());
        assert!(parse(&["drain", "m1", "--grace", "-1"]).is_err());
        assert!(parse(&["create", "m1", "--epoch", "1"]).is_err());
        assert!(parse(&["create", "m1", "--shard-id", "s", "--epoch", "-1"]).is_err());
        assert!(parse(&["watch", "m1", "--interval", "0"]).is_err());
        assert!(parse(&["configure", "m1", "--cluster", "c"]).is_err());
        assert!(parse(&[
            "configure",
            "m1",
            "--cluster",
            "c",
            "--blob-file",
            "b",
            "--metadata",
            "=v"
        ])
        .is_err());
    }

    #[test]
    fn states_parse_in_every_spelling() {
        assert_eq!(parse_state("idle"), Ok(MachineState::Idle));
        assert_eq!(parse_state("CONFIGURED"), Ok(MachineState::Configured));
        assert_eq!(
            parse_state("MACHINE_STATE_DRAINING"),
            Ok(MachineState::Draining)
        );
        let err = parse_state("unspecified").unwrap_err();
        assert!(err.contains("SPECULATIVE"), "{err}");
        assert_eq!(state_name(3), "IDLE");
        assert_eq!(state_name(99), "UNKNOWN(99)");
    }

    #[test]
    fn duplicate_metadata_keys_are_an_error() {
        let pairs = vec![("k".to_string(), "1".to_string()), ("k".into(), "2".into())];
        let err = metadata_map(&pairs).unwrap_err();
        assert_eq!(err.kind(), CtlErrorKind::Input);
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("\"k\""), "{err}");
    }

    fn machine() -> Machine {
        Machine {
            id: "p/OnDemand/pve.small/z/000".into(),
            state: MachineState::Failed as i32,
            host: Some(HostRef {
                provider: "proxmox".into(),
                r#ref: "z/101".into(),
            }),
            instance_type: "pve.small".into(),
            zone: "z".into(),
            capacity_type: CapacityType::OnDemand as i32,
            price_per_hour: 0.5,
            resources: Some(Resources {
                resources: [("cpu".to_string(), "2".to_string())].into(),
            }),
            shard_metadata: [("b".to_string(), "2".to_string()), ("a".into(), "1".into())].into(),
            last_error: "clone failed\nlock timeout".into(),
            ..Machine::default()
        }
    }

    #[test]
    fn json_view_uses_plain_names() {
        let v = serde_json::to_value(MachineView::from(&machine())).unwrap();
        assert_eq!(v["state"], "FAILED");
        assert_eq!(v["capacity_type"], "ON_DEMAND");
        assert_eq!(v["host"]["ref"], "z/101");
        assert_eq!(v["resources"]["cpu"], "2");
        assert_eq!(v["shard_metadata"]["a"], "1");
        assert_eq!(v["last_error"], "clone failed\nlock timeout");
        let bare = serde_json::to_value(MachineView::from(&Machine::default())).unwrap();
        assert!(bare["host"].is_null());
        assert_eq!(bare["state"], "UNSPECIFIED");
    }

    #[test]
    fn table_aligns_columns_and_escapes_control_bytes() {
        let text = list_table(&[machine()]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ID  "), "{text}");
        let col = lines[0].find("STATE").unwrap();
        assert_eq!(&lines[1][col..col + 6], "FAILED");
        assert!(lines[1].ends_with("clone failed\\nlock timeout"), "{text}");
        assert!(
            lines[1].contains("  -  "),
            "empty cluster shows '-': {text}"
        );
        let details = machine_details(&machine());
        assert!(details.contains("host:"));
        assert!(details.contains("proxmox/z/101"));
        assert!(
            details.contains("shard_metadata:            a=1,b=2"),
            "{details}"
        );
        assert!(
            details.contains("interruption_probability:  0\n"),
            "{details}"
        );
    }

    #[test]
    fn targets_split_into_scheme_and_authority() {
        assert_eq!(split_target("h:1"), (None, "h:1"));
        assert_eq!(split_target("https://h:1"), (Some("https"), "h:1"));
        assert_eq!(split_target("http://[::1]:9"), (Some("http"), "[::1]:9"));
    }

    #[tokio::test]
    async fn tls_misconfiguration_fails_before_dialling() {
        let base = parse(&["list"]).unwrap();
        let https = CtlArgs {
            target: "https://127.0.0.1:1".into(),
            ..base.clone()
        };
        let err = connect(&https).await.err().unwrap();
        assert_eq!(err.kind(), CtlErrorKind::Input, "{err}");
        let err = err.to_string();
        assert!(err.contains("--tls-ca"), "{err}");
        let mixed = CtlArgs {
            target: "http://127.0.0.1:1".into(),
            tls_ca: Some("/nonexistent".into()),
            ..base.clone()
        };
        let err = connect(&mixed).await.err().unwrap().to_string();
        assert!(err.contains("http://"), "{err}");
        let missing = CtlArgs {
            tls_ca: Some("/nonexistent/ca.pem".into()),
            ..base.clone()
        };
        let err = connect(&missing).await.err().unwrap();
        assert!(
            std::error::Error::source(&err).is_some(),
            "the io error is kept as the source"
        );
        let err = err.to_string();
        assert!(
            err.contains("cannot read --tls-ca /nonexistent/ca.pem"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn unreachable_target_names_the_address() {
        // A port nothing listens on: bind, learn it, release it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let args = CtlArgs {
            target: format!("127.0.0.1:{port}"),
            ..parse(&["list"]).unwrap()
        };
        let err = connect(&args).await.err().unwrap();
        assert_eq!(err.kind(), CtlErrorKind::Connect, "{err}");
        assert_eq!(err.exit_code(), 1);
        let err = err.to_string();
        assert!(
            err.starts_with(&format!("cannot connect to 127.0.0.1:{port}")),
            "{err}"
        );
    }

    #[test]
    fn targets_default_their_port_and_host() {
        assert_eq!(normalize_authority("pve-ctl"), "pve-ctl:9000");
        assert_eq!(normalize_authority("127.0.0.1"), "127.0.0.1:9000");
        assert_eq!(normalize_authority(":9100"), "127.0.0.1:9100");
        assert_eq!(normalize_authority("h:1"), "h:1");
        assert_eq!(normalize_authority("::1"), "[::1]:9000");
        assert_eq!(normalize_authority("[::1]"), "[::1]:9000");
        assert_eq!(normalize_authority("[::1]:7"), "[::1]:7");
    }

    #[test]
    fn summary_counts_every_state_per_zone_and_type() {
        let mut a = machine();
        a.state = MachineState::Idle as i32;
        a.zone = "pve1".into();
        a.instance_type = "pve.small".into();
        let mut b = a.clone();
        b.state = MachineState::Failed as i32;
        let mut c = a.clone();
        c.zone = "pve2".into();
        let rows = summarize(&[a.clone(), b, c]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].zone, "pve1");
        assert_eq!(rows[0].total, 2);
        assert_eq!(rows[0].counts["FAILED"], 1);
        assert_eq!(rows[0].counts.len(), 8, "every state is a column");
        let table = summary_table(&rows);
        let last = table.lines().last().unwrap();
        assert!(
            last.starts_with("(all)") && last.trim_end().ends_with('3'),
            "{table}"
        );
    }

    #[test]
    fn summary_rows_carry_their_zones_room() {
        use bigfleet_proto::admin::{NodeRoom, TypeFit};
        let mut a = machine();
        a.zone = "pve1".into();
        a.instance_type = "pve.small".into();
        let mut b = a.clone();
        b.instance_type = "pve.huge".into();
        let mut rows = summarize(&[a, b]);
        let gib = 1u64 << 30;
        let rooms = vec![NodeRoom {
            node: "pve1".into(),
            memory_bytes: 16 * gib,
            committed_bytes: 12 * gib,
            limit_bytes: 16 * gib,
            fits: vec![TypeFit {
                instance_type: "pve.small".into(),
                count: 1,
            }],
        }];
        attach_rooms(&mut rows, &rooms);
        let small = rows
            .iter()
            .find(|r| r.instance_type == "pve.small")
            .unwrap();
        let room = small.room.as_ref().expect("room");
        assert_eq!((room.committed_bytes, room.fits), (12 * gib, Some(1)));
        let huge = rows.iter().find(|r| r.instance_type == "pve.huge").unwrap();
        assert_eq!(huge.room.as_ref().unwrap().fits, None, "not offered there");
        let table = room_table(&rooms);
        assert!(
            table.contains("16.0 GiB")
                && table.contains("4.0 GiB")
                && table.contains("pve.small=1"),
            "{table}"
        );
    }

    #[test]
    fn the_storage_table_names_each_storage_and_what_is_left() {
        let gib = 1u64 << 30;
        let table = storage_table(&[
            bigfleet_proto::admin::StorageRoom {
                storage: "local-lvm".into(),
                node: "pve2".into(),
                avail_bytes: 100 * gib,
                allowed_bytes: 200 * gib,
                in_flight_bytes: 64 * gib,
                overcommit: 2.0,
            },
            bigfleet_proto::admin::StorageRoom {
                storage: "ceph".into(),
                node: String::new(),
                avail_bytes: 10 * gib,
                allowed_bytes: 10 * gib,
                in_flight_bytes: 0,
                overcommit: 1.0,
            },
        ]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("STORAGE"), "{table}");
        assert!(
            lines[1].starts_with("ceph") && lines[1].contains("(shared)"),
            "{table}"
        );
        assert!(
            lines[2].contains("pve2")
                && lines[2].contains("64.0 GiB")
                && lines[2].contains("136.0 GiB"),
            "{table}"
        );
    }

    #[test]
    fn list_filters_and_short_output_parse() {
        let a = parse(&[
            "-o",
            "json",
            "list",
            "--zone",
            "pve1,pve2",
            "--type",
            "pve.small",
        ])
        .unwrap();
        assert_eq!(a.output, Output::Json);
        match a.command {
            CtlCommand::List { zones, types, .. } => {
                assert_eq!(zones, vec!["pve1", "pve2"]);
                assert_eq!(types, vec!["pve.small"]);
            }
            other => panic!("parsed {other:?}"),
        }
        assert!(matches!(
            parse(&["summary"]).unwrap().command,
            CtlCommand::Summary
        ));
    }
}
