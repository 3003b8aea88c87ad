//! Fuzz target `lease_api`: see `fence_fuzz::lease_api` (fuzz/checks.rs) for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fence_fuzz::lease_api(data));
