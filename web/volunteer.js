// The volunteer's panel: K Web Workers ("use K of N cores"; each web/worker.js hosts one Rust
// BrowserWorker, joined as thread i of K of one volunteer), started, paused and stopped from
// here; the data they move (this session and today, with an optional daily cap); the
// volunteer's identity, name and team; and one sentence of what the tab contributes.
// No training logic lives here: the numbers come from the workers' progress reports.
import { $, announce, bytes, fixed, hex, num } from './fmt.js';
import { publicId } from './identity.js';

export const volunteer = {
  worker: null,
  // One entry per running Web Worker: { worker, progress, lastBytes, stopping }.
  threads: [],
  running: false,
  paused: false,
  // Why the tab paused itself (Save-Data), as opposed to the volunteer's Pause.
  autoPaused: null,
  progress: null,
  hiddenSince: null,
  hiddenMs: 0,
  // performance.now() (ms since navigation start) of the click and of the first accepted push.
  clickedAt: null,
  firstPushAt: null,
  // What threads that ended this session did (a cores change or a Stop retires them).
  retired: { samples: 0, steps: 0, pushes_accepted: 0, pushes_rejected: 0, reconnects: 0, bytes_up: 0, bytes_down: 0, reasons: {} },
  sessionBytes: 0,
  // [performance.now(), samples] of this tab and of the run, for "the last minute".
  mine: [],
  runs: [],
  // The last state said in the live region.
  said: null,
};

const store = {
  get(k) { try { return localStorage.getItem(k); } catch { return null; } },
  set(k, v) { try { localStorage.setItem(k, v); } catch { /* private mode: this page only */ } },
  del(k) { try { localStorage.removeItem(k); } catch { /* nothing stored */ } },
};

// ---------------------------------------------------------------- identity, name, team

// The volunteer's stable identity: 32 random hex digits (128 bits) made once and kept in
// localStorage, sent only in the join (a Web Worker cannot read localStorage, so the page
// posts it to each one: never in a URL, which servers and proxies log). It is a secret:
// whoever has it is credited as this volunteer. The server credits, names and quarantines the
// public id derived from it (identity.js; docs/protocol.md, "Join"), and that is all it shows;
// the page shows it too and finds itself on the board by it. "Forget me" removes the identity;
// the next Start makes a new one.
const IDENTITY_KEY = 'crowdgrad.identity';
const IDENTITY_RE = /^[A-Za-z0-9_-]{8,64}$/;
const NAME_KEY = 'crowdgrad.name';
const TEAM_KEY = 'crowdgrad.team';
const DATA_KEY = 'crowdgrad.data.today';
const CAP_KEY = 'crowdgrad.data.cap_mb';
const REACHED_KEY = 'crowdgrad.data.cap_reached';
let identity = null;

export function getIdentity(create = true) {
  if (identity) return identity;
  const kept = store.get(IDENTITY_KEY);
  if (kept && IDENTITY_RE.test(kept)) identity = kept;
  else if (create) {
    identity = hex(16);
    store.set(IDENTITY_KEY, identity);
  }
  return identity;
}

// The public id of the identity (null when there is none yet), computed once per identity.
let publicOf = { secret: null, id: null };
export function getPublicId() {
  const secret = getIdentity(false);
  if (!secret) return null;
  if (publicOf.secret !== secret) publicOf = { secret, id: publicId(secret) };
  return publicOf.id;
}

function renderIdentity() {
  const pub = getPublicId();
  const shown = $('me-identity-short');
  shown.textContent = pub ? `${pub.slice(0, 8)}…` : 'none yet (made at the next Start)';
  shown.title = pub ? `Your public id: ${pub}` : '';
  $('copy-identity').disabled = !pub;
}

async function copyIdentity() {
  const id = getIdentity(false);
  if (!id) return;
  let ok = false;
  try {
    await navigator.clipboard.writeText(id);
    ok = true;
  } catch {
    ok = false;
  }
  $('copy-result').textContent = ok ? 'Copied your secret identity. Keep it to yourself: whoever has it is credited as you.'
    : `Your secret identity (keep it to yourself): ${id}`;
}

function forget() {
  if (volunteer.running) stopAll(null);
  showError('');
  showNote('');
  for (const k of [IDENTITY_KEY, NAME_KEY, TEAM_KEY, DATA_KEY, CAP_KEY, REACHED_KEY]) store.del(k);
  identity = null;
  $('my-name').value = '';
  $('my-team').value = '';
  $('cap').value = '';
  volunteer.sessionBytes = 0;
  renderIdentity();
  renderData();
  $('copy-result').textContent = 'Forgotten: nothing of yours is kept in this browser now.';
}

// ---------------------------------------------------------------- data used, and the cap

const today = () => {
  const d = new Date();
  return `${d.getFullYear()}-${String(d.getMonth() + 1).padStart(2, '0')}-${String(d.getDate()).padStart(2, '0')}`;
};

function todayBytes() {
  try {
    const v = JSON.parse(store.get(DATA_KEY) || 'null');
    return v && v.date === today() ? Number(v.bytes) || 0 : 0;
  } catch {
    return 0;
  }
}

function addToday(n) {
  store.set(DATA_KEY, JSON.stringify({ date: today(), bytes: todayBytes() + n }));
}

function capBytes() {
  const mb = Number($('cap').value);
  return $('cap').value !== '' && Number.isFinite(mb) && mb > 0 ? mb * 1e6 : null;
}

// Whether today's data, with `ahead` bytes more, reaches the cap; or the cap already
// stopped the tab today (and was not raised since).
function overCap(ahead = 0) {
  const cap = capBytes();
  if (cap == null) return false;
  let reached = null;
  try { reached = JSON.parse(store.get(REACHED_KEY) || 'null'); } catch { reached = null; }
  if (reached && reached.date === today() && cap <= reached.cap) return true;
  return todayBytes() + ahead >= cap;
}

function capReached() {
  store.set(REACHED_KEY, JSON.stringify({ date: today(), cap: capBytes() }));
}

function capMessage() {
  return `Stopped at your limit: this tab moved ${bytes(todayBytes())} of the ${$('cap').value} MB a day you allow `
    + '(it stops before the next moments of traffic would pass it). Raise the limit, or come back tomorrow.';
}

function renderData() {
  $('data-session').textContent = bytes(volunteer.sessionBytes);
  const cap = capBytes();
  $('data-today').textContent = `${bytes(todayBytes())}${cap ? ` of ${bytes(cap)}` : ''}`;
}

// What a thread's report says it moved: its sockets both ways, and its partition unless the
// Cache API had it.
const moved = (p) => (p.bytes_up || 0) + (p.bytes_down || 0) + (p.data_from_cache ? 0 : (p.data_bytes || 0));

// ---------------------------------------------------------------- threads

const pageQuery = new URLSearchParams(location.search);
// Loopback mode (`/?loopback=1`): every Web Worker trains against in-memory shards of its own
// on a synthetic partition, with the run's model and batch: this device's compute alone;
// `&batch=B` overrides the batch there (to time smaller batches).
export const loopback = pageQuery.get('loopback') === '1';

export const cores = Math.max(1, Number(navigator.hardwareConcurrency) || 1);
let statusFn = () => null;

// The script URL tells each Web Worker which thread it is, and who it works for.
function workerUrl(index, count, key) {
  const st = statusFn();
  const q = new URLSearchParams({ thread: String(index), threads: String(count), volunteer: key });
  if (!loopback) {
    const name = $('my-name').value.trim();
    const team = $('my-team').value.trim();
    if (name) q.set('name', name);
    if (team) q.set('team', team);
  }
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
  const w = new Worker(workerUrl(index, count, key), { type: 'module' });
  const t = { worker: w, progress: null, lastBytes: 0, lastDelta: 0, stopping: false };
  volunteer.threads[index] = t;
  if (index === 0) volunteer.worker = w;
  w.onmessage = (e) => {
    const msg = e.data;
    if (msg.type === 'progress') {
      onThreadProgress(t, msg.progress);
      // The first thread has the partition in the Cache API once it trains: start the others,
      // which find it there (one download for all).
      if (index === 0 && msg.progress.state === 'training' && volunteer.running) startRest(count, key);
    } else if (msg.type === 'error') showError(msg.message);
  };
  w.onerror = (e) => {
    e.preventDefault();
    showError(`The worker failed to load: ${e.message || 'unknown error'}`);
  };
  w.postMessage({ cmd: 'throttle', value: Number($('throttle').value) });
  w.postMessage({ cmd: 'token', value: $('join-token').value });
  if (!loopback) w.postMessage({ cmd: 'identity', value: getIdentity() });
  if (volunteer.paused) w.postMessage({ cmd: 'pause' });
  w.postMessage({ cmd: 'start' });
}

function startRest(count, key) {
  if (volunteer.threads.length >= count) return;
  clearTimeout(volunteer.restTimer);
  for (let i = volunteer.threads.length; i < count; i++) startThread(i, count, key);
}

// Every command goes to every Web Worker: pause and the CPU limit hold for all of them.
function send(cmd, value) {
  for (const t of volunteer.threads) if (t) t.worker.postMessage({ cmd, value });
}

function onThreadProgress(t, p) {
  t.progress = p;
  const now = moved(p);
  t.lastDelta = Math.max(0, now - t.lastBytes);
  if (now > t.lastBytes) {
    volunteer.sessionBytes += t.lastDelta;
    addToday(t.lastDelta);
  }
  t.lastBytes = now;
  if (t.stopping && p.state === 'stopped') t.worker.terminate();
  renderProgress(sumProgress());
  renderData();
  // Reports come four times a second: stop when the next one could pass the cap (with half
  // again as a margin), so the cap is crossed by no more than what is in flight when the
  // workers are told. A partition download counts when it is complete, at once.
  const next = volunteer.threads.reduce((a, x) => a + ((x && x.lastDelta) || 0), 0);
  if (volunteer.running && overCap(1.5 * next)) {
    capReached();
    stopAll(capMessage(), 'note');
  }
}

// Ends a thread: `stop` closes its sockets (a Close frame to every shard), then the Web
// Worker is terminated once it says it stopped, or after 1.5 s whatever it is doing.
function retire(t) {
  if (!t) return;
  const p = t.progress || {};
  const r = volunteer.retired;
  for (const k of ['samples', 'steps', 'pushes_accepted', 'pushes_rejected', 'reconnects', 'bytes_up', 'bytes_down']) r[k] += p[k] || 0;
  for (const [k, v] of Object.entries(p.rejected_by_reason || {})) r.reasons[k] = (r.reasons[k] || 0) + v;
  t.stopping = true;
  t.worker.postMessage({ cmd: 'stop' });
  setTimeout(() => t.worker.terminate(), 1_500);
}

function launch(count) {
  const key = hex(16);
  volunteer.count = count;
  startThread(0, count, key);
  // Loopback threads download nothing; otherwise the rest start once thread 0 trains, or
  // after 30 s whatever it is doing (a slow download must not keep the other cores idle).
  if (loopback) startRest(count, key);
  else volunteer.restTimer = setTimeout(() => startRest(count, key), 30_000);
}

function retireAll() {
  clearTimeout(volunteer.restTimer);
  const old = volunteer.threads;
  volunteer.threads = [];
  volunteer.worker = null;
  old.forEach(retire);
}

function chosenCores() {
  return Math.min(cores, Math.max(1, Number($('cores').value) || 1));
}

function startContributing() {
  showError('');
  if (overCap()) {
    showNote(capMessage());
    return;
  }
  showNote('');
  volunteer.clickedAt = performance.now();
  // The last report of a previous start says nothing about this one.
  volunteer.progress = null;
  volunteer.running = true;
  volunteer.stopped = false;
  const button = $('contribute');
  button.disabled = true;
  button.textContent = 'Contributing';
  button.setAttribute('aria-pressed', 'true');
  $('pause').hidden = false;
  $('stop').hidden = false;
  if (saveData() && !volunteer.paused) {
    volunteer.autoPaused = 'save-data';
    setPaused(true);
    showNote('Your browser asks sites to save data (Data Saver), so this tab is paused. Press Resume to train anyway.');
  }
  launch(chosenCores());
  renderIdentity();
}

// Stops every Web Worker and closes its sockets; `why` is shown as an error, or as a note.
export function stopAll(why, as = 'error', state = 'stopped') {
  if (!volunteer.running) {
    if (why) (as === 'note' ? showNote : showError)(why);
    return;
  }
  volunteer.running = false;
  volunteer.stopped = true;
  retireAll();
  const button = $('contribute');
  button.disabled = false;
  button.textContent = 'Contribute';
  button.setAttribute('aria-pressed', 'false');
  $('pause').hidden = true;
  $('stop').hidden = true;
  volunteer.paused = false;
  volunteer.autoPaused = null;
  $('pause').textContent = 'Pause';
  $('pause').setAttribute('aria-pressed', 'false');
  const el = $('my-state');
  el.textContent = state;
  el.dataset.state = 'stopped';
  say(state);
  if (why) (as === 'note' ? showNote : showError)(why);
  renderHeadline();
}

function setPaused(paused) {
  volunteer.paused = paused;
  send(paused ? 'pause' : 'resume');
  const b = $('pause');
  b.textContent = paused ? 'Resume' : 'Pause';
  b.setAttribute('aria-pressed', String(paused));
}

function togglePause() {
  if (volunteer.autoPaused) {
    volunteer.autoPaused = null;
    showNote('');
  }
  setPaused(!volunteer.paused);
}

// A cores change while training retires the threads and starts the new number (one new
// volunteer key: the server sees K' threads of one volunteer).
function coresChanged() {
  if (!volunteer.running) return;
  retireAll();
  launch(chosenCores());
}

// ---------------------------------------------------------------- Save-Data, defaults

const saveData = () => !!(navigator.connection && navigator.connection.saveData);

function watchSaveData() {
  const c = navigator.connection;
  if (!c || !c.addEventListener) return;
  c.addEventListener('change', () => {
    if (!volunteer.running) return;
    if (saveData() && !volunteer.paused) {
      volunteer.autoPaused = 'save-data';
      setPaused(true);
      showNote('Your browser now asks sites to save data (Data Saver), so this tab paused. Press Resume to train anyway.');
    } else if (!saveData() && volunteer.autoPaused === 'save-data') {
      volunteer.autoPaused = null;
      setPaused(false);
      showNote('');
    }
  });
}

// Conservative on phones and on battery, where the browser says so: 1 core at 50%. Else all
// cores but one, at 100%.
let touchedSettings = false;
function gentle(why) {
  if (touchedSettings || volunteer.running) return;
  $('cores').value = '1';
  $('throttle').value = '50';
  $('defaults-note').textContent = `${why}: this tab starts gently, 1 core at 50%. You can change both, even while it trains.`;
}

function applyDefaults() {
  $('cores').replaceChildren(...Array.from({ length: cores }, (_, i) => {
    const o = document.createElement('option');
    o.value = String(i + 1);
    o.textContent = String(i + 1);
    return o;
  }));
  $('cores').value = String(Math.max(1, cores - 1));
  $('cores-total').textContent = String(cores);
  if (matchMedia('(pointer: coarse)').matches) gentle('This looks like a phone or tablet');
  if (navigator.getBattery) {
    navigator.getBattery().then((b) => { if (!b.charging) gentle('This device runs on battery'); }).catch(() => {});
  }
}

// ---------------------------------------------------------------- rendering

function showError(text) {
  const el = $('my-error');
  el.hidden = !text;
  el.textContent = text || '';
}

function showNote(text) {
  const el = $('my-note');
  el.hidden = !text;
  el.textContent = text || '';
}

function say(state) {
  if (volunteer.said === state) return;
  volunteer.said = state;
  const words = {
    training: 'Your tab is training.',
    paused: 'Your tab is paused.',
    reconnecting: 'Your tab lost the server and is reconnecting.',
    quarantined: 'Your tab was quarantined by the server.',
    stopped: 'Your tab stopped.',
  };
  if (words[state]) announce(words[state]);
}

// The threads' reports as one: counts and rates add up (with what retired threads did), times
// and the loss are means.
function sumProgress() {
  const ps = volunteer.threads.map((t) => t && t.progress).filter(Boolean);
  if (ps.length === 0) return null;
  const r = volunteer.retired;
  const sum = (k) => ps.reduce((a, p) => a + (p[k] || 0), 0) + (r[k] || 0);
  const mean = (k) => {
    const vs = ps.map((p) => p[k]).filter((v) => v != null && Number.isFinite(v));
    return vs.length ? vs.reduce((a, b) => a + b, 0) / vs.length : null;
  };
  const stepping = ps.filter((p) => p.steps > 0);
  const first = ps[0];
  const worse = ps.find((p) => p.state === 'reconnecting') || first;
  const reasons = { ...r.reasons };
  for (const p of ps) for (const [k, v] of Object.entries(p.rejected_by_reason || {})) reasons[k] = (reasons[k] || 0) + v;
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
    bytes_up: sum('bytes_up'),
    bytes_down: sum('bytes_down'),
    rejected_by_reason: reasons,
    samples_per_sec: ps.reduce((a, p) => a + (p.samples_per_sec || 0), 0),
    reconnects: sum('reconnects'),
    ema_loss: stepping.length ? stepping.reduce((a, p) => a + p.ema_loss, 0) / stepping.length : first.ema_loss,
    step_ms: mean('step_ms'),
    wait_ms: mean('wait_ms'),
  };
}

// A refusal that will not change by retrying: a private run's token (401), a quarantined
// identity (403, or the shards' quarantined error). The tab stops and says what to do.
function fatal(p) {
  const text = `${p.error || ''} ${p.last_error || ''}`;
  if (/answered HTTP 401/.test(text)) {
    return 'This run is private and the server refused the join token. Ask the host for the run\'s link '
      + '(it ends with #token=…) or type the token in the Join token field, then press Contribute again.';
  }
  if (/answered HTTP 403/.test(text) || /quarantined/.test(p.last_error || '')) {
    return 'The server quarantined this browser\'s identity (its pushes looked wrong to the run\'s defences), '
      + 'so this tab stopped. Ask the host to lift it (crowdgrad ctl unquarantine) if you think it is a mistake.';
  }
  return null;
}

const REASON_WORDS = {
  too_stale: 'too stale',
  busy: 'server busy or paused',
  out_of_bounds: 'an outlier',
  replayed: 'a repeat',
  disagrees: 'disagreed with the others',
};

export function reasonsText(reasons) {
  const parts = Object.entries(reasons || {}).filter(([, v]) => v > 0).map(([k, v]) => `${k} ${num(v)}${REASON_WORDS[k] ? ` (${REASON_WORDS[k]})` : ''}`);
  return parts.length ? parts.join(' · ') : 'none';
}

function renderProgress(p) {
  if (!p) return;
  volunteer.progress = p;
  if (volunteer.firstPushAt == null && p.pushes_accepted > 0) volunteer.firstPushAt = performance.now();
  const why = fatal(p);
  if (why && volunteer.running) {
    stopAll(why, 'error', /quarantined/.test(why) ? 'quarantined' : 'stopped');
    return;
  }
  if (!volunteer.running) return;
  const state = $('my-state');
  let label = p.state;
  if (p.state === 'reconnecting' && p.retry_in_ms != null) {
    label = `reconnecting (retry in ${(p.retry_in_ms / 1000).toFixed(1)} s)`;
  }
  state.textContent = label;
  state.dataset.state = p.state;
  say(p.state);
  $('my-id').textContent = p.worker_ids && p.worker_ids.length ? p.worker_ids.join(', ')
    : (loopback ? 'loopback' : '–');
  $('my-threads').textContent = `${p.threads || 1} of ${cores}${loopback ? ' (loopback)' : ''}`;
  $('my-samples').textContent = num(p.samples);
  $('my-steps').textContent = num(p.steps);
  $('my-accepted').textContent = num(p.pushes_accepted);
  $('my-rejected').textContent = num(p.pushes_rejected);
  $('my-refusals').textContent = reasonsText(p.rejected_by_reason);
  const refused = Object.values(p.rejected_by_reason || {}).reduce((a, b) => a + b, 0);
  $('my-refusals-line').textContent = refused
    ? `· ${num(refused)} of ${num(refused + p.pushes_accepted)} pushes refused, as normal (reasons under Details)` : '';
  $('my-rate').textContent = num(p.samples_per_sec);
  $('my-loss').textContent = p.steps > 0 ? fixed(p.ema_loss, 4) : '–';
  $('my-step').textContent = p.step_ms == null ? '–'
    : `${p.step_ms.toFixed(1)} ms` + (p.wait_ms == null ? '' : ` + ${p.wait_ms.toFixed(1)} ms waiting`);
  $('my-bytes').textContent = `${bytes(p.bytes_up)} / ${bytes(p.bytes_down)}`;
  $('my-reconnects').textContent = num(p.reconnects);
  // The driver's own error (why the last session ended) or the shards' last real failure
  // (core clears it after the next applied push). Policy refusals are never shown here.
  $('my-last-error').textContent = p.error || p.last_error || 'none';
  const problem = p.state === 'reconnecting' ? p.error : null;
  showError(problem ? `Lost the server: ${problem}. Retrying automatically.` : '');
  document.title = p.steps > 0 ? `crowdgrad · ${num(p.samples)} samples` : 'crowdgrad';
  const t = performance.now();
  volunteer.mine.push([t, p.samples]);
  trim(volunteer.mine, t);
  renderHeadline();
  if (onProgressHook) onProgressHook(p);
}
let onProgressHook = null;

function trim(series, t) {
  while (series.length > 2 && series[1][0] < t - 60_000) series.shift();
}

// The change of `series` over the last minute (or since it began).
function lastMinute(series) {
  if (series.length < 2) return null;
  const a = series[0];
  const b = series[series.length - 1];
  return { d: b[1] - a[1], s: (b[0] - a[0]) / 1000 };
}

function renderHeadline() {
  const el = $('my-headline');
  const p = volunteer.progress;
  const mine = lastMinute(volunteer.mine);
  const run = lastMinute(volunteer.runs);
  if (volunteer.running && mine && run && run.d > 0 && mine.s > 5) {
    const share = Math.min(1, Math.max(0, mine.d / run.d));
    const span = mine.s >= 55 ? 'in the last minute' : `in the last ${Math.round(mine.s)} s`;
    // The tab counts what it computed, the server what it applied: near 100% they differ a
    // little, so the counts are shown only where they agree.
    const counts = mine.d <= run.d ? ` (${num(mine.d)} of ${num(run.d)})` : '';
    el.textContent = `You supplied ${Math.round(100 * share)}% of the run's samples ${span}${counts}.`;
  } else if (volunteer.running && volunteer.paused) {
    el.textContent = 'Paused: your tab computes nothing and sends nothing.';
  } else if (volunteer.running && p && p.samples > 0) {
    // Training, but not yet 5 s of both figures to compare.
    el.textContent = `Training: your tab has supplied ${num(p.samples)} samples so far.`;
  } else if (volunteer.running) {
    el.textContent = 'Getting ready: joining the run and fetching data…';
  } else if (p && p.samples > 0) {
    el.textContent = `This session your tab supplied ${num(p.samples)} samples. Thank you.`;
  } else {
    el.textContent = 'Click Contribute to lend this tab to the run.';
  }
}

// The run's totals, once a tick (app.js), for the headline's share.
export function noteRun(st) {
  const t = performance.now();
  const s = st && st.totals && st.totals.samples;
  if (s == null) return;
  volunteer.runs.push([t, s]);
  trim(volunteer.runs, t);
  if (volunteer.running) {
    // While nothing comes from the workers (paused), hold the tab's own line flat.
    const p = volunteer.progress;
    if (p) {
      volunteer.mine.push([t, p.samples]);
      trim(volunteer.mine, t);
    }
    renderHeadline();
  }
}

function renderVisibility() {
  const note = $('visibility');
  if (!volunteer.running) {
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

// A private run's join token: from the link's fragment (#token=..., never sent to the server
// in a URL) or typed into the field. It is taken off the address bar at once and never shown.
export const joinToken = (() => {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (!m) return '';
  history.replaceState(null, '', location.pathname + location.search);
  try {
    return decodeURIComponent(m[1]);
  } catch {
    return '';
  }
})();

// The ledger's "you" (app.js polls /api/contributors), for the all-time figures.
export function renderYou(you, rank, total) {
  $('me-samples').textContent = you ? num(you.samples) : '0';
  $('me-headline').textContent = you && you.samples > 0
    ? `All time, this browser supplied ${num(you.samples)} samples${rank ? ` (rank ${num(rank)} of ${num(total)})` : ''}.`
    : 'Nothing contributed from this browser yet.';
}

export function initVolunteer({ status, onProgress }) {
  statusFn = status;
  onProgressHook = onProgress;
  applyDefaults();
  if (joinToken) $('join-token').value = joinToken;
  $('my-name').value = store.get(NAME_KEY) || '';
  $('my-team').value = store.get(TEAM_KEY) || '';
  $('cap').value = store.get(CAP_KEY) || '';
  $('my-name').addEventListener('change', (e) => store.set(NAME_KEY, e.target.value.trim()));
  $('my-team').addEventListener('change', (e) => store.set(TEAM_KEY, e.target.value.trim()));
  $('cap').addEventListener('change', (e) => {
    store.set(CAP_KEY, e.target.value);
    renderData();
    if (volunteer.running && overCap()) {
      capReached();
      stopAll(capMessage(), 'note');
    }
  });
  $('contribute').addEventListener('click', startContributing);
  $('pause').addEventListener('click', togglePause);
  $('stop').addEventListener('click', () => stopAll(null));
  $('cores').addEventListener('change', () => { touchedSettings = true; coresChanged(); });
  $('throttle').addEventListener('change', (e) => { touchedSettings = true; send('throttle', Number(e.target.value)); });
  $('copy-identity').addEventListener('click', copyIdentity);
  $('forget').addEventListener('click', forget);
  document.addEventListener('visibilitychange', renderVisibility);
  watchSaveData();
  renderIdentity();
  renderData();
}

export { getIdentity as identityNow };
