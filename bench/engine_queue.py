"""Streams queued at a real llama-server (issue #40), run by hand:

    .venv/bin/python bench/engine_queue.py [--streams 12] [--parallel 1] [--timeout 4]

One llama-server (``make llama-server``; SmolLM2-135M, ``-np --parallel``, one thread) and a
gateway in front of it with short first-byte and idle timeouts (``--timeout``), twice:
without and with ``max_in_flight = --parallel`` in its ``[[upstreams]]`` table. N streams
at once (``max_tokens`` 32, greedy); prints how many answered, the errors by code and
when the last one ended. Without the cap the engine queues the streams itself and the
gateway's timers run while they wait; with it they wait in the gateway.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.processes import GatewayProcess, free_port  # noqa: E402

LLAMA_DIR = Path(os.environ.get("CODEBUDDY2API_LLAMA_DIR", Path.home() / ".cache/codebuddy2api/llama"))


def llama(parallel: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [str(LLAMA_DIR / "bin/llama-server"), "-m", str(LLAMA_DIR / "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            "--host", "127.0.0.1", "--port", str(port), "--no-repack", "-c", str(1024 * parallel),
            "-np", str(parallel), "-t", "1", "--seed", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url + "/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("llama-server did not start")


def stream(base: str, n: int) -> tuple[str, float]:
    started = time.monotonic()
    body = {"model": "smol", "stream": True, "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": f"Count from {n} to {n + 20}."}]}
    with httpx.stream("POST", base + "/chat/completions", json=body, timeout=120) as response:
        text = response.read().decode()
    if response.status_code != 200:
        return f"http {response.status_code}", time.monotonic() - started
    if '"type":"' in text and "error" in text:
        code = text.split('"code":"', 1)[1].split('"', 1)[0] if '"code":"' in text else "error"
        return code, time.monotonic() - started
    return "ok", time.monotonic() - started


def run(url: str, streams: int, timeout: float, cap: int | None, tmp: Path) -> None:
    config = tmp / f"gw-{cap}.toml"
    config.write_text(f'[[upstreams]]\nname = "llama"\nbase_url = "{url}"\n'
                      + (f"max_in_flight = {cap}\n" if cap else ""))
    gw = GatewayProcess("--config", str(config), "--data-dir", str(tmp / f"data-{cap}"), "--first-byte-timeout",
                        str(timeout), "--idle-timeout", str(timeout), "--stream-mode", "realtime",
                        "--log-level", "error", log_dir=tmp)
    try:
        gw.wait_healthy()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            results = list(pool.map(lambda n: stream(gw.base_url, n), range(streams)))
    finally:
        gw.stop()
    codes = collections.Counter(code for code, _ in results)
    last = max(seconds for _, seconds in results)
    print(f"max_in_flight={cap or 'none':>4}  answered {codes['ok']}/{streams}  errors {({k: v for k, v in codes.items() if k != 'ok'})}"
          f"  last ended at {last:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args()
    proc, url = llama(args.parallel)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for cap in (None, args.parallel):
                run(url, args.streams, args.timeout, cap, Path(tmp))
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
