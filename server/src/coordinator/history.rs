//! What the host and the teacher look back on (issue 19): the evaluation history of every
//! experiment with wall-clock times ([`Experiments`], `GET /api/evals`, saved in checkpoints),
//! and the ring of the run's figures every [`FIGURE_EVERY_S`] seconds ([`Figures`], `GET
//! /api/history`).
//!
//! Both are bounded. An experiment keeps its last [`RECENT`] evaluation points whole and the
//! older ones thinned to at most [`LONG`] more (every other one dropped when full, the first
//! and the last kept), so a run of days still draws its whole curve. The figures ring keeps
//! [`FIGURES_RECENT`] points (24 h at 5 s) whole and thins older ones the same way into at
//! most [`FIGURES_LONG`] more.
//!
//! Nothing here reads the registry or a shard: the evaluator and the dashboard task hand in
//! the figures they already read ([`crate::registry::Registry::summary`] copies the totals
//! out under the registry's lock and nothing else).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Evaluation points an experiment keeps whole.
pub const RECENT: usize = 2_000;
/// Older evaluation points kept, thinned.
pub const LONG: usize = 2_000;
/// An evaluation point is recorded at least this often while nothing moves (the same figures
/// with a new time), so the chart draws a flat segment, not a line across the idle time.
pub const IDLE_EVERY_MS: u64 = 30_000;
/// Experiments kept (the oldest are dropped beyond it).
pub const MAX_EXPERIMENTS: usize = 32;

/// Seconds between two points of the figures ring.
pub const FIGURE_EVERY_S: u64 = 5;
/// Figures kept whole: 24 hours at [`FIGURE_EVERY_S`].
pub const FIGURES_RECENT: usize = 17_280;
/// Older figures kept, thinned.
pub const FIGURES_LONG: usize = 2_000;

/// Milliseconds since the Unix epoch, now.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How often the guesses (`/api/guesses`) are recomputed at most.
pub const GUESS_EVERY: std::time::Duration = std::time::Duration::from_secs(3);

/// `GET /api/guesses`, built at most every [`GUESS_EVERY`] and shared by all viewers.
#[derive(Debug, Default)]
pub struct GuessCache {
    built: tokio::sync::Mutex<Option<(std::time::Instant, bytes::Bytes)>>,
}

impl GuessCache {
    /// The JSON body now: the cached one, or (at most every [`GUESS_EVERY`]) what `build`
    /// makes, on a blocking thread. One caller builds while the others wait for it.
    pub async fn get(
        &self,
        build: impl FnOnce() -> serde_json::Value + Send + 'static,
    ) -> bytes::Bytes {
        let mut g = self.built.lock().await;
        if let Some((at, body)) = g.as_ref() {
            if at.elapsed() < GUESS_EVERY {
                return body.clone();
            }
        }
        let body = tokio::task::spawn_blocking(build).await.unwrap_or_default();
        let body = bytes::Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        *g = Some((std::time::Instant::now(), body.clone()));
        body
    }
}

/// One evaluation point of an experiment (`/api/evals`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// When, milliseconds since the Unix epoch.
    pub t_ms: u64,
    /// Training examples behind the parameters, counted from the experiment's start.
    pub samples: u64,
    /// Test accuracy in [0, 1] (null if not finite).
    pub accuracy: Option<f64>,
    /// Mean test loss.
    pub loss: f64,
    /// A language model's validation bits per token (null for other models).
    pub bits_per_token: Option<f64>,
}

/// What an experiment ran with (`settings` in `/api/evals`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// `async`, `ssp:S` or `sync:K`.
    pub consistency: String,
    /// The shards' learning rate (the peak of a schedule).
    pub lr: f64,
    /// How the shards combine pushes (`mean`, `median`, ...).
    pub aggregation: String,
    /// The model as `--model` takes it (e.g. `mlp:128`).
    pub model: String,
    /// The shards' optimizer rule.
    pub optimizer: String,
    /// Examples per gradient.
    pub batch_size: usize,
    /// The seed of its initial weights.
    pub seed: u64,
    /// Parameter shards.
    pub shards: usize,
    /// The staleness policy.
    pub staleness: String,
    /// Inner steps per push.
    pub local_steps: String,
}

/// One experiment: settings, start, and its evaluation points (thinned as the module says).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Experiment {
    /// From 1, one more per experiment started.
    pub id: u32,
    /// The teacher's name for it.
    pub label: String,
    /// When it started, milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// What it ran with.
    pub settings: Settings,
    /// Most workers connected at once while it ran.
    pub workers_seen: u64,
    /// The server's sample counter when it started (counted from the process start).
    #[serde(default)]
    pub samples_base: u64,
    /// Samples the experiment had before the server restarted (a restart starts the
    /// counter over).
    #[serde(default)]
    pub samples_carried: u64,
    /// Older points, thinned.
    #[serde(default)]
    pub long: Vec<Point>,
    /// The newest points, whole.
    #[serde(default)]
    pub recent: VecDeque<Point>,
}

impl Experiment {
    /// A new experiment at `now_ms` with the server's sample counter at `samples_now`.
    pub fn new(id: u32, label: String, settings: Settings, samples_now: u64, now_ms: u64) -> Self {
        Self {
            id,
            label,
            started_ms: now_ms,
            settings,
            workers_seen: 0,
            samples_base: samples_now,
            samples_carried: 0,
            long: Vec::new(),
            recent: VecDeque::new(),
        }
    }

    /// The experiment's own samples for the server's counter at `raw`.
    pub fn samples(&self, raw: u64) -> u64 {
        self.samples_carried + raw.saturating_sub(self.samples_base)
    }

    /// Every point kept, oldest first.
    pub fn points(&self) -> impl Iterator<Item = &Point> {
        self.long.iter().chain(self.recent.iter())
    }

    /// The newest point.
    pub fn last(&self) -> Option<&Point> {
        self.recent.back().or(self.long.last())
    }

    /// Appends `p`, moving the oldest whole point to the thinned range and thinning it when
    /// full (module doc).
    pub fn push(&mut self, p: Point) {
        self.recent.push_back(p);
        while self.recent.len() > RECENT {
            if let Some(old) = self.recent.pop_front() {
                self.long.push(old);
            }
            if self.long.len() > LONG {
                thin(&mut self.long);
            }
        }
    }

    /// The `crowdgrad sim` command that replays this experiment: its model, consistency,
    /// learning rate, aggregation and optimizer, on as many simulated workers as it saw, for
    /// as many samples as it trained (at least 10,000), on `data_dir`.
    pub fn sim_command(&self, data_dir: &str) -> String {
        let s = &self.settings;
        let samples = self.last().map_or(0, |p| p.samples).max(10_000);
        let mut args = vec![
            "crowdgrad".to_string(),
            "sim".into(),
            "--data-dir".into(),
            quote(data_dir),
            "--model".into(),
            quote(&s.model),
            "--optimizer".into(),
            quote(&s.optimizer),
            "--lr".into(),
            format!("{}", s.lr as f32),
            "--consistency".into(),
            quote(&s.consistency),
            "--aggregation".into(),
            quote(&s.aggregation),
            "--staleness".into(),
            quote(&s.staleness),
            "--local-steps".into(),
            quote(&s.local_steps),
            "--batch-size".into(),
            s.batch_size.to_string(),
            "--seed".into(),
            s.seed.to_string(),
            "--shards".into(),
            s.shards.to_string(),
            "--workers".into(),
            self.workers_seen.max(1).to_string(),
            "--samples".into(),
            samples.to_string(),
        ];
        args.push("--out".into());
        args.push(format!("sim-experiment-{}", self.id));
        args.join(" ")
    }
}

/// A shell word for `s`: as it is when it is plain, else in single quotes.
fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:,=+@".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Halves `v`: keeps every other element from the first, and the last.
fn thin<T: Copy>(v: &mut Vec<T>) {
    let last = v.last().copied();
    let odd_len = v.len() % 2 == 1;
    let kept: Vec<T> = v.iter().step_by(2).copied().collect();
    *v = kept;
    if let (Some(l), false) = (last, odd_len) {
        v.push(l);
    }
}

/// Every experiment of the run, the current one last.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Experiments {
    /// Oldest first; never empty once the server runs.
    pub list: Vec<Experiment>,
}

impl Experiments {
    /// The current experiment.
    pub fn current(&self) -> Option<&Experiment> {
        self.list.last()
    }

    /// The current experiment, to change.
    pub fn current_mut(&mut self) -> Option<&mut Experiment> {
        self.list.last_mut()
    }

    /// The next experiment's id.
    pub fn next_id(&self) -> u32 {
        self.list.last().map_or(1, |e| e.id + 1)
    }

    /// Starts `e` (dropping the oldest beyond [`MAX_EXPERIMENTS`]).
    pub fn start(&mut self, e: Experiment) {
        self.list.push(e);
        if self.list.len() > MAX_EXPERIMENTS {
            self.list.remove(0);
        }
    }

    /// The experiment `id`.
    pub fn get(&self, id: u32) -> Option<&Experiment> {
        self.list.iter().find(|e| e.id == id)
    }

    /// After a restart: the server's sample counter starts over at 0, so the current
    /// experiment carries what it had.
    pub fn resumed(&mut self) {
        if let Some(e) = self.list.last_mut() {
            e.samples_carried = e.last().map_or(e.samples_carried, |p| p.samples);
            e.samples_base = 0;
        }
    }

    /// Records an evaluation of the current experiment at `now_ms` with the server's sample
    /// counter at `raw`; with `moved` false (nothing changed since the last evaluation) only
    /// when the last point is at least [`IDLE_EVERY_MS`] old, repeating its figures. Returns
    /// whether a point was recorded.
    /// With `of` set, only while that experiment is current (an evaluation of parameters read
    /// before the next experiment started belongs to none).
    pub fn record(
        &mut self,
        of: Option<u32>,
        now_ms: u64,
        raw: u64,
        figures: Option<(f64, f64, Option<f64>)>,
    ) -> bool {
        let Some(e) = self.list.last_mut() else {
            return false;
        };
        if of.is_some_and(|id| id != e.id) {
            return false;
        }
        let p = match (figures, e.last()) {
            (Some((accuracy, loss, bits)), _) => Point {
                t_ms: now_ms,
                samples: e.samples(raw),
                accuracy: accuracy.is_finite().then_some(accuracy),
                loss,
                bits_per_token: bits,
            },
            (None, Some(last)) if now_ms >= last.t_ms + IDLE_EVERY_MS => Point {
                t_ms: now_ms,
                ..*last
            },
            (None, _) => return false,
        };
        e.push(p);
        true
    }

    /// `GET /api/evals`: `{"experiment", "experiments": [{"id", "label", "started_ms",
    /// "settings", "sim_command", "workers_seen", "points"}]}`.
    pub fn to_json(&self, data_dir: &str) -> serde_json::Value {
        serde_json::json!({
            "experiment": self.current().map_or(0, |e| e.id),
            "experiments": self.list.iter().map(|e| serde_json::json!({
                "id": e.id,
                "label": e.label,
                "started_ms": e.started_ms,
                "settings": e.settings,
                "sim_command": e.sim_command(data_dir),
                "workers_seen": e.workers_seen,
                "points": e.points().collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }

    /// `GET /api/evals.csv?experiment=ID`: `# sim: COMMAND`, the header, one line per point.
    pub fn csv(&self, id: u32, data_dir: &str) -> Option<String> {
        let e = self.get(id)?;
        let mut out = format!("# sim: {}\n", e.sim_command(data_dir));
        out.push_str("t_ms,samples,accuracy,loss,bits_per_token\n");
        let opt = |x: Option<f64>| x.map_or(String::new(), |v| v.to_string());
        for p in e.points() {
            out.push_str(&format!(
                "{},{},{},{},{}\n",
                p.t_ms,
                p.samples,
                opt(p.accuracy),
                p.loss,
                opt(p.bits_per_token)
            ));
        }
        Some(out)
    }
}

/// One point of the figures ring (`/api/history`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// When, milliseconds since the Unix epoch.
    pub t_ms: u64,
    /// The server's sample counter.
    pub samples: u64,
    /// Samples per second over the interval.
    pub samples_per_s: f64,
    /// Volunteers online (a volunteer's threads count once).
    pub volunteers: u64,
    /// Push bytes received per second over the interval.
    pub bytes_up_per_s: f64,
    /// Parameter bytes sent per second over the interval.
    pub bytes_down_per_s: f64,
    /// Pushes refused in the interval, by reason.
    pub rejected: BTreeMap<String, u64>,
    /// Workers quarantined now.
    pub quarantined: u64,
    /// Connections, joins, downloads and pushes the limits refused in the interval.
    pub limit_refusals: u64,
}

/// The cumulative counters one figure is the difference of.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// When, milliseconds since the Unix epoch.
    pub t_ms: u64,
    /// The sample counter.
    pub samples: u64,
    /// Bytes received from workers.
    pub bytes_up: u64,
    /// Bytes sent to workers.
    pub bytes_down: u64,
    /// Pushes refused, by reason.
    pub rejected: BTreeMap<String, u64>,
    /// Everything the limits refused.
    pub limit_refusals: u64,
    /// Volunteers online now.
    pub volunteers: u64,
    /// Workers quarantined now.
    pub quarantined: u64,
}

/// The ring of figures (module doc).
#[derive(Debug, Default)]
pub struct Figures {
    long: Vec<Figure>,
    recent: VecDeque<Figure>,
    last: Option<Totals>,
}

impl Figures {
    /// Takes the counters now: the first call only remembers them; every later one appends
    /// the differences since the previous call as one figure.
    pub fn observe(&mut self, now: Totals) {
        let Some(prev) = self.last.replace(now.clone()) else {
            return;
        };
        let dt = (now.t_ms.saturating_sub(prev.t_ms) as f64 / 1000.0).max(1e-3);
        let per_s = |a: u64, b: u64| a.saturating_sub(b) as f64 / dt;
        let rejected = now
            .rejected
            .iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(prev.rejected.get(k).copied().unwrap_or(0));
                (d > 0).then(|| (k.clone(), d))
            })
            .collect();
        let f = Figure {
            t_ms: now.t_ms,
            samples: now.samples,
            samples_per_s: per_s(now.samples, prev.samples),
            volunteers: now.volunteers,
            bytes_up_per_s: per_s(now.bytes_up, prev.bytes_up),
            bytes_down_per_s: per_s(now.bytes_down, prev.bytes_down),
            rejected,
            quarantined: now.quarantined,
            limit_refusals: now.limit_refusals.saturating_sub(prev.limit_refusals),
        };
        self.recent.push_back(f);
        while self.recent.len() > FIGURES_RECENT {
            if let Some(old) = self.recent.pop_front() {
                self.long.push(old);
            }
            if self.long.len() > FIGURES_LONG {
                thin_figures(&mut self.long);
            }
        }
    }

    /// The figures newer than `since_ms`, oldest first.
    pub fn since(&self, since_ms: u64) -> Vec<Figure> {
        self.long
            .iter()
            .chain(self.recent.iter())
            .filter(|f| f.t_ms > since_ms)
            .cloned()
            .collect()
    }
}

fn thin_figures(v: &mut Vec<Figure>) {
    let n = v.len();
    let kept: Vec<Figure> = v
        .drain(..)
        .enumerate()
        .filter(|(i, _)| i % 2 == 0 || *i + 1 == n)
        .map(|(_, f)| f)
        .collect();
    *v = kept;
}

/// `GET /api/history.csv`: a header line, then one line per figure; `rejected` as
/// `reason:count` pairs separated by `;`.
pub fn figures_csv(figures: &[Figure]) -> String {
    let mut out = String::from(
        "t_ms,samples,samples_per_s,volunteers,bytes_up_per_s,bytes_down_per_s,rejected,quarantined,limit_refusals\n",
    );
    for f in figures {
        let rejected: Vec<String> = f.rejected.iter().map(|(k, v)| format!("{k}:{v}")).collect();
        out.push_str(&format!(
            "{},{},{:.3},{},{:.1},{:.1},{},{},{}\n",
            f.t_ms,
            f.samples,
            f.samples_per_s,
            f.volunteers,
            f.bytes_up_per_s,
            f.bytes_down_per_s,
            rejected.join(";"),
            f.quarantined,
            f.limit_refusals
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            consistency: "async".into(),
            lr: 0.05,
            aggregation: "mean".into(),
            model: "mlp:128".into(),
            optimizer: "adagrad".into(),
            batch_size: 32,
            seed: 42,
            shards: 2,
            staleness: "accept".into(),
            local_steps: "1".into(),
        }
    }

    #[test]
    fn idle_points_repeat_the_figures_every_30_s() {
        let mut x = Experiments::default();
        x.start(Experiment::new(1, "a".into(), settings(), 100, 1_000));
        assert!(!x.record(None, 1_000, 100, None), "nothing to repeat yet");
        assert!(x.record(Some(1), 1_000, 100, Some((0.1, 2.3, None))));
        assert!(!x.record(None, 20_000, 100, None));
        assert!(x.record(None, 31_000, 100, None));
        let pts: Vec<Point> = x.current().unwrap().points().copied().collect();
        assert_eq!(pts.len(), 2);
        assert_eq!((pts[1].t_ms, pts[1].accuracy), (31_000, Some(0.1)));
        assert_eq!(
            pts[1].samples, 0,
            "samples count from the experiment's start"
        );
        assert!(
            !x.record(Some(2), 32_000, 1_100, Some((0.9, 0.1, None))),
            "experiment 2 is not current"
        );
        assert!(x.record(Some(1), 32_000, 1_100, Some((0.5, 1.0, None))));
        assert_eq!(x.current().unwrap().last().unwrap().samples, 1_000);
    }

    #[test]
    fn the_history_is_bounded_and_keeps_first_and_last() {
        let mut e = Experiment::new(1, "a".into(), settings(), 0, 0);
        for i in 0..20_000u64 {
            e.push(Point {
                t_ms: i,
                samples: i,
                accuracy: Some(0.5),
                loss: 1.0,
                bits_per_token: None,
            });
            assert!(e.long.len() <= LONG && e.recent.len() <= RECENT);
        }
        let pts: Vec<&Point> = e.points().collect();
        assert_eq!(pts.first().unwrap().t_ms, 0);
        assert_eq!(pts.last().unwrap().t_ms, 19_999);
        assert!(pts.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
        assert_eq!(e.recent.len(), RECENT);
    }

    #[test]
    fn a_restart_carries_the_experiments_samples() {
        let mut x = Experiments::default();
        x.start(Experiment::new(1, "a".into(), settings(), 0, 0));
        x.record(None, 1, 5_000, Some((0.9, 0.3, None)));
        let saved = serde_json::to_value(&x).unwrap();
        let mut y: Experiments = serde_json::from_value(saved).unwrap();
        y.resumed();
        y.record(None, 2, 10, Some((0.9, 0.3, None)));
        assert_eq!(y.current().unwrap().last().unwrap().samples, 5_010);
    }

    #[test]
    fn csv_and_sim_command() {
        let mut x = Experiments::default();
        x.start(Experiment::new(3, "it's".into(), settings(), 0, 0));
        x.record(None, 7, 64, Some((0.25, 2.0, None)));
        let csv = x.csv(3, "/data/my mnist").unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert!(
            lines[0]
                .starts_with("# sim: crowdgrad sim --data-dir '/data/my mnist' --model mlp:128"),
            "{}",
            lines[0]
        );
        assert!(lines[0].contains("--consistency async") && lines[0].contains("--lr 0.05"));
        assert_eq!(lines[1], "t_ms,samples,accuracy,loss,bits_per_token");
        assert_eq!(lines[2], "7,64,0.25,2,");
        assert!(x.csv(4, "d").is_none());
    }

    #[test]
    fn figures_are_differences_per_interval() {
        let mut f = Figures::default();
        let mut t = Totals {
            t_ms: 0,
            ..Totals::default()
        };
        f.observe(t.clone());
        t.t_ms = 5_000;
        t.samples = 500;
        t.bytes_up = 5_000;
        t.rejected.insert("busy".into(), 3);
        t.limit_refusals = 2;
        t.volunteers = 4;
        f.observe(t.clone());
        t.t_ms = 10_000;
        f.observe(t);
        let all = f.since(0);
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].samples_per_s, 100.0);
        assert_eq!(all[0].rejected["busy"], 3);
        assert_eq!(all[0].limit_refusals, 2);
        assert!(all[1].rejected.is_empty() && all[1].limit_refusals == 0);
        assert_eq!(f.since(5_000).len(), 1);
        assert!(figures_csv(&all).lines().nth(1).unwrap().contains("busy:3"));
    }
}
