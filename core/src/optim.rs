//! Optimizers as pure update rules over slices with explicit state (burn's `SimpleOptimizer`
//! shape): [`step`] takes the parameters of one shard, the gradient slice for them and the
//! [`OptState`] the shard owns. Every rule is element-wise, so applying one push to N shards gives
//! bit-for-bit the same parameters as applying it to one unsharded vector.
//!
//! Weight decay is L2 regularisation folded into the gradient (`g + wd * p`) for every rule but
//! [`Rule::AdamW`], whose decay is decoupled from the gradient (Loshchilov & Hutter 2019):
//! `p -= lr * (m̂ / (sqrt(v̂) + eps) + wd * p)`, as PyTorch's `AdamW` does. Gradient clipping by
//! global norm is done by the worker on the full gradient before it is sliced
//! ([`clip_by_global_norm`]), because a shard only sees its own slice; it clips every inner
//! step's gradient too under local steps.
//!
//! A learning-rate schedule ([`crate::schedule::Schedule`], in [`OptimizerConfig::schedule`])
//! is applied by the caller through `lr_scale`: [`step`] does not know the version it runs at.

use crate::error::{Error, Result};
use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};

/// The update rule and its own hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Rule {
    /// `p -= lr * g`.
    Sgd,
    /// Heavy-ball momentum (TensorFlow's `MomentumOptimizer`): `v = mu v + g; p -= lr v`, or with
    /// Nesterov `p -= lr (g + mu v)`.
    Momentum {
        /// Momentum coefficient `mu` in `[0, 1)`.
        momentum: f32,
        /// Use Nesterov's look-ahead form.
        nesterov: bool,
    },
    /// Adagrad: `a += g^2; p -= lr g / (sqrt(a) + eps)`.
    Adagrad {
        /// Starting value of the accumulator (TensorFlow uses 0.1).
        initial_accumulator: f32,
        /// Added to the root for stability.
        eps: f32,
    },
    /// RMSProp: `s = rho s + (1 - rho) g^2; p -= lr g / (sqrt(s) + eps)`.
    RmsProp {
        /// Decay `rho` of the running mean square.
        decay: f32,
        /// Added to the root for stability.
        eps: f32,
    },
    /// Adam with bias correction (Kingma & Ba 2015).
    Adam {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root for stability.
        eps: f32,
    },
    /// AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019), `p -= lr * (m̂ /
    /// (sqrt(v̂) + eps) + wd * p)` with [`OptimizerConfig::weight_decay`] as `wd`, on every
    /// parameter. Its defaults are the language-model recipe (GPT-3, Chinchilla, nanoGPT; the
    /// PyTorch comparison peer's): betas 0.9 / 0.95, eps 1e-8, weight decay 0.1
    /// ([`Rule::default_weight_decay`]).
    #[serde(rename = "adamw")]
    AdamW {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root for stability.
        eps: f32,
    },
}

impl Rule {
    /// The rule named `name` with its customary defaults: `sgd`, `momentum`, `nesterov`,
    /// `adagrad`, `rmsprop`, `adam`, `adamw`.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown name.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "sgd" => Rule::Sgd,
            "momentum" => Rule::Momentum {
                momentum: 0.9,
                nesterov: false,
            },
            "nesterov" => Rule::Momentum {
                momentum: 0.9,
                nesterov: true,
            },
            "adagrad" => Rule::Adagrad {
                initial_accumulator: 0.1,
                eps: 1e-7,
            },
            "rmsprop" => Rule::RmsProp {
                decay: 0.9,
                eps: 1e-7,
            },
            "adam" => Rule::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-7,
            },
            // β2 = 0.95 rather than 0.999: a second moment that forgets in ~20 steps follows
            // the gradient-scale jumps of language-model training, which 0.999 answers with
            // too large steps (the GPT-3 / nanoGPT setting); eps is PyTorch's.
            "adamw" => Rule::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
            },
            other => {
                return Err(Error::Config(format!(
                    "unknown optimizer {other:?} (expected sgd, momentum, nesterov, adagrad, rmsprop, adam or adamw)"
                )))
            }
        })
    }

    /// How many state values per parameter the rule keeps.
    pub fn slots(&self) -> usize {
        match self {
            Rule::Sgd => 0,
            Rule::Momentum { .. } | Rule::Adagrad { .. } | Rule::RmsProp { .. } => 1,
            Rule::Adam { .. } | Rule::AdamW { .. } => 2,
        }
    }

    /// The weight decay a run gets unless it names one: 0.1 for `adamw` (decoupled: at lr
    /// 0.001 it shrinks a weight by 1e-4 per update, a half-life of ~7,000 updates; the
    /// language-model recipe its defaults come from), 0 for every other rule (where the decay
    /// is an L2 term in the gradient, off unless asked for).
    pub fn default_weight_decay(&self) -> f32 {
        match self {
            Rule::AdamW { .. } => 0.1,
            _ => 0.0,
        }
    }

    /// Stable names of the rule's state slots, in slot order (`slot0`, `slot1`). Checkpoints
    /// store slot `i` of tensor `T` as `T.{name}`, e.g. `layer0.weight.adagrad_acc`. AdamW's
    /// moments are Adam's and keep Adam's names.
    pub fn slot_names(&self) -> &'static [&'static str] {
        match self {
            Rule::Sgd => &[],
            Rule::Momentum { .. } => &["momentum"],
            Rule::Adagrad { .. } => &["adagrad_acc"],
            Rule::RmsProp { .. } => &["rmsprop_sq"],
            Rule::Adam { .. } | Rule::AdamW { .. } => &["adam_m", "adam_v"],
        }
    }

    /// The rule's name as `--optimizer` takes it (`nesterov` for Nesterov momentum).
    pub fn name(&self) -> &'static str {
        match self {
            Rule::Sgd => "sgd",
            Rule::Momentum {
                nesterov: false, ..
            } => "momentum",
            Rule::Momentum { nesterov: true, .. } => "nesterov",
            Rule::Adagrad { .. } => "adagrad",
            Rule::RmsProp { .. } => "rmsprop",
            Rule::Adam { .. } => "adam",
            Rule::AdamW { .. } => "adamw",
        }
    }
}

/// Hyperparameters of a shard's optimizer. Build it, then call [`OptimizerConfig::validate`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// The update rule.
    pub rule: Rule,
    /// Learning rate.
    pub lr: f32,
    /// Weight decay: L2 folded into the gradient, or decoupled for [`Rule::AdamW`]; 0
    /// disables it.
    pub weight_decay: f32,
    /// Clip the worker's full gradient (every inner step's, under local steps) to this global
    /// L2 norm; `None` disables it. Read from the shards' optimizer of the run spec.
    pub clip_norm: Option<f32>,
    /// The learning-rate schedule (absent in JSON: the constant rate). The caller applies it
    /// through `lr_scale` ([`crate::schedule`] says who and at which version).
    #[serde(default, skip_serializing_if = "Schedule::is_constant")]
    pub schedule: Schedule,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            rule: Rule::from_name("adagrad").unwrap_or(Rule::Sgd),
            lr: 0.05,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Schedule::default(),
        }
    }
}

impl OptimizerConfig {
    /// Checks every value is finite and in range, the schedule's too.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        self.schedule.validate()?;
        let bad = |what: &str, v: f32| Err(Error::Config(format!("{what} = {v} is out of range")));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("learning rate", self.lr);
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight decay", self.weight_decay);
        }
        if let Some(c) = self.clip_norm {
            if !(c.is_finite() && c > 0.0) {
                return bad("clip norm", c);
            }
        }
        let unit = |v: f32| v.is_finite() && (0.0..1.0).contains(&v);
        let pos = |v: f32| v.is_finite() && v > 0.0;
        match self.rule {
            Rule::Sgd => Ok(()),
            Rule::Momentum { momentum, .. } if !unit(momentum) => bad("momentum", momentum),
            Rule::Adagrad {
                initial_accumulator,
                ..
            } if !(initial_accumulator.is_finite() && initial_accumulator >= 0.0) => {
                bad("initial accumulator", initial_accumulator)
            }
            Rule::Adagrad { eps, .. }
            | Rule::RmsProp { eps, .. }
            | Rule::Adam { eps, .. }
            | Rule::AdamW { eps, .. }
                if !pos(eps) =>
            {
                bad("epsilon", eps)
            }
            Rule::RmsProp { decay, .. } if !unit(decay) => bad("decay", decay),
            Rule::Adam { beta1, .. } | Rule::AdamW { beta1, .. } if !unit(beta1) => {
                bad("beta1", beta1)
            }
            Rule::Adam { beta2, .. } | Rule::AdamW { beta2, .. } if !unit(beta2) => {
                bad("beta2", beta2)
            }
            _ => Ok(()),
        }
    }
}

/// Per-parameter optimizer state for one shard (or one unsharded vector).
#[derive(Debug, Clone, PartialEq)]
pub struct OptState {
    /// First state slot (velocity, accumulator, mean square or first moment).
    pub slot0: Vec<f32>,
    /// Second state slot (Adam's second moment).
    pub slot1: Vec<f32>,
    /// Number of updates applied so far (Adam's bias correction uses it).
    pub t: u64,
}

impl OptState {
    /// Fresh state for `len` parameters under `rule`.
    pub fn new(rule: &Rule, len: usize) -> Self {
        let init = match rule {
            Rule::Adagrad {
                initial_accumulator,
                ..
            } => *initial_accumulator,
            _ => 0.0,
        };
        let slots = rule.slots();
        Self {
            slot0: if slots >= 1 {
                vec![init; len]
            } else {
                Vec::new()
            },
            slot1: if slots >= 2 {
                vec![0.0; len]
            } else {
                Vec::new()
            },
            t: 0,
        }
    }

    /// The state slots `rule` keeps, in slot order, each as long as the parameters
    /// ([`Rule::slot_names`] names them).
    pub fn slots(&self, rule: &Rule) -> Vec<&[f32]> {
        [&self.slot0[..], &self.slot1[..]]
            .into_iter()
            .take(rule.slots())
            .collect()
    }

    /// State for `len` parameters under `rule` from saved slots (in slot order) and the update
    /// count `t`: the inverse of [`OptState::slots`].
    ///
    /// # Errors
    /// [`Error::Config`] when the number of slots is not the rule's, a slot's length is not
    /// `len`, or a value is not finite.
    pub fn from_slots(rule: &Rule, len: usize, slots: Vec<Vec<f32>>, t: u64) -> Result<Self> {
        if slots.len() != rule.slots() {
            return Err(Error::Config(format!(
                "optimizer {} keeps {} state slots, got {}",
                rule.name(),
                rule.slots(),
                slots.len()
            )));
        }
        for (name, s) in rule.slot_names().iter().zip(&slots) {
            if s.len() != len {
                return Err(Error::Config(format!(
                    "optimizer slot {name} holds {} values for {len} parameters",
                    s.len()
                )));
            }
            if s.iter().any(|v| !v.is_finite()) {
                return Err(Error::Config(format!(
                    "optimizer slot {name} holds a non-finite value"
                )));
            }
        }
        let mut it = slots.into_iter();
        Ok(Self {
            slot0: it.next().unwrap_or_default(),
            slot1: it.next().unwrap_or_default(),
            t,
        })
    }
}

/// Applies one gradient to `params` in place. `lr_scale` multiplies the learning rate (1.0 for a
/// plain step; staleness policies use it).
///
/// # Panics
/// If `grad` or the state slots do not match `params` in length: the caller (the shard) checks
/// lengths of everything that comes from the network before it calls this.
pub fn step(
    cfg: &OptimizerConfig,
    state: &mut OptState,
    params: &mut [f32],
    grad: &[f32],
    lr_scale: f32,
) {
    assert_eq!(params.len(), grad.len(), "gradient length");
    let lr = cfg.lr * lr_scale;
    let wd = cfg.weight_decay;
    state.t += 1;
    match cfg.rule {
        Rule::Sgd => {
            for (p, &g) in params.iter_mut().zip(grad) {
                *p -= lr * (g + wd * *p);
            }
        }
        Rule::Momentum { momentum, nesterov } => {
            let v = &mut state.slot0[..params.len()];
            for ((p, &g), v) in params.iter_mut().zip(grad).zip(v) {
                let g = g + wd * *p;
                *v = momentum * *v + g;
                let d = if nesterov { g + momentum * *v } else { *v };
                *p -= lr * d;
            }
        }
        Rule::Adagrad { eps, .. } => {
            let a = &mut state.slot0[..params.len()];
            for ((p, &g), a) in params.iter_mut().zip(grad).zip(a) {
                let g = g + wd * *p;
                *a += g * g;
                *p -= lr * g / (a.sqrt() + eps);
            }
        }
        Rule::RmsProp { decay, eps } => {
            let s = &mut state.slot0[..params.len()];
            for ((p, &g), s) in params.iter_mut().zip(grad).zip(s) {
                let g = g + wd * *p;
                *s = decay * *s + (1.0 - decay) * g * g;
                *p -= lr * g / (s.sqrt() + eps);
            }
        }
        Rule::Adam { beta1, beta2, eps } => {
            let t = state.t.min(i32::MAX as u64) as i32;
            let c1 = 1.0 / (1.0 - beta1.powi(t));
            let c2 = 1.0 / (1.0 - beta2.powi(t));
            let (m, v) = (
                &mut state.slot0[..params.len()],
                &mut state.slot1[..params.len()],
            );
            for (((p, &g), m), v) in params.iter_mut().zip(grad).zip(m).zip(v) {
                let g = g + wd * *p;
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *p -= lr * (*m * c1) / ((*v * c2).sqrt() + eps);
            }
        }
        Rule::AdamW { beta1, beta2, eps } => {
            let t = state.t.min(i32::MAX as u64) as i32;
            let c1 = 1.0 / (1.0 - beta1.powi(t));
            let c2 = 1.0 / (1.0 - beta2.powi(t));
            let (m, v) = (
                &mut state.slot0[..params.len()],
                &mut state.slot1[..params.len()],
            );
            for (((p, &g), m), v) in params.iter_mut().zip(grad).zip(m).zip(v) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *p -= lr * ((*m * c1) / ((*v * c2).sqrt() + eps) + wd * *p);
            }
        }
    }
}

/// Scales `grad` down so its L2 norm is at most `max_norm`; returns the norm before clipping.
pub fn clip_by_global_norm(grad: &mut [f32], max_norm: f32) -> f32 {
    let norm = grad.iter().map(|&g| g * g).sum::<f32>().sqrt();
    if norm > max_norm && norm > 0.0 {
        let s = max_norm / norm;
        grad.iter_mut().for_each(|g| *g *= s);
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rule: Rule, lr: f32) -> OptimizerConfig {
        OptimizerConfig {
            rule,
            lr,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Schedule::default(),
        }
    }

    fn close(a: f32, b: f32) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn sgd_by_hand() {
        let c = cfg(Rule::Sgd, 0.1);
        let mut s = OptState::new(&c.rule, 2);
        let mut p = [1.0, -2.0];
        step(&c, &mut s, &mut p, &[0.5, -1.0], 1.0);
        close(p[0], 0.95);
        close(p[1], -1.9);
        // lr_scale halves the move.
        step(&c, &mut s, &mut p, &[1.0, 0.0], 0.5);
        close(p[0], 0.90);
    }

    #[test]
    fn weight_decay_by_hand() {
        let mut c = cfg(Rule::Sgd, 0.1);
        c.weight_decay = 0.5;
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [2.0];
        step(&c, &mut s, &mut p, &[0.0], 1.0);
        close(p[0], 2.0 - 0.1 * 1.0);
    }

    #[test]
    fn momentum_and_nesterov_by_hand() {
        let c = cfg(
            Rule::Momentum {
                momentum: 0.9,
                nesterov: false,
            },
            0.1,
        );
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [1.0];
        step(&c, &mut s, &mut p, &[1.0], 1.0); // v = 1, p = 0.9
        close(p[0], 0.9);
        step(&c, &mut s, &mut p, &[1.0], 1.0); // v = 1.9, p = 0.71
        close(p[0], 0.71);

        let c = cfg(
            Rule::Momentum {
                momentum: 0.9,
                nesterov: true,
            },
            0.1,
        );
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [1.0];
        step(&c, &mut s, &mut p, &[1.0], 1.0); // v = 1, d = 1 + 0.9 = 1.9, p = 0.81
        close(p[0], 0.81);
        step(&c, &mut s, &mut p, &[1.0], 1.0); // v = 1.9, d = 1 + 1.71 = 2.71, p = 0.539
        close(p[0], 0.539);
    }

    #[test]
    fn adagrad_by_hand() {
        let c = cfg(
            Rule::Adagrad {
                initial_accumulator: 0.1,
                eps: 0.0,
            },
            0.1,
        );
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [1.0];
        step(&c, &mut s, &mut p, &[0.3], 1.0); // a = 0.19
        close(s.slot0[0], 0.19);
        close(p[0], 1.0 - 0.1 * 0.3 / 0.19f32.sqrt());
    }

    #[test]
    fn rmsprop_by_hand() {
        let c = cfg(
            Rule::RmsProp {
                decay: 0.9,
                eps: 0.0,
            },
            0.01,
        );
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [1.0];
        step(&c, &mut s, &mut p, &[2.0], 1.0); // s = 0.4, move = 0.01 * 2 / sqrt(0.4)
        close(s.slot0[0], 0.4);
        close(p[0], 1.0 - 0.01 * 2.0 / 0.4f32.sqrt());
    }

    #[test]
    fn adam_by_hand() {
        let c = cfg(
            Rule::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 0.0,
            },
            0.001,
        );
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [1.0];
        // First Adam step moves by exactly lr * sign(g) once bias-corrected.
        step(&c, &mut s, &mut p, &[5.0], 1.0);
        close(p[0], 0.999);
        // Second step, g = 1: m = 0.09*5*... computed explicitly.
        step(&c, &mut s, &mut p, &[1.0], 1.0);
        let m = 0.9f32 * 0.5 + 0.1 * 1.0;
        let v = 0.999f32 * 0.025 + 0.001 * 1.0;
        let mhat = m / (1.0 - 0.81);
        let vhat = v / (1.0 - 0.998_001);
        close(p[0], 0.999 - 0.001 * mhat / vhat.sqrt());
    }

    #[test]
    fn adamw_by_hand() {
        let mut c = cfg(Rule::from_name("adamw").unwrap(), 0.01);
        c.weight_decay = 0.1;
        let mut s = OptState::new(&c.rule, 1);
        let mut p = [1.0f32];
        // Step 1, g = 5: m̂ = 5, v̂ = 25, so the Adam part is 5 / (5 + 1e-8) ≈ 1; the decay
        // adds wd * p = 0.1.
        step(&c, &mut s, &mut p, &[5.0], 1.0);
        let (b1, b2, eps, lr, wd) = (0.9f64, 0.95f64, 1e-8f64, 0.01f64, 0.1f64);
        let (mut m, mut v, mut want) = (0.0f64, 0.0f64, 1.0f64);
        for (t, g) in [(1, 5.0f64), (2, 1.0), (3, -2.0)] {
            if t > 1 {
                step(&c, &mut s, &mut p, &[g as f32], 1.0);
            }
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let mhat = m / (1.0 - b1.powi(t));
            let vhat = v / (1.0 - b2.powi(t));
            want -= lr * (mhat / (vhat.sqrt() + eps) + wd * want);
            assert!(
                (f64::from(p[0]) - want).abs() < 1e-6,
                "step {t}: {} != {want}",
                p[0]
            );
        }
        assert!(
            (f64::from(p[0]) - (1.0 - 0.01 * 1.1)).abs() > 1e-4,
            "moved on"
        );
        // lr_scale (a schedule's factor) scales the decay too, as PyTorch's group lr does.
        let mut s = OptState::new(&c.rule, 1);
        let mut q = [2.0f32];
        step(&c, &mut s, &mut q, &[0.0], 0.5);
        assert_eq!(q[0], 2.0 - (0.01 * 0.5) * (0.1 * 2.0));
    }

    #[test]
    fn adamw_decay_is_decoupled() {
        // A zero gradient leaves the moments at 0: the parameter shrinks by exactly lr*wd*p.
        let mut c = cfg(Rule::from_name("adamw").unwrap(), 0.01);
        c.weight_decay = 0.1;
        let mut s = OptState::new(&c.rule, 3);
        let start = [1.0f32, -3.0, 0.25];
        let mut p = start;
        step(&c, &mut s, &mut p, &[0.0; 3], 1.0);
        for (got, p0) in p.iter().zip(start) {
            assert_eq!(*got, p0 - 0.01 * (0.1 * p0));
        }
        assert_eq!(s.slot0, vec![0.0; 3]);
        assert_eq!(s.slot1, vec![0.0; 3]);
        // Adam's L2 decay goes through the moments instead: its first step is a full lr.
        let mut a = c;
        a.rule = Rule::from_name("adam").unwrap();
        let mut sa = OptState::new(&a.rule, 1);
        let mut q = [1.0f32];
        step(&a, &mut sa, &mut q, &[0.0], 1.0);
        close(q[0], 1.0 - 0.01);
        // Without decay AdamW is Adam with its betas.
        let mut w = cfg(Rule::from_name("adamw").unwrap(), 0.001);
        let mut adam = cfg(
            Rule::Adam {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
            },
            0.001,
        );
        w.weight_decay = 0.0;
        adam.weight_decay = 0.0;
        let (mut sw, mut sa) = (OptState::new(&w.rule, 2), OptState::new(&adam.rule, 2));
        let (mut pw, mut pa) = ([0.5f32, -0.5], [0.5f32, -0.5]);
        for g in [[1.0f32, 0.1], [-0.3, 0.2], [0.7, -0.9]] {
            step(&w, &mut sw, &mut pw, &g, 1.0);
            step(&adam, &mut sa, &mut pa, &g, 1.0);
        }
        for (x, y) in pw.iter().zip(pa) {
            close(*x, y);
        }
    }

    #[test]
    fn adamw_defaults_and_json() {
        let r = Rule::from_name("adamw").unwrap();
        assert_eq!(
            r,
            Rule::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8
            }
        );
        assert_eq!(r.default_weight_decay(), 0.1);
        assert_eq!(Rule::from_name("adam").unwrap().default_weight_decay(), 0.0);
        assert_eq!(
            r.slot_names(),
            Rule::from_name("adam").unwrap().slot_names()
        );
        let json = serde_json::to_value(r).unwrap();
        assert_eq!(json["kind"], "adamw");
        assert_eq!(serde_json::from_value::<Rule>(json).unwrap(), r);
    }

    #[test]
    fn a_config_without_a_schedule_decodes_and_one_with_round_trips() {
        // JSON of a run spec's optimizer from before schedules existed.
        let old = r#"{"rule":{"kind":"adagrad","initial_accumulator":0.1,"eps":1e-7},
                      "lr":0.05,"weight_decay":0.0,"clip_norm":null}"#;
        let c: OptimizerConfig = serde_json::from_str(old).unwrap();
        assert_eq!(c.schedule, Schedule::default());
        assert!(c.validate().is_ok());
        // A constant schedule is left out, so such a spec encodes as it did.
        let json = serde_json::to_value(c).unwrap();
        assert!(json.get("schedule").is_none(), "{json}");
        let mut s = c;
        s.rule = Rule::from_name("adamw").unwrap();
        s.schedule = Schedule {
            warmup: 64,
            decay: crate::schedule::Decay::Cosine,
            decay_samples: 6400,
            min_ratio: 0.1,
            samples_per_version: 32,
            counted: false,
        };
        let back: OptimizerConfig =
            serde_json::from_value(serde_json::to_value(s).unwrap()).unwrap();
        assert_eq!(back, s);
        // A bad schedule makes the config invalid.
        s.schedule.decay_samples = 10;
        assert!(s.validate().is_err());
    }

    #[test]
    fn sharded_apply_equals_unsharded() {
        let schedule = Schedule {
            warmup: 2,
            decay: crate::schedule::Decay::Cosine,
            decay_samples: 5,
            min_ratio: 0.1,
            samples_per_version: 1,
            counted: false,
        };
        let names = [
            "sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw",
        ];
        for (name, schedule) in names
            .iter()
            .flat_map(|n| [(*n, Schedule::default()), (*n, schedule)])
        {
            let c = OptimizerConfig {
                rule: Rule::from_name(name).unwrap(),
                lr: 0.01,
                weight_decay: 1e-4,
                clip_norm: None,
                schedule,
            };
            let n = 1001;
            let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let grads: Vec<Vec<f32>> = (0..5)
                .map(|k| {
                    (0..n)
                        .map(|i| ((i * (k + 3)) as f32 * 0.11).cos())
                        .collect()
                })
                .collect();
            // Each update at its version's factor, as every shard computes it for itself.
            let mut whole = init.clone();
            let mut ws = OptState::new(&c.rule, n);
            for (v, g) in grads.iter().enumerate() {
                step(&c, &mut ws, &mut whole, g, c.schedule.factor(v as u64));
            }
            let ranges = crate::partition::partition(n, 4).unwrap();
            let mut sharded = init.clone();
            for r in ranges {
                let mut st = OptState::new(&c.rule, r.len());
                for (v, g) in grads.iter().enumerate() {
                    step(
                        &c,
                        &mut st,
                        &mut sharded[r.start..r.end],
                        &g[r.start..r.end],
                        c.schedule.factor(v as u64),
                    );
                }
            }
            assert_eq!(whole, sharded, "{name} {schedule:?}");
            if !schedule.is_constant() {
                assert_ne!(c.schedule.factor(0), 1.0, "the schedule is exercised");
            }
        }
    }

    #[test]
    fn validation_rejects_bad_values() {
        let mut c = OptimizerConfig::default();
        assert!(c.validate().is_ok());
        c.lr = f32::NAN;
        assert!(c.validate().is_err());
        c.lr = 0.1;
        c.rule = Rule::Momentum {
            momentum: 1.5,
            nesterov: false,
        };
        assert!(c.validate().is_err());
        c.rule = Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 0.0,
        };
        assert!(c.validate().is_err());
        c.rule = Rule::AdamW {
            beta1: 0.9,
            beta2: 1.0,
            eps: 1e-8,
        };
        assert!(c.validate().is_err());
        c.rule = Rule::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: -1.0,
        };
        assert!(c.validate().is_err());
        c.rule = Rule::Sgd;
        c.clip_norm = Some(-1.0);
        assert!(c.validate().is_err());
        assert!(Rule::from_name("lbfgs").is_err());
    }

    #[test]
    fn slots_round_trip_and_are_checked() {
        for name in [
            "sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw",
        ] {
            let rule = Rule::from_name(name).unwrap();
            assert_eq!(rule.name(), name);
            assert_eq!(rule.slot_names().len(), rule.slots());
            let c = cfg(rule, 0.01);
            let mut s = OptState::new(&rule, 3);
            let mut p = [1.0, 2.0, 3.0];
            step(&c, &mut s, &mut p, &[0.5, -0.5, 0.25], 1.0);
            let saved: Vec<Vec<f32>> = s.slots(&rule).iter().map(|v| v.to_vec()).collect();
            let back = OptState::from_slots(&rule, 3, saved.clone(), s.t).unwrap();
            assert_eq!(back, s, "{name}");
            assert!(OptState::from_slots(&rule, 4, saved.clone(), 1).is_err() || saved.is_empty());
            let mut extra = saved.clone();
            extra.push(vec![0.0; 3]);
            assert!(OptState::from_slots(&rule, 3, extra, 1).is_err(), "{name}");
            if let Some(first) = saved.first() {
                let mut nan = saved.clone();
                nan[0] = vec![f32::NAN; first.len()];
                assert!(OptState::from_slots(&rule, 3, nan, 1).is_err());
            }
        }
    }

    #[test]
    fn clip_scales_to_norm() {
        let mut g = [3.0, 4.0];
        assert_eq!(clip_by_global_norm(&mut g, 1.0), 5.0);
        close(g[0], 0.6);
        close(g[1], 0.8);
        let mut g = [0.3, 0.4];
        clip_by_global_norm(&mut g, 1.0);
        assert_eq!(g, [0.3, 0.4]);
    }
}
