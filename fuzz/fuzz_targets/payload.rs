//! `cargo fuzz run payload`: see crowdgrad_fuzz::payload.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| crowdgrad_fuzz::payload(data));
