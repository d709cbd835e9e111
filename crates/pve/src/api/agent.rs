//! The QEMU guest agent inside a VM: ping, write a file, run a command and
//! read its exit status. Payloads reach the agent through PVE's Perl
//! `encode_base64`, hence [`latin1_text`].

use base64::Engine as _;
use http::Method;
use serde::Deserialize;
use serde_json::Value;
use zeroize::Zeroizing;

use super::vm_path;
use crate::client::PveClient;
use crate::error::PveError;
use crate::form::Params;
use crate::types::{lenient, ExecStatus, FileEncoding};

/// `agent/file-write` `content` limit.
pub const MAX_FILE_WRITE_CONTENT: usize = 61440;
/// `agent/exec` `input-data` limit.
pub const MAX_EXEC_INPUT: usize = 65536;

#[derive(Deserialize)]
struct ExecPid {
    #[serde(deserialize_with = "lenient::u32")]
    pid: u32,
}

impl PveClient {
    /// `POST .../agent/ping`: Ok once the guest agent answers.
    pub async fn agent_ping(&self, node: &str, vmid: u32) -> Result<(), PveError> {
        let path = vm_path(node, vmid, "/agent/ping");
        let _: Value = self
            .call("agent_ping", Method::POST, &path, &Params::new())
            .await?;
        Ok(())
    }

    /// `POST .../agent/file-write`: writes (truncates) `path` in the guest.
    /// Content after encoding must fit in 60 KiB.
    pub async fn agent_file_write(
        &self,
        node: &str,
        vmid: u32,
        path: &str,
        content: &[u8],
        encoding: FileEncoding,
    ) -> Result<(), PveError> {
        if path.is_empty() {
            return Err(PveError::InvalidArgument("file-write path is empty".into()));
        }
        // The content may be a piece of the bootstrap blob: its encoded
        // copy is wiped once sent (`Params` wipes its own copy).
        let (payload, encode) = match encoding {
            FileEncoding::PveEncodes => (Zeroizing::new(latin1_text(content)), true),
            FileEncoding::Base64 => (
                Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(content)),
                false,
            ),
        };
        // PVE's limit counts characters; both encodings use one per byte sent.
        let sent = payload.chars().count();
        if sent > MAX_FILE_WRITE_CONTENT {
            return Err(PveError::InvalidArgument(format!(
                "file-write content for {path} is {sent} bytes after encoding; the limit is {MAX_FILE_WRITE_CONTENT}"
            )));
        }
        let mut p = Params::new();
        p.push("file", path);
        p.push("content", payload.as_bytes());
        p.push_bool("encode", encode);
        let _: Value = self
            .call(
                "agent_file_write",
                Method::POST,
                &vm_path(node, vmid, "/agent/file-write"),
                &p,
            )
            .await?;
        Ok(())
    }

    /// `POST .../agent/exec`: starts `argv` (no shell) with optional stdin and
    /// returns the guest pid. `input_data` (any bytes, at most 64 KiB) reaches
    /// the command's stdin unchanged.
    pub async fn agent_exec<S: AsRef<str>>(
        &self,
        node: &str,
        vmid: u32,
        argv: &[S],
        input_data: Option<&[u8]>,
    ) -> Result<u32, PveError> {
        if argv.is_empty() || argv[0].as_ref().is_empty() {
            return Err(PveError::InvalidArgument("exec command is empty".into()));
        }
        let mut p = Params::new();
        p.push_array("command", argv.iter().map(|a| a.as_ref()));
        if let Some(data) = input_data {
            if data.len() > MAX_EXEC_INPUT {
                return Err(PveError::InvalidArgument(format!(
                    "exec input-data is {} bytes; the limit is {MAX_EXEC_INPUT}",
                    data.len()
                )));
            }
            p.push("input-data", latin1_text(data));
        }
        let r: ExecPid = self
            .call(
                "agent_exec",
                Method::POST,
                &vm_path(node, vmid, "/agent/exec"),
                &p,
            )
            .await?;
        Ok(r.pid)
    }

    /// `GET .../agent/exec-status?pid=N`. The agent forgets the pid after the
    /// first `exited` answer, so a lost answer loses the exit code. The
    /// output comes back as the text of the guest's bytes (PVE sends them one
    /// character per byte; they are put back together here).
    pub async fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u32,
    ) -> Result<ExecStatus, PveError> {
        let mut p = Params::new();
        p.push("pid", pid.to_string());
        let mut st: ExecStatus = self
            .call(
                "agent_exec_status",
                Method::GET,
                &vm_path(node, vmid, "/agent/exec-status"),
                &p,
            )
            .await?;
        st.out_data = st.out_data.map(bytes_as_sent);
        st.err_data = st.err_data.map(bytes_as_sent);
        Ok(st)
    }
}

/// The guest's output as text. PVE base64-decodes the agent's `out-data` /
/// `err-data` into a Perl byte string and JSON-encodes that one character
/// per byte (qemu-server `API2/Qemu/Agent.pm`), so UTF-8 output arrives with
/// each byte as the character of that code point (`\u00c3\u00bc` for `ü`).
/// When every character is at most U+00FF, the characters are those bytes:
/// they are put back together and decoded as UTF-8 (invalid sequences become
/// U+FFFD). A character above U+00FF means a server that sent the text
/// itself; it is kept as it came.
fn bytes_as_sent(text: String) -> String {
    let bytes: Option<Vec<u8>> = text.chars().map(|c| u8::try_from(c).ok()).collect();
    match bytes {
        Some(bytes) => match String::from_utf8(bytes) {
            Ok(decoded) => decoded,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        },
        None => text,
    }
}

/// Text for a parameter PVE hands to the guest agent through Perl's
/// `encode_base64` (`file-write` content with `encode=1`, exec `input-data`).
/// PVE decodes the request as UTF-8 and `encode_base64` takes every character
/// up to U+00FF as one byte (and dies with "Wide character" above), so sending
/// each byte as the character with that code point delivers the bytes exactly,
/// whatever they are; UTF-8 text sent as-is would arrive re-encoded or fail.
fn latin1_text(bytes: &[u8]) -> String {
    // Sized once (bytes >= 0x80 take two in UTF-8), so no outgrown buffer
    // keeps a copy of a secret's characters.
    let mut out = String::with_capacity(bytes.iter().map(|&b| 1 + usize::from(b >= 0x80)).sum());
    out.extend(bytes.iter().map(|&b| char::from(b)));
    out
}

#[cfg(test)]
mod tests {
    use super::bytes_as_sent;

    #[test]
    fn exec_output_bytes_are_put_back_together() {
        // `ü` and `€` as PVE sends them: one character per UTF-8 byte.
        assert_eq!(
            bytes_as_sent("gr\u{c3}\u{bc}n \u{e2}\u{82}\u{ac}".into()),
            "grün €"
        );
        assert_eq!(bytes_as_sent("plain ascii\n".into()), "plain ascii\n");
        // A lone Latin-1 byte is not UTF-8: replaced, not passed on as `é`.
        assert_eq!(bytes_as_sent("caf\u{e9}".into()), "caf\u{fffd}");
        // Text from a server that sent characters, not bytes: kept.
        assert_eq!(bytes_as_sent("grün €".into()), "grün €");
    }
}
