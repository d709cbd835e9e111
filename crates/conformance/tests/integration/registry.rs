//! Well-formedness of the frozen registry and its binding to implementing tests.

use std::collections::{BTreeMap, HashSet};

use conformance::registry::{id_number, Area, AREA_COUNTS, BEHAVIORS, GATES, PROFILES};
use conformance::suite::{implementation, IMPLS};

#[test]
fn ninety_three_unique_ids() {
    assert_eq!(BEHAVIORS.len(), 93);
    let mut seen = HashSet::new();
    for b in BEHAVIORS {
        assert!(seen.insert(b.id), "duplicate id {}", b.id);
        let n = id_number(b.id).unwrap_or_else(|| panic!("malformed id {}", b.id));
        assert!(n >= 101, "id {} below the numbering range", b.id);
        assert!(!b.assertion.is_empty(), "{} has no assertion", b.id);
    }
}

#[test]
fn profiles_and_gates_are_known() {
    for b in BEHAVIORS {
        assert!(!b.profiles.is_empty(), "{} has no profile", b.id);
        for p in b.profiles {
            assert!(PROFILES.contains(p), "{} has unknown profile {p}", b.id);
        }
        if let Some(g) = b.gate {
            assert!(GATES.contains(&g), "{} has unknown gate {g}", b.id);
        }
    }
}

#[test]
fn area_counts_match_the_spec() {
    let mut counts: BTreeMap<Area, usize> = BTreeMap::new();
    for b in BEHAVIORS {
        *counts.entry(b.area).or_default() += 1;
    }
    for (area, want) in AREA_COUNTS {
        assert_eq!(
            counts.get(&area).copied().unwrap_or(0),
            want,
            "area {}",
            area.title()
        );
    }
    assert_eq!(counts.len(), Area::ALL.len());
    assert_eq!(AREA_COUNTS.iter().map(|(_, n)| n).sum::<usize>(), 93);
}

#[test]
fn ids_sit_in_their_area_block() {
    // B1xx lifecycle, B2xx matrix, ... B12xx property: the hundreds digit names the area.
    let block = |a: Area| match a {
        Area::Lifecycle => 1,
        Area::TransitionMatrix => 2,
        Area::Fencing => 3,
        Area::Concurrency => 4,
        Area::Metadata => 5,
        Area::TimeoutsFailure => 7,
        Area::FieldShape => 8,
        Area::ListRevision => 9,
        Area::Durability => 10,
        Area::ScaleSoak => 11,
        Area::PropertyFuzz => 12,
    };
    for b in BEHAVIORS {
        let n = id_number(b.id).unwrap_or(0);
        assert_eq!(
            n / 100,
            block(b.area),
            "{} filed under {}",
            b.id,
            b.area.title()
        );
        // Upstream ids stop below B1301; our own additions start there.
        assert!(n < 1301, "{} is one of ours but carries no marker", b.id);
    }
}

#[test]
fn every_behavior_has_exactly_one_implementing_test() {
    for b in BEHAVIORS {
        assert!(
            implementation(b.id).is_some(),
            "{} has no implementing test",
            b.id
        );
    }
    let ids: HashSet<&str> = BEHAVIORS.iter().map(|b| b.id).collect();
    let mut bound = HashSet::new();
    for (id, _) in IMPLS {
        assert!(ids.contains(id), "test bound to unknown id {id}");
        assert!(bound.insert(*id), "{id} bound twice");
    }
}

#[test]
fn lanes_match_profiles() {
    use conformance::suite::Impl;
    for b in BEHAVIORS {
        let lane = match implementation(b.id) {
            Some(Impl::Fault(_)) => "fault",
            Some(Impl::Durable(_)) => "durable",
            Some(Impl::Scale(_)) => "scale",
            Some(Impl::Endpoint(_) | Impl::Serial(_)) => "core",
            None => continue,
        };
        assert!(
            b.profiles.contains(&lane),
            "{} runs in the {lane} lane but claims {:?}",
            b.id,
            b.profiles
        );
    }
}
