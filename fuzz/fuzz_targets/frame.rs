//! `cargo fuzz run frame`: see crowdgrad_fuzz::frame.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| crowdgrad_fuzz::frame(data));
