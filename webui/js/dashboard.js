// The metrics dashboard: last hour from GET /admin/api/audit/timeseries (per-bucket counts,
// errors and TTFB percentiles by protocol and by mode) and live state from
// GET /admin/api/status (in-flight, credential health, repairs, budget overflows).
// Polls every POLL_MS while the page is open and the tab visible. Charts: uPlot (vendored).

import { get } from "./api.js";
import { fmtMs, fmtNumber, fmtPercent, h, replace } from "./dom.js";

const POLL_MS = 2500;
const WINDOW = 3600;
const BUCKET = 10;
const PROTOCOLS = ["chat", "responses", "messages"];
const MODES = ["compatible", "realtime"];
const COLORS = {
  chat: "#2563eb", responses: "#16a34a", messages: "#d97706",
  compatible: "#7c3aed", realtime: "#db2777", p50: "#0891b2", p95: "#dc2626", all: "#334155",
};
const INFLIGHT_HISTORY = 300 / (POLL_MS / 1000);

function stat(id, label, sub) {
  return h(`div.stat#${id}`, null, h("span.stat-label", null, label), h("span.stat-value", null, "–"),
    h("span.stat-sub", null, sub || ""));
}

function setStat(id, value, text, sub) {
  const el = document.getElementById(id);
  if (!el) return;
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.querySelector(".stat-value").textContent = text;
  if (sub !== undefined) el.querySelector(".stat-sub").textContent = sub;
}

function lastMinuteRate(times, counts, now) {
  let n = 0;
  let from = now;
  for (let i = times.length - 1; i >= 0 && times[i] >= now - 60; i -= 1) {
    n += counts[i];
    from = times[i];
  }
  const seconds = Math.max(now - from, BUCKET);
  return n / seconds;
}

class Chart {
  /** options.points: mark every value (for series with gaps, where a lone value has no line);
   *  options.span: show only the last `span` seconds of x. */
  constructor(container, title, series, yLabel, options = {}) {
    this.options = options;
    this.title = title;
    this.names = series;
    this.box = h("div.chart-body");
    this.el = h("section.card.chart", null, h("h3", null, title), this.box);
    container.append(this.el);
    this.plot = null;
    this.yLabel = yLabel;
  }

  update(data) {
    if (typeof uPlot === "undefined") return; // the vendored script failed to load
    const width = Math.max(this.box.clientWidth, 200);
    if (!this.plot) {
      const series = [{}, ...this.names.map((name) => ({
        label: name, stroke: COLORS[name] || COLORS.all, width: 1.5, spanGaps: false,
        points: this.options.points ? { show: true, size: 5, fill: COLORS[name] } : { show: false },
      }))];
      const span = this.options.span;
      const x = span ? { time: true, range: (u, min, max) => [max - span, max] } : { time: true };
      this.plot = new uPlot({
        width, height: 170, series,
        scales: { x, y: { range: (u, min, max) => [0, Math.max(max || 0, 1)] } },
        axes: [{ stroke: "#64748b", grid: { stroke: "#e2e8f0" } },
               { stroke: "#64748b", grid: { stroke: "#e2e8f0" }, size: 56, label: this.yLabel, labelSize: 14 }],
        legend: { live: false },
        cursor: { drag: { x: false, y: false } },
      }, data, this.box);
    } else {
      if (Math.abs(this.plot.width - width) > 4) this.plot.setSize({ width, height: 170 });
      this.plot.setData(data);
    }
  }

  destroy() {
    if (this.plot) this.plot.destroy();
  }
}

export function mount(main) {
  const updated = h("span.muted#dash-updated", null, "loading…");
  const stats = h("div.stats", null,
    stat("stat-rps", "Requests/s", "last minute"),
    stat("stat-requests", "Requests", "last hour"),
    stat("stat-error-rate", "Error rate", "last hour"),
    stat("stat-p50", "TTFB p50", "last hour"),
    stat("stat-p95", "TTFB p95", "last hour"),
    stat("stat-inflight", "In flight", "now"),
    stat("stat-repairs", "Tool repairs", "last hour"),
    stat("stat-overflows", "Over budget", "last hour"));
  const facts = h("p.facts#dash-facts");
  const charts = h("div.charts");
  const breakdown = h("section.card#breakdown", null, h("h2", null, "Last hour by protocol and by mode"));
  const health = h("section.card#credential-health", null, h("h2", null, "Upstream credentials"));
  const error = h("p.notice.error", { hidden: true });
  replace(main,
    h("div.page-head", null, h("h1", null, "Dashboard"), h("span.live-dot", { title: "refreshing live" }), updated),
    error, stats, facts, charts, h("div.two-col", null, breakdown, health));

  const chartRps = new Chart(charts, "Requests/s by protocol", PROTOCOLS, "req/s");
  const chartModes = new Chart(charts, "Requests/s by mode", MODES, "req/s");
  const chartErrors = new Chart(charts, "Error rate by mode (%)", MODES, "%", { points: true });
  const chartTtfb = new Chart(charts, "Time to first byte, all requests (ms)", ["p50", "p95"], "ms", { points: true });
  const chartTtfbModes = new Chart(charts, "Time to first byte p95 by mode (ms)", MODES, "ms", { points: true });
  const chartInflight = new Chart(charts, "In flight by protocol (last 5 minutes, sampled)", PROTOCOLS, "requests",
    { span: 300 });
  const inflight = { t: [], chat: [], responses: [], messages: [] };
  let timer = null;
  let stopped = false;

  function series(group, name, f) {
    const g = group[name];
    return g ? g[f] : null;
  }

  function render(ts, st) {
    const now = st.time;
    const times = ts.times;
    const zeros = times.map(() => 0);
    const rate = (counts) => (counts || zeros).map((c) => c / ts.bucket);
    const total = ts.total.summary;
    setStat("stat-rps", lastMinuteRate(times, ts.total.requests, now),
      fmtNumber(lastMinuteRate(times, ts.total.requests, now), 2));
    setStat("stat-requests", total.requests, fmtNumber(total.requests));
    setStat("stat-error-rate", total.error_rate, fmtPercent(total.error_rate),
      `${fmtNumber(total.errors)} errors, last hour`);
    setStat("stat-p50", total.ttfb_ms_p50, fmtMs(total.ttfb_ms_p50));
    setStat("stat-p95", total.ttfb_ms_p95, fmtMs(total.ttfb_ms_p95));
    setStat("stat-inflight", st.in_flight, `${st.in_flight}`, `now, of ${st.max_concurrent} allowed`);
    setStat("stat-repairs", st.tool_repairs, fmtNumber(st.tool_repairs),
      `in ${st.requests_with_repairs} request(s)`);
    setStat("stat-overflows", st.budget_overflows, fmtNumber(st.budget_overflows));
    replace(facts,
      "Stream mode ", h("strong#dash-mode", null, st.stream_mode),
      " · settings revision ", h("strong", null, String(st.revision)),
      " · credentials usable ", h("strong", null, `${st.credentials_usable} / ${st.credentials.length}`),
      " · audit queue ", h("strong", null, String(st.audit_queue_depth)));
    updated.textContent = `last hour · ${BUCKET}s buckets · updated ${new Date(now * 1000).toLocaleTimeString()}`;

    chartRps.update([times, ...PROTOCOLS.map((p) => rate(series(ts.by_protocol, p, "requests")))]);
    chartModes.update([times, ...MODES.map((m) => rate(series(ts.by_mode, m, "requests")))]);
    chartErrors.update([times, ...MODES.map((m) => {
      const req = series(ts.by_mode, m, "requests");
      const err = series(ts.by_mode, m, "errors");
      return times.map((_, i) => (req && req[i] ? (100 * err[i]) / req[i] : null));
    })]);
    chartTtfb.update([times, ts.total.ttfb_ms_p50, ts.total.ttfb_ms_p95]);
    chartTtfbModes.update([times, ...MODES.map((m) => series(ts.by_mode, m, "ttfb_ms_p95") || times.map(() => null))]);

    inflight.t.push(now);
    for (const p of PROTOCOLS) inflight[p].push(st.in_flight_by_protocol[p] || 0);
    if (inflight.t.length > INFLIGHT_HISTORY) for (const k of Object.keys(inflight)) inflight[k].shift();
    chartInflight.update([inflight.t, ...PROTOCOLS.map((p) => inflight[p])]);

    renderBreakdown(ts, st);
    renderHealth(st);
  }

  function renderBreakdown(ts, st) {
    const row = (kind, name, group, inFlight) => {
      const s = group ? group.summary : { requests: 0, errors: 0, error_rate: 0, ttfb_ms_p50: null, ttfb_ms_p95: null };
      return h("tr", { "data-group": `${kind}:${name}` },
        h("td", null, h("span.swatch", { style: `background:${COLORS[name]}` }), name),
        h("td.num", null, fmtNumber(s.requests)),
        h("td.num", null, fmtNumber(s.requests / ts.window, 3)),
        h("td.num", null, fmtPercent(s.error_rate)),
        h("td.num", null, fmtMs(s.ttfb_ms_p50)),
        h("td.num", null, fmtMs(s.ttfb_ms_p95)),
        h("td.num", null, inFlight === undefined ? "–" : String(inFlight)));
    };
    const head = h("thead", null, h("tr", null,
      ["", "Requests", "Req/s", "Error rate", "TTFB p50", "TTFB p95", "In flight"].map((t) => h("th", null, t))));
    replace(breakdown, h("h2", null, "Last hour by protocol and by mode"),
      h("table.grid", null, head, h("tbody", null,
        h("tr.group", null, h("th", { colspan: 7 }, "Protocol")),
        PROTOCOLS.map((p) => row("protocol", p, ts.by_protocol[p], st.in_flight_by_protocol[p] || 0)),
        h("tr.group", null, h("th", { colspan: 7 }, "Mode")),
        MODES.map((m) => row("mode", m, ts.by_mode[m], (st.in_flight_by_mode || {})[m] || 0)))));
  }

  function renderHealth(st) {
    const rows = st.credentials.map((c) => {
      const cooling = Object.entries(c.cooldowns);
      let state = "healthy";
      let tone = "ok";
      if (c.disabled) { state = `disabled${c.disabled_reason ? `: ${c.disabled_reason}` : ""}`; tone = "error"; }
      else if (cooling.length) {
        state = `cooling down (${cooling.map(([m, s]) => `${m === "*" ? "all models" : m} ${Math.ceil(s)} s`).join(", ")})`;
        tone = "warn";
      }
      return h("tr", null,
        h("td.mono", null, c.upstream),
        h("td.mono", null, c.fingerprint),
        h("td", null, h(`span.pill.${tone}`, null, state)),
        h("td.num", null, String(c.in_flight)));
    });
    // the same reasons as GET /readyz (store writable, spill journal empty, audit queue, credentials)
    const notReady = st.not_ready || [];
    const ready = h("p#dash-ready", null, "Readiness: ", notReady.length
      ? h("span.pill.error", null, `not ready: ${notReady.map((r) => r.message).join("; ")}`)
      : h("span.pill.ok", null, "ready"));
    replace(health, h("h2", null, "Upstream credentials"), ready,
      rows.length ? h("table.grid", null,
        h("thead", null, h("tr", null, ["Upstream", "Key", "Health", "In flight"].map((t) => h("th", null, t)))),
        h("tbody", null, rows)) : h("p.muted", null, "No upstream credentials configured."),
      h("p", null, h("a", { href: "#/credentials" }, "Manage credentials →")));
  }

  async function poll() {
    if (stopped) return;
    if (!document.hidden) {
      try {
        const [ts, st] = await Promise.all([
          get(`/admin/api/audit/timeseries?window=${WINDOW}&bucket=${BUCKET}`),
          get(`/admin/api/status?window=${WINDOW}`),
        ]);
        if (stopped) return;
        error.hidden = true;
        render(ts, st);
      } catch (exc) {
        if (stopped) return;
        error.textContent = `Could not refresh: ${exc.message}`;
        error.hidden = false;
      }
    }
    timer = setTimeout(poll, POLL_MS);
  }

  poll();
  return () => {
    stopped = true;
    clearTimeout(timer);
    for (const chart of [chartRps, chartModes, chartErrors, chartTtfb, chartTtfbModes, chartInflight]) chart.destroy();
  };
}
