"""Head to head: two gateway trees (commits) under the same load at the same moments.

``make bench`` measures targets one after another, so the machine's drift between phases
(other tenants, frequency, caches) moves a ratio by ±0.1–0.2 from run to run; a 2–3% change
in the code is invisible there. Here both gateways run side by side in front of one
simulator and two load generators drive them *simultaneously* (each at ``--concurrency``),
so whatever the machine does hits both alike; the figure is the median over rounds of
B's CPU per request over A's (CPU from ``/proc/PID/stat``). The same tree against itself
gives 1.00 ± 0.03 on the 2-core machine (docs/performance.md). Beside it, the latency each
gateway adds, compared the same way: per round, the median time to the first content byte
through each (same upstream, same moments), and B's minus A's.

    .venv/bin/python bench/ab.py TREE_A TREE_B [--protocol chat] [--mode realtime] [--rounds 6]

TREE_A / TREE_B: checkouts (``git worktree add --detach /tmp/a <rev>``); each gateway
imports ``gateway`` from its tree (``PYTHONPATH``), everything else from this venv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import LoadGen, Server, cpu_seconds, free_port
from run import PROMPT, SCENARIOS

BENCH = Path(__file__).resolve().parent
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def body(protocol: str, model: str) -> dict[str, Any]:
    if protocol == "chat":
        return {"model": model, "messages": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    if protocol == "messages":
        return {"model": model, "max_tokens": 4096, "messages": PROMPT, "stream": True}
    return {"model": model, "input": PROMPT[0]["content"], "stream": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--protocol", choices=sorted(PATHS), default="chat")
    parser.add_argument("--mode", choices=("realtime", "compatible"), default="realtime")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="main")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=96, help="per gateway per round")
    parser.add_argument("--concurrency", type=int, default=8, help="per gateway (both at once)")
    args = parser.parse_args()
    py = sys.executable
    trees = {"A": str(Path(args.tree_a).resolve()), "B": str(Path(args.tree_b).resolve())}
    request = body(args.protocol, SCENARIOS[args.scenario])
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sim_port = free_port()
        upstream = f"http://127.0.0.1:{sim_port}/v1"
        servers = {"sim": Server("sim", [py, "-m", "gateway", "simulate", "--port", str(sim_port)], sim_port, "/healthz",
                                 tmp / "sim.log")}
        for name, tree in trees.items():
            port = free_port()
            servers[name] = Server(
                name, [py, "-m", "gateway", "serve", "--port", str(port), "--upstream-url", upstream,
                       "--data-dir", str(tmp / name), "--stream-mode", args.mode, "--log-level", "warning",
                       "--max-concurrent", "4096"],
                port, "/healthz", tmp / f"{name}.log", env={"PYTHONPATH": tree}, cwd=Path(tree))
        loadgens: dict[str, LoadGen] = {}
        try:
            for server in servers.values():
                server.start()
            for server in servers.values():
                server.wait_ready()
            loadgens = {name: LoadGen(py, BENCH / "loadgen.py") for name in trees}
            ratios: list[float] = []
            per: dict[str, list[float]] = {name: [] for name in trees}
            content: dict[str, list[float]] = {name: [] for name in trees}  # per round, median ms to first content
            for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
                n = args.requests if r else 16
                before = {name: cpu_seconds(servers[name].pid) for name in trees}
                replies: dict[str, dict[str, Any]] = {}

                def drive(name: str, n: int = n) -> None:
                    replies[name] = loadgens[name].call(
                        op="run", url=servers[name].base + PATHS[args.protocol], body=request,
                        protocol=args.protocol, headers={}, concurrency=args.concurrency, requests=n, timeout=300)

                order = ("A", "B") if r % 2 else ("B", "A")
                threads = [threading.Thread(target=drive, args=(name,)) for name in order]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                cpu = {}
                for name in trees:
                    ok = sum(1 for x in replies[name]["results"] if x["ok"])
                    if ok != n:
                        raise SystemExit(f"{name}: {n - ok} of {n} requests failed; see {servers[name].log_path}")
                    cpu[name] = (cpu_seconds(servers[name].pid) - before[name]) * 1000 / ok
                if r:
                    for name in trees:
                        per[name].append(cpu[name])
                        content[name].append(1000 * statistics.median(
                            x["content"] for x in replies[name]["results"] if x["content"] is not None))
                    ratios.append(cpu["B"] / cpu["A"])
            ratios.sort()
            print(f"{args.mode} {args.protocol}, {args.rounds} rounds x {args.requests} requests each, "
                  f"c={args.concurrency} per gateway, both at once")
            print(f"CPU ms/request: A {statistics.median(per['A']):.2f}, B {statistics.median(per['B']):.2f} (medians)")
            print(f"B/A per round: median {statistics.median(ratios):.3f} [{ratios[0]:.3f} .. {ratios[-1]:.3f}]")
            later = sorted(b - a for a, b in zip(content["A"], content["B"]))
            print(f"first content p50 ms: A {statistics.median(content['A']):.1f}, B {statistics.median(content['B']):.1f}"
                  f" (medians of rounds); B-A per round: median {statistics.median(later):+.1f}"
                  f" [{later[0]:+.1f} .. {later[-1]:+.1f}]")
        finally:
            for loadgen in loadgens.values():
                loadgen.close()
            for server in servers.values():
                server.stop()


if __name__ == "__main__":
    main()
