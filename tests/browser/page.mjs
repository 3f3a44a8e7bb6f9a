#!/usr/bin/env node
// The page for its three people (issue 19), in real headless Chromium over the DevTools pipe
// (cdp.mjs), against the release server on MNIST (`--model softmax`: 15 KB shards, so the
// phase that watches the Web Workers' sockets costs the tab little):
//
//   node tests/browser/page.mjs            the checks (`cargo xtask test` runs them, ~2 min)
//   node tests/browser/page.mjs --soak 300 one honest tab of the default model for 300 s:
//                                          whether it ever shows an error, and the refusals
//                                          (out_of_bounds per pushes); not in the test command
//
// 1. Layout at 1280×720: the dashboard is wider than 700 px; a public run with one worker shows
//    no join-token field and no workers pager; a phone (390 px) has no horizontal scroll and
//    its one-line summary at the top. Screenshots at 390, 1280 and 1920 px (full page) go to
//    page-shots/ in the target directory (harness.mjs TARGET).
// 2. The page sits idle for a while, then one tab trains: the evaluation chart is flat across
//    the idle stretch (no slope from the first point to the next); no error is shown while it
//    trains; outlier refusals are counted, never shown as an error.
// 3. The evaluations and the run over time download as CSV and JSON. axe-core, injected in
//    the page, reports no serious or critical violation (full page and the classroom view).
// 4. Stop: every Web Worker target is gone and every WebSocket it opened is closed (CDP
//    Network events of the workers' sessions), and the server sees the tab's workers offline.
// 5. A data cap (20 MB over what the tab moved today) stops the tab at the cap; Forget me
//    leaves nothing of the volunteer in localStorage; the display name went with the join.
// 6. ?view=present shows the QR code, which decodes (jsQR, on the canvas's pixels) to the join
//    URL; the teacher's admin token pauses and resumes the run and stays out of the URL and
//    storage.
// 7. A phone (coarse pointer) starts with 1 core at 50%, and pauses itself on Save-Data.
// 8. A private run refused (401): the tab stops with the reason and what to do, no retrying;
//    its classroom view's QR code carries the join token, its markup and address do not.
// 9. A quarantined identity: stopped while training (a failed spot check) and at its next
//    join (403), each time with the reason and what to do, and no retrying.
// With the server's history endpoints (`/api/history`, `/api/evals`): the run's figures after
// an idle start are flat (samples/s 0) before training, not a line; the classroom view shows
// the guesses, a demonstration banner, a live consistency switch and a second experiment
// overlaid on the first, exported as CSV with its sim command.
// Everything binds 127.0.0.1, every wait is bounded, the last line is `N passed, M failed`.

import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import {
  ROOT, TARGET, check, deadline, finish, freePort, getStatus, killChildren, killChildrenOnExit,
  log, openBrowser, sleep, startServer, stopChild, tmpDir, waitFor,
} from './harness.mjs';
import { publicId } from '../../web/identity.js';

const require = createRequire(import.meta.url);
const jsQR = require('jsqr');
const AXE = path.join(ROOT, 'node_modules/axe-core/axe.min.js');
const SHOTS = path.join(TARGET, 'page-shots');
const ADMIN = 'teacher-token-0123456789';
const args = process.argv.slice(2);
const soakAt = args.indexOf('--soak');
const SOAK_S = soakAt >= 0 ? Number(args[soakAt + 1] || 300) : 0;
const LIMIT_S = Number(process.env.PAGE_TIMEOUT_S || (SOAK_S ? SOAK_S + 240 : 300));

const dirs = [];
killChildrenOnExit();
deadline(LIMIT_S, () => {
  check(`whole page test within ${LIMIT_S} s`, false, 'overall time limit hit');
  killChildren();
  finish(1);
});

// ------------------------------------------------------------------ the page over CDP

class Page {
  constructor(browser) {
    this.b = browser;
    this.workers = new Map(); // sessionId -> targetId of each attached Web Worker
    this.sockets = new Map(); // `${sessionId}/${requestId}` -> { url, closed }
    this.errors = [];
    this.watchNetwork = false;
    browser.on((m) => this.event(m));
  }

  event({ method, params, sessionId }) {
    if (method === 'Target.attachedToTarget' && params.targetInfo.type === 'worker') {
      const s = params.sessionId;
      this.workers.set(s, params.targetInfo.targetId);
      const go = () => this.b.send('Runtime.runIfWaitingForDebugger', {}, s).catch(() => {});
      if (this.watchNetwork) this.b.send('Network.enable', {}, s).then(go, go);
      else go();
    } else if (method === 'Target.detachedFromTarget') {
      this.workers.delete(params.sessionId);
    } else if (method === 'Network.webSocketCreated') {
      this.sockets.set(`${sessionId}/${params.requestId}`, { url: params.url, closed: false });
    } else if (method === 'Network.webSocketClosed') {
      const s = this.sockets.get(`${sessionId}/${params.requestId}`);
      if (s) s.closed = true;
    } else if (method === 'Runtime.exceptionThrown' && sessionId === this.b.session) {
      this.errors.push(`uncaught: ${params.exceptionDetails.text} ${(params.exceptionDetails.exception || {}).description || ''}`);
    } else if (method === 'Log.entryAdded' && params.entry.level === 'error' && sessionId === this.b.session) {
      this.errors.push(params.entry.text);
    } else if (method === 'Runtime.consoleAPICalled' && params.type === 'error' && sessionId === this.b.session) {
      this.errors.push(params.args.map((a) => a.value ?? a.description).join(' '));
    }
  }

  async init() {
    const s = this.b.session;
    await this.b.send('Page.enable', {}, s);
    await this.b.send('Runtime.enable', {}, s);
    await this.b.send('Log.enable', {}, s);
    await this.b.send('Target.setAutoAttach', { autoAttach: true, waitForDebuggerOnStart: true, flatten: true }, s);
  }

  eval(expr, ms) { return this.b.evaluate(expr, ms); }

  async size(width, height) {
    if (this.w === width && this.h === height) return;
    this.w = width;
    this.h = height;
    await this.b.send('Emulation.setDeviceMetricsOverride',
      { width, height, deviceScaleFactor: 1, mobile: width < 500 }, this.b.session);
    await sleep(400);
  }

  async goto(url) {
    await this.b.send('Page.navigate', { url }, this.b.session);
    await waitFor('the page to load', () => this.eval("document.readyState === 'complete' && !!window.crowdgrad"), 30_000, 100);
    await waitFor('the first status', () => this.eval("document.getElementById('run-info').textContent.startsWith('run ')"), 15_000, 100);
  }

  // A full-page PNG at `width`.
  async shot(name, width, height = 720, full = true) {
    await this.size(width, height);
    await sleep(700);
    const h = full ? await this.eval('Math.ceil(document.documentElement.scrollHeight)') : height;
    // A screen's worth is clipped where the page is scrolled to (sticky parts where they stick).
    const y = full ? 0 : await this.eval('Math.round(window.scrollY)');
    const { data } = await this.b.send('Page.captureScreenshot', {
      format: 'png', captureBeyondViewport: full, clip: { x: 0, y, width, height: Math.min(h, 12_000), scale: 1 },
    }, this.b.session, 30_000);
    fs.mkdirSync(SHOTS, { recursive: true });
    const file = path.join(SHOTS, `${name}.png`);
    fs.writeFileSync(file, Buffer.from(data, 'base64'));
    log(`screenshot ${path.relative(ROOT, file)} (${width}×${h})`);
    return file;
  }

  shown(id) {
    return this.eval(`(() => { const e = document.getElementById(${JSON.stringify(id)});
      return !!e && e.getClientRects().length > 0 && getComputedStyle(e).visibility !== 'hidden'; })()`);
  }

  text(id) { return this.eval(`(document.getElementById(${JSON.stringify(id)}) || {}).textContent || ''`); }
  click(id) { return this.eval(`document.getElementById(${JSON.stringify(id)}).click()`); }
  progress() { return this.eval('window.crowdgrad.volunteer.progress'); }

  // Serious and critical axe-core violations: [{id, impact, nodes, help}].
  async axe() {
    const have = await this.eval('typeof window.axe === "object"');
    if (!have) await this.eval(fs.readFileSync(AXE, 'utf8'), 30_000);
    const r = await this.eval(`axe.run(document, { resultTypes: ['violations'] }).then((r) => r.violations.map((v) => (
      { id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.slice(0, 3).map((n) => n.target.join(' ')) })))`, 60_000);
    return r.filter((v) => v.impact === 'serious' || v.impact === 'critical');
  }
}

async function newPage(tag) {
  const dir = tmpDir(`crowdgrad-page-${tag}-`);
  dirs.push(dir);
  const browser = await openBrowser(dir);
  const page = new Page(browser);
  await page.init();
  return page;
}

const digits = (t) => Number(String(t || '').replace(/[^0-9]/g, '') || 0);

// Samples the error box every `everyMs` while `until()` is false; returns what it ever showed.
async function watchErrors(page, until, timeoutMs, everyMs = 1_000) {
  const shown = [];
  const end = Date.now() + timeoutMs;
  while (Date.now() < end) {
    const e = await page.eval("(() => { const e = document.getElementById('my-error'); return e.hidden ? '' : e.textContent; })()");
    if (e && !shown.includes(e)) shown.push(e);
    if (await until()) return { shown, done: true };
    await sleep(everyMs);
  }
  return { shown, done: false };
}

// ------------------------------------------------------------------ the checks

async function layoutAndTraining(server) {
  const page = await newPage('main');
  await page.size(1280, 720);
  const loadedAt = Date.now();
  await page.goto(`${server.base}/`);
  const width = await page.eval("Math.round(document.getElementById('dashboard').getBoundingClientRect().width)");
  check('the dashboard is wider than 700 px at 1280×720', width > 700, `${width} px`);
  check('a public run shows no join-token field', !(await page.shown('join-token-label')));

  // Idle for a while before anybody trains: the chart must stay flat across it.
  await sleep(Math.max(0, 13_000 - (Date.now() - loadedAt)));
  page.watchNetwork = true;
  await page.eval(`(() => { const n = document.getElementById('my-name'); n.value = 'Ada L.'; n.dispatchEvent(new Event('change'));
    const t = document.getElementById('my-team'); t.value = 'Room 4+B'; t.dispatchEvent(new Event('change'));
    document.getElementById('cores').value = '1'; document.getElementById('contribute').click(); })()`);
  const run = await watchErrors(page, async () => ((await page.progress()) || {}).pushes_accepted >= 200, 60_000);
  const p = await page.progress();
  check('one tab trains (200 accepted pushes)', run.done, `${p && p.pushes_accepted} accepted, refused by reason ${JSON.stringify(p && p.rejected_by_reason)}`);
  check('no error is shown while an honest tab trains', run.shown.length === 0, run.shown.join(' | ') || 'none shown');
  check('the workers pager is hidden with one worker', !(await page.shown('workers-pager')));
  const named = (await (await fetch(`${server.base}/api/workers`)).json()).workers.map((w) => w.name);
  check('the display name goes with the join', named.includes('Ada L.'), JSON.stringify(named));
  const board = await (await fetch(`${server.base}/api/contributors`)).json();
  const teams = (board.teams || []).map((t) => `${t.team}: ${t.members} member(s), ${t.samples} samples`);
  check('the team goes with the join, and the leaderboard adds it up', (board.teams || []).some((t) => t.team === 'Room 4+B'
    && t.members === 1 && t.samples > 0), JSON.stringify(teams));
  const teamRows = await waitFor('the page\'s teams table', () => page.eval(`(() => { const w = document.getElementById('teams-wrap');
    return !w.hidden && document.getElementById('teams').textContent.includes('Room 4+B (yours)'); })()`), 10_000).catch(() => false);
  check('the page shows the teams, yours marked', teamRows);
  const shownRefusals = await page.text('my-refusals');
  const refused = Object.values((p && p.rejected_by_reason) || {}).reduce((a, b) => a + b, 0);
  check('refusals are counted by reason, in the details, not as an error',
    refused === 0 ? shownRefusals === 'none' : /\d/.test(shownRefusals), `${shownRefusals}`);

  // The chart after an idle start: between the first evaluation and the hold before the first
  // trained one, every plotted accuracy equals the first (a flat segment).
  await waitFor('a trained evaluation', () => page.eval("window.crowdgrad.experiments().slice(-1)[0].points.some((p) => p.samples > 0)"), 20_000);
  const flat = await page.eval(`(() => {
    const pts = window.crowdgrad.experiments().slice(-1)[0].points;
    const first = pts[0];
    const trained = pts.find((p) => p.samples > 0);
    const u = window.crowdgrad.chart();
    const xs = u.data[0], ys = u.data[1];
    const idle = [];
    for (let i = 0; i < xs.length; i++) if (xs[i] * 1000 < trained.t_ms - 1000) idle.push(ys[i]);
    return { gap_s: (trained.t_ms - first.t_ms) / 1000, idle: idle.length, flat: idle.every((y) => Math.abs(y - first.accuracy) < 1e-9) };
  })()`);
  check('the accuracy chart is flat across the idle start, not a line to the first trained point',
    flat.flat && flat.idle >= 2 && flat.gap_s > 10, `idle ${flat.gap_s.toFixed(1)} s, ${flat.idle} plotted points there`);

  // Screenshots while training.
  await page.eval("document.querySelectorAll('#my-details, #about').forEach((d) => { d.open = true; })");
  await page.shot('page-1280', 1280);
  await page.shot('page-1920', 1920, 1080);
  await page.size(390, 844);
  await sleep(800);
  const phone = await page.eval(`({ scroll: document.documentElement.scrollWidth,
    summary: document.getElementById('summary').getBoundingClientRect().top,
    text: document.getElementById('summary').textContent })`);
  check('a phone (390 px) does not scroll sideways', phone.scroll <= 390, `scrollWidth ${phone.scroll}`);
  check('a phone has the one-line run summary at the top', phone.summary < 200 && /accuracy/.test(phone.text), `${phone.text} at y=${Math.round(phone.summary)}`);
  await page.shot('page-390', 390, 844);
  await page.eval('window.scrollTo(0, 1500)');
  await sleep(300);
  const stuck = await page.eval("Math.round(document.getElementById('summary').getBoundingClientRect().top)");
  check('the phone\'s summary stays at the top of the screen while the page scrolls', stuck >= 0 && stuck < 5, `top ${stuck} px after scrolling 1500 px`);
  await page.shot('page-390-screen', 390, 844, false);
  await page.eval('window.scrollTo(0, 0)');
  await page.size(1280, 720);

  const violations = await page.axe();
  check('axe-core: no serious or critical violations on the page', violations.length === 0,
    violations.map((v) => `${v.id} (${v.impact}): ${v.nodes.join(', ')}`).join('; ') || 'none');

  // Every series downloads: the evaluations and the run over time, as CSV and as JSON.
  const dl = tmpDir('crowdgrad-page-downloads-');
  dirs.push(dl);
  await page.b.send('Browser.setDownloadBehavior', { behavior: 'allow', downloadPath: dl });
  await page.eval("document.querySelectorAll('[data-download]').forEach((b) => b.click())");
  const files = await waitFor('four downloads', () => {
    const f = fs.readdirSync(dl).filter((n) => !n.endsWith('.crdownload'));
    return f.length >= 4 ? f : null;
  }, 15_000).catch(() => fs.readdirSync(dl));
  const body = (n) => fs.readFileSync(path.join(dl, n), 'utf8');
  // A header and at least two rows in each CSV; each JSON parses.
  const ok = files.length === 4
    && files.filter((n) => n.endsWith('.csv')).every((n) => body(n).trim().split('\n').length > 2)
    && files.filter((n) => n.endsWith('.json')).every((n) => JSON.parse(body(n)));
  check('the evaluations and the run over time download as CSV and JSON', ok, files.join(', '));

  // Stop: the Web Workers end and their sockets close.
  const workerIds = (p && p.worker_ids) || [];
  const opened = [...page.sockets.values()].length;
  await page.click('stop');
  const stopped = await waitFor('the Web Workers to go', async () => page.workers.size === 0
    && [...page.sockets.values()].every((s) => s.closed), 10_000, 200).catch(() => false);
  const open = [...page.sockets.values()].filter((s) => !s.closed).length;
  check('Stop ends every Web Worker (CDP: no worker target left)', page.workers.size === 0, `${page.workers.size} left`);
  check('Stop closes every WebSocket (CDP Network: none open)', !!stopped && opened > 0 && open === 0, `${opened} opened, ${open} open`);
  const offline = await waitFor('the server to see the tab offline', async () => {
    const st = await getStatus(server.base);
    return st.workers.filter((w) => workerIds.includes(w.id)).every((w) => !w.connected) ? st : null;
  }, 10_000).catch(() => null);
  check('the server sees the stopped tab offline', !!offline && workerIds.length > 0, `workers ${workerIds.join(', ')}`);
  page.watchNetwork = false;

  // A daily data cap: once the tab trains again, a cap of what it moved today plus 20 MB
  // (about 1.5 s of a tab on loopback, 15 MB/s) stops it there.
  await page.click('contribute');
  await waitFor('the tab to train again', () => page.eval(`(() => { const t = window.crowdgrad.volunteer.threads[0];
    return window.crowdgrad.volunteer.running && !!t && !!t.progress && t.progress.pushes_accepted > 50; })()`), 30_000, 100);
  const today = await page.eval("JSON.parse(localStorage.getItem('crowdgrad.data.today') || '{\"bytes\":0}').bytes");
  const capMb = Math.round(today / 1e4) / 100 + 20;
  await page.eval(`(() => { const c = document.getElementById('cap'); c.value = '${capMb}'; c.dispatchEvent(new Event('change')); })()`);
  const capped = await waitFor('the tab to stop at its cap', async () => {
    const s = await page.eval(`({ running: window.crowdgrad.volunteer.running, note: document.getElementById('my-note').textContent,
      bytes: JSON.parse(localStorage.getItem('crowdgrad.data.today')).bytes })`);
    return !s.running && /limit/.test(s.note) ? s : null;
  }, 60_000, 100).catch(() => null);
  await sleep(2_000);
  const after = await page.eval(`({ bytes: JSON.parse(localStorage.getItem('crowdgrad.data.today')).bytes, threads: window.crowdgrad.volunteer.threads.length })`);
  // The page stops when the next two reports (a quarter second of traffic each) could cross
  // the cap: it stops a little before it, and at most what is in flight then may pass it.
  const over = capped ? after.bytes - capMb * 1e6 : null;
  check('a data cap stops the tab at the cap', !!capped && after.threads === 0 && page.workers.size === 0
    && capped.bytes > (capMb - 12) * 1e6 && over < 0.5e6,
    capped ? `cap ${capMb} MB, stopped at ${(capped.bytes / 1e6).toFixed(2)} MB, ${(after.bytes / 1e6).toFixed(2)} MB 2 s later (${over >= 0 ? '+' : ''}${(over / 1e3).toFixed(0)} kB from the cap); "${capped.note}"` : 'did not stop');
  const again = await page.eval("document.getElementById('contribute').click(), window.crowdgrad.volunteer.running");
  check('Contribute at the cap does not start', !again);
  // Issue 21: the page shows the start of its identity's public id (the server's derivation,
  // recomputed here), and the identity itself, a secret, is in no URL the tab fetched.
  const ident = JSON.parse(await page.eval(`JSON.stringify({ id: localStorage.getItem('crowdgrad.identity'),
    shown: document.getElementById('me-identity-short').textContent,
    urls: performance.getEntriesByType('resource').map((e) => e.name) })`));
  check('the page shows its public id, and no URL it fetched holds the secret identity',
    /^[0-9a-f]{32}$/.test(ident.id || '') && ident.shown === `${publicId(ident.id).slice(0, 8)}…`
      && !ident.urls.some((u) => u.includes(ident.id)),
    `shown ${ident.shown}, ${ident.urls.length} URLs`);
  await page.click('forget');
  const kept = await page.eval("Object.keys(localStorage).filter((k) => k.startsWith('crowdgrad.'))");
  check('Forget me clears the identity (and everything else of the volunteer) from the browser', kept.length === 0,
    kept.join(', ') || 'nothing kept');

  // Classroom view.
  await page.goto(`${server.base}/?view=present`);
  await sleep(1_500);
  check('?view=present shows the QR code', await page.shown('qr'));
  const qr = await page.eval(`(() => { const c = document.getElementById('qr'); const g = c.getContext('2d');
    return { w: c.width, h: c.height, data: Array.from(g.getImageData(0, 0, c.width, c.height).data), url: location.origin + '/' }; })()`);
  const code = jsQR(Uint8ClampedArray.from(qr.data), qr.w, qr.h);
  check('the QR code decodes to the join URL', code && code.data === qr.url, `${code ? code.data : 'no code found'} (want ${qr.url})`);
  const pv = await page.axe();
  check('axe-core: no serious or critical violations in the classroom view', pv.length === 0,
    pv.map((v) => `${v.id} (${v.impact}): ${v.nodes.join(', ')}`).join('; ') || 'none');
  await page.eval(`(() => { document.getElementById('teacher').open = true; const t = document.getElementById('admin-token');
    t.value = ${JSON.stringify(ADMIN)}; t.dispatchEvent(new Event('input')); document.getElementById('admin-pause').click(); })()`);
  const adminState = async () => (await fetch(`${server.base}/api/admin/state`, { headers: { Authorization: `Bearer ${ADMIN}` } })).json();
  const paused = await waitFor('the run to pause', async () => (await adminState()).paused, 5_000).catch(() => false);
  await page.click('admin-resume');
  const resumed = await waitFor('the run to resume', async () => !(await adminState()).paused, 5_000).catch(() => false);
  const leaked = await page.eval(`location.href.includes(${JSON.stringify(ADMIN)}) || Object.keys(localStorage).some((k) => localStorage.getItem(k).includes(${JSON.stringify(ADMIN)}))`);
  check('the teacher pauses and resumes the run from the page; the token stays out of the URL and storage', paused && resumed && !leaked);
  await page.shot('present-1280', 1280);
  await page.shot('present-1920', 1920, 1080);
  await page.shot('present-390', 390, 844, false);

  const errors = page.errors.filter((e) => !/favicon/.test(e));
  check('no console errors on the page', errors.length === 0, errors.slice(0, 3).join(' | ') || 'none');
  await page.b.close();
}

// The server's figures after an idle start: flat (nothing moved) before the first push.
async function historyFlat(server) {
  const r = await fetch(`${server.base}/api/history`);
  if (r.status === 404) {
    log('skipped: this server has no /api/history (the server side of issue 19 not merged)');
    return;
  }
  const h = await r.json();
  const pts = h.points || [];
  const firstMoving = pts.findIndex((p) => p.samples_per_s > 0);
  const idle = firstMoving < 0 ? pts : pts.slice(0, firstMoving);
  check('the run\'s history is flat over the idle start (samples/s 0 at every point before training)',
    idle.length >= 2 && idle.every((p) => p.samples_per_s === 0 && p.samples === idle[0].samples),
    `${idle.length} idle points of ${pts.length}`);
}

// The teacher's view of a server with the history endpoints: the guesses strip, a worker
// made slow for a demonstration (the banner says so, and goes), a live consistency switch, a
// second experiment overlaid on the first on the samples axis, an experiment exported as CSV
// with its sim command.
async function teacher(server) {
  if ((await fetch(`${server.base}/api/evals`)).status === 404) {
    log('skipped the teacher\'s experiments: this server has no /api/evals');
    return;
  }
  const page = await newPage('teacher');
  await page.size(1280, 720);
  await page.goto(`${server.base}/?view=present`);
  await page.eval("document.getElementById('cores').value = '1'; document.getElementById('contribute').click()");
  await waitFor('the tab to train', async () => ((await page.progress()) || {}).pushes_accepted > 20, 60_000);
  const guesses = await waitFor('the guesses', () => page.eval("document.getElementById('guesses').children.length"), 15_000).catch(() => 0);
  check('the classroom view shows the model\'s guesses on test images', guesses > 0 && await page.shown('guesses-box'), `${guesses} images`);
  const admin = (id, value) => page.eval(`(() => { const e = document.getElementById('${id}'); e.value = ${JSON.stringify(value)};
    e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change')); })()`);
  await page.eval("document.getElementById('teacher').open = true");
  await admin('admin-token', ADMIN);
  await waitFor('a worker to choose', () => page.eval("document.getElementById('demo-worker').options.length > 0"), 10_000);
  await admin('demo-delay', '200');
  await page.click('demo-apply');
  const on = await waitFor('the demonstration banner', () => page.eval("(() => { const e = document.getElementById('p-demo'); return !e.hidden && e.textContent; })()"), 10_000).catch(() => null);
  await page.click('demo-clear');
  const off = await waitFor('the banner to go', () => page.eval("document.getElementById('p-demo').hidden"), 10_000).catch(() => false);
  check('a worker made slow for a demonstration is shown while it is, and no longer after', !!on && /slowed by 200 ms/.test(on) && off, on || 'no banner');
  await admin('admin-consistency', 'ssp:2');
  await page.click('admin-set-consistency');
  const adminState = async () => (await fetch(`${server.base}/api/admin/state`, { headers: { Authorization: `Bearer ${ADMIN}` } })).json();
  const switched = await waitFor('the switch', async () => (await adminState()).consistency === 'ssp:2', 5_000).catch(() => false);
  check('the teacher switches consistency live from the page (async → ssp:2)', switched, await page.text('admin-result'));
  await admin('exp-label', 'second try');
  await page.click('exp-start');
  const two = await waitFor('the second experiment to have trained points', () => page.eval(`(() => {
    const e = window.crowdgrad.experiments(); return e.length >= 2 && e[e.length - 1].points.some((p) => p.samples > 0) ? e.length : null; })()`), 30_000).catch(() => 0);
  await admin('p-x-axis', 'samples');
  await sleep(1_500);
  const series = await page.eval("window.crowdgrad.chart().series.map((s) => s.label)");
  // Overlaid: the second counts its samples from its own start, as the first did.
  const starts = await page.eval(`window.crowdgrad.experiments().map((e) => [e.points[0].samples, e.points[e.points.length - 1].samples])`);
  check('a second experiment appears overlaid on the first (samples axis)', two >= 2 && series.length >= 4
    && starts[starts.length - 1][0] < starts[0][1], `${series.join(', ')}; samples first..last ${starts.map((r) => r.join('..')).join(', ')}`);
  await page.shot('present-experiments-1280', 1280);
  const dl = tmpDir('crowdgrad-page-export-');
  dirs.push(dl);
  await page.b.send('Browser.setDownloadBehavior', { behavior: 'allow', downloadPath: dl });
  await page.eval("document.querySelector('#experiments button').click()");
  const file = await waitFor('the export', () => fs.readdirSync(dl).find((n) => n.endsWith('.csv')), 10_000).catch(() => null);
  const text = file ? fs.readFileSync(path.join(dl, file), 'utf8') : '';
  check('an experiment exports as CSV with its crowdgrad sim command', /^# sim: crowdgrad sim /.test(text), text.split('\n')[0]);
  await page.click('stop');
  await page.b.close();
}

// A phone (coarse pointer, touch) that asks to save data: the gentle defaults, and the tab
// pauses itself on Save-Data.
async function phoneSavingData(server) {
  const page = await newPage('phone');
  await page.size(390, 844);
  await page.b.send('Emulation.setTouchEmulationEnabled', { enabled: true, maxTouchPoints: 5 }, page.b.session);
  await page.b.send('Emulation.setDataSaverOverride', { dataSaverEnabled: true }, page.b.session);
  await page.goto(`${server.base}/`);
  const d = await page.eval(`({ cores: document.getElementById('cores').value, limit: document.getElementById('throttle').value,
    note: document.getElementById('defaults-note').textContent })`);
  check('a phone starts gently: 1 core at 50%', d.cores === '1' && d.limit === '50', d.note);
  await page.click('contribute');
  const paused = await waitFor('the tab to pause on Save-Data', () => page.eval(`(() => {
    const p = window.crowdgrad.volunteer.progress; const n = document.getElementById('my-note');
    return window.crowdgrad.volunteer.paused && p && p.state === 'paused' && !n.hidden ? n.textContent : null; })()`), 20_000).catch(() => null);
  check('Save-Data pauses the tab and says why', !!paused && /save data/.test(paused), paused || 'not paused');
  await page.b.close();
}

async function privateRefused() {
  const port = await freePort();
  // --ema too: the run line says what the charts are of.
  const server = await startServer(port, 'page-private', ['--model', 'softmax', '--join-token', 'class-token-42', '--ema', '0.999']);
  const page = await newPage('private');
  await page.size(1280, 720);
  await page.goto(`${server.base}/`);
  check('a private run shows the join-token field', await page.shown('join-token-label'));
  const runLine = await page.eval("document.getElementById('run-info').textContent");
  check('with --ema the run line says the charts are of the weights\' moving average',
    runLine.includes("evaluates the weights' moving average (ema 0.999)"), runLine);
  await page.click('contribute');
  const stopped = await waitFor('the refused tab to stop', () => page.eval(`(() => {
    const v = window.crowdgrad.volunteer; const e = document.getElementById('my-error');
    return !v.running && !e.hidden ? e.textContent : null; })()`), 20_000, 250).catch(() => null);
  await sleep(3_000);
  const joins = (await getStatus(server.base)).limits.joins_unauthorized;
  check('a refused join token (401) stops the tab with the reason and what to do, no retrying',
    !!stopped && /private/.test(stopped) && /token/.test(stopped) && joins <= 2 && page.workers.size === 0,
    `${stopped}; ${joins} refused joins`);
  // The classroom view of a private run opened with its link: the QR code carries the token,
  // the page's text and attributes do not.
  await page.goto(`${server.base}/?view=present#token=class-token-42`);
  const qr = await page.eval(`(() => { const c = document.getElementById('qr'); const g = c.getContext('2d');
    return { w: c.width, h: c.height, data: Array.from(g.getImageData(0, 0, c.width, c.height).data),
      html: document.documentElement.outerHTML, href: location.href }; })()`);
  const code = jsQR(Uint8ClampedArray.from(qr.data), qr.w, qr.h);
  const want = `${server.base}/#token=class-token-42`;
  check('a private run\'s QR code carries the join token, the page\'s markup and address do not',
    code && code.data === want && !qr.html.includes('class-token-42') && !qr.href.includes('class-token-42'),
    `${code ? code.data : 'no code found'} (want ${want})`);
  await page.b.close();
  await stopChild(server, 'private server');
}

// A quarantined identity (403 on its next join, or the shards' quarantined error while it
// trains): the tab stops with the reason and what to do, and does not retry. The teacher's
// demonstration rewrites the tab's pushes as a sign-flipping worker's on arrival; every push
// is spot-checked, so the first checked one fails and quarantines the tab's identity.
async function quarantinedStops() {
  const port = await freePort();
  const server = await startServer(port, 'page-quarantine', ['--model', 'softmax', '--admin-token', ADMIN,
    '--spot-check', '1']);
  const page = await newPage('quarantine');
  await page.size(1280, 720);
  await page.goto(`${server.base}/`);
  await page.eval("document.getElementById('cores').value = '1'; document.getElementById('contribute').click()");
  await waitFor('the tab to train', async () => ((await page.progress()) || {}).pushes_accepted > 5, 60_000);
  const ids = await page.eval('window.crowdgrad.volunteer.progress.worker_ids');
  const r = await fetch(`${server.base}/api/admin/demo`, { method: 'POST',
    headers: { Authorization: `Bearer ${ADMIN}`, 'content-type': 'application/json' },
    body: JSON.stringify({ worker: ids[0], fault: 'signflip' }) });
  check('the teacher makes the tab a sign-flipping worker', r.ok, `${r.status} ${await r.text()}`);
  const stoppedText = () => page.eval(`(() => {
    const v = window.crowdgrad.volunteer; const e = document.getElementById('my-error');
    return !v.running && !e.hidden ? e.textContent : null; })()`);
  const stopped = await waitFor('the quarantined tab to stop', stoppedText, 30_000, 250).catch(() => null);
  const st = await getStatus(server.base);
  const quarantined = (st.quarantines || []).length;
  check('a quarantine during training stops the tab with the reason and what to do',
    !!stopped && /quarantined/.test(stopped) && /unquarantine/.test(stopped) && page.workers.size === 0,
    `${stopped}; ${quarantined} quarantines in the status`);
  // The next Contribute: its join gets 403, and the tab stops again without retrying.
  const refused = async () => (await getStatus(server.base)).limits.joins_quarantined;
  const before = await refused();
  await page.click('contribute');
  const again = await waitFor('the 403 to stop the tab', async () => {
    const t = await stoppedText();
    return t && /quarantined/.test(t) ? t : null;
  }, 20_000, 250).catch(() => null);
  await sleep(3_000);
  const after = await refused();
  check('a quarantined identity\'s next join (403) stops the tab with the reason, no retrying',
    !!again && after >= before + 1 && after <= before + 2 && page.workers.size === 0,
    `${again}; joins refused 403: ${before} → ${after}`);
  await page.shot('quarantined-1280', 1280);
  await page.b.close();
  await stopChild(server, 'quarantine server');
}

// ------------------------------------------------------------------ the soak

async function soak() {
  const port = await freePort();
  const server = await startServer(port, 'page-soak', []);
  const page = await newPage('soak');
  await page.size(1280, 720);
  await page.goto(`${server.base}/`);
  await page.eval(`document.getElementById('cores').value = '${process.env.SOAK_CORES || 1}'; document.getElementById('contribute').click()`);
  const started = Date.now();
  const run = await watchErrors(page, async () => Date.now() - started > SOAK_S * 1000, SOAK_S * 1000 + 5_000);
  const p = await page.progress();
  const st = await getStatus(server.base);
  const reasons = {};
  for (const s of st.shards) for (const [k, v] of Object.entries(s.rejected_by_reason || {})) reasons[k] = (reasons[k] || 0) + v;
  const pushes = st.totals.pushes_applied + st.totals.pushes_rejected;
  const oob = reasons.out_of_bounds || 0;
  log(`soak: ${SOAK_S} s, ${p.pushes_accepted} pushes accepted by the tab, refused by reason ${JSON.stringify(p.rejected_by_reason)}`);
  log(`soak: server ${pushes} pushes, refused ${JSON.stringify(reasons)}; out_of_bounds ${oob} per ${pushes} = ${(oob / Math.max(1, pushes)).toExponential(2)}`);
  log(`soak: accuracy ${st.eval && st.eval.accuracy}`);
  check(`no error shown in ${SOAK_S} s of an honest tab`, run.shown.length === 0, run.shown.join(' | ') || 'none shown');
  check('the tab trained all along', p.pushes_accepted > 0 && p.state === 'training', `${p.state}, ${p.pushes_accepted} accepted`);
  await page.b.close();
  await stopChild(server, 'soak server');
}

async function main() {
  for (const f of [AXE, path.join(ROOT, 'web/vendor/uqr.mjs'), path.join(ROOT, 'web/pkg/crowdgrad_worker_wasm_bg.wasm')]) {
    if (!fs.existsSync(f)) throw new Error(`missing ${f} (npm ci; cargo xtask build-web)`);
  }
  if (SOAK_S) {
    await soak();
    return;
  }
  const port = await freePort();
  const server = await startServer(port, 'page', ['--model', 'softmax', '--admin-token', ADMIN]);
  await layoutAndTraining(server);
  await historyFlat(server);
  await teacher(server);
  await phoneSavingData(server);
  await stopChild(server, 'server');
  await privateRefused();
  await quarantinedStops();
}

main().then(() => {
  for (const d of dirs) fs.rmSync(d, { recursive: true, force: true });
  killChildren();
  finish(0);
}, (e) => {
  console.error(e);
  check('page test ran to the end', false, e.message);
  killChildren();
  finish(1);
});
