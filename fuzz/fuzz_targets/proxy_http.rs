//! cargo-fuzz target `proxy_http`: the body lives in `kvbridge_fuzz::proxy_http` so that `cargo test`
//! replays the committed seeds (those of `proxy_request`) through the same code.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvbridge_fuzz::proxy_http::run(data));
