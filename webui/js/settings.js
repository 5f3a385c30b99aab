// Settings: the stream-mode toggle and the run-time knobs, each with where its value comes
// from. Saves are revisioned: PUT /admin/api/settings {revision, changes} with the revision
// this page read, so a change made elsewhere in the meantime is a 409, never overwritten.

import { ApiError, get, put } from "./api.js";
import { fmtBytes, fmtTime, h, notice, replace } from "./dom.js";

/** The knobs on this page (every other setting is listed read-only below them). */
const FIELDS = [
  { name: "max_collect_bytes", label: "Output budget", unit: "bytes", step: 1, min: 0, integer: true,
    hint: (v) => (Number(v) === 0 ? "0 = unlimited" : `${fmtBytes(Number(v))} per request; 0 = unlimited`) },
  { name: "tool_repair_attempts", label: "Tool repair attempts", unit: "regenerations", step: 1, min: 0, max: 10,
    integer: true, hint: () => "How often a bad tool call may be regenerated (0–10)" },
  { name: "keepalive_interval", label: "Keepalive interval", unit: "seconds", step: 0.1, min: 0.1, max: 60,
    hint: () => "Seconds between keepalive events while a client waits" },
  { name: "max_concurrent", label: "Max concurrent requests", unit: "requests", step: 1, min: 1, integer: true,
    hint: () => "Global cap on generation requests running at once" },
];
const SOURCE_TEXT = { cli: "command-line flag", env: "environment", saved: "saved here", default: "default" };

function sourceBadge(item) {
  return h(`span.badge.source-${item.source}`, { title: `value from: ${SOURCE_TEXT[item.source] || item.source}` },
    item.source);
}

function lockNote(item) {
  return item.locked ? h("p.lock", null, `Locked: ${item.locked}`) : null;
}

export function mount(main) {
  let view = null; // the last GET/PUT answer: {revision, settings, modes}
  const status = notice();
  const body = h("div.settings-body");
  replace(main,
    h("div.page-head", null, h("h1", null, "Settings"),
      h("span.muted#settings-revision", null, "")),
    status, body);

  async function load(message) {
    try {
      view = await get("/admin/api/settings");
    } catch (exc) {
      status.show(`Could not load the settings: ${exc.message}`, "error");
      return;
    }
    render();
    if (message) status.show(message, "ok");
    else status.clear();
  }

  function current(name) {
    return view.settings[name];
  }

  function render() {
    document.getElementById("settings-revision").textContent = `revision ${view.revision}`;
    const mode = current("stream_mode");
    const modeChoices = Object.entries(view.modes).map(([value, help]) => h("label.mode-choice", {
      class: value === mode.value ? "chosen" : "",
    },
    h("input", { type: "radio", name: "stream_mode", value, checked: value === mode.value,
                 disabled: Boolean(mode.locked), "data-testid": `mode-${value}`,
                 onchange: () => { markChosen(); dirty(); } }),
    h("span.mode-name", null, value),
    h("span.mode-help", null, help)));

    const modeCard = h("section.card#stream-mode-card", { class: mode.locked ? "locked" : "" },
      h("div.card-head", null, h("h2", null, "Stream mode"), sourceBadge(mode)),
      h("p.muted", null, "Applies to requests that start after saving; running requests keep theirs."),
      h("div.mode-choices", null, modeChoices),
      lockNote(mode));

    const rows = FIELDS.map((field) => {
      const item = current(field.name);
      const input = h("input", {
        id: `field-${field.name}`, name: field.name, type: "number", step: field.step, min: field.min,
        max: field.max, value: String(item.value), disabled: Boolean(item.locked),
        oninput: () => { hint.textContent = field.hint(input.value); dirty(); },
      });
      const hint = h("span.hint", null, field.hint(item.value));
      return h("div.field", { class: item.locked ? "locked" : "", "data-setting": field.name },
        h("label", { for: `field-${field.name}` }, field.label),
        h("div.field-input", null, input, h("span.unit", null, field.unit), sourceBadge(item)),
        hint, lockNote(item));
    });

    const save = h("button.primary#save-settings", { type: "submit" }, "Save");
    const unsaved = h("span.muted#unsaved", { hidden: true }, "unsaved changes");
    // novalidate: the API validates (like the CLI) and its message is the one shown
    const form = h("form#settings-form", { novalidate: true, onsubmit: (e) => { e.preventDefault(); submit(); } },
      modeCard,
      h("section.card", null, h("div.card-head", null, h("h2", null, "Limits and timing")), rows),
      h("div.form-actions", null, save, unsaved));

    replace(body, form, allSettings(), h("section.card#history", null, h("h2", null, "Recent changes"),
      h("p.muted", null, "loading…")));
    loadHistory();

    function markChosen() {
      for (const label of form.querySelectorAll(".mode-choice")) {
        label.classList.toggle("chosen", label.querySelector("input").checked);
      }
    }
    function dirty() {
      unsaved.hidden = Object.keys(changes()).length === 0;
    }
  }

  function changes() {
    const out = {};
    const chosen = body.querySelector("input[name=stream_mode]:checked");
    if (chosen && chosen.value !== current("stream_mode").value) out.stream_mode = chosen.value;
    for (const field of FIELDS) {
      const input = body.querySelector(`#field-${field.name}`);
      if (!input || input.disabled || input.value === "") continue;
      const value = field.integer ? Number.parseInt(input.value, 10) : Number.parseFloat(input.value);
      if (value !== current(field.name).value) out[field.name] = Number.isNaN(value) ? input.value : value;
    }
    return out;
  }

  async function submit() {
    const wanted = changes();
    if (Object.keys(wanted).length === 0) {
      status.show("Nothing to save: no value was changed.", "info");
      return;
    }
    const button = body.querySelector("#save-settings");
    button.disabled = true;
    try {
      view = await put("/admin/api/settings", { revision: view.revision, changes: wanted });
      render();
      status.show(`Saved: ${Object.keys(wanted).join(", ")} (now revision ${view.revision}).`, "ok");
    } catch (exc) {
      button.disabled = false;
      if (exc instanceof ApiError && exc.code === "stale_revision") {
        const reload = h("button#reload-settings", { type: "button", onclick: () => load("Reloaded the current settings.") },
          "Reload");
        const now = exc.body.error.current_revision;
        status.show(
          `These settings were changed elsewhere (now revision ${now}; this page read revision ${view.revision}). `
          + "Your change was not saved; reload to see the current values, then make it again. ",
          "warn", reload);
      } else {
        status.show(`Not saved: ${exc.message}`, "error");
      }
    }
  }

  function allSettings() {
    const rows = Object.entries(view.settings).sort(([a], [b]) => a.localeCompare(b)).map(([name, item]) =>
      h("tr", null,
        h("td.mono", null, name),
        h("td.mono", null, item.value === null ? "–" : typeof item.value === "string" ? item.value : JSON.stringify(item.value)),
        h("td", null, sourceBadge(item)),
        h("td.muted", null, item.locked || "editable"),
        h("td.muted", null, item.description)));
    return h("details.card", null, h("summary", null, "All settings (read-only)"),
      h("table.grid", null,
        h("thead", null, h("tr", null, ["Name", "Value", "Source", "Lock", "Meaning"].map((t) => h("th", null, t)))),
        h("tbody", null, rows)));
  }

  async function loadHistory() {
    const section = body.querySelector("#history");
    let history;
    try {
      ({ history } = await get("/admin/api/settings/history"));
    } catch (exc) {
      replace(section, h("h2", null, "Recent changes"), h("p.muted", null, exc.message));
      return;
    }
    const rows = history.slice(0, 10).map((entry) => h("tr", null,
      h("td", null, String(entry.revision)),
      h("td", null, fmtTime(entry.at)),
      h("td", null, entry.actor),
      h("td.mono", null, Object.entries(entry.changes).map(([k, v]) =>
        `${k}: ${JSON.stringify(v.old)} → ${JSON.stringify(v.new)}`).join("; "))));
    replace(section, h("h2", null, "Recent changes"),
      rows.length ? h("table.grid", null,
        h("thead", null, h("tr", null, ["Revision", "When", "Who", "Changes"].map((t) => h("th", null, t)))),
        h("tbody", null, rows)) : h("p.muted", null, "No saved changes yet."));
  }

  load();
  return null;
}
