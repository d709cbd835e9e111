//! Prints the chart's manifests for a values file, like `helm template`:
//! `cargo run -p deploy-check --example render-chart -- [VALUES.yaml]`.

use std::process::ExitCode;

use deploy_check::helm::{Chart, Release};
use deploy_check::workspace_root;

fn main() -> ExitCode {
    let chart = match Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let overrides = match std::env::args().nth(1) {
        None => serde_yaml::Value::Mapping(Default::default()),
        Some(path) => match std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_yaml::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(v) => v,
            Err(e) => {
                eprintln!("error: reading values {path}: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    match chart.render(&overrides, &Release::default()) {
        Ok(docs) => {
            for d in docs {
                println!(
                    "---\n# Source: bigfleet-proxmox/templates/{}\n{}",
                    d.template,
                    d.yaml.trim_end()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
