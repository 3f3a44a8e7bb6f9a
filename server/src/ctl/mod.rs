//! `crowdgrad ctl`: the admin API from the command line ([`crate::coordinator::admin`]).
//!
//! ```text
//! crowdgrad ctl --server http://127.0.0.1:8080 --token T state|pause|resume|drain|stop|checkpoint
//! crowdgrad ctl --token T set-lr 0.01
//! crowdgrad ctl --token T set-consistency ssp:2
//! crowdgrad ctl --token T unquarantine 7          (or: unquarantine --identity ID)
//! ```
//!
//! The token may also come from `CROWDGRAD_ADMIN_TOKEN`. The server's JSON answer is printed;
//! a refusal (401, 409, ...) is an error with the server's message.

use crate::error::{Error, Result};
use clap::{Args, Subcommand};
use std::time::Duration;

/// Flags of `crowdgrad ctl`.
#[derive(Debug, Clone, Args)]
pub struct CtlArgs {
    /// The server's base address.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The admin token (also from the environment variable CROWDGRAD_ADMIN_TOKEN).
    #[arg(long, env = "CROWDGRAD_ADMIN_TOKEN", hide_env_values = true)]
    pub token: String,
    /// What to do.
    #[command(subcommand)]
    pub command: CtlCmd,
}

/// `crowdgrad ctl` commands.
#[derive(Debug, Clone, Subcommand)]
pub enum CtlCmd {
    /// Show paused/draining, learning rate, consistency, versions, last checkpoint.
    State,
    /// Pause training: shards answer pushes with the non-fatal `busy` error.
    Pause,
    /// Resume training.
    Resume,
    /// Refuse joins, let connections finish, say Bye, write the final checkpoint, exit 0.
    Drain,
    /// As drain, without waiting for connections to finish.
    Stop,
    /// Write a checkpoint now.
    Checkpoint,
    /// Set every shard's learning rate.
    SetLr {
        /// The new learning rate.
        lr: f32,
    },
    /// Change the consistency mode of the running server where that is safe (async <-> ssp:S,
    /// sync:K -> sync:K' / async / ssp:S); an unsafe change is refused with the reason.
    SetConsistency {
        /// `async`, `ssp:S` or `sync:K`.
        mode: String,
    },
    /// Lift the quarantine of a worker id, or of an identity (`--identity`).
    Unquarantine {
        /// The worker id, or with --identity the identity's public id (24 hex digits, as the
        /// status and the leaderboard show it; never the volunteer's secret).
        who: String,
        /// `who` is an identity's public id, not a worker id.
        #[arg(long)]
        identity: bool,
    },
}

/// Runs `args` against the server; returns the server's JSON answer.
///
/// # Errors
/// A bad URL, the server unreachable, or the server refusing (its message).
pub fn run(args: &CtlArgs) -> Result<serde_json::Value> {
    let base = args.server.trim_end_matches('/');
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(Error::Config(format!(
            "--server {:?} must start with http:// or https://",
            args.server
        )));
    }
    let (method, path, body) = match &args.command {
        CtlCmd::State => ("GET", "state", None),
        CtlCmd::Pause => ("POST", "pause", None),
        CtlCmd::Resume => ("POST", "resume", None),
        CtlCmd::Drain => ("POST", "drain", None),
        CtlCmd::Stop => ("POST", "stop", None),
        CtlCmd::Checkpoint => ("POST", "checkpoint", None),
        CtlCmd::SetLr { lr } => ("POST", "set-lr", Some(serde_json::json!({ "lr": lr }))),
        CtlCmd::SetConsistency { mode } => (
            "POST",
            "set-consistency",
            Some(serde_json::json!({ "consistency": mode })),
        ),
        CtlCmd::Unquarantine { who, identity } => {
            let body = if *identity {
                serde_json::json!({ "identity": who })
            } else {
                let id: u64 = who
                    .parse()
                    .map_err(|_| Error::Config(format!("worker id {who:?} is not a number")))?;
                serde_json::json!({ "worker": id })
            };
            ("POST", "unquarantine", Some(body))
        }
    };
    let url = format!("{base}/api/admin/{path}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into();
    let auth = format!("Bearer {}", args.token);
    let resp = if method == "GET" {
        agent.get(&url).header("authorization", &auth).call()
    } else {
        let body = body.unwrap_or_else(|| serde_json::json!({})).to_string();
        agent
            .post(&url)
            .header("authorization", &auth)
            .header("content-type", "application/json")
            .send(body.as_bytes())
    };
    let mut resp = resp.map_err(|e| Error::Http(format!("{url}: {e}")))?;
    let status = resp.status();
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(1 << 20)
        .read_to_vec()
        .map_err(|e| Error::Http(format!("{url}: {e}")))?;
    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(
        |_| serde_json::json!({ "error": String::from_utf8_lossy(&bytes).to_string() }),
    );
    if !status.is_success() {
        let msg = json["error"].as_str().unwrap_or("no message").to_string();
        return Err(Error::Http(format!("{status}: {msg}")));
    }
    Ok(json)
}
