"""Store faults, measured (issue #31): not a timed test, a measurement, run by hand on
``main`` and a branch alike (``--repo``: the source tree whose gateway is started; its
code runs on this checkout's Python environment).

One gateway (``python -m gateway serve --simulator`` with a client key) on a fresh data
dir, then, with the SQLite file write-locked by a second connection (``BEGIN EXCLUSIVE``):

1. Responses (streamed, ``store: true``) end-to-end seconds, p50/p99 over 16 requests from
   4 threads, against the same with the store healthy;
2. 20 Chat requests, then 1.5 s, then SIGKILL (the lock still held); after the lock goes,
   a restart on the same data dir: how many of those 20 finished requests have no row;
3. with the file's WAL read marks locked by this process (an unreadable store), Chat
   end-to-end seconds (3 requests; each capped at 30 s).

Prints one JSON object and writes ``bench/results/store-faults-<label>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import free_port

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
KEY = "bench-store-faults-client-key-0123456789"
HEADERS = {"authorization": f"Bearer {KEY}"}
DB = "codebuddy2api.sqlite3"


class Gateway:
    def __init__(self, repo: Path, data: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
        env["PYTHONPATH"] = str(repo)
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--simulator", "--port", str(self.port), "--data-dir", str(data),
             "--api-key", KEY, "--log-level", "warning"], cwd=repo, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start (see {log})")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def responses(url: str, text: str) -> float:
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/responses", headers=HEADERS, timeout=60,
                      json={"model": "echo", "input": text, "store": True, "stream": True}) as r:
        body = b"".join(r.iter_bytes())
    assert r.status_code == 200 and b"response.completed" in body, (r.status_code, body[:200])
    return time.monotonic() - started


def chat(url: str, text: str, timeout: float = 60) -> tuple[float, str]:
    started = time.monotonic()
    try:
        r = httpx.post(url + "/v1/chat/completions", headers=HEADERS, timeout=timeout,
                       json={"model": "echo", "messages": [{"role": "user", "content": text}]})
        outcome = str(r.status_code)
        request_id = r.headers.get("x-request-id", "")
    except httpx.TimeoutException:
        outcome, request_id = "timeout", ""
    return time.monotonic() - started, f"{outcome} {request_id}"


def pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return round(ordered[max(0, -(-len(ordered) * q // 100) - 1)], 3)


def responses_latency(url: str, label: str) -> dict[str, float]:
    with ThreadPoolExecutor(4) as pool:
        seconds = list(pool.map(lambda i: responses(url, f"{label} {i}"), range(16)))
    return {"p50_s": pct(seconds, 50), "p99_s": pct(seconds, 99), "max_s": round(max(seconds), 3)}


@contextlib.contextmanager
def write_locked(data: Path) -> Any:
    conn = sqlite3.connect(data / DB, isolation_level=None, timeout=30)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


@contextlib.contextmanager
def unreadable(data: Path) -> Any:
    fd = os.open(str(data / DB) + "-shm", os.O_RDWR)
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 120)
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 5, 123)
                break
            except OSError:
                fcntl.lockf(fd, fcntl.LOCK_UN, 8, 120)
                time.sleep(0.01)
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 8, 120)
        os.close(fd)


def audit_ids(data: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(data / DB, timeout=30)) as conn:
        return {r[0] for r in conn.execute("SELECT request_id FROM audit")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=BENCH.parent)
    parser.add_argument("--label", default="branch")
    args = parser.parse_args()
    out: dict[str, Any] = {"label": args.label, "repo": str(args.repo)}
    with tempfile.TemporaryDirectory(prefix="store-faults-") as tmp:
        data, log = Path(tmp) / "data", Path(tmp) / "gateway.log"
        gw = Gateway(args.repo, data, log)
        try:
            responses_latency(gw.url, "warm")
            out["responses_healthy"] = responses_latency(gw.url, "healthy")
            with write_locked(data):
                out["responses_write_locked"] = responses_latency(gw.url, "locked")
                finished = [chat(gw.url, f"kill {i}")[1].split()[-1] for i in range(20)]
                time.sleep(1.5)
                gw.proc.send_signal(signal.SIGKILL)
                gw.proc.wait()
        finally:
            gw.stop()
        gw = Gateway(args.repo, data, log)
        try:
            time.sleep(3)  # replay at start, then the background retries
            out["sigkill_finished_requests"] = len(finished)
            out["sigkill_rows_lost"] = len(set(finished) - audit_ids(data))
            with unreadable(data):
                seconds = [chat(gw.url, f"unreadable {i}", timeout=30) for i in range(3)]
            out["chat_store_unreadable"] = {"seconds": [round(s, 3) for s, _ in seconds],
                                            "status": [o.split()[0] for _, o in seconds]}
        finally:
            gw.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"store-faults-{args.label}.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
