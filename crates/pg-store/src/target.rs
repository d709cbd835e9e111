//! Where the state lives and how to reach it: the `postgres://` URL (with
//! libpq's `sslmode` and `sslrootcert`, which the client library does not
//! parse itself), the TLS set-up, and the password's sources.
//!
//! The password never comes from the URL (it would sit on the command line
//! and in the process list): it comes from `--state-password-file`, else
//! libpq's usual sources, `PGPASSWORD` and then the password file
//! (`PGPASSFILE`, default `~/.pgpass`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use tokio_postgres::config::{Host, SslMode};

/// Why a `--state` URL or its password cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The URL itself is malformed (the client library said why).
    #[error("--state: not a valid PostgreSQL URL: {0}")]
    Url(#[source] tokio_postgres::Error),
    /// The URL carries a password.
    #[error(
        "--state: the URL must not carry the password (it would show on the command line); \
         put it in --state-password-file, PGPASSWORD or the password file (PGPASSFILE, \
         ~/.pgpass)"
    )]
    PasswordInUrl,
    /// An `sslmode` that does not verify the server, or one we do not know.
    #[error(
        "--state: sslmode={0} is not supported: use sslmode=verify-full (with sslrootcert=CA \
         file for a private CA) or, on a trusted loopback only, sslmode=disable"
    )]
    SslMode(String),
    /// A URL parameter that is not valid percent-encoded UTF-8.
    #[error("--state: the URL parameter {0} is not valid UTF-8 once decoded")]
    Encoding(String),
    /// The URL names no user.
    #[error("--state: the URL names no user (postgres://USER@HOST:PORT/DB)")]
    NoUser,
    /// A file the connection needs cannot be read.
    #[error("--state: cannot read {what} {path}: {source}")]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The CA file holds no usable certificate.
    #[error("--state: sslrootcert {0} holds no PEM certificate")]
    NoCertificate(PathBuf),
    /// rustls refused the TLS settings.
    #[error("--state: cannot set up TLS: {0}")]
    Tls(#[source] rustls::Error),
}

/// Whether `state` names a PostgreSQL database rather than a file.
pub fn is_postgres_url(state: &str) -> bool {
    state.starts_with("postgres://") || state.starts_with("postgresql://")
}

/// Why `state`, which is not a `postgres://` URL, must not be taken for a
/// file name either: it looks like a URL of another scheme or case
/// (`POSTGRES://...`, `pg://...`, `sqlite:...`) or a libpq connection
/// string (`host=db user=bf`). Taken as a path it would create a private
/// state file named after it (a replica meant to share a database then
/// leads alone) and print its password in file names and messages. `None`
/// for anything that reads as a path. What it says of `state` has any
/// password masked.
pub fn misread_state(state: &str) -> Option<String> {
    if is_postgres_url(state) {
        return None;
    }
    let shown = mask_secrets(state);
    let head = state.split('/').next().unwrap_or(state);
    let scheme = head.split_once(':').map(|(s, _)| s).filter(|s| {
        s.len() > 1
            && s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    });
    if let Some(scheme) = scheme {
        return Some(format!(
            "{shown:?} looks like a URL ({scheme}:) but is not postgres://... or postgresql://... \
             (lower case): write the database as postgres://USER@HOST:PORT/DB, or a file path \
             (./{scheme}:... for a file whose name starts that way)"
        ));
    }
    let libpq = state
        .split_whitespace()
        .any(|word| word.split_once('=').is_some_and(|(k, _)| is_libpq_key(k)));
    libpq.then(|| {
        format!(
            "{shown:?} looks like a libpq connection string (key=value): write the database as \
             postgres://USER@HOST:PORT/DB?sslmode=..., the password in --state-password-file, \
             PGPASSWORD or the password file, or give a file path"
        )
    })
}

/// libpq's connection keywords that a connection string starts with.
fn is_libpq_key(key: &str) -> bool {
    matches!(
        key,
        "host"
            | "hostaddr"
            | "port"
            | "dbname"
            | "user"
            | "password"
            | "passfile"
            | "sslmode"
            | "sslrootcert"
            | "service"
            | "application_name"
            | "options"
    )
}

/// `state` with a URL's password (`user:PASSWORD@`) and a connection
/// string's `password=...` replaced by `****`.
fn mask_secrets(state: &str) -> String {
    let masked_words: Vec<String> = state
        .split(' ')
        .map(|w| match w.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=****"),
            _ => w.to_string(),
        })
        .collect();
    let joined = masked_words.join(" ");
    let Some((scheme, rest)) = joined.split_once("://") else {
        return joined;
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:****@{host}{tail}"),
            None => joined,
        },
        None => joined,
    }
}

/// How the connection is protected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tls {
    /// `sslmode=disable`: plain TCP (a trusted loopback, tests).
    Disabled,
    /// `sslmode=verify-full` (the default): TLS, the chain verified against
    /// `sslrootcert` (else the public web roots) and the host name checked.
    VerifyFull { root_cert: Option<PathBuf> },
}

/// A parsed `--state postgres://...` URL: the connection settings without
/// any password, and the TLS mode.
#[derive(Clone, Debug)]
pub struct Target {
    config: tokio_postgres::Config,
    tls: Tls,
    display: String,
}

impl Target {
    /// Parse a `postgres://USER@HOST:PORT/DB?sslmode=...` URL (also
    /// `postgresql://`). `sslmode` is `verify-full` (the default) or
    /// `disable`; `sslrootcert` names the CA file for `verify-full`.
    pub fn parse(url: &str) -> Result<Target, TargetError> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut sslmode = None;
        let mut root_cert = None;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = || {
                percent_decode_str(value)
                    .decode_utf8()
                    .map(|v| v.into_owned())
                    .map_err(|_| TargetError::Encoding(key.to_string()))
            };
            match key {
                "sslmode" => sslmode = Some(decode()?),
                "sslrootcert" => root_cert = Some(PathBuf::from(decode()?)),
                // libpq's own names for the password: refused like one in
                // the authority part.
                "password" => return Err(TargetError::PasswordInUrl),
                _ => kept.push(pair),
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        let mut config: tokio_postgres::Config = rest.parse().map_err(TargetError::Url)?;
        if config.get_password().is_some() {
            return Err(TargetError::PasswordInUrl);
        }
        if config.get_user().is_none() {
            return Err(TargetError::NoUser);
        }
        let tls = match sslmode.as_deref().unwrap_or("verify-full") {
            "verify-full" => {
                config.ssl_mode(SslMode::Require);
                Tls::VerifyFull { root_cert }
            }
            "disable" => {
                config.ssl_mode(SslMode::Disable);
                Tls::Disabled
            }
            other => return Err(TargetError::SslMode(other.to_string())),
        };
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("bigfleet-proxmox");
        }
        let display = describe(&config);
        Ok(Target {
            config,
            tls,
            display,
        })
    }

    /// The URL without its query, for logs and messages
    /// (`postgres://USER@HOST:PORT/DB`): never a password.
    pub fn display(&self) -> &str {
        &self.display
    }

    /// The host the URL names (a TCP host name or address, or a socket
    /// directory), if any.
    pub fn host(&self) -> Option<String> {
        match self.config.get_hosts().first()? {
            Host::Tcp(name) => Some(name.clone()),
            Host::Unix(path) => Some(path.display().to_string()),
        }
    }

    /// The TLS mode the URL asked for.
    pub fn tls(&self) -> &Tls {
        &self.tls
    }

    /// The connection settings with the password from `password_file`,
    /// else `PGPASSWORD`, else the password file, if any of them has one.
    pub(crate) fn config_with_password(
        &self,
        password_file: Option<&Path>,
    ) -> Result<tokio_postgres::Config, TargetError> {
        let mut config = self.config.clone();
        if let Some(password) = self.password(password_file)? {
            config.password(password);
        }
        Ok(config)
    }

    fn password(&self, password_file: Option<&Path>) -> Result<Option<String>, TargetError> {
        if let Some(path) = password_file {
            let text = std::fs::read_to_string(path).map_err(|source| TargetError::Unreadable {
                what: "the password file",
                path: path.to_path_buf(),
                source,
            })?;
            // One line; the newline an editor adds is not part of it.
            return Ok(Some(text.trim_end_matches(['\r', '\n']).to_string()));
        }
        if let Some(password) = std::env::var_os("PGPASSWORD") {
            return Ok(Some(password.to_string_lossy().into_owned()));
        }
        let passfile = std::env::var_os("PGPASSFILE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pgpass")));
        let Some(passfile) = passfile else {
            return Ok(None);
        };
        let text = match std::fs::read_to_string(&passfile) {
            Ok(text) => text,
            // No password file is the usual case (trust or certificate
            // authentication, or a password from elsewhere).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(TargetError::Unreadable {
                    what: "the password file",
                    path: passfile,
                    source,
                })
            }
        };
        let host = match self.config.get_hosts().first() {
            Some(Host::Tcp(name)) => name.clone(),
            // libpq matches a socket connection against `localhost`.
            _ => "localhost".to_string(),
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        let user = self.config.get_user().unwrap_or_default();
        let dbname = self.config.get_dbname().unwrap_or(user);
        Ok(pgpass_lookup(&text, &host, port, dbname, user))
    }

    /// The TLS connector the URL asks for; `None` for a plain connection.
    pub(crate) fn connector(
        &self,
    ) -> Result<Option<tokio_postgres_rustls::MakeRustlsConnect>, TargetError> {
        let Tls::VerifyFull { root_cert } = &self.tls else {
            return Ok(None);
        };
        let mut roots = rustls::RootCertStore::empty();
        match root_cert {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|source| TargetError::Unreadable {
                    what: "sslrootcert",
                    path: path.clone(),
                    source,
                })?;
                let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
                    .collect::<Result<_, _>>()
                    .map_err(|source| TargetError::Unreadable {
                        what: "sslrootcert",
                        path: path.clone(),
                        source,
                    })?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(TargetError::NoCertificate(path.clone()));
                }
            }
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(TargetError::Tls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Some(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
    }
}

/// How long one connection attempt may take unless the URL says
/// (`connect_timeout=SECONDS`).
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn describe(config: &tokio_postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(name)) if name.contains(':') => format!("[{name}]"),
        Some(Host::Tcp(name)) => name.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or_default();
    let dbname = config.get_dbname().unwrap_or(user);
    format!("postgres://{user}@{host}:{port}/{dbname}")
}

/// The password of the first line of a libpq password file
/// (`host:port:database:user:password`, `*` matching anything, `\:` and
/// `\\` escaped) that matches the connection.
pub fn pgpass_lookup(
    text: &str,
    host: &str,
    port: u16,
    dbname: &str,
    user: &str,
) -> Option<String> {
    let port = port.to_string();
    text.lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .filter_map(split_pgpass_line)
        .find(|fields| {
            [host, port.as_str(), dbname, user]
                .iter()
                .zip(fields.iter())
                .all(|(want, field)| field == "*" || field == want)
        })
        .map(|mut fields| fields.swap_remove(4))
}

/// A password file line's five fields, unescaped; `None` for a line with
/// fewer (libpq skips those).
fn split_pgpass_line(line: &str) -> Option<Vec<String>> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    fields.last_mut()?.push(next);
                }
            }
            // The password, the fifth field, may itself hold colons.
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut()?.push(c),
        }
    }
    (fields.len() == 5).then_some(fields)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_misspelt_url_or_a_connection_string_is_not_a_path() {
        for (value, says) in [
            (
                "POSTGRES://bf:Secret1@db:5432/bf",
                "looks like a URL (POSTGRES:)",
            ),
            ("Postgresql://bf@db/bf", "looks like a URL"),
            ("pg://bf@db/bf", "looks like a URL (pg:)"),
            ("sqlite:/var/lib/state.db", "looks like a URL (sqlite:)"),
            (
                "host=db user=bf password=Secret1",
                "libpq connection string",
            ),
            ("dbname=bf", "libpq connection string"),
        ] {
            let e = misread_state(value).unwrap_or_else(|| panic!("{value} taken for a path"));
            assert!(e.contains(says), "{value}: {e}");
            assert!(!e.contains("Secret1"), "the password echoed: {e}");
        }
        for path in [
            "postgres://bf@db:5432/bf?sslmode=verify-full",
            "postgresql://bf@db/bf",
            "/var/lib/bigfleet/state.db",
            "state.db",
            "./POSTGRES:odd",
            "/data/a=b/state.db",
            "C",
        ] {
            assert_eq!(misread_state(path), None, "{path}");
        }
        assert_eq!(
            mask_secrets("POSTGRES://bf:Secret1@db:5432/bf?sslmode=require"),
            "POSTGRES://bf:****@db:5432/bf?sslmode=require"
        );
    }

    use super::*;

    #[test]
    fn verify_full_is_the_default_and_the_query_keeps_other_parameters() {
        let t = Target::parse("postgres://bf@db.example:6543/state?connect_timeout=3").unwrap();
        assert_eq!(t.tls(), &Tls::VerifyFull { root_cert: None });
        assert_eq!(t.display(), "postgres://bf@db.example:6543/state");
        assert_eq!(
            t.config.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(3))
        );
        let t = Target::parse(
            "postgresql://bf@db.example/state?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(
            t.tls(),
            &Tls::VerifyFull {
                root_cert: Some(PathBuf::from("/etc/ca.pem"))
            }
        );
        assert_eq!(t.display(), "postgres://bf@db.example:5432/state");
        let t = Target::parse("postgres://bf@127.0.0.1:5/db?sslmode=disable").unwrap();
        assert_eq!(t.tls(), &Tls::Disabled);
    }

    #[test]
    fn a_password_or_an_unverified_mode_is_refused() {
        for url in [
            "postgres://bf:secret@h/db",
            "postgres://bf@h/db?password=secret",
        ] {
            let e = Target::parse(url).unwrap_err();
            assert!(matches!(e, TargetError::PasswordInUrl), "{url}: {e}");
            assert!(!e.to_string().contains("secret"), "{e}");
        }
        for mode in ["require", "prefer", "allow", "verify-ca", "bogus"] {
            let e = Target::parse(&format!("postgres://bf@h/db?sslmode={mode}")).unwrap_err();
            assert!(e.to_string().contains("use sslmode=verify-full"), "{e}");
        }
        assert!(matches!(
            Target::parse("postgres://h/db"),
            Err(TargetError::NoUser)
        ));
    }

    #[test]
    fn the_password_file_flag_wins_and_loses_its_newline() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "s3cret:with:colons\n").unwrap();
        let t = Target::parse("postgres://bf@h/db?sslmode=disable").unwrap();
        let config = t.config_with_password(Some(&file)).unwrap();
        assert_eq!(config.get_password(), Some(&b"s3cret:with:colons"[..]));
        let e = t
            .config_with_password(Some(&dir.path().join("missing")))
            .unwrap_err();
        assert!(
            e.to_string().contains("cannot read the password file"),
            "{e}"
        );
    }

    #[test]
    fn pgpass_lines_match_like_libpq() {
        let text = "# comment\n\
                    other:5432:*:bf:wrong\n\
                    db.example:5432:state:bf:pa\\:ss:word\n\
                    *:*:*:*:fallback\n\
                    short:line\n";
        assert_eq!(
            pgpass_lookup(text, "db.example", 5432, "state", "bf").as_deref(),
            Some("pa:ss:word")
        );
        assert_eq!(
            pgpass_lookup(text, "db.example", 5433, "state", "bf").as_deref(),
            Some("fallback")
        );
        assert_eq!(pgpass_lookup("short:line\n", "h", 1, "d", "u"), None);
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let url = format!(
            "postgres://bf@h/db?sslmode=verify-full&sslrootcert={}",
            ca.display()
        );
        let e = Target::parse(&url).unwrap().connector().err().unwrap();
        assert!(matches!(e, TargetError::NoCertificate(_)), "{e}");
    }
}
