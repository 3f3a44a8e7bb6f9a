//! `cargo fuzz run session`: see crowdgrad_fuzz::session.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| crowdgrad_fuzz::session(data));
