// The page: the volunteer's panel (volunteer.js), the run's live dashboard fed by the server's
// dashboard stream (/api/events: a `run` event once, then a small `tick` a second with the
// counters and only the new evaluation points; docs/protocol.md, "Dashboard stream"), the
// host's charts over time (charts.js) and the classroom view (present.js). The worker table
// (with its reputation records) comes from /api/workers and the leaderboard from
// /api/contributors, polled only while the page is visible; a hidden page closes its stream
// and reopens it when shown (issue 18). Servers with the history endpoints (`/api/evals`,
// `/api/history`; their evaluation points carry `t_ms`) feed the experiments and the figures
// over time; an older server's are kept here from the ticks since the page opened.
// What each person sees and can do: docs/page.md.
import uPlot from './vendor/uPlot.esm.js';
import { $, announce, bytes, cell, clock, compact, csv, download, fixed, num, pct } from './fmt.js';
import {
  EvalChart, evalSummary, initChartControls, registerEvalChart, renderMultiples, setLanguage,
} from './charts.js';
import {
  cores, getPublicId, initVolunteer, joinToken, loopback, noteRun, reasonsText, renderYou, volunteer,
} from './volunteer.js';
import {
  initPresent, presenting, renderDemoWorkers, renderExperiments, renderPresent, wantGuesses,
} from './present.js';

// ---------------------------------------------------------------- state

// The latest status (loopback threads take the run's model and batch from it).
let lastStatus = null;
let run = null;
// This experiment's evaluation points from the stream, each with `t_ms`.
let history = [];
// Every experiment, oldest first, from /api/evals (else the stream's one).
let experiments = null;
let currentExperiment = null;
// The run's figures over time: from /api/history, or kept here from the ticks.
let figures = [];
let figuresFromServer = false;
// Whether the server has the history endpoints (its evaluation points carry t_ms).
let pageApi = false;
// The wall-clock time the server started, from a tick's uptime (for an older server's points).
let startedMs = null;
// "Pause live updates": data keeps coming, the page stops redrawing.
let frozen = false;
let language = null;

const EVAL_HISTORY = 1024;
const FIGURE_EVERY_MS = 5_000;

const withTime = (p) => (p.t_ms != null ? p : { ...p, t_ms: Math.round((startedMs || Date.now()) + 1000 * (p.time_s || 0)) });

initVolunteer({ status: () => lastStatus, onProgress: () => { markMyWorker(); renderSummary(); } });

// ---------------------------------------------------------------- charts

const chart = new EvalChart($('chart'));
// On a projector the chart takes about half the screen's height.
const pchart = new EvalChart($('p-chart'), { height: Math.round(Math.min(720, Math.max(320, 0.5 * innerHeight))), big: true });
registerEvalChart(chart);
registerEvalChart(pchart);
initChartControls(() => renderCharts(true));
// The classroom view's own x-axis choice is the dashboard's (one view of the chart).
$('p-x-axis').addEventListener('change', (e) => {
  $('x-axis').value = e.target.value;
  $('x-axis').dispatchEvent(new Event('change'));
});
$('x-axis').addEventListener('change', (e) => { $('p-x-axis').value = e.target.value; });

function currentExperiments() {
  if (experiments && experiments.length) {
    const out = experiments.map((e) => ({ ...e }));
    const cur = out[out.length - 1];
    // Stream points newer than what /api/evals answered join the current experiment. The
    // stream counts samples from the server's start, an experiment from its own: the offset
    // is read off the evaluation both have (the same t_ms); without one, none join.
    const last = cur.points[cur.points.length - 1];
    const same = last && history.find((p) => p.t_ms === last.t_ms);
    if (same) {
      const offset = same.samples - last.samples;
      cur.points = [...cur.points, ...history.filter((p) => p.t_ms > last.t_ms).map((p) => ({ ...p, samples: p.samples - offset }))];
    }
    return out;
  }
  return [{ id: 0, label: 'this run', points: history }];
}

// The server evaluates every --eval-every seconds while the run moves: a gap much longer
// than that was idle.
const evalEveryMs = () => 1000 * (Number(lastStatus && lastStatus.config && lastStatus.config.eval_every) || 1);
const evalGapMs = () => Math.max(10_000, 5 * evalEveryMs());
const leadMs = () => 1.5 * evalEveryMs();

function renderCharts(force = false) {
  if (frozen && !force) return;
  const exps = currentExperiments();
  chart.update(exps, evalGapMs(), leadMs());
  $('chart-summary').textContent = evalSummary(exps[exps.length - 1].points);
  if (presenting()) {
    pchart.update(exps, evalGapMs(), leadMs());
    $('p-chart-summary').textContent = evalSummary(exps[exps.length - 1].points);
  }
  renderMultiples(figures);
  $('over-time-source').textContent = figuresFromServer
    ? `From the server's record of the run, one point every ${FIGURE_EVERY_MS / 1000} s.`
    : `Since this page opened, one point every ${FIGURE_EVERY_MS / 1000} s (this server keeps no history of its own).`;
  renderExperiments(exps, currentExperiment, exportExperiment);
}

// ---------------------------------------------------------------- staleness histogram

let hist = null;
let histShards = -1;
const BUCKETS = 17;
const HIST_COLORS = ['#1b3a6b', '#c45f00', '#1f6f43', '#7a3f9d', '#8a6d00', '#2b7c8c'];
const HIST_DASH = [undefined, [6, 4], [2, 3], [12, 3, 3, 3], [1, 3], [8, 2]];

function shares(h) {
  const counts = Array.from({ length: BUCKETS }, (_, i) => (h && h[i]) || 0);
  const total = counts.reduce((a, b) => a + b, 0);
  return counts.map((c) => (total ? c / total : 0));
}

function makeHist(shardCount) {
  const box = $('hist');
  if (hist) hist.destroy();
  histShards = shardCount;
  const step = uPlot.paths.stepped({ align: 1 });
  const series = [{ label: 'staleness', value: (u, v) => (v == null ? '' : v >= BUCKETS - 1 ? `${BUCKETS - 1}+` : String(v)) }];
  for (let i = 0; i < shardCount; i++) {
    series.push({ label: `shard ${i}`, stroke: HIST_COLORS[i % HIST_COLORS.length], dash: HIST_DASH[i % HIST_DASH.length], width: 2, paths: step, value: (u, v) => pct(v) });
  }
  series.push({ label: 'read skew', stroke: '#444', dash: [10, 3, 2, 3], width: 2, paths: step, value: (u, v) => pct(v) });
  const axis = { stroke: '#3d4452', grid: { stroke: '#e4e2dc' } };
  hist = new uPlot({
    width: Math.max(280, box.clientWidth),
    height: 200,
    scales: { x: { time: false }, y: { range: [0, 1] } },
    axes: [
      { ...axis, label: 'updates behind', values: (u, vs) => vs.map((v) => (v == null ? '' : v >= BUCKETS - 1 ? `${BUCKETS - 1}+` : v)) },
      { ...axis, label: 'share', values: (u, vs) => vs.map((v) => (v == null ? '' : `${Math.round(v * 100)}%`)) },
    ],
    series,
    legend: { live: true },
  }, [Array.from({ length: BUCKETS }, (_, i) => i), ...series.slice(1).map(() => [])], box);
  new ResizeObserver(() => {
    const w = Math.max(280, box.clientWidth);
    if (hist && Math.abs(hist.width - w) > 2) hist.setSize({ width: w, height: 200 });
  }).observe(box);
}

function renderHist(st) {
  const shards = st.shards || [];
  if (histShards !== shards.length) makeHist(shards.length);
  const xs = Array.from({ length: BUCKETS }, (_, i) => i);
  hist.setData([xs, ...shards.map((s) => shares(s.staleness_hist)), shares(st.read_skew_hist)]);
  const t = st.totals || {};
  const fresh = shares(t.staleness_hist)[0];
  $('hist-summary').textContent = t.pushes_applied
    ? `${pct(fresh)} of applied pushes were computed on the current version; mean staleness ${fixed(t.staleness_mean, 2)}, max ${num(t.staleness_max)}; `
      + `mean read skew ${fixed(t.read_skew_mean, 2)}.`
    : 'No pushes applied yet.';
}

// ---------------------------------------------------------------- status

function setTask(task) {
  const lm = task && task.kind === 'language' ? task : null;
  if (JSON.stringify(lm) === JSON.stringify(language)) return;
  language = lm;
  const unit = lm && lm.level === 'bytes' ? 'byte' : 'character';
  $('kpi-accuracy-label').textContent = lm ? `Next-${unit} accuracy` : 'Test accuracy';
  $('kpi-loss-label').textContent = lm ? `Validation bits/${unit === 'byte' ? 'byte' : 'char'}` : 'Test loss';
  $('chart-caption').textContent = lm
    ? `Next-${unit} accuracy (left axis, solid) and validation bits per ${unit} (right axis, dashed; lower is better). Drag across the chart to zoom; the zoom stays while the run updates.`
    : 'Test accuracy (left axis, solid) and loss (right axis, dashed). Drag across the chart to zoom; the zoom stays while the run updates.';
  setLanguage(lm);
  wantGuesses(!lm && pageApi);
  $('sample').hidden = !lm;
  if (lm && !sampleTimer) {
    loadSample();
    sampleTimer = setInterval(() => { if (!document.hidden) loadSample(); }, 5_000);
  }
}

let sampleTimer = null;
async function loadSample() {
  try {
    const r = await fetch('/api/sample');
    if (r.status !== 200) return;
    const s = await r.json();
    const prompt = document.createElement('span');
    prompt.className = 'sample-prompt';
    prompt.textContent = s.prompt;
    $('sample-text').replaceChildren(prompt, document.createTextNode(s.text));
    $('sample-info').textContent = `After ${num(s.samples)} samples (step ${num(s.step)}), at temperature ${s.temperature}: `
      + 'the bold prompt is the server\'s, the rest the model\'s.';
  } catch {
    // The next poll tries again.
  }
}

function kindSummary(k) {
  if (!k) return '–';
  const part = (name, c) => `${name} ${num(c && c.connected)} / ${num(c && c.registered)}`;
  return `${part('native', k.native)} · ${part('browser', k.browser)}`;
}

function shardHealth(h) {
  if (!h) return 'in process';
  if (h.ready) return `up (${h.url})`;
  return `${h.up ? 'wrong layout' : 'DOWN'}: ${h.error || ''} (${h.url})`;
}

// The resolved configuration as TOML-like text: top-level keys, then [sections].
function configText(cfg) {
  if (!cfg || typeof cfg !== 'object') return '–';
  const v = (x) => (typeof x === 'string' ? JSON.stringify(x) : Array.isArray(x) ? JSON.stringify(x) : String(x));
  const plain = Object.entries(cfg).filter(([, x]) => typeof x !== 'object' || Array.isArray(x) || x === null);
  const sections = Object.entries(cfg).filter(([, x]) => x && typeof x === 'object' && !Array.isArray(x));
  const lines = plain.map(([k, x]) => `${k} = ${v(x)}`);
  for (const [name, t] of sections) {
    lines.push('', `[${name}]`, ...Object.entries(t).map(([k, x]) => `${k} = ${v(x)}`));
  }
  return lines.join('\n');
}

function renderShards(shards, health) {
  $('shards').replaceChildren(...shards.map((s, i) => {
    const tr = document.createElement('tr');
    tr.append(
      cell(String(s.id)),
      cell(`${num(s.range.start)}–${num(s.range.end)}`),
      cell(num(s.version), 'num'),
      cell(`${num(s.pushes_applied)} / ${num(s.pushes_rejected)}`, 'num'),
      cell(num(s.pulls), 'num'),
      cell(`${fixed(s.staleness_mean, 1)} / ${num(s.staleness_max)}`, 'num'),
      cell(shardHealth(health && health[i])),
    );
    return tr;
  }));
}

function sumReasons(shards, key) {
  const out = {};
  for (const s of shards || []) for (const [k, v] of Object.entries(s[key] || {})) out[k] = (out[k] || 0) + v;
  return out;
}

const LIMIT_KEYS = ['connections_refused_total', 'pushes_limited_per_worker', 'pushes_limited_per_ip', 'joins_limited', 'joins_unauthorized', 'downloads_limited'];
const limitRefusals = (l) => LIMIT_KEYS.reduce((a, k) => a + ((l && l[k]) || 0), 0);

// One figure every 5 s from the ticks, in /api/history's shape, when the server keeps none.
let lastFigureTotals = null;
function observeFigure(st) {
  if (figuresFromServer) return;
  const now = Date.now();
  const t = st.totals || {};
  const totals = {
    t_ms: now, samples: t.samples || 0, up: t.bytes_up || 0, down: t.bytes_down || 0,
    rejected: sumReasons(st.shards, 'rejected_by_reason'), limits: limitRefusals(st.limits),
  };
  const prev = lastFigureTotals;
  if (prev && now - prev.t_ms < FIGURE_EVERY_MS) return;
  lastFigureTotals = totals;
  if (!prev) return;
  const s = (now - prev.t_ms) / 1000;
  const rejected = {};
  for (const [k, v] of Object.entries(totals.rejected)) if (v - (prev.rejected[k] || 0) > 0) rejected[k] = v - (prev.rejected[k] || 0);
  const vols = t.workers && t.workers.volunteers;
  figures.push({
    t_ms: now,
    samples: totals.samples,
    samples_per_s: Math.max(0, (totals.samples - prev.samples) / s),
    volunteers: vols ? vols.connected : st.workers_connected || 0,
    bytes_up_per_s: Math.max(0, (totals.up - prev.up) / s),
    bytes_down_per_s: Math.max(0, (totals.down - prev.down) / s),
    rejected,
    quarantined: (st.reputation && st.reputation.quarantined) || 0,
    limit_refusals: Math.max(0, totals.limits - prev.limits),
  });
  if (figures.length > 17_280) figures.shift();
}

let configShown = '';
function renderStatus(st) {
  lastStatus = st;
  noteRun(st);
  observeFigure(st);
  setTask(st.task);
  if (frozen) return;
  // A private run shows the token field (unless the link carried the token).
  $('join-token-label').hidden = !st.private_run || Boolean(joinToken);
  const opt = st.optimizer || {};
  const rule = opt.rule && opt.rule.kind ? opt.rule.kind : (typeof opt.rule === 'string' ? opt.rule : '');
  const model = typeof st.model === 'string' ? st.model : JSON.stringify(st.model);
  const dataset = st.dataset && st.dataset.name ? st.dataset.name : (st.dataset || '');
  // Under local steps the workers' inner optimizer is the one that learns (and follows a
  // schedule); the shards' rule is the outer step.
  const local = st.local || {};
  const steps = local.steps != null ? String(local.steps) : '1';
  const inner = local.inner || {};
  const innerRule = inner.rule && inner.rule.kind ? inner.rule.kind : '';
  const lr = (x) => Number(Number(x).toPrecision(3));
  const scheduled = (o) => o.schedule && (o.schedule.warmup > 0 || (o.schedule.decay && o.schedule.decay !== 'none'));
  const learner = steps === '1' ? opt : inner;
  const now = scheduled(learner) && st.lr_now != null ? ` (now ${lr(st.lr_now)})` : '';
  $('run-info').textContent = [
    `run ${st.run_id}`, model, dataset && `on ${dataset}`, st.consistency,
    st.batch_size && `batch ${st.batch_size}`,
    steps === '1'
      ? rule && `${rule}${opt.lr ? ` lr ${lr(opt.lr)}` : ''}${now}`
      : `local steps ${steps}: ${innerRule} lr ${lr(inner.lr)}${now}, outer ${rule} lr ${lr(opt.lr)}`,
    // --ema: what the charts and the sample are of.
    st.ema != null && `evaluates the weights' moving average (ema ${st.ema})`,
    `up ${Math.round(st.uptime_s || 0)} s`,
  ].filter(Boolean).join(' · ');
  const ev = st.eval;
  $('kpi-accuracy').textContent = ev ? pct(ev.accuracy) : '–';
  // A language model's perplexity is 2^(bits per token): how many tokens it is as unsure as.
  $('kpi-loss').textContent = ev
    ? (language ? `${fixed(ev.bits_per_token, 3)} (perplexity ${fixed(2 ** ev.bits_per_token, 1)})` : fixed(ev.loss, 4))
    : '–';
  const t = st.totals || {};
  $('kpi-rate').textContent = num(t.samples_per_sec);
  $('kpi-workers').textContent = num(st.workers_connected);
  const vols = t.workers && t.workers.volunteers;
  $('kpi-volunteers').textContent = vols ? num(vols.connected) : '–';
  $('kpi-samples').textContent = num(t.samples);
  $('kpi-pushes').textContent = `${num(t.pushes_applied)} / ${num(t.pushes_rejected)}`;
  $('kpi-frames').textContent = num(t.frames_rejected);
  const quarantined = (st.reputation && st.reputation.quarantined) || 0;
  const sc = st.spot_checks;
  $('kpi-spot').textContent = `${sc ? `${num(sc.passed)} / ${num(sc.failed)}` : 'off'} · ${num(quarantined)}`;
  $('kpi-bytes').textContent = `${bytes(t.bytes_up)} / ${bytes(t.bytes_down)}`;
  $('kpi-kinds').textContent = kindSummary(t.workers);
  $('kpi-mode').textContent = st.consistency || '–';
  $('kpi-policy').textContent = st.staleness_policy || '–';
  $('kpi-skew').textContent = t.read_steps ? `${fixed(t.read_skew_mean, 2)} / ${num(t.read_skew_max)}` : '–';
  const pushes = reasonsText(sumReasons(st.shards, 'rejected_by_reason'));
  const frames = reasonsText(sumReasons(st.shards, 'frames_rejected_by_reason'));
  $('refusals').textContent = `Pushes: ${pushes}. Frames: ${frames}.`;
  if (t.workers) workerPages.total = t.workers.registered;
  renderWorkerPager();
  renderShards(st.shards || [], st.remote_shards);
  // Rewritten only when it changes, so it can be selected and copied.
  const cfg = configText(st.config);
  if (cfg !== configShown) {
    configShown = cfg;
    $('config').textContent = cfg;
  }
  renderHist(st);
  if (st.quarantines) renderQuarantines(st.quarantines);
  // The tick carries `demo` only while one is on: without it, none is.
  if (st.demo || pageApi) renderDemo(st.demo || []);
  renderPresent(st, language);
  renderSummary();
  renderCharts();
}

function renderSummary() {
  const st = lastStatus;
  if (!st) return;
  const ev = st.eval;
  const t = st.totals || {};
  const vols = t.workers && t.workers.volunteers;
  const figure = language
    ? `${ev && ev.bits_per_token != null ? ev.bits_per_token.toFixed(2) : '–'} bits/char`
    : `${ev ? `${(100 * ev.accuracy).toFixed(1)}%` : '–'} accuracy`;
  const me = volunteer.running ? ` · you: ${(volunteer.progress && volunteer.progress.state) || 'starting'}` : '';
  const online = vols ? vols.connected : st.workers_connected || 0;
  $('summary').textContent = `${figure} · ${num(online)} ${online === 1 ? 'volunteer' : 'volunteers'} · ${compact(t.samples_per_sec || 0)} samples/s${me}`;
}

function renderQuarantines(list) {
  $('quarantine-none').hidden = list.length > 0;
  $('quarantine-wrap').hidden = list.length === 0;
  $('quarantines').replaceChildren(...list.map((q) => {
    const tr = document.createElement('tr');
    tr.append(cell(q.worker == null ? '–' : String(q.worker)), cell(q.identity_short || '–'),
      cell(q.reason || '–', 'reason'), cell(q.at_ms ? new Date(q.at_ms).toLocaleString() : '–'));
    return tr;
  }));
}

function renderDemo(list) {
  const on = list.filter((d) => d.delay_ms || d.fault);
  $('demo-banner').hidden = on.length === 0;
  $('p-demo').hidden = on.length === 0;
  $('demo-banner').textContent = $('p-demo').textContent = on.length
    ? `Demonstration on: ${on.map((d) => `worker ${d.worker}${d.delay_ms ? ` slowed by ${num(d.delay_ms)} ms` : ''}${d.fault ? ` made faulty (${d.fault})` : ''}`).join('; ')}.`
    : '';
}

function setLive(live) {
  const el = $('live');
  el.dataset.live = frozen ? 'paused' : String(live);
  el.textContent = frozen ? 'updates paused' : live ? 'live' : 'reconnecting…';
  if (!live && !frozen) announce('Lost the run\'s live updates; reconnecting.');
}

// ---------------------------------------------------------------- workers

const PAGE = 100;
const WORKERS_EVERY_MS = 3_000;
const workerPages = { offset: 0, total: 0, loading: false };
const reputation = { workers: {} };

function renderWorkerPager() {
  const { offset, total } = workerPages;
  const to = Math.min(total, offset + PAGE);
  $('workers-range').textContent = total === 0 ? 'no workers yet'
    : `${num(Math.min(offset + 1, total))}–${num(to)} of ${num(total)}, newest first`;
  $('workers-newer').disabled = offset === 0;
  $('workers-older').disabled = offset + PAGE >= total;
  $('workers-pager').hidden = total <= PAGE && offset === 0;
}

async function loadWorkerPage() {
  if (workerPages.loading || frozen) return;
  const offset = workerPages.offset;
  workerPages.loading = true;
  try {
    const r = await fetch(`/api/workers?offset=${offset}&limit=${PAGE}`);
    const page = await r.json();
    if (!r.ok) throw new Error(page.error || r.statusText);
    if (offset !== workerPages.offset) return; // the user moved on meanwhile
    workerPages.total = page.total;
    reputation.workers = page.reputation || {};
    if (page.quarantines) renderQuarantines(page.quarantines);
    else renderQuarantines(quarantinesFromRecords(page.workers));
    if (page.workers.length === 0 && offset > 0) {
      workerPages.offset = Math.max(0, Math.ceil(page.total / PAGE) - 1) * PAGE;
    } else {
      renderWorkers(page.workers);
      renderDemoWorkers(page.workers);
    }
  } catch (err) {
    console.warn('crowdgrad: could not load workers', err);
  } finally {
    workerPages.loading = false;
    renderWorkerPager();
  }
}

// An older server has no quarantine list: the shown workers' reputation records have it.
function quarantinesFromRecords(workers) {
  const ids = new Map(workers.map((w) => [String(w.id), w]));
  return Object.entries(reputation.workers || {}).filter(([, r]) => r.quarantined).map(([id, r]) => ({
    worker: Number(id),
    identity_short: ids.get(id) && ids.get(id).identity ? `${ids.get(id).identity.slice(0, 8)}…` : null,
    reason: r.quarantined.reason,
    at_ms: r.quarantined.at_ms || (r.quarantined.at_unix ? r.quarantined.at_unix * 1000 : null),
  }));
}

function moveWorkerPage(pages) {
  const last = Math.max(0, Math.ceil(workerPages.total / PAGE) - 1) * PAGE;
  workerPages.offset = Math.min(last, Math.max(0, workerPages.offset + pages * PAGE));
  loadWorkerPage();
  renderWorkerPager();
}
$('workers-newer').addEventListener('click', () => moveWorkerPage(-1));
$('workers-older').addEventListener('click', () => moveWorkerPage(1));

// The threads of one volunteer (joined with one threads.volunteer) as one row: counts add up,
// staleness is their pushes' mean and their max, the histograms add up.
function groupThreads(workers) {
  const groups = new Map();
  const out = [];
  for (const w of workers) {
    const key = w.threads && w.threads.volunteer;
    if (!key) {
      out.push({ ...w, ids: [w.id], thread_count: 1 });
      continue;
    }
    const g = groups.get(key);
    if (!g) {
      const row = { ...w, ids: [w.id], thread_count: 1, staleness_hist: [...(w.staleness_hist || [])] };
      groups.set(key, row);
      out.push(row);
      continue;
    }
    const applied = (g.pushes_applied || 0) + (w.pushes_applied || 0);
    g.staleness_mean = applied
      ? ((g.staleness_mean || 0) * (g.pushes_applied || 0) + (w.staleness_mean || 0) * (w.pushes_applied || 0)) / applied
      : g.staleness_mean;
    g.ids.push(w.id);
    g.thread_count += 1;
    g.id = Math.max(g.id, w.id);
    g.connected = g.connected || w.connected;
    g.shards_connected += w.shards_connected || 0;
    g.samples += w.samples || 0;
    g.pushes_applied = applied;
    g.pushes_rejected += w.pushes_rejected || 0;
    g.staleness_max = Math.max(g.staleness_max || 0, w.staleness_max || 0);
    (w.staleness_hist || []).forEach((c, i) => { g.staleness_hist[i] = (g.staleness_hist[i] || 0) + c; });
    g.last_seen_s = Math.min(g.last_seen_s, w.last_seen_s);
  }
  return out;
}

function sparkline(h) {
  const bars = '▁▂▃▄▅▆▇█';
  const counts = Array.from({ length: BUCKETS }, (_, i) => (h && h[i]) || 0);
  const last = counts.reduce((m, c, i) => (c > 0 ? i : m), 0);
  const max = Math.max(1, ...counts);
  return counts.slice(0, last + 1).map((c) => (c === 0 ? ' ' : bars[Math.min(7, Math.floor((c / max) * 7.999))])).join('');
}

function renderWorkers(workers) {
  const rows = groupThreads(workers).sort((a, b) => (b.connected - a.connected) || (b.id - a.id));
  $('workers').replaceChildren(...rows.map((w) => {
    const tr = document.createElement('tr');
    tr.dataset.connected = String(!!w.connected);
    tr.dataset.kind = w.client;
    tr.dataset.id = String(w.id);
    tr.dataset.ids = w.ids.join(',');
    tr.dataset.threads = String(w.thread_count);
    const ids = w.ids.length > 1 ? `${w.ids.join(', ')} · ${w.thread_count} threads` : String(w.id);
    const label = w.name ? `${ids} (${w.name})` : ids;
    tr.append(
      cell(label, 'who'),
      cell(w.client, `kind kind-${w.client}`),
      cell(w.connected ? `yes (${w.shards_connected})` : 'no'),
      cell(num(w.samples), 'num'),
      cell(`${num(w.pushes_applied)} / ${num(w.pushes_rejected)}`, 'num'),
      cell(`${fixed(w.staleness_mean, 1)} / ${num(w.staleness_max)}`, 'num'),
      sparkCell(w.staleness_hist),
      ...exchangeCells(w.exchange),
      trustCell(w.ids || [w.id], tr),
      cell(`${fixed(w.last_seen_s, 1)} s ago`, 'num'),
    );
    return tr;
  }));
  markMyWorker();
}

// Spot checks and quarantine (issue 10): QUARANTINED with its reason in the cell itself.
function trustCell(ids, tr) {
  const reps = ids.map((id) => (reputation.workers || {})[String(id)]).filter(Boolean);
  const q = reps.find((r) => r.quarantined);
  if (q) {
    tr.dataset.quarantined = 'true';
    return cell(`QUARANTINED: ${q.quarantined.reason}`, 'quarantined');
  }
  const ok = reps.reduce((n, r) => n + r.spot_passed, 0);
  const bad = reps.reduce((n, r) => n + r.spot_failed, 0);
  return cell(reps.length ? `${num(ok)} / ${num(bad)}` : '–', 'num');
}

function exchangeCells(x) {
  if (!x) return [cell('–', 'num'), cell('–'), cell('–', 'num'), cell('–', 'num')];
  const enc = (e) => (e === 'int8_block' ? 'int8' : e);
  const share = Math.max(0, Math.min(1, x.compute_share || 0));
  return [
    cell(num(x.local_steps), 'num'),
    cell(`${enc(x.pull_encoding)} / ${enc(x.push_encoding)}`),
    cell(`${bytes(x.up_bps)}/s / ${bytes(x.down_bps)}/s`, 'num'),
    cell(`${(100 * share).toFixed(0)}% / ${(100 * (1 - share)).toFixed(0)}%`, 'num'),
  ];
}

function sparkCell(h) {
  const td = cell(sparkline(h), 'spark');
  const counts = (h || []).map((c, i) => `${i === BUCKETS - 1 ? `${i}+` : i}: ${c}`).filter((s) => !s.endsWith(': 0'));
  td.setAttribute('aria-label', counts.length ? `pushes by staleness, ${counts.join(', ')}` : 'no pushes yet');
  return td;
}

function markMyWorker() {
  const mine = new Set(((volunteer.progress && volunteer.running && volunteer.progress.worker_ids) || []).map(String));
  for (const tr of $('workers').children) {
    const me = (tr.dataset.ids || '').split(',').some((id) => mine.has(id));
    tr.classList.toggle('me', me);
    const who = tr.querySelector('.who');
    if (who) {
      const base = who.textContent.replace(/ · this tab$/, '');
      who.textContent = me ? `${base} · this tab` : base;
    }
  }
}

// ---------------------------------------------------------------- leaderboard

const BOARD_EVERY_MS = 3_000;
const BOARD_TOP = 10;
let boardLoading = false;
const ago = (unix) => (unix ? new Date(unix * 1000).toLocaleString() : '–');

async function loadBoard() {
  if (boardLoading || frozen) return;
  boardLoading = true;
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), 5_000);
  try {
    // By the public id: the identity itself is a secret, sent only in the join.
    const id = getPublicId();
    const q = new URLSearchParams({ limit: String(BOARD_TOP) });
    if (id) q.set('identity', id);
    const r = await fetch(`/api/contributors?${q}`, { signal: abort.signal });
    const b = await r.json();
    if (!r.ok) throw new Error(b.error || r.statusText);
    const you = b.you;
    renderYou(you, b.your_rank, b.total);
    $('me-pushes').textContent = you ? `${num(you.pushes_accepted)} / ${num(you.pushes_rejected)}` : '0 / 0';
    $('me-compute').textContent = you ? `${fixed(you.compute_seconds, 1)} s` : '0 s';
    $('me-seen').textContent = you ? `${ago(you.first_seen_unix)} – ${ago(you.last_seen_unix)}` : '–';
    $('me-rank').textContent = you && b.your_rank ? `${num(b.your_rank)} of ${num(b.total)}` : '–';
    $('leaderboard').replaceChildren(...b.contributors.map((c, i) => {
      const tr = document.createElement('tr');
      if (c.identity === id) tr.className = 'me';
      const you = c.identity === id ? ' (you)' : '';
      const who = `${c.name || `${c.identity.slice(0, 8)}…`}${c.team ? ` · ${c.team}` : ''}${you}`;
      // Four columns fit the volunteer's narrow card: the kind and the pushes go on a
      // second line of the volunteer's cell (visible text, not a tooltip).
      const volunteerCell = cell(who, 'person');
      const more = document.createElement('span');
      more.className = 'sub';
      more.textContent = `${c.client} · pushes ${num(c.pushes_accepted)} ok / ${num(c.pushes_rejected)} refused`;
      volunteerCell.append(more);
      tr.replaceChildren(cell(String(i + 1), 'num'), volunteerCell, cell(num(c.samples), 'num'),
        cell(`${fixed(c.compute_seconds, 1)} s`, 'num'));
      return tr;
    }));
    // Teams: the ones the server adds up from their members' last joins.
    const teams = b.teams || [];
    $('teams-wrap').hidden = teams.length === 0;
    const mine = $('my-team').value.trim();
    $('teams').replaceChildren(...teams.map((t, i) => {
      const tr = document.createElement('tr');
      if (mine && t.team === mine) tr.className = 'me';
      const cells = [String(i + 1), t.team + (mine && t.team === mine ? ' (yours)' : ''),
        num(t.members), num(t.samples)];
      tr.replaceChildren(...cells.map((text, j) => cell(text, j === 1 ? 'person' : 'num')));
      return tr;
    }));
  } catch (err) {
    console.warn('crowdgrad: could not load the contributors', err);
  } finally {
    clearTimeout(timer);
    boardLoading = false;
  }
}

// ---------------------------------------------------------------- history endpoints

async function getJson(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

let evalsLoading = false;
async function loadEvals() {
  if (!pageApi || evalsLoading) return;
  evalsLoading = true;
  try {
    const e = await getJson('/api/evals');
    experiments = (e.experiments || []).map((x) => ({ ...x, points: (x.points || []).filter((p) => p.t_ms != null) }));
    currentExperiment = e.experiment;
    // The stream's points belong to the current experiment only from its start.
    const cur = experiments[experiments.length - 1];
    if (cur && cur.started_ms) history = history.filter((p) => p.t_ms >= cur.started_ms);
    renderCharts();
  } catch (err) {
    console.warn('crowdgrad: could not load the experiments', err);
  } finally {
    evalsLoading = false;
  }
}

let figuresLoading = false;
async function loadFigures() {
  if (!pageApi || figuresLoading) return;
  figuresLoading = true;
  try {
    const since = figuresFromServer && figures.length ? figures[figures.length - 1].t_ms : 0;
    const h = await getJson(`/api/history?since_ms=${since}`);
    if (!figuresFromServer) figures = [];
    figuresFromServer = true;
    for (const p of h.points || []) if (!figures.length || p.t_ms > figures[figures.length - 1].t_ms) figures.push(p);
    renderCharts();
  } catch (err) {
    console.warn('crowdgrad: could not load the run\'s history', err);
  } finally {
    figuresLoading = false;
  }
}

let statusLoading = false;
// The quarantine list and the demonstrations are in /api/status: asked for every 10 s (the
// tick carries the demonstrations only while one is on, /api/workers the quarantines).
async function loadDemo() {
  if (!pageApi || statusLoading) return;
  statusLoading = true;
  try {
    const st = await getJson('/api/status');
    if (st.demo) renderDemo(st.demo);
    if (st.quarantines) renderQuarantines(st.quarantines);
  } catch {
    // The next poll tries again.
  } finally {
    statusLoading = false;
  }
}

function discoverPageApi(points) {
  if (pageApi || !points.some((p) => p && p.t_ms != null)) return;
  pageApi = true;
  wantGuesses(!language);
  loadEvals();
  loadFigures();
  loadDemo();
}

// ---------------------------------------------------------------- downloads

function evalRows(points) {
  return points.filter((p) => !p.hold).map((p) => ({ ...p, accuracy: p.accuracy, time: new Date(p.t_ms).toISOString() }));
}

async function fetchText(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.text();
}

async function exportExperiment(e) {
  const name = `crowdgrad-experiment-${e.id}.csv`;
  if (pageApi) {
    try {
      download(name, await fetchText(`/api/evals.csv?experiment=${encodeURIComponent(e.id)}`), 'text/csv');
      return;
    } catch (err) {
      console.warn('crowdgrad: /api/evals.csv failed; exporting what the page has', err);
    }
  }
  const head = e.sim_command ? `# sim: ${e.sim_command}\n` : '';
  download(name, head + csv(['time', 't_ms', 'samples', 'accuracy', 'loss', 'bits_per_token'], evalRows(e.points)), 'text/csv');
}

async function downloadSeries(what) {
  const exps = currentExperiments();
  const cur = exps[exps.length - 1];
  const run = lastStatus ? lastStatus.run_id : 'run';
  if (what === 'evals.csv') return exportExperiment(cur);
  if (what === 'evals.json') {
    return download(`crowdgrad-${run}-evals.json`, JSON.stringify({ experiment: currentExperiment, experiments: exps.map((e) => ({ ...e, points: evalRows(e.points) })) }, null, 1), 'application/json');
  }
  const cols = ['time', 't_ms', 'samples', 'samples_per_s', 'volunteers', 'bytes_up_per_s', 'bytes_down_per_s', 'rejected', 'quarantined', 'limit_refusals'];
  const rows = figures.map((p) => ({ ...p, time: new Date(p.t_ms).toISOString() }));
  if (what === 'history.csv') {
    if (figuresFromServer) {
      try {
        return download(`crowdgrad-${run}-history.csv`, await fetchText('/api/history.csv'), 'text/csv');
      } catch { /* what the page has, below */ }
    }
    return download(`crowdgrad-${run}-history.csv`, csv(cols, rows), 'text/csv');
  }
  return download(`crowdgrad-${run}-history.json`, JSON.stringify({ interval_s: FIGURE_EVERY_MS / 1000, points: figures }, null, 1), 'application/json');
}

for (const b of document.querySelectorAll('[data-download]')) {
  b.addEventListener('click', () => downloadSeries(b.dataset.download));
}

// ---------------------------------------------------------------- the stream

let events = null;

function applyTick(tick) {
  if (!run || !tick) return;
  if (tick.uptime_s != null) startedMs = Date.now() - 1000 * tick.uptime_s;
  renderStatus({ ...run, ...tick, eval_history: history });
}

function onRun(data) {
  run = data.run || {};
  if (data.tick && data.tick.uptime_s != null) startedMs = Date.now() - 1000 * data.tick.uptime_s;
  const pts = data.eval_history || [];
  discoverPageApi(pts);
  history = pts.map(withTime);
  applyTick(data.tick);
}

function onTick(tick) {
  const pts = tick.evals || [];
  discoverPageApi(pts);
  for (const raw of pts) {
    const p = withTime(raw);
    // A point the `run` event already carried (it may be taken a moment after its tick).
    if (history.length && p.time_s <= history[history.length - 1].time_s) continue;
    if (history.length >= EVAL_HISTORY && !pageApi) history = history.filter((_, i) => i % 2 === 0);
    history.push(p);
  }
  applyTick(tick);
}

function connectEvents() {
  if (events) return;
  const es = new EventSource('/api/events');
  events = es;
  const on = (name, f) => es.addEventListener(name, (e) => {
    setLive(true);
    try {
      f(JSON.parse(e.data));
    } catch (err) {
      console.warn(`crowdgrad: bad ${name} event`, err);
    }
  });
  on('run', onRun);
  on('tick', onTick);
  es.onopen = () => setLive(true);
  // EventSource reconnects by itself (e.g. across a server restart).
  es.onerror = () => setLive(false);
}

function closeEvents() {
  if (!events) return;
  events.close();
  events = null;
}

// "Pause live updates": nothing on the page moves until it is pressed again.
$('live-toggle').addEventListener('click', () => {
  frozen = !frozen;
  const b = $('live-toggle');
  b.setAttribute('aria-pressed', String(frozen));
  b.textContent = frozen ? 'Resume live updates' : 'Pause live updates';
  setLive(!!events);
  if (!frozen && lastStatus) {
    renderStatus(lastStatus);
    loadWorkerPage();
    loadBoard();
  }
});

function dashboardVisibility() {
  if (document.visibilityState === 'hidden') {
    closeEvents();
  } else {
    connectEvents();
    loadWorkerPage();
    loadBoard();
  }
}
document.addEventListener('visibilitychange', dashboardVisibility);
const visible = () => document.visibilityState !== 'hidden';
setInterval(() => { if (visible()) loadWorkerPage(); }, WORKERS_EVERY_MS);
setInterval(() => { if (visible()) loadBoard(); }, BOARD_EVERY_MS);
setInterval(() => { if (visible() && !frozen) { loadEvals(); loadFigures(); } }, FIGURE_EVERY_MS);
setInterval(() => { if (visible() && !frozen) loadDemo(); }, 10_000);

initPresent({ token: joinToken, onToggle: () => renderCharts(true) });
connectEvents();
loadWorkerPage();
loadBoard();

// A handle for debugging from the console (and for the browser tests to read figures).
window.crowdgrad = { volunteer, cores, loopback, figures: () => figures, experiments: currentExperiments, chart: () => chart.u };
