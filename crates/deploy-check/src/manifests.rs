//! The chart's rendered manifests as operators' own tools see them: one
//! multi-document file for the chart's defaults, one for three replicas on
//! PostgreSQL, and one per values example in `docs/` (what `make chart-render` writes and the `kubernetes_validate`
//! test validates), and the Kubernetes minor versions the chart claims in
//! its `kubeVersion`.

use std::path::{Path, PathBuf};

use crate::helm::{self, merge, Chart, Release};

/// The only values the chart cannot render without (the real backend's API,
/// token and trust); everything else stays at its default.
pub const REQUIRED_VALUES: &str = "\
proxmox:
  apiURL: https://pve1.example.internal:8006/api2/json
  tokenID: bigfleet@pve!autoscaler
  nodes: [pve1]
credentials:
  token: {secretName: pve-token}
  ca: {secretName: pve-ca}
";

/// High availability on PostgreSQL, over [`REQUIRED_VALUES`]: three
/// replicas (a rolling update, pod anti-affinity, and the opt-in
/// PodDisruptionBudget), the password and CloudNativePG's CA Secret
/// mounted, no PVC.
pub const POSTGRES_HA_VALUES: &str = "\
replicaCount: 3
podDisruptionBudget: {enabled: true}
state:
  postgres:
    url: postgres://bigfleet@pg-rw.databases.svc:5432/bigfleet?sslmode=verify-full
    password: {secretName: pg-app, secretKey: password}
    ca: {secretName: pg-ca}
    leaseTTL: 8s
";

/// Why the manifests could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error(transparent)]
    Chart(#[from] helm::Error),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{at}: the YAML does not parse: {source}")]
    Yaml {
        at: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{at}: rendering these values: {source}")]
    Render {
        at: String,
        #[source]
        source: helm::Error,
    },
    #[error("docs/install.md has no values example to build the other examples on")]
    NoBaseExample,
    #[error(
        "Chart.yaml's kubeVersion {value:?} {reason}; write it as a closed range of \
         minor versions, `>=1.A.0-0 <1.B.0-0`"
    )]
    KubeVersion { value: String, reason: &'static str },
}

/// One set of values the manifests are rendered with.
#[derive(Debug, Clone)]
pub struct ValueSet {
    /// The file stem: `default`, or `<page>-<n>` for the n-th values
    /// example of `docs/<page>.md`.
    pub name: String,
    /// Where the values come from, for the file's header.
    pub from: String,
    pub values: serde_yaml::Value,
}

/// Fenced code blocks of a markdown page: (language, body, line of the body).
pub fn fences(markdown: &str) -> Vec<(String, String, usize)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String, usize)> = None;
    for (n, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(lang) = trimmed.strip_prefix("```") {
            match current.take() {
                Some(block) => out.push(block),
                None => current = Some((lang.trim().to_owned(), String::new(), n + 2)),
            }
        } else if let Some((_, body, _)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

fn docs_pages(root: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let dir = root.join("docs");
    let read_error = |source| ManifestError::Read {
        path: dir.clone(),
        source,
    };
    let mut pages = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(read_error)? {
        let path = entry.map_err(read_error)?.path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    Ok(pages)
}

/// Whether a YAML block is chart values: a mapping whose every key is a
/// top-level key of the chart's values.yaml (scrape configs and rule
/// excerpts are not).
fn is_values_example(chart: &Chart, block: &serde_yaml::Value) -> bool {
    let (Some(block), Some(defaults)) = (block.as_mapping(), chart.values.as_mapping()) else {
        return false;
    };
    !block.is_empty() && block.keys().all(|k| defaults.contains_key(k))
}

/// The chart's defaults (with [`REQUIRED_VALUES`]), then every values
/// example of `docs/*.md` in page order. An example is merged over the first
/// one of install.md (its "minimal production values.yaml"), as the docs
/// mean the later fragments to be read.
pub fn value_sets(chart: &Chart, root: &Path) -> Result<Vec<ValueSet>, ManifestError> {
    let parse = |at: &str, text: &str| {
        serde_yaml::from_str::<serde_yaml::Value>(text).map_err(|source| ManifestError::Yaml {
            at: at.to_owned(),
            source,
        })
    };
    let mut examples = Vec::new();
    for page in docs_pages(root)? {
        let text = std::fs::read_to_string(&page).map_err(|source| ManifestError::Read {
            path: page.clone(),
            source,
        })?;
        let file = page
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let stem = file.trim_end_matches(".md").to_owned();
        let mut n = 0;
        for (lang, body, line) in fences(&text) {
            if lang != "yaml" {
                continue;
            }
            let at = format!("docs/{file}:{line}");
            let values = parse(&at, &body)?;
            if !is_values_example(chart, &values) {
                continue;
            }
            n += 1;
            examples.push(ValueSet {
                name: format!("{stem}-{n}"),
                from: at,
                values,
            });
        }
    }
    let base = examples
        .iter()
        .find(|e| e.name == "install-1")
        .map(|e| e.values.clone())
        .ok_or(ManifestError::NoBaseExample)?;
    let required = parse("REQUIRED_VALUES", REQUIRED_VALUES)?;
    let mut postgres_ha = required.clone();
    merge(
        &mut postgres_ha,
        &parse("POSTGRES_HA_VALUES", POSTGRES_HA_VALUES)?,
    );
    let mut sets = vec![
        ValueSet {
            name: "default".to_owned(),
            from: "the chart's values.yaml, with only the values it requires set".to_owned(),
            values: required,
        },
        ValueSet {
            name: "postgres-ha".to_owned(),
            from: "three replicas on PostgreSQL (deploy-check's POSTGRES_HA_VALUES)".to_owned(),
            values: postgres_ha,
        },
    ];
    for mut example in examples {
        if example.name != "install-1" {
            let mut merged = base.clone();
            merge(&mut merged, &example.values);
            example.values = merged;
            example.from = format!("{} over docs/install.md's values example", example.from);
        }
        sets.push(example);
    }
    Ok(sets)
}

/// The manifests of one value set as `helm template` prints them.
pub fn render(chart: &Chart, set: &ValueSet) -> Result<String, ManifestError> {
    let documents = chart
        .render(&set.values, &Release::default())
        .map_err(|source| ManifestError::Render {
            at: set.from.clone(),
            source,
        })?;
    let mut out = format!("# Rendered from {}\n", set.from);
    for d in documents {
        out.push_str(&format!(
            "---\n# Source: bigfleet-proxmox/templates/{}\n{}\n",
            d.template,
            d.yaml.trim_end()
        ));
    }
    Ok(out)
}

/// Writes `<name>.yaml` for every value set into `out` (created if need
/// be) and returns the files in value-set order.
pub fn write(chart: &Chart, root: &Path, out: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    std::fs::create_dir_all(out).map_err(|source| ManifestError::Write {
        path: out.to_owned(),
        source,
    })?;
    let mut files = Vec::new();
    for set in value_sets(chart, root)? {
        let path = out.join(format!("{}.yaml", set.name));
        std::fs::write(&path, render(chart, &set)?).map_err(|source| ManifestError::Write {
            path: path.clone(),
            source,
        })?;
        files.push(path);
    }
    Ok(files)
}

/// `1.M.P[-pre]` as (M, P, whether a pre-release suffix is present).
fn kube_version(text: &str) -> Option<(u32, u32, bool)> {
    let (numbers, pre) = match text.split_once('-') {
        Some((n, pre)) => (n, Some(pre)),
        None => (text, None),
    };
    let mut parts = numbers.split('.');
    let (major, minor, patch) = (parts.next()?, parts.next()?, parts.next()?);
    if major != "1" || parts.next().is_some() {
        return None;
    }
    Some((minor.parse().ok()?, patch.parse().ok()?, pre.is_some()))
}

/// The Kubernetes minor versions (`1.M`) the chart's `kubeVersion` admits.
/// Only a closed range `>=1.A.0-0 <1.B.0-0` is read: an open one would claim
/// versions nobody has validated, and the `-0` suffixes make helm admit the
/// pre-release builds cloud providers ship (`1.30.2-gke.1`).
pub fn claimed_kube_minors(chart: &Chart) -> Result<Vec<u32>, ManifestError> {
    let value = chart
        .metadata
        .get("kubeVersion")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned();
    let fail = |reason| ManifestError::KubeVersion {
        value: value.clone(),
        reason,
    };
    let terms: Vec<&str> = value.split_whitespace().collect();
    let [low, high] = terms[..] else {
        return Err(fail("is not two bounds"));
    };
    let (Some(low), Some(high)) = (low.strip_prefix(">="), high.strip_prefix('<')) else {
        return Err(fail("is not `>=` a lower bound and `<` an upper bound"));
    };
    let (Some(low), Some(high)) = (kube_version(low), kube_version(high)) else {
        return Err(fail("has a bound that is not a Kubernetes 1.x version"));
    };
    if low.1 != 0 || high.1 != 0 || !low.2 || !high.2 {
        return Err(fail("has a bound that is not `1.M.0-0`"));
    }
    if low.0 >= high.0 {
        return Err(fail("admits no version"));
    }
    Ok((low.0..high.0).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart_with(kube_version: &str) -> Chart {
        let mut chart = Chart::load(&crate::workspace_root().join("deploy/helm/bigfleet-proxmox"))
            .expect("the chart loads");
        chart
            .metadata
            .insert("kubeVersion".into(), kube_version.into());
        chart
    }

    #[test]
    fn claimed_minors_come_from_a_closed_range() {
        assert_eq!(
            claimed_kube_minors(&chart_with(">=1.25.0-0 <1.28.0-0")).expect("closed"),
            [25, 26, 27]
        );
        for bad in [
            ">=1.25.0-0",
            ">=1.25.0-0 <=1.28.0-0",
            ">=1.25.0 <1.28.0-0",
            ">=1.25.3-0 <1.28.0-0",
            ">=2.0.0-0 <2.1.0-0",
            ">=1.28.0-0 <1.25.0-0",
            "",
        ] {
            assert!(
                claimed_kube_minors(&chart_with(bad)).is_err(),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn fences_keep_the_language_and_the_line() {
        let md = "text\n```yaml\na: 1\n```\n\n```sh\nls\n```\n";
        assert_eq!(
            fences(md),
            [
                ("yaml".to_owned(), "a: 1\n".to_owned(), 3),
                ("sh".to_owned(), "ls\n".to_owned(), 7)
            ]
        );
    }
}
