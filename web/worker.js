// The volunteer's Web Worker: load the wasm, build one Rust BrowserWorker, forward messages.
// All training, networking and timing logic is in worker-wasm (Rust).
import init, { BrowserWorker } from './pkg/crowdgrad_worker_wasm.js';

const early = [];
let worker = null;

function handle({ cmd, value }) {
  try {
    if (cmd === 'start') worker.start();
    else if (cmd === 'pause') worker.pause();
    else if (cmd === 'resume') worker.resume();
    else if (cmd === 'throttle') worker.set_throttle(value);
    else if (cmd === 'token') worker.set_join_token(String(value || ''));
    else if (cmd === 'stop') worker.stop();
  } catch (err) {
    self.postMessage({ type: 'error', message: String(err && err.message ? err.message : err) });
  }
}

// Commands sent while the wasm loads are replayed once it is ready.
self.onmessage = (e) => (worker ? handle(e.data) : early.push(e.data));

try {
  await init();
  worker = new BrowserWorker(self.location.origin, (progress) =>
    self.postMessage({ type: 'progress', progress }));
  self.postMessage({ type: 'ready' });
  early.splice(0).forEach(handle);
} catch (err) {
  self.postMessage({ type: 'error', message: String(err && err.message ? err.message : err) });
}
