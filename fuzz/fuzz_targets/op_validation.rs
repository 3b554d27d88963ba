//! cargo-fuzz target `op_validation`: the body lives in `kvbridge_fuzz::op_validation` so that `cargo test`
//! replays the committed seeds through the same code.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvbridge_fuzz::op_validation::run(data));
