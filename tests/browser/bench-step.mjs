#!/usr/bin/env node
// Browser step benchmark (issue 11): the wasm gradient step per GEMM kernel, with the first
// dense layer dense (`sparse off`) or skipping the batch's zero inputs (`sparse auto`, the
// default), against native (both ways) in the same run, per-layer shares of both models in
// wasm next to native, the MLP's loss_and_grad across batch densities (where the sparse path
// stops paying), one tab's samples/s against a server on this machine and against the
// in-memory loopback shards, and the bundle size.
//
//   cargo xtask bench-browser        (builds what it needs, then runs this script)
//   node tests/browser/bench-step.mjs [--rounds 5] [--tab-seconds 10] [--before DIR]
//
// `--before DIR` adds another commit's builds to the same rounds, for a before/after of a
// change: DIR/pkg holds that commit's web/pkg bundle (its .wasm and JS glue; copied to
// web/pkg/before to be served) and DIR/step_time, if present, its native step_time; they show
// as the build `simd128 (before)` and native `before`.
//
// Needs: web/pkg (cargo xtask build-web; web/pkg/relaxed for the relaxed-SIMD rows, web/pkg/gemm
// for the gemm crate's row: cargo xtask bench-browser builds both),
// target/release/crowdgrad, target/release/examples/step_time (native, AVX2/FMA detected at run
// time) and target/sse2/release/examples/step_time (native built with MMTEST_FEATURE=sse2:
// matrixmultiply limited to its 4-wide SSE2 kernel, the width of wasm SIMD128).
//
// Plain headless Chromium over a raw DevTools pipe with only the Runtime domain (cdp.mjs, as
// the figures phase of e2e.mjs): nothing mirrors the page's WebSocket traffic. The wasm benchmarks
// run in a dedicated module Web Worker that imports the same bundle the page uses and calls its
// `bench_step` / `bench_layers` exports (worker-wasm/src/bench.rs); native runs the same Rust
// code (examples/step_time.rs). Kernels and native builds are interleaved round by round and
// the median of the rounds is reported, because the machine is shared. A benchmark, not a
// test: it prints figures and fails only when something does not run.

import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import zlib from 'node:zlib';
import {
  CHROMIUM, ROOT, SERVER, TARGET, WEB, deadline, freePort, getStatus, killChildren, killChildrenOnExit,
  log, openBrowser, runCapture, sleep, startServer, stopChild, tmpDir, waitFor,
} from './harness.mjs';

const NATIVE = {
  avx2: path.join(TARGET, 'release/examples/step_time'),
  sse2: path.join(TARGET, 'sse2/release/examples/step_time'),
  before: null,
};
const LIMIT_S = Number(process.env.BENCH_TIMEOUT_S || 1200);

const argv = process.argv.slice(2);
const flag = (name, def) => {
  const i = argv.indexOf(name);
  return i >= 0 && argv[i + 1] !== undefined ? Number(argv[i + 1]) : def;
};
const ROUNDS = flag('--rounds', 5);
const BEFORE = (() => {
  const i = argv.indexOf('--before');
  return i >= 0 ? argv[i + 1] : null;
})();
const TAB_S = flag('--tab-seconds', 10);
// Sparse-input choices timed per kernel: `off` (dense GEMM) and `auto` (sparse when the batch is
// at most SPARSE_MAX_DENSITY nonzero: the synthetic batches are ~25%). The CNN's first layer
// is a convolution, so it runs `auto` only (the same code as `off`).
const SPARSE = ['off', 'auto'];
// Nonzero fractions for the density sweep of loss_and_grad (MNIST's pixel / 255: 0.19).
const DENSITIES = [0.1, 0.19, 0.3, 0.5, 0.7, 1.0];
// Steps per round: MLP steps take ~0.3-1 ms, CNN steps ~5-20 ms.
// The gpt (issue 20: the wasm step at most 2x the native one) steps ~0.2-1 s: few steps, and no
// per-layer run (layer_bench feeds images).
const MODELS = [
  { model: 'mlp:128', batch: 32, shards: 2, steps: 300 },
  { model: 'cnn', batch: 32, shards: 2, steps: 20 },
  { model: 'gpt', batch: 32, shards: 2, steps: 4, dense: true },
];
/// The models without a sparse first layer to choose (convolutions, embeddings) run `auto` only.
const sparseChoices = (m) => (m.model === 'cnn' || m.dense ? ['auto'] : SPARSE);

const median = (v) => {
  const s = [...v].sort((a, b) => a - b);
  return s.length ? (s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2) : NaN;
};
const kib = (n) => `${(n / 1024).toFixed(1)} KiB`;
const gzipSize = (file) => zlib.gzipSync(fs.readFileSync(file), { level: 9 }).length;

killChildrenOnExit();
deadline(LIMIT_S, () => {
  console.error(`bench-step: not done within ${LIMIT_S} s`);
  killChildren();
  process.exit(1);
});

/// Runs `jobs` in a fresh dedicated module Web Worker of the page that loads build `b`: its
/// `wasm` module (a URL under /pkg) with its JS `glue`.
async function inWorker(browser, b, jobs, timeoutMs) {
  const { wasm, glue } = b;
  const expr = `(async () => {
    const src = \`
      import init, * as w from '\${self.location.origin}${glue}';
      self.onmessage = async (e) => {
        try {
          await init({ module_or_path: self.location.origin + e.data.wasm });
          const out = [];
          for (const j of e.data.jobs) {
            out.push(JSON.parse(j.kind === 'step'
              ? w.bench_step(j.model, j.batch, j.shards, j.steps, j.kernel, j.sparse)
              : w.bench_layers(j.model, j.batch, j.steps, j.kernel, j.sparse, j.density)));
          }
          self.postMessage({ ok: true, info: JSON.parse(w.bench_info()), out });
        } catch (err) {
          self.postMessage({ ok: false, error: String(err && err.message ? err.message : err) });
        }
      };\`;
    const url = URL.createObjectURL(new Blob([src], { type: 'text/javascript' }));
    const worker = new Worker(url, { type: 'module' });
    try {
      return await new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error('bench worker: no answer')), ${timeoutMs - 1000});
        worker.onmessage = (e) => { clearTimeout(timer); resolve(e.data); };
        worker.onerror = (e) => { clearTimeout(timer); reject(new Error('bench worker: ' + e.message)); };
        worker.postMessage({ wasm: ${JSON.stringify(wasm)}, jobs: ${JSON.stringify(jobs)} });
      });
    } finally {
      worker.terminate();
      URL.revokeObjectURL(url);
    }
  })()`;
  const r = await browser.evaluate(expr, timeoutMs);
  if (!r.ok) throw new Error(`wasm benchmark failed: ${r.error}`);
  return r;
}

async function nativeRun(which, m, layers, sparse = 'auto', density = 0.19) {
  const args = ['--model', m.model, '--batch', String(m.batch), '--shards', String(m.shards),
    '--steps', String(m.steps), '--sparse', sparse];
  if (layers) args.push('--layers', '--density', String(density));
  const out = await runCapture(NATIVE[which], args);
  const json = out.split('\n').find((l) => l.startsWith('{'));
  if (!json) throw new Error(`no JSON line from ${NATIVE[which]}`);
  return JSON.parse(json);
}

const fmt = (v, d = 3) => (Number.isFinite(v) ? v.toFixed(d) : 'n/a');

async function main() {
  for (const [what, file] of [['server binary', SERVER], ['Chromium', CHROMIUM],
    ['wasm bundle (cargo xtask build-web)', path.join(WEB, 'pkg/crowdgrad_worker_wasm_bg.wasm')],
    ['native step_time (cargo build --release -p crowdgrad-worker-wasm --example step_time)', NATIVE.avx2]]) {
    if (!fs.existsSync(file)) throw new Error(`${what} missing: ${file}`);
  }
  const haveSse2 = fs.existsSync(NATIVE.sse2);
  // `glue`: the JS bindings each build is loaded with (the relaxed build shares the plain one's).
  const builds = [{ name: 'simd128', wasm: '/pkg/crowdgrad_worker_wasm_bg.wasm', glue: '/pkg/crowdgrad_worker_wasm.js' }];
  if (fs.existsSync(path.join(WEB, 'pkg/relaxed/crowdgrad_worker_wasm_bg.wasm'))) {
    builds.push({ name: 'relaxed-simd', wasm: '/pkg/relaxed/crowdgrad_worker_wasm_bg.wasm', glue: '/pkg/crowdgrad_worker_wasm.js' });
  }
  // The benchmark-only build with the gemm crate (its own glue): only its `gemm` kernel is new.
  if (fs.existsSync(path.join(WEB, 'pkg/gemm/crowdgrad_worker_wasm.js'))) {
    builds.push({ name: 'simd128+gemm-crate', wasm: '/pkg/gemm/crowdgrad_worker_wasm_bg.wasm', glue: '/pkg/gemm/crowdgrad_worker_wasm.js', only: ['gemm'] });
  }
  if (BEFORE !== null) {
    const src = path.resolve(BEFORE || '.');
    const files = ['crowdgrad_worker_wasm_bg.wasm', 'crowdgrad_worker_wasm.js'];
    for (const f of files) {
      if (!fs.existsSync(path.join(src, 'pkg', f))) throw new Error(`--before: ${path.join(src, 'pkg', f)} missing`);
    }
    const dst = path.join(WEB, 'pkg/before');
    fs.mkdirSync(dst, { recursive: true });
    for (const f of files) fs.copyFileSync(path.join(src, 'pkg', f), path.join(dst, f));
    // The page's default kernel only (and out of the density sweep, like the gemm crate's).
    builds.unshift({ name: 'simd128 (before)', wasm: '/pkg/before/crowdgrad_worker_wasm_bg.wasm', glue: '/pkg/before/crowdgrad_worker_wasm.js', only: ['loadsplat'] });
    if (fs.existsSync(path.join(src, 'step_time'))) NATIVE.before = path.join(src, 'step_time');
  }
  const natives = ['avx2', 'sse2', 'before'].filter((w) => (w === 'sse2' ? haveSse2 : w === 'before' ? !!NATIVE.before : true));
  const load = os.loadavg().map((l) => l.toFixed(1)).join(' / ');
  log(`load average ${load} on ${os.cpus().length} cores; ${ROUNDS} rounds`);

  const port = await freePort();
  const server = await startServer(port, 'bench-step');
  const { base } = server;
  const st = await getStatus(base);
  const dir = tmpDir('crowdgrad-bench-step-');
  let browser = null;
  // wasm[build][kernel][model] = [round values]; native[which][model] = [...]
  // Keys: `build/kernel` (wasm) or `avx2`/`sse2` (native), then `/sparse-choice`.
  const wasm = {};
  const wasmLoop = {};
  const native = {};
  const nativeLoop = {};
  let layersWasm = {};
  let layersNative = {};
  // sweep[key][density] = [{ median, sparse_path }...]
  const sweep = {};
  let info = null;
  let nativeMaxDensity = null;
  const tab = {};
  try {
    browser = await openBrowser(dir);
    await browser.send('Page.navigate', { url: `${base}/` }, browser.session);
    await waitFor('the page to load', () => browser.evaluate(
      "document.readyState === 'complete' && !!window.crowdgrad"), 30_000, 100);
    for (const b of builds) {
      const r = await inWorker(browser, b, [], 60_000);
      b.info = r.info;
      if (b.only) b.info.kernels = b.info.kernels.filter((k) => b.only.includes(k));
      info = info || r.info;
      log(`${b.name} build: kernels ${r.info.kernels.join(', ')} (default ${r.info.default}), relaxed ${r.info.relaxed_simd}, `
        + `sparse ${(r.info.sparse || []).join('/')} (default ${r.info.sparse_default}, max density ${r.info.sparse_max_density})`);
      if (!r.info.sparse) throw new Error(`${b.name}: this bundle has no sparse-input choice; rebuild it (cargo xtask build-web)`);
    }
    for (let round = 0; round < ROUNDS; round++) {
      for (const b of builds) {
        const jobs = [];
        for (const k of b.info.kernels) {
          for (const m of MODELS) {
            for (const sparse of sparseChoices(m)) jobs.push({ kind: 'step', kernel: k, sparse, ...m });
          }
        }
        const r = await inWorker(browser, b, jobs, 600_000);
        for (const s of r.out) {
          const key = `${b.name}/${s.kernel}/${s.sparse}`;
          ((wasm[key] ||= {})[s.model] ||= []).push(s.step_ms_mean);
          ((wasmLoop[key] ||= {})[s.model] ||= []).push(s.loopback_samples_per_sec);
        }
      }
      for (const which of natives) {
        for (const m of MODELS) {
          for (const sparse of sparseChoices(m)) {
            const n = await nativeRun(which, m, false, sparse);
            nativeMaxDensity = n.sparse_max_density ?? nativeMaxDensity;
            const key = `${which}/${sparse}`;
            ((native[key] ||= {})[m.model] ||= []).push(n.native_step_ms_mean);
            ((nativeLoop[key] ||= {})[m.model] ||= []).push(n.loopback_samples_per_sec);
          }
        }
      }
      // loss_and_grad of the MLP (default kernel of each build, median of each call) across
      // densities, sparse auto vs off: where the sparse path stops paying on each side.
      const mlp = MODELS[0];
      const sweepJobs = (kernel) => DENSITIES.flatMap((density) => SPARSE.map((sparse) => (
        { kind: 'layers', kernel, sparse, density, ...mlp, steps: mlp.steps })));
      for (const b of builds.filter((x) => !x.only)) {
        const jobs = sweepJobs(b.info.default);
        const r = await inWorker(browser, b, jobs, 600_000);
        r.out.forEach((l, i) => {
          l.density_asked = jobs[i].density;
          (((sweep[`wasm ${b.name}/${l.kernel}`] ||= {})[`${l.density_asked}/${l.sparse}`]) ||= []).push(l);
        });
      }
      for (const which of ['avx2', 'sse2']) {
        if (which === 'sse2' && !haveSse2) continue;
        for (const density of DENSITIES) {
          for (const sparse of SPARSE) {
            const l = (await nativeRun(which, mlp, true, sparse, density)).layers;
            l.density_asked = density;
            (((sweep[`native ${which}`] ||= {})[`${density}/${sparse}`]) ||= []).push(l);
          }
        }
      }
      log(`round ${round + 1}/${ROUNDS} done`);
    }
    // Per-layer times of both models, every kernel of every build, and native, on a batch of
    // MNIST's density (0.19); the MLP with the first layer dense and sparse.
    const lj = builds.flatMap((b) => b.info.kernels.map((k) => ({ b, k })));
    for (const m of MODELS.filter((x) => !x.dense)) {
      const steps = 3 * m.steps;
      const choices = m.model === 'cnn' ? ['auto'] : SPARSE;
      layersWasm[m.model] = {};
      layersNative[m.model] = {};
      for (const { b, k } of lj) {
        for (const sparse of choices) {
          const r = await inWorker(browser, b, [{ kind: 'layers', kernel: k, sparse, density: 0.19, ...m, steps }], 600_000);
          layersWasm[m.model][`${b.name}/${k}/${sparse}`] = r.out[0];
        }
      }
      for (const which of ['avx2', 'sse2']) {
        if (which === 'sse2' && !haveSse2) continue;
        for (const sparse of choices) {
          layersNative[m.model][`${which}/${sparse}`] = (await nativeRun(which, { ...m, steps }, true, sparse, 0.19)).layers;
        }
      }
    }

    // One tab with K = 1 Web Worker (the page's own, default kernel) against the server on
    // this machine, then in the page's loopback mode (`/?loopback=1`: in-memory shards in the
    // Web Worker, no server), if this page has it.
    for (const [mode, url] of [['server', `${base}/`], ['loopback', `${base}/?loopback=1`]]) {
      await browser.send('Page.navigate', { url }, browser.session);
      await sleep(500);
      await waitFor(`the ${mode} page to load`, () => browser.evaluate(
        "document.readyState === 'complete' && !!window.crowdgrad"), 30_000, 100);
      await browser.evaluate("(() => { const c = document.getElementById('cores'); if (c) c.value = '1'; "
        + "document.getElementById('contribute').click(); return true; })()");
      const ok = await waitFor(`the ${mode} tab to train`, async () => {
        const p = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
        return p && p.state === 'training' && p.steps > 0 && p.pushes_accepted > 0;
      }, 60_000, 200).catch((e) => (mode === 'loopback' ? (log(`loopback tab: ${e.message}`), false) : Promise.reject(e)));
      if (!ok) continue;
      await sleep(TAB_S * 1000);
      const p = JSON.parse(await browser.evaluate('JSON.stringify(window.crowdgrad.volunteer.progress)'));
      if (!(p.state === 'training' && p.pushes_accepted > 0)) throw new Error(`the ${mode} tab is not training: ${JSON.stringify(p)}`);
      tab[mode] = p;
    }
  } finally {
    if (browser) await browser.close();
    await stopChild(server);
    fs.rmSync(dir, { recursive: true, force: true });
  }

  // ------------------------------------------------------------------ report
  const mlpSteps = MODELS[0].steps;
  // native[`${which}/${sparse}`][model]; the CNN ran with `auto` only (its first layer is a
  // convolution: the same code as `off`).
  const nat = (which, sparse, model) => median(((native[`${which}/${model === 'cnn' ? 'auto' : sparse}`] || {})[model]) || []);
  const natLabel = { avx2: 'AVX2/FMA (run-time detected)', sse2: 'SSE2 only (MMTEST_FEATURE=sse2)' };
  console.log(`\nwasm step() vs native, median of ${ROUNDS} rounds (ms per step, mean over each round's steps); `
    + 'sparse off = the first layer as a dense GEMM, auto = skipping the batch\'s zeros when at most '
    + `${info.sparse_max_density} (wasm) / ${nativeMaxDensity} (native) of it is nonzero (these batches: ~0.25); × compares with native at the same choice, `
    + '× AVX2 dense with native AVX2 sparse off:');
  console.log('| build / kernel / sparse | MLP 784-128-10 | × AVX2 | × SSE2 | × AVX2 dense | CNN | × AVX2 | × SSE2 |');
  console.log('|---|---|---|---|---|---|---|---|');
  for (const which of ['avx2', 'sse2']) {
    for (const sparse of SPARSE) {
      if (!native[`${which}/${sparse}`]) continue;
      console.log(`| native ${natLabel[which]} / ${sparse} | ${fmt(nat(which, sparse, 'mlp:128'))} | | | | ${sparse === 'auto' ? fmt(nat(which, sparse, 'cnn')) : ''} | | |`);
    }
  }
  for (const [key, per] of Object.entries(wasm)) {
    const sparse = key.split('/').pop();
    const mlp = median(per['mlp:128'] || []);
    const cnn = median(per.cnn || []);
    const x = (v, which, s, model) => (Number.isFinite(v) && native[`${which}/${model === 'cnn' ? 'auto' : s}`] ? `${(v / nat(which, s, model)).toFixed(2)}×` : '');
    console.log(`| wasm ${key} | ${fmt(mlp)} | ${x(mlp, 'avx2', sparse, 'mlp:128')} | ${x(mlp, 'sse2', sparse, 'mlp:128')} | ${x(mlp, 'avx2', 'off', 'mlp:128')} | `
      + `${Number.isFinite(cnn) ? fmt(cnn) : ''} | ${x(cnn, 'avx2', sparse, 'cnn')} | ${x(cnn, 'sse2', sparse, 'cnn')} |`);
  }
  // The gpt (issue 20): wasm against native AVX2, both with the default first-layer choice;
  // with --before, that commit's wasm against its own native too.
  const gptNative = median(((native['avx2/auto'] || {}).gpt) || []);
  const gptBefore = median(((native['before/auto'] || {}).gpt) || []);
  console.log(`\ngpt (gpt:4,128,4,64, V = 256, batch 32 x 64 tokens): native AVX2 ${fmt(gptNative)} ms per step (${(2048 / (gptNative / 1e3)).toFixed(0)} tokens/s)`);
  if (Number.isFinite(gptBefore)) console.log(`  native AVX2 (before): ${fmt(gptBefore)} ms per step (${(2048 / (gptBefore / 1e3)).toFixed(0)} tokens/s)`);
  for (const [key, per] of Object.entries(wasm)) {
    const g = median(per.gpt || []);
    const own = key.includes('(before)') && Number.isFinite(gptBefore) ? `, ${(g / gptBefore).toFixed(2)}x native (before)` : '';
    if (Number.isFinite(g)) console.log(`  wasm ${key}: ${fmt(g)} ms per step (${(2048 / (g / 1e3)).toFixed(0)} tokens/s), ${(g / gptNative).toFixed(2)}x native${own}`);
  }
  console.log('\nsamples/s against the in-memory loopback shards (worker and shards on one thread), MLP:');
  for (const [key, per] of Object.entries(wasmLoop)) if (per['mlp:128']) console.log(`  wasm ${key}: ${median(per['mlp:128']).toFixed(0)}`);
  for (const [key, per] of Object.entries(nativeLoop)) if (per['mlp:128']) console.log(`  native ${key}: ${median(per['mlp:128']).toFixed(0)}`);

  console.log(`\nMLP loss_and_grad across batch densities (mean ms over ${mlpSteps} calls, median over ${ROUNDS} rounds; `
    + 'means, because a page\'s performance.now() is coarsened to 100 µs), sparse off vs auto '
    + `(auto goes sparse at most at the target's max density, wasm ${info.sparse_max_density}, native ${nativeMaxDensity}; * marks the sparse path):`);
  console.log(`| where | ${DENSITIES.map((d) => `${d} off | ${d} auto`).join(' | ')} |`);
  console.log(`|---|${DENSITIES.map(() => '---|---').join('|')}|`);
  for (const [key, per] of Object.entries(sweep)) {
    const cells = DENSITIES.flatMap((d) => SPARSE.map((sp) => {
      const runs = per[`${d}/${sp}`] || [];
      const v = median(runs.map((l) => l.step_ms));
      return `${fmt(v)}${runs.some((l) => l.sparse_path) ? '*' : ''}`;
    }));
    console.log(`| ${key} | ${cells.join(' | ')} |`);
  }
  console.log(`\none tab, K = 1 Web Worker (${st.model}, batch ${st.batch_size}, ${st.shards.length} shards, default kernel ${info.default}, sparse input ${info.sparse_default}, after ${TAB_S} s):`);
  for (const [mode, p] of Object.entries(tab)) {
    const where = mode === 'server' ? 'against the server on this machine' : 'page loopback mode (/?loopback=1, in-memory shards)';
    console.log(`  ${where}: ${p.samples_per_sec.toFixed(0)} samples/s; per step ${p.step_ms.toFixed(3)} ms computing + ${(p.wait_ms || 0).toFixed(3)} ms waiting`);
  }

  for (const m of MODELS.filter((x) => !x.dense)) {
    console.log(`\n${m.model} per stage: forward + backward ms per step (share of loss_and_grad), batch ${m.batch}, `
      + 'density 0.19 (MNIST\'s); step() adds the batch copy, clipping and push encoding to loss_and_grad:');
    const ln = layersNative[m.model];
    const lw = layersWasm[m.model];
    const cols = [...Object.keys(ln).map((w) => `native ${w}`), ...Object.keys(lw).map((k) => `wasm ${k}`)];
    const all = [...Object.values(ln), ...Object.values(lw)];
    console.log(`| stage | ${cols.join(' | ')} |`);
    console.log(`|---|${cols.map(() => '---').join('|')}|`);
    const cell = (l, i) => {
      const t = i < 0 ? l.loss_ms : l.forward_ms[i] + l.backward_ms[i];
      return `${fmt(t)} (${((100 * t) / l.step_ms).toFixed(1)}%)`;
    };
    all[0].names.forEach((n, i) => console.log(`| ${n} | ${all.map((l) => cell(l, i)).join(' | ')} |`));
    console.log(`| softmax + loss | ${all.map((l) => cell(l, -1)).join(' | ')} |`);
    console.log(`| **loss_and_grad** | ${all.map((l) => fmt(l.step_ms)).join(' | ')} |`);
    console.log(`| loss_and_grad, median call | ${all.map((l) => fmt(l.step_ms_median)).join(' | ')} |`);
  }

  console.log('\nbundle:');
  for (const b of builds) {
    const f = path.join(WEB, b.wasm.replace(/^\//, ''));
    console.log(`  ${b.name}: ${path.relative(ROOT, f)} ${kib(fs.statSync(f).size)} raw / ${kib(gzipSize(f))} gzip -9`);
  }
  const glue = path.join(WEB, 'pkg/crowdgrad_worker_wasm.js');
  console.log(`  JS glue: ${kib(fs.statSync(glue).size)} raw / ${kib(gzipSize(glue))} gzip -9`);
  console.log(`\nload average at the end: ${os.loadavg().map((l) => l.toFixed(1)).join(' / ')} (start ${load})`);
}

main().then(() => process.exit(0), (e) => {
  console.error(`bench-step: ${e.stack || e}`);
  killChildren();
  process.exit(1);
});
