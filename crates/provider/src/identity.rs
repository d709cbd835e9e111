//! Caller identity under mTLS, as BigFleet defines it (its ADR-0048 and
//! ADR-0060): exactly one `bigfleet://` URI SAN per client certificate names
//! who the caller is, and each RPC binds what it may do to that name. This
//! module is pure: it reads the URI SANs of a certificate, names the caller
//! and decides; [`crate::guard`] applies it to the gRPC services.

use rustls::pki_types::CertificateDer;
use x509_parser::error::X509Error;
use x509_parser::extensions::GeneralName;

/// The URI scheme of BigFleet identities; other URI SANs are not ours.
pub const SCHEME: &str = "bigfleet://";
/// bigfleetctl, operators and this provider's own `ctl`.
pub const ADMIN: &str = "bigfleet://admin";
/// Read-only tooling: Get and List only.
pub const READONLY: &str = "bigfleet://readonly";
/// `bigfleet://shard/<shard_id>`: a shard, for its own `shard_id` only.
pub const SHARD_PREFIX: &str = "bigfleet://shard/";
/// `bigfleet://cluster/<cluster_id>`: cluster operators, who never talk to
/// providers.
pub const CLUSTER_PREFIX: &str = "bigfleet://cluster/";

/// `--tls-client-identity`: what a verified client certificate must say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientIdentityMode {
    /// The certificate's `bigfleet://` URI SAN decides what it may call.
    Bigfleet,
    /// Any certificate that chains to `--tls-ca` may call anything (for
    /// client certificates that carry no `bigfleet://` URI SAN yet).
    Any,
}

/// How the listener treats caller identity; also the start-up line's
/// `client_identity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityCheck {
    /// mTLS, and every RPC is bound to the certificate's identity.
    Bigfleet,
    /// mTLS with `--tls-client-identity any`: the chain alone is checked.
    ChainOnly,
    /// Plaintext or server-only TLS: there is no verified client
    /// certificate, so there is no identity to check ("identity is only as
    /// strong as the transport").
    Off,
}

impl IdentityCheck {
    /// The check for a listener: identities exist only under mTLS.
    pub fn new(mtls: bool, mode: ClientIdentityMode) -> IdentityCheck {
        match (mtls, mode) {
            (false, _) => IdentityCheck::Off,
            (true, ClientIdentityMode::Bigfleet) => IdentityCheck::Bigfleet,
            (true, ClientIdentityMode::Any) => IdentityCheck::ChainOnly,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            IdentityCheck::Bigfleet => "bigfleet",
            IdentityCheck::ChainOnly => "any",
            IdentityCheck::Off => "off",
        }
    }
}

/// Who a certificate says the caller is, among the identities that may
/// call a provider at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// `bigfleet://shard/<shard_id>`.
    Shard(String),
    /// `bigfleet://admin`.
    Admin,
    /// `bigfleet://readonly`.
    Readonly,
}

impl Caller {
    fn uri(&self) -> String {
        match self {
            Caller::Shard(id) => format!("{SHARD_PREFIX}{id}"),
            Caller::Admin => ADMIN.to_owned(),
            Caller::Readonly => READONLY.to_owned(),
        }
    }
}

/// What an RPC needs of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need<'a> {
    /// A CapacityProvider mutation: the shard named by the request's
    /// `shard_id` (empty: no fencing token), or an admin.
    ActFor { shard_id: &'a str },
    /// Get and List: any shard, an admin or read-only tooling.
    Read,
    /// The Admin service: an admin only.
    Admin,
}

/// Why a caller was refused; the `reason` label of
/// `bigfleet_proxmox_identity_rejected_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The certificate carries no `bigfleet://` URI SAN (or could not be read).
    NoIdentity,
    /// The certificate carries more than one `bigfleet://` URI SAN.
    SeveralIdentities,
    /// A `bigfleet://cluster/…` identity: cluster operators never call providers.
    ClusterIdentity,
    /// A `bigfleet://` URI that names no role BigFleet defines.
    UnknownRole,
    /// A known role this RPC does not admit (read-only mutating, a shard reclaiming).
    NotPermitted,
    /// A shard acting for another `shard_id`.
    WrongShard,
    /// A shard's mutation without a fencing token (a shard always stamps one).
    NoToken,
}

impl Reason {
    /// Refusals any RPC can meet: the certificate names no usable identity.
    pub const UNIDENTIFIED: [Reason; 4] = [
        Reason::NoIdentity,
        Reason::SeveralIdentities,
        Reason::ClusterIdentity,
        Reason::UnknownRole,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Reason::NoIdentity => "no_identity",
            Reason::SeveralIdentities => "several_identities",
            Reason::ClusterIdentity => "cluster_identity",
            Reason::UnknownRole => "unknown_role",
            Reason::NotPermitted => "not_permitted",
            Reason::WrongShard => "wrong_shard",
            Reason::NoToken => "no_token",
        }
    }

    /// Every reason `rpc` can be refused for (the series that exist from
    /// the first scrape).
    pub fn possible_for(need: Need<'_>) -> Vec<Reason> {
        let mut out = Reason::UNIDENTIFIED.to_vec();
        match need {
            Need::ActFor { .. } => {
                out.extend([Reason::NotPermitted, Reason::WrongShard, Reason::NoToken])
            }
            Need::Admin => out.push(Reason::NotPermitted),
            Need::Read => {}
        }
        out
    }
}

/// A certificate whose identity could not be read. rustls has verified its
/// chain, so this is a certificate our parser does not understand.
#[derive(Debug, thiserror::Error)]
#[error("the client certificate could not be parsed: {0}")]
pub struct UnreadableCertificate(#[source] X509Error);

/// The `bigfleet://` URI SANs of a certificate (the scheme matched without
/// regard to case, as URI schemes are, and written lower-case).
pub fn bigfleet_uris(cert: &CertificateDer<'_>) -> Result<Vec<String>, UnreadableCertificate> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| {
        UnreadableCertificate(match e {
            x509_parser::nom::Err::Error(e) | x509_parser::nom::Err::Failure(e) => e,
            x509_parser::nom::Err::Incomplete(_) => X509Error::InvalidCertificate,
        })
    })?;
    let san = parsed
        .subject_alternative_name()
        .map_err(UnreadableCertificate)?;
    let Some(san) = san else {
        return Ok(Vec::new());
    };
    Ok(san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => normalize(uri),
            _ => None,
        })
        .collect())
}

fn normalize(uri: &str) -> Option<String> {
    let scheme = uri.get(..SCHEME.len())?;
    scheme
        .eq_ignore_ascii_case(SCHEME)
        .then(|| format!("{SCHEME}{}", &uri[SCHEME.len()..]))
}

/// Characters of a certificate's URI kept in a message or a log line.
const URI_CHARS: usize = 128;

fn clip(text: &str) -> String {
    match text.char_indices().nth(URI_CHARS) {
        None => text.to_owned(),
        Some((end, _)) => format!("{}...", &text[..end]),
    }
}

/// A refusal: why, the identity seen and the one needed. Its `Display` is
/// the PERMISSION_DENIED message.
#[derive(Debug, thiserror::Error)]
#[error("caller identity {seen} may not {action}: needs {needed}")]
pub struct Refusal {
    pub reason: Reason,
    /// The identity as the certificate gave it (or why there is none).
    pub seen: String,
    action: String,
    needed: String,
    #[source]
    cause: Option<UnreadableCertificate>,
}

impl Refusal {
    fn new(reason: Reason, seen: String, rpc: &str, need: Need<'_>) -> Refusal {
        let (action, needed) = match need {
            Need::ActFor { shard_id: "" } => (
                format!("call {rpc} without a fencing token"),
                format!(
                    "{ADMIN} (a shard stamps every mutation with its token, so its shard_id is \
                     never empty)"
                ),
            ),
            Need::ActFor { shard_id } => (
                format!(
                    "act for shard_id {}",
                    providerkit::engine::echo_prefix(shard_id)
                ),
                format!("{SHARD_PREFIX}{} or {ADMIN}", clip(shard_id)),
            ),
            Need::Read => (
                format!("call {rpc}"),
                format!("{SHARD_PREFIX}<shard_id>, {ADMIN} or {READONLY}"),
            ),
            Need::Admin => (format!("call {rpc}"), ADMIN.to_owned()),
        };
        Refusal {
            reason,
            seen,
            action,
            needed,
            cause: None,
        }
    }
}

/// Names the caller from the `bigfleet://` URIs of its certificate.
pub fn identify(uris: &[String]) -> Result<Caller, (Reason, String)> {
    let uri = match uris {
        [] => {
            return Err((
                Reason::NoIdentity,
                "none (the client certificate carries no bigfleet:// URI SAN)".to_owned(),
            ))
        }
        [one] => one.as_str(),
        several => {
            let listed: Vec<String> = several.iter().map(|u| clip(u)).collect();
            return Err((
                Reason::SeveralIdentities,
                format!(
                    "ambiguous ({} bigfleet:// URI SANs: {})",
                    several.len(),
                    listed.join(", ")
                ),
            ));
        }
    };
    match uri {
        ADMIN => Ok(Caller::Admin),
        READONLY => Ok(Caller::Readonly),
        _ => match uri.strip_prefix(SHARD_PREFIX) {
            Some(id) if !id.is_empty() => Ok(Caller::Shard(id.to_owned())),
            _ if uri.starts_with(CLUSTER_PREFIX) => Err((Reason::ClusterIdentity, clip(uri))),
            _ => Err((Reason::UnknownRole, clip(uri))),
        },
    }
}

/// Whether `caller` may make the call `rpc` that needs `need`; the reason
/// and the message when not.
pub fn authorize(caller: &Caller, rpc: &str, need: Need<'_>) -> Result<(), Refusal> {
    let refuse = |reason| Err(Refusal::new(reason, caller.uri(), rpc, need));
    match (caller, need) {
        (Caller::Admin, _) => Ok(()),
        (Caller::Shard(_) | Caller::Readonly, Need::Read) => Ok(()),
        (Caller::Shard(_) | Caller::Readonly, Need::Admin) => refuse(Reason::NotPermitted),
        (Caller::Readonly, Need::ActFor { .. }) => refuse(Reason::NotPermitted),
        (Caller::Shard(_), Need::ActFor { shard_id: "" }) => refuse(Reason::NoToken),
        (Caller::Shard(own), Need::ActFor { shard_id }) if own == shard_id => Ok(()),
        (Caller::Shard(_), Need::ActFor { .. }) => refuse(Reason::WrongShard),
    }
}

/// The refusal of a call that presented no certificate at all.
pub fn anonymous(rpc: &str, need: Need<'_>) -> Refusal {
    Refusal::new(
        Reason::NoIdentity,
        "none (no client certificate)".to_owned(),
        rpc,
        need,
    )
}

/// Whether the certificate's caller may make the mutation `rpc` for some
/// shard: an admin or a shard may (the request's `shard_id` decides, once
/// read); read-only tooling and a certificate without a usable identity
/// may not, whatever the body says.
pub fn may_act_for_some_shard(leaf: &CertificateDer<'_>, rpc: &str) -> Result<(), Refusal> {
    let need = Need::ActFor { shard_id: "" };
    let uris = bigfleet_uris(leaf).map_err(|cause| Refusal {
        cause: Some(cause),
        ..Refusal::new(
            Reason::NoIdentity,
            "none (the client certificate could not be parsed)".to_owned(),
            rpc,
            need,
        )
    })?;
    match identify(&uris).map_err(|(reason, seen)| Refusal::new(reason, seen, rpc, need))? {
        Caller::Admin | Caller::Shard(_) => Ok(()),
        readonly @ Caller::Readonly => Err(Refusal {
            reason: Reason::NotPermitted,
            seen: readonly.uri(),
            action: format!("call {rpc}, a mutation"),
            needed: format!("{SHARD_PREFIX}<the request's shard_id> or {ADMIN}"),
            cause: None,
        }),
    }
}

/// The whole decision for a verified leaf certificate.
pub fn check(leaf: &CertificateDer<'_>, rpc: &str, need: Need<'_>) -> Result<(), Refusal> {
    let uris = bigfleet_uris(leaf).map_err(|cause| Refusal {
        cause: Some(cause),
        ..Refusal::new(
            Reason::NoIdentity,
            "none (the client certificate could not be parsed)".to_owned(),
            rpc,
            need,
        )
    })?;
    let caller = identify(&uris).map_err(|(reason, seen)| Refusal::new(reason, seen, rpc, need))?;
    authorize(&caller, rpc, need)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uris(list: &[&str]) -> Vec<String> {
        list.iter().map(|u| u.to_string()).collect()
    }

    fn cert(sans: &[&str]) -> CertificateDer<'static> {
        let mut params = rcgen::CertificateParams::new(vec!["client.test".to_owned()])
            .unwrap_or_else(|e| panic!("params: {e}"));
        for san in sans {
            let uri =
                rcgen::string::Ia5String::try_from(*san).unwrap_or_else(|e| panic!("{san}: {e}"));
            params.subject_alt_names.push(rcgen::SanType::URI(uri));
        }
        let key = rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("key: {e}"));
        params
            .self_signed(&key)
            .unwrap_or_else(|e| panic!("sign: {e}"))
            .der()
            .clone()
    }

    #[test]
    fn only_bigfleet_uris_count_and_the_scheme_is_case_insensitive() {
        let c = cert(&[
            "spiffe://example/x",
            "BigFleet://shard/a",
            "https://bigfleet/admin",
        ]);
        assert_eq!(
            bigfleet_uris(&c).map_err(|e| e.to_string()),
            Ok(uris(&["bigfleet://shard/a"]))
        );
        assert_eq!(
            bigfleet_uris(&cert(&[])).map_err(|e| e.to_string()),
            Ok(vec![])
        );
        let junk = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01]);
        assert!(bigfleet_uris(&junk).is_err());
    }

    #[test]
    fn identities_are_named_or_refused() {
        assert_eq!(identify(&uris(&[ADMIN])), Ok(Caller::Admin));
        assert_eq!(identify(&uris(&[READONLY])), Ok(Caller::Readonly));
        assert_eq!(
            identify(&uris(&["bigfleet://shard/a/b"])),
            Ok(Caller::Shard("a/b".into()))
        );
        let reason = |list: &[&str]| identify(&uris(list)).map_err(|(r, _)| r);
        assert_eq!(reason(&[]), Err(Reason::NoIdentity));
        assert_eq!(reason(&[ADMIN, READONLY]), Err(Reason::SeveralIdentities));
        assert_eq!(reason(&[ADMIN, ADMIN]), Err(Reason::SeveralIdentities));
        assert_eq!(
            reason(&["bigfleet://cluster/c1"]),
            Err(Reason::ClusterIdentity)
        );
        assert_eq!(reason(&["bigfleet://operator"]), Err(Reason::UnknownRole));
        assert_eq!(reason(&["bigfleet://shard/"]), Err(Reason::UnknownRole));
        assert_eq!(reason(&["bigfleet://admin/x"]), Err(Reason::UnknownRole));
    }

    #[test]
    fn bindings() {
        let a = Caller::Shard("a".into());
        let ok = |c: &Caller, need| authorize(c, "X", need).map_err(|r| r.reason);
        let act = |shard_id| Need::ActFor { shard_id };
        assert_eq!(ok(&a, act("a")), Ok(()));
        assert_eq!(ok(&a, act("b")), Err(Reason::WrongShard));
        assert_eq!(ok(&a, act("")), Err(Reason::NoToken));
        assert_eq!(ok(&a, Need::Read), Ok(()));
        assert_eq!(ok(&a, Need::Admin), Err(Reason::NotPermitted));
        assert_eq!(ok(&Caller::Readonly, Need::Read), Ok(()));
        assert_eq!(ok(&Caller::Readonly, act("a")), Err(Reason::NotPermitted));
        assert_eq!(ok(&Caller::Readonly, act("")), Err(Reason::NotPermitted));
        assert_eq!(
            ok(&Caller::Readonly, Need::Admin),
            Err(Reason::NotPermitted)
        );
        for need in [act("a"), act(""), Need::Read, Need::Admin] {
            assert_eq!(ok(&Caller::Admin, need), Ok(()));
        }
    }

    #[test]
    fn the_message_names_the_identity_seen_and_the_one_needed() {
        let refusal = authorize(
            &Caller::Shard("a".into()),
            "Create",
            Need::ActFor { shard_id: "b" },
        )
        .expect_err("another shard");
        assert_eq!(
            refusal.to_string(),
            "caller identity bigfleet://shard/a may not act for shard_id \"b\": \
             needs bigfleet://shard/b or bigfleet://admin"
        );
        let refusal = check(&cert(&["bigfleet://cluster/c1"]), "List", Need::Read)
            .expect_err("a cluster identity");
        assert_eq!(refusal.reason, Reason::ClusterIdentity);
        assert_eq!(
            refusal.to_string(),
            "caller identity bigfleet://cluster/c1 may not call List: needs \
             bigfleet://shard/<shard_id>, bigfleet://admin or bigfleet://readonly"
        );
        let refusal = check(&cert(&[]), "Reclaim", Need::Admin).expect_err("no identity");
        assert_eq!(
            refusal.to_string(),
            "caller identity none (the client certificate carries no bigfleet:// URI SAN) \
             may not call Reclaim: needs bigfleet://admin"
        );
        // A long shard_id from the request is cut in the message.
        let long = "s".repeat(4096);
        let refusal = authorize(
            &Caller::Readonly,
            "Create",
            Need::ActFor { shard_id: &long },
        )
        .expect_err("read-only");
        assert!(refusal.to_string().len() < 1024, "{}", refusal);
    }

    #[test]
    fn every_reason_a_need_meets_is_listed() {
        assert_eq!(
            Reason::possible_for(Need::Read),
            Reason::UNIDENTIFIED.to_vec()
        );
        assert!(Reason::possible_for(Need::Admin).contains(&Reason::NotPermitted));
        assert!(Reason::possible_for(Need::ActFor { shard_id: "" }).contains(&Reason::NoToken));
    }
}
