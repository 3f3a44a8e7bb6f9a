//! `crowdgrad work`'s flags and their checked form, [`WorkOptions`].

use super::options::{default_threads, identity_from_file, Timeouts, WorkOptions};
use crate::error::{Error, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The flags of `crowdgrad work`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkArgs {
    /// The server's base address.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// Stop after this many steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Stop after this many seconds.
    #[arg(long)]
    pub seconds: Option<f64>,
    /// A display name for the dashboard.
    #[arg(long)]
    pub name: Option<String>,
    /// A team for the leaderboard (`/api/contributors` adds up each team's samples).
    #[arg(long)]
    pub team: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Make every step take this many extra milliseconds (play a slow volunteer).
    #[arg(long, default_value_t = 0)]
    pub step_delay_ms: u64,
    /// Your volunteer identity for the contribution ledger: a secret (8-64 of A-Z a-z 0-9 - _;
    /// use 32 random hex digits), whoever has it is credited as you; the server shows only
    /// its public id. Default: the one kept in --id-file.
    #[arg(long)]
    pub id: Option<String>,
    /// Where the identity (a secret) is kept: created on first run with 32 random hex digits
    /// and mode 0600.
    #[arg(long, default_value = "data/worker-id")]
    pub id_file: PathBuf,
    /// A private run's join token (sent as `Authorization: Bearer`); also read from
    /// CROWDGRAD_JOIN_TOKEN.
    #[arg(long, env = "CROWDGRAD_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// For https:// servers, trust only the certificates in this PEM file (a self-signed
    /// server's own certificate or a private CA) instead of the public roots.
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// Seconds to connect (TCP + TLS + WebSocket upgrade) before trying again.
    #[arg(long, default_value_t = 10.0)]
    pub connect_timeout: f64,
    /// Seconds one HTTP request (the join, one data file) may take in all.
    #[arg(long, default_value_t = 300.0)]
    pub http_timeout: f64,
    /// Seconds without a byte during an HTTP request before the link counts as stalled.
    #[arg(long, default_value_t = 30.0)]
    pub stall_timeout: f64,
    /// Worker loops to run in parallel, as threads of one volunteer (1-256); default: every
    /// core but one. --steps and --seconds apply to each.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seconds to wait for the shards' reply to a pull or push before reconnecting.
    #[arg(long, default_value_t = 30.0)]
    pub reply_timeout: f64,
    /// Play a FAULTY worker, for experiments (the same kinds as `sim --fault`): nan, inf,
    /// noise, scale:F, signflip:S, replay, wrong_shard, shuffled_labels or collude:S
    /// (every colluding process of a run sends the same vector, of L2 norm S per shard,
    /// from the run's seed). Applies to every thread.
    #[arg(long)]
    pub fault: Option<String>,
    /// With --fault: send the first N pushes (over all shards) honestly, then the fault: a
    /// patient attacker that passes its spot-check probation first. Per thread; restarts
    /// with a reconnect.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub fault_after: u64,
}

impl WorkArgs {
    /// The checked options: every bad value is refused with the flag's name.
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag, or the identity file's I/O error.
    pub fn options(self) -> Result<WorkOptions> {
        let mut opts = WorkOptions::new(self.server);
        if let Some(f) = self.fault {
            let f = crowdgrad_core::fault::Fault::parse(&f)
                .map_err(|e| Error::Config(format!("--fault: {e}")))?;
            opts.fault = Some(f);
        }
        opts.fault_after = self.fault_after;
        opts.threads = self.threads.unwrap_or_else(default_threads);
        let secs = |flag: &str, v: f64| {
            if v.is_finite() && (0.05..=86_400.0).contains(&v) {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(Error::Config(format!(
                    "{flag} {v} must be between 0.05 and 86400 seconds"
                )))
            }
        };
        opts.timeouts = Timeouts {
            connect: secs("--connect-timeout", self.connect_timeout)?,
            http: secs("--http-timeout", self.http_timeout)?,
            stall: secs("--stall-timeout", self.stall_timeout)?,
            reply: secs("--reply-timeout", self.reply_timeout)?,
        };
        opts.join_token = self.join_token;
        opts.ca = self.ca;
        opts.step_delay = Duration::from_millis(self.step_delay_ms);
        opts.identity = Some(match self.id {
            Some(id) => {
                crate::registry::ledger::check_identity(&id)
                    .map_err(|m| Error::Config(format!("--id: {m}")))?;
                id
            }
            None => identity_from_file(&self.id_file)?,
        });
        opts.steps = self.steps;
        if let Some(s) = self.seconds {
            if !(s.is_finite() && s > 0.0) {
                return Err(Error::Config("--seconds must be positive".into()));
            }
            opts.duration = Some(Duration::from_secs_f64(s));
        }
        opts.name = self.name;
        opts.team = self.team;
        opts.progress = !self.quiet && !self.json;
        Ok(opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        work: WorkArgs,
    }

    fn parse(args: &[&str]) -> Result<WorkOptions> {
        let mut all = vec!["work"];
        if !args.contains(&"--id") {
            all.extend(["--id", "tester-0001"]);
        }
        all.extend_from_slice(args);
        Cli::try_parse_from(all)
            .expect("flags parse")
            .work
            .options()
    }

    #[test]
    fn bad_values_are_refused_with_the_flag() {
        for (args, says) in [
            (&["--connect-timeout", "0"][..], "--connect-timeout"),
            (&["--reply-timeout", "NaN"][..], "--reply-timeout"),
            (&["--seconds=-1"][..], "--seconds"),
            (&["--fault", "frobnicate"][..], "--fault"),
            (&["--id", "x"][..], "--id"),
        ] {
            let e = parse(args).expect_err("refused").to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn good_values_become_options() {
        let o = parse(&[
            "--threads",
            "3",
            "--seconds",
            "2.5",
            "--quiet",
            "--fault",
            "signflip:2",
        ])
        .expect("accepted");
        assert_eq!(o.threads, 3);
        assert_eq!(o.duration, Some(Duration::from_secs_f64(2.5)));
        assert!(!o.progress);
        assert!(o.fault.is_some());
        assert_eq!(o.identity.as_deref(), Some("tester-0001"));
    }
}
