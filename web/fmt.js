// Small helpers every part of the page shares: element lookup, number formats, the polite live
// region, and file downloads.

export const $ = (id) => document.getElementById(id);
const fmtInt = new Intl.NumberFormat('en');
export const num = (v) => (v == null || !Number.isFinite(Number(v)) ? '–' : fmtInt.format(Math.round(v)));
export const fixed = (v, d) => (v == null || !Number.isFinite(v) ? '–' : v.toFixed(d));
// 1.2K, 209.4K, 3M: for where a full figure does not fit (a chart's axis, the one-line summary).
const fmtCompact = new Intl.NumberFormat('en', { notation: 'compact', maximumFractionDigits: 1 });
export const compact = (v) => (v == null || !Number.isFinite(Number(v)) ? '–' : fmtCompact.format(v));
export const pct = (v) => (v == null || !Number.isFinite(v) ? '–' : `${(100 * v).toFixed(2)}%`);
// Bytes in B, kB, MB, GB (decimal, as link speeds are).
export const bytes = (v) => {
  if (v == null || !Number.isFinite(v)) return '–';
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
};
export const hex = (n) => Array.from(crypto.getRandomValues(new Uint8Array(n)), (b) => b.toString(16).padStart(2, '0')).join('');
export const clock = (ms) => new Date(ms).toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit' });

// The polite live region: only state changes are said, each once.
let said = '';
export function announce(text) {
  if (!text || text === said) return;
  said = text;
  $('announce').textContent = text;
}

export function cell(text, cls) {
  const td = document.createElement('td');
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

// Offers `text` as a file named `name`.
export function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// Rows of objects as CSV: a header of `columns`, values quoted when they need it.
export function csv(columns, rows) {
  const q = (v) => {
    if (v == null) return '';
    const s = typeof v === 'object' ? JSON.stringify(v) : String(v);
    return /[",\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
  };
  return [columns.join(','), ...rows.map((r) => columns.map((c) => q(r[c])).join(','))].join('\n') + '\n';
}
