//! Datasets: IDX files (MNIST, Fashion-MNIST and anything else in LeCun's IDX format with
//! unsigned-byte images and labels, raw or gzip-compressed; images `N x H x W` or
//! `N x H x W x C`) and NumPy `.npy` files ([`parse_npy`]), text cut into windows of token ids
//! ([`windows`], [`TextInfo`]), and batching into normalised f32.
//!
//! Pixels stay `u8` in memory (a quarter of the f32 size); a batch is converted to `x / 255`
//! when it is filled, then normalised per channel when the run says so ([`Normalize`]), or
//! kept as exact token ids for text ([`Normalize::tokens`]).
//!
//! # Layout
//! - `idx.rs`: IDX files, [`IdxArray`].
//! - `npy.rs`: `.npy` files.
//! - `normalize.rs`: [`Normalize`], [`NormalizeChoice`].
//! - `dataset.rs`: [`Dataset`], [`BatchSampler`], [`channels_of`].
//! - `text.rs`: [`TextInfo`] (vocabulary, encode, decode), [`TextLevel`], [`windows`].

mod dataset;
mod idx;
mod normalize;
mod npy;
mod text;

pub use dataset::{channels_of, BatchSampler, Dataset};
pub use idx::{encode_idx, parse_idx, parse_idx_owned, IdxArray, MAX_IDX_BYTES};
pub use normalize::{Normalize, NormalizeChoice};
pub use npy::{encode_npy_u8, parse_npy};
pub use text::{window_count, windows, TextInfo, TextLevel, MAX_CONTEXT, MAX_VOCAB_CHARS};

/// Helpers the data tests share.
#[cfg(test)]
mod testing {
    use super::encode_idx;

    pub(super) fn toy() -> (Vec<u8>, Vec<u8>) {
        let pixels: Vec<u8> = (0..5 * 4).map(|i| (i * 10) as u8).collect();
        (
            encode_idx(&[5, 2, 2], &pixels),
            encode_idx(&[5], &[0, 1, 2, 1, 0]),
        )
    }
}
