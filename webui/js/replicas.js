// The dashboard's replicas card (issue #38) from GET /admin/api/status `replica`: which
// replica this page talks to, its share of max_concurrent (replicas split the global cap),
// and the live replicas as of the last heartbeat, each with its usable credentials, so
// replicas that disagree on them say so in words. Ids, hosts and labels come from the store:
// text nodes only (dom.js).

import { fmtNumber, h, replace } from "./dom.js";

/** This replica's cap: its share when replicas share the store, else the whole max_concurrent. */
export function capOf(st) {
  return st.replica ? st.replica.max_concurrent_share : st.max_concurrent;
}

/** The "In flight" tile's line: the cap this replica admits up to, and whose part it is. */
export function inFlightSub(st) {
  const r = st.replica;
  if (!r || !r.shared) return `now, of ${capOf(st)} allowed`;
  return `now, of ${r.max_concurrent_share} allowed here`; // short: a phone's tile; the card says the rest
}

/** The tile's tooltip: whose cap that is. */
export function inFlightTitle(st) {
  const r = st.replica;
  return r && r.shared ? `this replica's share of max_concurrent ${st.max_concurrent}, split over ${r.live.length} live replicas`
    : `max_concurrent ${st.max_concurrent}`;
}

// a replica's usable credentials: its heartbeat's count; a standalone gateway has only its own
function usableOf(member, st) {
  return member.credentials_usable ?? (member.replica_id === st.replica.replica_id ? st.credentials_usable : null);
}

/** The card's contents: one line for a gateway alone, else a table of the live replicas. */
export function renderReplicas(card, st) {
  const r = st.replica;
  if (!r) {
    replace(card, h("h2", null, "Replicas"), h("p.muted", null, "This gateway does not report replicas."));
    return;
  }
  card.dataset.replica = r.replica_id;
  card.dataset.share = String(r.max_concurrent_share);
  const me = h("p#replica-self", null, "This replica ", h("strong.mono#replica-id", null, r.replica_id), r.shared
    ? [", admitting up to ", h("strong#replica-share", null, String(r.max_concurrent_share)),
       ` of the ${st.max_concurrent} shared by ${r.live.length} live replica(s).`]
    : [" shares its store with no one: its cap is all of ",
       h("strong#replica-share", null, String(r.max_concurrent_share)), "."]);
  if (!r.shared) {
    replace(card, h("h2", null, "Replicas"), me);
    return;
  }
  const counts = r.live.map((m) => usableOf(m, st)).filter((n) => n !== null && n !== undefined);
  const agree = new Set(counts).size <= 1;
  const said = r.live.map((m) => `${m.replica_id} ${usableOf(m, st) ?? "?"}`).join(", ");
  const verdict = agree
    ? h("p#replicas-agreement", { "data-agree": "true" }, h("span.pill.ok", null, "agree"),
      ` Every live replica has ${counts.length ? counts[0] : "?"} usable credential(s)`)
    : h("p#replicas-agreement", { "data-agree": "false" },
      h("span.pill.warn", null, "mismatch"), ` Replicas disagree on usable credentials: ${said}`);
  const rows = r.live.map((m) => h("tr", { "data-replica-id": m.replica_id, "data-self": String(m.replica_id === r.replica_id) },
    h("td", null, h("span.mono", null, m.replica_id), m.replica_id === r.replica_id ? h("span.muted", null, " (this one)") : null),
    h("td.mono.replica-host", null, m.host || "–"),
    h("td.num", null, String(m.in_flight)),
    h("td.num", null, String(m.max_concurrent_share)),
    h("td.num.replica-usable", null, fmtNumber(usableOf(m, st)))));
  replace(card, h("h2", null, "Replicas"), me, verdict,
    h("table.grid#replica-table", null,
      h("thead", null, h("tr", null, ["Replica", "Host", "In flight", "Share", "Usable credentials"].map((t) => h(t === "Host" ? "th.replica-host" : "th", null, t)))),
      h("tbody#replica-rows", null, rows)));
}
