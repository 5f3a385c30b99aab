// Managed client keys (issue #28): create one (its secret is shown once, with a copy
// button, and never again), edit its models and limits, revoke it, and see its usage
// today, over /admin/api/keys. The secret lives only in this page's memory until the
// admin leaves it.

import { api, del, get, post } from "./api.js";
import { fmtNumber, fmtTime, h, notice, replace } from "./dom.js";

const LIMITS = [
  ["rpm", "Requests / min"], ["tpm", "Tokens / min"], ["max_concurrent", "Concurrent"],
  ["daily_tokens", "Tokens / day"], ["budget_tokens", "Token budget"], ["max_output_tokens", "Default output cap"],
];
const PERIODS = ["day", "week", "month"];

/** The form's fields -> a create or change body (empty = no limit; models: comma-separated globs). */
function bodyOf(inputs) {
  const body = {};
  for (const [name] of LIMITS) {
    const raw = inputs[name].value.trim();
    body[name] = raw === "" ? null : Number(raw);
  }
  const models = inputs.models.value.split(",").map((s) => s.trim()).filter(Boolean);
  body.models = models.length ? models : null;
  const expires = inputs.expires_at.value.trim();
  body.expires_at = expires === "" ? null : expires;
  const money = inputs.budget_cost.value.trim();
  body.budget_cost = money === "" ? null : Number(money);
  body.budget_period = inputs.budget_period.value;
  return body;
}

function fields(prefix) {
  const inputs = {
    models: h(`input#${prefix}-models`, { type: "text", name: "models", placeholder: "all models (e.g. gpt-4o*, claude-*)" }),
    expires_at: h(`input#${prefix}-expires`, { type: "text", name: "expires_at", placeholder: "never (e.g. 2027-01-01T00:00:00Z)" }),
    // money per period, in the currency of the --config prices (a model without a price is refused)
    budget_cost: h(`input#${prefix}-budget-cost`, { type: "number", min: "0", step: "any", name: "budget_cost", placeholder: "no limit" }),
    budget_period: h(`select#${prefix}-budget-period`, { name: "budget_period" },
      PERIODS.map((p) => h("option", { value: p }, p))),
  };
  for (const [name] of LIMITS) {
    inputs[name] = h(`input#${prefix}-${name.replaceAll("_", "-")}`, { type: "number", min: "0", step: "1", name, placeholder: "no limit" });
  }
  const labels = [
    h("label.filter", null, "Models", inputs.models),
    ...LIMITS.map(([name, label]) => h("label.filter", null, label, inputs[name])),
    h("label.filter", null, "Money budget", inputs.budget_cost),
    h("label.filter", null, "Budget period", inputs.budget_period),
    h("label.filter", null, "Expires", inputs.expires_at),
  ];
  return { inputs, labels };
}

const limitText = (v) => (v === null || v === undefined ? "–" : fmtNumber(v));

/** The budgets per period: "1,000,000 tokens, 25 / month" (spent so far under it when known). */
function budgetText(k) {
  const parts = [];
  if (k.budget_tokens !== null && k.budget_tokens !== undefined) parts.push(`${fmtNumber(k.budget_tokens)} tokens`);
  if (k.budget_cost !== null && k.budget_cost !== undefined) parts.push(fmtNumber(k.budget_cost, 2));
  return parts.length ? `${parts.join(", ")} / ${k.budget_period}` : "–";
}

function spentText(k) {
  const left = k.budget_left;
  if (!left) return "";
  const parts = [];
  if (left.tokens !== null && left.tokens !== undefined) parts.push(`${fmtNumber(left.tokens)} tokens`);
  if (left.cost !== null && left.cost !== undefined) parts.push(fmtNumber(left.cost, 4));
  return parts.length ? `left: ${parts.join(", ")}` : "";
}

export function mount(main) {
  const status = notice();
  const tbody = h("tbody#key-rows");
  const total = h("span.muted#key-summary");
  const secretBox = h("section.card#key-secret", { hidden: true });
  const name = h("input#key-name", { type: "text", name: "name", required: true, placeholder: "team or user" });
  const create = fields("key");
  const createForm = h("form.inline-form#create-key", { onsubmit: (e) => { e.preventDefault(); add(); } },
    h("label.filter", null, "Name", name), ...create.labels,
    h("button.primary#create-key-button", { type: "submit" }, "Create key"));
  const edit = fields("edit");
  const editTitle = h("h2#edit-title", null, "Edit");
  let editing = null;
  const editForm = h("form.inline-form#edit-key", { onsubmit: (e) => { e.preventDefault(); save(); } },
    ...edit.labels,
    h("button.primary#save-key-button", { type: "submit" }, "Save limits"),
    h("button.small#cancel-edit", { type: "button", onclick: () => { editCard.hidden = true; editing = null; } }, "Cancel"));
  const editCard = h("section.card#edit-card", { hidden: true }, editTitle, editForm);
  // what a (first) key does to /v1 (GET /admin/api/status client_auth), said where the key is made
  const lockNotice = h("p.notice#keys-lock-notice", { role: "status", hidden: true });
  replace(main,
    h("div.page-head", null, h("h1", null, "Keys"), total),
    status, secretBox,
    h("section.card.table-card", null,
      h("table.grid#keys-table", null,
        h("thead", null, h("tr", null,
          ["Name", "Prefix", "Models", "RPM", "TPM", "Concurrent", "Tokens / day", "Budget", "Requests today", "Tokens today", "State", ""]
            .map((t) => h("th", null, t)))),
        tbody)),
    editCard,
    h("section.card", null, h("h2", null, "Create a client key"),
      h("p.muted", null, "The key is shown once, right after it is created; the gateway keeps only its hash. "
        + "Empty limits mean no limit."),
      lockNotice, createForm));

  async function loadLock() {
    let auth;
    try {
      auth = (await get("/admin/api/status?window=60")).client_auth;
    } catch {
      return;
    }
    lockNotice.dataset.state = auth.locked ? "locked" : auth.key_required ? "required" : "open";
    if (!auth.key_required) {
      lockNotice.className = "notice warn";
      replace(lockNotice, h("strong", null, "Creating the first key locks /v1. "),
        "From then on every /v1 request needs a key, loopback calls included (a curl without one gets 401), "
        + "and revoking the keys later does not open it again.");
    } else if (auth.locked) {
      lockNotice.className = "notice error";
      replace(lockNotice, h("strong", null, "/v1 is locked: "),
        "every request needs a key and none is usable (revoked or expired). Create one here.");
    } else {
      lockNotice.className = "notice";
      replace(lockNotice, "Every /v1 request needs a key, loopback calls included.");
    }
    lockNotice.hidden = false;
  }

  async function load() {
    loadLock();
    let answer;
    try {
      answer = await get("/admin/api/keys");
    } catch (exc) {
      status.show(`Could not load the keys: ${exc.message}`, "error");
      return;
    }
    const keys = answer.keys;
    total.textContent = `${keys.filter((k) => !k.revoked_at).length} active key(s), ${keys.length} in all`;
    if (!keys.length) {
      replace(tbody, h("tr", null, h("td.empty", { colspan: 12 }, "No managed keys yet.")));
      return;
    }
    replace(tbody, keys.map((k) => {
      const expired = k.expires_at && Date.parse(k.expires_at) <= Date.now();
      const state = k.revoked_at ? h("span.pill.error", null, `revoked ${fmtTime(Date.parse(k.revoked_at) / 1000)}`)
        : expired ? h("span.pill.warn", null, "expired") : h("span.pill.ok", null, "active");
      return h("tr", { "data-key-id": k.id, "data-key-name": k.name },
        h("td", null, k.name),
        h("td.mono", null, `${k.prefix}…`),
        h("td.mono", null, k.models ? k.models.join(", ") : "all"),
        h("td.num", null, limitText(k.rpm)),
        h("td.num", null, limitText(k.tpm)),
        h("td.num", null, limitText(k.max_concurrent)),
        h("td.num", null, limitText(k.daily_tokens)),
        h("td.budget", null, budgetText(k), h("span.muted.budget-left", null, spentText(k))),
        h("td.num.requests-today", null, fmtNumber(k.usage.requests_today)),
        h("td.num.tokens-today", null, fmtNumber(k.usage.tokens_today)),
        h("td.key-state", null, state),
        h("td.actions", null, k.revoked_at ? null : [
          h("button.small", { type: "button", "data-action": "edit", onclick: () => startEdit(k) }, "Edit"),
          h("button.small.danger", { type: "button", "data-action": "revoke", onclick: () => revoke(k) }, "Revoke"),
        ]));
    }));
  }

  function startEdit(key) {
    editing = key;
    replace(editTitle, `Edit ${key.name}`);
    for (const [limit] of LIMITS) edit.inputs[limit].value = key[limit] ?? "";
    edit.inputs.models.value = key.models ? key.models.join(", ") : "";
    edit.inputs.expires_at.value = key.expires_at || "";
    edit.inputs.budget_cost.value = key.budget_cost ?? "";
    edit.inputs.budget_period.value = key.budget_period || "day";
    editCard.hidden = false;
    edit.inputs.rpm.focus();
  }

  async function save() {
    if (!editing) return;
    try {
      const changed = await api("PATCH", `/admin/api/keys/${encodeURIComponent(editing.id)}`, bodyOf(edit.inputs));
      status.show(`Saved the limits of ${changed.name}.`, "ok");
      editCard.hidden = true;
      editing = null;
    } catch (exc) {
      status.show(`Not saved: ${exc.message}`, "error");
    }
    load();
  }

  async function revoke(key) {
    if (!window.confirm(`Revoke ${key.name}? Its requests are refused at once, on every replica within two seconds.`)) return;
    try {
      await del(`/admin/api/keys/${encodeURIComponent(key.id)}`);
      status.show(`Revoked ${key.name}.`, "ok");
    } catch (exc) {
      status.show(`Revoke failed: ${exc.message}`, "error");
    }
    load();
  }

  async function add() {
    try {
      const created = await post("/admin/api/keys", { name: name.value.trim(), ...bodyOf(create.inputs) });
      name.value = "";
      for (const input of Object.values(create.inputs)) input.value = "";
      create.inputs.budget_period.value = "day";
      showSecret(created);
      status.clear();
    } catch (exc) {
      status.show(`Not created: ${exc.message}`, "error");
    }
    load();
  }

  function showSecret(created) {
    const secret = h("input#key-secret-value.mono", { type: "text", readonly: true, value: created.key, size: 60 });
    const copied = h("span.muted#key-copied", null, "");
    const copy = h("button.primary#copy-key", {
      type: "button",
      onclick: async () => {
        try {
          await navigator.clipboard.writeText(created.key);
          copied.textContent = "Copied.";
        } catch {
          secret.select(); // no clipboard permission: selected for Ctrl+C
          copied.textContent = "Selected: press Ctrl+C.";
        }
      },
    }, "Copy");
    const done = h("button.small#dismiss-key", { type: "button", onclick: () => { secretBox.hidden = true; secretBox.replaceChildren(); } },
      "I have saved it");
    replace(secretBox, h("h2", null, `Key for ${created.name}`),
      h("p.notice.warn", null, "Copy this key now: it is shown only once. The gateway keeps only its hash."),
      h("p", null, secret, " ", copy, " ", copied), done);
    secretBox.hidden = false;
  }

  load();
  return () => { secretBox.replaceChildren(); };
}
