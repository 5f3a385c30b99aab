"""Issue #25's tenant attacks, measured (not a timed test): what key B gets of key A's state,
what tampered envelopes get, what a forged Gemini ``__gts_`` id sends upstream, and what a
compaction replay costs.

Starts the built-in simulator (``python -m gateway simulate``) and one gateway in front of
it with two client keys, from the source tree given by ``--repo`` (default: this one, so
the same script measures ``main`` -- e.g. ``git archive main | tar -x -C /tmp/main`` -- and
a branch alike). Prints one JSON object (and writes ``bench/results/tenants-<label>.json``).
"""

from __future__ import annotations

import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Server, before_after_main, free_port

KEY_A = "bench-tenant-alice-0123456789abcdef"
KEY_B = "bench-tenant-bob-0123456789abcdef00"
HISTORY = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "alice's secret plan"}]}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def h(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def attacks(base: str, sim: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base + "/v1", timeout=30) as c:
        stored = c.post("/responses", headers=h(KEY_A), json={"model": "echo", "input": "alice's secret plan", "store": True}).json()
        out["a_get_own"] = c.get(f"/responses/{stored['id']}", headers=h(KEY_A)).status_code
        out["b_get_a"] = c.get(f"/responses/{stored['id']}", headers=h(KEY_B)).status_code
        httpx.delete(sim + "/_sim/requests")
        cont = c.post("/responses", headers=h(KEY_B), json={"model": "echo", "input": "go on", "previous_response_id": stored["id"]})
        sent = json.dumps(httpx.get(sim + "/_sim/requests").json())
        out["b_continue_a"] = cont.status_code
        out["b_continue_a_history_upstream"] = "alice's secret plan" in sent
        compacted = c.post("/responses", headers=h(KEY_A), json={
            "model": "echo", "store": False, "input": [*HISTORY, {"type": "compaction_trigger"}]}).json()
        item = compacted["output"][0]
        value = item["encrypted_content"]
        payload = value.split(".")[1]
        try:
            readable = "You said" in base64.urlsafe_b64decode(payload + "==").decode("utf-8", "replace")
        except ValueError:
            readable = False
        out["compaction_envelope_readable"] = readable

        def replay(key: str, content: str) -> int:
            body = {"model": "echo", "store": False, "input": [{**item, "encrypted_content": content}, {"role": "user", "content": "go"}]}
            return c.post("/responses", headers=h(key), json=body).status_code

        out["a_replay_own"] = replay(KEY_A, value)
        out["b_replay_a"] = replay(KEY_B, value)
        middle = len(value) // 2
        out["tampered"] = replay(KEY_A, value[:middle] + ("A" if value[middle] != "A" else "B") + value[middle + 1:])
        out["truncated"] = replay(KEY_A, value[: len(value) // 3])
        forged = base64.urlsafe_b64encode(json.dumps({"c": "forged summary"}).encode()).decode()
        out["unsigned"] = replay(KEY_A, f"cb2a1.{forged}.")
        gts = "call_1__gts_" + base64.urlsafe_b64encode(b"client text as a signature").decode().rstrip("=")
        httpx.delete(sim + "/_sim/requests")
        c.post("/chat/completions", headers=h(KEY_A), json={"model": "echo", "tools": TOOLS, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": gts, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": gts, "content": "sunny"}]})
        out["forged_gts_reaches_thought_signature"] = "client text as a signature" in json.dumps(httpx.get(sim + "/_sim/requests").json())
        times = []
        for _ in range(200):
            started = time.perf_counter()
            replay(KEY_A, value)
            times.append((time.perf_counter() - started) * 1000)
        out["compaction_replay_ms_median"] = round(statistics.median(times), 2)
        out["compaction_envelope_chars"] = len(value)
    return out


def run(repo: Path, label: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-tenants-"))
    sim_port, port = free_port(), free_port()
    sim = Server("simulator", [sys.executable, "-m", "gateway", "simulate", "--port", str(sim_port)], sim_port, None,
                 tmp / "sim.log", env={"PYTHONPATH": str(repo)}, cwd=repo)
    gateway = Server(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--api-key", KEY_A, "--api-key", KEY_B,
         "--upstream-url", f"http://127.0.0.1:{sim_port}/v1", "--data-dir", str(tmp / "data"), "--log-level", "warning"],
        port, "/healthz", tmp / "gateway.log", env={"PYTHONPATH": str(repo)}, cwd=repo,
    )
    sim.start()
    try:
        sim.wait_ready()
        gateway.start()
        gateway.wait_ready()
        return {"label": label, "repo": str(repo), **attacks(gateway.base, f"http://127.0.0.1:{sim_port}")}
    finally:
        gateway.stop()
        sim.stop()


if __name__ == "__main__":
    sys.exit(before_after_main(__doc__, run, "tenants"))
