//! What the property tests (the fuzz targets) share: how many cases a run
//! makes, and arbitrary JSON shaped like what a parser reads.
//!
//! CI runs a few cases per property; `make fuzz` runs many
//! (`PROPTEST_CASES=100000`).

use proptest::prelude::*;
use proptest::strategy::Union;
use serde_json::Value;

/// Cases per property: `PROPTEST_CASES`, or 64.
pub fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// A proptest configuration making [`cases`] cases.
pub fn config() -> ProptestConfig {
    config_with_cases(cases())
}

/// A proptest configuration making `cases` cases and persisting no
/// failures (a failing case is printed; the seed files would land in the
/// source tree).
pub fn config_with_cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// The shape of the JSON documents [`JsonShape::values`] generates.
pub struct JsonShape {
    /// Object member names: the fields the parser under test reads, and a
    /// few it does not.
    pub keys: &'static [&'static str],
    /// Regexes of the string leaves, one kind of leaf each.
    pub strings: &'static [&'static str],
    /// The most members an object has.
    pub max_members: usize,
    /// The members proptest expects a collection to have, which bounds the
    /// size of a whole document (`prop_recursive`'s `expected_branch_size`).
    pub expected_branch_size: u32,
}

impl JsonShape {
    /// Arbitrary JSON: null, booleans, integers, floats and the string
    /// kinds as leaves, nested up to three deep in arrays and objects.
    pub fn values(&self) -> impl Strategy<Value = Value> {
        let mut leaves = vec![
            Just(Value::Null).boxed(),
            any::<bool>().prop_map(Value::Bool).boxed(),
            any::<i64>().prop_map(|n| serde_json::json!(n)).boxed(),
            any::<f64>().prop_map(|f| serde_json::json!(f)).boxed(),
        ];
        leaves.extend(
            self.strings
                .iter()
                .map(|&pattern| pattern.prop_map(Value::String).boxed()),
        );
        let keys = prop::sample::select(self.keys.to_vec());
        let max_members = self.max_members;
        Union::new(leaves).prop_recursive(3, 32, self.expected_branch_size, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(keys.clone(), inner, 0..=max_members).prop_map(|m| {
                    Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                }),
            ]
        })
    }
}
