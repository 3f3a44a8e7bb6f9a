// Classroom mode (`?view=present`, or the Present button): the figure in big type, one large
// chart, volunteers online, samples/s, the join link with its QR code, the model's guesses on
// test images, and the teacher's controls behind the admin token. The token is typed into the
// page and kept in this module's memory only: never in the URL, never in storage.
import { encode } from './vendor/uqr.mjs';
import { $, num, pct } from './fmt.js';

let adminToken = '';
let guessTimer = null;
let hasGuesses = true;

export function presenting() {
  return document.body.dataset.view === 'present';
}

// The link a class opens: this page without its view, with the join token in the fragment
// when this page was opened with one (a private run; the fragment never reaches a server log).
export function joinUrl(token) {
  const u = new URL('/', location.href);
  if (token) u.hash = `token=${encodeURIComponent(token)}`;
  return u.href;
}

// Draws the QR code of `text` on the canvas, 4 modules of quiet zone, black on white.
export function drawQr(canvas, text) {
  const qr = encode(text, { ecc: 'M', border: 4 });
  const n = qr.size;
  const scale = Math.max(2, Math.floor(canvas.width / n));
  canvas.width = n * scale;
  canvas.height = n * scale;
  const g = canvas.getContext('2d');
  g.fillStyle = '#fff';
  g.fillRect(0, 0, canvas.width, canvas.height);
  g.fillStyle = '#000';
  for (let y = 0; y < n; y++) {
    for (let x = 0; x < n; x++) if (qr.data[y][x]) g.fillRect(x * scale, y * scale, scale, scale);
  }
}

export function setView(present, { push = true } = {}) {
  document.body.dataset.view = present ? 'present' : 'page';
  $('present').hidden = !present;
  $('present-toggle').setAttribute('aria-pressed', String(present));
  $('present-toggle').textContent = present ? 'Back to the full page' : 'Present';
  if (push) {
    const u = new URL(location.href);
    if (present) u.searchParams.set('view', 'present');
    else u.searchParams.delete('view');
    history.replaceState(null, '', u.pathname + u.search);
  }
  if (present) startGuesses();
  else stopGuesses();
}

export function renderPresent(st, language) {
  const ev = st.eval;
  if (language) {
    $('p-accuracy').textContent = ev && ev.bits_per_token != null ? ev.bits_per_token.toFixed(3) : '–';
    $('p-accuracy-label').textContent = `bits per ${language.level === 'bytes' ? 'byte' : 'character'} (lower is better)`;
  } else {
    $('p-accuracy').textContent = ev ? pct(ev.accuracy).replace(/\.\d+%$/, (m) => `${m.slice(0, 2)}%`) : '–';
    $('p-accuracy-label').textContent = 'test accuracy';
  }
  const t = st.totals || {};
  const vols = t.workers && t.workers.volunteers;
  const online = vols ? vols.connected : st.workers_connected;
  $('p-volunteers').textContent = num(online);
  $('p-volunteers-label').textContent = online === 1 ? 'volunteer online' : 'volunteers online';
  $('p-rate').textContent = num(t.samples_per_sec);
  $('p-mode').textContent = st.consistency ? `consistency ${st.consistency}` : '';
}

// ---------------------------------------------------------------- the model's guesses

async function loadGuesses() {
  if (!hasGuesses || document.hidden) return;
  try {
    const r = await fetch('/api/guesses');
    if (r.status === 404) {
      hasGuesses = false;
      return;
    }
    if (!r.ok) return;
    const g = await r.json();
    $('guesses-box').hidden = !(g.images && g.images.length);
    $('guesses').replaceChildren(...(g.images || []).map((im) => {
      const li = document.createElement('li');
      const c = document.createElement('canvas');
      c.width = im.width || 28;
      c.height = im.height || 28;
      const px = Uint8Array.from(atob(im.pixels || ''), (ch) => ch.charCodeAt(0));
      const img = c.getContext('2d').createImageData(c.width, c.height);
      for (let i = 0; i < c.width * c.height; i++) {
        const v = px[i] || 0;
        img.data.set([v, v, v, 255], 4 * i);
      }
      c.getContext('2d').putImageData(img, 0, 0);
      const right = String(im.guess) === String(im.label);
      c.setAttribute('role', 'img');
      c.setAttribute('aria-label', `a test image of a ${im.label}`);
      const cap = document.createElement('span');
      cap.className = right ? 'right' : 'wrong';
      cap.textContent = `${right ? '✓' : '✗'} ${im.guess} (${Math.round(100 * (im.confidence || 0))}%)`;
      const truth = document.createElement('span');
      truth.className = 'hint';
      truth.textContent = right ? '' : ` is ${im.label}`;
      li.append(c, cap, truth);
      return li;
    }));
  } catch {
    // The next poll tries again.
  }
}

// Only image classifiers have guesses; the server says 404 otherwise (then never again).
function startGuesses() {
  if (guessTimer || !guessesWanted) return;
  loadGuesses();
  guessTimer = setInterval(loadGuesses, 4_000);
}
function stopGuesses() {
  clearInterval(guessTimer);
  guessTimer = null;
}
let guessesWanted = false;
export function wantGuesses(yes) {
  guessesWanted = yes;
  if (!yes) {
    stopGuesses();
    $('guesses-box').hidden = true;
  } else if (presenting()) startGuesses();
}

// ---------------------------------------------------------------- teacher controls

async function admin(path, body) {
  const out = $('admin-result');
  if (!adminToken) {
    out.textContent = 'Type the admin token first.';
    return null;
  }
  out.textContent = 'Sending…';
  try {
    const r = await fetch(path, {
      method: 'POST',
      headers: { Authorization: `Bearer ${adminToken}`, ...(body ? { 'Content-Type': 'application/json' } : {}) },
      body: body ? JSON.stringify(body) : undefined,
    });
    const text = await r.text();
    let j = null;
    try { j = JSON.parse(text); } catch { j = null; }
    if (r.status === 404) out.textContent = 'This server does not offer that control.';
    else if (!r.ok) out.textContent = `Refused (${r.status}): ${(j && j.error) || text}`;
    else out.textContent = `Done: ${path.replace('/api/admin/', '')}.`;
    return r.ok ? (j || {}) : null;
  } catch (e) {
    out.textContent = `Could not reach the server: ${e.message}`;
    return null;
  }
}

export function renderDemoWorkers(workers) {
  const sel = $('demo-worker');
  const ids = workers.filter((w) => w.connected).map((w) => String(w.id));
  const now = [...sel.options].map((o) => o.value);
  if (ids.join(',') === now.join(',')) return;
  const keep = sel.value;
  sel.replaceChildren(...ids.map((id) => {
    const o = document.createElement('option');
    o.value = id;
    o.textContent = `worker ${id}`;
    return o;
  }));
  if (ids.includes(keep)) sel.value = keep;
}

export function renderExperiments(experiments, current, onExport) {
  const ul = $('experiments');
  if (!experiments.length) return;
  const key = experiments.map((e) => `${e.id}:${e.points.length > 0}`).join(',') + current;
  if (ul.dataset.key === key) return;
  ul.dataset.key = key;
  ul.replaceChildren(...experiments.map((e) => {
    const li = document.createElement('li');
    const s = e.settings || {};
    li.textContent = `${e.label || `experiment ${e.id}`}${e.id === current ? ' (now)' : ''}: `
      + `${[s.consistency, s.lr != null && `lr ${Number(Number(s.lr).toPrecision(6))}`, s.aggregation, s.model].filter(Boolean).join(', ')} `;
    const b = document.createElement('button');
    b.type = 'button';
    b.className = 'small';
    b.textContent = 'Export CSV';
    b.addEventListener('click', () => onExport(e));
    li.append(b);
    if (e.sim_command) {
      const code = document.createElement('code');
      code.textContent = e.sim_command;
      li.append(document.createElement('br'), code);
    }
    return li;
  }));
}

export function initPresent({ token, onToggle }) {
  $('admin-token').addEventListener('input', (e) => { adminToken = e.target.value.trim(); });
  $('present-toggle').addEventListener('click', () => {
    setView(!presenting());
    onToggle();
  });
  $('admin-pause').addEventListener('click', () => admin('/api/admin/pause'));
  $('admin-resume').addEventListener('click', () => admin('/api/admin/resume'));
  $('admin-set-consistency').addEventListener('click', () => {
    const c = $('admin-consistency').value.trim();
    if (c) admin('/api/admin/set-consistency', { consistency: c });
  });
  $('admin-set-lr').addEventListener('click', () => {
    const lr = Number($('admin-lr').value);
    if (Number.isFinite(lr) && lr > 0) admin('/api/admin/set-lr', { lr });
    else $('admin-result').textContent = 'The learning rate must be a positive number.';
  });
  const demo = (clear) => {
    const worker = Number($('demo-worker').value);
    if (!Number.isInteger(worker)) {
      $('admin-result').textContent = 'No worker online to choose.';
      return;
    }
    const delay = Number($('demo-delay').value);
    admin('/api/admin/demo', {
      worker,
      delay_ms: clear || !(delay > 0) ? null : delay,
      fault: clear || !$('demo-fault').value ? null : $('demo-fault').value,
    });
  };
  $('demo-apply').addEventListener('click', () => demo(false));
  $('demo-clear').addEventListener('click', () => demo(true));
  $('exp-start').addEventListener('click', () => {
    const body = { label: $('exp-label').value.trim() || `experiment at ${new Date().toLocaleTimeString()}` };
    const c = $('exp-consistency').value.trim();
    const lr = Number($('exp-lr').value);
    const a = $('exp-aggregation').value.trim();
    if (c) body.consistency = c;
    if ($('exp-lr').value && Number.isFinite(lr) && lr > 0) body.lr = lr;
    if (a) body.aggregation = a;
    admin('/api/admin/experiment', body);
  });
  // A private run's token is in the QR code's pixels only: never in the page's text or
  // attributes (the link shown and its href go without it).
  const plain = joinUrl('');
  $('join-url').href = plain;
  $('join-url').textContent = plain;
  $('qr').setAttribute('aria-label', `QR code of the join link ${plain}${token ? ', with the run\'s join token' : ''}`);
  if (token) $('join-url').after(document.createTextNode(' (the QR code carries the join token)'));
  drawQr($('qr'), joinUrl(token));
  setView(new URLSearchParams(location.search).get('view') === 'present', { push: false });
}
