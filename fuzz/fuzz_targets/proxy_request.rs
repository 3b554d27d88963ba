//! cargo-fuzz target `proxy_request`: the body lives in `kvbridge_fuzz::proxy_request` so that `cargo test`
//! replays the committed seeds through the same code.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvbridge_fuzz::proxy_request::run(data));
