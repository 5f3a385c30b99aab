"""Render docs/performance.md (and docs/perf/*.png when matplotlib is there) from bench results.

The newest ``bench/results/*.json`` of kind ``main`` gives the main tables; the newest of
kind ``peer`` (``make bench-peer``) gives the LiteLLM comparison, with its own direct and
raw-relay figures from that same run. Hand-written analysis lives in ``bench/analysis.md``
and is included verbatim (it cannot be regenerated from numbers).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
DOC = ROOT / "docs" / "performance.md"
PLOTS = ROOT / "docs" / "perf"
GW = ("realtime-chat", "realtime-messages", "realtime-responses",
      "compatible-chat", "compatible-messages", "compatible-responses")


INCLUDE_QUICK = "--include-quick" in sys.argv  # to check the report on a `run.py --quick` result


def latest(kind: str) -> tuple[Path, dict[str, Any]] | None:
    for path in sorted((BENCH / "results").glob("*.json"), reverse=True):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("meta", {}).get("kind") == kind and (INCLUDE_QUICK or not data["meta"].get("quick")):
            return path, data
    return None


def f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def rx(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def mib(kib: float | None) -> float | None:
    return None if kib is None else kib / 1024


class Figures:
    """Derived figures of one run (everything the tables and the target check need)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.d = data
        self.chunks = data.get("chunks", {})

    def load(self, c: int | str, src: str = "load") -> dict[str, Any]:
        return self.d.get(src, {}).get(str(c), {})

    def ttfb(self, c: int | str, target: str, q: str = "p50", key: str = "content", src: str = "load") -> float | None:
        return self.load(c, src).get(target, {}).get(key, {}).get(q)

    def added(self, c: int | str, target: str, q: str = "p50", key: str = "content", src: str = "load") -> float | None:
        t, d = self.ttfb(c, target, q, key, src), self.ttfb(c, "direct", q, key, src)
        return None if t is None or d is None else t - d

    def added_ratio(self, c: int | str, target: str, q: str = "p50", key: str = "content",
                    src: str = "load") -> float | None:
        a, r = self.added(c, target, q, key, src), self.added(c, "raw", q, key, src)
        if a is None or r is None or r <= 0:
            return None
        return max(a, 0.0) / r

    def cpu(self, c: int | str, target: str) -> float | None:
        return self.load(c).get(target, {}).get("cpu_ms_per_req")

    def cpu_chunk_us(self, c: int | str, target: str) -> float | None:
        v, n = self.cpu(c, target), self.chunks.get("main")
        return None if v is None or not n else v * 1000 / n

    def marginal_chunk_us(self, target: str) -> float | None:
        short = self.d.get("load_short", {}).get(target, {}).get("cpu_ms_per_req")
        main = self.cpu(16, target)
        dn = self.chunks.get("main", 0) - self.chunks.get("short", 0)
        if short is None or main is None or dn <= 0:
            return None
        return (main - short) * 1000 / dn

    def paired_cpu_ratios(self, c: int | str, target: str, base: str = "raw") -> list[float]:
        """CPU/request of ``target`` over ``base``'s, round by round (both ran in the same
        round, minutes apart at most): what the machine did meanwhile cancels out."""
        t, b = self.load(c).get(target, {}), self.load(c).get(base, {})
        out = []
        for rt, rb in zip(t.get("rounds", []), b.get("rounds", []), strict=False):
            if rt.get("ok") and rb.get("ok") and rb.get("cpu_s"):
                out.append((rt["cpu_s"] / rt["ok"]) / (rb["cpu_s"] / rb["ok"]))
        return sorted(out)

    def rps(self, c: int | str, target: str) -> float | None:
        return self.load(c).get(target, {}).get("rps")


def targets_of(data: dict[str, Any]) -> list[str]:
    return list(data["targets"])


def latency_section(fg: Figures, src: str = "load", scenario: str = "main") -> str:
    parts = []
    for c in fg.d.get(src, {}):
        load = fg.load(c, src)
        rows = []
        for t in targets_of(fg.d):
            s = load.get(t)
            if not s:
                continue
            rows.append([
                f"`{t}`", f"{s['ok']}/{s['n']}",
                f(fg.ttfb(c, t, src=src)), f(fg.ttfb(c, t, "p99", src=src)),
                f(fg.added(c, t, src=src)), f(fg.added(c, t, "p99", src=src)),
                rx(fg.added_ratio(c, t, src=src)) if t != "raw" else "1.00×",
                rx(fg.added_ratio(c, t, "p99", src=src)) if t != "raw" else "1.00×",
                f(fg.ttfb(c, t, key="first", src=src)), f(s["total"]["p50"]),
                rx(ratio(s["total"]["p50"], load["direct"]["total"]["p50"])),
                f(100 * s["foreign_share"], 0) if s.get("foreign_share") is not None else "–",
            ])
        parts.append(f"### `{fg.d['meta']['scenarios'][scenario]}`, concurrency {c}\n\n" + table(
            ["target", "ok", "TTFB p50", "TTFB p99", "added p50", "added p99", "added p50 / raw's",
             "added p99 / raw's", "first byte p50", "total p50", "total / direct", "other load %"], rows))
    return "\n\n".join(parts)


def cpu_section(fg: Figures) -> str:
    rows = []
    raw16, raw64 = fg.cpu(16, "raw"), fg.cpu(64, "raw")
    raw_marg = fg.marginal_chunk_us("raw")
    for t in targets_of(fg.d):
        rows.append([
            f"`{t}`", f"`{fg.d['targets'][t]['process']}`",
            f(fg.cpu(16, t), 2), rx(ratio(fg.cpu(16, t), raw16)), rx(ratio(fg.cpu(16, t), fg.cpu(16, "direct"))),
            f(fg.cpu(64, t), 2), rx(ratio(fg.cpu(64, t), raw64)),
            f(fg.cpu_chunk_us(16, t), 0), f(fg.marginal_chunk_us(t), 0),
            rx(ratio(fg.marginal_chunk_us(t), raw_marg)),
        ])
    return table(
        ["target", "process measured", "CPU ms/request (c=16)", "/ raw", "/ direct", "CPU ms/request (c=64)",
         "/ raw", "µs per upstream chunk (c=16)", "marginal µs/chunk", "marginal / raw's"], rows)


def throughput_section(fg: Figures) -> str:
    rows = []
    load = fg.load(64)
    for t in targets_of(fg.d):
        s = load.get(t)
        if not s:
            continue
        rows.append([
            f"`{t}`", f(s["rps"]), rx(ratio(s["rps"], load["direct"]["rps"])), rx(ratio(s["rps"], load["raw"]["rps"])),
            f(100 * s["cpu_s"] / s["wall_s"], 0), f(100 * s["sim_cpu_s"] / s["wall_s"], 0),
            f(100 * s["loadgen_cpu_s"] / s["wall_s"], 0),
        ])
    return table(["target", "streams/s", "/ direct", "/ raw", "target process CPU %", "simulator CPU %",
                  "load generator CPU %"], rows)


def memory_section(fg: Figures) -> str:
    d = fg.d
    rows = []
    for proc in d["memory_start"]:
        rows.append([f"`{proc}`", f(mib(d["memory_start"][proc]["rss_kib"])), f(mib(d["memory_warm"][proc]["rss_kib"])),
                     f(mib(d["memory_end"][proc]["rss_kib"])), f(mib(d["memory_end"][proc]["hwm_kib"])),
                     f(100 * d["idle_cpu_per_s"][proc], 2)])
    idle = table(["process", "RSS at start MiB", "after warm-up MiB", "at the end MiB", "peak (VmHWM) MiB",
                  "idle CPU %"], rows)
    rows = []
    streams = d.get("streams", {})
    raw = streams.get("raw")
    direct = streams.get("direct")
    for t, s in streams.items():
        fresh = s.get("fresh")
        per = (s["held"]["rss_kib"] - s["before"]["rss_kib"]) / max(1, s["opened"])
        raw_per = (raw["held"]["rss_kib"] - raw["before"]["rss_kib"]) / max(1, raw["opened"]) if raw else None
        rows.append([
            f"`{t}`", f"`{s['process']}`", f"{s['opened']} ({s['failed']} failed)", f(s["ramp_s"]),
            f(mib(fresh["rss_kib"])) if fresh else "–", f(mib(s["before"]["rss_kib"])), f(mib(s["held"]["rss_kib"])),
            rx(ratio(s["held"]["rss_kib"], raw["held"]["rss_kib"])) if raw else "–",
            rx(ratio(s["held"]["rss_kib"], direct["held"]["rss_kib"])) if direct else "–",
            f(per), rx(ratio(per, raw_per)), f(mib(s["after"]["rss_kib"])),
        ])
    n = fg.d["meta"]["plan"]["hold_streams"]
    held = table(["target", "process", "streams open", "ramp s", "RSS fresh process MiB",
                  "RSS warmed (before) MiB", f"RSS with {n} streams MiB",
                  "/ raw", "/ direct", "KiB per stream", "per stream / raw's", "RSS after release MiB"], rows)
    return (idle + f"\n\n**{n} concurrent open streams** (scenario `{d['meta']['scenarios']['hold']}`). Each gateway "
            "row is a freshly started process warmed with 8 requests of that protocol (CPython keeps freed memory, "
            "so rows sharing a process would hide each other):\n\n" + held)


def replay_section(fg: Figures) -> str:
    rep = fg.d.get("replay")
    if not rep:
        return "_not measured in this run_"
    rows = []
    for t in targets_of(fg.d):
        s = rep.get(t)
        if not s:
            continue
        total, content = s["total"]["p50"], s["content"]["p50"]
        rows.append([f"`{t}`", f"{s['ok']}/{s['n']}", f(content), f(total),
                     f(None if total is None or content is None else total - content),
                     rx(ratio(total, rep["direct"]["total"]["p50"])), rx(ratio(total, rep["raw"]["total"]["p50"])),
                     f(s["bytes"] / 1024 if s["bytes"] else None, 0)])
    return table(["target", "ok", "content TTFB p50 ms", "total p50 ms", "content → end (replay) ms",
                  "total / direct", "total / raw", "KiB received"], rows)


def fixed_section(fg: Figures) -> str:
    tiny = fg.d.get("load_tiny")
    if not tiny:
        return "_not measured in this run_"
    rows = []
    for t in targets_of(fg.d):
        s = tiny.get(t)
        if not s:
            continue
        added = None if s["content"]["p50"] is None else s["content"]["p50"] - tiny["direct"]["content"]["p50"]
        raw_added = tiny["raw"]["content"]["p50"] - tiny["direct"]["content"]["p50"]
        rows.append([f"`{t}`", f"{s['ok']}/{s['n']}", f(s["cpu_ms_per_req"], 2),
                     rx(ratio(s["cpu_ms_per_req"], tiny["raw"]["cpu_ms_per_req"])),
                     f(s["content"]["p50"], 2), f(added, 2), rx(ratio(added, raw_added)) if t != "raw" else "1.00×",
                     f(s["total"]["p50"], 2)])
    return table(["target", "ok", "CPU ms/request", "/ raw", "content TTFB p50 ms", "added p50 ms",
                  "added / raw's", "total p50 ms"], rows)


def micro_section(d: dict[str, Any] | None) -> str:
    if not d:
        return "_not measured in this run_"
    parts = []
    sections = (
        ("per_chunk_us", "per upstream chunk", "µs"),
        ("queue_hop_us", "handing one item from the producer task to the consumer (as the relay does per chunk)", "µs"),
        ("per_request_us", "per request", "µs"),
        ("rss_mib", "resident memory of a fresh interpreter after", "MiB"),
    )
    for key, title, unit in sections:
        rows = [[f"{name}", f(v, 2 if unit == "µs" else 1)] for name, v in d.get(key, {}).items()]
        parts.append(f"**{title[0].upper() + title[1:]}** ({unit}):\n\n" + table(["what", unit], rows))
    return "\n\n".join(parts)


KEY_CHECK_ROWS = (
    ("static_key_check_us", "static `--api-key` check (constant-time compare), for comparison"),
    ("managed_key_check_us", "managed key check: SHA-256 lookup among 1,000 keys, revoked/expired, model globs"),
    ("reserve_settle_sqlite_us", "a key with a daily budget: reservation + settlement on SQLite (called directly)"),
    ("reserve_settle_sqlite_rpm60_us", "a key with rpm 60, tpm, max_concurrent and a budget, its minute full: the same"),
    ("reserve_settle_sqlite_threaded_us", "the same through `asyncio.to_thread`, as the request path runs it"),
)


def key_check_section(d: dict[str, Any] | None) -> str:
    """Issue #28: the CPU a managed client key adds per request (bench/key_check.py)."""
    if not d:
        return "_not measured in this run_"
    rows = [[what, f(d[name], 1)] for name, what in KEY_CHECK_ROWS if name in d]
    target = d.get("managed_key_check_us")
    met = "" if target is None else f"\n\nTarget < 200 µs added CPU per request for the key check: {verdict(target < 200)}."
    return table(["what", "µs CPU per request"], rows) + met


def verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("**met**" if ok else "**not met**")


def targets_section(fg: Figures, peer: Figures | None) -> str:
    rows = []

    def add(name: str, threshold: str, measured: str, ok: bool | None) -> None:
        rows.append([name, threshold, measured, verdict(ok)])

    for proto in ("chat", "messages", "responses"):
        for c in (16, 64):
            r = ratio(fg.cpu(c, f"realtime-{proto}"), fg.cpu(c, "raw"))
            add(f"CPU/request, realtime {proto} (c={c})", "≤ 1.5× raw relay",
                f"{f(fg.cpu(c, f'realtime-{proto}'), 2)} ms = {rx(r)}", None if r is None else r <= 1.5)
    for proto in ("chat", "messages", "responses"):
        r = ratio(fg.cpu(16, f"compatible-{proto}"), fg.cpu(16, "raw"))
        add(f"CPU/request, compatible {proto} (c=16)", "≤ 2× raw relay",
            f"{f(fg.cpu(16, f'compatible-{proto}'), 2)} ms = {rx(r)}", None if r is None else r <= 2)
    for proto in ("chat", "messages", "responses"):
        r = fg.added_ratio(1, f"realtime-{proto}")
        add(f"added TTFB c=1 p50, realtime {proto}", "≤ 1.5× raw's added",
            f"{f(fg.added(1, f'realtime-{proto}'), 2)} ms vs raw {f(fg.added(1, 'raw'), 2)} ms = {rx(r)}",
            None if r is None else r <= 1.5)
    for src, label in (("load_paced", "paced 20 ms"), ("load", "paced 2 ms, CPU-saturating")):
        for c in (16, 64):
            for q in ("p50", "p99"):
                if not fg.load(c, src):
                    continue
                vals = [(fg.added_ratio(c, f"realtime-{p}", q, src=src), p) for p in ("chat", "messages", "responses")]
                known = [v for v in vals if v[0] is not None]
                raw_added = fg.added(c, "raw", q, src=src)
                if not known:
                    add(f"added TTFB c={c} {q}, realtime ({label})", "≤ 1.25× raw's added",
                        f"raw relay's added time is {f(raw_added)} ms (≤ 0): ratio undefined", None)
                    continue
                worst = max(known)
                add(f"added TTFB c={c} {q}, realtime ({label}; worst: {worst[1]})", "≤ 1.25× raw's added",
                    f"{f(fg.added(c, 'realtime-' + worst[1], q, src=src))} ms vs raw {f(raw_added)} ms = {rx(worst[0])}",
                    worst[0] <= 1.25)
    r = ratio(fg.cpu_chunk_us(16, "realtime-messages"), fg.cpu_chunk_us(16, "raw"))
    add("CPU per upstream chunk, Chat→Messages (realtime, c=16)", "≤ 1.5× raw relay",
        f"{f(fg.cpu_chunk_us(16, 'realtime-messages'), 0)} µs = {rx(r)}", None if r is None else r <= 1.5)
    r = ratio(fg.marginal_chunk_us("realtime-messages"), fg.marginal_chunk_us("raw"))
    add("  same, marginal (cost of one more chunk)", "≤ 1.5× raw relay",
        f"{f(fg.marginal_chunk_us('realtime-messages'), 0)} µs = {rx(r)}", None if r is None else r <= 1.5)
    if peer is not None:
        r = ratio(peer.cpu(16, "litellm"), peer.cpu(16, "realtime-chat"))
        add("CPU/request vs LiteLLM proxy (Chat, c=16, peer run)", "≥ 5× less",
            f"LiteLLM {f(peer.cpu(16, 'litellm'), 2)} ms vs gateway {f(peer.cpu(16, 'realtime-chat'), 2)} ms = {rx(r)} less",
            None if r is None else r >= 5)
    else:
        add("CPU/request vs LiteLLM proxy", "≥ 5× less", "not measured (run `make bench-peer`)", None)
    for mode in ("realtime", "compatible"):
        start = mib(fg.d["memory_start"][mode]["rss_kib"])
        warm = mib(fg.d["memory_warm"][mode]["rss_kib"])
        add(f"RSS idle, {mode} gateway, fresh", "≤ 80 MiB", f"{f(start)} MiB", None if start is None else start <= 80)
        add(f"RSS idle, {mode} gateway, after serving all three protocols", "≤ 80 MiB", f"{f(warm)} MiB",
            None if warm is None else warm <= 80)
    return table(["target (issue #9)", "threshold", "measured", "verdict"], rows)


def redesign_section(fg: Figures) -> str:
    """Issue #20's bar for the split generation core: CPU per streamed request <= 1.2x the
    raw relay in both modes, added time to first content at c=16 within 1.25x the raw
    relay's (realtime only: compatible mode's first content is the whole answer by design)."""
    rows = []
    for mode in ("realtime", "compatible"):
        for proto in ("chat", "messages", "responses"):
            target = f"{mode}-{proto}"
            r = ratio(fg.cpu(16, target), fg.cpu(16, "raw"))
            paired = fg.paired_cpu_ratios(16, target)
            median = statistics.median(paired) if paired else r
            spread = f"; per round: median {rx(median)} ({rx(paired[0])}–{rx(paired[-1])})" if paired else ""
            rows.append([f"CPU/request, {mode} {proto} (c=16)", "≤ 1.2× raw relay",
                         f"{f(fg.cpu(16, target), 2)} ms vs raw {f(fg.cpu(16, 'raw'), 2)} ms = {rx(r)}{spread}",
                         verdict(None if median is None else median <= 1.2)])
    for src, label in (("load_paced", "paced 20 ms"), ("load", "paced 2 ms, CPU-saturating")):
        if not fg.load(16, src):
            continue
        for proto in ("chat", "messages", "responses"):
            target = f"realtime-{proto}"
            r = fg.added_ratio(16, target, src=src)
            rows.append([f"added TTFB c=16 p50, realtime {proto} ({label})", "≤ 1.25× raw's added",
                         f"{f(fg.added(16, target, src=src))} ms vs raw {f(fg.added(16, 'raw', src=src))} ms = {rx(r)}",
                         verdict(None if r is None else r <= 1.25)])
    return table(["target (issue #20)", "threshold", "measured", "verdict"], rows)


def durability_line(data: dict[str, Any]) -> str:
    """Whether the gateways kept every row in the store during the run: a spilled row means
    the store failed over to the journal, and the CPU figures priced that, not the store."""
    seen = data.get("durability")
    if not seen:
        return "_Store rows spilled during the run: not recorded by this run._"
    parts = [f"`{name}`: {int(d.get('spilled', 0))} spilled, {int(d.get('lost', 0))} lost" for name, d in sorted(seen.items())]
    bad = any(d.get("spilled") or d.get("lost") for d in seen.values())
    return ("**Store rows during the run** (the gateways' `codebuddy2api_records_spilled_total` / `_lost_total`): "
            + "; ".join(parts) + (" — **the store failed over during the run: these CPU figures are not the store's.**" if bad else "."))


def peer_section(found: tuple[Path, dict[str, Any]] | None) -> str:
    failed = BENCH / "results" / "peer-install-failed.txt"
    note = ""
    if failed.exists() and (found is None or failed.stat().st_mtime > found[0].stat().st_mtime):
        failure = failed.read_text().splitlines()
        note = (f"**The last `make bench-peer` could not install `litellm[proxy]`** ({failure[0] if failure else '?'}); "
                "see `bench/results/peer-install.log`. ")
    if found is None:
        return note + (
            "_No peer run found._ `make bench-peer` installs the LiteLLM proxy into `bench/.peer-venv` "
            "and runs it as one more target; its figures then appear here.")
    path, data = found
    fg = Figures(data)
    m = data["meta"]
    stack = ", ".join(f"{k} {v}" for k, v in sorted((m.get("peer_packages") or {}).items()))
    lines = [note + f"From `{path.relative_to(ROOT)}` ({m['date']}; LiteLLM proxy from `bench/.peer-venv`: {stack or '?'}), "
             "started with `litellm --config … --num_workers 1` in front of the same simulator (OpenAI-compatible "
             "upstream, one model alias per scenario, a throwaway master key). `direct`, `raw` and the gateway were "
             "measured in the same run, Chat clients, rounds alternating. uvicorn runs LiteLLM on uvloop when its venv has it "
             f"(see the versions above); the gateway and the raw relay ran on "
             f"{'uvloop' if m['packages'].get('uvloop') else 'asyncio + h11'} in this run.", ""]
    rows = []
    for t in targets_of(data):
        rows.append([
            f"`{t}`", f(fg.cpu(16, t), 2), rx(ratio(fg.cpu(16, t), fg.cpu(16, "raw"))),
            rx(ratio(fg.cpu(16, "litellm"), fg.cpu(16, t))),
            f(fg.added(1, t), 2), f(fg.added(16, t)), f(fg.added(64, t)), f(fg.added(64, t, "p99")),
            f(fg.rps(64, t)),
            f(mib(data["memory_warm"][data["targets"][t]["process"]]["rss_kib"])),
            f(mib(data.get("streams", {}).get(t, {}).get("held", {}).get("rss_kib"))),
        ])
    n = m["plan"]["hold_streams"]
    ll = data.get("streams", {}).get("litellm")
    if ll and (ll.get("upstream_open", n) < n or ll.get("failed")):
        lines.insert(1, f"LiteLLM's open-streams memory was read with {ll['upstream_open']} streams open upstream: "
                        f"{ll['opened']} of {n} client streams got their response headers within "
                        f"{ll['ramp_s']:.0f} s ({ll['failed']} failed), so it understates {n} concurrent streams.\n")
    lines.append(table(["target", "CPU ms/req c=16", "/ raw", "LiteLLM's / this", "added TTFB c=1 ms",
                        "added c=16 ms", "added c=64 p50 ms", "added c=64 p99 ms", "streams/s c=64",
                        "RSS warm MiB", f"RSS {n} streams MiB"], rows))
    return "\n".join(lines)


def _ms_per_request(p: dict[str, Any], row: dict[str, Any]) -> float | None:
    """A row's share of busy samples times the process CPU per request measured during the profile."""
    if not p.get("requests"):
        return None
    return row["pct"] / 100 * p["cpu_s"] * 1000 / p["requests"]


def profile_section(profiles: dict[str, Any] | None) -> str:
    if not profiles:
        return "_not run_"
    from profile_summary import summarize_raw

    for prof in profiles.values():  # re-summarize from the raw stacks when they are still there
        raw_path = ROOT / str(prof.get("raw_file", ""))
        if prof.get("ok") and raw_path.is_file():
            prof.update(summarize_raw(raw_path.read_text()))
    main = profiles.get("realtime-messages", {})
    if not main.get("ok"):
        return f"Profiling failed: `{main.get('error')}`"
    parts = [(
        f"`{main['tool']}` on the gateway process while it served Messages streams at concurrency 16 "
        f"(`{main['scenario']}`; {main['samples']} busy samples, {main['idle_samples']} samples of threads waiting "
        f"in epoll/queues left out), and the same for the raw relay serving Chat. Raw stacks: `bench/results/*-profile-*.txt` "
        "(gitignored; collapsed-stack format for flamegraph.pl or speedscope). \"ms/request\" = the share of busy "
        "samples × the process CPU per request measured during the profile."
    )]
    raw = profiles.get("raw", {})
    if raw.get("ok"):
        areas = {r["function"] for r in main["by_area"]} | {r["function"] for r in raw.get("by_area", [])}
        gw_rows = {r["function"]: r for r in main["by_area"]}
        raw_rows = {r["function"]: r for r in raw["by_area"]}
        rows = []
        for a in sorted(areas, key=lambda a: -(gw_rows.get(a, {}).get("pct") or 0)):
            g, r = gw_rows.get(a), raw_rows.get(a)
            gm = _ms_per_request(main, g) if g else 0.0
            rm = _ms_per_request(raw, r) if r else 0.0
            rows.append([f"`{a}`", f(gm, 2), f(rm, 2), f((gm or 0) - (rm or 0), 2)])
        gt = main["cpu_s"] * 1000 / main["requests"]
        rt = raw["cpu_s"] * 1000 / raw["requests"]
        rows.append(["**total (CPU/request)**", f(gt, 2), f(rt, 2), f(gt - rt, 2)])
        parts.append("**Self time by library, ms of CPU per streamed request** (gateway realtime Messages vs raw relay, "
                     "both at concurrency 16, 2 KB answer):\n\n" + table(["area", "gateway", "raw relay", "difference"], rows))

    def rows(p: dict[str, Any], key: str, n: int) -> list[list[str]]:
        return [[f"`{r['function']}`", str(r["samples"]), f"{r['pct']}%", f(_ms_per_request(p, r), 3)] for r in p[key][:n]]

    hdr = ["function", "samples", "share", "ms/request"]
    parts.append("**Gateway: top functions by self time:**\n\n" + table(hdr, rows(main, "top_self", 20)))
    parts.append("**Gateway: its own functions by total (inclusive) time:**\n\n" + table(hdr, rows(main, "top_gateway_total", 20)))
    if raw.get("ok"):
        parts.append("**Raw relay: top functions by self time:**\n\n" + table(hdr, rows(raw, "top_self", 12)))
    fixed = profiles.get("realtime-chat-fixed", {})
    if fixed.get("ok"):
        parts.append(
            f"**Fixed cost per request**: the gateway (realtime, Chat) serving one-chunk answers (`{fixed['scenario']}`) "
            f"at concurrency 1, {fixed['requests']} requests, {fixed['samples']} busy samples; its own functions by "
            "total time:\n\n" + table(hdr, rows(fixed, "top_gateway_total", 25))
            + "\n\nand by self time:\n\n" + table(hdr, rows(fixed, "top_self", 15)))
    return "\n\n".join(parts)


def plots(fg: Figures) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    PLOTS.mkdir(parents=True, exist_ok=True)
    made = []
    ts = [t for t in targets_of(fg.d) if t != "direct"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, c in zip(axes, ("1", "16", "64")):
        src = "load_paced" if c != "1" and fg.load(c, "load_paced") else "load"
        vals = [fg.added(c, t, src=src) or 0 for t in ts]
        p99 = [fg.added(c, t, "p99", src=src) or 0 for t in ts]
        xs = range(len(ts))
        ax.bar([x - 0.2 for x in xs], vals, 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
        ax.set_xticks(list(xs), ts, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"added TTFB vs direct, c={c} ({'20 ms' if src == 'load_paced' else '2 ms'} pacing)", fontsize=9)
        ax.set_ylabel("ms")
        if fg.added(c, "raw", src=src) is not None:
            ax.axhline(fg.added(c, "raw", src=src), color="grey", lw=0.8, ls="--")
        ax.set_yscale("symlog", linthresh=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "ttfb.png", dpi=90)
    plt.close(fig)
    made.append("perf/ttfb.png")
    all_ts = targets_of(fg.d)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(all_ts))
    ax.bar([x - 0.2 for x in xs], [fg.cpu(16, t) or 0 for t in all_ts], 0.4, label="c=16")
    ax.bar([x + 0.2 for x in xs], [fg.cpu(64, t) or 0 for t in all_ts], 0.4, label="c=64")
    raw = fg.cpu(16, "raw")
    if raw:
        ax.axhline(1.5 * raw, color="red", lw=0.8, ls="--", label="1.5× raw relay (c=16)")
        ax.axhline(2 * raw, color="orange", lw=0.8, ls=":", label="2× raw relay (c=16)")
    ax.set_xticks(list(xs), all_ts, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("CPU ms per streamed request")
    ax.set_title(f"CPU per streamed request ({fg.chunks.get('main')} upstream chunks each); direct = simulator")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "cpu.png", dpi=90)
    plt.close(fig)
    made.append("perf/cpu.png")
    streams = fg.d.get("streams", {})
    if streams:
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(streams)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [streams[t]["before"]["rss_kib"] / 1024 for t in names], 0.4, label="before")
        ax.bar([x + 0.2 for x in xs], [streams[t]["held"]["rss_kib"] / 1024 for t in names], 0.4,
               label=f"{fg.d['meta']['plan']['hold_streams']} open streams")
        ax.axhline(80, color="red", lw=0.8, ls="--", label="80 MiB idle target")
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("RSS MiB")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / "rss.png", dpi=90)
        plt.close(fig)
        made.append("perf/rss.png")
    return made


def render() -> int:
    found = latest("main")
    if found is None:
        print("no bench results yet: run `make bench`", file=sys.stderr)
        return 1
    path, data = found
    fg = Figures(data)
    peer_found = latest("peer")
    peer_fg = Figures(peer_found[1]) if peer_found else None
    m = data["meta"]
    pk = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v) + (
        "" if m["packages"].get("uvloop") else "; no uvloop/httptools: uvicorn runs asyncio + h11")
    analysis = (BENCH / "analysis.md").read_text() if (BENCH / "analysis.md").exists() else ""
    hostile = (BENCH / "hostile.md").read_text() if (BENCH / "hostile.md").exists() else ""  # bench/hostile.py
    store_faults = (BENCH / "store_faults.md").read_text() if (BENCH / "store_faults.md").exists() else ""  # bench/store_faults.py
    soak = (BENCH / "soak.md").read_text() if (BENCH / "soak.md").exists() else ""  # bench/soak.py
    rollouts = (BENCH / "rollouts.md").read_text() if (BENCH / "rollouts.md").exists() else ""  # bench/rollouts.py
    images = plots(fg)
    parts = [
        "# Performance",
        "",
        ("_Generated by `bench/report.py` from `" + str(path.relative_to(ROOT)) + "`; do not edit the tables by hand. "
         "Re-run with `make bench` (about 8 minutes) and `make bench-peer` (LiteLLM, about 7 minutes plus its install)._"),
        "",
        (f"**Machine**: {m['nproc']} cores, {m['cpu_model']}, Python {m['python']}, {m['platform']}; {pk}. "
         f"**Date**: {m['date']}. **Run time**: {m['duration_s']} s. **Commit**: `{m.get('commit') or '?'}` "
         "(the tree may have carried uncommitted changes)."),
        "",
        "## How it is measured",
        "",
        f"""- Processes, all on 127.0.0.1, each its own OS process: the simulator (`python -m gateway simulate`), the raw
  relay (`bench/raw_relay.py`: Starlette + httpx, body forwarded, upstream bytes streamed back unchanged, under uvicorn),
  one gateway per stream mode (`python -m gateway serve --stream-mode realtime|compatible --log-level warning
  --max-concurrent 4096`: the default cap of 64 would refuse the open-streams test; audit on, SQLite in a temp dir), and the
  load generator (`bench/loadgen.py`, asyncio + httpx) whose CPU is not counted against anyone.
- Targets: `direct` (the simulator itself), `raw` (raw relay), `<mode>-<protocol>` (the gateway, client protocol
  Chat / Messages / Responses; direct and raw are spoken to in Chat). Every target is asked for the same upstream
  answer: `{m['scenarios']['main']}` — a 2 KB text in {fg.chunks.get('main')} upstream SSE frames
  (incl. the usage chunk and `[DONE]`), 2 ms apart.
- Rounds alternate between targets (order rotated every round): at concurrency 1 / 16 / 64,
  {m['plan']['c1_rounds']} / {m['plan']['c16_rounds']} / {m['plan']['c64_rounds']} rounds of
  {m['plan']['c1_requests']} / {m['plan']['c16_requests']} / {m['plan']['c64_requests']} requests per target.
- `raw-fresh` is the same raw relay without upstream keep-alive (a new TCP connection per request): it prices
  what the gateway currently pays per request (see "Proposed optimizations").
- TTFB = time to the first body byte that carries content (Chat: a data frame with non-empty `content`; Messages: the
  first `content_block_delta`; Responses: the first `response.output_text.delta`). "first byte" = any body byte.
  "Added" = the target's figure minus `direct`'s figure at the same concurrency and percentile.
- CPU = utime+stime of the serving process (all its threads) from `/proc/PID/stat`, before/after every phase, summed
  over rounds and divided by the successful requests; per chunk = divided by the {fg.chunks.get('main')} upstream
  frames. "Marginal" per chunk = (CPU/request of the 2 KB answer − CPU/request of a 512 B answer in
  {fg.chunks.get('short')} frames) / {fg.chunks.get('main', 0) - fg.chunks.get('short', 0)} — the cost of one more chunk without the fixed per-request cost.
  `direct`'s CPU is the simulator's: the upstream's own cost, a floor no relay can go under.
- All of it shares 2 cores: at concurrency 64 the simulator, the target and the load generator together saturate the
  machine, so c=64 latencies include CPU queueing, equally for every target.
- Responses requests use the default `store` (true): each answer is saved to SQLite, as a client would see it.
""",
        "## Issue #9 targets",
        "",
        targets_section(fg, peer_fg),
        "",
        "## Issue #20 targets (the split generation core)",
        "",
        ("The CPU verdict is on the median of the per-round ratios (target and raw relay measured in the same round), "
         "which the machine's drift between rounds does not move; the whole-run ratio is shown beside it."),
        "",
        redesign_section(fg),
        "",
        durability_line(data),
        "",
        "## Added latency (ms)",
        "",
        ("Time to the first content byte, and its excess over `direct` (\"added\"). \"other load %\" = CPU used meanwhile "
         "by processes outside this benchmark, as a share of the machine (a phase above "
         f"25% is run once more; {fg.d.get('retried_phases', 0)} phases were). Two pacings: 2 ms between upstream chunks "
         "(500 chunks/s per stream: at c≥16 the simulator, the target and the load generator together use most of the "
         "2 cores, so latency there is mostly CPU queueing), and 20 ms (50 chunks/s per stream, closer to a real model, "
         "CPU to spare) where the added time is the relay's own."),
        "",
        latency_section(fg),
        "",
        latency_section(fg, "load_paced", "paced"),
        "",
        "![added TTFB](perf/ttfb.png)" if "perf/ttfb.png" in images else "",
        "",
        "## Fixed cost per request (one-chunk answers, concurrency 1)",
        "",
        f"`{m['scenarios'].get('tiny')}`: {fg.chunks.get('tiny', '?')} upstream frames, so nearly all of it is per-request work.",
        "",
        fixed_section(fg),
        "",
        "## CPU",
        "",
        cpu_section(fg),
        "",
        "![CPU per request](perf/cpu.png)" if "perf/cpu.png" in images else "",
        "",
        "## Throughput at concurrency 64",
        "",
        throughput_section(fg),
        "",
        "## Memory",
        "",
        memory_section(fg),
        "",
        "![RSS](perf/rss.png)" if "perf/rss.png" in images else "",
        "",
        f"## Compatible-mode replay of a 100 KB answer (`{m['scenarios']['replay']}`, {fg.chunks.get('replay')} frames, concurrency 1)",
        "",
        replay_section(fg),
        "",
        "## LiteLLM proxy (peer)",
        "",
        peer_section(peer_found),
        "",
        "## Profile: realtime gateway, Messages clients, concurrency 16",
        "",
        profile_section(data.get("profiles")),
        "",
        "## Micro-measurements (`bench/micro.py`, no servers)",
        "",
        "Single stages priced in isolation, so each proposal below says what it can save at most.",
        "",
        micro_section(data.get("micro")),
        "",
        "## Managed client keys (`bench/key_check.py`, issue #28)",
        "",
        key_check_section(data.get("key_check")),
        "",
        analysis.strip(),
        "",
        hostile.strip(),
        "",
        store_faults.strip(),
        soak.strip(),
        rollouts.strip(),
        "",
    ]
    DOC.write_text("\n".join(parts))
    print(f"wrote {DOC.relative_to(ROOT)}" + (f" and {', '.join('docs/' + i for i in images)}" if images else ""))
    return 0


if __name__ == "__main__":
    sys.exit(render())
