#!/usr/bin/env node
// Browser test, TLS and a private run: the release server serves https/wss directly
// (`--tls-cert/--tls-key`, a self-signed certificate made here with openssl) and requires a
// join token; a headless Chromium tab (playwright-core driving /usr/bin/chromium, told to accept
// the test certificate) opens the page with `#token=...`, clicks Contribute and trains over wss.
// A second tab without the token is refused (401) and never trains. The token never shows up
// in the page or the status.
//
//   node tests/browser/tls.mjs     (after `cargo xtask build-web` and a release build;
//                                   `cargo xtask test` runs it after e2e.mjs)
//
// Everything binds 127.0.0.1, every wait is bounded (TLS_TIMEOUT_S, default 240), child
// processes are killed on exit, and the last line is `N passed, M failed`.

import fs from 'node:fs';
import path from 'node:path';
import { chromium } from 'playwright-core';
import {
  CHROMIUM, OUT, check, deadline, finish, freePort, getStatus, killChildren, killChildrenOnExit,
  runCapture, sleep, startServer, tmpDir, waitFor,
} from './harness.mjs';

// Only this test's own status requests go to the self-signed server.
process.env.NODE_TLS_REJECT_UNAUTHORIZED = '0';

const LIMIT_S = Number(process.env.TLS_TIMEOUT_S || 240);
const TOKEN = 'tls-e2e-Vq3k9';

let context = null;
let tmp = null;

async function cleanup() {
  if (context) await Promise.race([context.close().catch(() => {}), sleep(10_000)]);
  killChildren();
  if (tmp) fs.rmSync(tmp, { recursive: true, force: true });
}

killChildrenOnExit();
deadline(LIMIT_S, async () => {
  check(`whole test within ${LIMIT_S} s`, false);
  await cleanup();
  finish();
});

async function main() {
  fs.mkdirSync(OUT, { recursive: true });
  tmp = tmpDir('crowdgrad-tls-');
  const cert = path.join(tmp, 'cert.pem');
  const key = path.join(tmp, 'key.pem');
  await runCapture('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256',
    '-nodes', '-days', '2', '-subj', '/CN=localhost',
    '-addext', 'subjectAltName=IP:127.0.0.1,DNS:localhost', '-keyout', key, '-out', cert]);

  const port = await freePort();
  const server = await startServer(port, 'tls', ['--model', 'softmax', '--tls-cert', cert, '--tls-key', key],
    { scheme: 'https', env: { CROWDGRAD_JOIN_TOKEN: TOKEN }, timeoutMs: 120_000 });
  const { base } = server;

  tmp && fs.mkdirSync(path.join(tmp, 'profile'));
  context = await chromium.launchPersistentContext(path.join(tmp, 'profile'), {
    executablePath: CHROMIUM,
    headless: true,
    ignoreHTTPSErrors: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
      '--ignore-certificate-errors', '--disable-background-networking'],
  });
  const page = context.pages()[0] || await context.newPage();
  await page.goto(`${base}/#token=${TOKEN}`, { waitUntil: 'load', timeout: 60_000 });
  check('the token is taken off the address bar', !page.url().includes(TOKEN), page.url());
  await page.getByRole('button', { name: 'Contribute' }).click({ timeout: 30_000 });
  const accepted = await waitFor('an accepted push from the tab over wss', async () => {
    const n = Number(((await page.locator('#my-accepted').textContent()) || '').replace(/[^0-9]/g, '') || 0);
    return n > 20 ? n : null;
  }, 90_000, 200);
  check('a tab trains over https/wss in a private run', accepted > 20, `${accepted} accepted`);

  // Without the token: the join is refused, nothing trains.
  const other = await context.newPage();
  await other.goto(`${base}/`, { waitUntil: 'load', timeout: 60_000 });
  await other.getByRole('button', { name: 'Contribute' }).click({ timeout: 30_000 });
  const refused = await waitFor('the tokenless tab to report the refusal', async () => {
    const p = await other.evaluate(() => window.crowdgrad && window.crowdgrad.volunteer.progress);
    return p && p.error && /401/.test(p.error) ? p.error : null;
  }, 30_000, 200).catch((e) => e.message);
  check('a tab without the token is refused with 401', /401/.test(refused), refused);
  const fieldShown = await other.locator('#join-token-label').isVisible();
  check('the page offers a token field for a private run', fieldShown);

  const s = await getStatus(base);
  const browsers = s.totals.workers.browser;
  check('exactly one browser worker registered', browsers.registered === 1, JSON.stringify(browsers));
  check('the refused join is counted', s.limits.joins_unauthorized >= 1, JSON.stringify(s.limits));
  const html = await page.content();
  check('no token in the page or the status', !html.includes(TOKEN) && !JSON.stringify(s).includes(TOKEN));
  await page.screenshot({ path: path.join(OUT, 'tls.png') });

  server.kill('SIGTERM');
  const stopped = await Promise.race([new Promise((r) => server.on('exit', () => r(true))), sleep(10_000)]);
  check('the server stops on SIGTERM', stopped === true);
}

main()
  .catch((e) => check('tls browser test ran', false, e.stack || String(e)))
  .finally(async () => {
    await cleanup();
    finish();
  });
