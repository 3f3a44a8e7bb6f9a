// The volunteer's Web Worker: load the wasm, build one Rust BrowserWorker, forward messages.
// All training, networking and timing logic is in worker-wasm (Rust).
import init, { BrowserWorker } from './pkg/crowdgrad_worker_wasm.js';

// Two wasm builds share this glue: plain SIMD128 (the default, and the reproducible path) and
// relaxed SIMD (`f32x4.relaxed_madd` in the GEMM kernels, which rounds differently across
// engines and CPUs). The relaxed one is loaded only when the page asks (`worker.js?simd=relaxed`)
// and the engine validates this 40-byte module, one `f32x4.relaxed_madd` of three splats; else,
// or if it fails to load, the plain build.
const RELAXED_PROBE = new Uint8Array([0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0,
  10, 19, 1, 17, 0, 65, 1, 253, 15, 65, 2, 253, 15, 65, 3, 253, 15, 253, 133, 2, 11]);
const RELAXED_WASM = new URL('./pkg/relaxed/crowdgrad_worker_wasm_bg.wasm', import.meta.url);

async function load() {
  const asked = new URL(self.location.href).searchParams.get('simd') === 'relaxed';
  if (asked && WebAssembly.validate(RELAXED_PROBE)) {
    try {
      await init({ module_or_path: RELAXED_WASM });
      return 'relaxed-simd';
    } catch (err) {
      console.warn('crowdgrad: relaxed-SIMD build failed to load, using SIMD128', err);
    }
  }
  await init();
  return 'simd128';
}

const early = [];
let worker = null;

function handle({ cmd, value }) {
  try {
    if (cmd === 'start') worker.start();
    else if (cmd === 'pause') worker.pause();
    else if (cmd === 'resume') worker.resume();
    else if (cmd === 'throttle') worker.set_throttle(value);
    else if (cmd === 'token') worker.set_join_token(String(value || ''));
    else if (cmd === 'identity') worker.set_identity(String(value || ''));
    else if (cmd === 'stop') worker.stop();
  } catch (err) {
    self.postMessage({ type: 'error', message: String(err && err.message ? err.message : err) });
  }
}

// Commands sent while the wasm loads are replayed once it is ready.
self.onmessage = (e) => (worker ? handle(e.data) : early.push(e.data));

try {
  const simd = await load();
  worker = new BrowserWorker(self.location.origin, (progress) =>
    self.postMessage({ type: 'progress', progress }));
  self.postMessage({ type: 'ready', simd });
  early.splice(0).forEach(handle);
} catch (err) {
  self.postMessage({ type: 'error', message: String(err && err.message ? err.message : err) });
}
