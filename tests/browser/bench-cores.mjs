#!/usr/bin/env node
// Cores benchmark (issue 11): one tab's samples/s with K = 1..N Web Workers against in-memory
// loopback shards (the page's `/?loopback=1`: each Web Worker trains against core's shard
// sessions in its own memory, no server CPU competing) and against a server on this machine
// (the default run: mlp:128, batch 32, 2 shards); and the loopback step at half the batch, the
// bound on splitting one batch over 2 threads. Runs are interleaved round by round and the
// median is reported, because the machine is shared. A benchmark: it prints figures and fails
// only when something does not run.
//
//   node tests/browser/bench-cores.mjs [--rounds 3] [--seconds 8] [--renice] [--model gpt]
//
// `--model gpt` (issue 20): the server trains the language model on the sentences corpus
// (data/sentences: `crowdgrad data fetch --dataset sentences`) with the peer's recipe (AdamW lr
// 0.003, clip 1) and evaluates every 30 s, as it shares the cores; only the server rows run
// (the loopback page trains the MLP) and the table adds tokens/s (samples x the context).
//
// Needs web/pkg (cargo xtask build-web) and target/release/crowdgrad. `--renice` (root) puts
// the server and every Chromium thread at nice -15, to measure on a machine busy with other
// work (Chromium resets its renderers to nice 0, so renicing the script is not enough).
// Plain headless Chromium over a raw DevTools pipe with only the Runtime domain (cdp.mjs), as
// the figures phase of e2e.mjs; processes, paths and waits from harness.mjs.

import fs from 'node:fs';
import path from 'node:path';
import {
  CHROMIUM, SERVER, WEB, deadline, freePort, killChildrenOnExit, openBrowser, runCapture, sleep,
  SENTENCES, startServer, stopChild, tmpDir, waitFor,
} from './harness.mjs';

const argv = process.argv.slice(2);
const flag = (name, def) => {
  const i = argv.indexOf(name);
  return i >= 0 && argv[i + 1] !== undefined ? Number(argv[i + 1]) : def;
};
const ROUNDS = flag('--rounds', 3);
const SECONDS = flag('--seconds', 8);
const RENICE = argv.includes('--renice');
const MODEL = (() => { const i = argv.indexOf('--model'); return i >= 0 ? argv[i + 1] : null; })();
const MODEL_ARGS = MODEL
  ? ['--model', MODEL, '--dataset', 'sentences', '--optimizer', 'adamw', '--lr', '0.003', '--clip-norm', '1', '--eval-every', '30']
  : [];
// Steps before the figures start: MLP steps take ~0.5 ms, a gpt step in wasm ~0.3 s.
const WARM_STEPS = MODEL && MODEL.startsWith('gpt') ? 3 : 20;
const LIMIT_S = Number(process.env.BENCH_TIMEOUT_S || 900);

// Progress goes to stderr: stdout is the table.
const log = (msg) => console.error(msg);
killChildrenOnExit();
deadline(LIMIT_S, () => { log(`gave up after ${LIMIT_S} s`); process.exit(1); });

/// `pid` and every process below it (Chromium's renderers, its zygotes' children).
async function descendants(pid) {
  const out = await runCapture('ps', ['-eo', 'pid=,ppid='], { check: false });
  const kids = new Map();
  for (const line of out.trim().split('\n')) {
    const [p, pp] = line.trim().split(/\s+/).map(Number);
    if (!kids.has(pp)) kids.set(pp, []);
    kids.get(pp).push(p);
  }
  const all = [pid];
  for (let i = 0; i < all.length; i++) all.push(...(kids.get(all[i]) || []));
  return all;
}

function renice(pids) {
  return runCapture('sh', ['-c',
    `for p in ${pids}; do for t in /proc/$p/task/*; do renice -n -15 -p \${t##*/} >/dev/null 2>&1; done; done`],
  { check: false });
}

const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s[Math.floor((s.length - 1) / 2)]; };

async function main() {
  for (const f of [SERVER, CHROMIUM, path.join(WEB, 'pkg/crowdgrad_worker_wasm_bg.wasm')]) {
    if (!fs.existsSync(f)) throw new Error(`missing ${f}`);
  }
  const port = await freePort();
  // The language model reads data/sentences: the default data dir (data/mnist) would get the
  // corpus fetched into it, and MNIST runs after it would load text (seen once: every test
  // then trained "mlp 65-128-256").
  const server = await startServer(port, 'bench-cores', MODEL_ARGS,
    { timeoutMs: 120_000, say: log, ...(MODEL ? { dataDir: SENTENCES } : {}) });
  const { base, status: st } = server;
  if (RENICE) await renice(String(server.pid));
  const dir = tmpDir('crowdgrad-bench-cores-');
  const browser = await openBrowser(dir);
  try {
    const n = await browser.evaluate('navigator.hardwareConcurrency');
    const ks = Array.from({ length: n }, (_, i) => i + 1);
    const half = Math.max(1, Math.floor(st.batch_size / 2));
    const context = st.task && st.task.kind === 'language' ? st.task.context : 0;
    const loopback = MODEL ? [] : [
      ...ks.map((k) => ({ name: `loopback K=${k}`, query: '?loopback=1', k })),
      { name: `loopback K=1 batch ${half}`, query: `?loopback=1&batch=${half}`, k: 1 },
    ];
    const plan = [...loopback, ...ks.map((k) => ({ name: `server K=${k}`, query: '', k }))];
    const got = new Map(plan.map((p) => [p.name, []]));
    for (let round = 0; round < ROUNDS; round++) {
      for (const p of plan) {
        await browser.send('Page.navigate', { url: `${base}/${p.query}` }, browser.session);
        await waitFor('the page and its first status', () => browser.evaluate(
          "document.readyState === 'complete' && !!window.crowdgrad && document.getElementById('run-info').textContent.startsWith('run ')"), 30_000, 100);
        await browser.evaluate(`document.getElementById('cores').value = '${p.k}'; document.getElementById('contribute').click()`);
        await waitFor(`${p.name} training`, async () => {
          const ps = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.threads.map((t) => t && t.progress))'));
          return ps.length === p.k && ps.every((x) => x && x.state === 'training' && x.steps > WARM_STEPS);
        }, MODEL ? 180_000 : 90_000, 200);
        if (RENICE) await renice((await descendants(browser.child.pid)).join(' '));
        await sleep(2_000);
        const read = async () => JSON.parse(await browser.evaluate(
          'JSON.stringify({ t: performance.now(), threads: window.crowdgrad.volunteer.threads.map((x) => x.progress) })'));
        const a = await read();
        await sleep(SECONDS * 1000);
        const b = await read();
        const samples = b.threads.reduce((s, x, i) => s + x.samples - a.threads[i].samples, 0);
        const compute = b.threads.reduce((s, x, i) => s + x.compute_s - a.threads[i].compute_s, 0);
        const steps = b.threads.reduce((s, x, i) => s + x.steps - a.threads[i].steps, 0);
        const r = { sps: (1000 * samples) / (b.t - a.t), stepMs: (1000 * compute) / Math.max(1, steps) };
        got.get(p.name).push(r);
        log(`round ${round + 1}: ${p.name}: ${r.sps.toFixed(0)} samples/s, step() ${r.stepMs.toFixed(3)} ms (load ${fs.readFileSync('/proc/loadavg', 'utf8').split(' ')[0]})`);
      }
    }
    const med = (name) => ({ sps: median(got.get(name).map((r) => r.sps)), stepMs: median(got.get(name).map((r) => r.stepMs)) });
    console.log(`\n${st.model}, batch ${st.batch_size}, ${st.shards.length} shards; ${n} cores; median of ${ROUNDS} rounds of ${SECONDS} s${RENICE ? ' (nice -15)' : ''}\n`);
    console.log(context ? '| run | samples/s | tokens/s | x K=1 | step() ms |' : '| run | samples/s | x K=1 | step() ms |');
    console.log(context ? '|---|---|---|---|---|' : '|---|---|---|---|');
    for (const p of plan) {
      const m = med(p.name);
      const ratio = p.query.startsWith('?loopback=1&') ? '–' : (m.sps / med(p.name.replace(/K=\d+/, 'K=1')).sps).toFixed(2);
      const tokens = context ? ` ${(m.sps * context).toFixed(0)} |` : '';
      console.log(`| ${p.name} | ${m.sps.toFixed(0)} |${tokens} ${ratio} | ${m.stepMs.toFixed(3)} |`);
    }
    if (MODEL) return;
    const full = med('loopback K=1');
    const halfM = med(`loopback K=1 batch ${half}`);
    console.log(`\nsplit-batch bound over 2 threads: step(${st.batch_size}) / step(${half}) = ${(full.stepMs / halfM.stepMs).toFixed(2)}x on step() alone`);
    if (n >= 2) {
      const s2 = med('loopback K=2').sps / full.sps;
      console.log(`loopback K=2 / K=1 = ${s2.toFixed(2)}x (target >= ${(0.8 * 2).toFixed(1)}x: ${s2 >= 1.6 ? 'met' : 'MISSED'})`);
    }
  } finally {
    await browser.close();
    await stopChild(server);
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

try {
  await main();
  process.exit(0);
} catch (e) {
  log(`bench-cores: ${e.message}`);
  process.exit(1);
}
