//! cargo-fuzz target `handshake`: the body lives in `kvbridge_fuzz::handshake` so that `cargo test`
//! replays the committed seeds through the same code.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvbridge_fuzz::handshake::run(data));
