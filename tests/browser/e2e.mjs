#!/usr/bin/env node
// Browser end-to-end test: the real page in real headless Chromium (playwright-core driving
// /usr/bin/chromium, never a downloaded browser) against the release server on real MNIST.
//
//   node tests/browser/e2e.mjs      (after `cargo xtask build-web` and a release build;
//                                    `cargo xtask test` runs it last)
//
// 1. Two tabs click Contribute, one native worker joins: test accuracy passes 0.90, both tabs
//    show accepted pushes, the dashboard lists 3 workers, no console errors; screenshot saved
//    to target/browser/dashboard.png.
// 2. One tab closes mid-training: the server stays healthy, the others keep training.
// 3. The server restarts on the same port: the remaining tab rejoins and trains on, no click.
// 4. Figures for the docs come from a separate, uninstrumented run (below).
// 5. Issue 11: one tab with K = 2 Web Workers trains, is one volunteer with 2 threads on the
//    dashboard, pauses both and holds the CPU limit for each; figures of K = 1 vs K = 2 against
//    loopback shards and against the server.
// 6. Issue 9: a tab trains, reloads and keeps its identity (the same localStorage value); its
//    total in /api/contributors and on the page grows on from the previous one, and survives a
//    server restart on the same checkpoint directory.
// Everything binds 127.0.0.1, every wait is bounded, child processes are killed on exit, and the
// last line is `N passed, M failed`.
//
// Why two browsers: Playwright enables the CDP Network domain on every page and worker, so
// Chromium mirrors every WebSocket frame to it as base64 (about 270 KB per shard per step for
// the default MLP). That costs the tab ~5x its throughput and, on a loaded machine, backs up
// the DevTools pipe until the page stops answering. So phases 1-3 run the server with
// `--model softmax` (15 KB shards), and the figures come from a plain headless Chromium driven
// over a raw CDP pipe with only the Runtime domain (cdp.mjs), against the default model.
//
// The phases run in the order of the PHASES table at the end of this file.
//
// Environment: CROWDGRAD_BIN (server binary, default $CARGO_TARGET_DIR/release/crowdgrad),
// CHROMIUM (default /usr/bin/chromium), E2E_TIMEOUT_S (overall bound, default 900), E2E_ONLY=NAME
// (only the phases of PHASES named NAME or NAME-something, a comma-separated list of names
// allowed): cores (phase 5), identity (only the identity phase), overlap (only the --overlap on
// tab) or remote (only the tab against shard processes), and so on.

import fs from 'node:fs';
import path from 'node:path';
import zlib from 'node:zlib';
import { chromium } from 'playwright-core';
import {
  CHROMIUM, CHROMIUM_ARGS, OUT, ROOT, SERVER, TARGET, WEB, check, deadline, finish, freePort,
  getStatus, killChildren, killChildrenOnExit, log, openBrowser, runCapture, SENTENCES, sleep,
  spawnLogged, startServer, stopChild, tmpDir, waitFor,
} from './harness.mjs';
import { publicId } from '../../web/identity.js';

const STEP_TIME = path.join(TARGET, 'release/examples/step_time');
const LIMIT_S = Number(process.env.E2E_TIMEOUT_S || 900);
// Errors the browser itself logs while the server is down on purpose (phase 3).
const EXPECTED_WHILE_DOWN = /ERR_CONNECTION_REFUSED|ERR_CONNECTION_RESET|ERR_EMPTY_RESPONSE|ERR_INCOMPLETE_CHUNKED_ENCODING|WebSocket connection to .* failed|WebSocket is closed before the connection is established/;

// ------------------------------------------------------------------ figures and cleanup

const figures = {};

let context = null;
let userDataDir = null;

async function cleanup() {
  if (context) {
    const c = context;
    context = null;
    await Promise.race([c.close().catch(() => {}), sleep(10_000)]);
  }
  killChildren();
  if (userDataDir) fs.rmSync(userDataDir, { recursive: true, force: true });
}

killChildrenOnExit();
deadline(LIMIT_S, async () => {
  check(`whole test within ${LIMIT_S} s`, false, 'overall time limit hit');
  await cleanup();
  finish(1);
});

// ------------------------------------------------------------------ helpers

// Issue 10: the server's spot checks of `kind` workers' pushes (cosine and norm ratio of the
// pushed slice to the server's own recomputation) and whether any check failed or anybody was
// quarantined.
function spotChecks(st, kind) {
  const kinds = new Map((st.workers || []).map((w) => [w.id, w.client]));
  const mine = ((st.spot_checks && st.spot_checks.recent) || []).filter((f) => kinds.get(f.worker) === kind);
  const ok = !!st.spot_checks && st.spot_checks.failed === 0 && st.reputation.quarantined === 0 && mine.length > 0;
  const cos = mine.map((f) => 1 - f.cosine);
  const ratio = mine.map((f) => f.norm_ratio);
  const text = mine.length === 0 ? `no checks of ${kind} pushes` : `${mine.length} checks of ${kind} pushes: `
    + `1 - cosine max ${Math.max(...cos).toExponential(2)}, norm ratio ${Math.min(...ratio).toFixed(5)}..${Math.max(...ratio).toFixed(5)}; `
    + `${st.spot_checks.passed} passed, ${st.spot_checks.failed} failed, ${st.reputation.quarantined} quarantined`;
  return { ok, text };
}

const digits = (text) => Number(String(text || '').replace(/[^0-9]/g, '') || 0);

async function tabProgress(page) {
  return page.evaluate(() => (window.crowdgrad && window.crowdgrad.volunteer.progress) || null);
}

async function shownAccepted(page) {
  return digits(await page.locator('#my-accepted').textContent());
}

function gzipSize(file) {
  return zlib.gzipSync(fs.readFileSync(file), { level: 9 }).length;
}

const kib = (n) => `${(n / 1024).toFixed(1)} KiB`;

// ------------------------------------------------------------------ the test

const consoleErrors = [];
let phase = 'load';

function watch(page, tab) {
  const record = (text, uncaught = false) => consoleErrors.push({ tab, phase, text, uncaught });
  page.on('console', (m) => { if (m.type() === 'error') record(m.text()); });
  page.on('pageerror', (e) => record(`uncaught: ${e.message}`, true));
  page.on('worker', (w) => w.on('console', (m) => { if (m.type() === 'error') record(`worker: ${m.text()}`); }));
}

function errorsIn(phases) {
  return consoleErrors.filter((e) => phases.includes(e.phase));
}

async function main() {
  fs.mkdirSync(OUT, { recursive: true });
  for (const [what, file] of [['server binary', SERVER], ['Chromium', CHROMIUM],
    ['wasm bundle (cargo xtask build-web)', path.join(WEB, 'pkg/crowdgrad_worker_wasm_bg.wasm')],
    ['uPlot (cargo xtask build-web)', path.join(WEB, 'vendor/uPlot.esm.js')]]) {
    if (!fs.existsSync(file)) throw new Error(`${what} missing: ${file}`);
  }

  // Bundle size: what a volunteer downloads for the worker.
  const wasmFile = path.join(WEB, 'pkg/crowdgrad_worker_wasm_bg.wasm');
  const glueFile = path.join(WEB, 'pkg/crowdgrad_worker_wasm.js');
  figures['wasm bundle (raw / gzip -9)'] = `${kib(fs.statSync(wasmFile).size)} / ${kib(gzipSize(wasmFile))}`;
  figures['JS glue (raw / gzip -9)'] = `${kib(fs.statSync(glueFile).size)} / ${kib(gzipSize(glueFile))}`;

  for (const [name, run] of selected(PHASES, process.env.E2E_ONLY)) {
    await run();
  }
}

/// Phases 1-3 (playwright-core, the softmax run): two tabs and a native worker train together;
/// the page's controls; a tab closes; the server restarts.
async function functional() {
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  // Half the rounds spot-checked (issue 10): honest tabs and the native worker must pass.
  const FUNCTIONAL = ['--model', 'softmax', '--spot-check', '0.5'];
  let server = await startServer(port, 1, FUNCTIONAL);

  userDataDir = tmpDir('crowdgrad-e2e-');
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    args: CHROMIUM_ARGS,
    viewport: { width: 1280, height: 1000 },
  });
  const tabs = [];
  for (const name of ['A', 'B']) {
    const page = name === 'A' && context.pages()[0] ? context.pages()[0] : await context.newPage();
    watch(page, name);
    const t0 = Date.now();
    await page.goto(`${base}/`, { waitUntil: 'load', timeout: 60_000 });
    const loadMs = Date.now() - t0;
    await page.bringToFront();
    // One Web Worker per tab here (the default, N - 1 cores, differs between machines).
    await page.selectOption('#cores', '1');
    await page.getByRole('button', { name: 'Contribute' }).click({ timeout: 30_000 });
    tabs.push({ name, page, t0, loadMs });
    log(`tab ${name} loaded in ${loadMs} ms and clicked Contribute`);
  }

  // ---------------------------------------------------------------- phase 1: train together
  phase = 'train';
  for (const tab of tabs) {
    await waitFor(`tab ${tab.name}'s first accepted push`, async () => (await shownAccepted(tab.page)) > 0, 60_000, 50);
    // Timed in the page: ms since navigation start of the click and of the first push.
    const t = await tab.page.evaluate(() => ({
      clicked: window.crowdgrad.volunteer.clickedAt,
      first: window.crowdgrad.volunteer.firstPushAt,
    }));
    const p = await tabProgress(tab.page);
    figures[`tab ${tab.name} (softmax run, Playwright attached): navigation start to first accepted push`] =
      `${Math.round(t.first)} ms (load event ${tab.loadMs} ms; click to first push ${Math.round(t.first - t.clicked)} ms, `
      + `of which wasm worker start to first push ${Math.round(p.first_push_ms)} ms; partition ${kib(p.data_bytes)}, `
      + `${p.data_from_cache ? 'from the Cache API' : 'downloaded'})`;
  }
  const native = spawnLogged('native-worker', SERVER,
    ['work', '--server', base, '--seconds', '300', '--quiet', '--name', 'e2e-native']);
  log('native worker started');

  const trainStart = Date.now();
  const st = await waitFor('test accuracy above 0.90', async () => {
    const s = await getStatus(base);
    return s.eval && s.eval.accuracy > 0.90 ? s : null;
  }, 300_000, 500);
  figures['time from native start to test accuracy > 0.90'] =
    `${((Date.now() - trainStart) / 1000).toFixed(1)} s (accuracy ${st.eval.accuracy.toFixed(4)} after ${st.eval.samples} samples)`;
  check('test accuracy > 0.90 on /api/status', st.eval.accuracy > 0.90, `accuracy ${st.eval.accuracy.toFixed(4)}`);
  // The native worker may have pushed little by the time accuracy passes 0.90: wait (bounded)
  // until both kinds have a check on record, or one failed.
  const spotNow = await waitFor('spot checks of browser and native pushes', async () => {
    const s = await getStatus(base);
    const settled = !s.spot_checks || s.spot_checks.failed > 0 || s.reputation.quarantined > 0
      || ['browser', 'native'].every((k) => !spotChecks(s, k).text.startsWith('no checks'));
    return settled ? s : null;
  }, 60_000, 250).catch(() => getStatus(base));
  for (const kind of ['browser', 'native']) {
    const sc = spotChecks(spotNow, kind);
    check(`spot checks pass for the honest ${kind} workers (--spot-check 0.5), nobody quarantined`, sc.ok, sc.text);
    figures[`spot checks, honest ${kind} (softmax, serve's default local steps auto, bf16 / int8)`] = sc.text;
  }

  for (const tab of tabs) {
    const shown = await shownAccepted(tab.page);
    check(`tab ${tab.name} shows accepted pushes`, shown > 0, `${shown} accepted`);
  }
  const [tabA, tabB] = tabs;
  let listed = [];
  try {
    listed = await waitFor('the dashboard to list 3 workers online', async () => {
      const rows = await tabA.page.$$eval('#workers tr[data-connected="true"]', (trs) => trs.map((tr) => tr.dataset.kind));
      return rows.length === 3 ? rows : null;
    }, 15_000);
  } catch (e) {
    log(e.message);
  }
  const kinds = [...listed].sort().join(', ');
  check('dashboard lists 3 workers online (2 browser, 1 native)', kinds === 'browser, browser, native', kinds || 'none');
  const accuracyShown = await tabA.page.locator('#kpi-accuracy').textContent();
  check('dashboard shows the test accuracy', /\d+\.\d+%/.test(accuracyShown), accuracyShown);
  const chartPoints = await tabA.page.evaluate(() => document.querySelectorAll('#chart canvas').length);
  check('dashboard draws the uPlot chart', chartPoints > 0);
  // serve's default exchange: the run line names the inner optimizer that learns and the outer step.
  const runInfo = await tabA.page.locator('#run-info').textContent();
  check('the run line names the local steps and both optimizers', /local steps auto:\d+: adam lr 0\.003, outer sgd lr 1/.test(runInfo), runInfo);

  const shot = path.join(OUT, 'dashboard.png');
  await tabA.page.screenshot({ path: shot, fullPage: true });
  log(`screenshot saved to ${shot}`);
  // A phone-sized view: nothing may stick out sideways (tables scroll inside their box).
  await tabA.page.setViewportSize({ width: 390, height: 844 });
  const overflowNow = () => tabA.page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  try {
    await waitFor('the page to reflow for a phone', async () => (await overflowNow()) <= 0, 5_000, 100);
  } catch (e) {
    log(e.message);
  }
  const overflow = await overflowNow();
  await tabA.page.screenshot({ path: path.join(OUT, 'phone.png'), fullPage: true });
  check('page fits a 390 px wide phone screen', overflow <= 0, `${overflow} px overflow`);
  await tabA.page.setViewportSize({ width: 1280, height: 1000 });
  const early = errorsIn(['load', 'train']);
  check('no console errors while loading and training', early.length === 0,
    early.map((e) => `${e.tab}: ${e.text}`).join(' | '));

  // ---------------------------------------------------------------- controls: pause, CPU limit
  phase = 'controls';
  await tabB.page.getByRole('button', { name: 'Pause', exact: true }).click();
  let paused = null;
  try {
    paused = await waitFor('tab B to pause', async () => {
      const p = await tabProgress(tabB.page);
      return p.state === 'paused' ? p : null;
    }, 10_000, 100);
  } catch (e) {
    log(e.message);
  }
  if (paused) {
    await sleep(1_500);
    const still = await tabProgress(tabB.page);
    // The server lists it offline once it has seen the sockets close: waited for (up to
    // 10 s), not assumed after a fixed 1.5 s (a CI run under load listed it online then).
    const pausedAt = Date.now();
    let listedB = null;
    try {
      listedB = await waitFor('the server to list tab B offline', async () => {
        const w = (await getStatus(base)).workers.find((x) => x.id === paused.worker_id);
        return w && !w.connected ? w : null;
      }, 10_000, 100);
    } catch (e) {
      log(e.message);
    }
    check('Pause stops tab B computing and closes its connections',
      still.steps === paused.steps && listedB,
      `${still.steps - paused.steps} steps while paused; server lists it ${listedB ? `offline within ${((Date.now() - pausedAt) / 1000 + 1.5).toFixed(1)} s` : 'online after 11.5 s'}`);
    await tabB.page.getByRole('button', { name: 'Resume', exact: true }).click();
    let resumed = null;
    try {
      resumed = await waitFor('tab B to resume', async () => {
        const p = await tabProgress(tabB.page);
        return p.state === 'training' && p.steps > paused.steps ? p : null;
      }, 15_000, 100);
    } catch (e) {
      log(e.message);
    }
    check('Resume reconnects tab B and it trains on', resumed,
      resumed ? `worker ${resumed.worker_id}, ${resumed.steps - paused.steps} steps since` : '');
  } else {
    check('Pause stops tab B computing and closes its connections', false, 'never paused');
  }
  // The hidden-tab note (visibilitychange simulated: headless tabs cannot really be hidden).
  const setVisibility = (state) => tabA.page.evaluate((st) => {
    Object.defineProperty(document, 'visibilityState', { value: st, configurable: true });
    document.dispatchEvent(new Event('visibilitychange'));
  }, state);
  await setVisibility('hidden');
  const hiddenNote = await tabA.page.locator('#visibility').isVisible()
    && /hidden/.test(await tabA.page.locator('#visibility').textContent());
  await sleep(1_100);
  await setVisibility('visible');
  const backNote = await tabA.page.locator('#visibility').textContent();
  check('a hidden tab is told it keeps training in the Web Worker (simulated visibilitychange)',
    hiddenNote && /was hidden for \d+ s/.test(backNote), backNote);

  await tabA.page.selectOption('#throttle', '25');
  await sleep(1_500);
  // Computing time over wall time from the worker's own counters (both taken in one report):
  // steps × the step-time average overstated it whenever the average lagged (CI saw 30.4%).
  const t0 = await tabProgress(tabA.page);
  await sleep(5_000);
  const t1 = await tabProgress(tabA.page);
  const duty = (1000 * (t1.compute_s - t0.compute_s)) / Math.max(1, t1.uptime_ms - t0.uptime_ms);
  check('a 25% CPU limit keeps tab A computing at most ~25% of the time',
    t1.throttle_percent === 25 && duty > 0 && duty <= 0.3, `computing ${(100 * duty).toFixed(1)}% of wall time`);
  await tabA.page.selectOption('#throttle', '100');

  // ---------------------------------------------------------------- phase 2: close a tab
  phase = 'close-tab';
  const acceptedA = await shownAccepted(tabA.page);
  const nativeSamples = (s) => (s.workers.find((w) => w.client === 'native' && w.connected) || { samples: 0 }).samples;
  const before = await getStatus(base);
  await tabB.page.close();
  log('tab B closed');
  let online = null;
  try {
    online = await waitFor('the server to count 2 workers online', async () => {
      const s = await getStatus(base);
      return s.workers_connected === 2 ? s : null;
    }, 20_000);
  } catch (e) {
    log(e.message);
  }
  check('server stays healthy and drops the closed tab', online && server.exitCode === null,
    online ? '2 workers online' : 'still counting the closed tab');
  let keptA = false;
  try {
    keptA = await waitFor('tab A to keep pushing', async () => (await shownAccepted(tabA.page)) > acceptedA + 20, 20_000);
  } catch (e) {
    log(e.message);
  }
  check('tab A keeps training after tab B closed', keptA);
  let keptNative = false;
  try {
    keptNative = await waitFor('the native worker to keep pushing', async () =>
      nativeSamples(await getStatus(base)) > nativeSamples(before), 20_000);
  } catch (e) {
    log(e.message);
  }
  check('native worker keeps training after tab B closed', keptNative);
  const after = await getStatus(base);
  check('shard versions keep rising', after.shards.every((s, i) => s.version > before.shards[i].version));

  // ---------------------------------------------------------------- phase 3: restart the server
  await stopChild(native, 'native worker');
  log('native worker stopped (tab A trains alone from here)');
  const solo = await tabProgress(tabA.page);

  phase = 'restart';
  const cachedUrls = () => tabA.page.evaluate(async () =>
    (await (await caches.open('crowdgrad-data-v1')).keys()).map((r) => r.url));
  const cachedBefore = await cachedUrls();
  check('tab A\'s partition files are in the Cache API',
    cachedBefore.includes(`${base}${solo.partition_images}`), `${cachedBefore.length} cached files`);
  const acceptedBefore = (await tabProgress(tabA.page)).pushes_accepted;
  await stopChild(server, 'server');
  let noticed = null;
  try {
    noticed = await waitFor('tab A to notice the server is gone', async () => {
      const p = await tabProgress(tabA.page);
      return p.state === 'reconnecting' ? p : null;
    }, 15_000, 100);
  } catch (e) {
    log(e.message);
  }
  check('tab A notices the server went away', noticed, noticed ? noticed.error : '');
  const downAt = Date.now();
  server = await startServer(port, 2, FUNCTIONAL);
  let back = null;
  try {
    back = await waitFor('tab A to rejoin and push again', async () => {
      const p = await tabProgress(tabA.page);
      return p.state === 'training' && p.pushes_accepted > acceptedBefore + 20 ? p : null;
    }, 60_000, 100);
  } catch (e) {
    log(e.message);
  }
  check('tab A rejoins the restarted server and keeps training, no click', back,
    back ? `${back.pushes_accepted - acceptedBefore} more pushes accepted, ${back.reconnects} reconnect(s)` : '');
  if (back) {
    figures['server restart to tab A training again'] = `${((Date.now() - downAt) / 1000).toFixed(1)} s (server down and restarted, rejoin backoff included)`;
    // The server may hand out another partition on rejoin: a hit is expected exactly when
    // that partition's files were cached before.
    const hit = cachedBefore.includes(`${base}${back.partition_images}`);
    check(`rejoined tab ${hit ? 'reads its cached partition from the Cache API' : 'downloads its new partition'}`,
      back.data_from_cache === hit, `partition ${back.partition_index}, from cache: ${back.data_from_cache}`);
    const s2 = await getStatus(base);
    const mine = s2.workers.find((w) => w.id === back.worker_id);
    check('the restarted server lists tab A as a connected browser worker',
      mine && mine.connected && mine.client === 'browser', mine ? `worker ${mine.id}` : 'not listed');
    const shownAfter = await shownAccepted(tabA.page);
    check('tab A\'s page shows the carried-over push count', shownAfter >= acceptedBefore, `${shownAfter} accepted`);
  }
  const controls = errorsIn(['controls']);
  check('no console errors while pausing, resuming and limiting the CPU', controls.length === 0,
    controls.map((e) => `${e.tab}: ${e.text}`).join(' | '));
  const late = errorsIn(['close-tab', 'restart']);
  const unexpected = late.filter((e) => e.uncaught || !EXPECTED_WHILE_DOWN.test(e.text));
  check('no unexpected console errors after the tab close and restart', unexpected.length === 0,
    `${late.length - unexpected.length} expected network errors while the server was down` +
    (unexpected.length ? `; unexpected: ${unexpected.map((e) => `${e.tab}: ${e.text}`).join(' | ')}` : ''));
  check('server healthy at the end', (await getStatus(base)).workers_connected >= 1);

  await stopChild(server, 'server');
  await cleanup();
}

// ------------------------------------------------------------------ issue 9: identity and ledger

/// The ledger entry of the identity `id` (a secret) on the server at `base`, or null: looked
/// up by its public id, as the page does (issue 21).
async function ledgerOf(base, id) {
  const r = await fetch(`${base}/api/contributors?limit=10&identity=${publicId(id)}`, { signal: AbortSignal.timeout(3_000) });
  if (!r.ok) throw new Error(`/api/contributors answered ${r.status}`);
  return (await r.json()).you || null;
}

/// Issue 9: a tab trains, reloads and keeps its identity; its total grows on from the previous
/// one (server and page); the server restarts on its checkpoint directory and the total
/// survives and grows on again.
async function identityTab() {
  phase = 'identity';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const ck = tmpDir('crowdgrad-e2e-ck-');
  const flags = ['--model', 'softmax', '--checkpoint-dir', ck, '--checkpoint-every', '1'];
  let server = await startServer(port, 'identity-1', flags);
  const dir = tmpDir('crowdgrad-identity-');
  let browser = null;
  try {
    browser = await openBrowser(dir);
    const stored = () => browser.evaluate("localStorage.getItem('crowdgrad.identity')");
    const shownMine = async () => digits(await browser.evaluate("document.getElementById('me-samples').textContent"));
    await openPage(browser, `${base}/`);
    await contributeWith(browser, 1);
    const id = await stored();
    check('the page keeps a random identity in localStorage', /^[0-9a-f]{32}$/.test(id || ''), String(id));
    const first = await waitFor('the tab\'s ledger entry', async () => {
      const me = await ledgerOf(base, id);
      return me && me.samples > 2_000 ? me : null;
    }, 60_000, 250);
    await waitFor('the page to show its contribution', async () => (await shownMine()) > 0, 15_000, 250);
    check('/api/contributors credits the tab\'s identity', first.client === 'browser' && first.pushes_accepted > 0,
      `${first.samples} samples, ${first.pushes_accepted} pushes`);
    // Issue 21: the identity is a secret. The board, the page and the URLs the tab fetched
    // carry only its public id (the server's derivation, recomputed here).
    const pub = publicId(id);
    const seen = JSON.parse(await browser.evaluate(`JSON.stringify({
      shown: document.getElementById('me-identity-short').textContent,
      urls: performance.getEntriesByType('resource').map((e) => e.name).concat(location.href) })`));
    const board = await (await fetch(`${base}/api/contributors?limit=100`)).text();
    const csv = await (await fetch(`${base}/api/contributors?format=csv`)).text();
    const statusText = await (await fetch(`${base}/api/status`)).text();
    check('the board shows the public id, never the secret identity',
      first.identity === pub && board.includes(pub) && ![board, csv, statusText].some((t) => t.includes(id)),
      `public id ${pub}`);
    check('the page shows the start of its public id and fetched no URL holding the secret',
      seen.shown.startsWith(pub.slice(0, 8)) && !seen.urls.some((u) => u.includes(id)),
      `shown ${seen.shown}, ${seen.urls.length} URLs`);

    // Reload: a new page and Web Worker, the same identity; the total continues.
    await openPage(browser, `${base}/`);
    const again = await stored();
    check('a reloaded tab keeps its identity (same localStorage value)', again === id, `${again}`);
    const before = (await ledgerOf(base, id)).samples;
    await contributeWith(browser, 1);
    const grown = await waitFor('the total to grow on after the reload', async () => {
      const me = await ledgerOf(base, id);
      return me && me.samples > before + 2_000 && me.sessions >= 2 ? me : null;
    }, 60_000, 250).catch((e) => { log(e.message); return null; });
    check('after the reload the total grows from the previous one (not reset)', grown,
      grown ? `${before} -> ${grown.samples} samples over ${grown.sessions} sessions` : 'it did not grow');
    const shown = await waitFor('the page to show the carried total', async () => {
      const n = await shownMine();
      return n > before ? n : null;
    }, 15_000, 250).catch(() => null);
    check('the reloaded page shows a total above the pre-reload one', shown, `${shown} > ${before}`);
    const rank = await browser.evaluate("document.getElementById('me-rank').textContent");
    const rows = await browser.evaluate("document.querySelectorAll('#leaderboard tr').length");
    check('the leaderboard lists the tab', rows >= 1 && /^1 of/.test(rank), `${rows} rows, rank ${rank}`);

    // The server restarts on its checkpoint directory: the ledger survives and the tab, which
    // rejoins by itself, keeps adding to the same total.
    const atStop = (await ledgerOf(base, id)).samples;
    await stopChild(server, 'identity server');
    server = await startServer(port, 'identity-2', flags);
    const restored = await ledgerOf(base, id);
    check('the ledger survives a server restart', restored && restored.samples >= atStop,
      restored ? `${atStop} before, ${restored.samples} after the restart` : 'gone');
    const after = await waitFor('the total to grow after the restart', async () => {
      const me = await ledgerOf(base, id);
      return me && me.samples > atStop + 2_000 ? me : null;
    }, 60_000, 250).catch((e) => { log(e.message); return null; });
    check('the rejoined tab keeps adding to its total after the restart', after,
      after ? `${atStop} -> ${after.samples} samples` : 'it did not grow');
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'identity server');
    fs.rmSync(dir, { recursive: true, force: true });
    fs.rmSync(ck, { recursive: true, force: true });
  }
}

// ------------------------------------------------------------------ phase 4: figures

/// Opens the page at `base` in the pipe browser, waits for it (`the ${what} page to load`) and
/// clicks Contribute with one Web Worker (the phases below measure one core).
async function contributeOneCore(browser, base, what) {
  await browser.send('Page.navigate', { url: `${base}/` }, browser.session);
  await waitFor(`the ${what} page to load`, () => browser.evaluate(
    "document.readyState === 'complete' && !!window.crowdgrad"), 30_000, 100);
  await browser.evaluate("document.getElementById('cores').value = '1'; document.getElementById('contribute').click()");
}

/// Waits (60 s at most) for the tab's first accepted push.
async function firstPush(browser, what) {
  await waitFor(`the ${what} tab's first push`, () => browser.evaluate(
    'window.crowdgrad.volunteer.firstPushAt && true'), 60_000, 100);
}

/// One tab alone, nothing instrumenting it, against the server's default model; then the
/// native step() time for the same model and batch.
async function measureFigures() {
  phase = 'figures';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'figures');
  const st = await getStatus(base);
  const dir = tmpDir('crowdgrad-figures-');
  let browser = null;
  try {
    browser = await openBrowser(dir);
    await contributeOneCore(browser, base, 'figures');
    const first = await waitFor('the figures tab\'s first push', () => browser.evaluate(
      'window.crowdgrad.volunteer.firstPushAt && JSON.stringify(window.crowdgrad.volunteer)'), 60_000, 100);
    const v = JSON.parse(first);
    await sleep(10_000);
    const p = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
    check('an uninstrumented tab trains against the default model', p.state === 'training' && p.pushes_accepted > 0,
      `${p.pushes_accepted} pushes accepted`);
    figures['model, batch (figures run)'] = `${st.model}, ${st.batch_size}, ${st.shards.length} shards`;
    figures['first visit: navigation start to first accepted push'] =
      `${Math.round(v.firstPushAt)} ms (click to first push ${Math.round(v.firstPushAt - v.clickedAt)} ms, `
      + `incl. downloading the ${kib(v.progress.data_bytes)} partition)`;
    figures['one tab alone (server on the same 2 cores)'] =
      `${p.samples_per_sec.toFixed(0)} samples/s; per step ${p.step_ms.toFixed(3)} ms computing + ${p.wait_ms.toFixed(3)} ms waiting for parameters`;
    const m = /^mlp ([\d-]+)$/.exec(String(st.model || ''));
    const modelFlag = m ? `mlp:${m[1].split('-').slice(1, -1).join(',')}` : (String(st.model).startsWith('softmax') ? 'softmax' : null);
    await browser.close();
    browser = null;
    await stopChild(server, 'figures server');
    if (fs.existsSync(STEP_TIME) && modelFlag) {
      const out = await runCapture(STEP_TIME,
        ['--model', modelFlag, '--batch', String(st.batch_size), '--shards', String(st.shards.length)],
        { timeoutMs: 60_000, check: false });
      const json = out.split('\n').find((l) => l.startsWith('{'));
      if (json) {
        const n = JSON.parse(json);
        figures['step(): browser (wasm32 + SIMD128) vs native'] =
          `${p.step_ms.toFixed(3)} ms vs ${n.native_step_ms_mean.toFixed(3)} ms (${(p.step_ms / n.native_step_ms_mean).toFixed(1)}x)`;
      }
    } else {
      figures['step(): native'] = `n/a (build ${path.relative(ROOT, STEP_TIME)}: cargo build --release -p crowdgrad-worker-wasm --example step_time)`;
    }
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'figures server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/// Issue 12: one plain tab trains the default CNN (`--model cnn`: im2col convolutions and
/// max-pooling in wasm) for a short budget; the server's evaluation must climb well above
/// chance, and the tab's step time goes into the figures.
async function cnnTab() {
  phase = 'cnn';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'cnn', ['--model', 'cnn', '--eval-every', '2']);
  const dir = tmpDir('crowdgrad-cnn-');
  let browser = null;
  try {
    const st = await getStatus(base);
    check('the server runs the CNN', String(st.model).startsWith('conv:16x5x5'), String(st.model));
    browser = await openBrowser(dir);
    await contributeOneCore(browser, base, 'CNN');
    await firstPush(browser, 'CNN');
    const acc = await waitFor('the CNN to pass 80% test accuracy', async () => {
      const s = await getStatus(base);
      const a = s.eval && s.eval.accuracy;
      return a >= 0.8 ? a : null;
    }, 60_000, 500);
    const p = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
    check('a headless tab trains the CNN (test accuracy > 80%)', acc >= 0.8 && p.pushes_accepted > 0,
      `accuracy ${(acc * 100).toFixed(1)}%, ${p.pushes_accepted} pushes accepted`);
    figures['CNN (cnn) in one tab'] =
      `${p.samples_per_sec.toFixed(0)} samples/s; per step ${p.step_ms.toFixed(3)} ms computing + ${p.wait_ms.toFixed(3)} ms waiting`;
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'cnn server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/// The language model the gpt phase trains: two blocks of width 64 (about 0.12M
/// parameters), context 64, so a headless tab on a loaded 2-core machine moves it in a minute.
const E2E_GPT = 'gpt:2,64,4,64';
/// Validation bits per character the tab's training must get below. A uniform guess over the
/// 256 tokens is 8 bits, a fresh model about 8; the PyTorch peer's default gpt is at 3.66 after
/// 256,000 tokens (bench/peer/README.md).
const E2E_GPT_BPC = 4.5;

/// Issue 20: one plain tab trains a small gpt on the sentences from scratch (one Web Worker):
/// the validation bits per character fall below E2E_GPT_BPC and the page shows a sample of
/// the current weights' writing.
async function gptTab() {
  phase = 'gpt';
  if (!fs.existsSync(path.join(SENTENCES, 'train.txt'))) {
    check('the sentences corpus is there (crowdgrad data fetch --dataset sentences)', false, SENTENCES);
    return;
  }
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'gpt', ['--model', E2E_GPT, '--dataset', 'sentences', '--eval-every', '2',
    '--optimizer', 'adamw', '--lr', '0.003', '--clip-norm', '1'],
    { dataDir: SENTENCES });
  const dir = tmpDir('crowdgrad-gpt-');
  let browser = null;
  try {
    const st = await getStatus(base);
    check('the server runs a language model on text', st.task && st.task.kind === 'language' && st.task.vocab > 2,
      JSON.stringify(st.task));
    browser = await openBrowser(dir);
    await contributeOneCore(browser, base, 'gpt');
    await firstPush(browser, 'gpt');
    const started = Date.now();
    const bpc = await waitFor(`validation bits/char below ${E2E_GPT_BPC}`, async () => {
      const s = await getStatus(base);
      const b = s.eval && s.eval.bits_per_token;
      return b !== undefined && b < E2E_GPT_BPC ? b : null;
    }, 240_000, 1000);
    const p = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
    check(`a headless tab trains the gpt (validation bits/char < ${E2E_GPT_BPC})`, bpc < E2E_GPT_BPC && p.pushes_accepted > 0,
      `${bpc.toFixed(3)} bits/char after ${((Date.now() - started) / 1000).toFixed(0)} s, ${p.pushes_accepted} pushes accepted`);
    // The page polls /api/sample: it must come to show the server's current sample itself.
    const shown = await waitFor('the page to show the current sample', async () => {
      const t = (await browser.evaluate("(document.querySelector('#sample-text') || {}).textContent || ''")).trim();
      const r = await fetch(`${base}/api/sample`);
      if (r.status !== 200) return null;
      const api = await r.json();
      return t.length >= 20 && t.includes(api.text.trim()) ? t : null;
    }, 30_000, 500);
    check('the page shows what the weights write (/api/sample)', true, JSON.stringify(shown.slice(0, 160)));
    figures['gpt (gpt:2,64,4,64) in one tab'] =
      `${p.samples_per_sec.toFixed(1)} windows/s (x64 tokens); per step ${p.step_ms.toFixed(1)} ms computing + ${p.wait_ms.toFixed(1)} ms waiting; ${bpc.toFixed(3)} bits/char`;
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'gpt server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/// Issue 8: one plain tab in a compressed, local-step run (`--local-steps 4`, bf16 pulls,
/// int8 block pushes): the tab's exchange view on the server must show H = 4 and the
/// negotiated encodings, and test accuracy must rise well above its first evaluation.
async function localStepsTab() {
  phase = 'local-steps';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'local-steps', ['--local-steps', '4',
    '--pull-encoding', 'bf16', '--push-encoding', 'int8_block', '--eval-every', '1', '--spot-check', '1']);
  const dir = tmpDir('crowdgrad-local-');
  let browser = null;
  try {
    browser = await openBrowser(dir);
    await contributeOneCore(browser, base, 'local-steps');
    await firstPush(browser, 'local-steps');
    const first = (await getStatus(base)).eval_history[0];
    const tab = await waitFor('the tab\'s exchange view (H, encodings) and 90% test accuracy', async () => {
      const s = await getStatus(base);
      const w = s.workers.find((x) => x.client === 'browser' && x.exchange);
      return w && w.exchange.local_steps === 4 && s.eval && s.eval.accuracy >= 0.9 ? { w, s } : null;
    }, 60_000, 500).catch((e) => { log(e.message); return null; });
    const x = tab && tab.w.exchange;
    check('a tab in a --local-steps 4 run reports H = 4 with bf16 pulls and int8 block pushes',
      x && x.local_steps === 4 && x.pull_encoding === 'bf16' && x.push_encoding === 'int8_block',
      x ? `H ${x.local_steps}, ${x.pull_encoding} / ${x.push_encoding}, computing ${(100 * x.compute_share).toFixed(0)}%` : 'no exchange view');
    const acc = tab ? tab.s.eval.accuracy : 0;
    check('test accuracy rises in the compressed, local-step run (> 90%)',
      tab && acc >= 0.9 && acc > first.accuracy + 0.5,
      `${(100 * first.accuracy).toFixed(1)}% -> ${(100 * acc).toFixed(1)}%`);
    if (tab) {
      const t = tab.s.totals;
      const perPush = t.bytes_up / Math.max(1, t.pushes_applied);
      const f32 = 4 * tab.s.params / tab.s.shards.length;
      check('the tab\'s pushes are int8 blocks on the wire (~25% of f32)', perPush < 0.27 * f32,
        `${(perPush / 1024).toFixed(1)} KiB per shard push vs ${(f32 / 1024).toFixed(1)} KiB in f32`);
      // Every round recomputed whole by the server (issue 10): the tab is not quarantined.
      const sc = spotChecks(tab.s, 'browser');
      check('spot checks of the tab\'s local rounds (H = 4) all pass', sc.ok, sc.text);
      figures['spot checks, honest browser (mlp, H = 4, bf16 / int8)'] = sc.text;
      figures['local steps (H = 4, bf16 / int8) in one tab'] =
        `${(100 * x.compute_share).toFixed(0)}% computing, up ${(x.up_bps / 1e3).toFixed(0)} kB/s, down ${(x.down_bps / 1e3).toFixed(0)} kB/s`;
    }
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'local-steps server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/// Issue 8: a tab with the next pull in flight while it computes (`--overlap on`, gradient
/// pushes): it must train, and the figures give its computing and waiting per step next to the
/// default tab's (the figures phase), both against a server on the same 2 cores.
async function overlapTab() {
  phase = 'overlap';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'overlap', ['--overlap', 'on', '--eval-every', '1']);
  const dir = tmpDir('crowdgrad-overlap-');
  let browser = null;
  try {
    browser = await openBrowser(dir);
    await contributeOneCore(browser, base, 'overlap');
    await firstPush(browser, 'overlap');
    await sleep(8_000);
    const p = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
    const s = await getStatus(base);
    const w = s.workers.find((x) => x.client === 'browser' && x.exchange);
    check('a tab trains with its next pull in flight (--overlap on)',
      p.state === 'training' && p.pushes_accepted > 0 && !!w,
      `${p.pushes_accepted} pushes accepted, accuracy ${s.eval ? (100 * s.eval.accuracy).toFixed(1) : '?'}%`);
    const share = p.step_ms / Math.max(1e-9, p.step_ms + p.wait_ms);
    figures['one tab, --overlap on (next pull in flight while computing)'] =
      `${p.samples_per_sec.toFixed(0)} samples/s; per step ${p.step_ms.toFixed(3)} ms computing + `
      + `${p.wait_ms.toFixed(3)} ms waiting (${(100 * share).toFixed(0)}% computing)`;
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'overlap server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/// Issue 9: a tab trains against a coordinator and two shard processes (`crowdgrad shard`);
/// shard 1 is killed with SIGKILL: the tab keeps training and pushing to shard 0 without a
/// rejoin, reopens shard 1 alone when it is back (resumed from its own checkpoint), and pushes
/// to it again.
async function remoteShardTab() {
  phase = 'remote-shard';
  const SECRET = 'e2e-run-secret-0123456789abcdef';
  const ports = [await freePort(), await freePort()];
  const ckpt = tmpDir('crowdgrad-shard-ckpt-');
  // Gradient pushes (H = 1) on the coordinator and both shard processes: the phase counts
  // versions (50 on each shard before the kill), one per step of the tab at H = 1; under
  // serve's default `auto` a version is a whole round and the counts would depend on H.
  const H1 = ['--local-steps', '1', '--egress-budget', 'off'];
  const startShard = async (i) => {
    const child = spawnLogged(`shard-${i}`, SERVER, ['shard', '--listen', `127.0.0.1:${ports[i]}`,
      '--index', String(i), '--shards', '2', '--run-secret', SECRET,
      '--checkpoint-dir', ckpt, '--checkpoint-every', '1', ...H1]);
    await waitFor(`shard ${i} to answer`, async () => {
      if (child.exitCode !== null) throw new Error(`shard ${i} exited; see ${child.logFile}`);
      const r = await fetch(`http://127.0.0.1:${ports[i]}/api/shard`, { signal: AbortSignal.timeout(2_000) });
      return r.ok;
    }, 60_000, 200);
    return child;
  };
  const shards = [];
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const dir = tmpDir('crowdgrad-remote-');
  let server = null;
  let browser = null;
  const version = (s, i) => Number((s.remote_shards && s.remote_shards[i] && s.remote_shards[i].version) || 0);
  const progress = async () => JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
  try {
    shards.push(await startShard(0), await startShard(1));
    server = await startServer(port, 'remote', ['--shard-urls',
      `ws://127.0.0.1:${ports[0]},ws://127.0.0.1:${ports[1]}`, '--run-secret', SECRET, '--eval-every', '1', ...H1]);
    browser = await openBrowser(dir);
    await contributeOneCore(browser, base, 'remote-shard');
    await waitFor('the tab to train on both shard processes', async () => {
      const s = await getStatus(base);
      return version(s, 0) > 50 && version(s, 1) > 50;
    }, 60_000, 250);
    const before = await progress();
    shards[1].kill('SIGKILL');
    await shards[1].exited;
    const down = await waitFor('shard 1 reported down', async () => {
      const s = await getStatus(base);
      return s.remote_shards[1].up === false ? s : null;
    }, 30_000, 250);
    const moved = await waitFor('shard 0 moving on while shard 1 is down', async () => {
      const s = await getStatus(base);
      return version(s, 0) > version(down, 0) + 50 ? s : null;
    }, 30_000, 250).catch((e) => { log(e.message); return null; });
    const mid = await progress();
    check('with shard 1 killed, the tab keeps pushing to shard 0 without a rejoin',
      moved && mid.state === 'training' && mid.reconnects === before.reconnects && mid.shards_connected === 1,
      moved ? `shard 0 v${version(down, 0)} -> v${version(moved, 0)}; state ${mid.state}, `
        + `${mid.shards_connected} shard connected, sessions ${before.reconnects} -> ${mid.reconnects}` : 'shard 0 did not move');
    shards[1] = await startShard(1);
    const back = await waitFor('the tab to reopen shard 1 and push to it', async () => {
      const s = await getStatus(base);
      const p = await progress();
      return s.remote_shards[1].ready && p.shards_connected === 2 && version(s, 1) > 0 ? { s, p } : null;
    }, 60_000, 250).catch((e) => { log(e.message); return null; });
    if (back) await sleep(2_000);
    const after = back ? await getStatus(base) : null;
    const end = await progress();
    check('the tab reopens shard 1 alone when it is back and pushes to it again',
      back && version(after, 1) > version(back.s, 1) && end.reconnects === before.reconnects,
      back ? `shard 1 v${version(back.s, 1)} -> v${version(after, 1)}, sessions ${end.reconnects}` : 'not back');
  } finally {
    if (browser) await browser.close();
    if (server) await stopChild(server, 'remote coordinator');
    for (const [i, c] of shards.entries()) await stopChild(c, `shard ${i}`);
    fs.rmSync(dir, { recursive: true, force: true });
    fs.rmSync(ckpt, { recursive: true, force: true });
  }
}

// ------------------------------------------------------------------ issue 11: K cores in one tab

/// Opens `url` in the pipe browser and waits for the page's handle.
async function openPage(browser, url) {
  await browser.send('Page.navigate', { url }, browser.session);
  await waitFor(`${url} to load`, () => browser.evaluate(
    "document.readyState === 'complete' && !!window.crowdgrad && !!window.crowdgrad.volunteer"), 30_000, 100);
}

/// Clicks Contribute with K Web Workers.
async function contributeWith(browser, k) {
  await browser.evaluate(`document.getElementById('cores').value = '${k}'; document.getElementById('contribute').click()`);
}

/// Every Web Worker's latest report.
async function threadReports(browser) {
  return JSON.parse(await browser.evaluate(
    'JSON.stringify(window.crowdgrad.volunteer.threads.map((t) => (t && t.progress) || null))'));
}

/// Issue 11: one tab with K = 2 Web Workers against a softmax run: both train, the second reads
/// the first's partition from the Cache API, the server and its dashboard show one volunteer
/// with 2 threads, Pause stops both (no push from either), and a 25% CPU limit holds for each.
async function coresTab() {
  phase = 'cores';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'cores', ['--model', 'softmax']);
  const dir = tmpDir('crowdgrad-cores-');
  let browser = null;
  try {
    browser = await openBrowser(dir);
    await openPage(browser, `${base}/`);
    const offer = JSON.parse(await browser.evaluate(`JSON.stringify({
      n: navigator.hardwareConcurrency,
      options: [...document.getElementById('cores').options].map((o) => o.value),
      value: document.getElementById('cores').value,
      total: document.getElementById('cores-total').textContent })`));
    check('the page offers "use K of N cores" (N = navigator.hardwareConcurrency, default K = N - 1, at least 1)',
      offer.options.length === offer.n && Number(offer.total) === offer.n && Number(offer.value) === Math.max(1, offer.n - 1),
      `N = ${offer.n}, K offered 1..${offer.options.length}, default ${offer.value}`);
    if (offer.n < 2) {
      check('K = 2 Web Workers in one tab', false, `this browser reports ${offer.n} core(s)`);
      return;
    }
    await contributeWith(browser, 2);
    const both = await waitFor('both Web Workers to have pushes accepted', async () => {
      const ps = await threadReports(browser);
      return ps.length === 2 && ps.every((p) => p && p.state === 'training' && p.pushes_accepted > 5) ? ps : null;
    }, 90_000, 200).catch((e) => { log(e.message); return null; });
    check('K = 2: both Web Workers of the tab train', both,
      both ? both.map((p) => `worker ${p.worker_id}: ${p.pushes_accepted} pushes`).join(', ') : 'not both training');
    if (!both) return;
    check('the second Web Worker reads the partition the first downloaded (Cache API, one download)',
      both[1].data_from_cache === true && both[1].partition_images === both[0].partition_images,
      `thread 1 from cache: ${both[1].data_from_cache}, partitions ${both[0].partition_index} / ${both[1].partition_index}`);
    const ids = both.map((p) => p.worker_id);
    const listed = await waitFor('the server to show one volunteer with 2 threads', async () => {
      const s = await getStatus(base);
      const ws = s.workers.filter((w) => ids.includes(w.id) && w.connected);
      return ws.length === 2 && ws.every((w) => w.threads && w.threads.count === 2)
        && ws[0].threads.volunteer === ws[1].threads.volunteer && s.totals.workers.volunteers.connected === 1 ? s : null;
    }, 15_000).catch((e) => { log(e.message); return null; });
    check('the server counts the tab as one volunteer with 2 threads', listed,
      listed ? `volunteers online ${listed.totals.workers.volunteers.connected}, browser workers online ${listed.totals.workers.browser.connected}` : 'not grouped');
    const row = await waitFor('the dashboard to show the tab once, with 2 threads', () => browser.evaluate(`(() => {
      const rows = [...document.querySelectorAll('#workers tr[data-connected="true"]')];
      return rows.length === 1 && rows[0].dataset.threads === '2' ? rows[0].cells[0].textContent : null; })()`), 10_000)
      .catch((e) => { log(e.message); return null; });
    check('the dashboard lists the tab as one volunteer with 2 threads', row, row || 'no single 2-thread row');

    // Pause: neither Web Worker computes or pushes.
    await browser.evaluate("document.getElementById('pause').click()");
    const paused = await waitFor('both Web Workers to pause', async () => {
      const ps = await threadReports(browser);
      return ps.every((p) => p.state === 'paused') ? ps : null;
    }, 10_000, 100).catch((e) => { log(e.message); return null; });
    if (paused) {
      const s0 = await getStatus(base);
      await sleep(2_000);
      const s1 = await getStatus(base);
      const still = await threadReports(browser);
      const applied = (s, id) => (s.workers.find((w) => w.id === id) || { pushes_applied: 0 }).pushes_applied;
      const pushes = ids.map((id) => applied(s1, id) - applied(s0, id));
      const steps = still.map((p, i) => p.steps - paused[i].steps);
      const online = s1.workers.filter((w) => ids.includes(w.id) && w.connected).length;
      check('Pause stops both Web Workers: no step, no push applied from either, both disconnected',
        pushes.every((n) => n === 0) && steps.every((n) => n === 0) && online === 0,
        `pushes applied while paused ${pushes.join(' / ')}, steps ${steps.join(' / ')}, ${online} online`);
      await browser.evaluate("document.getElementById('pause').click()");
      const resumed = await waitFor('both Web Workers to resume', async () => {
        const ps = await threadReports(browser);
        return ps.every((p, i) => p.state === 'training' && p.steps > paused[i].steps) ? ps : null;
      }, 20_000, 100).catch((e) => { log(e.message); return null; });
      check('Resume restarts both Web Workers', resumed);
    } else {
      check('Pause stops both Web Workers: no step, no push applied from either, both disconnected', false, 'never paused');
    }

    // The CPU limit, per Web Worker: computing time over wall time from each one's counters.
    await browser.evaluate("(() => { const s = document.getElementById('throttle'); s.value = '25'; s.dispatchEvent(new Event('change')); })()");
    await sleep(1_500);
    const c0 = await threadReports(browser);
    await sleep(5_000);
    const c1 = await threadReports(browser);
    const busy = c1.map((p, i) => (1000 * (p.compute_s - c0[i].compute_s)) / Math.max(1, p.uptime_ms - c0[i].uptime_ms));
    check('a 25% CPU limit holds for both Web Workers (each computes at most ~25% of the time)',
      c1.every((p) => p.throttle_percent === 25) && busy.every((b) => b <= 0.3) && busy.every((b) => b > 0),
      `computing ${busy.map((b) => `${(100 * b).toFixed(1)}%`).join(' / ')} of wall time`);
    figures['CPU limit 25%, K = 2 (busy share per Web Worker)'] = busy.map((b) => `${(100 * b).toFixed(1)}%`).join(' / ');
    const errs = errorsIn(['cores']);
    check('no console errors with 2 Web Workers', errs.length === 0, errs.map((e) => e.text).join(' | '));
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'cores server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/// Issue 11 figures: one tab's samples/s with K = 1 and K = 2 Web Workers against in-memory
/// loopback shards (the page's `?loopback=1`: no server CPU competing) and against a server on
/// the same machine (default model); and the loopback step time at half the batch, the upper
/// bound of splitting one batch over 2 threads (no barrier, no gradient sum counted).
async function coresFigures() {
  phase = 'cores-figures';
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const server = await startServer(port, 'cores-figures');
  const dir = tmpDir('crowdgrad-cores-fig-');
  let browser = null;
  const MEASURE_MS = 10_000;
  try {
    const st = await getStatus(base);
    browser = await openBrowser(dir);
    const run = async (query, k) => {
      await openPage(browser, `${base}/${query}`);
      // Loopback threads take the run's model and batch from the status: wait for it.
      await waitFor('the first status', () => browser.evaluate("document.getElementById('run-info').textContent.startsWith('run ')"), 10_000, 100);
      await contributeWith(browser, k);
      await waitFor(`${k} Web Worker(s) training (${query || 'server'})`, async () => {
        const ps = await threadReports(browser);
        return ps.length === k && ps.every((p) => p && p.state === 'training' && p.steps > 20);
      }, 90_000, 200).catch(async (e) => {
        const ps = await threadReports(browser).catch(() => []);
        const err = await browser.evaluate("document.getElementById('my-error').textContent").catch(() => '');
        throw new Error(`${e.message}; reports: ${ps.map((p) => p && `${p.state} ${p.steps} steps ${p.error || ''}`).join(' | ')}; page: ${err}`);
      });
      await sleep(2_000);
      const read = async () => JSON.parse(await browser.evaluate(
        'JSON.stringify({ t: performance.now(), threads: window.crowdgrad.volunteer.threads.map((x) => x.progress) })'));
      const a = await read();
      await sleep(MEASURE_MS);
      const b = await read();
      const samples = (r) => r.threads.reduce((n, p) => n + p.samples, 0);
      const stepMs = b.threads.reduce((n, p) => n + p.step_ms, 0) / k;
      return { sps: (1000 * (samples(b) - samples(a))) / (b.t - a.t), stepMs };
    };
    const n = await browser.evaluate('navigator.hardwareConcurrency').catch(() => 0);
    const batch = st.batch_size;
    const l1 = await run('?loopback=1', 1);
    const l2 = n >= 2 ? await run('?loopback=1', 2) : null;
    const s1 = await run('', 1);
    const s2 = n >= 2 ? await run('', 2) : null;
    const half = await run(`?loopback=1&batch=${Math.max(1, Math.floor(batch / 2))}`, 1);
    const fmt = (r) => (r ? `${r.sps.toFixed(0)} samples/s (step ${r.stepMs.toFixed(2)} ms)` : 'n/a (1 core)');
    figures[`cores: tab, loopback shards (${st.model}, batch ${batch}), K = 1 / K = 2`] = `${fmt(l1)} / ${fmt(l2)}`;
    figures[`cores: tab vs server on the same ${n} cores, K = 1 / K = 2`] = `${fmt(s1)} / ${fmt(s2)}`;
    if (l2) {
      const scale = l2.sps / l1.sps;
      figures['cores: loopback scaling K = 2 over K = 1'] = `${scale.toFixed(2)}x (target >= 1.6x: ${scale >= 1.6 ? 'met' : 'MISSED'})`;
      // Splitting one batch over 2 threads: each computes half of it; the step takes at least
      // step(B/2), so samples/s rise at most step(B) / step(B/2).
      const bound = l1.stepMs / half.stepMs;
      figures['cores: split-batch bound, step(B) / step(B/2) in loopback'] =
        `${l1.stepMs.toFixed(2)} ms / ${half.stepMs.toFixed(2)} ms = ${bound.toFixed(2)}x at most (independent workers: ${scale.toFixed(2)}x)`;
    }
    if (s2) figures['cores: server scaling K = 2 over K = 1 (server shares the cores)'] = `${(s2.sps / s1.sps).toFixed(2)}x`;
  } catch (e) {
    check('the cores figures ran', false, e.message);
  } finally {
    if (browser) await browser.close();
    await stopChild(server, 'cores-figures server');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

// ------------------------------------------------------------------ the phases, in order

/// Name -> phase, run in this order. `E2E_ONLY=NAME` runs the phases named NAME or NAME-...
/// (so `cores` is phase 5 and its figures); a comma-separated list selects several.
const PHASES = [
  ['functional', functional],
  ['figures', measureFigures],
  ['cnn', cnnTab],
  ['gpt', gptTab],
  ['local-steps', localStepsTab],
  ['overlap', overlapTab],
  ['remote', remoteShardTab],
  ['identity', identityTab],
  ['cores', coresTab],
  ['cores-figures', coresFigures],
];

/// The entries of `phases` that `only` selects (every one when it is empty); throws on a name
/// that selects nothing.
function selected(phases, only) {
  if (!only) return phases;
  const names = only.split(',').map((n) => n.trim()).filter(Boolean);
  const picked = phases.filter(([name]) => names.some((n) => name === n || name.startsWith(`${n}-`)));
  const unknown = names.filter((n) => !phases.some(([name]) => name === n || name.startsWith(`${n}-`)));
  if (unknown.length) throw new Error(`E2E_ONLY: no phase named ${unknown.join(', ')} (phases: ${phases.map(([n]) => n).join(', ')})`);
  return picked;
}

let code = 0;
try {
  await main();
} catch (e) {
  check('the test ran to completion', false, e.message);
  code = 1;
  await cleanup();
}
console.log('\nfigures:');
for (const [k, v] of Object.entries(figures)) console.log(`  ${k}: ${v}`);
finish(code);
