//! Fuzz target `pem_and_auth`: see `fence_fuzz::pem_and_auth` (fuzz/checks.rs) for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fence_fuzz::pem_and_auth(data));
