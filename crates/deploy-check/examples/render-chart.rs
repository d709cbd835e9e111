//! Prints the chart's manifests for a values file, like `helm template`:
//! `cargo run -p deploy-check --example render-chart -- [VALUES.yaml]`;
//! or, with `--out DIR` (what `make chart-render` runs), writes one file per
//! value set the `kubernetes_validate` test checks: `default.yaml` and one
//! per values example in docs/.

use std::path::Path;
use std::process::ExitCode;

use deploy_check::helm::{Chart, Release};
use deploy_check::{manifests, workspace_root};

fn main() -> ExitCode {
    let chart = match Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, out] if flag == "--out" => write_all(&chart, Path::new(out)),
        [] => print(&chart, None),
        [values] if !values.starts_with("--") => print(&chart, Some(values)),
        _ => {
            eprintln!("usage: render-chart [VALUES.yaml] | render-chart --out DIR");
            ExitCode::from(2)
        }
    }
}

fn write_all(chart: &Chart, out: &Path) -> ExitCode {
    match manifests::write(chart, &workspace_root(), out) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print(chart: &Chart, values: Option<&str>) -> ExitCode {
    let overrides = match values {
        None => serde_yaml::Value::Mapping(Default::default()),
        Some(path) => match std::fs::read_to_string(path)
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
