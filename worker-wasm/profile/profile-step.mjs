#!/usr/bin/env node
// Where a wasm training step's time goes, per function: the page's bundle (web/pkg, or the
// build in --pkg DIR) run in Node (V8, the engine of Chromium) under V8's sampling profiler
// (the DevTools `Profiler` domain, through node:inspector), while `bench_step` times the core
// worker's step as in tests/browser/bench-step.mjs. Prints the CPU time per step, self time per
// wasm function (the model's element-wise ops and attention are kept out of line, so they have
// names: core/src/model/gpt.rs), and the GEMM's time split by the function that called it.
//
//   cargo xtask build-web
//   node worker-wasm/profile/profile-step.mjs [--model gpt] [--batch 32] [--steps 4]
//        [--kernel loadsplat] [--pkg web/pkg] [--top 25] [--no-profile]
//
// `--no-profile` only times the steps (CPU and wall), without the profiler's overhead.
//
// The native counterpart is perf over the same Rust code:
//   perf record target/release/examples/step_time --model gpt --batch 32 --shards 2 --steps 10
//   perf report --no-children --sort symbol
// A tool, not a test: figures depend on the machine and its load (CPU time per step is less
// sensitive to other processes than wall time).

import fs from 'node:fs';
import path from 'node:path';
import { Session } from 'node:inspector/promises';
import { fileURLToPath } from 'node:url';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const argv = process.argv.slice(2);
const arg = (name, def) => {
  const i = argv.indexOf(name);
  return i >= 0 && argv[i + 1] !== undefined ? argv[i + 1] : def;
};
const model = arg('--model', 'gpt');
const batch = Number(arg('--batch', 32));
const steps = Number(arg('--steps', 4));
const kernel = arg('--kernel', 'loadsplat');
const pkg = path.resolve(arg('--pkg', path.join(ROOT, 'web/pkg')));
const top = Number(arg('--top', 25));
const profiling = !argv.includes('--no-profile');
if (!(batch > 0 && steps > 0 && steps <= 1000 && top > 0)) {
  console.error('profile-step: --batch, --steps (at most 1000) and --top must be positive');
  process.exit(2);
}
const wasmFile = path.join(pkg, 'crowdgrad_worker_wasm_bg.wasm');
if (!fs.existsSync(wasmFile)) {
  console.error(`profile-step: ${wasmFile} missing (cargo xtask build-web)`);
  process.exit(2);
}

// The bench exports take their clock from a Web Worker's `performance`: Node's global has one.
globalThis.WorkerGlobalScope = class { static [Symbol.hasInstance]() { return true; } };
const w = await import(path.join(pkg, 'crowdgrad_worker_wasm.js'));
w.initSync({ module: fs.readFileSync(wasmFile) });

const session = new Session();
if (profiling) {
  session.connect();
  await session.post('Profiler.enable');
  await session.post('Profiler.setSamplingInterval', { interval: 200 });
  await session.post('Profiler.start');
}
const cpu0 = process.cpuUsage();
// bench_step runs 20 warm-up steps before the timed ones (worker-wasm/src/bench.rs).
const result = JSON.parse(w.bench_step(model, batch, 2, steps, kernel, 'auto'));
const cpu = process.cpuUsage(cpu0);
const cpuStepMs = (cpu.user + cpu.system) / 1000 / (20 + steps);
console.log(`${model}, batch ${batch}, kernel ${kernel}, ${pkg}`);
console.log(`step() wall median ${result.step_ms_median.toFixed(1)} ms; CPU ${cpuStepMs.toFixed(1)} ms per step (${20 + steps} steps with the warm-up)`);
if (!profiling) process.exit(0);
const { profile } = await session.post('Profiler.stop');
session.disconnect();

const byId = new Map(profile.nodes.map((n) => [n.id, n]));
const parent = new Map();
for (const n of profile.nodes) for (const c of n.children || []) parent.set(c, n.id);
const selfUs = new Map();
profile.samples.forEach((id, i) => selfUs.set(id, (selfUs.get(id) || 0) + (profile.timeDeltas[i] || 0)));
const clean = (name) => (name || '(anonymous)').replace(/::h[0-9a-f]{16}$/, '').replace(/\[[0-9a-f]+\]/g, '');
const fnSelf = new Map();
const gemmBy = new Map();
let total = 0;
for (const [id, us] of selfUs) {
  const name = clean(byId.get(id).callFrame.functionName);
  total += us;
  fnSelf.set(name, (fnSelf.get(name) || 0) + us);
  if (name.endsWith('model::gemm::gemm')) {
    const p = byId.get(parent.get(id));
    const caller = p ? clean(p.callFrame.functionName) : '?';
    gemmBy.set(caller, (gemmBy.get(caller) || 0) + us);
  }
}
// The profiler's samples are wall time (a loaded machine stretches them all alike): a
// function's share of the samples times the CPU time per step.
const perStep = (us) => ((us / total) * cpuStepMs).toFixed(2).padStart(8);
const share = (us) => `${((100 * us) / total).toFixed(1).padStart(5)}%`;
console.log('\n| share | CPU ms per step | function (self time) |\n|---|---|---|');
for (const [name, us] of [...fnSelf].sort((a, b) => b[1] - a[1]).slice(0, top)) {
  console.log(`| ${share(us)} | ${perStep(us)} | ${name} |`);
}
console.log('\n| share | CPU ms per step | GEMM called from |\n|---|---|---|');
for (const [name, us] of [...gemmBy].sort((a, b) => b[1] - a[1])) {
  console.log(`| ${share(us)} | ${perStep(us)} | ${name} |`);
}
