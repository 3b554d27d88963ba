//! cargo-fuzz target `zmtp_pull`: the body lives in `kvbridge_fuzz::zmtp_pull` so that
//! `cargo test` replays the committed seeds through the same code.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvbridge_fuzz::zmtp_pull::run(data));
