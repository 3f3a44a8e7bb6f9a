// The run's charts (uPlot): the evaluation chart (wall-clock time or samples on x; auto, fixed
// or log error-rate y; smoothing; a zoom that stays across updates; earlier experiments
// overlaid on the samples axis), the small multiples of the run over time, and their text
// summaries. Colours differ in luminance and every line has its own dash, so they stay apart
// on a projector and in greyscale.
import uPlot from './vendor/uPlot.esm.js';
import { $, bytes, clock, compact, num, pct } from './fmt.js';

// Dark navy solid for accuracy, a light orange dashed line for the loss; earlier experiments
// in greys and dash patterns of their own.
export const ACC = '#1b3a6b';
export const LOSS = '#c45f00';
const OLD = [
  { stroke: '#6b6b6b', dash: [10, 5] },
  { stroke: '#2f8f6f', dash: [3, 4] },
  { stroke: '#8e3b8e', dash: [14, 4, 3, 4] },
  { stroke: '#999999', dash: [2, 2] },
];
const AXIS = { stroke: '#3d4452', grid: { stroke: '#e4e2dc' }, ticks: { stroke: '#c9c6bd' } };

// What the chart shows; `zoom` is the user's x range, kept across updates until reset.
const view = { x: 'time', y: 'auto', smooth: 0, zoom: null, language: null };

// ---------------------------------------------------------------- evaluation chart

// An exponential moving average over `ys` (null stays null), weight `s` on the past.
function smooth(ys, s) {
  if (!s) return ys;
  let m = null;
  return ys.map((y) => {
    if (y == null || !Number.isFinite(y)) return y;
    m = m == null ? y : s * m + (1 - s) * y;
    return m;
  });
}

// The model does not change while nothing trains: an evaluation after an idle stretch is
// preceded by a hold of the previous value, so the line is flat across the gap, not a slope
// from the old value to the new one.
// `gapMs` is what counts as idle, `leadMs` how long before the next point training may have
// begun (about one evaluation interval).
function withHolds(points, gapMs, leadMs) {
  const out = [];
  for (const p of points) {
    const prev = out[out.length - 1];
    if (prev && p.t_ms - prev.t_ms > gapMs) out.push({ ...prev, t_ms: p.t_ms - leadMs, hold: true });
    out.push(p);
  }
  return out;
}

const accOf = (p) => (p.accuracy == null ? null : p.accuracy);
const secondOf = (p) => (view.language ? (p.bits_per_token == null ? null : p.bits_per_token) : p.loss);

export class EvalChart {
  constructor(box, { height = 280, big = false } = {}) {
    this.box = box;
    this.height = height;
    this.big = big;
    this.u = null;
    this.shape = null;
    new ResizeObserver(() => {
      const w = Math.max(280, this.box.clientWidth);
      if (this.u && Math.abs(this.u.width - w) > 2) this.u.setSize({ width: w, height: this.height });
    }).observe(box);
  }

  // Builds the uPlot for `shape` (axis kind, y kind, the experiments overlaid).
  build(shape, series) {
    if (this.u) this.u.destroy();
    this.box.replaceChildren();
    this.shape = shape;
    const time = view.x === 'time';
    const font = this.big ? '16px system-ui' : '12px system-ui';
    const log = view.y === 'log';
    const accScale = log
      ? { distr: 3, auto: true }
      : view.y === 'fixed' ? { auto: false, range: [0, 1] }
        : { auto: true, range: (u, min, max) => [Math.max(0, min - 0.02), Math.min(1, max + 0.02)] };
    const accLabel = log ? 'error rate (log)' : (view.language ? 'next-token accuracy' : 'accuracy');
    const opts = {
      width: Math.max(280, this.box.clientWidth),
      height: this.height,
      scales: { x: { time }, acc: accScale, loss: { auto: true } },
      axes: [
        { ...AXIS, font, label: time ? 'time' : 'samples', labelFont: font, values: time ? undefined : (u, vs) => vs.map((v) => (v == null ? '' : num(v))) },
        { ...AXIS, font, labelFont: font, scale: 'acc', label: accLabel, stroke: ACC, values: (u, vs) => vs.map((v) => (v == null ? '' : log ? `${+(100 * v).toPrecision(2)}%` : `${Math.round(v * 100)}%`)), size: 56 },
        { ...AXIS, font, labelFont: font, scale: 'loss', label: view.language ? 'bits per token' : 'loss', side: 1, grid: { show: false }, stroke: LOSS },
      ],
      series: [{ label: time ? 'time' : 'samples', value: time ? (u, v) => (v == null ? '' : clock(v * 1000)) : (u, v) => num(v) }, ...series],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      hooks: {
        setSelect: [(u) => {
          if (u.select.width > 2) {
            view.zoom = { min: u.posToVal(u.select.left, 'x'), max: u.posToVal(u.select.left + u.select.width, 'x') };
            $('zoom-reset').hidden = false;
          }
        }],
        ready: [(u) => u.over.addEventListener('dblclick', () => resetZoom())],
      },
    };
    this.u = new uPlot(opts, [[]], this.box);
  }

  // experiments: [{id, label, points: [{t_ms, samples, accuracy, loss, bits_per_token}]}],
  // the last is the current one.
  update(experiments, gapMs, leadMs) {
    const current = experiments[experiments.length - 1];
    if (!current) return;
    const log = view.y === 'log';
    const acc = (p) => {
      const a = accOf(p);
      if (a == null) return null;
      return log ? Math.max(1e-4, 1 - a) : a;
    };
    const width = this.big ? 4 : 2;
    let data;
    let series;
    if (view.x === 'time') {
      const pts = withHolds(current.points, gapMs, leadMs);
      series = [
        { label: log ? 'error rate' : (view.language ? 'next-token accuracy' : 'test accuracy'), scale: 'acc', stroke: ACC, width, value: (u, v) => pct(v) },
        { label: view.language ? 'bits/token' : 'test loss', scale: 'loss', stroke: LOSS, width, dash: [8, 5], value: (u, v) => (v == null ? '–' : v.toFixed(4)) },
      ];
      data = [pts.map((p) => p.t_ms / 1000), smooth(pts.map(acc), view.smooth), smooth(pts.map(secondOf), view.smooth)];
    } else {
      // Samples on x: every experiment's accuracy (earlier ones dashed), the current loss.
      const tables = experiments.map((e) => [e.points.map((p) => p.samples), smooth(e.points.map(acc), view.smooth)]);
      tables.push([current.points.map((p) => p.samples), smooth(current.points.map(secondOf), view.smooth)]);
      data = uPlot.join(tables.map((t) => {
        // uPlot.join needs ascending, distinct x.
        const seen = new Map();
        t[0].forEach((x, i) => seen.set(x, t[1][i]));
        const xs = [...seen.keys()].sort((a, b) => a - b);
        return [xs, xs.map((x) => seen.get(x))];
      }));
      series = experiments.map((e, i) => {
        const last = i === experiments.length - 1;
        const style = last ? { stroke: ACC, width } : { ...OLD[i % OLD.length], width: width - 0.5 };
        return { label: `${e.label || `experiment ${e.id}`}${last ? '' : ''}`, scale: 'acc', spanGaps: true, ...style, value: (u, v) => pct(v) };
      });
      series.push({ label: `${current.label || 'current'}: ${view.language ? 'bits/token' : 'loss'}`, scale: 'loss', spanGaps: true, stroke: LOSS, width, dash: [8, 5], value: (u, v) => (v == null ? '–' : v.toFixed(4)) });
    }
    const shape = `${view.x}/${view.y}/${series.map((s) => s.label).join('|')}/${view.language ? 'lm' : 'img'}`;
    if (shape !== this.shape) this.build(shape, series);
    this.u.setData(data);
    if (view.zoom) this.u.setScale('x', view.zoom);
  }
}

const charts = [];
let redraw = () => {};

export function registerEvalChart(chart) {
  charts.push(chart);
}

function resetZoom() {
  view.zoom = null;
  $('zoom-reset').hidden = true;
  redraw();
}

export function setLanguage(lm) {
  view.language = lm;
  for (const c of charts) c.shape = null;
  redraw();
}

export function initChartControls(onChange) {
  redraw = onChange;
  const set = (id, key, f = (v) => v) => $(id).addEventListener('change', (e) => {
    view[key] = f(e.target.value);
    // A zoom on one axis means nothing on the other.
    if (key === 'x') view.zoom = null;
    $('zoom-reset').hidden = !view.zoom;
    onChange();
  });
  set('x-axis', 'x');
  set('y-scale', 'y');
  set('smooth', 'smooth', Number);
  $('zoom-reset').addEventListener('click', resetZoom);
}

// One sentence per chart, for those who cannot see it.
export function evalSummary(points) {
  const real = points.filter((p) => !p.hold);
  if (real.length === 0) return 'No evaluation yet.';
  const first = real[0];
  const last = real[real.length - 1];
  if (view.language) {
    const best = Math.min(...real.map((p) => p.bits_per_token ?? Infinity));
    return `Validation ${last.bits_per_token == null ? '–' : last.bits_per_token.toFixed(3)} bits per token after ${num(last.samples)} samples (at ${clock(last.t_ms)}), `
      + `from ${first.bits_per_token == null ? '–' : first.bits_per_token.toFixed(3)} at the start; best ${Number.isFinite(best) ? best.toFixed(3) : '–'}. ${real.length} evaluations.`;
  }
  const best = Math.max(...real.map((p) => p.accuracy ?? -1));
  return `Test accuracy ${pct(last.accuracy)} after ${num(last.samples)} samples (at ${clock(last.t_ms)}), from ${pct(first.accuracy)} at the start; `
    + `best ${pct(best)}; loss ${last.loss == null ? '–' : last.loss.toFixed(4)}. ${real.length} evaluations.`;
}

// ---------------------------------------------------------------- small multiples

// Each figure: a title, its series [label, value of a point, style], a value format.
const MULTIPLES = [
  // Its axis in 200K, not 200,000: a full figure does not fit the axis and was cut to "0,000".
  { integer: true, id: 'm-rate', title: 'Samples per second', series: [['samples/s', (p) => p.samples_per_s]], fmt: num, axis: compact },
  { integer: true, id: 'm-volunteers', title: 'Volunteers online', series: [['volunteers', (p) => p.volunteers]], fmt: num },
  { integer: true, id: 'm-bytes', title: 'Bytes per second, up (solid) and down (dashed)', series: [['up', (p) => p.bytes_up_per_s], ['down', (p) => p.bytes_down_per_s, { dash: [6, 4], stroke: LOSS }]], fmt: (v) => `${bytes(v)}/s`, axis: bytes, axisSize: 78 },
  { integer: true, id: 'm-rejected', title: 'Refused pushes by reason, per interval', reasons: true, fmt: num },
  { integer: true, id: 'm-quarantined', title: 'Workers quarantined', series: [['quarantined', (p) => p.quarantined]], fmt: num },
  { integer: true, id: 'm-limits', title: 'Limit refusals, per interval', series: [['refusals', (p) => p.limit_refusals]], fmt: num },
];
const REASON_STYLES = [
  { stroke: ACC }, { stroke: LOSS, dash: [6, 4] }, { stroke: '#2f8f6f', dash: [2, 3] },
  { stroke: '#8e3b8e', dash: [12, 3, 3, 3] }, { stroke: '#6b6b6b', dash: [1, 4] },
];
const small = new Map();
// Tick steps of whole units (1, 2, 5, 10, ... 5e11): every figure here counts things (samples,
// volunteers, bytes, refusals), and a tick at 0.5 would print as a rounded 1.
const INTEGER_STEPS = Array.from({ length: 12 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();

function multipleBox(m) {
  let entry = small.get(m.id);
  if (entry) return entry;
  const fig = document.createElement('figure');
  const plot = document.createElement('div');
  plot.className = 'plot';
  plot.id = m.id;
  plot.setAttribute('role', 'img');
  const cap = document.createElement('figcaption');
  cap.id = `${m.id}-caption`;
  const sum = document.createElement('p');
  sum.className = 'chart-summary';
  sum.id = `${m.id}-summary`;
  plot.setAttribute('aria-labelledby', `${cap.id} ${sum.id}`);
  cap.textContent = m.title;
  fig.append(cap, plot, sum);
  $('multiples').append(fig);
  entry = { fig, plot, sum, u: null, shape: null };
  new ResizeObserver(() => {
    const w = Math.max(200, plot.clientWidth);
    if (entry.u && Math.abs(entry.u.width - w) > 2) entry.u.setSize({ width: w, height: 140 });
  }).observe(plot);
  small.set(m.id, entry);
  return entry;
}

// points: the run's figures ([{t_ms, samples_per_s, volunteers, ...}]), oldest first.
export function renderMultiples(points) {
  const xs = points.map((p) => p.t_ms / 1000);
  for (const m of MULTIPLES) {
    const e = multipleBox(m);
    let series = m.series;
    if (m.reasons) {
      const names = [...new Set(points.flatMap((p) => Object.keys(p.rejected || {})))].sort();
      series = (names.length ? names : ['none']).map((n) => [n, (p) => (p.rejected || {})[n] || 0]);
    }
    const shape = series.map((s) => s[0]).join('|');
    if (e.shape !== shape) {
      if (e.u) e.u.destroy();
      e.plot.replaceChildren();
      e.shape = shape;
      e.u = new uPlot({
        width: Math.max(200, e.plot.clientWidth),
        height: 140,
        scales: { x: { time: true }, y: { auto: true, range: (u, min, max) => [0, Math.max(m.integer ? 4 : 1, max * 1.1)] } },
        axes: [{ ...AXIS, size: 30 }, { ...AXIS, size: m.axisSize || 50, ...(m.integer ? { incrs: INTEGER_STEPS } : {}), values: (u, vs) => vs.map((v) => (v == null ? '' : (m.axis || m.fmt)(v))) }],
        series: [{ value: (u, v) => (v == null ? '' : clock(v * 1000)) }, ...series.map(([label, , style], i) => ({
          label, width: 2, stroke: ACC, ...(m.reasons ? REASON_STYLES[i % REASON_STYLES.length] : {}), ...(style || {}), value: (u, v) => m.fmt(v),
        }))],
        legend: { show: series.length > 1 || m.reasons },
      }, [[]], e.plot);
    }
    e.u.setData([xs, ...series.map(([, f]) => points.map((p) => {
      const v = f(p);
      return v == null || !Number.isFinite(v) ? null : v;
    }))]);
    const last = points[points.length - 1];
    e.sum.textContent = last
      ? `${series.map(([label, f]) => `${label} ${m.fmt(f(last))}`).join(', ')} at ${clock(last.t_ms)}; `
        + `peak ${m.fmt(Math.max(...points.map((p) => series.reduce((a, [, f]) => a + (f(p) || 0), 0))))} over ${points.length} points.`
      : 'No figures yet.';
  }
}

export { view as chartView };
