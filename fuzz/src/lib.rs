//! The checks of the fuzz targets (`fuzz/checks.rs`, shared with `tests/fuzz_replay.rs`).

#[path = "../checks.rs"]
mod checks;

pub use checks::*;
