// The dashboard's empty state (issue #38): with no requests in the chosen range, a first
// request to send (a curl against this gateway's own address, copyable) instead of a wall of
// empty charts. No secret is ever in it: when /v1 needs a client key, the command reads it
// from $CODEBUDDY2API_KEY and says where to make one.

import { get } from "./api.js";
import { h, replace } from "./dom.js";

/** The model to name: the first one /v1/models lists (open on loopback), else a placeholder. */
async function someModel(keyRequired) {
  if (keyRequired) return "MODEL";
  try {
    const models = await get("/v1/models", { timeoutMs: 5000 });
    return (models.data && models.data[0] && models.data[0].id) || "MODEL";
  } catch {
    return "MODEL";
  }
}

/** The shell command: JSON in single quotes (a model id never holds one; it is escaped anyway). */
export function curlCommand(origin, model, keyRequired) {
  const body = JSON.stringify({ model, messages: [{ role: "user", content: "Say hello" }] }).replaceAll("'", "'\\''");
  const lines = [`curl -sS ${origin}/v1/chat/completions`, "  -H 'content-type: application/json'"];
  if (keyRequired) lines.push("  -H \"authorization: Bearer $CODEBUDDY2API_KEY\"");
  lines.push(`  -d '${body}'`);
  return lines.join(" \\\n");
}

/** Fill `card` with the hint; `clientAuth` is GET /admin/api/status's `client_auth`. */
export async function firstRequestCard(card, span, clientAuth) {
  const keyRequired = clientAuth.key_required;
  const model = await someModel(keyRequired);
  const command = curlCommand(location.origin, model, keyRequired);
  const copied = h("span.muted#first-request-copied", null, "");
  const code = h("pre.body.command#first-request-command", null, command);
  const copy = h("button.small#copy-first-request", {
    type: "button",
    onclick: async () => {
      try {
        await navigator.clipboard.writeText(command);
        copied.textContent = "Copied.";
      } catch {
        getSelection().selectAllChildren(code); // no clipboard permission: selected for Ctrl+C
        copied.textContent = "Selected: press Ctrl+C.";
      }
    },
  }, "Copy");
  replace(card,
    h("h2", null, `No requests yet (${span})`),
    h("p", null, "Send a first request to this gateway; the charts appear as soon as requests arrive."),
    keyRequired
      ? h("p.notice.warn", null, "Every /v1 request needs a client key here: create one on the ",
        h("a", { href: "#/keys" }, "Keys page"), ", then export it as CODEBUDDY2API_KEY.")
      : null,
    model === "MODEL" ? h("p.muted", null, "Replace MODEL with a model your upstream serves.") : null,
    code, h("p", null, copy, " ", copied));
}
