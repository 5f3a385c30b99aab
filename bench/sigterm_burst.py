"""Requests sent just before SIGTERM: how many got no answer (not a timed test, a count).

Starts one gateway with the built-in simulator (``python -m gateway serve --simulator``) from
the source tree given by ``--repo`` (default: this one, so the same script counts on ``main``
and on a branch), then, ``--runs`` times: ``--requests`` threads each open a new connection
and send one streamed Chat Completions request; ``--lead`` seconds after the first thread
started, SIGTERM. Each request ends as ``http <status>`` (an HTTP answer read to the close),
``reset`` (a reset or a close with nothing), or ``refused`` (the connection itself refused:
nothing was sent). Past ``--max-connections-per-ip`` (256) a connection is answered 503
``too_many_connections`` before anything is read: no request, no audit row. After the exit the audit rows are counted from the SQLite file. The
issue #40 study: 58 of 90 requests sent 30 ms before SIGTERM got no answer and no row.

    python bench/sigterm_burst.py --repo /tmp/cb2a-main --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from tests.processes import free_port, wait_healthy  # noqa: E402


def one_run(repo: Path, requests: int, lead: float) -> dict[str, int]:
    data = Path(tempfile.mkdtemp(prefix="sigterm-burst-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port), "--simulator",
                             "--data-dir", str(data), "--log-level", "warning"],
                            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(proc, f"http://127.0.0.1:{port}", 60)
    body = json.dumps({"model": "text", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    outcomes = ["unfinished"] * requests

    def send(i: int) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        except OSError:
            outcomes[i] = "refused"
            return
        with sock:
            got = b""
            try:
                sock.sendall(request)
                while piece := sock.recv(65536):
                    got += piece
            except OSError:
                pass
            outcomes[i] = f"http {got.split()[1].decode()}" if got.startswith(b"HTTP/1.1 ") else "reset"

    threads = [threading.Thread(target=send, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    time.sleep(lead)
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(90)
    proc.wait(90)
    with sqlite3.connect(data / "codebuddy2api.sqlite3") as db:
        rows = db.execute("SELECT count(*) FROM audit").fetchone()[0]
        codes = dict(db.execute("SELECT coalesce(error_code, outcome), count(*) FROM audit GROUP BY 1").fetchall())
    return dict(sorted(Counter(outcomes).items())) | {"audit_rows": rows, "audited": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE, help="the source tree to run the gateway from")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=90)
    parser.add_argument("--lead", type=float, default=0.03, help="seconds between the first request and SIGTERM")
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(one_run(args.repo, args.requests, args.lead)), flush=True)


if __name__ == "__main__":
    main()
