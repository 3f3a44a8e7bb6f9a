//! `cargo fuzz run reader`: see crowdgrad_fuzz::reader.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| crowdgrad_fuzz::reader::reader(data));
