"""The soak (issue #31): a long mixed load on one gateway, watching what must not grow.

Run by hand, never by ``make test``::

    .venv/bin/python bench/soak.py --minutes 30 --label after
    .venv/bin/python bench/soak.py --minutes 5 --label before --repo /work/main

Starts the built-in simulator (``python -m gateway simulate``) and one gateway
(``python -m gateway serve`` from ``--repo``, default this tree) on loopback, then runs
``--concurrency`` request loops until ``--minutes`` are up (or ``--max-requests``): the
three protocols, streamed and not, plain text and tool calls, upstream errors sent
mid-stream (``data: {"error": ...}`` then the end of the body), clients that leave
mid-stream, and a stream-mode flip (compatible <-> realtime) through the admin settings
API every ``--flip-seconds``. Every request has a client timeout (``--request-timeout``);
one that runs into it counts as a hang.

Every 10 s and at every 10k requests it samples the gateway process from ``/proc``: open
fds, RSS, threads, plus ``codebuddy2api_asyncio_tasks`` and
``codebuddy2api_upstream_connections_in_use`` from ``/metrics`` where the tree has them.
Latency p50/p99 are per 10k-request window (requests that ended as designed: answers,
upstream errors; not the disconnects). Writes ``bench/results/soak-<label>.json`` and
re-renders ``bench/soak.md`` from every soak result there (``bench/report.py`` includes it
in docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Server, free_port, raise_nofile  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
KEY = "soak-client-key-0123456789abcdef"
ADMIN_TOKEN = "soak-admin-token-0123456789abcdef"
WINDOW = 10_000  # requests per reporting window
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# -- the request mix -------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix."""

    name: str
    protocol: str  # chat | responses | messages
    stream: bool
    model: str
    tools: bool = False
    disconnect: bool = False  # read the first bytes, then close the connection
    weight: int = 1


def mix() -> list[Kind]:
    out: list[Kind] = []
    for protocol in ("chat", "responses", "messages"):
        for stream in (True, False):
            tag = f"{protocol}-{'stream' if stream else 'json'}"
            out.append(Kind(f"{tag}-text", protocol, stream, "text", weight=4))
            out.append(Kind(f"{tag}-tool", protocol, stream, "tool", tools=True, weight=2))
            out.append(Kind(f"{tag}-upstream-error", protocol, stream, "error_frame", weight=1))
        out.append(Kind(f"{protocol}-disconnect", protocol, True, "text;chunk=2;delay=0.05", disconnect=True))
    return out


def request_of(kind: Kind) -> tuple[str, dict[str, Any]]:
    """(path, body) of one request of ``kind``."""
    user = "hello soak, what is the weather in Paris today?"
    if kind.protocol == "chat":
        body: dict[str, Any] = {"model": kind.model, "stream": kind.stream,
                                "messages": [{"role": "user", "content": user}]}
        if kind.tools:
            body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_SCHEMA}}]
        return "/v1/chat/completions", body
    if kind.protocol == "responses":
        body = {"model": kind.model, "stream": kind.stream, "input": user}
        if kind.tools:
            body["tools"] = [{"type": "function", "name": "get_weather", "parameters": TOOL_SCHEMA}]
        return "/v1/responses", body
    body = {"model": kind.model, "stream": kind.stream, "max_tokens": 256,
            "messages": [{"role": "user", "content": user}]}
    if kind.tools:
        body["tools"] = [{"name": "get_weather", "input_schema": TOOL_SCHEMA}]
    return "/v1/messages", body


@dataclass
class Tally:
    """What the loops saw, for the whole run and the current window."""

    started: float = field(default_factory=time.monotonic)
    done: int = 0
    hangs: int = 0  # requests that hit the client timeout
    unexpected: dict[str, int] = field(default_factory=dict)  # "kind: what" -> count
    outcomes: dict[str, int] = field(default_factory=dict)
    window_latency: list[float] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    flips: int = 0

    def note_unexpected(self, what: str) -> None:
        self.unexpected[what] = self.unexpected.get(what, 0) + 1


def judge(kind: Kind, status: int, body: bytes) -> str:
    """What the answer was: ``ok``, ``upstream_error`` (as designed), else what went wrong."""
    if kind.model == "error_frame":
        if status == 200 and kind.stream and (b"upstream exploded" in body or b"error" in body):
            return "upstream_error"
        if status >= 500 and b"error" in body:
            return "upstream_error"
        return f"error_frame answered {status}"
    if status != 200:
        return f"status {status}: {body[:120]!r}"
    if kind.tools and b"get_weather" not in body:
        return "no tool call"
    if not kind.tools and kind.stream and b"error" in body[-400:] and b'"error":null' not in body[-400:]:
        return "stream ended in an error"
    return "ok"


async def one(client: httpx.AsyncClient, base: str, kind: Kind, tally: Tally, timeout: float) -> None:
    path, body = request_of(kind)
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
    began = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            if kind.disconnect:
                async with client.stream("POST", base + path, json=body, headers=headers) as response:
                    async for _ in response.aiter_bytes():
                        break  # the client leaves mid-stream
                outcome = "disconnect"
            else:
                response = await client.post(base + path, json=body, headers=headers)
                outcome = judge(kind, response.status_code, response.content)
    except TimeoutError:
        tally.hangs += 1
        outcome = "hang"
    except httpx.HTTPError as exc:
        outcome = f"client error {type(exc).__name__}"
    tally.outcomes[outcome if outcome in ("ok", "upstream_error", "disconnect", "hang") else "unexpected"] = (
        tally.outcomes.get(outcome if outcome in ("ok", "upstream_error", "disconnect", "hang") else "unexpected", 0) + 1)
    if outcome not in ("ok", "upstream_error", "disconnect", "hang"):
        tally.note_unexpected(f"{kind.name}: {outcome}")
    if outcome in ("ok", "upstream_error"):
        tally.window_latency.append(time.monotonic() - began)
    tally.done += 1


# -- sampling the gateway --------------------------------------------------------------

def proc_figures(pid: int) -> dict[str, Any]:
    """Open fds, RSS (KiB) and threads of one process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    values = {line.split(":")[0]: line.split(":", 1)[1].split() for line in status}
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    close_wait = 0  # this process's sockets the peer closed and it did not (the leak's mark)
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        close_wait += sum(1 for line in lines if line.split()[3] == "08" and line.split()[9] in sockets)
    return {"fds": len(fds), "rss_kib": int(values["VmRSS"][0]),
            "threads": int(values["Threads"][0]), "close_wait_sockets": close_wait}


async def metric_values(client: httpx.AsyncClient, base: str) -> dict[str, float | None]:
    wanted = {"codebuddy2api_asyncio_tasks": "asyncio_tasks",
              "codebuddy2api_upstream_connections_in_use": "upstream_connections",
              "codebuddy2api_event_loop_lag_seconds": "loop_lag_s"}
    out: dict[str, float | None] = dict.fromkeys(wanted.values())
    try:
        text = (await client.get(base + "/metrics", timeout=10)).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


async def sample(client: httpx.AsyncClient, base: str, pid: int, tally: Tally) -> dict[str, Any]:
    figures = proc_figures(pid)
    figures.update(await metric_values(client, base))
    figures["requests"] = tally.done
    figures["minutes"] = round((time.monotonic() - tally.started) / 60, 2)
    try:
        ready = await client.get(base + "/readyz", timeout=10)
        figures["readyz"] = ready.status_code
    except httpx.HTTPError:
        figures["readyz"] = None
    return figures


async def flip_modes(client: httpx.AsyncClient, base: str, every: float, tally: Tally, stop: asyncio.Event) -> None:
    """compatible <-> realtime through the admin settings API, every ``every`` seconds."""
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass
        try:
            view = (await client.get(base + "/admin/api/settings", headers=headers, timeout=10)).json()
            mode = view["settings"]["stream_mode"]["value"]
            changed = await client.put(base + "/admin/api/settings", headers=headers, timeout=10, json={
                "revision": view["revision"],
                "changes": {"stream_mode": "realtime" if mode == "compatible" else "compatible"}})
            if changed.status_code == 200:
                tally.flips += 1
            else:
                tally.note_unexpected(f"mode flip: {changed.status_code}")
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            tally.note_unexpected(f"mode flip: {type(exc).__name__}")


async def run_load(base: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    kinds = mix()
    weights = [k.weight for k in kinds]
    rng = random.Random(31)
    tally = Tally()
    deadline = time.monotonic() + args.minutes * 60
    stop = asyncio.Event()
    samples: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        async with httpx.AsyncClient(timeout=10) as side:
            samples.append({**await sample(side, base, pid, tally), "at": "start"})

            async def loop() -> None:
                while not stop.is_set():
                    if time.monotonic() >= deadline or tally.done >= args.max_requests:
                        stop.set()
                        return
                    await one(client, base, rng.choices(kinds, weights)[0], tally, args.request_timeout)

            async def watch() -> None:
                next_window, next_tick = WINDOW, time.monotonic() + 10
                while not stop.is_set():
                    await asyncio.sleep(0.5)
                    if tally.done >= next_window:
                        latency = sorted(tally.window_latency)
                        tally.window_latency = []
                        figures = await sample(side, base, pid, tally)
                        figures["p50_ms"] = round(statistics.median(latency) * 1000, 1) if latency else None
                        figures["p99_ms"] = round(latency[int(len(latency) * 0.99)] * 1000, 1) if latency else None
                        tally.windows.append(figures)
                        print(json.dumps({"window": figures}), flush=True)
                        next_window += WINDOW
                    if time.monotonic() >= next_tick:
                        figures = await sample(side, base, pid, tally)
                        samples.append(figures)
                        print(json.dumps({"sample": figures, "hangs": tally.hangs}), flush=True)
                        next_tick += 10

            flipper = asyncio.create_task(flip_modes(side, base, args.flip_seconds, tally, stop))
            watcher = asyncio.create_task(watch())
            await asyncio.gather(*(loop() for _ in range(args.concurrency)))
            stop.set()
            await asyncio.gather(flipper, watcher)
            await asyncio.sleep(2)  # let closes settle before the last sample
            samples.append({**await sample(side, base, pid, tally), "at": "end"})
            # the hang check: one plain request after the load, with a short bound
            try:
                final = await client.post(base + "/v1/chat/completions", timeout=30, headers={"authorization": f"Bearer {KEY}"},
                                          json={"model": "text", "messages": [{"role": "user", "content": "still there?"}]})
                final_ok = final.status_code == 200
            except httpx.HTTPError:
                final_ok = False
    elapsed = time.monotonic() - tally.started
    return {"requests": tally.done, "seconds": round(elapsed, 1), "rate_per_s": round(tally.done / elapsed, 1),
            "hangs": tally.hangs, "outcomes": tally.outcomes, "unexpected": tally.unexpected, "flips": tally.flips,
            "final_request_ok": final_ok, "windows": tally.windows, "samples": samples}


def growth(result: dict[str, Any]) -> dict[str, Any]:
    """From the first window (warm: tokenizer and pools loaded) to the end."""
    samples = result["samples"]
    base = result["windows"][0] if result["windows"] else samples[0]
    end = samples[-1]
    span = max(1, end["requests"] - base["requests"])
    return {
        "fds_from": base["fds"], "fds_to": end["fds"], "fd_growth": end["fds"] - base["fds"],
        "rss_mib_from": round(base["rss_kib"] / 1024, 1), "rss_mib_to": round(end["rss_kib"] / 1024, 1),
        "rss_mib_per_10k": round((end["rss_kib"] - base["rss_kib"]) / 1024 / span * WINDOW, 2),
        "threads_from": base["threads"], "threads_to": end["threads"],
        "tasks_from": base.get("asyncio_tasks"), "tasks_to": end.get("asyncio_tasks"),
        "max_close_wait": max(s["close_wait_sockets"] for s in samples),
    }


# -- the report ------------------------------------------------------------------------

def _cell(value: Any) -> str:
    return "n/a" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "## Soak (`bench/soak.py`, issue #31)",
        "",
        "_Written by `bench/soak.py` from `bench/results/soak-*.json`; re-run with "
        "`.venv/bin/python bench/soak.py --minutes 30 --label <name> [--repo <tree>]`._",
        "",
        "One gateway process (`serve --log-level warning`, a client key, the simulator as a separate process) "
        "under a closed loop of concurrent clients (raw httpx, no SDK): the three protocols, streamed and not, "
        "text and tool calls, upstream errors mid-stream (`data: {\"error\": ...}`, then the end of the body; "
        "2 in 15 requests), clients leaving mid-stream (1 in 15), and a stream-mode flip through "
        "`PUT /admin/api/settings` every 30 s. Figures from `/proc/<pid>` and `/metrics`; growth is measured "
        "from the end of the first 10k-request window (warm) to the end of the run.",
        "",
        "| run | tree | minutes | concurrency | requests | req/s | hangs | final request | fds (warm → end) "
        "| CLOSE-WAIT max | RSS MiB (warm → end) | RSS per 10k | threads | asyncio tasks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        g = r["growth"]
        lines.append(
            f"| {label} | `{r['tree']}` @ `{r['commit']}` | {r['minutes']:g} | {r['concurrency']} | {r['requests']} "
            f"| {r['rate_per_s']} | {r['hangs']} | {'ok' if r['final_request_ok'] else 'FAILED'} "
            f"| {g['fds_from']} → {g['fds_to']} ({g['fd_growth']:+d}) | {g['max_close_wait']} "
            f"| {g['rss_mib_from']} → {g['rss_mib_to']} | {g['rss_mib_per_10k']:+.2f} MiB "
            f"| {g['threads_from']} → {g['threads_to']} | {_cell(g['tasks_from'])} → {_cell(g['tasks_to'])} |"
        )
    for label, r in results.items():
        lines += ["", f"**{label}**: per 10k-request window (p50/p99 of answered requests, ms)", "",
                  "| requests | minute | p50 | p99 | fds | CLOSE-WAIT | RSS MiB | threads | tasks | /readyz |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for w in r["windows"]:
            lines.append(f"| {w['requests']} | {w['minutes']:g} | {_cell(w['p50_ms'])} | {_cell(w['p99_ms'])} "
                         f"| {w['fds']} | {w['close_wait_sockets']} | {w['rss_kib'] / 1024:.1f} | {w['threads']} "
                         f"| {_cell(w.get('asyncio_tasks'))} | {_cell(w.get('readyz'))} |")
        if not r["windows"]:
            last = r["samples"][-1]
            lines.append(f"| {last['requests']} (no full window) | {last['minutes']:g} | n/a | n/a | {last['fds']} "
                         f"| {last['close_wait_sockets']} | {last['rss_kib'] / 1024:.1f} | {last['threads']} "
                         f"| {_cell(last.get('asyncio_tasks'))} | {_cell(last.get('readyz'))} |")
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        unexpected = "; ".join(f"{k} ×{v}" for k, v in sorted(r["unexpected"].items())[:8]) or "none"
        lines += ["", f"Outcomes: {outcomes}; mode flips: {r['flips']}. Unexpected: {unexpected}."]
    return "\n".join(lines) + "\n"


def commit_of(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs [default: 30]")
    parser.add_argument("--max-requests", type=int, default=10_000_000, help="stop after this many requests")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent request loops [default: 8]")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="a request past this is a hang")
    parser.add_argument("--flip-seconds", type=float, default=30.0, help="stream-mode flip interval")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the source tree whose gateway runs")
    parser.add_argument("--label", default="after", help="the result's name in bench/soak.md")
    args = parser.parse_args()
    raise_nofile()
    repo = args.repo.resolve()
    python = sys.executable
    env = {"PYTHONPATH": str(repo)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        sim_port, port = free_port(), free_port()
        simulator = Server("simulator", [python, "-m", "gateway", "simulate", "--port", str(sim_port)], sim_port,
                           "/healthz", Path(tmp) / "simulator.log", env=env, cwd=repo)
        gateway = Server("gateway", [python, "-m", "gateway", "serve", "--port", str(port),
                                     "--upstream-url", f"http://127.0.0.1:{sim_port}/v1", "--api-key", KEY,
                                     "--admin-token", ADMIN_TOKEN, "--data-dir", str(Path(tmp) / "data"),
                                     "--log-level", "warning", "--keepalive-interval", "1"],
                         port, "/healthz", Path(tmp) / "gateway.log", env=env, cwd=repo)
        simulator.start()
        try:
            simulator.wait_ready()
            gateway.start()
            gateway.wait_ready(60)
            result = asyncio.run(run_load(gateway.base, gateway.pid, args))
        finally:
            gateway.stop()
            simulator.stop()
    result.update(tree=str(repo), commit=commit_of(repo), minutes=args.minutes, concurrency=args.concurrency)
    result["growth"] = growth(result)
    (RESULTS / f"soak-{args.label}.json").write_text(json.dumps(result, indent=1))
    results = {p.stem.removeprefix("soak-"): json.loads(p.read_text()) for p in sorted(RESULTS.glob("soak-*.json"))}
    (BENCH / "soak.md").write_text(render(results))
    print(json.dumps({k: result[k] for k in ("requests", "rate_per_s", "hangs", "final_request_ok", "growth")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
