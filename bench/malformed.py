"""``make bench-malformed``: a few thousand malformed bodies against a gateway and the simulator.

Starts the simulator and one gateway (own processes, loopback, stopped by PID at the end),
posts the seeded corpus of ``tests/hostile.py`` to the three generation routes and
``count_tokens`` one at a time, and counts what the issue (#14) measured:

- answers with a 5xx status, answers that are not the route's exact error shape (or a
  2xx that is not JSON / a stream without its terminal event);
- upstream calls made for bodies invalid by construction, and for any 4xx answer (the
  simulator's request log is read and cleared after every body);
- the gateway's RSS: idle, after one valid request per route (tokenizer loaded), at the
  end, and its peak (VmHWM).

Writes ``bench/results/malformed-<label>-<timestamp>.json`` and prints a summary. The
gateway is the source tree of the current directory (``python -m gateway``): to measure
another checkout, run this script from there (``cd ../main && python <this>/bench/malformed.py``).
Memory under large bodies is ``bench/hostile.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from procs import Server, free_port, memory_kib

from tests.hostile import ROUTES, SEEDS, Case, corpus, encode, error_shape_problem, stream_problem

PY = sys.executable


def classify(case: Case, response: httpx.Response) -> str | None:
    """None when the answer is acceptable in shape, else the problem."""
    status = response.status_code
    kind = response.headers.get("content-type", "")
    if status >= 400:
        try:
            body = response.json()
        except ValueError:
            return f"{status} not JSON: {response.text[:120]!r}"
        return error_shape_problem(case.route, body)
    if kind.startswith("text/event-stream"):
        return stream_problem(case.route, response.text)
    try:
        response.json()
    except ValueError:
        return f"{status} not JSON"
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-malformed-"))
    sim_port, gw_port = free_port(), free_port()
    simulator = Server("simulator", [PY, "-m", "gateway", "simulate", "--port", str(sim_port)],
                       sim_port, "/healthz", tmp / "simulator.log")
    gateway = Server("gateway", [PY, "-m", "gateway", "serve", "--port", str(gw_port),
                                 "--upstream-url", f"http://127.0.0.1:{sim_port}/v1", "--data-dir", str(tmp / "data"),
                                 "--stream-mode", args.stream_mode, "--log-level", "error"],
                     gw_port, "/healthz", tmp / "gateway.log")
    cases = corpus(seed=args.seed, random_mutations=args.random_mutations)
    result: dict[str, Any] = {"cases": len(cases), "stream_mode": args.stream_mode, "seed": args.seed}
    try:
        simulator.start()
        gateway.start()
        simulator.wait_ready()
        gateway.wait_ready()
        sim = httpx.Client(base_url=simulator.base, timeout=300)  # a loaded machine is slow, not wrong
        client = httpx.Client(base_url=gateway.base, timeout=300)
        result["rss_idle_kib"] = memory_kib(gateway.pid)["rss_kib"]
        for route in ROUTES:  # warm-up: one valid request per route (loads the tokenizer)
            client.post(route, content=encode(SEEDS[route][0]), headers={"content-type": "application/json"})
        result["rss_warm_kib"] = memory_kib(gateway.pid)["rss_kib"]
        sim.delete("/_sim/requests")
        statuses: collections.Counter[str] = collections.Counter()
        problems: list[dict[str, Any]] = []
        upstream_invalid = upstream_4xx = server_errors = unshaped = 0
        invalid_not_400 = 0
        started = time.monotonic()
        for case in cases:
            try:
                response = client.post(case.route, content=case.body, headers={"content-type": "application/json"})
            except httpx.HTTPError as exc:
                problems.append({"route": case.route, "label": case.label, "problem": f"transport: {exc!r}",
                                 "body": case.body[:200].decode("utf-8", "replace")})
                unshaped += 1
                continue
            calls = len(sim.get("/_sim/requests").json()["requests"])
            if calls:
                sim.delete("/_sim/requests")
            status = response.status_code
            statuses[f"{status // 100}xx"] += 1
            problem = classify(case, response)
            if status >= 500:
                server_errors += 1
            if problem is not None:
                unshaped += 1
            if case.invalid and calls:
                upstream_invalid += 1
            if 400 <= status < 500 and calls:
                upstream_4xx += 1
            if case.invalid and status != 400:
                invalid_not_400 += 1
            if problem or status >= 500 or (case.invalid and (calls or status != 400)):
                problems.append({"route": case.route, "label": case.label, "status": status,
                                 "upstream_calls": calls, "problem": problem,
                                 "answer": response.text[:200], "body": case.body[:200].decode("utf-8", "replace")})
        result.update(
            seconds=round(time.monotonic() - started, 1),
            invalid_cases=sum(c.invalid for c in cases),
            statuses=dict(statuses),
            server_errors=server_errors,
            unshaped=unshaped,
            upstream_calls_for_invalid=upstream_invalid,
            upstream_calls_for_4xx=upstream_4xx,
            invalid_not_400=invalid_not_400,
            rss_end_kib=memory_kib(gateway.pid)["rss_kib"],
            rss_peak_kib=memory_kib(gateway.pid)["hwm_kib"],
            problems_by_label=dict(collections.Counter(f"{p['route']} {p['label']}" for p in problems)),
            # every 5xx and every answer of the wrong shape; a sample of the rest
            failures=[p for p in problems if p.get("status", 0) >= 500 or p["problem"]],
            sample=[p for p in problems if not (p.get("status", 0) >= 500 or p["problem"])][:100],
        )
    finally:
        gateway.stop()
        simulator.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--random-mutations", type=int, default=1250)
    parser.add_argument("--stream-mode", default="compatible", choices=["compatible", "realtime"])
    parser.add_argument("--label", default="", help="a name for the results file (e.g. before/after)")
    args = parser.parse_args()
    result = run(args)
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"malformed-{args.label + '-' if args.label else ''}{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("failures", "sample")}
    print(json.dumps(summary, indent=1))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
