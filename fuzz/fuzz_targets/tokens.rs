//! Fuzz target `tokens`: see `fence_fuzz::tokens` (fuzz/checks.rs) for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fence_fuzz::tokens(data));
