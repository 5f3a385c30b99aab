// The metrics dashboard over a chosen time range (5 min … 7 days) from
// GET /admin/api/audit/timeseries (per-bucket counts, errors, TTFB/TTFT/duration
// percentiles by protocol and by mode, output tokens/s by model, errors by code, upstream
// attempts and their errors by upstream) and live
// state from GET /admin/api/status (in-flight against this replica's share of the cap, credential
// health, repairs, budget overflows, the live replicas: replicas.js). Polls every POLL_MS
// (less often for long ranges) while the page is open and the tab visible. Charts: uPlot.

import { get } from "./api.js";
import { firstRequestCard } from "./first_request.js";
import { capOf, inFlightSub, inFlightTitle, renderReplicas } from "./replicas.js";
import { fmtMs, fmtNumber, fmtPercent, h, replace } from "./dom.js";

const POLL_MS = 2500;
// a poll that has no answer after this long counts as the gateway being unreachable
const POLL_TIMEOUT_MS = 8000;
// [seconds, label, bucket seconds, refresh ms]: at most a few hundred points per chart; a
// long range reads many audit rows, so it refreshes less often (its last bucket moves slowly).
const RANGES = [
  [300, "5 min", 5, POLL_MS], [3600, "1 h", 10, POLL_MS], [21600, "6 h", 60, 10_000],
  [86400, "24 h", 300, 30_000], [604800, "7 d", 1800, 60_000],
];
const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#dc2626", "#4d7c0f", "#64748b"];
// Kept across visits to the page (and across polls).
const view = { range: 3600 };
const PROTOCOLS = ["chat", "responses", "messages"];
const MODES = ["compatible", "realtime"];
const COLORS = {
  chat: "#2563eb", responses: "#16a34a", messages: "#d97706",
  compatible: "#7c3aed", realtime: "#db2777", p50: "#0891b2", p95: "#dc2626", all: "#334155",
};

function rangeOf(seconds) {
  return RANGES.find(([s]) => s === seconds) || RANGES[1];
}

function colorOf(name, i) {
  return name === "other" ? "#94a3b8" : COLORS[name] || PALETTE[i % PALETTE.length];
}

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

/** Rollout capture (GET /admin/api/status `capture`): on, and where token ids come from. */
function captureText(capture) {
  const sources = Object.entries(capture.token_sources).map(([name, source]) => `${name} ${source}`);
  return `ON, token ids from ${sources.length ? sources.join(", ") : "none"}`;
}

function lastMinuteRate(times, counts, now, bucket) {
  let n = 0;
  let from = now;
  for (let i = times.length - 1; i >= 0 && times[i] >= now - Math.max(60, bucket); i -= 1) {
    n += counts[i];
    from = times[i];
  }
  const seconds = Math.max(now - from, bucket);
  return n / seconds;
}

class Chart {
  /** options.points: mark every value (for series with gaps, where a lone value has no line);
   *  options.span: show only the last `span` seconds of x; otherwise x is the chosen range.
   *  update(data, names) rebuilds the plot when the series change (models, error codes). */
  constructor(container, id, title, series, yLabel, options = {}) {
    this.options = options;
    this.title = title;
    this.names = series;
    this.box = h("div.chart-body");
    this.el = h(`section.card.chart#${id}`, null, h("h3", null, title), this.box);
    container.append(this.el);
    this.plot = null;
    this.yLabel = yLabel;
    this.xRange = null;
  }

  update(data, names, xRange) {
    if (typeof uPlot === "undefined") return; // the vendored script failed to load
    this.el.dataset.series = (names || this.names).join(",");
    this.el.dataset.points = String(data[0].length);
    const rangeKey = xRange ? xRange.join(":") : "";
    if (names && names.join(",") !== this.names.join(",")) {
      this.names = names;
      this.destroy();
    }
    if (this.plot && (xRange ? xRange[1] - xRange[0] : 0) !== this.span) this.destroy();
    this.xRange = xRange;
    this.el.dataset.range = rangeKey;
    const width = Math.max(this.box.clientWidth, 200);
    if (!this.plot) {
      const series = [{}, ...this.names.map((name, i) => ({
        label: name, stroke: colorOf(name, i), width: 1.5, spanGaps: false,
        points: this.options.points ? { show: true, size: 5, fill: colorOf(name, i) } : { show: false },
      }))];
      const span = this.options.span;
      this.span = xRange ? xRange[1] - xRange[0] : 0;
      const x = span ? { time: true, range: (u, min, max) => [max - span, max] }
        : { time: true, range: (u, min, max) => (this.xRange ? this.xRange : [min, max]) };
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
    this.plot = null;
    this.box.replaceChildren();
  }
}

export function mount(main) {
  const updated = h("span.muted#dash-updated", null, "loading…");
  const picker = h("div.range-picker#range-picker", { role: "group", "aria-label": "Time range" },
    RANGES.map(([seconds, label]) => h("button.small", {
      type: "button", "data-range": String(seconds), "aria-pressed": String(seconds === view.range),
      onclick: () => choose(seconds),
    }, label)));
  const stats = h("div.stats", null,
    stat("stat-rps", "Requests/s", "last minute"),
    stat("stat-requests", "Requests", ""),
    stat("stat-error-rate", "Error rate", ""),
    stat("stat-p50", "TTFB p50", ""),
    stat("stat-p95", "TTFB p95", ""),
    stat("stat-ttft-p50", "TTFT p50", ""),
    stat("stat-ttft-p95", "TTFT p95", ""),
    stat("stat-inflight", "In flight", "now"),
    stat("stat-repairs", "Tool repairs", ""),
    stat("stat-overflows", "Over budget", ""));
  const facts = h("p.facts#dash-facts");
  const charts = h("div.charts");
  const breakdown = h("section.card#breakdown", null, h("h2", null, "By protocol and by mode"));
  const health = h("section.card#credential-health", null, h("h2", null, "Upstream credentials"));
  const byKey = h("section.card#key-usage", null, h("h2", null, "Usage by client key, today"));
  const replicas = h("section.card#replicas", null, h("h2", null, "Replicas"));
  const error = h("p.notice.error", { hidden: true });
  // the live indicator says what the last poll found: live, or offline (no answer: the gateway
  // is down or unreachable), never a green dot over stale numbers
  const liveText = h("span.live-text", null, "connecting…");
  const live = h("span.live#live-state", { "data-state": "connecting", role: "status" }, h("span.live-dot"), liveText);
  // no requests in the range: a first request to send instead of a wall of empty charts
  const firstRequest = h("section.card#first-request", { hidden: true });
  replace(main,
    h("div.page-head", null, h("h1", null, "Dashboard"), live, updated, h("span.spacer"), picker),
    error, stats, facts, firstRequest, charts, h("div.two-col", null, breakdown, health), replicas, byKey);

  const chartRps = new Chart(charts, "chart-rps", "Requests/s by protocol", PROTOCOLS, "req/s");
  const chartModes = new Chart(charts, "chart-modes", "Requests/s by mode", MODES, "req/s");
  const chartErrors = new Chart(charts, "chart-error-rate", "Error rate by mode (%)", MODES, "%", { points: true });
  const chartCodes = new Chart(charts, "chart-error-codes", "Errors by code (requests per bucket)", [], "requests",
    { points: true });
  const chartTtft = new Chart(charts, "chart-ttft", "Time to first token (ms)", ["p50", "p95"], "ms", { points: true });
  const chartTtfb = new Chart(charts, "chart-ttfb", "Time to first byte (ms)", ["p50", "p95"], "ms", { points: true });
  const chartTtftModes = new Chart(charts, "chart-ttft-modes", "Time to first token p95 by mode (ms)", MODES, "ms",
    { points: true });
  const chartDuration = new Chart(charts, "chart-duration", "Request duration (ms)", ["p50", "p95"], "ms",
    { points: true });
  const chartTokens = new Chart(charts, "chart-tokens", "Output tokens/s by model", [], "tokens/s");
  const chartInflight = new Chart(charts, "chart-inflight", "Requests in flight by protocol (mean per bucket)",
    PROTOCOLS, "requests");
  const chartUpstreams = new Chart(charts, "chart-upstream-requests", "Upstream requests/s by upstream", [], "req/s");
  const chartUpstreamErrors = new Chart(charts, "chart-upstream-errors", "Upstream errors by upstream (per bucket)", [],
    "errors", { points: true });
  const all = [chartRps, chartModes, chartErrors, chartCodes, chartTtft, chartTtfb, chartTtftModes, chartDuration,
    chartTokens, chartInflight, chartUpstreams, chartUpstreamErrors];
  let timer = null;
  let stopped = false;
  let generation = 0; // a poll answered after the range changed is dropped

  function choose(seconds) {
    view.range = seconds;
    for (const b of picker.querySelectorAll("button")) b.setAttribute("aria-pressed", String(b.dataset.range === String(seconds)));
    clearTimeout(timer);
    generation += 1;
    poll();
  }

  function series(group, name, f) {
    const g = group[name];
    return g ? g[f] : null;
  }

  function setLive(state, text, title) {
    live.dataset.state = state;
    live.title = title;
    liveText.textContent = text;
  }

  let empty = false;
  async function showFirstRequest(ts, st, span) {
    empty = ts.total.summary.requests === 0;
    charts.hidden = empty;
    if (!empty) {
      firstRequest.hidden = true;
      return;
    }
    const shape = `${span}:${st.client_auth.key_required}`;
    if (firstRequest.dataset.shape !== shape) { // built once per range and key posture, shown once built
      firstRequest.dataset.shape = shape;
      await firstRequestCard(firstRequest, span, st.client_auth);
    }
    firstRequest.hidden = !empty;
  }

  function render(ts, st) {
    const [seconds, label, bucket] = rangeOf(view.range);
    const span = `last ${label}`;
    showFirstRequest(ts, st, span);
    const now = st.time;
    const times = ts.times;
    const zeros = times.map(() => 0);
    const rate = (counts) => (counts || zeros).map((c) => c / ts.bucket);
    const total = ts.total.summary;
    const xRange = [ts.since, ts.until];
    main.querySelector(".page-head").dataset.range = String(seconds);
    setStat("stat-rps", lastMinuteRate(times, ts.total.requests, now, bucket),
      fmtNumber(lastMinuteRate(times, ts.total.requests, now, bucket), 2));
    setStat("stat-requests", total.requests, fmtNumber(total.requests), span);
    setStat("stat-error-rate", total.error_rate, fmtPercent(total.error_rate),
      `${fmtNumber(total.errors)} errors, ${span}`);
    setStat("stat-p50", total.ttfb_ms_p50, fmtMs(total.ttfb_ms_p50), span);
    setStat("stat-p95", total.ttfb_ms_p95, fmtMs(total.ttfb_ms_p95), span);
    setStat("stat-ttft-p50", total.ttft_ms_p50, fmtMs(total.ttft_ms_p50), span);
    setStat("stat-ttft-p95", total.ttft_ms_p95, fmtMs(total.ttft_ms_p95), span);
    setStat("stat-inflight", st.in_flight, `${st.in_flight}`, inFlightSub(st));
    const inflight = document.getElementById("stat-inflight");
    inflight.dataset.cap = String(capOf(st)); // this replica's, not the global cap
    inflight.title = inFlightTitle(st);
    setStat("stat-repairs", st.tool_repairs, fmtNumber(st.tool_repairs),
      `in ${st.requests_with_repairs} request(s), ${span}`);
    setStat("stat-overflows", st.budget_overflows, fmtNumber(st.budget_overflows), span);
    replace(facts,
      "Stream mode ", h("strong#dash-mode", null, st.stream_mode),
      st.replica ? [" · replica ", h("strong.mono#dash-replica", null, st.replica.replica_id)] : null,
      " · settings revision ", h("strong", null, String(st.revision)),
      " · credentials usable ", h("strong", null, `${st.credentials_usable} / ${st.credentials.length}`),
      " · audit queue ", h("strong", null, String(st.audit_queue_depth)),
      st.capture ? [" · capture ", h("strong#dash-capture", null, captureText(st.capture))] : null);
    updated.textContent = `${span} · ${ts.bucket}s buckets · updated ${new Date(now * 1000).toLocaleTimeString()}`;

    chartRps.update([times, ...PROTOCOLS.map((p) => rate(series(ts.by_protocol, p, "requests")))], null, xRange);
    chartModes.update([times, ...MODES.map((m) => rate(series(ts.by_mode, m, "requests")))], null, xRange);
    chartErrors.update([times, ...MODES.map((m) => {
      const req = series(ts.by_mode, m, "requests");
      const err = series(ts.by_mode, m, "errors");
      return times.map((_, i) => (req && req[i] ? (100 * err[i]) / req[i] : null));
    })], null, xRange);
    const codes = Object.keys(ts.by_error_code);
    chartCodes.update([times, ...codes.map((c) => ts.by_error_code[c].requests.map((n) => n || null))], codes, xRange);
    chartTtft.update([times, ts.total.ttft_ms_p50, ts.total.ttft_ms_p95], null, xRange);
    chartTtfb.update([times, ts.total.ttfb_ms_p50, ts.total.ttfb_ms_p95], null, xRange);
    chartTtftModes.update([times, ...MODES.map((m) => series(ts.by_mode, m, "ttft_ms_p95") || times.map(() => null))],
      null, xRange);
    chartDuration.update([times, ts.total.duration_ms_p50, ts.total.duration_ms_p95], null, xRange);
    const models = Object.keys(ts.by_model);
    chartTokens.update([times, ...models.map((m) => ts.by_model[m].tokens_per_second)], models, xRange);

    chartInflight.update([times, ...PROTOCOLS.map((p) => series(ts.by_protocol, p, "in_flight_mean") || zeros)],
      null, xRange);
    // every attempt counts (failed-over ones too): each upstream's own load and health
    const upstreams = Object.keys(ts.by_upstream || {});
    chartUpstreams.update([times, ...upstreams.map((u) => rate(ts.by_upstream[u].requests))], upstreams, xRange);
    chartUpstreamErrors.update([times, ...upstreams.map((u) => ts.by_upstream[u].errors.map((n) => n || null))],
      upstreams, xRange);

    renderBreakdown(ts, st, span);
    renderHealth(st);
    renderReplicas(replicas, st);
  }

  function renderBreakdown(ts, st, span) {
    const row = (kind, name, group, inFlight) => {
      const s = group ? group.summary : { requests: 0, errors: 0, error_rate: 0 };
      return h("tr", { "data-group": `${kind}:${name}` },
        h("td", null, h("span.swatch", { style: `background:${COLORS[name]}` }), name),
        h("td.num", null, fmtNumber(s.requests)),
        h("td.num", null, fmtNumber(s.requests / ts.window, 3)),
        h("td.num", null, fmtPercent(s.error_rate)),
        h("td.num", null, fmtMs(s.ttfb_ms_p50)),
        h("td.num", null, fmtMs(s.ttft_ms_p50)),
        h("td.num", null, fmtMs(s.ttft_ms_p95)),
        h("td.num", null, inFlight === undefined ? "–" : String(inFlight)));
    };
    const head = h("thead", null, h("tr", null,
      ["", "Requests", "Req/s", "Error rate", "TTFB p50", "TTFT p50", "TTFT p95", "In flight"].map((t) => h("th", null, t))));
    replace(breakdown, h("h2", null, `By protocol and by mode, ${span}`),
      h("table.grid", null, head, h("tbody", null,
        h("tr.group", null, h("th", { colspan: 8 }, "Protocol")),
        PROTOCOLS.map((p) => row("protocol", p, ts.by_protocol[p], st.in_flight_by_protocol[p] || 0)),
        h("tr.group", null, h("th", { colspan: 8 }, "Mode")),
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
    // the same reasons as GET /readyz (store writable, spill journal empty, audit queue, credentials):
    // "degraded" while every reason still lets this replica serve, "not ready" once one does not
    const notReady = st.not_ready || [];
    const unready = notReady.some((r) => r.impact !== "degraded");
    const said = notReady.map((r) => r.message).join("; ");
    const ready = h("p#dash-ready", null, "Readiness: ", !notReady.length
      ? h("span.pill.ok", null, "ready")
      : unready ? h("span.pill.error", null, `not ready: ${said}`) : h("span.pill.warn", null, `degraded: ${said}`));
    replace(health, h("h2", null, "Upstream credentials"), ready,
      rows.length ? h("table.grid", null,
        h("thead", null, h("tr", null, ["Upstream", "Key", "Health", "In flight"].map((t) => h("th", null, t)))),
        h("tbody", null, rows)) : h("p.muted", null, "No upstream credentials configured."),
      h("p", null, h("a", { href: "#/credentials" }, "Manage credentials →")));
  }

  // managed client keys (issue #28): requests and tokens of each active key today (UTC)
  function renderKeys(keys) {
    const active = keys.filter((k) => !k.revoked_at);
    const budget = (k) => (k.daily_tokens ? ` of ${fmtNumber(k.daily_tokens)}` : "");
    replace(byKey, h("h2", null, "Usage by client key, today"),
      active.length ? h("table.grid", null,
        h("thead", null, h("tr", null, ["Key", "Requests", "Tokens"].map((t) => h("th", null, t)))),
        h("tbody", null, active.map((k) => h("tr", { "data-key-name": k.name },
          h("td", null, k.name),
          h("td.num", null, fmtNumber(k.usage.requests_today)),
          h("td.num", null, `${fmtNumber(k.usage.tokens_today)}${budget(k)}`))))) : h("p.muted", null, "No managed client keys."),
      h("p", null, h("a", { href: "#/keys" }, "Manage keys →")));
  }

  async function poll() {
    if (stopped) return;
    if (!document.hidden) {
      try {
        const [seconds, , bucket] = rangeOf(view.range);
        const asked = generation;
        const bounded = { timeoutMs: POLL_TIMEOUT_MS };
        const [ts, st, ks] = await Promise.all([
          get(`/admin/api/audit/timeseries?window=${seconds}&bucket=${bucket}`, bounded),
          get(`/admin/api/status?window=${seconds}`, bounded),
          get("/admin/api/keys", bounded),
        ]);
        if (stopped || asked !== generation) return;
        error.hidden = true;
        render(ts, st);
        renderKeys(ks.keys);
        setLive("live", "live", `refreshing every ${rangeOf(view.range)[3] / 1000} s`);
      } catch (exc) {
        if (stopped) return;
        error.textContent = `Could not refresh: ${exc.message}`;
        error.hidden = false;
        const since = new Date().toLocaleTimeString();
        if (exc.status === 0) setLive("offline", `offline: the gateway does not answer (since ${since})`, exc.message);
        else setLive("error", `error: ${exc.message}`, exc.message);
      }
    }
    // while offline, look again soon whatever the range: the indicator comes back with the gateway
    timer = setTimeout(poll, live.dataset.state === "live" ? rangeOf(view.range)[3] : POLL_MS);
  }

  poll();
  return () => {
    stopped = true;
    clearTimeout(timer);
    for (const chart of all) chart.destroy();
  };
}
