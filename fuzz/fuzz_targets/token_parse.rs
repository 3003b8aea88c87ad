//! Fuzz target `token_parse`: see `fence_fuzz::token_parse` (fuzz/checks.rs) for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fence_fuzz::token_parse(data));
