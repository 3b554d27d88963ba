//! cargo-fuzz target `frame_decoder`: the body lives in `kvbridge_fuzz::frame_decoder` so that `cargo test`
//! replays the committed seeds through the same code.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvbridge_fuzz::frame_decoder::run(data));
