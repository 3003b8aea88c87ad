//! Fuzz target `sink_layer`: see `fence_fuzz::sink_layer` (fuzz/checks.rs) for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fence_fuzz::sink_layer(data));
