//! Structured logs on stderr: logfmt (`ts=… level=info msg="…" k=v`) by
//! default, JSON with `--log-format json`.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Install the global subscriber. `level` is a tracing filter directive.
pub fn init(format: LogFormat, level: &str) -> Result<(), String> {
    let filter = EnvFilter::try_new(level)
        .map_err(|e| format!("--log-level {level:?} is not a valid level or filter: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.event_format(Logfmt).try_init(),
    };
    result.map_err(|e| format!("cannot install the logger: {e}"))
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
