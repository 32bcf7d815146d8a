// loraplex dashboard: reads GET /admin/stats every POLL_MS and redraws; no dependencies.
"use strict";

const POLL_MS = 1500;
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { width: 800, height: 180, left: 44, right: 8, top: 8, bottom: 20 };

const byId = (id) => document.getElementById(id);

function fmt(value, digits = 0) {
  if (value === null || value === undefined) return "–";
  return Number(value).toLocaleString("en-US", {
    minimumFractionDigits: digits,
    maximumFractionDigits: digits,
  });
}

const pct = (value) => (value === null || value === undefined ? "–" : `${fmt(100 * value, 1)}%`);

function ago(unix, now) {
  if (!unix) return "never";
  const s = Math.max(0, now - unix);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function fillRows(table, rows, columns, emptyText) {
  const body = table.tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    const tr = body.insertRow();
    const td = cell(emptyText, "empty");
    td.colSpan = columns;
    tr.appendChild(td);
    return;
  }
  for (const cells of rows) {
    const tr = body.insertRow();
    for (const td of cells) tr.appendChild(td);
  }
}

function renderEngine(doc) {
  const e = doc.engine;
  byId("model").textContent = doc.model;
  byId("kv-value").textContent = pct(e.kv_cache_usage_perc);
  byId("kv-meter").style.width = `${Math.min(100, 100 * e.kv_cache_usage_perc)}%`;
  byId("kv-blocks").textContent =
    `${fmt(e.num_kv_blocks_used)} used / ${fmt(e.num_kv_blocks_free)} free of ${fmt(e.num_kv_blocks_total)} blocks`;
  byId("seqs-value").textContent = `${fmt(e.num_requests_running)} / ${fmt(e.num_requests_waiting)}`;
  byId("preemptions").textContent = `${fmt(e.num_preemptions)} preemptions`;
  byId("gen-rate").textContent = fmt(e.generation_tokens_per_s, 1);
  byId("prompt-rate").textContent = `prompt: ${fmt(e.prompt_tokens_per_s, 1)} tok/s`;
  byId("hit-rate").textContent = pct(e.prefix_cache_hit_rate);
  byId("token-totals").textContent =
    `${fmt(e.prompt_tokens_total)} prompt / ${fmt(e.generation_tokens_total)} generated tokens`;
  byId("step-time").textContent = e.step_time_ms === null ? "–" : `${fmt(e.step_time_ms, 1)} ms`;
  byId("steps").textContent = `${fmt(e.num_steps)} steps`;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${fmt(1000 * value, value < 0.1 ? 1 : 0)} ms` : `${fmt(value, 2)} s`;
}

function renderLatency(latency) {
  const minutes = fmt(latency.window_s / 60, 1);
  for (const [id, key, what] of [["ttft", "ttft_s", "requests"], ["itl", "itl_s", "token gaps"],
                                 ["e2e", "e2e_s", "requests"]]) {
    const q = latency[key];
    byId(id).textContent = q.count ? `${seconds(q.p50)} / ${seconds(q.p95)}` : "–";
    byId(`${id}-count`).textContent = `${fmt(q.count)} ${what}, last ${minutes} min`;
  }
}

function svg(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function niceMax(value) {
  if (value <= 0) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function renderChart(series) {
  const chart = byId("chart");
  chart.replaceChildren();
  const points = series.points;
  const { width, height, left, right, top, bottom } = CHART;
  const w = width - left - right;
  const h = height - top - bottom;
  const yMax = niceMax(
    Math.max(0, ...points.map((p) => Math.max(p.generation_tokens_per_s, p.prompt_tokens_per_s))),
  );
  for (const f of [0, 0.5, 1]) {
    const y = top + h * (1 - f);
    chart.appendChild(svg("line", { x1: left, x2: width - right, y1: y, y2: y, class: "grid" }));
    chart.appendChild(svg("text", { x: left - 6, y: y + 4, "text-anchor": "end", class: "axis" }, fmt(yMax * f, yMax < 10 ? 1 : 0)));
  }
  if (points.length < 2) {
    byId("chart-range").textContent = "collecting…";
    return;
  }
  const t0 = points[0].t;
  const span = Math.max(1, points[points.length - 1].t - t0);
  const x = (p) => (left + (w * (p.t - t0)) / span).toFixed(1);
  const line = (value, scale, cls) => {
    const coords = points.map((p) => `${x(p)},${(top + h * (1 - value(p) / scale)).toFixed(1)}`);
    chart.appendChild(svg("polyline", { points: coords.join(" "), class: cls }));
  };
  line((p) => p.kv_cache_usage_perc, 1, "kv");
  line((p) => p.prompt_tokens_per_s, yMax, "prompt");
  line((p) => p.generation_tokens_per_s, yMax, "gen");
  chart.appendChild(svg("text", { x: left, y: height - 4, class: "axis" }, `−${fmt(span / 60, 1)} min`));
  chart.appendChild(svg("text", { x: width - right, y: height - 4, "text-anchor": "end", class: "axis" }, "now"));
  byId("chart-range").textContent = `last ${fmt(span / 60, 1)} min, every ${fmt(series.period_s, 1)} s`;
}

function shareCell(t) {
  const td = document.createElement("td");
  const wrap = document.createElement("div");
  wrap.className = "share";
  const bars = document.createElement("div");
  bars.className = "bars";
  const use = document.createElement("div");
  use.className = "use";
  use.style.width = `${Math.min(100, 100 * t.use_share)}%`;
  const fair = document.createElement("div");
  fair.className = "fair";
  fair.style.left = `${Math.min(100, 100 * t.fair_share)}%`;
  bars.append(use, fair);
  const label = document.createElement("span");
  label.textContent = `${pct(t.use_share)} of ${pct(t.fair_share)}`;
  wrap.append(bars, label);
  td.appendChild(wrap);
  return td;
}

function renderTenants(tenants) {
  const rows = tenants.map((t) => [
    cell(t.name),
    // NOTE: an engine in another process does not report tenants' queues: requests in flight.
    cell(
      t.num_requests_running === null
        ? `${fmt(t.num_requests_in_flight)} in flight`
        : fmt(t.num_requests_running),
      "num",
    ),
    cell(fmt(t.num_requests_waiting), "num"),
    cell(fmt(t.prompt_tokens_per_s, 1), "num"),
    cell(fmt(t.generation_tokens_per_s, 1), "num"),
    cell(fmt(t.prompt_tokens_total + t.generation_tokens_total), "num"),
    cell(`${fmt(t.requests_total)}${t.errors_total ? ` (${fmt(t.errors_total)} failed)` : ""}`, "num"),
    cell(fmt(t.rate_limited_total), "num"),
    shareCell(t),
  ]);
  fillRows(byId("tenants"), rows, 9, "no tenants");
}

function residencyCell(a) {
  const td = document.createElement("td");
  const badge = document.createElement("span");
  const failed = Boolean(a.failed);
  badge.className = `badge ${failed ? "failed" : a.residency}`;
  badge.textContent = failed ? "failed" : a.residency.toUpperCase();
  if (failed) badge.title = a.failed;
  td.appendChild(badge);
  for (const [on, text] of [[a.loading, "loading"], [a.pinned, "pinned"]]) {
    if (!on) continue;
    const flag = document.createElement("span");
    flag.className = "flag";
    flag.textContent = text;
    td.appendChild(flag);
  }
  return td;
}

function renderAdapters(adapters, now) {
  const pool = adapters.pool;
  byId("pool").textContent = pool
    ? `GPU slots ${pool.gpu_slots_used} / ${pool.gpu_slots_total} used (${pool.gpu_slots_in_use} in use by requests or pins), ` +
      `CPU cache ${pool.cpu_cache_used} / ${pool.cpu_cache_total}, ${pool.loads_in_flight} loads under way`
    : "LoRA adapters are off on this engine.";
  const rows = adapters.items.map((a) => [
    cell(a.tenant),
    cell(a.name),
    residencyCell(a),
    cell(ago(a.last_used, now)),
    cell(fmt(a.loads), "num"),
    cell(a.load_latency_mean_s === null ? "–" : `${fmt(1000 * a.load_latency_mean_s, 1)} ms`, "num"),
    cell(fmt(a.evictions), "num"),
    cell(fmt(a.requests_total), "num"),
    cell(`${fmt(a.num_requests_running)} / ${fmt(a.num_requests_waiting)}`, "num"),
  ]);
  fillRows(byId("adapters"), rows, 9, "no adapters");
}

async function poll() {
  const status = byId("status");
  try {
    const response = await fetch("/admin/stats", { credentials: "same-origin", cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      window.location.assign("/dashboard");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const doc = await response.json();
    renderEngine(doc);
    renderLatency(doc.latency);
    renderChart(doc.series);
    renderTenants(doc.tenants);
    renderAdapters(doc.adapters, doc.time);
    status.textContent = `updated ${new Date(doc.time * 1000).toLocaleTimeString()}`;
    status.classList.remove("error");
  } catch (error) {
    status.textContent = `not updated: ${error.message}`;
    status.classList.add("error");
  }
  window.setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", poll);
