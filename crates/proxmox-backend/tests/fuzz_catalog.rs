//! Property tests (the fuzz targets) for the files and strings the backend
//! parses from outside: the offerings and instance-types files, the price
//! list and the VM description marker. Arbitrary input never panics (a bad
//! file is an error that names it); what is written can be read back.
//!
//! CI runs a few cases per property; `make fuzz` runs many
//! (`PROPTEST_CASES=100000`).

use std::io::Write;

use proptest::prelude::*;
use provider_testkit::fuzz::{config, JsonShape};
use proxmox_backend::catalog::{load_instance_types, load_offerings, parse_prices};
use proxmox_backend::proxmox::{marker_description, parse_marker};

/// Catalog-shaped JSON: objects with the field names the catalog files
/// use, holding values of every JSON kind.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    JsonShape {
        keys: &[
            "instance_type",
            "zone",
            "count",
            "capacity_type",
            "resources",
            "labels",
            "vcpu",
            "memory_mib",
            "template_vmid",
            "pve.small",
            "x",
        ],
        strings: &[".{0,16}"],
        max_members: 7,
        expected_branch_size: 6,
    }
    .values()
}

fn with_file(text: &str, f: impl FnOnce(&std::path::Path)) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    f(file.path());
}

fn check_files(text: &str) -> Result<(), TestCaseError> {
    let mut result = Ok(());
    with_file(text, |path| {
        let name = path.display().to_string();
        if let Err(e) = load_offerings(path).map_err(|e| e.to_string()) {
            if !e.contains(&name) {
                result = Err(TestCaseError::fail(format!(
                    "offerings error names no file: {e}"
                )));
            }
        }
        if let Err(e) = load_instance_types(path, 9000).map_err(|e| e.to_string()) {
            if e.starts_with("--instance-types") && !e.contains(&name) {
                result = Err(TestCaseError::fail(format!(
                    "instance-types error names no file: {e}"
                )));
            }
        }
    });
    result
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn catalog_files_of_any_json_shape_never_panic(value in json_value()) {
        check_files(&value.to_string())?;
        check_files(&format!("[{value}]"))?;
    }

    #[test]
    fn catalog_files_of_any_text_never_panic(text in ".{0,200}") {
        check_files(&text)?;
    }

    #[test]
    fn price_lists_never_panic(text in "([a-z.]{0,8}=?[-0-9.eE]{0,8},?){0,6}|.{0,60}") {
        let _ = parse_prices(&text);
    }

    #[test]
    fn markers_never_panic_and_round_trip(
        junk in ".{0,80}",
        id in "[!-~]{1,64}",
        op in "[!-~]{0,32}",
    ) {
        let _ = parse_marker(&junk);
        prop_assume!(!id.contains("machine_id="));
        let description = marker_description(&id, &op);
        prop_assert_eq!(parse_marker(&description), Some(id));
    }
}
