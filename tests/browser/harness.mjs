// The one harness the browser scripts share (e2e.mjs, tls.mjs, bench-cores.mjs, bench-step.mjs),
// beside cdp.mjs (the DevTools client): where the binaries are (honouring CARGO_TARGET_DIR),
// the child processes a script owns (tracked, stopped with SIGTERM then SIGKILL, all killed when
// the script exits or is interrupted), a `crowdgrad serve` started and waited for, Chromium over
// the DevTools pipe, the bounded waits, and the `ok`/`FAIL` checks whose closing line
// `N passed, M failed` is what `cargo xtask test` counts (xtask's `parse_counts`).
//
// Like tests/integration/util.rs for the Rust tests: `scaffolding.rs` fails when another
// script in this directory starts processes itself or finds the binary on its own.

import { spawn } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { PipeBrowser, sleep, waitFor } from './cdp.mjs';

export { CHROMIUM, CHROMIUM_ARGS, PipeBrowser, sleep, waitFor } from './cdp.mjs';

// ------------------------------------------------------------------ paths

/// The workspace root.
export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
/// Cargo's target directory: CARGO_TARGET_DIR (relative to the root, as cargo reads it) or
/// target/.
export const TARGET = process.env.CARGO_TARGET_DIR
  ? path.resolve(ROOT, process.env.CARGO_TARGET_DIR)
  : path.join(ROOT, 'target');
/// The release `crowdgrad` binary, unless CROWDGRAD_BIN names another.
export const SERVER = process.env.CROWDGRAD_BIN || path.join(TARGET, 'release/crowdgrad');
export const WEB = path.join(ROOT, 'web');
export const DATA = path.join(ROOT, 'data/mnist');
/// The sentences corpus (`crowdgrad data fetch --dataset sentences`), for the language model.
export const SENTENCES = path.join(ROOT, 'data/sentences');
/// Logs, screenshots: target/browser.
export const OUT = path.join(TARGET, 'browser');

/// A fresh directory under the system's temporary directory (a browser profile, a checkpoint
/// directory); the caller removes it.
export const tmpDir = (prefix) => fs.mkdtempSync(path.join(os.tmpdir(), prefix));

// ------------------------------------------------------------------ logging

const started = Date.now();
/// Seconds since the script started, as `12.3s`.
export const since = () => `${((Date.now() - started) / 1000).toFixed(1)}s`;
/// A line on stdout, stamped with `since()`.
export const log = (msg) => console.log(`[${since()}] ${msg}`);

// ------------------------------------------------------------------ child processes

const children = new Set();

/// Registers `child` (killed when the script exits) and gives it an `exited` promise of
/// `{ code, signal }`.
export function track(child) {
  children.add(child);
  child.exited = new Promise((r) => child.on('exit', (code, signal) => {
    children.delete(child);
    r({ code, signal });
  }));
  return child;
}

/// SIGKILLs every tracked child still running.
export function killChildren() {
  for (const c of children) {
    try { c.kill('SIGKILL'); } catch { /* already gone */ }
  }
  children.clear();
}

/// Kills every tracked child when the script exits, and on SIGINT / SIGTERM (then exits 130).
export function killChildrenOnExit() {
  process.on('exit', killChildren);
  for (const sig of ['SIGINT', 'SIGTERM']) {
    process.on(sig, () => { killChildren(); process.exit(130); });
  }
}

/// Calls `onTimeout` once `limitS` seconds have passed (the timer does not keep the script
/// alive).
export function deadline(limitS, onTimeout) {
  setTimeout(onTimeout, limitS * 1000).unref();
}

/// Starts `cmd args` from the root, tracked, with stdout and stderr in OUT/`name`.log
/// (`child.logFile`); `env` is added to this process's environment.
export function spawnLogged(name, cmd, args, { env } = {}) {
  fs.mkdirSync(OUT, { recursive: true });
  const file = path.join(OUT, `${name}.log`);
  const fd = fs.openSync(file, 'w');
  const child = track(spawn(cmd, args, {
    cwd: ROOT, stdio: ['ignore', fd, fd], ...(env ? { env: { ...process.env, ...env } } : {}),
  }));
  fs.closeSync(fd);
  child.logFile = file;
  return child;
}

/// Asks `child` to stop (SIGTERM), gives it 10 s, then kills it and waits for it. Logs when
/// it had to kill, naming it `what` (when given).
export async function stopChild(child, what = null) {
  if (!child || child.exitCode !== null || child.signalCode !== null) return;
  child.kill('SIGTERM');
  const r = await Promise.race([child.exited, sleep(10_000).then(() => null)]);
  if (!r) {
    if (what) log(`${what} ignored SIGTERM for 10 s; killing it`);
    child.kill('SIGKILL');
    await child.exited;
  }
}

/// Runs `cmd args` to completion (tracked, killed after `timeoutMs`) and resolves with its
/// stdout. With `check` (the default) it rejects, with its stderr, unless it exits 0; without,
/// its stderr goes to ours and whatever it printed is the answer.
export function runCapture(cmd, args, { timeoutMs = 300_000, check = true } = {}) {
  return new Promise((resolve, reject) => {
    const child = track(spawn(cmd, args, { cwd: ROOT, stdio: ['ignore', 'pipe', check ? 'pipe' : 'inherit'] }));
    let out = '';
    let err = '';
    child.stdout.on('data', (d) => { out += d; });
    if (check) child.stderr.on('data', (d) => { err += d; });
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    child.on('exit', (code, signal) => {
      clearTimeout(timer);
      if (code === 0 || !check) resolve(out);
      else reject(new Error(`${path.relative(ROOT, cmd)} ${args.join(' ')} exited with ${signal || code}: ${err.trim()}`));
    });
  });
}

// ------------------------------------------------------------------ the server

/// A TCP port free on 127.0.0.1 a moment ago.
export function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.unref();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

/// `/api/status` of the server at `base` (3 s at most).
export async function getStatus(base) {
  const r = await fetch(`${base}/api/status`, { signal: AbortSignal.timeout(3_000) });
  if (!r.ok) throw new Error(`/api/status answered ${r.status}`);
  return r.json();
}

/// Starts `crowdgrad serve` on 127.0.0.1:`port` over MNIST and the web directory, with `args`
/// after the defaults, logging to OUT/server-`tag`.log, and waits (`timeoutMs`) until it answers
/// /api/status. Returns the child, with `base` (its URL, `scheme` http or https) and `status`
/// (that first answer). `say` gets its up and exit lines (default: `log`).
export async function startServer(port, tag, args = [], { scheme = 'http', env, timeoutMs = 180_000, say = log, dataDir = DATA } = {}) {
  const base = `${scheme}://127.0.0.1:${port}`;
  const child = spawnLogged(`server-${tag}`, SERVER,
    ['serve', '--addr', `127.0.0.1:${port}`, '--data-dir', dataDir, '--web-dir', WEB, ...args], { env });
  child.on('exit', (code, signal) => say(`server ${tag} exited (${signal || code})`));
  // Generous by default: on a first run the server fetches MNIST itself.
  child.status = await waitFor(`server ${tag} to answer /api/status`, async () => {
    if (child.exitCode !== null) throw new Error(`server exited with ${child.exitCode}; see ${child.logFile}`);
    return getStatus(base);
  }, timeoutMs, 200);
  child.base = base;
  say(`server ${tag} up at ${base}`);
  return child;
}

// ------------------------------------------------------------------ Chromium

/// Headless Chromium over the DevTools pipe (cdp.mjs) on the profile directory `dir`, a
/// tracked child of this script.
export function openBrowser(dir) {
  return PipeBrowser.launch(dir, { track, stop: (child) => stopChild(child, 'pipe browser') });
}

// ------------------------------------------------------------------ results

/// Every check so far: `{ name, ok }`.
export const results = [];

/// Records a check and prints `ok  NAME (detail)` or `FAIL NAME (detail)`; returns `ok`.
export function check(name, ok, detail = '') {
  results.push({ name, ok: !!ok });
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${name}${detail ? ` (${detail})` : ''}`);
  return !!ok;
}

/// Prints `N passed, M failed` (the line xtask counts) and exits: 0 when at least one check
/// ran, none failed and `code` is 0; else 1.
export function finish(code = 0) {
  const passed = results.filter((r) => r.ok).length;
  const failed = results.length - passed;
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed > 0 || code !== 0 || results.length === 0 ? 1 : 0);
}
