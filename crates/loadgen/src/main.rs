//! Load generator (work in progress).
fn main() {}
