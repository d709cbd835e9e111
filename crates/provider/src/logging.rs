//! Structured logs on stderr: logfmt (`ts=… level=info msg="…" k=v`) by
//! default, JSON with `--log-format json`.

use std::fmt::{self, Write as _};
use std::io::BufWriter;
use std::sync::OnceLock;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;
use crate::error::ConfigError;

/// Lines waiting for the writer thread; beyond this, lines are dropped and
/// counted (see [`dropped_lines`]) rather than stalling the RPC path.
const LOG_QUEUE_LINES: usize = 128_000;

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Log lines dropped because stderr could not keep up.
pub fn dropped_lines() -> u64 {
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}

/// Install the global subscriber. `level` is a tracing filter directive.
///
/// Lines are written by a dedicated thread that drains everything queued
/// before it writes, so under load many lines share one write and no RPC
/// waits on stderr. Keep the guard until exit: dropping it flushes.
pub fn init(format: LogFormat, level: &str) -> Result<WorkerGuard, LogError> {
    check_level_words(level).map_err(LogError::Level)?;
    let filter = EnvFilter::try_new(level).map_err(|e| {
        let message = format!("--log-level {level:?} is not a valid level or filter: {e}");
        LogError::Level(ConfigError::invalid_because(message, e))
    })?;
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("log-writer")
        .finish(BufWriter::with_capacity(64 * 1024, std::io::stderr()));
    // A second init (tests) keeps the first counter, as it keeps the first
    // subscriber.
    let _ = DROPPED.set(writer.error_counter());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    let result = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.event_format(Logfmt).try_init(),
    };
    result.map_err(LogError::Install)?;
    Ok(guard)
}

/// Refuses a directive that is a bare word but not a level. `EnvFilter`
/// reads `warning` or `inf` as a target name enabled at every level, which
/// silences every line the provider writes: a typo must not look like a
/// quiet process. A directive with a level (`TARGET=LEVEL`), a span filter
/// (`[span]`) or a module path (`crate::module`) is left to `EnvFilter`.
fn check_level_words(level: &str) -> Result<(), ConfigError> {
    for directive in level.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let filter_syntax = directive.contains(['=', '[']) || directive.contains("::");
        if !filter_syntax
            && directive
                .parse::<tracing::level_filters::LevelFilter>()
                .is_err()
        {
            return Err(ConfigError::invalid(format!(
                "--log-level {level:?} is not a valid level or filter: {directive:?} is not a \
                 level (error, warn, info, debug, trace or off); a filter names its target as \
                 TARGET=LEVEL"
            )));
        }
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// `--log-level` is not a level or filter: a configuration error.
    #[error(transparent)]
    Level(ConfigError),
    /// A global subscriber is already installed.
    #[error("cannot install the logger: {0}")]
    Install(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

pub struct Logfmt;

struct FieldWriter {
    out: String,
    message: Option<String>,
}

fn quote_if_needed(value: &str, out: &mut String) {
    let plain = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '"' && c != '=' && c != '\\');
    if plain {
        out.push_str(value);
    } else {
        out.push('"');
        for c in value.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                c if c.is_control() => {
                    let _ = write!(out, "\\u{{{:x}}}", c as u32);
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

impl Visit for FieldWriter {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = Some(value.to_string());
            return;
        }
        self.out.push(' ');
        self.out.push_str(field.name());
        self.out.push('=');
        quote_if_needed(value, &mut self.out);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

impl<S, N> FormatEvent<S, N> for Logfmt
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = FieldWriter {
            out: String::new(),
            message: None,
        };
        event.record(&mut fields);
        let ts = humantime::format_rfc3339_millis(std::time::SystemTime::now());
        let level = event.metadata().level().as_str().to_ascii_lowercase();
        let mut msg = String::new();
        quote_if_needed(fields.message.as_deref().unwrap_or(""), &mut msg);
        writeln!(writer, "ts={ts} level={level} msg={msg}{}", fields.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_that_are_not_levels_are_refused() {
        for bad in ["warning", "inf", "INFO,verbose", "quiet"] {
            let e = check_level_words(bad).expect_err(bad).to_string();
            assert!(e.contains("is not a level"), "{bad}: {e}");
        }
        for good in [
            "info",
            "WARN",
            "off",
            "info,h2=warn",
            "bigfleet_proxmox::serve",
            "[grpc]=debug",
            "",
        ] {
            check_level_words(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
    }

    #[test]
    fn quoting() {
        let mut out = String::new();
        quote_if_needed("plain", &mut out);
        out.push(' ');
        quote_if_needed("two words \"q\"\n", &mut out);
        out.push(' ');
        quote_if_needed("", &mut out);
        assert_eq!(out, "plain \"two words \\\"q\\\"\\n\" \"\"");
    }
}
