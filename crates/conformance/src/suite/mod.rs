//! The baseline and the extension tests, plus the static id -> implementing test map.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::harness::{SharedCtx, TestResult};

pub mod baseline;
pub mod concurrency;
pub mod durable;
pub mod fault;
pub mod fencing;
pub mod lifecycle;
pub mod list;
pub mod matrix;
pub mod metadata;
pub mod property;
pub mod scale;
pub mod shape;

pub type EndpointFn = fn(SharedCtx) -> BoxFuture<'static, TestResult>;
pub type DurableFn = fn(Arc<durable::DurableRun>) -> BoxFuture<'static, TestResult>;
pub type ScaleFn = fn(Arc<scale::ScaleRun>) -> BoxFuture<'static, TestResult>;

/// How a behavior is implemented and which lane runs it.
#[derive(Clone, Copy)]
pub enum Impl {
    /// Runs against a shared endpoint, concurrently with other tests.
    Endpoint(EndpointFn),
    /// Runs against a shared endpoint but alone (needs a quiescent fleet).
    Serial(EndpointFn),
    /// Runs in the fault lane against the fault-injecting provider.
    Fault(EndpointFn),
    /// Checks the recorded kill -9 / restart scenario of the durable lane.
    Durable(DurableFn),
    /// Runs in the scale lane against a large seeded fleet.
    Scale(ScaleFn),
}

macro_rules! ep {
    ($kind:ident, $f:path) => {
        Impl::$kind(|c| Box::pin($f(c)))
    };
}

/// The static map from registry id to its implementing test function.
pub static IMPLS: &[(&str, Impl)] = &[
    ("B101", ep!(Endpoint, lifecycle::b101)),
    ("B103", ep!(Endpoint, lifecycle::b103)),
    ("B104", ep!(Endpoint, lifecycle::b104)),
    ("B105", ep!(Endpoint, lifecycle::b105)),
    ("B106", ep!(Endpoint, lifecycle::b106)),
    ("B107", ep!(Endpoint, lifecycle::b107)),
    ("B108", ep!(Endpoint, lifecycle::b108)),
    ("B109", ep!(Endpoint, lifecycle::b109)),
    ("B201", ep!(Endpoint, matrix::b201)),
    ("B202", ep!(Endpoint, matrix::b202)),
    ("B203", ep!(Endpoint, matrix::b203)),
    ("B204", ep!(Endpoint, matrix::b204)),
    ("B205", ep!(Endpoint, matrix::b205)),
    ("B206", ep!(Endpoint, matrix::b206)),
    ("B207", ep!(Endpoint, matrix::b207)),
    ("B208", ep!(Endpoint, matrix::b208)),
    ("B209", ep!(Endpoint, matrix::b209)),
    ("B210", ep!(Endpoint, matrix::b210)),
    ("B211", ep!(Endpoint, matrix::b211)),
    ("B212", ep!(Endpoint, matrix::b212)),
    ("B213", ep!(Endpoint, matrix::b213)),
    ("B214", ep!(Endpoint, matrix::b214)),
    ("B215", ep!(Endpoint, matrix::b215)),
    ("B301", ep!(Endpoint, fencing::b301)),
    ("B302", ep!(Endpoint, fencing::b302)),
    ("B303", ep!(Endpoint, fencing::b303)),
    ("B305", ep!(Endpoint, fencing::b305)),
    ("B306", ep!(Endpoint, fencing::b306)),
    ("B307", ep!(Endpoint, fencing::b307)),
    ("B308", ep!(Endpoint, fencing::b308)),
    ("B309", ep!(Endpoint, fencing::b309)),
    ("B310", ep!(Endpoint, fencing::b310)),
    ("B311", ep!(Endpoint, fencing::b311)),
    ("B312", ep!(Endpoint, fencing::b312)),
    ("B401", ep!(Endpoint, concurrency::b401)),
    ("B402", ep!(Endpoint, concurrency::b402)),
    ("B403", ep!(Endpoint, concurrency::b403)),
    ("B404", ep!(Endpoint, concurrency::b404)),
    ("B405", ep!(Endpoint, concurrency::b405)),
    ("B406", ep!(Endpoint, concurrency::b406)),
    ("B407", ep!(Endpoint, concurrency::b407)),
    ("B408", ep!(Endpoint, concurrency::b408)),
    ("B409", ep!(Endpoint, concurrency::b409)),
    ("B501", ep!(Endpoint, metadata::b501)),
    ("B502", ep!(Endpoint, metadata::b502)),
    ("B503", ep!(Endpoint, metadata::b503)),
    ("B504", ep!(Endpoint, metadata::b504)),
    ("B505", ep!(Endpoint, metadata::b505)),
    ("B801", ep!(Endpoint, shape::b801)),
    ("B802", ep!(Endpoint, shape::b802)),
    ("B803", ep!(Endpoint, shape::b803)),
    ("B804", ep!(Endpoint, shape::b804)),
    ("B805", ep!(Endpoint, shape::b805)),
    ("B806", ep!(Endpoint, shape::b806)),
    ("B807", ep!(Endpoint, shape::b807)),
    ("B901", ep!(Serial, list::b901)),
    ("B902", ep!(Endpoint, list::b902)),
    ("B903", ep!(Endpoint, list::b903)),
    ("B904", ep!(Serial, list::b904)),
    ("B905", ep!(Endpoint, list::b905)),
    ("B906", ep!(Endpoint, list::b906)),
    ("B907", ep!(Serial, list::b907)),
    ("B908", ep!(Serial, list::b908)),
    ("B909", ep!(Endpoint, list::b909)),
    ("B701", ep!(Fault, fault::b701)),
    ("B702", ep!(Fault, fault::b702)),
    ("B703", ep!(Fault, fault::b703)),
    ("B704", ep!(Fault, fault::b704)),
    ("B705", ep!(Fault, fault::b705)),
    ("B706", ep!(Fault, fault::b706)),
    ("B707", ep!(Fault, fault::b707)),
    ("B708", ep!(Fault, fault::b708)),
    ("B1001", ep!(Durable, durable::b1001)),
    ("B1002", ep!(Durable, durable::b1002)),
    ("B1003", ep!(Durable, durable::b1003)),
    ("B1004", ep!(Durable, durable::b1004)),
    ("B1005", ep!(Durable, durable::b1005)),
    ("B1006", ep!(Durable, durable::b1006)),
    ("B1007", ep!(Durable, durable::b1007)),
    ("B1101", ep!(Scale, scale::b1101)),
    ("B1102", ep!(Scale, scale::b1102)),
    ("B1103", ep!(Scale, scale::b1103)),
    ("B1104", ep!(Scale, scale::b1104)),
    ("B1105", ep!(Scale, scale::b1105)),
    ("B1106", ep!(Scale, scale::b1106)),
    ("B1107", ep!(Scale, scale::b1107)),
    ("B1108", ep!(Scale, scale::b1108)),
    ("B1109", ep!(Scale, scale::b1109)),
    ("B1201", ep!(Endpoint, property::b1201)),
    ("B1202", ep!(Endpoint, property::b1202)),
    ("B1203", ep!(Endpoint, property::b1203)),
    ("B1204", ep!(Endpoint, property::b1204)),
    ("B1205", ep!(Endpoint, property::b1205)),
];

/// The implementing test of a behavior id.
pub fn implementation(id: &str) -> Option<Impl> {
    IMPLS.iter().find(|(i, _)| *i == id).map(|(_, f)| *f)
}

/// Baseline (the floor) tests, run before the extension suite.
pub static BASELINE: &[(&str, EndpointFn)] = &[
    ("baseline/full_lifecycle", |c| {
        Box::pin(baseline::full_lifecycle(c))
    }),
    ("baseline/create_idempotent", |c| {
        Box::pin(baseline::create_idempotent(c))
    }),
    ("baseline/get_unknown_not_found", |c| {
        Box::pin(baseline::get_unknown(c))
    }),
    ("baseline/delete_unknown", |c| {
        Box::pin(baseline::delete_unknown(c))
    }),
    ("baseline/list_idle_filter", |c| {
        Box::pin(baseline::list_idle_filter(c))
    }),
    ("baseline/list_max_results_1", |c| {
        Box::pin(baseline::list_max_one(c))
    }),
    ("baseline/list_shape", |c| Box::pin(baseline::list_shape(c))),
    ("baseline/revision_changes", |c| {
        Box::pin(baseline::revision_changes(c))
    }),
    ("baseline/drain_speculative_fails", |c| {
        Box::pin(baseline::drain_speculative(c))
    }),
    ("baseline/fencing_stale_token", |c| {
        Box::pin(baseline::fencing_stale(c))
    }),
    ("baseline/fencing_per_machine", |c| {
        Box::pin(baseline::fencing_per_machine(c))
    }),
    ("baseline/fence_before_not_found", |c| {
        Box::pin(baseline::fence_before_not_found(c))
    }),
    ("baseline/fence_before_idempotency", |c| {
        Box::pin(baseline::fence_before_idempotency(c))
    }),
    ("baseline/shard_metadata_echo_clear", |c| {
        Box::pin(baseline::metadata_echo_clear(c))
    }),
    ("baseline/readiness_gate", |c| {
        Box::pin(baseline::readiness_gate(c))
    }),
];
