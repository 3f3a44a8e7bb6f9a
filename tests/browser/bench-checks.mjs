#!/usr/bin/env node
// Honest workers under spot checks (issue 21: "zero false quarantines over 10,000 checks, every
// encoding, native and browser"). For each push encoding it starts a real `crowdgrad serve`
// checking a high share of the pushes (`--spot-check 1` by default: every push), lets honest
// workers train until the server has made `--checks` checks of their pushes (or `--cap-s`
// seconds passed, or a check failed or a worker was quarantined), and prints per encoding:
// checks passed / failed, quarantines, the cosine and norm-ratio range of the checks it saw,
// pushes refused by reason (the checker's `busy` and `too_stale` among them), test accuracy and
// time. The workers are either headless Chromium tabs on the real page (`--kind browser`: the
// page's Contribute button, K Web Workers of wasm) or `crowdgrad work` processes (`--kind
// native`). A benchmark: it prints figures; it exits 1 when something does not run, and also
// when an honest worker failed a check or was quarantined (the claim it measures).
//
//   node tests/browser/bench-checks.mjs [--kind browser|native|both] [--encodings f32,bf16,int8_block]
//        [--checks 10000] [--cap-s 600] [--local-steps 1|auto|H] [--spot-check 1] [--cores 1]
//        [--threads 1] [--model mlp:128] [--min-s 0] [--dump FILE] [--serve "MORE SERVE FLAGS"]
//
// `--min-s S` keeps training until S seconds have passed even when the checks are counted
// (late in training is where compressed pushes are furthest from their recomputed round).
//
// With `--local-steps 1` (the default here: a round is one step, so checks come fast) the
// egress budget is turned off (`--egress-budget off`, as serve's docs say for H = 1 lessons);
// with `auto` serve's defaults stay. The pull encoding is serve's default (bf16), which the
// page and `work` use as the server says. Every check's figures come from `/api/status`'s
// `spot_checks.recent` (the last 512), polled twice a second: the cosine and ratio ranges are
// over the checks seen that way, and the table says how many of all checks that was.
//
// Needs web/pkg (cargo xtask build-web) for the browser and target/release/crowdgrad.
// Processes, paths and waits from harness.mjs, Chromium over the DevTools pipe (cdp.mjs).

import fs from 'node:fs';
import path from 'node:path';
import {
  CHROMIUM, SERVER, WEB, deadline, freePort, getStatus, killChildrenOnExit, openBrowser,
  sleep, spawnLogged, startServer, stopChild, tmpDir, waitFor,
} from './harness.mjs';

const argv = process.argv.slice(2);
const opt = (name, def) => {
  const i = argv.indexOf(name);
  return i >= 0 && argv[i + 1] !== undefined ? argv[i + 1] : def;
};
const num = (name, def) => {
  const v = Number(opt(name, def));
  if (!Number.isFinite(v) || v <= 0) throw new Error(`${name} wants a positive number, got ${opt(name, def)}`);
  return v;
};
const KINDS = { browser: ['browser'], native: ['native'], both: ['native', 'browser'] }[opt('--kind', 'both')];
if (!KINDS) throw new Error(`--kind wants browser, native or both, got ${opt('--kind')}`);
const ENCODINGS = opt('--encodings', 'f32,bf16,int8_block').split(',').filter(Boolean);
for (const e of ENCODINGS) {
  if (!['f32', 'bf16', 'int8_block'].includes(e)) throw new Error(`unknown push encoding ${e}`);
}
const CHECKS = num('--checks', 10_000);
const CAP_S = num('--cap-s', 600);
// Train on at least this long after the target is met: late in training an int8 push's
// carried residual is as large as its gradient (docs/benchmarks.md), the hard case.
const MIN_S = Number(opt('--min-s', 0));
// Every check seen, one JSON line each ({kind, enc, t_s, worker, shard, steps, cosine,
// norm_ratio, passed}), for looking at how the figures move with the round's length.
const DUMP = opt('--dump', null);
// More `serve` flags, one string split on spaces (e.g. `--serve "--inner-optimizer sgd"`).
const SERVE_ARGS = (opt('--serve', '') || '').split(' ').filter(Boolean);
if (DUMP) fs.writeFileSync(DUMP, '');
const LOCAL_STEPS = opt('--local-steps', '1');
const SPOT = num('--spot-check', 1);
const CORES = num('--cores', 1);
const THREADS = num('--threads', 1);
const MODEL = opt('--model', null);
// The whole script: every run's cap, plus starting and stopping.
const LIMIT_S = Number(process.env.BENCH_TIMEOUT_S || (KINDS.length * ENCODINGS.length * (CAP_S + 120)));

// Progress goes to stderr: stdout is the table.
const log = (msg) => console.error(`[${new Date().toISOString().slice(11, 19)}] ${msg}`);
killChildrenOnExit();
deadline(LIMIT_S, () => { log(`gave up after ${LIMIT_S} s`); process.exit(1); });

const loadavg = () => fs.readFileSync('/proc/loadavg', 'utf8').split(' ').slice(0, 3).join(' ');

/// Pushes and frames refused, by reason (the server's totals).
function refusals(totals) {
  const out = {};
  for (const m of [totals.rejected_by_reason, totals.frames_rejected_by_reason]) {
    for (const [k, v] of Object.entries(m || {})) out[k] = (out[k] || 0) + v;
  }
  return out;
}

/// One run: a server with push encoding `enc`, honest workers of `kind`, until CHECKS checks.
async function run(kind, enc, browser) {
  const port = await freePort();
  const args = ['--spot-check', String(SPOT), '--push-encoding', enc, '--local-steps', LOCAL_STEPS,
    ...(LOCAL_STEPS === '1' ? ['--egress-budget', 'off'] : []), ...(MODEL ? ['--model', MODEL] : []), ...SERVE_ARGS];
  const server = await startServer(port, `bench-checks-${kind}-${enc}`, args, { timeoutMs: 120_000, say: log });
  const { base } = server;
  const load0 = loadavg();
  let native = null;
  const t0 = Date.now();
  try {
    if (kind === 'native') {
      native = spawnLogged(`bench-checks-native-${enc}`, SERVER,
        ['work', '--server', base, '--seconds', String(Math.ceil(CAP_S) + 30), '--threads', String(THREADS),
          '--quiet', '--name', `bench-checks-${enc}`]);
    } else {
      await browser.send('Page.navigate', { url: `${base}/` }, browser.session);
      await waitFor('the page and its first status', () => browser.evaluate(
        "document.readyState === 'complete' && !!window.crowdgrad && document.getElementById('run-info').textContent.startsWith('run ')"), 60_000, 200);
      await browser.evaluate(`document.getElementById('cores').value = '${CORES}';
        document.getElementById('throttle').value = '100';
        document.getElementById('contribute').click()`);
    }
    // Poll: every check's figures pass through `recent` (512) unless more than that many
    // are made between two polls; `seen` counts what was observed.
    let cosMin = Infinity; let ratioMin = Infinity; let ratioMax = -Infinity; let stepsMax = 0;
    let seen = 0; let lastDone = 0; let st = null; let firstCheckAt = null;
    let stopped = 'cap';
    while ((Date.now() - t0) / 1000 < CAP_S) {
      await sleep(500);
      if (native && native.exitCode !== null) { stopped = `native worker exited (${native.exitCode})`; break; }
      if (server.exitCode !== null) throw new Error(`server exited (${server.exitCode}); see ${server.logFile}`);
      try { st = await getStatus(base); } catch (e) { log(`status: ${e.message}`); continue; }
      const sc = st.spot_checks;
      if (!sc) throw new Error('the server runs no spot checks');
      const kinds = new Map((st.workers || []).map((w) => [w.id, w.client]));
      const done = sc.passed + sc.failed;
      const fresh = Math.min(done - lastDone, sc.recent.length);
      for (const f of sc.recent.slice(sc.recent.length - fresh)) {
        if (kinds.has(f.worker) && kinds.get(f.worker) !== kind) throw new Error(`a ${kinds.get(f.worker)} worker's push in a ${kind} run`);
        cosMin = Math.min(cosMin, f.cosine);
        ratioMin = Math.min(ratioMin, f.norm_ratio);
        ratioMax = Math.max(ratioMax, f.norm_ratio);
        stepsMax = Math.max(stepsMax, f.steps);
        if (DUMP) fs.appendFileSync(DUMP, `${JSON.stringify({ kind, enc, t_s: (Date.now() - t0) / 1000, ...f })}\n`);
      }
      seen += fresh;
      lastDone = done;
      if (done > 0 && firstCheckAt === null) firstCheckAt = Date.now();
      if (sc.failed > 0 || st.reputation.quarantined > 0) { stopped = 'a check failed or a worker was quarantined'; break; }
      if (done >= CHECKS && (Date.now() - t0) / 1000 >= MIN_S) { stopped = 'target'; break; }
      if (Math.floor((Date.now() - t0) / 10_000) !== Math.floor((Date.now() - t0 - 500) / 10_000)) {
        log(`${kind} ${enc}: ${done} checks (${sc.passed} passed), ${((Date.now() - t0) / 1000).toFixed(0)} s, load ${loadavg()}`);
      }
    }
    const secs = (Date.now() - t0) / 1000;
    if (kind === 'browser') {
      await browser.evaluate("document.getElementById('contribute').click()").catch(() => {});
    }
    // The last evaluation after the workers stop (one more, at most --eval-every later).
    const at = Date.now();
    const final = await waitFor('an evaluation after the run', async () => {
      const s = await getStatus(base);
      return s.eval && s.eval.t_ms >= at ? s : null;
    }, 30_000, 250).catch(() => st);
    const sc = final.spot_checks;
    const c = final.totals;
    return {
      kind, enc, stopped, secs, checkSecs: firstCheckAt ? (Date.now() - firstCheckAt) / 1000 : 0,
      passed: sc.passed, failed: sc.failed, quarantined: final.reputation.quarantined,
      quarantines: final.quarantines, refusedBusy: sc.refused_busy, refusedVersion: sc.refused_version,
      sensitive: sc.sensitive ?? 0, sensitivePassed: sc.sensitive_passed ?? 0,
      cosMin, ratioMin, ratioMax, stepsMax, seen,
      applied: c.pushes_applied, rejected: c.pushes_rejected, reasons: refusals(c),
      accuracy: final.eval ? final.eval.accuracy : NaN, samples: c.samples,
      workers: (final.workers || []).filter((w) => w.client === kind).length,
      load0, load1: loadavg(), model: final.model,
    };
  } finally {
    if (native) await stopChild(native, 'native worker');
    await stopChild(server, 'server');
  }
}

async function main() {
  for (const f of [SERVER, ...(KINDS.includes('browser') ? [CHROMIUM, path.join(WEB, 'pkg/crowdgrad_worker_wasm_bg.wasm')] : [])]) {
    if (!fs.existsSync(f)) throw new Error(`missing ${f}`);
  }
  const rows = [];
  let dir = null; let browser = null;
  try {
    for (const kind of KINDS) {
      for (const enc of ENCODINGS) {
        if (kind === 'browser' && !browser) {
          dir = tmpDir('crowdgrad-bench-checks-');
          browser = await openBrowser(dir);
        }
        log(`${kind}, push ${enc}: starting (load ${loadavg()})`);
        const r = await run(kind, enc, browser);
        log(`${kind}, push ${enc}: ${r.passed} passed, ${r.failed} failed, ${r.quarantined} quarantined in ${r.secs.toFixed(0)} s (${r.stopped}); judged by their sensitivity: ${r.sensitive} rounds, ${r.sensitivePassed} passed`);
        if (r.quarantines.length) log(`quarantines: ${JSON.stringify(r.quarantines)}`);
        rows.push(r);
      }
    }
  } finally {
    if (browser) await browser.close();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  }
  const who = (k) => (k === 'browser' ? `browser (1 tab, K = ${CORES})` : `native (work --threads ${THREADS})`);
  console.log(`\n${rows[0].model}${SERVE_ARGS.length ? ` ${SERVE_ARGS.join(' ')}` : ''}, --spot-check ${SPOT}, --local-steps ${LOCAL_STEPS}${LOCAL_STEPS === '1' ? ' --egress-budget off' : ''}, target ${CHECKS} checks${MIN_S ? ` and ${MIN_S} s` : ''} or ${CAP_S} s\n`);
  console.log('| workers | push | checks passed | failed | quarantined | cosine min (checks seen) | norm ratio | max H | pushes applied | refused by reason | accuracy | time | checks/s | load |');
  console.log('|---|---|---:|---:|---:|---|---|---:|---:|---|---:|---:|---:|---|');
  for (const r of rows) {
    const reasons = Object.entries(r.reasons).map(([k, v]) => `${k} ${v}`).join(', ') || 'none';
    console.log(`| ${who(r.kind)} | ${r.enc} | ${r.passed} | ${r.failed} | ${r.quarantined} | ${r.cosMin.toFixed(4)}, 1 − cos ${(1 - r.cosMin).toExponential(1)} (${r.seen}) | `
      + `${r.ratioMin.toFixed(5)} – ${r.ratioMax.toFixed(5)} | ${r.stepsMax} | ${r.applied} | ${reasons} | `
      + `${(100 * r.accuracy).toFixed(2)}% | ${r.secs.toFixed(0)} s | ${(r.passed + r.failed) / Math.max(1e-9, r.checkSecs) | 0} | ${r.load0} → ${r.load1} |`);
  }
  const bad = rows.filter((r) => r.failed > 0 || r.quarantined > 0);
  const short = rows.filter((r) => r.passed + r.failed < CHECKS);
  console.log(`\n${bad.length === 0 ? 'no honest worker failed a check or was quarantined' : `FAILED: ${bad.map((r) => `${r.kind} ${r.enc}`).join(', ')}`}`
    + `${short.length ? `; under ${CHECKS} checks (time cap): ${short.map((r) => `${r.kind} ${r.enc} ${r.passed + r.failed}`).join(', ')}` : ''}`);
  return bad.length === 0;
}

try {
  process.exit((await main()) ? 0 : 1);
} catch (e) {
  log(`bench-checks: ${e.stack || e.message}`);
  process.exit(1);
}
