// The page: a volunteer panel driving K Web Workers ("use K of N cores"; each web/worker.js
// hosts one Rust BrowserWorker, joined as thread i of K of one volunteer), and a live dashboard fed by the server's dashboard stream (/api/events:
// a `run` event once, then a small `tick` a second with the counters and only the new
// evaluation points; docs/protocol.md, "Dashboard stream"). The worker table (with its
// reputation records) comes from /api/workers and the leaderboard from /api/contributors,
// polled only while the page is visible; a hidden page closes its stream and reopens it when
// shown (issue 18).
// No training logic lives here: the numbers shown come from the worker's progress reports and
// the server's status.
import uPlot from './vendor/uPlot.esm.js';

const $ = (id) => document.getElementById(id);
const fmtInt = new Intl.NumberFormat('en');
const num = (v) => (v == null ? '–' : fmtInt.format(Math.round(v)));
const fixed = (v, d) => (v == null || !Number.isFinite(v) ? '–' : v.toFixed(d));
const pct = (v) => (v == null ? '–' : `${(100 * v).toFixed(2)}%`);
// Bytes in B, kB, MB, GB (decimal, as link speeds are).
const bytes = (v) => {
  if (v == null || !Number.isFinite(v)) return '–';
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
};

// ---------------------------------------------------------------- volunteer panel

const volunteer = {
  worker: null,
  // One entry per Web Worker: { worker, progress }. `progress` below is their sum.
  threads: [],
  paused: false,
  progress: null,
  hiddenSince: null,
  hiddenMs: 0,
  // performance.now() (ms since navigation start) of the click and of the first accepted push.
  clickedAt: null,
  firstPushAt: null,
};

// Every command goes to every Web Worker: pause and the CPU limit hold for all of them.
function send(cmd, value) {
  for (const t of volunteer.threads) t.worker.postMessage({ cmd, value });
}

// "Use K of N cores": N from the browser, the default leaves one core to the volunteer.
const cores = Math.max(1, Number(navigator.hardwareConcurrency) || 1);
$('cores').replaceChildren(...Array.from({ length: cores }, (_, i) => {
  const o = document.createElement('option');
  o.value = String(i + 1);
  o.textContent = String(i + 1);
  return o;
}));
$('cores').value = String(Math.max(1, cores - 1));
$('cores-total').textContent = String(cores);

// Loopback mode (`/?loopback=1`): every Web Worker trains against in-memory shards of its own
// on a synthetic partition, with the run's model and batch: this device's compute alone;
// `&batch=B` overrides the batch there (to time smaller batches).
const pageQuery = new URLSearchParams(location.search);
const loopback = pageQuery.get('loopback') === '1';

// The volunteer's stable identity: 32 random hex digits made once and kept in localStorage
// (a Web Worker cannot read it, so it goes in the script URL), sent with every join: the
// server's ledger credits it across sessions, reloads and server restarts. Not a secret
// credential (docs/protocol.md, "Identity"). Without localStorage: one for this page only.
const IDENTITY_KEY = 'crowdgrad.identity';
const IDENTITY_RE = /^[A-Za-z0-9_-]{8,64}$/;
const identity = (() => {
  const fresh = () => Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, '0')).join('');
  try {
    let id = localStorage.getItem(IDENTITY_KEY);
    if (!id || !IDENTITY_RE.test(id)) {
      id = fresh();
      localStorage.setItem(IDENTITY_KEY, id);
    }
    return id;
  } catch (err) {
    console.warn('crowdgrad: no localStorage; this identity lasts for this page only', err);
    return fresh();
  }
})();

// The script URL tells each Web Worker which thread it is (worker.js stays the same shim).
function workerUrl(index, count, key, st) {
  const q = new URLSearchParams({ thread: String(index), threads: String(count), volunteer: key });
  if (!loopback) q.set('identity', identity);
  if (loopback) {
    const cfg = (st && st.config && st.config.training) || {};
    q.set('loopback', '1');
    if (cfg.model) q.set('model', String(cfg.model));
    if (st && st.batch_size) q.set('batch', String(st.batch_size));
    if (st && st.shards && st.shards.length) q.set('shards', String(st.shards.length));
    if (pageQuery.get('batch')) q.set('batch', pageQuery.get('batch'));
  }
  // `/?simd=relaxed` opts into the relaxed-SIMD build (worker.js checks the engine has it).
  if (pageQuery.get('simd') === 'relaxed') q.set('simd', 'relaxed');
  return new URL(`./worker.js?${q}`, import.meta.url);
}

function startThread(index, count, key) {
  const w = new Worker(workerUrl(index, count, key, lastStatus), { type: 'module' });
  const t = { worker: w, progress: null };
  volunteer.threads[index] = t;
  if (index === 0) volunteer.worker = w;
  w.onmessage = (e) => {
    const msg = e.data;
    if (msg.type === 'progress') {
      t.progress = msg.progress;
      renderProgress(sumProgress());
      // The first thread has the partition in the Cache API once it trains: start the others,
      // which find it there (one download for all).
      if (index === 0 && msg.progress.state === 'training') startRest(count, key);
    } else if (msg.type === 'error') showError(msg.message);
  };
  w.onerror = (e) => {
    e.preventDefault();
    showError(`The worker failed to load: ${e.message || 'unknown error'}`);
  };
  w.postMessage({ cmd: 'throttle', value: Number($('throttle').value) });
  w.postMessage({ cmd: 'token', value: $('join-token').value });
  if (volunteer.paused) w.postMessage({ cmd: 'pause' });
  w.postMessage({ cmd: 'start' });
}

function startRest(count, key) {
  if (volunteer.threads.length >= count) return;
  clearTimeout(volunteer.restTimer);
  for (let i = volunteer.threads.length; i < count; i++) startThread(i, count, key);
}

// The threads' reports as one: counts and rates add up, times and the loss are means.
function sumProgress() {
  const ps = volunteer.threads.map((t) => t && t.progress).filter(Boolean);
  if (ps.length === 0) return null;
  const sum = (k) => ps.reduce((a, p) => a + (p[k] || 0), 0);
  const mean = (k) => {
    const vs = ps.map((p) => p[k]).filter((v) => v != null && Number.isFinite(v));
    return vs.length ? vs.reduce((a, b) => a + b, 0) / vs.length : null;
  };
  const stepping = ps.filter((p) => p.steps > 0);
  const first = ps[0];
  const worse = ps.find((p) => p.state === 'reconnecting') || first;
  return {
    ...first,
    state: worse.state,
    retry_in_ms: worse.retry_in_ms,
    error: ps.map((p) => p.error).find(Boolean) || null,
    last_error: ps.map((p) => p.last_error).find(Boolean) || null,
    worker_ids: ps.map((p) => p.worker_id).filter((id) => id != null),
    threads: ps.length,
    samples: sum('samples'),
    steps: sum('steps'),
    pushes_accepted: sum('pushes_accepted'),
    pushes_rejected: sum('pushes_rejected'),
    samples_per_sec: sum('samples_per_sec'),
    reconnects: sum('reconnects'),
    ema_loss: stepping.length ? stepping.reduce((a, p) => a + p.ema_loss, 0) / stepping.length : first.ema_loss,
    step_ms: mean('step_ms'),
    wait_ms: mean('wait_ms'),
  };
}

// A private run's join token: from the link's fragment (#token=..., never sent to the server
// in a URL) or typed into the field. It is taken off the address bar at once and never shown.
const joinToken = (() => {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (!m) return '';
  history.replaceState(null, '', location.pathname + location.search);
  try {
    return decodeURIComponent(m[1]);
  } catch {
    return '';
  }
})();
if (joinToken) $('join-token').value = joinToken;

function startContributing() {
  volunteer.clickedAt = performance.now();
  const button = $('contribute');
  button.disabled = true;
  button.textContent = 'Contributing';
  button.setAttribute('aria-pressed', 'true');
  $('pause').hidden = false;
  $('cores').disabled = true;
  const count = Math.min(cores, Math.max(1, Number($('cores').value) || 1));
  const key = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, '0')).join('');
  startThread(0, count, key);
  // Loopback threads download nothing; otherwise the rest start once thread 0 trains, or
  // after 30 s whatever it is doing (a slow download must not keep the other cores idle).
  if (loopback) startRest(count, key);
  else volunteer.restTimer = setTimeout(() => startRest(count, key), 30_000);
}

function togglePause() {
  volunteer.paused = !volunteer.paused;
  send(volunteer.paused ? 'pause' : 'resume');
  const b = $('pause');
  b.textContent = volunteer.paused ? 'Resume' : 'Pause';
  b.setAttribute('aria-pressed', String(volunteer.paused));
}

function showError(text) {
  const el = $('my-error');
  el.hidden = !text;
  el.textContent = text || '';
}

function renderProgress(p) {
  if (!p) return;
  volunteer.progress = p;
  if (volunteer.firstPushAt == null && p.pushes_accepted > 0) volunteer.firstPushAt = performance.now();
  const state = $('my-state');
  let label = p.state;
  if (p.state === 'reconnecting' && p.retry_in_ms != null) {
    label = `reconnecting (retry in ${(p.retry_in_ms / 1000).toFixed(1)} s)`;
  }
  state.textContent = label;
  state.dataset.state = p.state;
  $('my-id').textContent = p.worker_ids && p.worker_ids.length ? p.worker_ids.join(', ')
    : (loopback ? 'loopback' : '–');
  $('my-threads').textContent = `${p.threads || 1} of ${cores}${loopback ? ' (loopback)' : ''}`;
  $('my-samples').textContent = num(p.samples);
  $('my-steps').textContent = num(p.steps);
  $('my-accepted').textContent = num(p.pushes_accepted);
  $('my-rejected').textContent = num(p.pushes_rejected);
  $('my-rate').textContent = num(p.samples_per_sec);
  $('my-loss').textContent = p.steps > 0 ? fixed(p.ema_loss, 4) : '–';
  $('my-step').textContent = p.step_ms == null ? '–'
    : `${p.step_ms.toFixed(1)} ms` + (p.wait_ms == null ? '' : ` + ${p.wait_ms.toFixed(1)} ms waiting`);
  $('my-reconnects').textContent = num(p.reconnects);
  // The driver's own error (why the last session ended) or the shards' last word.
  $('my-last-error').textContent = p.error || p.last_error || 'none';
  const problem = p.state === 'reconnecting' ? p.error : null;
  showError(problem ? `Lost the server: ${problem}. Retrying automatically.` : '');
  document.title = p.steps > 0 ? `crowdgrad · ${num(p.samples)} samples` : 'crowdgrad';
  markMyWorker();
}

function renderVisibility() {
  const note = $('visibility');
  if (!volunteer.worker) {
    note.hidden = true;
    return;
  }
  if (document.visibilityState === 'hidden') {
    volunteer.hiddenSince = performance.now();
    note.hidden = false;
    note.textContent = 'This tab is hidden. Training continues in the Web Worker, '
      + 'though the browser may slow background tabs.';
  } else {
    if (volunteer.hiddenSince != null) {
      volunteer.hiddenMs += performance.now() - volunteer.hiddenSince;
      volunteer.hiddenSince = null;
    }
    const s = Math.round(volunteer.hiddenMs / 1000);
    note.hidden = s === 0;
    note.textContent = `This tab was hidden for ${s} s in total; the Web Worker kept training meanwhile.`;
  }
}

$('contribute').addEventListener('click', startContributing);
$('pause').addEventListener('click', togglePause);
$('throttle').addEventListener('change', (e) => send('throttle', Number(e.target.value)));
document.addEventListener('visibilitychange', renderVisibility);

// ---------------------------------------------------------------- dashboard

let chart = null;
let hist = null;
let histShards = -1;
const BUCKETS = 17;
const HIST_COLORS = ['#1f4f8f', '#a3441f', '#1f6f43', '#7a3f9d', '#8a6d00', '#2b7c8c'];

// Normalises a histogram to shares (a step outline is drawn, one bucket per staleness value).
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
    series.push({ label: `shard ${i}`, stroke: HIST_COLORS[i % HIST_COLORS.length], width: 2, paths: step, value: (u, v) => pct(v) });
  }
  series.push({ label: 'read skew', stroke: '#444', dash: [6, 4], width: 2, paths: step, value: (u, v) => pct(v) });
  const opts = {
    width: Math.max(280, box.clientWidth),
    height: 200,
    scales: { x: { time: false }, y: { range: [0, 1] } },
    axes: [
      { label: 'updates behind', stroke: '#555', values: (u, vs) => vs.map((v) => (v >= BUCKETS - 1 ? `${BUCKETS - 1}+` : v)) },
      { label: 'share', stroke: '#555', values: (u, vs) => vs.map((v) => `${Math.round(v * 100)}%`) },
    ],
    series,
    legend: { live: true },
  };
  const empty = [Array.from({ length: BUCKETS }, (_, i) => i), ...series.slice(1).map(() => [])];
  hist = new uPlot(opts, empty, box);
}

function renderHist(st) {
  const shards = st.shards || [];
  if (histShards !== shards.length) makeHist(shards.length);
  const xs = Array.from({ length: BUCKETS }, (_, i) => i);
  hist.setData([xs, ...shards.map((s) => shares(s.staleness_hist)), shares(st.read_skew_hist)]);
}

// A compact text sparkline of a worker's staleness histogram (its counts in the label).
function sparkline(h) {
  const bars = '▁▂▃▄▅▆▇█';
  const counts = Array.from({ length: BUCKETS }, (_, i) => (h && h[i]) || 0);
  const last = counts.reduce((m, c, i) => (c > 0 ? i : m), 0);
  const max = Math.max(1, ...counts);
  return counts.slice(0, last + 1).map((c) => (c === 0 ? ' ' : bars[Math.min(7, Math.floor((c / max) * 7.999))])).join('');
}

// A language model's run (status `task.kind` "language") shows validation bits per character
// (bits per token with byte tokens) where a classifier shows accuracy and loss, and the text
// its current weights write (/api/sample).
let language = null;
const SAMPLE_EVERY_MS = 5_000;
let sampleTimer = null;

function setTask(task) {
  const lm = task && task.kind === 'language' ? task : null;
  if (JSON.stringify(lm) === JSON.stringify(language)) return;
  language = lm;
  const unit = lm && lm.level === 'bytes' ? 'byte' : 'character';
  $('kpi-accuracy-label').textContent = lm ? `Next-${unit} accuracy` : 'Test accuracy';
  $('kpi-loss-label').textContent = lm ? `Validation bits/${unit === 'byte' ? 'byte' : 'char'}` : 'Test loss';
  $('chart-caption').textContent = lm
    ? `Next-${unit} accuracy (left axis) and validation bits per ${unit} (right axis; lower is better) against seconds since the run began.`
    : 'Test accuracy (left axis) and loss (right axis) against seconds since the run began.';
  if (chart) {
    chart.destroy();
    chart = null;
    $('chart').replaceChildren();
    makeChart();
  }
  $('sample').hidden = !lm;
  if (lm && !sampleTimer) {
    loadSample();
    sampleTimer = setInterval(() => { if (!document.hidden) loadSample(); }, SAMPLE_EVERY_MS);
  }
}

async function loadSample() {
  try {
    const r = await fetch('/api/sample');
    if (r.status !== 200) return;
    const s = await r.json();
    const out = $('sample-text');
    const prompt = document.createElement('span');
    prompt.className = 'sample-prompt';
    prompt.textContent = s.prompt;
    out.replaceChildren(prompt, document.createTextNode(s.text));
    $('sample-info').textContent = `After ${num(s.samples)} samples (step ${num(s.step)}), at temperature ${s.temperature}: `
      + 'the bold prompt is the server\'s, the rest the model\'s.';
  } catch (_) {
    // The next poll tries again.
  }
}

function makeChart() {
  const box = $('chart');
  const width = Math.max(280, box.clientWidth);
  const opts = {
    width,
    height: 260,
    scales: { x: { time: false }, acc: { range: [0, 1] }, loss: { auto: true } },
    axes: [
      { label: 'seconds', stroke: '#555' },
      { scale: 'acc', label: language ? 'next-token accuracy' : 'accuracy', stroke: '#1f6f43', values: (u, vs) => vs.map((v) => `${Math.round(v * 100)}%`) },
      { scale: 'loss', label: language ? 'bits per token' : 'loss', side: 1, grid: { show: false }, stroke: '#a3441f' },
    ],
    series: [
      { label: 'time (s)' },
      { label: language ? 'next-token accuracy' : 'test accuracy', scale: 'acc', stroke: '#1f6f43', width: 2, value: (u, v) => pct(v) },
      { label: language ? 'validation bits/token' : 'test loss', scale: 'loss', stroke: '#a3441f', width: 2, value: (u, v) => fixed(v, language ? 3 : 4) },
    ],
    legend: { live: true },
  };
  chart = new uPlot(opts, [[], [], []], box);
  new ResizeObserver(() => {
    const w = Math.max(280, box.clientWidth);
    if (chart && Math.abs(chart.width - w) > 2) chart.setSize({ width: w, height: 260 });
  }).observe(box);
}

function cell(text, cls) {
  const td = document.createElement('td');
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

// The worker table shows one page of PAGE workers, newest first, from /api/workers (with the
// reputation records of its rows): fetched when the page moves and every WORKERS_EVERY_MS
// while the page is visible, one request at a time.
const PAGE = 100;
const WORKERS_EVERY_MS = 3_000;
const workerPages = { offset: 0, total: 0, loading: false };

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
  if (workerPages.loading) return;
  const offset = workerPages.offset;
  workerPages.loading = true;
  try {
    const r = await fetch(`/api/workers?offset=${offset}&limit=${PAGE}`);
    const page = await r.json();
    if (!r.ok) throw new Error(page.error || r.statusText);
    if (offset !== workerPages.offset) return; // the user moved on meanwhile
    workerPages.total = page.total;
    reputation.workers = page.reputation || {};
    if (page.workers.length === 0 && offset > 0) {
      // Workers were forgotten since: show the last page that still exists.
      workerPages.offset = Math.max(0, Math.ceil(page.total / PAGE) - 1) * PAGE;
    } else {
      renderWorkers(page.workers);
    }
  } catch (err) {
    console.warn('crowdgrad: could not load workers', err);
  } finally {
    workerPages.loading = false;
    renderWorkerPager();
  }
}

function moveWorkerPage(pages) {
  const last = Math.max(0, Math.ceil(workerPages.total / PAGE) - 1) * PAGE;
  workerPages.offset = Math.min(last, Math.max(0, workerPages.offset + pages * PAGE));
  loadWorkerPage();
  renderWorkerPager();
}

$('workers-newer').addEventListener('click', () => moveWorkerPage(-1));
$('workers-older').addEventListener('click', () => moveWorkerPage(1));

function kindSummary(k) {
  if (!k) return '–';
  const part = (name, c) => `${name} ${num(c && c.connected)} / ${num(c && c.registered)}`;
  return `${part('native', k.native)} · ${part('browser', k.browser)}`;
}

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

function renderWorkers(workers) {
  const body = $('workers');
  // Online workers first, then newest first (as the pages are).
  const rows = groupThreads(workers).sort((a, b) => (b.connected - a.connected) || (b.id - a.id));
  body.replaceChildren(...rows.map((w) => {
    const tr = document.createElement('tr');
    tr.dataset.connected = String(!!w.connected);
    tr.dataset.kind = w.client;
    tr.dataset.id = String(w.id);
    tr.dataset.ids = w.ids.join(',');
    tr.dataset.threads = String(w.thread_count);
    const ids = w.ids.length > 1 ? `${w.ids.join(', ')} · ${w.thread_count} threads` : String(w.id);
    const label = w.name ? `${ids} (${w.name})` : ids;
    tr.append(
      cell(label),
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

// Spot checks and quarantine (issue 10): the counts from the tick, the records of the shown
// rows from /api/workers: checks passed / failed over the row's worker ids, or QUARANTINED
// with the reason as the tooltip.
const reputation = { workers: {}, quarantined: 0 };
function trustCell(ids, tr) {
  const reps = ids.map((id) => (reputation.workers || {})[String(id)]).filter(Boolean);
  const q = reps.find((r) => r.quarantined);
  if (q) {
    tr.dataset.quarantined = 'true';
    const td = cell('QUARANTINED', 'quarantined');
    td.title = q.quarantined.reason;
    return td;
  }
  const ok = reps.reduce((n, r) => n + r.spot_passed, 0);
  const bad = reps.reduce((n, r) => n + r.spot_failed, 0);
  const td = cell(reps.length ? `${num(ok)} / ${num(bad)}` : '–', 'num');
  const last = reps.map((r) => r.last_check).filter(Boolean).pop();
  if (last) td.title = `last check: cosine ${last.cosine.toFixed(6)}, norm ratio ${last.norm_ratio.toFixed(4)}`;
  return td;
}

// What a worker reported about its exchanges (issue 8): inner steps per push, the negotiated
// encodings, its traffic, and the share of its time spent computing rather than waiting.
function exchangeCells(x) {
  if (!x) return [cell('–', 'num'), cell('–'), cell('–', 'num'), cell('–', 'num')];
  const enc = (e) => (e === 'int8_block' ? 'int8' : e);
  const share = Math.max(0, Math.min(1, x.compute_share || 0));
  const busy = cell(`${(100 * share).toFixed(0)}% / ${(100 * (1 - share)).toFixed(0)}%`, 'num');
  busy.title = `mean exchange ${fixed(1000 * (x.exchange_s || 0), 1)} ms`;
  return [
    cell(num(x.local_steps), 'num'),
    cell(`${enc(x.pull_encoding)} / ${enc(x.push_encoding)}`),
    cell(`${bytes(x.up_bps)}/s / ${bytes(x.down_bps)}/s`, 'num'),
    busy,
  ];
}

function sparkCell(h) {
  const td = cell(sparkline(h), 'spark');
  const counts = (h || []).map((c, i) => `${i === BUCKETS - 1 ? `${i}+` : i}: ${c}`).filter((s) => !s.endsWith(': 0'));
  td.setAttribute('aria-label', counts.length ? `pushes by staleness, ${counts.join(', ')}` : 'no pushes yet');
  td.title = counts.join('\n');
  return td;
}

function markMyWorker() {
  const mine = new Set(((volunteer.progress && volunteer.progress.worker_ids) || []).map(String));
  for (const tr of $('workers').children) {
    const me = (tr.dataset.ids || '').split(',').some((id) => mine.has(id));
    tr.classList.toggle('me', me);
    if (me) tr.title = 'this tab';
    else tr.removeAttribute('title');
  }
}

// Remote shard processes (serve --shard-urls) report their health; in-process shards are
// always up.
function shardHealth(h) {
  if (!h) return 'in process';
  if (h.ready) return `up (${h.url})`;
  return `${h.up ? 'wrong layout' : 'DOWN'}: ${h.error || ''} (${h.url})`;
}

// The resolved configuration as TOML-like text: top-level keys, then [sections].
function configText(cfg) {
  if (!cfg || typeof cfg !== 'object') return '–';
  const v = (x) => (typeof x === 'string' ? JSON.stringify(x) : Array.isArray(x) ? JSON.stringify(x) : String(x));
  const plain = Object.entries(cfg).filter(([, x]) => typeof x !== 'object' || Array.isArray(x));
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

// The latest status (loopback threads take the run's model and batch from it).
let lastStatus = null;

function renderStatus(st) {
  lastStatus = st;
  // A private run shows the token field (unless the link carried the token).
  $('join-token-label').hidden = !st.private_run || Boolean(joinToken);
  const opt = st.optimizer || {};
  const rule = opt.rule && opt.rule.kind ? opt.rule.kind : (typeof opt.rule === 'string' ? opt.rule : '');
  const model = typeof st.model === 'string' ? st.model : JSON.stringify(st.model);
  const dataset = st.dataset && st.dataset.name ? st.dataset.name : (st.dataset || '');
  $('run-info').textContent = [
    `run ${st.run_id}`, model, dataset && `on ${dataset}`, st.consistency,
    st.batch_size && `batch ${st.batch_size}`, rule && `${rule}${opt.lr ? ` lr ${Number(opt.lr.toPrecision(6))}` : ''}`,
    `up ${Math.round(st.uptime_s || 0)} s`,
  ].filter(Boolean).join(' · ');
  setTask(st.task);
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
  reputation.quarantined = (st.reputation && st.reputation.quarantined) || 0;
  const sc = st.spot_checks;
  $('kpi-spot').textContent = `${sc ? `${num(sc.passed)} / ${num(sc.failed)}` : 'off'} · ${num(reputation.quarantined || 0)}`;
  $('kpi-bytes').textContent = `${bytes(t.bytes_up)} / ${bytes(t.bytes_down)}`;
  $('kpi-kinds').textContent = kindSummary(t.workers);
  $('kpi-mode').textContent = st.consistency || '–';
  $('kpi-policy').textContent = st.staleness_policy || '–';
  $('kpi-skew').textContent = t.read_steps ? `${fixed(t.read_skew_mean, 2)} / ${num(t.read_skew_max)}` : '–';
  if (t.workers) workerPages.total = t.workers.registered;
  renderWorkerPager();
  renderShards(st.shards || [], st.remote_shards);
  $('config').textContent = configText(st.config);
  renderHist(st);
  const h = st.eval_history || [];
  const second = language ? (e) => e.bits_per_token : (e) => e.loss;
  if (chart) chart.setData([h.map((e) => e.time_s), h.map((e) => e.accuracy), h.map(second)]);
}

function setLive(live) {
  const el = $('live');
  el.dataset.live = String(live);
  el.textContent = live ? 'live' : 'reconnecting…';
}

// "Your contribution" and the leaderboard, from the server's ledger (/api/contributors):
// one request at a time, every 3 s, each abandoned after 5 s.
const BOARD_EVERY_MS = 3_000;
const BOARD_TOP = 10;
let boardLoading = false;

function ago(unix) {
  if (!unix) return '–';
  return new Date(unix * 1000).toLocaleString();
}

async function loadBoard() {
  if (boardLoading) return;
  boardLoading = true;
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), 5_000);
  try {
    const q = new URLSearchParams({ limit: String(BOARD_TOP), identity });
    const r = await fetch(`/api/contributors?${q}`, { signal: abort.signal });
    const b = await r.json();
    if (!r.ok) throw new Error(b.error || r.statusText);
    const you = b.you;
    $('me-identity').textContent = identity;
    $('me-samples').textContent = you ? num(you.samples) : '0';
    $('me-pushes').textContent = you ? `${num(you.pushes_accepted)} / ${num(you.pushes_rejected)}` : '0 / 0';
    $('me-compute').textContent = you ? `${fixed(you.compute_seconds, 1)} s` : '0 s';
    $('me-seen').textContent = you ? `${ago(you.first_seen_unix)} – ${ago(you.last_seen_unix)}` : '–';
    $('me-rank').textContent = you && b.your_rank ? `${num(b.your_rank)} of ${num(b.total)}` : '–';
    $('leaderboard').replaceChildren(...b.contributors.map((c, i) => {
      const tr = document.createElement('tr');
      if (c.identity === identity) tr.className = 'me';
      const cells = [String(i + 1), c.name || `${c.identity.slice(0, 8)}…`, c.client, num(c.samples),
        `${num(c.pushes_accepted)} / ${num(c.pushes_rejected)}`, `${fixed(c.compute_seconds, 1)} s`];
      tr.replaceChildren(...cells.map((text, j) => {
        const td = document.createElement('td');
        td.textContent = text;
        if (j === 0 || j >= 3) td.className = 'num';
        return td;
      }));
      return tr;
    }));
  } catch (err) {
    console.warn('crowdgrad: could not load the contributors', err);
  } finally {
    clearTimeout(timer);
    boardLoading = false;
  }
}

loadBoard();
setInterval(() => { if (document.visibilityState !== 'hidden') loadBoard(); }, BOARD_EVERY_MS);

// The dashboard stream. `run` (first, and again after a missed tick) carries the run's
// description, the whole evaluation history and the current tick; each `tick` carries the
// counters and only the evaluation points added since the previous one, appended here (thinned
// as the server thins its own history: every other point once it holds EVAL_HISTORY).
const EVAL_HISTORY = 1024;
let run = null;
let history = [];
let events = null;

function applyTick(tick) {
  if (!run || !tick) return;
  renderStatus({ ...run, ...tick, eval_history: history });
}

function onRun(data) {
  run = data.run || {};
  history = data.eval_history || [];
  applyTick(data.tick);
}

function onTick(tick) {
  for (const p of tick.evals || []) {
    // A point the `run` event already carried (it may be taken a moment after its tick).
    if (history.length && p.time_s <= history[history.length - 1].time_s) continue;
    if (history.length >= EVAL_HISTORY) history = history.filter((_, i) => i % 2 === 0);
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

// A hidden page sends nothing and receives nothing: its stream closes, its polls stop; both
// resume (a fresh `run` event first) when it is shown again.
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
setInterval(() => { if (document.visibilityState !== 'hidden') loadWorkerPage(); }, WORKERS_EVERY_MS);

makeChart();
connectEvents();
loadWorkerPage();

// A handle for debugging from the console (and for the browser test to read figures).
window.crowdgrad = { volunteer };
