//! The server paces the crowd (issue 18): one rule, written once, for the server's shards, the
//! simulator and every worker.
//!
//! Without it each worker's demand is set by its own link: with `H = 1` a worker pulls the
//! whole model every step, and 10,000 volunteers would need 16 Gbit/s from one server. With an
//! egress budget `B` (bytes per second for the whole run, [`EgressBudget`]):
//!
//! 1. each shard gets a share proportional to its range length: `B_s = B · len_s / len`
//!    ([`Pacing::shard_budget`]);
//! 2. a shard knows the bytes of one `Params` frame for each connected worker session (32
//!    header bytes plus the range in the session's negotiated pull encoding,
//!    [`params_frame_bytes`]) and keeps their sum `S`;
//! 3. its pace is `pace_s = S / B_s` ([`pace_s`]): the least interval between one worker's
//!    pulls that keeps the shard's egress within its share if every worker pulled at that
//!    rate. It travels to workers that asked for it in each `Params` header's `aux`, in whole
//!    milliseconds rounded up ([`pace_ms`]);
//! 4. a worker takes the largest pace of its shards. Under `--local-steps auto` it lengthens
//!    its rounds, `H = max(H_auto, ⌈pace / t_c⌉)` within the run's bound ([`paced_steps`]);
//!    whatever `H` is, it sends a batch of pulls no sooner than `pace` after the previous
//!    batch ([`pull_due`]).
//!
//! So the crowd lengthens its rounds instead of saturating the server: total egress stays at
//! about `B` however many workers join, and each worker's share of it falls as `1/N`.

use crate::codec::Encoding;
use crate::error::{Error, Result};
use crate::wire::HEADER_LEN;
use std::fmt;

/// The budget `serve` and `shard` use unless told otherwise (issue 18):
/// [`SUGGESTED_EGRESS_BUDGET`], now that their default is `--local-steps auto`, under which
/// workers lengthen their rounds to the pace instead of waiting for pulls. Measured here
/// (docs/operations.md, "Egress budget"): with `--local-steps 1` a 400 Mbit/s budget holds
/// pulls, and 2 native workers on loopback fell from 48,117 to 6,334 samples/s; lessons that
/// compare H = 1 set `off` (`crowdgrad sim` does by default).
pub const DEFAULT_EGRESS_BUDGET: &str = SUGGESTED_EGRESS_BUDGET;

/// The budget a public server on a 1 Gbit/s link should set: 400 Mbit/s (50 MB/s), 40% of
/// the link, so the dashboard, joins, checkpoints and the pushes coming in keep room, and so
/// does the rounding of the pace to whole milliseconds.
pub const SUGGESTED_EGRESS_BUDGET: &str = "400mbit";

/// The smallest budget accepted, bytes per second: below it a plain number is far more
/// likely a unit left out (`400` for `400mbit`) than a link that slow.
pub const MIN_BUDGET: f64 = 1_000.0;
/// The largest budget accepted, bytes per second (1 TB/s).
pub const MAX_BUDGET: f64 = 1e12;
/// The longest pace a worker honours, seconds: a pace beyond it (a budget far too small for
/// the crowd, or a confused server) holds a worker this long, never longer.
pub const MAX_PACE: f64 = 600.0;

/// A whole run's egress budget for parameters sent to workers, bytes per second; off means
/// no pacing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EgressBudget(Option<f64>);

impl EgressBudget {
    /// No pacing.
    pub const OFF: EgressBudget = EgressBudget(None);

    /// A budget of `bytes` per second.
    ///
    /// # Errors
    /// [`Error::Config`] outside [`MIN_BUDGET`]..=[`MAX_BUDGET`].
    pub fn bytes_per_second(bytes: f64) -> Result<Self> {
        if bytes.is_finite() && (MIN_BUDGET..=MAX_BUDGET).contains(&bytes) {
            Ok(EgressBudget(Some(bytes)))
        } else {
            Err(Error::Config(format!(
                "egress budget of {bytes} bytes/s: use {MIN_BUDGET} to {MAX_BUDGET:e} bytes/s, or off"
            )))
        }
    }

    /// Parses `off` or `0` (no pacing), a plain number (bytes per second) or a number with a
    /// unit, case-insensitive, optionally followed by `/s`: bits `bit`, `kbit`, `mbit`,
    /// `gbit` (also `bps`, `kbps`, `mbps`, `gbps`); bytes `b`, `kb`, `mb`, `gb` (powers of
    /// 1000) and `kib`, `mib`, `gib` (powers of 1024). `400mbit` = `50MB` = 50,000,000
    /// bytes per second.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem: no number, an unknown unit, a negative or
    /// non-finite number, or a rate outside [`MIN_BUDGET`]..=[`MAX_BUDGET`].
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim().to_ascii_lowercase();
        if t == "off" || t == "none" {
            return Ok(Self::OFF);
        }
        let t = t.strip_suffix("/s").unwrap_or(&t);
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let bad = |why: &str| {
            Error::Config(format!(
                "egress budget {text:?}: {why}; use e.g. 400mbit, 50MB (bytes/s), 50000000 (bytes/s) or off"
            ))
        };
        let value: f64 = num.replace('_', "").parse().map_err(|_| bad("no number"))?;
        let scale = match unit.trim() {
            "" | "b" | "bytes" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "bit" | "bps" => 1.0 / 8.0,
            "kbit" | "kbps" => 1e3 / 8.0,
            "mbit" | "mbps" => 1e6 / 8.0,
            "gbit" | "gbps" => 1e9 / 8.0,
            _ => return Err(bad("unknown unit")),
        };
        if value == 0.0 {
            return Ok(Self::OFF);
        }
        Self::bytes_per_second(value * scale).map_err(|e| bad(&e.to_string()))
    }

    /// Bytes per second, `None` when off.
    pub fn get(self) -> Option<f64> {
        self.0
    }

    /// Whether there is a budget.
    pub fn is_on(self) -> bool {
        self.0.is_some()
    }
}

impl fmt::Display for EgressBudget {
    /// `off`, or bytes per second and the same in Mbit/s, e.g. `50000000 B/s (400 Mbit/s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => write!(f, "off"),
            Some(b) => write!(f, "{b:.0} B/s ({} Mbit/s)", b * 8.0 / 1e6),
        }
    }
}

/// How a run's shards pace their workers: the run's budget and the length of the whole
/// parameter vector, which every shard's share is cut from. Part of
/// [`crate::session::ShardSetup`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pacing {
    /// The whole run's budget.
    pub budget: EgressBudget,
    /// Values in the whole parameter vector (the sum of every shard's range).
    pub model_len: usize,
}

impl Pacing {
    /// No pacing.
    pub const OFF: Pacing = Pacing {
        budget: EgressBudget::OFF,
        model_len: 0,
    };

    /// Whether shards pace (a budget, and a model to share it over).
    pub fn is_on(&self) -> bool {
        self.budget.is_on() && self.model_len > 0
    }

    /// A shard of `range_len` values gets `budget · range_len / model_len` bytes per second;
    /// `None` when off.
    pub fn shard_budget(&self, range_len: usize) -> Option<f64> {
        let b = self.budget.get()?;
        if self.model_len == 0 {
            return None;
        }
        let share = range_len.min(self.model_len) as f64 / self.model_len as f64;
        Some(b * share)
    }

    /// The pace of a shard of `range_len` values whose sessions' frames sum to `demand` bytes
    /// ([`pace_s`]); 0 when off.
    pub fn pace_s(&self, range_len: usize, demand: u64) -> f64 {
        self.shard_budget(range_len)
            .map_or(0.0, |b| pace_s(demand, b))
    }
}

/// Bytes of one `Params` frame of `values` values in `encoding`: the 32-byte header and the
/// payload (no meta).
pub fn params_frame_bytes(encoding: Encoding, values: usize) -> u64 {
    (HEADER_LEN as u64).saturating_add(encoding.encoded_len(values) as u64)
}

/// The pace of a shard whose connected sessions' `Params` frames sum to `demand` bytes, under
/// a share of `shard_budget` bytes per second: `demand / shard_budget` seconds, the least
/// interval between one worker's pulls that keeps the shard's egress within its share if
/// every worker pulled at that rate. 0 (no pace) for a budget that is not positive and finite.
pub fn pace_s(demand: u64, shard_budget: f64) -> f64 {
    if shard_budget.is_finite() && shard_budget > 0.0 {
        demand as f64 / shard_budget
    } else {
        0.0
    }
}

/// A pace as the whole milliseconds a `Params` header's `aux` carries: rounded up, so a worker
/// that honours it never pulls faster than the shard asked; saturating; 0 for none.
pub fn pace_ms(pace_s: f64) -> u32 {
    if pace_s.is_finite() && pace_s > 0.0 {
        (pace_s * 1000.0).ceil().min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

/// A `Params` header's `aux` back in seconds, at most [`MAX_PACE`].
pub fn pace_from_ms(ms: u32) -> f64 {
    (f64::from(ms) / 1000.0).min(MAX_PACE)
}

/// `H` under `--local-steps auto` with a pace: the controller's `h`, raised so one round's
/// compute (`H · compute_s`) covers the pace, `max(h, ⌈pace / compute_s⌉)`, within `1..=max`.
/// Without a measured compute time, or without a pace, `h` stays.
pub fn paced_steps(h: u32, pace_s: f64, compute_s: Option<f64>, max: u32) -> u32 {
    let h = h.clamp(1, max.max(1));
    let Some(tc) = compute_s.filter(|t| t.is_finite() && *t > 0.0) else {
        return h;
    };
    if !(pace_s.is_finite() && pace_s > 0.0) {
        return h;
    }
    // `as` saturates; the ratio is finite and positive here.
    let need = (pace_s / tc).ceil() as u32;
    h.max(need).clamp(1, max.max(1))
}

/// When a worker may send its next batch of pulls: `pace` after the previous batch went out
/// (`last`), or `None` (at once) when there was none or there is no pace.
pub fn pull_due(last: Option<f64>, pace_s: f64) -> Option<f64> {
    let last = last?;
    (pace_s.is_finite() && pace_s > 0.0).then(|| last + pace_s.min(MAX_PACE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_in_bits_and_bytes() {
        let b = |s: &str| EgressBudget::parse(s).unwrap().get();
        assert_eq!(b("400mbit"), Some(50e6));
        assert_eq!(b("400Mbit/s"), Some(50e6));
        assert_eq!(b("400mbps"), Some(50e6));
        assert_eq!(b("50MB"), Some(50e6));
        assert_eq!(b("50 MB/s"), Some(50e6));
        assert_eq!(b("1gbit"), Some(125e6));
        assert_eq!(b("2kib"), Some(2048.0));
        assert_eq!(b("1.5mb"), Some(1.5e6));
        assert_eq!(b("50000000"), Some(50e6));
        assert_eq!(b("50_000"), Some(50e3));
        assert_eq!(b("0"), None);
        assert_eq!(b("off"), None);
        assert_eq!(b(" OFF "), None);
        assert_eq!(b("0mbit"), None);
        for bad in [
            "",
            "mbit",
            "-5mb",
            "400furlongs",
            "nan",
            "inf",
            "1e400",
            "400",
            "1..2mb",
            "5e13",
        ] {
            let e = EgressBudget::parse(bad).unwrap_err().to_string();
            assert!(e.contains("egress budget"), "{bad}: {e}");
        }
        assert_eq!(
            EgressBudget::parse(SUGGESTED_EGRESS_BUDGET).unwrap(),
            EgressBudget::bytes_per_second(50e6).unwrap()
        );
        assert_eq!(
            EgressBudget::parse(DEFAULT_EGRESS_BUDGET).unwrap(),
            EgressBudget::bytes_per_second(50e6).unwrap()
        );
        assert_eq!(
            EgressBudget::parse("400mbit").unwrap().to_string(),
            "50000000 B/s (400 Mbit/s)"
        );
        assert_eq!(EgressBudget::OFF.to_string(), "off");
    }

    #[test]
    fn each_shard_gets_its_share_and_paces_its_sum_of_frames() {
        let p = Pacing {
            budget: EgressBudget::bytes_per_second(1e6).unwrap(),
            model_len: 1000,
        };
        assert_eq!(p.shard_budget(250), Some(250_000.0));
        assert_eq!(p.shard_budget(750), Some(750_000.0));
        // 10 workers pulling 500 bf16 values (1,032-byte frames) from a 250 kB/s share.
        let frame = params_frame_bytes(Encoding::Bf16, 500);
        assert_eq!(frame, 32 + 1000);
        let pace = p.pace_s(250, 10 * frame);
        assert!((pace - 10.0 * 1032.0 / 250_000.0).abs() < 1e-12);
        // Every worker pulling once per pace sends exactly the share.
        assert!((10.0 * frame as f64 / pace - 250_000.0).abs() < 1e-6);
        // Shards' paces nearly agree when their frames are proportional to their ranges; the
        // 32-byte headers weigh more on the smaller one, whose pace is the longer.
        let a = p.pace_s(250, 10 * params_frame_bytes(Encoding::F32, 250));
        let b = p.pace_s(750, 10 * params_frame_bytes(Encoding::F32, 750));
        assert!(a > b && (a - b) / b < 0.03, "{a} {b}");
        assert_eq!(Pacing::OFF.pace_s(250, 1 << 30), 0.0);
        assert_eq!(pace_s(1000, 0.0), 0.0);
        assert_eq!(pace_s(1000, f64::NAN), 0.0);
        assert_eq!(pace_s(0, 1e6), 0.0, "nobody connected");
    }

    #[test]
    fn pace_travels_in_whole_milliseconds_rounded_up() {
        assert_eq!(pace_ms(0.0), 0);
        assert_eq!(pace_ms(-1.0), 0);
        assert_eq!(pace_ms(f64::NAN), 0);
        assert_eq!(pace_ms(0.0001), 1);
        assert_eq!(pace_ms(0.004), 4);
        assert_eq!(pace_ms(0.0041), 5);
        assert_eq!(pace_ms(1e12), u32::MAX);
        assert_eq!(pace_from_ms(250), 0.25);
        assert_eq!(pace_from_ms(u32::MAX), MAX_PACE);
    }

    #[test]
    fn auto_lengthens_rounds_to_cover_the_pace() {
        // 2 ms steps, a 100 ms pace: 50 steps, over the controller's 6.
        assert_eq!(paced_steps(6, 0.1, Some(0.002), 4096), 50);
        // The controller's choice stands when it already covers the pace.
        assert_eq!(paced_steps(80, 0.1, Some(0.002), 4096), 80);
        // The run's bound wins.
        assert_eq!(paced_steps(6, 0.1, Some(0.002), 32), 32);
        // Nothing measured or no pace: unchanged.
        assert_eq!(paced_steps(6, 0.1, None, 4096), 6);
        assert_eq!(paced_steps(6, 0.0, Some(0.002), 4096), 6);
        assert_eq!(paced_steps(6, f64::INFINITY, Some(0.002), 4096), 6);
        assert_eq!(paced_steps(0, 0.0, None, 0), 1);
    }

    #[test]
    fn pulls_wait_a_pace_after_the_last_batch() {
        assert_eq!(pull_due(None, 1.0), None, "first pull at once");
        assert_eq!(pull_due(Some(10.0), 0.0), None, "no pace");
        assert_eq!(pull_due(Some(10.0), 0.25), Some(10.25));
        assert_eq!(pull_due(Some(10.0), 1e9), Some(10.0 + MAX_PACE));
    }
}
