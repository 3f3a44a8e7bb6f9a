//! Per-channel normalisation of batches: [`Normalize`] (the numbers every worker applies, or
//! token mode for text) and [`NormalizeChoice`] (`--normalize` as given, `auto` included).

use super::Dataset;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Per-channel normalisation every worker applies to a batch, stated in the run spec:
/// `x = (p / 255 - mean[c]) / std[c]` for pixel `p` of channel `c`. One value applies to every
/// channel. The default (`mean` and `std` empty) is plain `p / 255`. Token mode (`tokens`, the
/// mode of every text run) is `x = p` exactly: a byte is a token id, not an intensity.
///
/// As text (`--normalize`): `MEAN/STD` with comma lists for several channels, e.g.
/// `0.1307/0.3081` (MNIST) or `0.49,0.48,0.45/0.25,0.24,0.26`; `none` for the default;
/// `tokens` for token mode.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Normalize {
    /// Mean per channel (or one for all), on the `p / 255` scale.
    #[serde(default)]
    pub mean: Vec<f32>,
    /// Standard deviation per channel (or one for all), positive.
    #[serde(default)]
    pub std: Vec<f32>,
    /// Token mode: `x = p`, the token id as an exact f32 (text runs). Excludes `mean` and
    /// `std`. Absent in JSON = false, so specs from before it existed read unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tokens: bool,
}

impl Normalize {
    /// True for the default, plain `p / 255`.
    pub fn is_identity(&self) -> bool {
        self.mean.is_empty() && self.std.is_empty() && !self.tokens
    }

    /// Token mode: batches carry the bytes as exact ids (`x = p`).
    pub fn tokens() -> Self {
        Self {
            tokens: true,
            ..Self::default()
        }
    }

    /// Parses `MEAN/STD` (comma lists per channel), `none` or `tokens`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other text, a non-finite value or a non-positive deviation.
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        if t == "none" || t.is_empty() {
            return Ok(Self::default());
        }
        if t == "tokens" {
            return Ok(Self::tokens());
        }
        let bad = || {
            Error::Config(format!("bad normalisation {t:?}: use MEAN/STD, e.g. 0.1307/0.3081, comma lists per channel, or none"))
        };
        let (m, s) = t.split_once('/').ok_or_else(bad)?;
        let list = |v: &str| -> Result<Vec<f32>> {
            v.split(',')
                .map(|x| x.trim().parse::<f32>().map_err(|_| bad()))
                .collect()
        };
        let n = Self {
            mean: list(m)?,
            std: list(s)?,
            tokens: false,
        };
        n.validate(n.mean.len().max(n.std.len()))?;
        Ok(n)
    }

    /// Mean and standard deviation per channel of `data`'s pixels (on the `p / 255` scale).
    pub fn of(data: &Dataset) -> Self {
        let c = data.channels();
        let mut sum = vec![0f64; c];
        let mut sq = vec![0f64; c];
        for (j, &p) in data.pixels.iter().enumerate() {
            let v = f64::from(p) / 255.0;
            sum[j % c] += v;
            sq[j % c] += v * v;
        }
        let n = (data.pixels.len() / c).max(1) as f64;
        let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
        Self {
            tokens: false,
            mean: mean.iter().map(|&m| m as f32).collect(),
            std: sq
                .iter()
                .zip(&mean)
                .map(|(q, m)| ((q / n - m * m).max(0.0).sqrt().max(1e-3)) as f32)
                .collect(),
        }
    }

    /// Checks the values fit images of `channels` channels.
    ///
    /// # Errors
    /// [`Error::Config`] when `mean` and `std` are not both empty, both of one value or both of
    /// `channels` values, or a value is not finite or a deviation not positive; when token
    /// mode comes with a mean or a deviation.
    pub fn validate(&self, channels: usize) -> Result<()> {
        if self.tokens {
            if !(self.mean.is_empty() && self.std.is_empty()) {
                return Err(Error::Config(
                    "token mode (batches of exact token ids) takes no mean or deviation".into(),
                ));
            }
            return Ok(());
        }
        if self.is_identity() {
            return Ok(());
        }
        let fits = |n: usize| n == 1 || n == channels;
        if !fits(self.mean.len()) || !fits(self.std.len()) {
            return Err(Error::Config(format!(
                "normalisation has {} means and {} deviations for images of {channels} channels",
                self.mean.len(),
                self.std.len()
            )));
        }
        if self.mean.iter().any(|m| !m.is_finite())
            || self.std.iter().any(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(Error::Config(
                "normalisation means must be finite and deviations positive".into(),
            ));
        }
        Ok(())
    }
}

/// `--normalize` as given: a fixed [`Normalize`], or `auto`, the training set's own per-channel
/// statistics ([`Normalize::of`]), computed once by the server and stated in the run spec, so
/// every worker still applies the same numbers.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum NormalizeChoice {
    /// These values (the default: none, plain `p / 255`).
    #[default]
    None,
    /// These values.
    Fixed(Normalize),
    /// The training set's statistics.
    Auto,
}

impl NormalizeChoice {
    /// Parses `none`, `auto` or `MEAN/STD` ([`Normalize::parse`]).
    ///
    /// # Errors
    /// As [`Normalize::parse`].
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "auto" => Ok(Self::Auto),
            t => {
                let n = Normalize::parse(t)?;
                Ok(if n.is_identity() {
                    Self::None
                } else {
                    Self::Fixed(n)
                })
            }
        }
    }

    /// The values for a run training on `train`, checked against its channels.
    ///
    /// # Errors
    /// [`Error::Config`] when fixed values do not fit `train`'s channels.
    pub fn resolve(&self, train: &Dataset) -> Result<Normalize> {
        let n = match self {
            Self::None => Normalize::default(),
            Self::Fixed(n) => n.clone(),
            Self::Auto => Normalize::of(train),
        };
        n.validate(train.channels()).map_err(|e| {
            Error::Config(format!(
                "--normalize: {e} (the dataset's images are {:?})",
                train.image_dims
            ))
        })?;
        Ok(n)
    }
}

impl NormalizeChoice {
    /// The values for a text run: token mode, the only one that keeps ids exact.
    ///
    /// # Errors
    /// [`Error::Config`] for `auto` or a mean and deviation: they would scale token ids.
    pub fn resolve_tokens(&self) -> Result<Normalize> {
        match self {
            Self::None => Ok(Normalize::tokens()),
            Self::Fixed(n) if n.tokens => Ok(n.clone()),
            other => Err(Error::Config(format!(
                "--normalize {other} does not apply to text: its batches are exact token ids (use none or tokens)"
            ))),
        }
    }
}

impl std::fmt::Display for NormalizeChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => write!(f, "none"),
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Auto => write!(f, "auto"),
        }
    }
}

impl std::fmt::Display for Normalize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.tokens && self.mean.is_empty() && self.std.is_empty() {
            return write!(f, "tokens");
        }
        if self.is_identity() {
            return write!(f, "none");
        }
        let list = |v: &[f32]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        write!(f, "{}/{}", list(&self.mean), list(&self.std))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::encode_idx;

    #[test]
    fn normalisation_per_channel() {
        // Two pixels of two channels: (10, 200), (30, 100).
        let img = encode_idx(&[1, 1, 2, 2], &[10, 200, 30, 100]);
        let mut d = Dataset::from_idx(&img, &encode_idx(&[1], &[0])).unwrap();
        let mut x = ndarray::Array2::zeros((1, 4));
        let mut y = [0u8];
        let plain = |d: &Dataset, x: &mut ndarray::Array2<f32>, y: &mut [u8]| {
            d.fill_batch(&[0], &mut x.view_mut(), y);
            x.row(0).to_vec()
        };
        let before = plain(&d, &mut x, &mut y);
        d.set_normalize(&Normalize::parse("0.1,0.5/0.2,0.25").unwrap())
            .unwrap();
        let after = plain(&d, &mut x, &mut y);
        for (j, (&a, &b)) in after.iter().zip(&before).enumerate() {
            let (m, s) = if j % 2 == 0 { (0.1, 0.2) } else { (0.5, 0.25) };
            assert!((a - (b - m) / s).abs() < 1e-5, "{j}: {a} vs {b}");
        }
        // A bad normalisation changes nothing.
        assert!(d
            .set_normalize(&Normalize::parse("0.1,0.2,0.3/1").unwrap())
            .is_err());
        assert_eq!(plain(&d, &mut x, &mut y), after);
        d.set_normalize(&Normalize::default()).unwrap();
        assert_eq!(plain(&d, &mut x, &mut y), before);
        for bad in ["0.1", "a/b", "0.1/0", "0.1/-1", "nan/1"] {
            assert!(Normalize::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Normalize::parse("none").unwrap(), Normalize::default());
        assert_eq!(
            NormalizeChoice::parse("none").unwrap(),
            NormalizeChoice::None
        );
        assert_eq!(
            NormalizeChoice::parse("auto").unwrap(),
            NormalizeChoice::Auto
        );
        assert!(NormalizeChoice::parse("auto:2").is_err());
        assert_eq!(
            NormalizeChoice::parse("auto").unwrap().resolve(&d).unwrap(),
            Normalize::of(&d)
        );
        assert!(NormalizeChoice::parse("0.1,0.2,0.3/1")
            .unwrap()
            .resolve(&d)
            .is_err());
        for t in ["none", "auto", "0.5/0.25"] {
            assert_eq!(NormalizeChoice::parse(t).unwrap().to_string(), t);
        }
        let n = Normalize::parse("0.1307/0.3081").unwrap();
        assert_eq!(Normalize::parse(&n.to_string()).unwrap(), n);
        let stats = Normalize::of(&d);
        assert!((stats.mean[0] - 20.0 / 255.0).abs() < 1e-6);
        assert!((stats.std[1] - 50.0 / 255.0).abs() < 1e-6);
    }

    #[test]
    fn token_mode_fills_exact_ids_and_refuses_a_mean_or_deviation() {
        // Every byte value, as rows of 64 tokens (any shape: the mode ignores channels).
        let tokens: Vec<u8> = (0..=255u8).collect();
        let img = encode_idx(&[4, 64], &tokens);
        let mut d = Dataset::from_idx(&img, &encode_idx(&[4], &[63, 127, 191, 255])).unwrap();
        d.set_normalize(&Normalize::tokens()).unwrap();
        let mut x = ndarray::Array2::zeros((4, 64));
        let mut y = [0u8; 4];
        d.fill_batch(&[3, 0, 2, 1], &mut x.view_mut(), &mut y);
        for (r, &k) in [3usize, 0, 2, 1].iter().enumerate() {
            for j in 0..64 {
                assert_eq!(x[[r, j]], (k * 64 + j) as f32, "row {k} token {j}");
            }
        }
        assert_eq!(y, [255, 63, 191, 127]);
        // With a mean or a deviation it is refused, and the dataset keeps token mode.
        let mixed = Normalize {
            mean: vec![0.5],
            std: vec![0.25],
            tokens: true,
        };
        assert!(mixed.validate(1).is_err());
        assert!(d.set_normalize(&mixed).is_err());
        d.fill_batch(&[1], &mut x.slice_mut(ndarray::s![0..1, ..]), &mut y[..1]);
        assert_eq!(x[[0, 5]], 69.0);
        // Text: none and tokens resolve to token mode; auto and fixed values are refused.
        for t in ["none", "tokens"] {
            assert_eq!(
                NormalizeChoice::parse(t).unwrap().resolve_tokens().unwrap(),
                Normalize::tokens(),
                "{t}"
            );
        }
        for t in ["auto", "0.5/0.25"] {
            let err = NormalizeChoice::parse(t).unwrap().resolve_tokens();
            assert!(err.unwrap_err().to_string().contains("token ids"), "{t}");
        }
        // Text form and JSON: `tokens`, and JSON without the key is the old plain p / 255.
        assert_eq!(Normalize::tokens().to_string(), "tokens");
        assert_eq!(Normalize::parse("tokens").unwrap(), Normalize::tokens());
        assert!(!Normalize::tokens().is_identity());
        let json = serde_json::to_value(Normalize::tokens()).unwrap();
        assert_eq!(json["tokens"], true);
        assert_eq!(
            serde_json::from_value::<Normalize>(json).unwrap(),
            Normalize::tokens()
        );
        let old = serde_json::to_value(Normalize::parse("0.1/0.2").unwrap()).unwrap();
        assert!(old.get("tokens").is_none());
        assert_eq!(
            serde_json::from_str::<Normalize>("{}").unwrap(),
            Normalize::default()
        );
    }
}
