//! What several of these checks read from the workspace itself.

use deploy_check::workspace_root;

/// A `[workspace.package]` field of the root Cargo.toml (`version`,
/// `license`): what the image labels and the chart must agree with.
pub fn workspace_package_field(key: &str) -> String {
    let cargo = std::fs::read_to_string(workspace_root().join("Cargo.toml"))
        .unwrap_or_else(|e| panic!("the workspace Cargo.toml: {e}"));
    cargo
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key} = ")))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("the workspace Cargo.toml has no `{key} = ` line"))
}
