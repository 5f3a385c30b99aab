// Upstream credentials: list (labels and fingerprints only: keys go in, never come out), add (the
// gateway probes it at once; the result is shown), delete one added here, disable, re-enable
// and reset cooldowns, over /admin/api/credentials.

import { del, get, post } from "./api.js";
import { fmtNumber, fmtPercent, fmtTime, h, notice, replace } from "./dom.js";

export function mount(main) {
  const status = notice();
  const tbody = h("tbody#credential-rows");
  const baseUrl = h("input#cred-base-url", { type: "url", name: "base_url", required: true,
                                             placeholder: "https://api.example.com/v1" });
  const apiKey = h("input#cred-api-key", { type: "password", name: "api_key", autocomplete: "off",
                                           placeholder: "sk-… (optional)" });
  const upstream = h("input#cred-upstream", { type: "text", name: "upstream", placeholder: "admin" });
  // the operator's name for the key (the API's `label`, at most 100 printable characters)
  const label = h("input#cred-label", { type: "text", name: "label", maxlength: "100",
                                        placeholder: "admin API (optional)" });
  const addForm = h("form.inline-form#add-credential", { onsubmit: (e) => { e.preventDefault(); add(); } },
    h("label.filter", null, "Base URL", baseUrl),
    h("label.filter", null, "API key", apiKey),
    h("label.filter", null, "Upstream name", upstream),
    h("label.filter", null, "Label", label),
    h("button.primary#add-credential-button", { type: "submit" }, "Add credential"));
  const total = h("span.muted#cred-summary");
  replace(main,
    h("div.page-head", null, h("h1", null, "Credentials"), total),
    status,
    h("section.card.table-card", null,
      h("table.grid#credentials-table", null,
        h("thead", null, h("tr", null,
          ["Upstream", "Base URL", "Key", "State", "Success (24 h)", "Last error", "Cooldowns", "In flight", ""].map((t) => h("th", null, t)))),
        tbody)),
    h("section.card", null, h("h2", null, "Add an upstream credential"),
      h("p.muted", null, "The key is stored in the gateway's database and never shown again; only its fingerprint and label are."),
      addForm));

  async function load() {
    let answer;
    try {
      answer = await get("/admin/api/credentials");
    } catch (exc) {
      status.show(`Could not load the credentials: ${exc.message}`, "error");
      return;
    }
    const creds = answer.credentials;
    total.textContent = `${creds.length} credential(s), ${answer.in_flight} request(s) in flight`;
    if (!creds.length) {
      replace(tbody, h("tr", null, h("td.empty", { colspan: 9 }, "No upstream credentials.")));
      return;
    }
    replace(tbody, creds.map((c) => {
      const cooldowns = Object.entries(c.cooldowns);
      const act = (label, path, tone) => h(`button.small${tone ? `.${tone}` : ""}`, {
        type: "button", "data-action": path,
        onclick: () => action(c, path, label),
      }, label);
      return h("tr", { "data-credential-id": c.id },
        h("td.mono", null, c.upstream),
        h("td.mono", null, c.base_url),
        h("td.cred-key", null, c.label ? h("div.cred-label", null, c.label) : null,
          h("div.mono.muted.cred-fingerprint", null, c.fingerprint)),
        h("td", null, c.disabled
          ? h("span.pill.error", null, `disabled${c.disabled_reason ? `: ${c.disabled_reason}` : ""}`)
          : h("span.pill.ok", null, "enabled"), health(c)),
        h("td.num.success-rate", { "data-value": c.stats.success_rate ?? "" },
          c.stats.success_rate === null ? "–" : fmtPercent(c.stats.success_rate),
          h("span.muted", null, ` of ${fmtNumber(c.stats.succeeded + c.stats.failed)}`)),
        h("td.last-error", null, c.stats.last_error
          ? [h("span.mono", null, c.stats.last_error.code),
             c.stats.last_error.status ? ` (HTTP ${c.stats.last_error.status})` : "",
             h("br"), h("span.muted", null, fmtTime(c.stats.last_error.at))]
          : "–"),
        h("td", null, cooldowns.length
          ? cooldowns.map(([m, s]) => `${m === "*" ? "all models" : m}: ${Math.ceil(s)} s`).join(", ") : "–",
          Object.entries(c.unavailable_models || {}).map(([m, u]) =>
            h("div.muted.cred-unavailable", null, `${m}: passed over ${Math.ceil(u.for_s)} s (${u.reason})`))),
        h("td.num", null, String(c.in_flight)),
        h("td.actions", null,
          c.disabled ? act("Enable", "enable") : act("Disable", "disable", "danger"),
          act("Reset cooldown", "reset"),
          c.added_by_admin ? h("button.small.danger", {
            type: "button", "data-action": "delete", onclick: () => remove(c),
          }, "Delete") : null));
    }));
  }

  // Why and since when a credential is out, and its probes (an upstream 401/403 is
  // re-probed with backoff and healed by itself; an admin's disable stays).
  function health(c) {
    const at = (t) => new Date(t * 1000).toLocaleTimeString();
    const lines = [];
    if (c.disabled && c.disabled_at) lines.push(h("div.muted.cred-since", null, `out since ${at(c.disabled_at)}`));
    if (c.disabled && c.disabled_by === "admin") {
      lines.push(h("div.muted.cred-probe", null, "not probed: stays out until enabled"));
    } else if (c.disabled && c.disabled_by === "upstream") {
      const next = c.next_probe_at ? `next probe ${at(c.next_probe_at)}` : "probe pending";
      lines.push(h("div.muted.cred-probe", null, c.last_probe_at
        ? `last probe ${at(c.last_probe_at)} (${c.last_probe_result}), ${c.probe_failures} failed; ${next}`
        : next));
    } else if (c.last_probe_at) {
      lines.push(h("div.muted.cred-probe", null, `last probe ${at(c.last_probe_at)}: ${c.last_probe_result}`));
    }
    return lines;
  }

  async function action(credential, path, label) {
    try {
      await post(`/admin/api/credentials/${encodeURIComponent(credential.id)}/${path}`);
      status.show(`${label}: ${credential.upstream} ${credential.fingerprint} — done.`, "ok");
    } catch (exc) {
      status.show(`${label} failed: ${exc.message}`, "error");
    }
    load();
  }

  async function remove(credential) {
    if (!window.confirm(`Delete ${credential.upstream} ${credential.fingerprint}? Its key is removed from the store.`)) return;
    try {
      await del(`/admin/api/credentials/${encodeURIComponent(credential.id)}`);
      status.show(`Deleted ${credential.upstream} (${credential.fingerprint}).`, "ok");
    } catch (exc) {
      status.show(`Delete failed: ${exc.message}`, "error");
    }
    load();
  }

  async function add() {
    const body = { base_url: baseUrl.value.trim() };
    if (apiKey.value) body.api_key = apiKey.value;
    if (upstream.value.trim()) body.upstream = upstream.value.trim();
    if (label.value.trim()) body.label = label.value.trim();
    try {
      const created = await post("/admin/api/credentials", body);
      apiKey.value = "";
      label.value = "";
      const probe = created.probe || {};
      const said = `probe: ${probe.result || "not run"}${probe.hint ? ` — ${probe.hint}` : ""}`;
      status.show(`Added ${created.upstream} (${created.label ? `${created.label}, ` : ""}${created.fingerprint}); `, probe.ok ? "ok" : "warn",
        h("span#probe-result", { "data-ok": String(Boolean(probe.ok)) }, said));
      load();
    } catch (exc) {
      status.show(`Not added: ${exc.message}`, "error");
    }
  }

  load();
  return null;
}
