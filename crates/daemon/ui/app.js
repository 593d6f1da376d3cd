// pagefleet's dashboard: renders the cluster snapshots pagefleetd sends as
// server-sent events (GET /ui/api/events, one a second). Everything shown
// is built with DOM nodes and textContent: nothing from the cluster is ever
// parsed as HTML.
'use strict';

const WINDOW_MS = 5 * 60 * 1000;
const PALETTE = ['#dd6b20', '#38a169', '#805ad5', '#d53f8c', '#319795', '#b7791f', '#718096'];
// Per guest (host/name): [{t, count, sum}] of its fault histogram, the last 5 minutes.
const faults = new Map();
// Per migrating guest: [{t, sent}] for the ETA.
const sentHistory = new Map();
const serverColour = new Map();

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k === 'style') Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function bytes(b) {
  if (!Number.isFinite(b)) return '-';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return (i === 0 ? b.toFixed(0) : b.toFixed(b < 10 ? 2 : 1)) + ' ' + u[i];
}

function seconds(s) {
  if (!Number.isFinite(s)) return '-';
  if (s < 1e-3) return (s * 1e6).toFixed(0) + ' µs';
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + ' ms';
  if (s < 120) return s.toFixed(1) + ' s';
  return Math.floor(s / 60) + ' min ' + Math.round(s % 60) + ' s';
}

function ago(unix, nowMs) {
  const s = Math.max(0, nowMs / 1000 - unix);
  return s < 90 ? Math.round(s) + ' s ago' : Math.round(s / 60) + ' min ago';
}

function colourOf(server) {
  if (!serverColour.has(server)) serverColour.set(server, PALETTE[serverColour.size % PALETTE.length]);
  return serverColour.get(server);
}

function fill(tbody, rows, empty) {
  tbody.replaceChildren(...rows);
  if (rows.length === 0) {
    const cols = tbody.parentElement.querySelectorAll('thead th').length;
    tbody.append(el('tr', {}, el('td', { colspan: String(cols), class: 'none' }, empty)));
  }
}

function bar(parts, total) {
  const b = el('div', { class: 'bar', title: parts.map(p => p.label + ': ' + bytes(p.value)).join(', ') });
  for (const p of parts) {
    if (p.value <= 0 || total <= 0) continue;
    b.append(el('span', { style: { width: (100 * p.value / total).toFixed(2) + '%', background: p.colour } }));
  }
  return b;
}

function sparkline(points) {
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('class', 'spark');
  svg.setAttribute('viewBox', '0 0 160 24');
  svg.setAttribute('preserveAspectRatio', 'none');
  if (points.length >= 2) {
    const t0 = points[0].t, t1 = points[points.length - 1].t;
    const max = Math.max(1, ...points.map(p => p.v));
    const line = document.createElementNS(ns, 'polyline');
    line.setAttribute('points', points.map(p =>
      (160 * (p.t - t0) / Math.max(1, t1 - t0)).toFixed(1) + ',' + (23 - 22 * p.v / max).toFixed(1)).join(' '));
    svg.append(line);
  }
  return svg;
}

// Fault rate (per second) between successive snapshots, and the mean
// fault time over the window.
function faultStats(key, hist, t) {
  let h = faults.get(key);
  if (!h) { h = []; faults.set(key, h); }
  if (hist) h.push({ t, count: hist.count, sum: hist.sum });
  while (h.length > 0 && h[0].t < t - WINDOW_MS) h.shift();
  const rates = [];
  for (let i = 1; i < h.length; i++) {
    const dt = (h[i].t - h[i - 1].t) / 1000;
    const dc = h[i].count - h[i - 1].count;
    if (dt > 0 && dc >= 0) rates.push({ t: h[i].t, v: dc / dt });
  }
  let mean = NaN;
  if (h.length >= 2) {
    const dc = h[h.length - 1].count - h[0].count;
    if (dc > 0) mean = (h[h.length - 1].sum - h[0].sum) / dc;
  }
  return { rates, now: rates.length ? rates[rates.length - 1].v : 0, mean };
}

function renderHosts(hosts) {
  fill($('hosts').tBodies[0], hosts.map(h => {
    const r = h.host;
    if (!r) {
      return el('tr', {}, el('td', {}, h.http), el('td', { colspan: '4' }, h.error || 'no answer'),
        el('td', { class: 'dead' }, 'dead'));
    }
    const used = r.mem_total - r.mem_available;
    const given = r.guest_memory - r.guest_free;
    return el('tr', {},
      el('td', { title: h.http }, r.hostname),
      el('td', { class: 'num' }, bytes(used) + ' of ' + bytes(r.mem_total)),
      el('td', { class: 'num' }, r.guest_memory ? bytes(given) + ' of ' + bytes(r.guest_memory) : '-'),
      el('td', { class: 'num' }, r.memserver ? bytes(r.lend_used) + ' of ' + bytes(r.lend_capacity) : '-'),
      el('td', { class: 'num' }, String(r.guests)),
      r.cordoned ? el('td', { class: 'cordoned' }, 'cordoned') : el('td', { class: 'ok' }, 'up'));
  }), 'no hosts');
}

function renderMigrations(hosts, t) {
  const box = $('migrations');
  const cards = [];
  const live = new Set();
  for (const h of hosts) {
    for (const g of h.guests || []) {
      const m = g.migration;
      if (!m) continue;
      const key = h.http + '/' + g.name;
      live.add(key);
      const sent = m.bytes_main + m.bytes_subs;
      let hist = sentHistory.get(key);
      if (!hist) { hist = []; sentHistory.set(key, hist); }
      hist.push({ t, sent });
      while (hist.length > 10) hist.shift();
      // Progress: what is sent against what is sent plus what this round has left.
      const total = sent + (m.remaining_bytes || 0);
      const frac = total > 0 ? sent / total : 0;
      const rate = m.transfer_rate || (hist.length >= 2
        ? (hist[hist.length - 1].sent - hist[0].sent) / ((hist[hist.length - 1].t - hist[0].t) / 1000) : 0);
      const eta = rate > 0 ? (m.remaining_bytes || 0) / rate : NaN;
      const converging = !m.dirty_rate || !m.transfer_rate || m.dirty_rate < m.transfer_rate;
      cards.push(el('div', { class: 'migration', 'data-guest': g.name },
        el('div', { class: 'title' }, g.name + ' from ' + (h.host ? h.host.hostname : h.http)),
        el('div', { class: 'facts' },
          el('span', {}, 'phase: ', el('b', { class: 'phase' }, m.phase || 'starting')),
          el('span', {}, 'round ' + m.round),
          el('span', {}, 'sent ' + bytes(sent)),
          el('span', {}, 'left this round ' + bytes(m.remaining_bytes || 0)),
          el('span', {}, 'transfer ' + bytes(m.transfer_rate || 0) + '/s'),
          el('span', { class: converging ? '' : 'failed' }, 'dirtied ' + bytes(m.dirty_rate || 0) + '/s'),
          el('span', {}, 'ETA ' + (Number.isFinite(eta) ? seconds(eta) : '-'))),
        el('div', { class: 'progress', role: 'progressbar', 'aria-valuenow': (100 * frac).toFixed(0) },
          el('span', { style: { width: (100 * frac).toFixed(1) + '%' } }))));
    }
  }
  for (const k of [...sentHistory.keys()]) if (!live.has(k)) sentHistory.delete(k);
  if (cards.length === 0) box.replaceChildren(el('p', { class: 'none' }, 'none in progress'));
  else box.replaceChildren(...cards);

  const done = [];
  for (const h of hosts) {
    for (const f of (h.host && h.host.migrations) || []) done.push({ from: h.host.hostname, f });
  }
  done.sort((a, b) => b.f.at_unix - a.f.at_unix);
  fill($('finished').tBodies[0], done.map(({ from, f }) => {
    const r = f.report;
    const sent = r ? r.bytes_main + (r.bytes_subs || []).reduce((a, b) => a + b, 0) : NaN;
    return el('tr', { 'data-guest': f.guest },
      el('td', {}, f.guest), el('td', {}, from),
      el('td', {}, r ? r.main_host : '-'),
      el('td', {}, r ? (r.sub_hosts.join(', ') || 'none') : '-'),
      el('td', {}, ago(f.at_unix, t)),
      el('td', { class: 'num' }, r ? seconds(r.total_secs) : '-'),
      el('td', { class: 'num' }, r ? seconds(r.downtime_ms / 1000) : '-'),
      el('td', { class: 'num' }, r ? String(r.rounds) : '-'),
      el('td', { class: 'num' }, bytes(sent)),
      r ? el('td', { class: 'ok outcome' }, 'running at the destination')
        : el('td', { class: 'failed outcome', title: f.error || '' }, 'failed: ' + (f.error || '')));
  }), 'none yet');
}

function renderGuests(hosts, t) {
  const rows = [];
  const seen = new Set();
  for (const h of hosts) {
    for (const g of h.guests || []) {
      const key = h.http + '/' + g.name;
      seen.add(key);
      const p = g.pages || { local: 0, zero: 0, remote: {} };
      const parts = [{ label: 'here', value: p.local * 4096, colour: 'var(--local)' }];
      for (const [server, n] of Object.entries(p.remote || {})) {
        parts.push({ label: server, value: n * 4096, colour: colourOf(server) });
      }
      const total = parts.reduce((a, x) => a + x.value, 0);
      const fs = faultStats(key, g.paging && g.paging.fault_seconds, t);
      const where = el('div', {}, bar(parts, total),
        el('div', { class: 'legend' }, parts.filter(x => x.value > 0)
          .map(x => x.label + ' ' + bytes(x.value)).join(' · ') || 'nothing resident yet'));
      const state = String(g.state).toLowerCase();
      rows.push(el('tr', { 'data-guest': g.name },
        el('td', {}, g.name),
        el('td', {}, h.host ? h.host.hostname : h.http),
        el('td', { class: state === 'failed' ? 'failed' : '' }, state),
        el('td', { class: 'num' }, bytes(g.size)),
        el('td', { class: 'num' }, bytes(g.budget_pages * 4096)),
        el('td', {}, where),
        el('td', {}, sparkline(fs.rates), ' ' + fs.now.toFixed(0)),
        el('td', { class: 'num' }, seconds(fs.mean))));
    }
  }
  for (const k of [...faults.keys()]) if (!seen.has(k)) faults.delete(k);
  fill($('guests').tBodies[0], rows, 'no guests');
}

function renderServers(hosts) {
  fill($('servers').tBodies[0], hosts.filter(h => h.host && h.host.memserver).map(h => {
    const r = h.host;
    return el('tr', {},
      el('td', {}, r.hostname), el('td', {}, r.memserver),
      el('td', {}, bar([{ label: 'stored', value: r.lend_used, colour: colourOf(r.memserver) }], r.lend_capacity),
        el('div', { class: 'legend' }, bytes(r.lend_used) + ' of ' + bytes(r.lend_capacity))),
      el('td', { class: 'num' }, String(r.regions)));
  }), 'no host lends memory');
}

// KSM and I/O QoS: shown only where a host's pagefleetd runs the controller.
function renderControllers(hosts) {
  const ksm = hosts.filter(h => h.host && h.host.ksm);
  $('ksm-section').hidden = ksm.length === 0;
  fill($('ksm').tBodies[0], ksm.map(h => {
    const k = h.host.ksm;
    return el('tr', {},
      el('td', {}, h.host.hostname), el('td', {}, k.policy),
      el('td', { class: k.running ? 'ok' : '' }, k.phase + (k.pressure ? ' (memory pressure)' : '')),
      el('td', { class: 'num' }, k.scan_pages_per_second.toFixed(0) + ' pages/s'),
      el('td', { class: 'num' }, bytes(k.saved_bytes)),
      el('td', { class: 'num' }, (100 * k.ksmd_cpu_ratio).toFixed(2) + ' %'),
      el('td', { class: 'why' }, k.why));
  }), 'no KSM controller');
  const rows = [];
  for (const h of hosts) {
    const q = h.host && h.host.ioqos;
    if (!q) continue;
    for (const t of q.tenants) {
      const limit = t.limit_bytes_per_second;
      rows.push(el('tr', { 'data-tenant': t.name },
        el('td', {}, h.host.hostname),
        el('td', { title: q.policy }, q.device + ' · ' + (100 * q.device_used_ratio).toFixed(0) + ' % used'),
        el('td', {}, t.name),
        el('td', {}, limit ? bar([{ label: 'rate', value: t.bytes_per_second, colour: 'var(--local)' }], limit) : '',
          el('div', { class: 'legend' }, bytes(t.bytes_per_second) + '/s' + (limit ? ' of ' + bytes(limit) + '/s' : ', no limit'))),
        el('td', { class: 'num' }, t.iops.toFixed(0)),
        t.error ? el('td', { class: 'failed', title: t.error }, 'error: ' + t.error)
          : el('td', { class: t.starved ? 'failed' : 'ok' }, t.starved ? 'starved' : 'ok')));
    }
  }
  $('ioqos-section').hidden = rows.length === 0;
  fill($('ioqos').tBodies[0], rows, 'no tenants');
}

let lastAt = 0;

function render(s) {
  if (!s || !s.view || s.at_unix_ms <= lastAt) return;
  lastAt = s.at_unix_ms;
  const hosts = s.view.hosts || [];
  $('serving').textContent = 'served by ' + s.serving + ' · ' + hosts.length + ' hosts';
  renderHosts(hosts);
  renderMigrations(hosts, s.at_unix_ms);
  renderGuests(hosts, s.at_unix_ms);
  renderServers(hosts);
  renderControllers(hosts);
}

function status(text, cls) {
  const c = $('conn');
  c.textContent = text;
  c.className = 'conn ' + cls;
}

fetch('api/snapshot', { credentials: 'same-origin' })
  .then(r => r.ok ? r.json() : null)
  .then(render)
  .catch(() => {});

const events = new EventSource('api/events');
events.addEventListener('snapshot', e => {
  render(JSON.parse(e.data));
  status('live', 'live');
});
events.onerror = () => {
  status(events.readyState === EventSource.CLOSED ? 'disconnected: reload, or open a new link' : 'reconnecting…',
    events.readyState === EventSource.CLOSED ? 'lost' : 'wait');
};
