//! TLS trust modes against real in-test HTTPS servers.

use std::error::Error as _;

use pve::{format_fingerprint, parse_fingerprints, PveClient, PveError};
use serde_json::json;

use crate::common::*;

fn nextid_server() -> impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static {
    |_r, _n| ok(json!("100"))
}

fn assert_tls_err(e: &PveError, needle: &str) {
    match e {
        PveError::Tls { message, .. } => {
            assert!(
                message.contains(needle),
                "TLS error {message:?} lacks {needle:?}"
            );
            // The rustls error itself is the cause, with the same text.
            let cause = e
                .source()
                .and_then(|s| s.downcast_ref::<rustls::Error>())
                .unwrap_or_else(|| panic!("TLS error without a rustls cause: {e:?}"));
            assert_eq!(&cause.to_string(), message);
        }
        other => panic!("expected a TLS error, got {other:?}"),
    }
}

#[tokio::test]
async fn ca_mode_accepts_chain_with_matching_hostname() {
    let ca = Ca::new("pve root CA");
    let srv = serve(&ca.leaf(&["localhost"]), nextid_server()).await;
    let (c, _) = client(&srv.url(), Some(ca.pem()), vec![]);
    assert_eq!(c.next_id(None).await.unwrap(), 100);
}

#[tokio::test]
async fn ca_mode_rejects_other_ca() {
    let ca = Ca::new("pve root CA");
    let other = Ca::new("attacker CA");
    let srv = serve(&ca.leaf(&["localhost"]), nextid_server()).await;
    let (c, calls) = client(&srv.url(), Some(other.pem()), vec![]);
    let e = c.next_id(None).await.unwrap_err();
    assert_tls_err(&e, "UnknownIssuer");
    // A TLS failure does not heal: never retried, and nothing reached the app.
    assert_eq!(last_call(&calls), ("nextid".into(), false, 1));
    assert!(srv.recorded().is_empty());
}

#[tokio::test]
async fn ca_mode_rejects_wrong_hostname() {
    let ca = Ca::new("pve root CA");
    let srv = serve(&ca.leaf(&["pve1.invalid"]), nextid_server()).await;
    let (c, _) = client(&srv.url(), Some(ca.pem()), vec![]);
    let e = c.next_id(None).await.unwrap_err();
    assert_tls_err(&e, "not valid for name");
}

#[tokio::test]
async fn pin_mode_accepts_matching_pin_without_hostname_check() {
    // PVE's self-signed leaf often lacks the name the API is reached by.
    let leaf = self_signed_leaf(&["pve1.invalid"]);
    let fp = leaf.fingerprint();
    let srv = serve(&leaf, nextid_server()).await;
    let (c, _) = client(&srv.url(), None, vec![fp]);
    assert_eq!(c.next_id(None).await.unwrap(), 100);

    // Also when listed after another pin (renewal pre-pinned), in lower-case bare hex.
    let list = format!(
        "{}, {}",
        format_fingerprint(&[0x11; 32]),
        hex::encode(fp).to_lowercase()
    );
    let (c, _) = client(&srv.url(), None, parse_fingerprints(&list).unwrap());
    assert_eq!(c.next_id(None).await.unwrap(), 100);
}

#[tokio::test]
async fn pinned_cert_without_its_private_key_is_rejected() {
    // The pin matches, but the server signs the handshake with another key: the
    // handshake signature check must still fail.
    for pins in [true, false] {
        let ca = Ca::new("pve root CA");
        let leaf = ca.leaf(&["localhost"]);
        let impostor = self_signed_leaf(&["localhost"]);
        let srv = serve_with_wrong_key(&leaf, &impostor.key_der, nextid_server()).await;
        let (c, _) = if pins {
            client(&srv.url(), None, vec![leaf.fingerprint()])
        } else {
            client(&srv.url(), Some(ca.pem()), vec![])
        };
        let e = c.next_id(None).await.unwrap_err();
        assert!(e.is_tls(), "pins={pins}: {e:?}");
        assert!(srv.recorded().is_empty());
    }
}

#[tokio::test]
async fn pin_mode_rejects_wrong_pin() {
    let leaf = self_signed_leaf(&["localhost"]);
    let srv = serve(&leaf, nextid_server()).await;
    let (c, calls) = client(&srv.url(), None, vec![[0x22; 32], [0x33; 32]]);
    let e = c.next_id(None).await.unwrap_err();
    assert_tls_err(&e, "matches none of the 2 pinned");
    assert!(e
        .to_string()
        .contains(&format_fingerprint(&leaf.fingerprint())));
    assert_eq!(last_call(&calls).2, 1);
    assert!(srv.recorded().is_empty());
}

#[tokio::test]
async fn both_modes_must_hold() {
    let ca = Ca::new("pve root CA");
    let other = Ca::new("other CA");
    let leaf = ca.leaf(&["localhost"]);
    let fp = leaf.fingerprint();
    let srv = serve(&leaf, nextid_server()).await;

    let (c, _) = client(&srv.url(), Some(ca.pem()), vec![fp]);
    assert_eq!(c.next_id(None).await.unwrap(), 100);

    let (c, _) = client(&srv.url(), Some(ca.pem()), vec![[0x44; 32]]);
    assert_tls_err(&c.next_id(None).await.unwrap_err(), "matches none");

    let (c, _) = client(&srv.url(), Some(other.pem()), vec![fp]);
    assert_tls_err(&c.next_id(None).await.unwrap_err(), "UnknownIssuer");

    // Right CA and pin, but the hostname is still checked when a CA is given.
    let leaf2 = ca.leaf(&["pve1.invalid"]);
    let srv2 = serve(&leaf2, nextid_server()).await;
    let (c, _) = client(&srv2.url(), Some(ca.pem()), vec![leaf2.fingerprint()]);
    assert_tls_err(&c.next_id(None).await.unwrap_err(), "not valid for name");
}

#[test]
fn construction_requires_trust_material_and_https() {
    let (cfg, _) = config("https://localhost:8006/api2/json", None, vec![]);
    let e = PveClient::new(cfg).unwrap_err();
    assert!(
        e.to_string()
            .contains("TLS verification material is required"),
        "{e}"
    );

    let (cfg, _) = config("http://localhost:8006/api2/json", None, vec![[1; 32]]);
    assert!(PveClient::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("must use https"));

    let (mut cfg, _) = config("https://localhost:8006/api2/json", None, vec![[1; 32]]);
    cfg.token_id = "no-realm".into();
    assert!(PveClient::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("USER@REALM!TOKENID"));

    let (mut cfg, _) = config("https://localhost:8006/api2/json", None, vec![[1; 32]]);
    cfg.token_secret = "bad\nsecret-xyz".into();
    let e = PveClient::new(cfg).unwrap_err().to_string();
    assert!(
        e.contains("not allowed in an HTTP header") && !e.contains("secret-xyz"),
        "{e}"
    );

    let (cfg, _) = config(
        "https://localhost:8006/api2/json",
        Some(b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n".to_vec()),
        vec![],
    );
    assert!(PveClient::new(cfg).is_err());
}
