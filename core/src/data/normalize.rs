//! Per-channel normalisation of batches: [`Normalize`] (the numbers every worker applies) and
//! [`NormalizeChoice`] (`--normalize` as given, `auto` included).

use super::Dataset;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Per-channel normalisation every worker applies to a batch, stated in the run spec:
/// `x = (p / 255 - mean[c]) / std[c]` for pixel `p` of channel `c`. One value applies to every
/// channel. The default (`mean` and `std` empty) is plain `p / 255`.
///
/// As text (`--normalize`): `MEAN/STD` with comma lists for several channels, e.g.
/// `0.1307/0.3081` (MNIST) or `0.49,0.48,0.45/0.25,0.24,0.26`; `none` for the default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Normalize {
    /// Mean per channel (or one for all), on the `p / 255` scale.
    #[serde(default)]
    pub mean: Vec<f32>,
    /// Standard deviation per channel (or one for all), positive.
    #[serde(default)]
    pub std: Vec<f32>,
}

impl Normalize {
    /// True for the default, plain `p / 255`.
    pub fn is_identity(&self) -> bool {
        self.mean.is_empty() && self.std.is_empty()
    }

    /// Parses `MEAN/STD` (comma lists per channel) or `none`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other text, a non-finite value or a non-positive deviation.
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        if t == "none" || t.is_empty() {
            return Ok(Self::default());
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
    /// `channels` values, or a value is not finite or a deviation not positive.
    pub fn validate(&self, channels: usize) -> Result<()> {
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
}
