//! `bigfleet-proxmox state copy --from PATH_OR_URL --to PATH_OR_URL`: moving
//! a whole state between SQLite and PostgreSQL (either direction, or
//! between two of one kind). The copy and its verification are
//! providerkit's [`copy_state`]; this module reads the command line, opens
//! both sides as the provider would open its `--state`, and turns the
//! outcome into one line for a person at a terminal.
//!
//! Run it with every provider on both states stopped: an SQLite state's
//! lock refuses a copy while a provider holds the file, but a PostgreSQL
//! source can be read under a running provider, whose later changes would
//! then be missing from the copy (a change during the copy itself is
//! detected and refused).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use pg_store::TargetError;
use providerkit::{copy_state, CopyError, CopyReport, StoreError};

use crate::state::{LocateError, OpenError, OpenedState, Purpose, StateLocation};

type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `bigfleet-proxmox state ...`.
#[derive(Args, Debug, Clone)]
pub struct StateArgs {
    #[command(subcommand)]
    pub command: StateCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum StateCommand {
    /// Copy a whole state (machine records with their transition windows,
    /// fence marks, the boot generation) into an empty state, SQLite or
    /// PostgreSQL on either side, then read both back and compare. Stop
    /// every provider on both states first.
    Copy(CopyArgs),
}

/// `state copy`'s flags.
#[derive(Args, Debug, Clone)]
pub struct CopyArgs {
    /// The state to copy: an SQLite file path, or
    /// postgres://USER@HOST:PORT/DB?sslmode=... (as --state takes them).
    #[arg(long)]
    pub from: String,

    /// The empty state to copy into: a path (a new SQLite file is created
    /// where none is) or a postgres:// URL (the tables are created in a
    /// database without them).
    #[arg(long)]
    pub to: String,

    /// File holding the PostgreSQL password of a postgres:// --from; unset,
    /// PGPASSWORD, then the password file PGPASSFILE or ~/.pgpass.
    #[arg(long)]
    pub from_password_file: Option<PathBuf>,

    /// File holding the PostgreSQL password of a postgres:// --to; unset,
    /// PGPASSWORD, then the password file PGPASSFILE or ~/.pgpass.
    #[arg(long)]
    pub to_password_file: Option<PathBuf>,
}

/// Which end of the copy a message is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Target,
}

impl Side {
    fn flag(self) -> &'static str {
        match self {
            Side::Source => "--from",
            Side::Target => "--to",
        }
    }

    fn password_flag(self) -> &'static str {
        match self {
            Side::Source => "--from-password-file",
            Side::Target => "--to-password-file",
        }
    }
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Target => "target",
        })
    }
}

/// Why `state copy` failed.
#[derive(Debug, thiserror::Error)]
pub enum StateCopyError {
    /// The command line needs fixing; nothing was opened.
    #[error("{message}")]
    Usage {
        message: String,
        #[source]
        source: Option<Cause>,
    },
    /// The source names nothing to copy.
    #[error(
        "the source {name} holds no state ({why}); nothing was copied: point --from at the \
         state the provider's --state names"
    )]
    NoSource { name: String, why: &'static str },
    /// A state could not be opened.
    #[error("cannot open the {side} {name}: {message}")]
    Open {
        side: Side,
        name: String,
        /// The store's message, with the flag named as this command names it.
        message: String,
        #[source]
        source: StoreError,
    },
    /// The copy or its verification failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
}

impl StateCopyError {
    /// 2 when the command line needs fixing (nothing was opened), else 1,
    /// as `ctl` does.
    pub fn exit_code(&self) -> u8 {
        match self {
            StateCopyError::Usage { .. } => 2,
            _ => 1,
        }
    }

    fn usage(message: impl Into<String>) -> StateCopyError {
        StateCopyError::Usage {
            message: message.into(),
            source: None,
        }
    }
}

/// A finished, verified copy: its one-line summary is its `Display`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopySummary {
    pub from: String,
    pub to: String,
    pub report: CopyReport,
}

impl std::fmt::Display for CopySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "copied {} machines and {} fence marks from {} to {} (boot generation {}); the copy \
             was read back and matches",
            self.report.machines,
            self.report.fence_marks,
            self.from,
            self.to,
            self.report.boot_generation
        )
    }
}

/// Run `state copy`.
pub fn run(args: &CopyArgs) -> Result<CopySummary, StateCopyError> {
    let from = locate(Side::Source, &args.from, args.from_password_file.as_deref())?;
    let to = locate(Side::Target, &args.to, args.to_password_file.as_deref())?;
    if from.same_state(&to) {
        return Err(StateCopyError::usage(format!(
            "--from and --to name the same state ({}): copy into another one",
            args.to.trim()
        )));
    }
    let source = from
        .open_source()
        .map_err(|e| opening(Side::Source, &from, e))?;
    let target = open(Side::Target, &to)?;
    let created_file = target.created_file();
    let target = target.into_dump();
    let result = copy_state(&*source, &*target);
    let (from_name, to_name) = (source.describe(), target.describe());
    // Both close (their writers end, the file lock is released) before a
    // file this command created is removed.
    drop(target);
    drop(source);
    match result {
        Ok(report) => Ok(CopySummary {
            from: from_name,
            to: to_name,
            report,
        }),
        Err(e) => {
            if let Some(path) = created_file {
                remove_new_file(&path);
            }
            Err(e.into())
        }
    }
}

/// Read one side's flag as the provider reads `--state`; empty is refused
/// (a copy needs both ends).
fn locate(
    side: Side,
    value: &str,
    password_file: Option<&Path>,
) -> Result<StateLocation, StateCopyError> {
    let (flag, password_flag) = (side.flag(), side.password_flag());
    match StateLocation::parse(value, password_file) {
        Ok(Some(location)) => Ok(location),
        Ok(None) => Err(StateCopyError::usage(format!(
            "{flag} is empty: name a state file or a postgres:// URL"
        ))),
        Err(LocateError::Misread(why)) => Err(StateCopyError::usage(format!("{flag} {why}"))),
        Err(LocateError::PasswordForFile(file)) => Err(StateCopyError::usage(format!(
            "{password_flag} {} needs {flag} postgres://...: a state file has no password",
            file.display()
        ))),
        Err(LocateError::Url(e)) => Err(StateCopyError::Usage {
            message: target_message(side, &e),
            source: Some(Box::new(e)),
        }),
    }
}

/// A URL's error as this command's flags name things: the store's
/// messages speak of the provider's `--state` and `--state-password-file`.
fn target_message(side: Side, e: &TargetError) -> String {
    match e {
        TargetError::PasswordInUrl => format!(
            "{}: the URL must not carry the password (it would show on the command line); put \
             it in {}, PGPASSWORD or the password file (PGPASSFILE, ~/.pgpass)",
            side.flag(),
            side.password_flag()
        ),
        other => as_flag(side, &other.to_string()),
    }
}

/// `message` with the provider's `--state: ` prefix, which pg-store's
/// messages about the URL and its files start with, replaced by this
/// side's flag.
fn as_flag(side: Side, message: &str) -> String {
    match message.strip_prefix("--state: ") {
        Some(rest) => format!("{}: {rest}", side.flag()),
        None => message.to_string(),
    }
}

/// Open the target as the provider opens its `--state` (the source is
/// read without writing: [`StateLocation::open_source`]).
fn open(side: Side, location: &StateLocation) -> Result<OpenedState, StateCopyError> {
    location
        .open(Purpose::CopyTarget)
        .map_err(|e| opening(side, location, e))
}

/// A side that could not be opened, named as this command names it.
fn opening(side: Side, location: &StateLocation, e: OpenError) -> StateCopyError {
    match e {
        OpenError::NoState(why) => StateCopyError::NoSource {
            name: location.describe(),
            why,
        },
        OpenError::Store(source) => StateCopyError::Open {
            side,
            name: location.describe(),
            message: as_flag(side, source.message()),
            source,
        },
    }
}

/// Remove a target file this command created, with SQLite's companions.
/// Best effort: what is left is an empty state a later copy accepts.
fn remove_new_file(path: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(from: &str, to: &str) -> CopyArgs {
        CopyArgs {
            from: from.into(),
            to: to.into(),
            from_password_file: None,
            to_password_file: None,
        }
    }

    fn refusal(a: &CopyArgs) -> StateCopyError {
        match run(a) {
            Ok(summary) => panic!("copied: {summary}"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_password_in_a_url_is_refused_naming_this_sides_flags() {
        let e = refusal(&args("/x.db", "postgres://bf:hunter2@db/bigfleet"));
        let text = e.to_string();
        assert_eq!(e.exit_code(), 2);
        assert!(
            text.starts_with("--to: the URL must not carry the password"),
            "{text}"
        );
        assert!(text.contains("--to-password-file"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn url_errors_name_the_flag_not_the_providers() {
        let e = refusal(&args("postgres://bf@db/x?sslmode=prefer", "/y.db"));
        let text = e.to_string();
        assert!(
            text.starts_with("--from: sslmode=prefer is not supported"),
            "{text}"
        );
        assert!(!text.contains("--state"), "{text}");
    }

    #[test]
    fn a_password_file_for_a_state_file_is_refused() {
        let mut a = args("/a.db", "/b.db");
        a.to_password_file = Some("/pw".into());
        assert_eq!(
            refusal(&a).to_string(),
            "--to-password-file /pw needs --to postgres://...: a state file has no password"
        );
    }

    #[test]
    fn a_state_is_not_copied_onto_itself() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let other = dir.path().join(".").join("state.db");
        let e = refusal(&args(
            path.to_str().expect("utf-8"),
            other.to_str().expect("utf-8"),
        ));
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("name the same state"), "{e}");
    }

    #[test]
    fn a_missing_source_file_is_refused_and_not_created() {
        let dir = tempfile::tempdir().expect("tempdir");
        let from = dir.path().join("nothing.db");
        let to = dir.path().join("copy.db");
        let e = refusal(&args(
            from.to_str().expect("utf-8"),
            to.to_str().expect("utf-8"),
        ));
        assert_eq!(e.exit_code(), 1);
        assert!(e.to_string().contains("no file is at that path"), "{e}");
        assert!(!from.exists() && !to.exists());
    }
}
