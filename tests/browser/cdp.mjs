// The plain Chrome DevTools Protocol client the browser scripts share (e2e.mjs, bench-step.mjs,
// bench-cores.mjs), and the bounded waits every script uses (tls.mjs too), all of which reach
// them through harness.mjs (which also holds the processes, the server and the checks).
//
// Why not Playwright for these runs: Playwright enables the CDP Network domain on every page and
// worker, so Chromium mirrors every WebSocket frame to it as base64 and the tab loses most of
// its throughput (see e2e.mjs). `PipeBrowser` launches Debian's Chromium headless with
// `--remote-debugging-pipe` (requests on fd 3, answers on fd 4, each message NUL-terminated
// JSON), attaches to its first page and speaks only the Target, Page, Runtime and Browser
// domains: no port, nothing mirrored (page.mjs alone enables Network, on the Web Workers of
// one short phase, to see their sockets close).
//
// Every wait is bounded: a request unanswered in 15 s (or the caller's bound) is rejected,
// Chromium gets 20 s to open its first page and 5 s to exit on Browser.close before the
// caller's `stop` ends it. The Chromium process belongs to the calling script: it registers
// it with its own `track` (killed when the script exits) and ends it with its own `stop`.

import { spawn } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');

/// The browser: Debian's Chromium unless `CHROMIUM` names another binary.
export const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';

/// Headless, no sandbox (CI runs as root), nothing in the background that competes for the
/// machine or talks to the network.
export const CHROMIUM_ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

/// The default bound on one CDP request.
const ANSWER_MS = 15_000;

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/// Polls `fn` every `intervalMs` until it returns something truthy, which it returns; throws
/// after `timeoutMs`, naming `what` and the last error `fn` threw.
export async function waitFor(what, fn, timeoutMs, intervalMs = 250) {
  const end = Date.now() + timeoutMs;
  let last = null;
  while (Date.now() < end) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    await sleep(intervalMs);
  }
  throw new Error(`timed out after ${timeoutMs / 1000} s waiting for ${what}${last ? ` (last error: ${last.message})` : ''}`);
}

/// A minimal CDP client over Chromium's --remote-debugging-pipe, attached to one page
/// (`session`, flat mode): `send` any command, `evaluate` an expression in the page, `close`.
export class PipeBrowser {
  /// Launches Chromium on the profile directory `dir` and attaches to its first page.
  /// `track(child)` registers the process with the caller (to be killed when it exits) and
  /// gives it an `exited` promise; `stop(child)` ends it when Browser.close does not.
  static async launch(dir, { track, stop }) {
    const child = track(spawn(CHROMIUM, [...CHROMIUM_ARGS, `--user-data-dir=${dir}`, '--remote-debugging-pipe', 'about:blank'],
      { cwd: ROOT, stdio: ['ignore', 'ignore', 'ignore', 'pipe', 'pipe'] }));
    const b = new PipeBrowser(child, stop);
    const { targetInfos } = await waitFor('Chromium to open its first page', async () => {
      const r = await b.send('Target.getTargets');
      return r.targetInfos.some((t) => t.type === 'page') ? r : null;
    }, 20_000, 200);
    const page = targetInfos.find((t) => t.type === 'page');
    b.session = (await b.send('Target.attachToTarget', { targetId: page.targetId, flatten: true })).sessionId;
    return b;
  }

  constructor(child, stop) {
    this.child = child;
    this.stop = stop;
    this.next = 1;
    this.pending = new Map();
    this.buffer = '';
    this.listeners = new Set();
    // Writes after Chromium exits fail with EPIPE; the pending call times out instead.
    child.stdio[3].on('error', () => {});
    child.stdio[4].on('data', (chunk) => {
      this.buffer += chunk.toString('utf8');
      let end;
      while ((end = this.buffer.indexOf('\0')) >= 0) {
        const msg = JSON.parse(this.buffer.slice(0, end));
        this.buffer = this.buffer.slice(end + 1);
        // Answers carry the request's id; events (no id) go to the listeners `on` added
        // (none by default: they are dropped).
        if (!msg.id) {
          for (const f of this.listeners) f(msg);
          continue;
        }
        const p = this.pending.get(msg.id);
        if (p) {
          this.pending.delete(msg.id);
          if (msg.error) p.reject(new Error(`${p.method}: ${msg.error.message}`));
          else p.resolve(msg.result);
        }
      }
    });
  }

  /// Calls `f({ method, params, sessionId })` for every event of every domain the caller
  /// enabled (page.mjs follows Web Workers and their sockets); returns the way to stop.
  on(f) {
    this.listeners.add(f);
    return () => this.listeners.delete(f);
  }

  /// Sends `method` (to the page when `sessionId` is given, else to the browser) and resolves
  /// with its result; rejects on a CDP error or when no answer comes within `timeoutMs`.
  send(method, params = {}, sessionId = undefined, timeoutMs = ANSWER_MS) {
    const id = this.next++;
    const msg = JSON.stringify({ id, method, params, ...(sessionId ? { sessionId } : {}) });
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new Error(`${method}: no answer in ${timeoutMs / 1000} s`));
      }, timeoutMs);
      this.pending.set(id, {
        method,
        resolve: (v) => { clearTimeout(timer); resolve(v); },
        reject: (e) => { clearTimeout(timer); reject(e); },
      });
      this.child.stdio[3].write(`${msg}\0`);
    });
  }

  /// The value of `expression` in the page (awaited when it is a promise), or throws with the
  /// page's exception.
  async evaluate(expression, timeoutMs = ANSWER_MS) {
    const r = await this.send('Runtime.evaluate',
      { expression, returnByValue: true, awaitPromise: true }, this.session, timeoutMs);
    if (r.exceptionDetails) {
      const d = r.exceptionDetails;
      throw new Error((d.exception && d.exception.description) || d.text);
    }
    return r.result.value;
  }

  /// Asks Chromium to exit, gives it 5 s, then ends it with the caller's `stop`.
  async close() {
    // Chromium may exit before it answers Browser.close.
    this.send('Browser.close').catch(() => {});
    await Promise.race([this.child.exited, sleep(5_000)]);
    await this.stop(this.child);
  }
}
