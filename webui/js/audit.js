// The audit viewer: a filterable, paged table over GET /admin/api/audit and one record's
// details from GET /admin/api/audit/{id}, bodies included when the gateway runs with
// --audit-bodies. Request and response bodies come from clients and models: they are shown
// as text (textContent, via dom.h), never interpreted as HTML.

import { get, query } from "./api.js";
import { append, fmtBytes, fmtMs, fmtNumber, fmtTime, h, notice, replace } from "./dom.js";

const PAGE = 50;
const RANGES = [
  ["900", "last 15 minutes"], ["3600", "last hour"], ["86400", "last 24 hours"],
  ["604800", "last 7 days"], ["", "all time"], ["custom", "custom range…"],
];
const OUTCOMES = ["success", "error", "cancelled", "invalid", "refused"];
const PROTOCOLS = ["chat", "responses", "messages"];
const MODES = ["compatible", "realtime"];
const TRANSPORTS = ["http", "websocket"];

// Kept across visits so "back to the list" keeps the filters and page.
const state = { outcome: "", protocol: "", transport: "", mode: "", model: "", upstream: "", key_id: "", error_code: "", request_id: "",
                range: "3600", from: "", to: "", offset: 0 };

function select(id, label, options, value) {
  return h("label.filter", null, label,
    h("select", { id, name: id }, h("option", { value: "" }, "any"),
      options.map((o) => h("option", { value: o, selected: o === value }, o))));
}

function outcomePill(outcome) {
  const tone = { success: "ok", error: "error", invalid: "warn", refused: "warn", cancelled: "muted" }[outcome] || "muted";
  return h(`span.pill.${tone}`, null, outcome || "?");
}

/** Today: the time only; otherwise date and time (the full stamp is in the tooltip). */
function shortTime(seconds) {
  const d = new Date(seconds * 1000);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString() : fmtTime(seconds);
}

/** The upstream that answered (the last attempt: the one that got 200, or the last tried). */
export function upstreamOf(record) {
  const attempts = record.upstream_attempts || [];
  const answered = attempts.filter((a) => a.status === 200);
  const last = (answered.length ? answered : attempts).at(-1);
  return last ? last.upstream : "";
}

/** Attempts with their wall-clock start in local time rather than Unix seconds. */
function localAttempts(attempts) {
  return (attempts || []).map((a) => ({ ...a, started_at: a.started_at ? fmtTime(a.started_at) : a.started_at }));
}

function toEpoch(local) {
  return local ? new Date(local).getTime() / 1000 : "";
}

export function mount(main) {
  const status = notice();
  const rangeSelect = h("select#f-range", { name: "range" },
    RANGES.map(([v, t]) => h("option", { value: v, selected: v === state.range }, t)));
  const from = h("input#f-from", { type: "datetime-local", value: state.from, step: 1 });
  const to = h("input#f-to", { type: "datetime-local", value: state.to, step: 1 });
  const custom = h("span.custom-range", { hidden: state.range !== "custom" },
    h("label.filter", null, "From", from), h("label.filter", null, "To", to));
  rangeSelect.addEventListener("change", () => { custom.hidden = rangeSelect.value !== "custom"; });
  const model = h("input#f-model.narrow", { type: "text", value: state.model, placeholder: "exact model name" });
  const upstream = h("input#f-upstream.narrow", { type: "text", value: state.upstream, placeholder: "upstream name" });
  const errorCode = h("input#f-error-code.narrow", { type: "text", value: state.error_code, placeholder: "e.g. upstream_error",
                                                     list: "known-error-codes" });
  // the managed client keys (revoked ones too: their requests stay in the log), by name
  const keySelect = h("select#f-key", { name: "key_id" }, h("option", { value: "" }, "any"));
  const requestId = h("input#f-request-id", { type: "text", value: state.request_id, placeholder: "req_…" });
  const knownCodes = h("datalist#known-error-codes", null,
    ["upstream_error", "upstream_timeout", "upstream_rate_limited", "upstream_unavailable", "tool_call_invalid",
     "response_too_large", "client_disconnected", "invalid_request", "capacity_exceeded"].map((c) => h("option", { value: c })));
  const form = h("form.filters#audit-filters", {
    onsubmit: (e) => { e.preventDefault(); state.offset = 0; readFilters(); load(); },
  },
  select("f-outcome", "Outcome", OUTCOMES, state.outcome),
  select("f-protocol", "Protocol", PROTOCOLS, state.protocol),
  select("f-transport", "Transport", TRANSPORTS, state.transport),
  select("f-mode", "Mode", MODES, state.mode),
  h("label.filter", null, "Model", model),
  h("label.filter", null, "Upstream", upstream),
  h("label.filter", null, "Key", keySelect),
  h("label.filter", null, "Error code", errorCode, knownCodes),
  h("label.filter", null, "Request id", requestId),
  h("label.filter", null, "Time", rangeSelect),
  custom,
  h("button.primary#apply-filters", { type: "submit" }, "Apply"),
  h("button#refresh-audit", { type: "button", onclick: () => load() }, "Refresh"));

  const summary = h("span.muted#audit-count");
  const tbody = h("tbody#audit-rows");
  const prev = h("button#audit-prev", { type: "button", onclick: () => { state.offset = Math.max(0, state.offset - PAGE); load(); } }, "← Newer");
  const next = h("button#audit-next", { type: "button", onclick: () => { state.offset += PAGE; load(); } }, "Older →");
  // TTFB is on the record's page: its room goes to the Model column, whose names wrap
  // (team-alpha/qwen2.5-coder-32b-instruct reads in full at 1280 px) instead of being cut
  const columns = ["Started", "Request", "Key", "Protocol", "Mode", "Model", "Upstream", "Outcome", "Error",
    "TTFT", "Duration", "Tokens"];
  replace(main,
    h("div.page-head", null, h("h1", null, "Audit log"), summary),
    form, status,
    h("section.card.table-card", null,
      h("table.grid.clickable.fixed#audit-table", null,
        h("colgroup", null, ["c-time", "c-id", "c-key", "c-proto", "c-mode", "c-model", "c-upstream", "c-outcome", "c-error",
          "c-ms", "c-ms", "c-tokens"].map((c) => h(`col.${c}`))),
        h("thead", null, h("tr", null, columns.map((c) => h("th", null, c)))), tbody)),
    h("div.pager", null, prev, next));

  function readFilters() {
    state.outcome = form.querySelector("#f-outcome").value;
    state.protocol = form.querySelector("#f-protocol").value;
    state.transport = form.querySelector("#f-transport").value;
    state.mode = form.querySelector("#f-mode").value;
    state.model = model.value.trim();
    state.upstream = upstream.value.trim();
    state.key_id = keySelect.value;
    state.error_code = errorCode.value.trim();
    state.request_id = requestId.value.trim();
    state.range = rangeSelect.value;
    state.from = from.value;
    state.to = to.value;
  }

  function params() {
    const p = { outcome: state.outcome, protocol: state.protocol, transport: state.transport, mode: state.mode, model: state.model,
                upstream: state.upstream, key_id: state.key_id,
                error_code: state.error_code, request_id: state.request_id, limit: PAGE, offset: state.offset };
    if (state.range === "custom") {
      p.since = toEpoch(state.from);
      p.until = toEpoch(state.to);
    } else if (state.range) {
      p.since = (Date.now() / 1000 - Number(state.range)).toFixed(3);
    }
    return p;
  }

  async function load() {
    let page;
    try {
      page = await get(`/admin/api/audit${query(params())}`);
    } catch (exc) {
      status.show(`Could not load the audit log: ${exc.message}`, "error");
      return;
    }
    status.clear();
    tbody.dataset.loads = String(Number(tbody.dataset.loads || 0) + 1); // tests wait on this
    const first = page.total ? page.offset + 1 : 0;
    summary.textContent = `${fmtNumber(first)}–${fmtNumber(page.offset + page.data.length)} of ${fmtNumber(page.total)}`;
    prev.disabled = page.offset === 0;
    next.disabled = !page.has_more;
    if (!page.data.length) {
      replace(tbody, h("tr", null, h("td.empty", { colspan: columns.length }, "No requests match these filters.")));
      return;
    }
    replace(tbody, page.data.map((r) => {
      const open = () => { location.hash = `#/audit/${encodeURIComponent(r.request_id)}`; };
      const usage = r.usage || {};
      return h("tr", {
        tabindex: 0, "data-request-id": r.request_id, onclick: open,
        onkeydown: (e) => { if (e.key === "Enter") open(); },
      },
      h("td.nowrap", { title: fmtTime(r.started_at) }, shortTime(r.started_at)),
      h("td.mono.cut", { title: r.request_id }, r.request_id),
      h("td.cut", { title: r.key_name || "no managed key", "data-col": "key" }, r.key_name || h("span.muted", null, "–")),
      h("td", { title: `${r.streamed ? "streamed" : "JSON answer"} over ${r.transport || "?"}`, "data-col": "protocol" },
        r.protocol, r.streamed ? "" : h("span.muted", null, " (json)"),
        r.transport === "websocket" ? h("span.muted", null, " (ws)") : ""),
      h("td", { "data-col": "mode" }, r.mode),
      h("td.mono.wrap", { title: r.model, "data-col": "model" }, r.model),
      h("td.mono.cut", { title: upstreamOf(r), "data-col": "upstream" }, upstreamOf(r)),
      h("td", { title: `HTTP ${r.http_status}` }, outcomePill(r.outcome), h("span.muted.status", null, ` ${r.http_status}`)),
      h("td.cut", { title: [r.error_code, r.error_message].filter(Boolean).join(": "), "data-col": "error" },
        r.error_code ? h("span.mono", null, r.error_code) : "",
        r.error_message ? h("span.muted.error-message", null, r.error_message) : ""),
      h("td.num", null, fmtMs(r.ttft_ms)),
      h("td.num", null, fmtMs(r.duration_ms)),
      h("td.num", null, usage.prompt_tokens === undefined ? "–"
        : `${fmtNumber(usage.prompt_tokens)} / ${fmtNumber(usage.completion_tokens)}`));
    }));
  }

  async function loadKeys() {
    let answer;
    try {
      answer = await get("/admin/api/keys");
    } catch {
      return; // the list still works without the names
    }
    replace(keySelect, h("option", { value: "" }, "any"), answer.keys.map((k) => h("option", {
      value: k.id, selected: k.id === state.key_id,
    }, k.revoked_at ? `${k.name} (revoked)` : k.name)));
  }

  loadKeys();
  load();
  return null;
}

// -- one record --------------------------------------------------------------------------

function kv(rows) {
  return h("dl.kv", null, rows.map(([k, v]) => [h("dt", null, k), h("dd", null, v)]));
}

function genericTable(items, id) {
  if (!items || !items.length) return h("p.muted", null, "none");
  const keys = [...new Set(items.flatMap((i) => Object.keys(i)))];
  const cell = (v) => (v === null || v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v));
  return h("table.grid", { id },
    h("thead", null, h("tr", null, keys.map((k) => h("th", null, k)))),
    h("tbody", null, items.map((i) => h("tr", null, keys.map((k) => h("td.mono", null, cell(i[k])))))));
}

function pretty(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
}

function bodiesSection(bodies) {
  const section = h("section.card#audit-bodies", null, h("h2", null, "Bodies"));
  if (!bodies) {
    append(section, h("p.muted", null,
      "Bodies are not stored for this request (start the gateway with --audit-bodies to keep them)."));
    return section;
  }
  const truncated = (name) => (bodies[`${name}_truncated`]
    ? h("p.notice.warn", null, `Cut to the first bytes of ${fmtBytes(bodies[`${name}_truncated`])} (audit_body_max_bytes).`)
    : null);
  if (bodies.response !== undefined) {
    let answer = null;
    try { answer = JSON.parse(bodies.response); } catch { answer = null; }
    append(section, h("h3", null, "Response (as the model answered; shown as plain text)"), truncated("response"));
    if (answer && typeof answer === "object") {
      if (answer.reasoning) append(section, h("h4", null, "Reasoning"), h("pre.body#detail-reasoning", null, answer.reasoning));
      append(section, h("h4", null, "Text"),
        h("pre.body#detail-response-text", null, answer.text || "(no text)"));
      if (answer.tool_calls && answer.tool_calls.length) {
        append(section, h("h4", null, "Tool calls"), genericTable(answer.tool_calls, "detail-tool-calls"));
      }
    } else {
      append(section, h("pre.body#detail-response-text", null, bodies.response));
    }
  } else {
    append(section, h("p.muted", null, "No response body (the request ended before an answer was validated)."));
  }
  if (bodies.request !== undefined) {
    append(section, h("h3", null, "Request (as the client sent it)"), truncated("request"),
      h("pre.body#detail-request", null, pretty(bodies.request)));
  }
  return section;
}

export function mountDetail(main, requestId) {
  const status = notice();
  const body = h("div");
  replace(main,
    h("p", null, h("a#back-to-audit", { href: "#/audit" }, "← Audit log")),
    h("div.page-head", null, h("h1", null, "Request "), h("code.request-id#detail-id", null, requestId)),
    status, body);

  (async () => {
    let r;
    try {
      r = await get(`/admin/api/audit/${encodeURIComponent(requestId)}`);
    } catch (exc) {
      status.show(exc.status === 404 ? `No audit record ${requestId}.` : exc.message, "error");
      return;
    }
    const usage = r.usage || {};
    replace(body,
      h("div.two-col", null,
        h("section.card#detail-summary", null, h("h2", null, "Summary"), kv([
          ["Outcome", outcomePill(r.outcome)],
          ["HTTP status", String(r.http_status)],
          ["Error", r.error_code
            ? h("span#detail-error", null, h("span.mono", null, r.error_code), r.error_message ? ` — ${r.error_message}` : "")
            : "–"],
          ["Upstream", h("span.mono#detail-upstream", null, upstreamOf(r) || "–")],
          ["Protocol", r.protocol],
          ["Transport", h("span#detail-transport", null, r.transport || "–")],
          ["Mode", h("span#detail-mode", null, r.mode)],
          ["Streamed", r.streamed ? "yes" : "no"],
          ["Model", h("span.mono", null, r.model)],
          ["Upstream model", h("span.mono", null, r.upstream_model || "–")],
          ["Finish reason", r.finish_reason || "–"],
          ["Managed key", h("span#detail-key", null, r.key_name || "–")],
          ["Client key", r.client_key_fingerprint || "–"],
          ["Trace id", h("span.mono#detail-trace", null, r.trace_context ? r.trace_context.split("-")[1] : "–")],
        ])),
        h("section.card", null, h("h2", null, "Timing and size"), kv([
          ["Started", fmtTime(r.started_at)],
          ["Ended", fmtTime(r.ended_at)],
          ["Time to first byte", fmtMs(r.ttfb_ms)],
          ["Time to first token", fmtMs(r.ttft_ms)],
          ["Duration", fmtMs(r.duration_ms)],
          ["Output", fmtBytes(r.output_bytes)],
          ["Tool calls", String(r.tool_calls ?? 0)],
          ["Keepalives", String(r.keepalives ?? 0)],
          ["Budget exceeded", r.budget_exceeded ? "yes" : "no"],
          ["Tokens (prompt / completion)", usage.prompt_tokens === undefined ? "–"
            : `${fmtNumber(usage.prompt_tokens)} / ${fmtNumber(usage.completion_tokens)}`],
          ["Reasoning / cached tokens", usage.prompt_tokens === undefined ? "–"
            : `${fmtNumber(usage.reasoning_tokens || 0)} / ${fmtNumber(usage.cached_tokens || 0)}`],
        ]))),
      bodiesSection(r.bodies),
      h("section.card", null, h("h2", null, "Upstream attempts"), genericTable(localAttempts(r.upstream_attempts), "detail-attempts")),
      h("section.card", null, h("h2", null, "Tool-call repairs"), genericTable(localAttempts(r.repairs), "detail-repairs")),
      h("details.card", null, h("summary", null, "Raw record (JSON)"),
        h("pre.body", null, JSON.stringify(r, null, 2))));
  })();
  return null;
}
