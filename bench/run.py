"""``make bench``: the gateway's overhead, measured against the upstream itself and a raw relay.

Processes (all on loopback, all started and stopped here): the simulator, the raw relay
(``bench/raw_relay.py``), one gateway per stream mode, optionally the LiteLLM proxy
(``--peer``), and the load generator (``bench/loadgen.py``). Rounds alternate between
targets (order rotated each round) so machine noise hits every target alike. CPU is
read from ``/proc/PID/stat`` of each server before and after each phase.

Writes ``bench/results/<timestamp>.json``; ``bench/report.py`` renders the doc from it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import (
    LoadGen,
    Server,
    cpu_seconds,
    free_port,
    http_get_json,
    machine_busy_seconds,
    memory_kib,
    raise_nofile,
)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PY = sys.executable

#: Simulator scenarios (the request's ``model``). Fixed pacing so every target sees the same upstream.
SCENARIOS = {
    "main": "large;size=2048;chunk=16;delay=0.002",  # ~2 KB answer in 128 chunks
    "short": "large;size=512;chunk=16;delay=0.002",  # 32 chunks: with main, the marginal cost of a chunk
    "replay": "large;size=102400;chunk=512",  # 100 KB answer, no pacing
    "hold": "large;size=960;chunk=16;delay=1.0",  # 60 chunks one second apart: streams stay open
    "hold_long": "large;size=2880;chunk=16;delay=1.0",  # 180 s: for a peer that needs a minute to accept 1000
    "tiny": "large;size=16;chunk=16",  # one content chunk: the fixed cost of a request
    "paced": "large;size=512;chunk=16;delay=0.02",  # 50 chunks/s per stream: load that leaves CPU to spare
}
#: A phase during which other processes on the machine used more than this share of it is run again (once).
FOREIGN_LIMIT = 0.25
RETRY_BUDGET = 25
PROMPT = [{"role": "user", "content": "Write a short greeting."}]


@dataclass
class Target:
    name: str
    protocol: str  # client protocol: chat | messages | responses
    server: str  # key of the server process measured
    path: str
    models: dict[str, str]  # scenario key -> model string this target needs
    headers: dict[str, str] = field(default_factory=dict)

    def body(self, scenario: str) -> dict[str, Any]:
        model = self.models[scenario]
        if self.protocol == "chat":
            return {"model": model, "messages": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
        if self.protocol == "messages":
            return {"model": model, "max_tokens": 4096, "messages": PROMPT, "stream": True}
        return {"model": model, "input": PROMPT[0]["content"], "stream": True}


@dataclass
class Plan:
    c1_rounds: int = 3
    c1_requests: int = 10  # per round per target
    c16_rounds: int = 9  # the issue #20 verdict is the median of per-round ratios: more rounds, steadier
    c16_requests: int = 48
    c64_rounds: int = 4
    c64_requests: int = 128
    marginal_rounds: int = 3
    tiny_rounds: int = 3
    tiny_requests: int = 50  # at concurrency 1
    paced_rounds: int = 3
    paced16_requests: int = 32
    paced64_requests: int = 128
    replay_requests: int = 5
    replay_rounds: int = 2
    hold_streams: int = 1000
    profile_seconds: int = 10

    @classmethod
    def quick(cls) -> Plan:
        return cls(c1_rounds=1, c1_requests=3, c16_rounds=1, c16_requests=16, c64_rounds=1, c64_requests=64,
                   marginal_rounds=1, tiny_rounds=1, tiny_requests=8, paced_rounds=1, paced16_requests=16,
                   paced64_requests=64, replay_requests=2, replay_rounds=1,
                   hold_streams=100, profile_seconds=3)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (q in 0..100)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles (ms) of the successful requests' first byte, first content byte and total."""
    ok = [r for r in results if r["ok"]]
    out: dict[str, Any] = {"n": len(results), "ok": len(ok), "errors": sorted({
        str(r.get("error") or r.get("status")) for r in results if not r["ok"]
    })}
    for key in ("first", "content", "total"):
        vals = [r[key] * 1000 for r in ok if r.get(key) is not None]
        out[key] = {"p50": percentile(vals, 50), "p99": percentile(vals, 99), "mean": sum(vals) / len(vals) if vals else None}
    out["frames"] = percentile([r["frames"] for r in ok], 50)
    out["bytes"] = percentile([r["bytes"] for r in ok], 50)
    return out


class Bench:
    """The servers of one run, the load generator, and the phases measured against them."""

    def __init__(self, plan: Plan, peer: bool, tmp: Path) -> None:
        self.plan, self.peer, self.tmp = plan, peer, tmp
        self.servers: dict[str, Server] = {}
        self.loadgen: LoadGen | None = None
        self.log: list[str] = []
        self.peer_key = "sk-bench-" + secrets.token_hex(8)
        self.retries_left = RETRY_BUDGET
        self.retried = 0

    # -- processes -------------------------------------------------------------------

    def start(self) -> None:
        sim_port = free_port()
        upstream = f"http://127.0.0.1:{sim_port}/v1"
        self.servers["simulator"] = Server(
            "simulator", [PY, "-m", "gateway", "simulate", "--port", str(sim_port)], sim_port, "/healthz",
            self.tmp / "simulator.log")
        port = free_port()
        self.servers["raw"] = Server(
            "raw", [PY, str(BENCH / "raw_relay.py"), "--port", str(port), "--upstream-url", upstream],
            port, None, self.tmp / "raw.log")
        if not self.peer:
            port = free_port()
            self.servers["raw-fresh"] = Server(
                "raw-fresh", [PY, str(BENCH / "raw_relay.py"), "--port", str(port), "--upstream-url", upstream,
                              "--fresh-connections"], port, None, self.tmp / "raw-fresh.log")
        for mode in ("realtime", "compatible"):
            port = free_port()
            self.servers[mode] = Server(
                mode, [PY, "-m", "gateway", "serve", "--port", str(port), "--upstream-url", upstream,
                       "--data-dir", str(self.tmp / mode), "--stream-mode", mode, "--log-level", "warning",
                       "--max-concurrent", "4096", "--max-connections-per-ip", "4096"],  # 1,000 held streams, one address
                port, "/healthz", self.tmp / f"{mode}.log")
        if self.peer:
            self.servers["litellm"] = self.litellm_server(upstream)
        for server in self.servers.values():
            server.start()
        for server in self.servers.values():
            server.wait_ready(180 if server.name == "litellm" else 30)
        self.loadgen = LoadGen(PY, BENCH / "loadgen.py")

    def litellm_server(self, upstream: str) -> Server:
        exe = BENCH / ".peer-venv" / "bin" / "litellm"
        if not exe.exists():
            raise SystemExit(f"{exe} is missing: run `make bench-peer` (it installs LiteLLM there)")
        lines = ["model_list:"]
        for key, model in SCENARIOS.items():
            lines += [f"  - model_name: bench-{key}", "    litellm_params:",
                      f"      model: {json.dumps('openai/' + model)}",
                      f"      api_base: {json.dumps(upstream)}", "      api_key: sk-bench"]
        lines += ["litellm_settings:", "  drop_params: true", "  telemetry: false", "  set_verbose: false",
                  # LiteLLM refuses to start without a master key; a throwaway one for this run
                  "general_settings:", f"  master_key: {self.peer_key}"]
        config = self.tmp / "litellm.yaml"
        config.write_text("\n".join(lines) + "\n")
        port = free_port()
        return Server(
            "litellm", [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                        "--num_workers", "1"],
            port, "/health/liveliness", self.tmp / "litellm.log",
            # its aiohttp pool allows 500 connections per upstream host by default; the gateway is
            # started with room for the 1000-stream test, so LiteLLM gets the same
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
                 "DISABLE_SCHEMA_UPDATE": "True", "AIOHTTP_CONNECTOR_LIMIT_PER_HOST": "2000",
                 "AIOHTTP_CONNECTOR_LIMIT": "2000"})

    def stop(self) -> None:
        if self.loadgen is not None:
            self.loadgen.close()
        for server in self.servers.values():
            server.stop()

    # -- targets ---------------------------------------------------------------------

    def targets(self) -> list[Target]:
        same = {k: v for k, v in SCENARIOS.items()}
        ts = [Target("direct", "chat", "simulator", "/v1/chat/completions", same),
              Target("raw", "chat", "raw", "/v1/chat/completions", same)]
        if not self.peer:  # the raw relay again, but with a new upstream TCP connection per request
            ts.append(Target("raw-fresh", "chat", "raw-fresh", "/v1/chat/completions", same))
        paths = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
        protocols = ("chat",) if self.peer else ("chat", "messages", "responses")
        for mode in ("realtime", "compatible"):
            for proto in protocols:
                ts.append(Target(f"{mode}-{proto}", proto, mode, paths[proto], same))
        if self.peer:
            ts.append(Target("litellm", "chat", "litellm", "/v1/chat/completions",
                             {k: f"bench-{k}" for k in SCENARIOS}, {"authorization": f"Bearer {self.peer_key}"}))
        return ts

    def url(self, t: Target) -> str:
        return self.servers[t.server].base + t.path

    # -- measurement -----------------------------------------------------------------

    def ours(self) -> float:
        """CPU seconds of every process this benchmark runs (servers, load generator, itself)."""
        pids = [s.pid for s in self.servers.values() if s.proc is not None and s.proc.poll() is None]
        if self.loadgen is not None:
            pids.append(self.loadgen.pid)
        return sum(cpu_seconds(p) for p in pids) + cpu_seconds(os.getpid())

    def phase(self, t: Target, scenario: str, concurrency: int, requests: int) -> dict[str, Any]:
        """One bounded load on one target. Run once more (within a global budget) when other
        processes on the machine were busy meanwhile; their share is recorded either way."""
        p = self._phase(t, scenario, concurrency, requests)
        if p["foreign_share"] <= FOREIGN_LIMIT or self.retries_left <= 0:
            return p
        self.retries_left -= 1
        self.retried += 1
        retry = self._phase(t, scenario, concurrency, requests)
        retry["retry"] = True
        retry["first_foreign_share"] = p["foreign_share"]
        return retry

    def _phase(self, t: Target, scenario: str, concurrency: int, requests: int) -> dict[str, Any]:
        assert self.loadgen is not None
        pid = self.servers[t.server].pid
        sim = self.servers["simulator"].pid
        before = (cpu_seconds(pid), cpu_seconds(sim), cpu_seconds(self.loadgen.pid), self.ours(),
                  machine_busy_seconds())
        reply = self.loadgen.call(op="run", url=self.url(t), body=t.body(scenario), protocol=t.protocol,
                                  headers=t.headers, concurrency=concurrency, requests=requests, timeout=300)
        after = (cpu_seconds(pid), cpu_seconds(sim), cpu_seconds(self.loadgen.pid), self.ours(),
                 machine_busy_seconds())
        foreign = max(0.0, (after[4] - before[4]) - (after[3] - before[3]))
        share = foreign / max(1e-6, reply["wall"] * (os.cpu_count() or 1))
        return {"results": reply["results"], "wall": reply["wall"], "cpu": after[0] - before[0],
                "sim_cpu": after[1] - before[1], "loadgen_cpu": after[2] - before[2], "foreign_share": share}

    def alternate(self, targets: list[Target], scenario: str, concurrency: int, requests: int,
                  rounds: int) -> dict[str, dict[str, Any]]:
        """Rounds over all targets, order rotated each round; results merged per target."""
        merged: dict[str, dict[str, Any]] = {
            t.name: {"results": [], "wall": 0.0, "cpu": 0.0, "sim_cpu": 0.0, "loadgen_cpu": 0.0, "rounds": [],
                     "foreign": 0.0}
            for t in targets}
        for r in range(rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for t in order:
                p = self.phase(t, scenario, concurrency, requests)
                m = merged[t.name]
                m["results"] += p["results"]
                ok = sum(1 for x in p["results"] if x["ok"])
                content = [x["content"] * 1000 for x in p["results"] if x["ok"] and x.get("content") is not None]
                m["rounds"].append({"round": r, "wall_s": round(p["wall"], 3), "cpu_s": round(p["cpu"], 3),
                                    "ok": ok, "content_p50": percentile(content, 50),
                                    "foreign_share": round(p["foreign_share"], 3), "retried": bool(p.get("retry"))})
                m["foreign"] += p["foreign_share"] * p["wall"]
                for k in ("wall", "cpu", "sim_cpu", "loadgen_cpu"):
                    m[k] += p[k]
        out = {}
        for name, m in merged.items():
            s = summarize(m["results"])
            n = max(1, s["ok"])
            s.update(wall_s=m["wall"], cpu_s=m["cpu"], sim_cpu_s=m["sim_cpu"], loadgen_cpu_s=m["loadgen_cpu"],
                     cpu_ms_per_req=m["cpu"] * 1000 / n, rps=s["ok"] / m["wall"] if m["wall"] else None,
                     rounds=m["rounds"], foreign_share=m["foreign"] / m["wall"] if m["wall"] else None)
            out[name] = s
        return out

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        self.log.append(line)
        print(line, flush=True)

    def run(self) -> dict[str, Any]:
        plan, targets = self.plan, self.targets()
        res: dict[str, Any] = {"meta": machine_info(self.peer, plan), "targets": {
            t.name: {"protocol": t.protocol, "process": t.server} for t in targets}}
        procs = {name: s.pid for name, s in self.servers.items()}
        res["memory_start"] = {name: memory_kib(pid) for name, pid in procs.items()}
        res["memory_start_note"] = "after /healthz answered, before any request"
        self.say("warm-up")
        self.alternate(targets, "main", 4, 12, 1)
        self.alternate(targets, "replay", 1, 2, 1)
        time.sleep(1.0)
        res["memory_warm"] = {name: memory_kib(pid) for name, pid in procs.items()}
        res["idle_cpu_per_s"] = self.idle_cpu(procs, 3.0)
        res["load"] = {}
        for c, n, rounds in ((1, plan.c1_requests, plan.c1_rounds), (16, plan.c16_requests, plan.c16_rounds),
                             (64, plan.c64_requests, plan.c64_rounds)):
            self.say(f"concurrency {c}: {rounds} rounds x {n} requests x {len(targets)} targets")
            res["load"][str(c)] = self.alternate(targets, "main", c, n, rounds)
        res["load_paced"] = {}
        for c, n in ((16, plan.paced16_requests), (64, plan.paced64_requests)):
            self.say(f"paced answers, concurrency {c}: {plan.paced_rounds} rounds x {n} requests x {len(targets)} targets")
            res["load_paced"][str(c)] = self.alternate(targets, "paced", c, n, plan.paced_rounds)
        if not self.peer:
            self.say("fixed cost per request (one-chunk answers, concurrency 1)")
            res["load_tiny"] = self.alternate(targets, "tiny", 1, plan.tiny_requests, plan.tiny_rounds)
            self.say("marginal chunk cost (short vs main answer, concurrency 16)")
            res["load_short"] = self.alternate(targets, "short", 16, plan.c16_requests, plan.marginal_rounds)
            self.say("100 KB answer (replay)")
            res["replay"] = self.alternate(targets, "replay", 1, plan.replay_requests, plan.replay_rounds)
        res["chunks"] = self.chunk_counts()
        res["durability"] = self.durability()  # before hold_all restarts the gateways (and their counters)
        self.say(f"memory with {plan.hold_streams} open streams")
        res["streams"] = self.hold_all(targets)
        res["memory_end"] = {name: memory_kib(s.pid) for name, s in self.servers.items()}
        res["memory_end_note"] = "gateways restarted for each open-streams measurement; see streams"
        if not self.peer:
            by_name = {t.name: t for t in targets}
            res["profiles"] = {}
            for key, name, scenario, c in (("realtime-messages", "realtime-messages", "main", 16),
                                           ("raw", "raw", "main", 16),
                                           ("realtime-chat-fixed", "realtime-chat", "tiny", 1)):
                self.say(f"profile {key} ({scenario} answers, concurrency {c})")
                res["profiles"][key] = self.profile(by_name[name], scenario, c, key)
        res["log"] = self.log
        res["retried_phases"] = self.retried
        return res

    def durability(self) -> dict[str, dict[str, float]]:
        """Rows each gateway spilled or lost over the run (its /metrics): a benchmark of a
        store that failed over to the journal would price the journal."""
        out: dict[str, dict[str, float]] = {}
        for mode in ("realtime", "compatible"):
            server = self.servers.get(mode)
            if server is None or server.proc is None or server.proc.poll() is not None:
                continue
            with urllib.request.urlopen(server.base + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
            counts = {"spilled": 0.0, "lost": 0.0}
            for line in text.splitlines():
                for key in counts:
                    if line.startswith(f"codebuddy2api_records_{key}_total"):
                        counts[key] += float(line.rsplit(" ", 1)[1])
            out[mode] = counts
        return out

    def idle_cpu(self, procs: dict[str, int], seconds: float) -> dict[str, float]:
        before = {n: cpu_seconds(p) for n, p in procs.items()}
        time.sleep(seconds)
        return {n: (cpu_seconds(p) - before[n]) / seconds for n, p in procs.items()}

    def chunk_counts(self) -> dict[str, int]:
        """Upstream frames per answer (``data:`` lines incl. [DONE]), read off the direct target."""
        direct = next(t for t in self.targets() if t.name == "direct")
        out = {}
        for scenario in ("main", "short", "replay", "tiny", "paced"):
            p = self.phase(direct, scenario, 1, 1)
            out[scenario] = int(p["results"][0]["frames"])
        return out

    def restart(self, name: str) -> None:
        """A fresh process, so its memory figures are its own (CPython rarely returns freed memory)."""
        server = self.servers[name]
        server.stop()
        server.start()
        server.wait_ready(180 if name == "litellm" else 30)

    def hold_all(self, targets: list[Target]) -> dict[str, Any]:
        """RSS with N streams open at once. Each gateway/peer measurement runs in a freshly started
        process warmed with a few requests of the same protocol; direct and raw run first."""
        assert self.loadgen is not None
        wanted = ("direct", "raw", "realtime-chat", "realtime-messages", "compatible-chat", "litellm")
        by_name = {t.name: t for t in targets}
        stats_url = self.servers["simulator"].base + "/_sim/stats"
        n = self.plan.hold_streams
        out: dict[str, Any] = {}
        for name in wanted:
            t = by_name.get(name)
            if t is None:
                continue
            if t.server in ("realtime", "compatible", "litellm"):
                self.restart(t.server)
                fresh = memory_kib(self.servers[t.server].pid)
                self.phase(t, "main", 4, 8)
                time.sleep(0.5)
            else:
                fresh = None
            pid = self.servers[t.server].pid
            before = memory_kib(pid)
            slow = t.name == "litellm"
            reply = self.loadgen.call(op="hold", url=self.url(t), body=t.body("hold_long" if slow else "hold"),
                                      headers=t.headers, n=n, timeout=150 if slow else 90)
            deadline = time.monotonic() + (60 if slow else 30)
            upstream_open = 0
            while time.monotonic() < deadline:
                upstream_open = int(http_get_json(stats_url)["open_streams"])
                if upstream_open >= reply["opened"]:
                    break
                time.sleep(0.5)
            time.sleep(1.0)
            held = memory_kib(pid)
            released = self.loadgen.call(op="release")
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and int(http_get_json(stats_url)["open_streams"]) > 0:
                time.sleep(0.5)
            time.sleep(1.0)
            out[t.name] = {"process": t.server, "opened": reply["opened"], "failed": reply["failed"],
                           "ramp_s": reply["ramp_s"], "upstream_open": upstream_open, "fresh": fresh,
                           "before": before, "held": held, "after": memory_kib(pid), "released": released}
            self.say(f"  {t.name}: {reply['opened']} open, rss {held['rss_kib'] / 1024:.1f} MiB")
        return out

    def profile(self, t: Target, scenario: str, concurrency: int, key: str) -> dict[str, Any]:
        """py-spy on the target's process while the load generator runs a bounded load."""
        from profile_summary import summarize_raw

        assert self.loadgen is not None
        pyspy = Path(PY).parent / "py-spy"
        if not pyspy.exists():
            return {"ok": False, "error": "py-spy is not installed in the venv"}
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        raw = RESULTS / f"{stamp}-profile-{key}.txt"
        rate = 250
        seconds = self.plan.profile_seconds
        pid = self.servers[t.server].pid
        spy = subprocess.Popen(
            [str(pyspy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate),
             "--nonblocking", "--format", "raw", "--output", str(raw)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        # enough requests to outlast the sampling window (main: ~0.35 s each; tiny: ~5 ms each)
        per_request = 0.35 if scenario == "main" else 0.006
        requests = int(concurrency * (seconds + 1) / per_request)
        load = self.phase(t, scenario, concurrency, requests)
        try:
            output, _ = spy.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            output, _ = spy.communicate()
        if spy.returncode != 0 or not raw.exists():
            return {"ok": False, "error": f"py-spy exit {spy.returncode}: {output.strip()[-500:]}"}
        summary = summarize_raw(raw.read_text())
        summary.update(ok=True, tool=f"py-spy record --rate {rate} --nonblocking", rate=rate, target=t.name,
                       scenario=SCENARIOS[scenario], concurrency=concurrency, raw_file=str(raw.relative_to(ROOT)),
                       requests=len(load["results"]), cpu_s=load["cpu"], wall_s=load["wall"])
        return summary


def machine_info(peer: bool, plan: Plan) -> dict[str, Any]:
    cpu_model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "kind": "peer" if peer else "main",
        "nproc": os.cpu_count(), "cpu_model": cpu_model, "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: version(p) for p in ("uvicorn", "starlette", "httpx", "orjson", "uvloop", "httptools", "h11")},
        "scenarios": SCENARIOS, "plan": plan.__dict__, "commit": git_head(),
        "litellm_version": peer_version() if peer else None,
        "peer_packages": peer_packages() if peer else None,
    }


def git_head() -> str | None:
    """The checked-out commit, read from .git without running git."""
    try:
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            path = ROOT / ".git" / ref
            if path.exists():
                return path.read_text().strip()[:12]
            for line in (ROOT / ".git" / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0][:12]
            return None
        return head[:12]
    except OSError:
        return None


def peer_version() -> str | None:
    return peer_packages().get("litellm")


def peer_packages() -> dict[str, str]:
    """Versions of the peer venv's server stack (LiteLLM brings uvloop/httptools; we do not)."""
    out = {}
    for dist in (BENCH / ".peer-venv").glob("lib/python*/site-packages/*.dist-info"):
        name, _, version = dist.name.removesuffix(".dist-info").partition("-")
        if name.lower() in ("litellm", "uvloop", "httptools", "uvicorn", "fastapi"):
            out[name.lower()] = version
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="add the LiteLLM proxy (bench/.peer-venv) as a target")
    parser.add_argument("--quick", action="store_true", help="tiny plan, to check the harness")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args()
    plan = Plan.quick() if args.quick else Plan()
    RESULTS.mkdir(parents=True, exist_ok=True)
    raise_nofile()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cb2a-bench-") as tmp:
        bench = Bench(plan, args.peer, Path(tmp))
        try:
            bench.start()
            res = bench.run()
        except BaseException:
            for server in bench.servers.values():
                print(f"--- {server.name} log (tail) ---", file=sys.stderr)
                if server.log_path.exists():
                    print(server.log_path.read_text()[-2000:], file=sys.stderr)
            raise
        finally:
            bench.stop()
        if not args.peer:
            from micro import run_all

            print("micro-measurements", flush=True)
            res["micro"] = run_all()
            from key_check import run_all as key_check

            print("managed key check (issue #28)", flush=True)
            res["key_check"] = key_check()
            from rollout_export import run_all as rollout_export

            print("bulk rollout export (issue #37)", flush=True)
            res["rollout_export"] = rollout_export()
        res["meta"]["duration_s"] = round(time.monotonic() - started, 1)
        res["meta"]["quick"] = args.quick
        logs = {name: s.log_path.read_text()[-3000:] for name, s in bench.servers.items() if s.log_path.exists()}
        res["server_log_tails"] = logs
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"{stamp}{'-peer' if args.peer else ''}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"results: {out.relative_to(ROOT)} ({res['meta']['duration_s']} s)")
    if not args.no_report:
        return subprocess.call([PY, str(BENCH / "report.py")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
