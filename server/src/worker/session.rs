//! One worker loop: sessions (join, download, connect every shard, train) with reconnection
//! and backoff, driving core's sans-IO [`Worker`].

use super::net::{connect_shard, get, join, Event, JoinError, Link, Net, Reconnect};
use super::options::{base_urls, jitter_seed, peak_rss_kib, Summary, WorkOptions};
use super::progress::{Cache, Progress, ThreadCtx};
use crate::error::{Error, Result};
use crowdgrad_core::backoff::Backoff;
use crowdgrad_core::data::Dataset;
use crowdgrad_core::fault::{self, Collusion, Fault, Faults};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::spec::Threads;
use crowdgrad_core::wire::{self, Bye, ClientKind, Message as Frame};
use crowdgrad_core::worker::{Worker, WorkerStats};
use futures_util::{SinkExt, StreamExt};
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

pub(super) enum End {
    /// Steps or time limit reached, or asked to stop.
    Done,
    /// The connection was lost or refused.
    Lost(String),
    /// The server will not let this worker in (wrong or missing join token): retrying is
    /// pointless.
    Refused(String),
}

/// One worker loop: sessions with reconnection until its limits or `shutdown`.
pub(super) async fn run_loop(
    opts: &WorkOptions,
    net: &Net,
    ctx: ThreadCtx,
    shutdown: impl Future<Output = ()>,
) -> Result<Summary> {
    let (http, ws) = base_urls(&opts.server)?;
    let ThreadCtx {
        threads,
        cache,
        mut progress,
    } = ctx;
    let started = Instant::now();
    let deadline = opts.duration.map(|d| started + d);
    let mut stats = WorkerStats::default();
    let mut ids = Vec::new();
    let mut sessions = 0u32;
    let mut backoff = Backoff::new(jitter_seed()).with_cap(opts.max_backoff.as_secs_f64());
    let mut last_error = None;
    let mut refused = false;
    tokio::pin!(shutdown);
    loop {
        let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
        let out_of_steps = opts.steps.is_some_and(|s| stats.steps >= s);
        if out_of_time || out_of_steps {
            break;
        }
        sessions += 1;
        let steps_before = stats.steps;
        let lp = Loop {
            opts,
            net,
            http: &http,
            ws: &ws,
            threads: threads.as_ref(),
            cache: &cache,
            deadline,
            started,
        };
        let end = session(&lp, &mut ids, &mut stats, &mut progress, shutdown.as_mut())
            .await
            .unwrap_or_else(|e| End::Lost(e.to_string()));
        match end {
            End::Done => break,
            End::Refused(why) => {
                tracing::error!(%why, "giving up");
                last_error = Some(why);
                refused = true;
                break;
            }
            End::Lost(why) => {
                if stats.steps > steps_before {
                    // The session trained: a fresh failure, not a repeated one.
                    backoff.reset();
                }
                let delay = Duration::from_secs_f64(backoff.next_delay());
                tracing::warn!(%why, "connection lost; reconnecting in {delay:?}");
                last_error = Some(why);
                let wait = match deadline {
                    Some(d) => delay.min(d.saturating_duration_since(Instant::now())),
                    None => delay,
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = &mut shutdown => break,
                }
            }
        }
    }
    if let Some(id) = ids.last() {
        progress.update(*id, &stats, started, true);
    }
    if let Some(b) = &progress.bar {
        b.finish();
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Summary {
        worker_ids: ids,
        samples_per_sec: stats.samples as f64 / seconds.max(1e-9),
        stats,
        seconds,
        sessions,
        peak_rss_kib: peak_rss_kib(),
        last_error,
        refused,
        threads: 1,
        public_id: opts
            .identity
            .as_deref()
            .map(crate::registry::ledger::public_id),
    })
}

/// What every session of one worker loop shares: its options, network, addresses, thread
/// context and limits (fixed for the loop's life).
pub(super) struct Loop<'a> {
    pub(super) opts: &'a WorkOptions,
    pub(super) net: &'a Net,
    /// The server's base address, `http(s)://HOST:PORT`.
    pub(super) http: &'a str,
    /// The same as `ws(s)://HOST:PORT`, for shards with relative paths.
    pub(super) ws: &'a str,
    pub(super) threads: Option<&'a Threads>,
    pub(super) cache: &'a Cache,
    /// `--seconds`, as an instant.
    pub(super) deadline: Option<Instant>,
    /// When the loop started (for rates).
    pub(super) started: Instant,
}

/// One join + connect + train cycle. Returns `Done` when asked to stop or out of steps/time.
pub(super) async fn session(
    lp: &Loop<'_>,
    ids: &mut Vec<u64>,
    stats: &mut WorkerStats,
    progress: &mut Progress,
    mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<End> {
    let Loop {
        opts,
        net,
        http,
        threads,
        cache,
        ..
    } = *lp;
    let prepare = async {
        let joined = join(
            net,
            http,
            (opts.name.clone(), opts.team.clone()),
            opts.identity.clone(),
            threads.cloned(),
        )
        .await?;
        ids.push(joined.worker_id);
        // The first thread to need the partition downloads it; the others wait for it here.
        let mut cached = cache.lock().await;
        let data = match cached.get(&joined.partition.images) {
            Some(d) => d.clone(),
            None => {
                let images = get(net, format!("{http}{}", joined.partition.images)).await?;
                let labels = get(net, format!("{http}{}", joined.partition.labels)).await?;
                let d = Dataset::from_idx(&images, &labels).map_err(Error::from)?;
                // Bounded: as many partitions as threads (a server without thread support
                // gives each its own); a restarted server's new paths replace the old.
                if cached.len() >= threads.map_or(1, |t| t.count as usize) {
                    cached.clear();
                }
                cached.insert(joined.partition.images.clone(), d.clone());
                d
            }
        };
        drop(cached);
        Ok::<_, JoinError>((joined, data))
    };
    let (joined, data) = tokio::select! {
        r = prepare => match r {
            Ok(x) => x,
            Err(JoinError::Retry(e)) => return Err(e),
            Err(JoinError::Refused(why)) => return Ok(End::Refused(why)),
        },
        _ = &mut shutdown => return Ok(End::Done),
    };
    let data = match opts.fault {
        // The same permutation for a worker id and run seed (a rerun is reproducible).
        Some(Fault::ShuffledLabels) => fault::shuffle_labels(
            &data,
            &mut Rng::new(joined.run.seed ^ joined.worker_id.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        )?,
        _ => data,
    };
    let mut worker = Worker::new(joined, data, ClientKind::Native, opts.steps)?;
    worker.carry_stats(stats.clone());
    let end = drive(&mut worker, lp, progress, shutdown).await;
    *stats = worker.stats().clone();
    Ok(end)
}

/// The absolute URL of every shard of the run (a shard in its own process has one already,
/// `serve --shard-urls`; the others are paths under `ws`).
fn shard_urls(worker: &Worker, ws: &str) -> Vec<String> {
    worker
        .join_info()
        .run
        .shards
        .iter()
        .map(|s| {
            if s.path.starts_with("ws://") || s.path.starts_with("wss://") {
                s.path.clone()
            } else {
                format!("{ws}{}", s.path)
            }
        })
        .collect()
}

/// A faulty worker's push rewriting (`--fault`; shuffled labels are in its data already): one
/// participant, this session's shards, noise drawn from a seed of its own.
fn push_faults(
    worker: &Worker,
    fault: Option<Fault>,
    honest_first: u64,
    shards: usize,
) -> Option<(Fault, Faults, Rng)> {
    fault.filter(|f| *f != Fault::ShuffledLabels).map(|f| {
        let seed = worker.join_info().run.seed;
        (
            f,
            Faults::new(Collusion::Seeded(seed), 1, shards).honest_first(honest_first),
            Rng::new(jitter_seed()),
        )
    })
}

/// Says goodbye on every connection still open, all at once and briefly (a stalled link must
/// not hold up a worker asked to stop).
async fn say_goodbye(links: Vec<Link>) {
    let byes = links
        .into_iter()
        .enumerate()
        .filter_map(|(i, l)| l.sink.map(|s| (i, s)))
        .map(|(i, mut sink)| async move {
            let bye = wire::encode(&Frame::Bye {
                shard: i as u32,
                bye: Bye {
                    reason: "worker leaving".into(),
                },
            });
            let _ = tokio::time::timeout(Duration::from_millis(500), async {
                let _ = sink.send(Message::Binary(bye.into())).await;
                let _ = sink.close().await;
            })
            .await;
        });
    futures_util::future::join_all(byes).await;
}

/// Drives `worker` over one connection per shard until it is done, out of time, asked to stop,
/// or every shard is lost at once. A lost shard is reconnected with backoff while the worker
/// trains on the others.
pub(super) async fn drive(
    worker: &mut Worker,
    lp: &Loop<'_>,
    progress: &mut Progress,
    mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> End {
    let (net, deadline, started) = (lp.net, lp.deadline, lp.started);
    let (step_delay, max_backoff) = (lp.opts.step_delay, lp.opts.max_backoff);
    let shards = shard_urls(worker, lp.ws);
    let id = worker.join_info().worker_id;
    let mut faulty = push_faults(worker, lp.opts.fault, lp.opts.fault_after, shards.len());
    // Connect to every shard concurrently, within the connect deadline, unless told to stop.
    let conns = futures_util::future::join_all(shards.iter().map(|u| connect_shard(net, u)));
    let conns = tokio::select! {
        c = conns => c,
        _ = &mut shutdown => return End::Done,
    };
    // One reader task per connection; its events carry the connection's generation so that
    // a late event of a replaced connection is ignored.
    let (ev_tx, mut ev_rx) = mpsc::channel::<Event>(256);
    let mut links: Vec<Link> = Vec::new();
    let mut readers = tokio::task::JoinSet::new();
    for (i, c) in conns.into_iter().enumerate() {
        let socket = match c {
            Ok(s) => s,
            Err(e) => return End::Lost(format!("connecting to shard {i}: {e}")),
        };
        links.push(Link::up(i, 0, socket, &ev_tx, &mut readers, max_backoff));
        worker.connected(i);
    }
    // Shards being reconnected: a shard that is lost is retried with backoff while the worker
    // trains on the others (core's `Worker::disconnected`); the session ends only when every
    // shard is lost at once (the server went away: join again).
    let mut reconnects: futures_util::stream::FuturesUnordered<Reconnect<'_>> = Default::default();
    macro_rules! lose {
        ($i:expr, $why:expr) => {{
            let i: usize = $i;
            let why: String = $why;
            worker.disconnected(i);
            let l = &mut links[i];
            l.down();
            if links.iter().all(|l| l.sink.is_none()) {
                break End::Lost(format!("every shard lost (last: shard {i}: {why})"));
            }
            let delay = Duration::from_secs_f64(links[i].backoff.next_delay());
            let generation = links[i].generation;
            tracing::warn!(shard = i, %why, "shard connection lost; the others carry on; reconnecting in {delay:?}");
            let url = shards[i].clone();
            reconnects.push(Box::pin(async move {
                tokio::time::sleep(delay).await;
                (i, generation, connect_shard(net, &url).await)
            }));
        }};
    }
    macro_rules! reconnected {
        ($i:expr, $generation:expr, $r:expr) => {{
            let (i, generation) = ($i, $generation);
            if links[i].generation == generation && links[i].sink.is_none() {
                match $r {
                    Ok(socket) => {
                        tracing::info!(shard = i, "shard connection back");
                        links[i] = Link::up(i, generation + 1, socket, &ev_tx, &mut readers, max_backoff);
                        worker.connected(i);
                    }
                    Err(e) => {
                        let delay = Duration::from_secs_f64(links[i].backoff.next_delay());
                        tracing::debug!(shard = i, %e, "shard still down; retrying in {delay:?}");
                        let url = shards[i].clone();
                        reconnects.push(Box::pin(async move {
                            tokio::time::sleep(delay).await;
                            (i, generation, connect_shard(net, &url).await)
                        }));
                    }
                }
            }
        }};
    }
    // The worker's clock (sans-IO: it measures compute and exchanges on what it is told).
    let clock = Instant::now();
    // Shards with frames queued but not yet flushed: frames are fed to their sinks and each
    // shard's are flushed once, so a step's push and pull to one shard leave in one write and
    // the shard answers both in one (one syscall and one wake-up each side instead of two).
    let mut queued = vec![false; links.len()];
    let end = loop {
        let mut send_failed = None;
        worker.set_time(clock.elapsed().as_secs_f64());
        while let Some(out) = worker.poll_transmit() {
            let Some(sink) = links[out.shard].sink.as_mut() else {
                continue;
            };
            // A link that stopped taking bytes must not hold the worker (nor its stop).
            let reply = net.timeouts.reply;
            queued[out.shard] = true;
            let frame = match faulty.as_mut() {
                Some((f, faults, rng)) => faults.corrupt(0, out.frame, *f, rng).0,
                None => out.frame,
            };
            let send = tokio::time::timeout(reply, sink.feed(Message::Binary(frame.into())));
            let sent = tokio::select! {
                r = send => r,
                _ = &mut shutdown => return End::Done,
            };
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    send_failed = Some((out.shard, format!("sending to shard {}: {e}", out.shard)));
                    break;
                }
                Err(_) => {
                    send_failed = Some((
                        out.shard,
                        format!("shard {} took no bytes for {reply:?}", out.shard),
                    ));
                    break;
                }
            }
        }
        for (i, link) in links.iter_mut().enumerate() {
            let failed = send_failed.as_ref().is_some_and(|(f, _)| *f == i);
            let flag = std::mem::take(&mut queued[i]);
            let Some(sink) = link.sink.as_mut().filter(|_| flag && !failed) else {
                continue;
            };
            let reply = net.timeouts.reply;
            let flushed = tokio::select! {
                r = tokio::time::timeout(reply, sink.flush()) => r,
                _ = &mut shutdown => return End::Done,
            };
            let why = match flushed {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => format!("sending to shard {i}: {e}"),
                Err(_) => format!("shard {i} took no bytes for {reply:?}"),
            };
            send_failed.get_or_insert((i, why));
        }
        if let Some((i, why)) = send_failed {
            lose!(i, why);
            continue;
        }
        if worker.is_done() || deadline.is_some_and(|d| Instant::now() >= d) {
            break End::Done;
        }
        if worker.ready() {
            worker.set_time(clock.elapsed().as_secs_f64());
            let t = Instant::now();
            if let Err(e) = worker.step() {
                break End::Lost(e.to_string());
            }
            worker.observe_compute(t.elapsed().as_secs_f64());
            // Frames that arrived meanwhile (the next round's parameters, acks) are taken now,
            // between steps, so a round of local steps does not delay them.
            let (mut lost, mut closed) = (None, None);
            while let Ok(ev) = ev_rx.try_recv() {
                worker.set_time(clock.elapsed().as_secs_f64());
                match ev {
                    Event::Frame(i, g, bytes) if links[i].current(g) => {
                        if let Err(e) = worker.receive(i, &bytes) {
                            lost = Some(format!("shard {i}: {e}"));
                            break;
                        }
                    }
                    Event::Closed(i, g, why) if links[i].current(g) => {
                        closed = Some((i, why));
                        break;
                    }
                    _ => {}
                }
            }
            if let Some(why) = lost {
                break End::Lost(why);
            }
            if let Some((i, why)) = closed {
                lose!(i, format!("closed: {why}"));
            }
            while let Some(Some((i, g, r))) =
                futures_util::FutureExt::now_or_never(reconnects.next())
            {
                reconnected!(i, g, r);
            }
            progress.update(id, worker.stats(), started, false);
            if !step_delay.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(step_delay) => {}
                    _ = &mut shutdown => break End::Done,
                }
            }
            continue;
        }
        let until = deadline.map_or_else(
            || tokio::time::Instant::now() + Duration::from_secs(86_400),
            Into::into,
        );
        // The next pulls may wait for the shards' pace (issue 18): wake the worker then.
        let held = worker.poll_timeout().map(|t| {
            let now = clock.elapsed().as_secs_f64();
            Duration::from_secs_f64((t - now).clamp(0.0, 86_400.0))
        });
        // Waiting for replies: one must come within the reply deadline (counted after the
        // hold: nothing is asked for during it).
        let reply = net.timeouts.reply;
        let patience = reply + held.unwrap_or_default();
        let ev = tokio::select! {
            ev = ev_rx.recv() => ev,
            Some((i, g, r)) = reconnects.next(), if !reconnects.is_empty() => {
                reconnected!(i, g, r);
                continue;
            }
            _ = tokio::time::sleep(held.unwrap_or_default()), if held.is_some() => {
                worker.handle_timeout(clock.elapsed().as_secs_f64());
                continue;
            }
            _ = tokio::time::sleep_until(until) => break End::Done,
            _ = tokio::time::sleep(patience) => {
                break End::Lost(format!("no reply from the shards within {reply:?}"))
            }
            _ = &mut shutdown => break End::Done,
        };
        worker.set_time(clock.elapsed().as_secs_f64());
        match ev {
            Some(Event::Frame(i, g, bytes)) if links[i].current(g) => {
                if let Err(e) = worker.receive(i, &bytes) {
                    break End::Lost(format!("shard {i}: {e}"));
                }
            }
            Some(Event::Closed(i, g, why)) if links[i].current(g) => {
                lose!(i, format!("closed: {why}"));
            }
            Some(_) => {}
            None => break End::Lost("all connections closed".into()),
        }
    };
    drop(reconnects);
    say_goodbye(links).await;
    readers.abort_all();
    end
}
