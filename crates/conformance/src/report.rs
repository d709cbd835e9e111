//! Results, verdict, `report.json` and `junit.xml`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use serde::Serialize;

use crate::registry::{self, BEHAVIORS};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Passed,
    Failed,
    Skipped,
}

#[derive(Debug, Clone, Serialize)]
pub struct TestRecord {
    pub status: Status,
    pub duration_ms: u64,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub area: Option<String>,
    /// Whether the claimed profiles require this behavior.
    pub required: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    Certified,
    Failed,
    Incomplete,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub verdict: Verdict,
    pub seed: u64,
    pub profiles: Vec<String>,
    pub target: String,
    pub capabilities: Option<serde_json::Value>,
    pub baseline: BTreeMap<String, TestRecord>,
    pub behaviors: BTreeMap<String, TestRecord>,
    pub scale: Option<serde_json::Value>,
    pub summary: BTreeMap<String, usize>,
    /// Required behaviors with no implementing test (forces INCOMPLETE).
    pub unimplemented: Vec<String>,
}

impl Report {
    pub fn new(seed: u64, profiles: Vec<String>, target: String) -> Report {
        Report {
            verdict: Verdict::Incomplete,
            seed,
            profiles,
            target,
            capabilities: None,
            baseline: BTreeMap::new(),
            behaviors: BTreeMap::new(),
            scale: None,
            summary: BTreeMap::new(),
            unimplemented: Vec::new(),
        }
    }

    /// Computes the verdict: INCOMPLETE if a required behavior has no implementing test or no
    /// result, FAILED on any required or baseline failure, CERTIFIED otherwise.
    pub fn finish(&mut self) -> Verdict {
        let mut sum = BTreeMap::new();
        for r in self.behaviors.values().chain(self.baseline.values()) {
            *sum.entry(format!("{:?}", r.status).to_lowercase())
                .or_insert(0) += 1;
        }
        self.summary = sum;
        let failed = self
            .baseline
            .values()
            .chain(self.behaviors.values())
            .any(|r| r.required && r.status == Status::Failed);
        let missing = BEHAVIORS
            .iter()
            .any(|b| b.required_by(&self.profiles) && !self.behaviors.contains_key(b.id));
        self.verdict = if failed {
            Verdict::Failed
        } else if !self.unimplemented.is_empty() || missing {
            Verdict::Incomplete
        } else {
            Verdict::Certified
        };
        self.verdict
    }

    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let json = serde_json::to_string_pretty(self)?;
        std::fs::write(dir.join("report.json"), json).context("writing report.json")?;
        std::fs::write(dir.join("junit.xml"), self.junit()).context("writing junit.xml")?;
        Ok(())
    }

    pub fn junit(&self) -> String {
        let mut suites: BTreeMap<String, Vec<(String, &TestRecord)>> = BTreeMap::new();
        for (k, r) in &self.baseline {
            suites
                .entry("baseline".into())
                .or_default()
                .push((k.clone(), r));
        }
        for (k, r) in &self.behaviors {
            let area = registry::behavior(k)
                .map(|b| b.area.title().to_string())
                .unwrap_or_else(|| "extension".into());
            suites.entry(area).or_default().push((k.clone(), r));
        }
        let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let total: usize = suites.values().map(|v| v.len()).sum();
        let fails = self
            .baseline
            .values()
            .chain(self.behaviors.values())
            .filter(|r| r.status == Status::Failed)
            .count();
        x.push_str(&format!(
            "<testsuites name=\"bfconformance\" tests=\"{total}\" failures=\"{fails}\">\n"
        ));
        for (name, cases) in suites {
            let f = cases
                .iter()
                .filter(|(_, r)| r.status == Status::Failed)
                .count();
            let s = cases
                .iter()
                .filter(|(_, r)| r.status == Status::Skipped)
                .count();
            x.push_str(&format!(
                "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{f}\" skipped=\"{s}\">\n",
                esc(&name),
                cases.len()
            ));
            for (id, r) in cases {
                let title = registry::behavior(&id).map(|b| b.assertion).unwrap_or("");
                x.push_str(&format!(
                    "    <testcase classname=\"{}\" name=\"{}\" time=\"{:.3}\">",
                    esc(&name),
                    esc(&if title.is_empty() {
                        id.clone()
                    } else {
                        format!("{id} {title}")
                    }),
                    r.duration_ms as f64 / 1000.0
                ));
                match r.status {
                    Status::Failed => {
                        x.push_str(&format!("<failure message=\"{}\"/>", esc(&r.message)))
                    }
                    Status::Skipped => {
                        x.push_str(&format!("<skipped message=\"{}\"/>", esc(&r.message)))
                    }
                    Status::Passed if !r.message.is_empty() => {
                        x.push_str(&format!("<system-out>{}</system-out>", esc(&r.message)))
                    }
                    Status::Passed => {}
                }
                x.push_str("</testcase>\n");
            }
            x.push_str("  </testsuite>\n");
        }
        x.push_str("</testsuites>\n");
        x
    }
}

/// XML-escapes text; characters XML 1.0 cannot carry are replaced.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            '\t' | '\n' | '\r' => o.push(c),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => o.push('\u{fffd}'),
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(status: Status, required: bool) -> TestRecord {
        TestRecord {
            status,
            duration_ms: 1,
            message: "m <&> \u{0}".into(),
            area: None,
            required,
        }
    }

    fn full(profiles: &[&str]) -> Report {
        let mut r = Report::new(
            1,
            profiles.iter().map(|s| s.to_string()).collect(),
            "t".into(),
        );
        for b in BEHAVIORS {
            r.behaviors
                .insert(b.id.into(), rec(Status::Passed, b.required_by(&r.profiles)));
        }
        r
    }

    #[test]
    fn verdicts() {
        let mut r = full(&["core"]);
        assert_eq!(r.finish(), Verdict::Certified);
        r.behaviors.insert("B101".into(), rec(Status::Failed, true));
        assert_eq!(r.finish(), Verdict::Failed);
        let mut r = full(&["core"]);
        r.behaviors.remove("B203");
        assert_eq!(r.finish(), Verdict::Incomplete);
        let mut r = full(&["core"]);
        r.unimplemented.push("B1301".into());
        assert_eq!(r.finish(), Verdict::Incomplete);
        let mut r = full(&["core"]);
        r.baseline
            .insert("baseline/x".into(), rec(Status::Failed, true));
        assert_eq!(r.finish(), Verdict::Failed);
    }

    #[test]
    fn junit_is_escaped() {
        let mut r = full(&["core"]);
        r.behaviors.insert("B101".into(), rec(Status::Failed, true));
        let x = r.junit();
        assert!(x.contains("m &lt;&amp;&gt; \u{fffd}"));
        assert!(!x.contains('\u{0}'));
        assert!(x.contains("failures=\"1\""));
    }
}
