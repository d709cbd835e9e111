//! Where a state is kept and how it is opened. `--state`, each leader
//! term of a PostgreSQL state and `state copy`'s `--from` and `--to` all
//! read their value and open their store here, so the rules (what is a
//! path, what is a URL, what is refused) cannot differ between them, and a
//! third store is one crate and one arm of [`StateLocation`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pg_store::{PgOptions, PgStore, Target, TargetError};
use providerkit::{StateDump, StateSource, Store, StoreError};
use sqlite_store::{Origin, ReadOnlySource, SqliteStore};

/// A state: an SQLite file or a PostgreSQL database.
#[derive(Clone, Debug)]
pub enum StateLocation {
    /// A path: an SQLite database (or the reference's JSON state, imported).
    Sqlite(PathBuf),
    /// A `postgres://` or `postgresql://` URL (boxed: the connection
    /// settings are large beside a path).
    Postgres {
        target: Box<Target>,
        options: PgOptions,
        /// The URL as given (a password in it is refused), which tells
        /// two states in one database server apart.
        url: String,
    },
}

/// Why a value names no state. The caller says which flag it came from.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    /// A URL of another scheme, or a libpq `key=value` string: taken for a
    /// path it would silently become a private state file.
    #[error("{0}")]
    Misread(String),
    /// A password file beside a state file, which has none.
    #[error("a state file has no password")]
    PasswordForFile(PathBuf),
    /// The `postgres://` URL does not parse or asks for what is refused.
    #[error(transparent)]
    Url(#[from] TargetError),
}

/// What a state is opened for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The provider serves it: created when absent, migrated; with a
    /// lease epoch, every commit checks that this replica still leads.
    Serve { lease_epoch: Option<i64> },
    /// `state copy --to`: created when absent.
    CopyTarget,
}

/// Why [`StateLocation::open`] gave no store.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// A copy's source is not a state; nothing was created.
    #[error("{0}")]
    NoState(&'static str),
    /// The store refused or failed to open.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl StateLocation {
    /// Read one flag's value: `None` when empty (the caller decides what
    /// that means), a `postgres://` URL names a database, anything that
    /// does not look like another kind of URL or a libpq string is a path.
    pub fn parse(
        value: &str,
        password_file: Option<&Path>,
    ) -> Result<Option<StateLocation>, LocateError> {
        let value = value.trim();
        if value.is_empty() {
            return Ok(None);
        }
        if let Some(why) = pg_store::misread_state(value) {
            return Err(LocateError::Misread(why));
        }
        if !pg_store::is_postgres_url(value) {
            if let Some(file) = password_file {
                return Err(LocateError::PasswordForFile(file.to_path_buf()));
            }
            return Ok(Some(StateLocation::Sqlite(PathBuf::from(value))));
        }
        let target = Target::parse(value)?;
        Ok(Some(StateLocation::Postgres {
            target: Box::new(target),
            options: PgOptions {
                password_file: password_file.map(Path::to_path_buf),
                lease_epoch: None,
            },
            url: value.to_string(),
        }))
    }

    /// What logs and messages name the state by (`sqlite:PATH`, the URL
    /// without a password).
    pub fn describe(&self) -> String {
        match self {
            StateLocation::Sqlite(path) => format!("sqlite:{}", path.display()),
            StateLocation::Postgres { target, .. } => target.display().to_string(),
        }
    }

    /// Whether two locations are one state (a copy onto itself).
    pub fn same_state(&self, other: &StateLocation) -> bool {
        match (self, other) {
            (StateLocation::Sqlite(a), StateLocation::Sqlite(b)) => {
                let resolve = |p: &Path| {
                    std::fs::canonicalize(p)
                        .or_else(|_| std::path::absolute(p))
                        .unwrap_or_else(|_| p.to_path_buf())
                };
                resolve(a) == resolve(b)
            }
            (StateLocation::Postgres { url: a, .. }, StateLocation::Postgres { url: b, .. }) => {
                a == b
            }
            _ => false,
        }
    }

    /// Open the state for `purpose`. Blocks until the file is locked or
    /// the database answered.
    pub fn open(&self, purpose: Purpose) -> Result<OpenedState, OpenError> {
        match self {
            StateLocation::Sqlite(path) => Ok(OpenedState::Sqlite(SqliteStore::open(path)?)),
            StateLocation::Postgres {
                target, options, ..
            } => {
                let store = match purpose {
                    Purpose::Serve { lease_epoch } => {
                        let options = PgOptions {
                            lease_epoch,
                            ..options.clone()
                        };
                        PgStore::open(target, &options)?
                    }
                    Purpose::CopyTarget => PgStore::open(target, options)?,
                };
                Ok(OpenedState::Postgres(store))
            }
        }
    }
}

impl StateLocation {
    /// The state as a copy's source: read without writing anything (no
    /// lock file beside a state file, no migration, no writer generation
    /// moved), so it stays byte for byte as it was. A path where nothing
    /// is, or a database without the state's tables, is no state, and
    /// nothing is created for it.
    pub fn open_source(&self) -> Result<Box<dyn StateSource>, OpenError> {
        match self {
            StateLocation::Sqlite(path) => {
                if let Err(e) = std::fs::symlink_metadata(path) {
                    // Anything but a missing file is for the open to say.
                    if e.kind() == std::io::ErrorKind::NotFound {
                        return Err(OpenError::NoState("no file is at that path"));
                    }
                }
                Ok(Box::new(ReadOnlySource::open(path)?))
            }
            StateLocation::Postgres {
                target, options, ..
            } => {
                // Read once here, so a database without the tables is
                // refused before anything else happens.
                if pg_store::read_state(target, options)?.is_none() {
                    return Err(OpenError::NoState("the database has no state tables"));
                }
                Ok(Box::new(PgSource {
                    target: (**target).clone(),
                    options: options.clone(),
                }))
            }
        }
    }
}

/// A PostgreSQL state as a copy's source: each read is its own snapshot,
/// rolled back (see `pg_store::read_state`).
struct PgSource {
    target: Target,
    options: PgOptions,
}

impl StateSource for PgSource {
    fn read(&self) -> Result<providerkit::Loaded, StoreError> {
        pg_store::read_state(&self.target, &self.options)?.ok_or_else(|| {
            StoreError::corrupt(format!(
                "PostgreSQL state {}: the state's tables went away during the copy",
                self.target.display()
            ))
        })
    }

    fn describe(&self) -> String {
        self.target.display().to_string()
    }
}

/// An open state, of whichever store.
pub enum OpenedState {
    Sqlite(SqliteStore),
    Postgres(PgStore),
}

impl OpenedState {
    /// The start-up line saying whether the state was created, loaded or
    /// imported and what it held, so a state that was expected but
    /// silently replaced by a fresh one shows in the first lines of the log.
    pub fn log_opened(&self) {
        match self {
            OpenedState::Sqlite(store) => {
                let report = store.report();
                let path = store.path().display();
                match &report.origin {
                    Origin::Created => tracing::info!(path = %path, "state created"),
                    Origin::Loaded => tracing::info!(
                        path = %path,
                        machines = report.machines,
                        fence_marks = report.fence_marks,
                        "state loaded"
                    ),
                    Origin::Imported(imported) => tracing::info!(
                        path = %path,
                        backup = %imported.backup.display(),
                        machines = report.machines,
                        fence_marks = report.fence_marks,
                        operation_ids = imported.operation_ids,
                        "state imported from the reference implementation's JSON file"
                    ),
                }
            }
            OpenedState::Postgres(store) => {
                let report = store.report();
                if report.created {
                    tracing::info!(url = %store.target(), "state created");
                } else {
                    tracing::info!(
                        url = %store.target(),
                        machines = report.machines,
                        fence_marks = report.fence_marks,
                        "state loaded"
                    );
                }
            }
        }
    }

    /// The file this open created, if it created one (a failed copy
    /// removes it again, so it leaves no new file behind).
    pub fn created_file(&self) -> Option<PathBuf> {
        match self {
            OpenedState::Sqlite(store) => {
                (store.report().origin == Origin::Created).then(|| store.path().into())
            }
            OpenedState::Postgres(_) => None,
        }
    }

    /// The store the engine serves from.
    pub fn into_store(self) -> Arc<dyn Store> {
        match self {
            OpenedState::Sqlite(store) => Arc::new(store),
            OpenedState::Postgres(store) => Arc::new(store),
        }
    }

    /// The store `state copy` reads or writes whole.
    pub fn into_dump(self) -> Box<dyn StateDump> {
        match self {
            OpenedState::Sqlite(store) => Box::new(store),
            OpenedState::Postgres(store) => Box::new(store),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_no_state_and_a_path_is_a_file() {
        assert!(StateLocation::parse("  ", None).expect("empty").is_none());
        let Some(StateLocation::Sqlite(path)) =
            StateLocation::parse(" /var/lib/x.db ", None).expect("a path")
        else {
            panic!("a path is an SQLite file");
        };
        assert_eq!(path, PathBuf::from("/var/lib/x.db"));
    }

    #[test]
    fn a_password_file_beside_a_state_file_is_refused() {
        let e = StateLocation::parse("/x.db", Some(Path::new("/pw"))).expect_err("refused");
        assert!(matches!(e, LocateError::PasswordForFile(p) if p == Path::new("/pw")));
    }

    #[test]
    fn a_url_of_another_case_is_not_taken_for_a_path() {
        let e = StateLocation::parse("POSTGRES://bf:hunter2@db/x", None).expect_err("refused");
        assert!(matches!(e, LocateError::Misread(_)), "{e:?}");
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn a_postgres_url_keeps_its_password_file_and_no_epoch() {
        let pw = Path::new("/run/secrets/pw");
        let Some(StateLocation::Postgres { options, url, .. }) =
            StateLocation::parse("postgres://bf@db:5432/x", Some(pw)).expect("a url")
        else {
            panic!("a postgres:// URL is a database");
        };
        assert_eq!(options.password_file.as_deref(), Some(pw));
        assert_eq!(options.lease_epoch, None);
        assert_eq!(url, "postgres://bf@db:5432/x");
    }

    #[test]
    fn a_missing_copy_source_file_is_no_state_and_is_not_created() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("none.db");
        let location = StateLocation::Sqlite(path.clone());
        match location.open_source() {
            Err(OpenError::NoState(why)) => assert_eq!(why, "no file is at that path"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("opened a state that is not there"),
        }
        assert!(!path.exists());
        let opened = location
            .open(Purpose::Serve { lease_epoch: None })
            .expect("a served state is created");
        assert_eq!(opened.created_file(), Some(path));
    }
}
