//! Fuzz target `headers`: see `fence_fuzz::headers` (fuzz/checks.rs) for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fence_fuzz::headers(data));
