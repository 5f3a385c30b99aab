"""The gateway's memory under hostile input (issue #14): not a timed test, a measurement.

Starts one gateway (``python -m gateway serve`` with a client key and the built-in
simulator) from the source tree given by ``--repo`` (default: this one, so the same script
measures ``main`` and a branch alike), then reads the VmRSS of its process tree:

1. idle: after start-up and one valid request per protocol;
2. after 2,000 malformed bodies (authenticated: wrong types, out-of-range numbers, invalid
   JSON, deep nesting, a 2 MB ``system``) spread over the three generation routes and
   ``count_tokens``;
3. during and after 8 concurrent unauthenticated 50 MB bodies (raw sockets; each client
   sends in 1 MiB pieces until the server answers or closes);
4. the same with the client key (the body limit's case rather than the key's);
5. (issue #25) the event-loop attacks, each alone while ``/healthz`` is sampled every 20 ms
   (p50/p99/max latency, RSS peak): a tool schema whose ``$ref`` points at a loopback
   listener that holds the connection 15 s (connections it accepted), a backtracking
   ``pattern``, an ``allOf`` fan-out of depth 17, 1 M chat messages (28.6 MiB), 300 k
   tools, ``count_tokens`` of 1 M messages, and six 1 M-message bodies at once; (issue #36)
   a 30 MiB ``/v1/completions`` body of token-id prompts (2,048 x 2,600 ids).

Prints one JSON object (and writes it to ``bench/results/hostile-<label>.json``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Server, free_port, memory_kib

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
KEY = "bench-hostile-key-0123456789"
MiB = 1024 * 1024
ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


def malformed_bodies() -> list[bytes]:
    """A fixed mix of bad bodies, the kinds issue #14 found (2,000 in all)."""
    deep = "[" * 1000 + '"x"' + "]" * 1000  # as text: json.dumps itself recurses too deep
    base_chat = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}
    variants: list[Any] = [
        b"{not json", b"", b"[]", b"null", b'"text"', b"\xff\xfe",
        {**base_chat, "max_tokens": "str"}, {**base_chat, "max_tokens": []}, {**base_chat, "max_tokens": {}},
        {**base_chat, "max_tokens": -1}, {**base_chat, "max_tokens": 2**70}, {**base_chat, "temperature": -1},
        {**base_chat, "temperature": 2**70}, {**base_chat, "messages": "hi"}, {**base_chat, "messages": [1, 2]},
        {**base_chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": "no"}}]},
        ('{"model": "text", "messages": [{"role": "user", "content": "x"}], "deep": ' + deep + "}").encode(),
        ('{"model": "text", "messages": ' + deep + "}").encode(),
        {"model": "text", "max_tokens": 16, "system": "s" * (2 * MiB), "messages": [{"role": "user", "content": 3}]},
        {"model": 5, "input": {"a": 1}}, {"model": "text", "messages": [{"role": "bogus", "content": "x"}]},
    ]
    out = [v if isinstance(v, bytes) else json.dumps(v).encode() for v in variants]
    return [out[i % len(out)] for i in range(2000)]


def post(base: str, path: str, body: bytes, key: str | None = KEY, timeout: float = 60) -> int:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
        headers["x-api-key"] = key
    request = urllib.request.Request(base + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def big_upload(port: int, path: str, size: int, result: dict[str, Any], key: str | None = None) -> None:
    """Send ``size`` bytes (Content-Length declared), with or without the client key; note
    how much went out before the server answered or closed, and the status it gave."""
    piece = b"x" * MiB
    sent = 0
    start = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        auth = f"authorization: Bearer {key}\r\nx-api-key: {key}\r\n" if key else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
                f"{auth}content-length: {size}\r\n\r\n").encode()
        sock.sendall(head)
        sock.setblocking(False)
        answer = b""
        while sent < size:
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
                break  # answered before the whole body went out
            except BlockingIOError:
                pass
            try:
                sent += sock.send(piece[: min(MiB, size - sent)])
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        sock.settimeout(120)
        try:
            while b"\r\n" not in answer:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    finally:
        sock.close()
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else None
    result.update(sent_bytes=sent, status=status, seconds=round(time.monotonic() - start, 2))


def concurrent_uploads(server: Server, port: int, key: str | None, phase: str) -> dict[str, Any]:
    """8 clients at once, 50 MB each; RSS sampled every 20 ms meanwhile, and 2 s after."""
    results: list[dict[str, Any]] = [{} for _ in range(8)]
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], memory_kib(server.pid)["rss_kib"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    uploads = [threading.Thread(target=big_upload, args=(port, ROUTES[i % 3], 50 * 1000 * 1000, results[i], key))
               for i in range(8)]
    started = time.monotonic()
    for t in uploads:
        t.start()
    for t in uploads:
        t.join()
    seconds = round(time.monotonic() - started, 2)
    time.sleep(0.5)
    done.set()
    sampler.join()
    time.sleep(2)
    return {f"{phase}_seconds": seconds, f"{phase}_peak_mib": mib(peak[0]),
            f"after_{phase}_mib": mib(memory_kib(server.pid)["rss_kib"]), f"{phase}_uploads": results}


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


def run(repo: Path, label: str) -> dict[str, Any]:
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-hostile-"))
    server = Server(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--api-key", KEY,
         "--data-dir", str(tmp / "data"), "--log-level", "warning"],
        port, "/healthz", tmp / "gateway.log",
        env={"PYTHONPATH": str(repo)}, cwd=repo,
    )
    server.proc = None
    server.start()
    out: dict[str, Any] = {"label": label, "repo": str(repo)}
    try:
        server.wait_ready()
        base = server.base
        chat = json.dumps({"model": "text", "messages": [{"role": "user", "content": "hi"}]}).encode()
        msgs = json.dumps({"model": "text", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}).encode()
        resp = json.dumps({"model": "text", "input": "hi"}).encode()
        out["warmup_status"] = [post(base, "/v1/chat/completions", chat), post(base, "/v1/messages", msgs),
                                post(base, "/v1/responses", resp)]
        time.sleep(1)
        out["idle_mib"] = mib(memory_kib(server.pid)["rss_kib"])

        statuses: dict[str, int] = {}
        bodies = malformed_bodies()
        for i, body in enumerate(bodies):
            status = post(base, ROUTES[i % len(ROUTES)], body)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        time.sleep(1)
        out["malformed_statuses"] = statuses
        out["after_malformed_mib"] = mib(memory_kib(server.pid)["rss_kib"])

        for phase, key in (("big", None), ("big_keyed", KEY)):
            out.update(concurrent_uploads(server, port, key, phase))
    finally:
        server.stop()
    return out


# -- sockets and connections (issue #25): browsers, pre-auth sockets, slow headers, big frames --


def healthz_ms(base: str, samples: int, pause: float = 0.02) -> dict[str, float]:
    """``/healthz`` latency over ``samples`` fresh requests: p50, p99, max (ms)."""
    took: list[float] = []
    for _ in range(samples):
        start = time.perf_counter()
        try:
            urllib.request.urlopen(base + "/healthz", timeout=30).read()
        except OSError:
            pass
        took.append((time.perf_counter() - start) * 1000)
        time.sleep(pause)
    took.sort()
    return {"p50": round(took[len(took) // 2], 1), "p99": round(took[int(len(took) * 0.99) - 1], 1), "max": round(took[-1], 1)}


def gateway_server(repo: Path, tmp: Path, name: str, *flags: str) -> Server:
    port = free_port()
    server = Server(name, [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp / name),
                           "--log-level", "error", *flags], port, "/healthz", tmp / f"{name}.log",
                    env={"PYTHONPATH": str(repo)}, cwd=repo)
    server.start()
    server.wait_ready()
    return server


def run_sockets(repo: Path, label: str) -> dict[str, Any]:
    """The attacks of issue #25 on sockets and connections, against ``repo``'s gateway."""
    import asyncio
    import subprocess

    sys.path.insert(0, str(BENCH.parent))
    from tests import socket_attacks as attacks

    tmp = Path(tempfile.mkdtemp(prefix="cb2a-sockets-"))
    out: dict[str, Any] = {"label": label, "repo": str(repo)}
    keyed = gateway_server(repo, tmp, "keyed", "--api-key", KEY + "-0123456789", "--ws-idle-timeout", "5")
    auth = {"authorization": f"Bearer {KEY}-0123456789"}
    try:
        url = keyed.base
        host, port = url.removeprefix("http://").split(":")
        out["idle_mib"] = mib(memory_kib(keyed.pid)["rss_kib"])
        out["healthz_quiet_ms"] = healthz_ms(url, 200)

        async def keyless_then_codex() -> dict[str, Any]:
            held = await attacks.connect(attacks.ws_url(url), additional_headers=auth, open_timeout=30)
            await held.close()
            started = time.monotonic()
            kept: list[Any] = []
            statuses = await attacks.keyless_upgrades(url, 256, kept)
            seconds = time.monotonic() - started
            try:
                ws = await attacks.connect(attacks.ws_url(url), additional_headers=auth, open_timeout=30)
                codex = "101"
                await ws.close()
            except attacks.InvalidStatus as exc:
                codex = str(exc.response.status_code)
            for ws in kept:
                await ws.close()
            return {"keyless_statuses": statuses, "keyless_seconds": round(seconds, 2), "codex_with_key": codex}

        out.update(asyncio.run(keyless_then_codex()))
        out["ignored_frames_closed_after_s"] = asyncio.run(attacks.ignored_frames(url, 20, auth))
        out["slow_headers"] = asyncio.run(attacks.slow_headers(host, int(port), 1500, 5.0, 30))

        attack = subprocess.Popen([sys.executable, "-m", "tests.socket_attacks", url, "12", KEY + "-0123456789"],
                                  cwd=BENCH.parent, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(1)
        out["healthz_under_socket_attacks_ms"] = healthz_ms(url, 300)
        attack.wait(120)

        before = memory_kib(keyed.pid)["rss_kib"]

        async def frames() -> list[dict[str, Any]]:
            opened, answers = await attacks.big_frames(url, 3, headers=auth)
            time.sleep(3)
            out["big_frames_rss_delta_mib"] = mib(memory_kib(keyed.pid)["rss_kib"] - before)
            for ws in opened:
                await ws.close()
            return answers

        out["big_frames_answers"] = [a["type"] for a in asyncio.run(frames())]
        out["big_frames_rss_before_mib"] = mib(before)
    finally:
        keyed.stop()
    open_gateway = gateway_server(repo, tmp, "open")
    try:
        url = open_gateway.base
        chat = json.dumps({"model": "text", "messages": [{"role": "user", "content": "hi"}]}).encode()
        out["cross_origin_ws"] = asyncio.run(attacks.cross_origin_upgrades(url, 30))
        out["text_plain_post_status"] = {
            path: status_of(url + path, chat, {"content-type": "text/plain", "origin": "http://evil.example"})
            for path in ("/v1/chat/completions", "/v1/messages/count_tokens")}
        out["host_evil_status"] = status_of(url + "/v1/chat/completions", chat,
                                            {"content-type": "application/json", "host": "evil.example"})
    finally:
        open_gateway.stop()
    return out


def status_of(url: str, body: bytes, headers: dict[str, str]) -> int:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", parts.path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class HoldingListener:
    """Accepts loopback connections, counts them, holds each 15 s (a slow $ref target)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            threading.Timer(15, conn.close).start()


def tool_body(schema: dict[str, Any]) -> bytes:
    return json.dumps({"model": "fenced_json", "messages": [{"role": "user", "content": "weather?"}],
                       "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}).encode()


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def loop_attacks(listener_port: int) -> dict[str, list[tuple[str, bytes]]]:
    """Each attack: the (route, body) pairs sent at once (1 M messages: 28.6 MiB compact)."""
    defs = {f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}] * 2} for i in range(17)}
    defs["a17"] = {"type": "string"}
    million = [{"role": "user", "content": "x"}] * 1_000_000
    chat_1m = compact({"model": "text", "messages": million})
    resp_1m = compact({"model": "text", "input": million})
    msgs_1m = compact({"model": "text", "max_tokens": 16, "messages": million})
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(300_000)]
    ids = b"[" + b",".join(b"%d" % (10_000 + j) for j in range(2600)) + b"]"
    token_ids = b'{"model":"base-model","max_tokens":5,"prompt":[' + b",".join([ids] * 2048) + b"]}"  # 30 MiB
    return {
        "schema_ref_listener": [("/v1/chat/completions", tool_body(
            {"type": "object", "properties": {"city": {"$ref": f"http://127.0.0.1:{listener_port}/s.json"}}}))],
        "schema_backtracking_pattern": [("/v1/chat/completions", tool_body(
            {"type": "object", "properties": {"city": {"type": "string", "pattern": "^(?:.?){90}$X"}}}))],
        "schema_allof_fanout_17": [("/v1/chat/completions", tool_body(
            {"type": "object", "properties": {"city": {"$ref": "#/$defs/a0"}}, "$defs": defs}))],
        "chat_1m_messages": [("/v1/chat/completions", chat_1m)],
        "chat_300k_tools": [("/v1/chat/completions", compact(
            {"model": "text", "messages": [{"role": "user", "content": "x"}], "tools": tools}))],
        "count_tokens_1m": [("/v1/messages/count_tokens", compact({"model": "text", "messages": million}))],
        "completions_token_ids_30mib": [("/v1/completions", token_ids)],
        "six_at_once_1m": [("/v1/chat/completions", chat_1m), ("/v1/responses", resp_1m), ("/v1/messages", msgs_1m)] * 2,
    }


def healthz_during(base: str, server: Server, requests: list[tuple[str, bytes]]) -> dict[str, Any]:
    """Send ``requests`` at once; sample /healthz latency (20 ms apart) and RSS until all answered."""
    statuses: list[Any] = [None] * len(requests)
    latencies: list[float] = []
    peak = [0]

    def send(i: int, route: str, body: bytes) -> None:
        try:
            statuses[i] = post(base, route, body, timeout=90)
        except Exception as exc:  # a timeout is a finding here, not a crash of the bench
            statuses[i] = type(exc).__name__

    threads = [threading.Thread(target=send, args=(i, r, b)) for i, (r, b) in enumerate(requests)]
    started = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(base + "/healthz", timeout=60).read()
        except Exception:
            pass
        latencies.append((time.monotonic() - t0) * 1000)
        peak[0] = max(peak[0], memory_kib(server.pid)["rss_kib"])
        time.sleep(0.02)
    for t in threads:
        t.join()
    latencies.sort()
    pick = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) if latencies else None  # noqa: E731
    return {"statuses": statuses, "seconds": round(time.monotonic() - started, 2), "healthz_samples": len(latencies),
            "healthz_p50_ms": pick(0.5), "healthz_p99_ms": pick(0.99), "healthz_max_ms": round(max(latencies, default=0), 1),
            "rss_peak_mib": mib(peak[0])}


def run_loop_attacks(repo: Path, label: str, only: list[str] | None) -> dict[str, Any]:
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-hostile-loop-"))
    server = Server(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--api-key", KEY,
         "--data-dir", str(tmp / "data"), "--log-level", "warning"],
        port, "/healthz", tmp / "gateway.log", env={"PYTHONPATH": str(repo)}, cwd=repo,
    )
    server.proc = None
    server.start()
    listener = HoldingListener()
    out: dict[str, Any] = {"label": label, "repo": str(repo)}
    try:
        server.wait_ready()
        post(server.base, "/v1/chat/completions", json.dumps({"model": "text", "messages": [{"role": "user", "content": "hi"}]}).encode())
        out["idle_mib"] = mib(memory_kib(server.pid)["rss_kib"])
        for name, requests in loop_attacks(listener.port).items():
            if only and name not in only:
                continue
            out[name] = healthz_during(server.base, server, requests)
            time.sleep(1)
        out["listener_connections"] = listener.accepted
        out["after_mib"] = mib(memory_kib(server.pid)["rss_kib"])
    finally:
        listener.stop.set()
        server.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=BENCH.parent, help="source tree whose gateway is measured")
    parser.add_argument("--label", default="current")
    parser.add_argument("--sockets", action="store_true", help="the sockets and connections attacks (issue #25) instead")
    parser.add_argument("--loop", action="store_true", help="only the event-loop attacks of issue #25 (part 5)")
    parser.add_argument("--only", action="append", help="with --loop: just this attack (repeatable)")
    args = parser.parse_args()
    if args.sockets:
        result = run_sockets(args.repo.resolve(), args.label)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"hostile-sockets-{args.label}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return 0
    RESULTS.mkdir(exist_ok=True)
    if args.loop:
        result = run_loop_attacks(args.repo.resolve(), args.label, args.only)
        (RESULTS / f"hostile-loop-{args.label}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return 0
    result = run(args.repo.resolve(), args.label)
    (RESULTS / f"hostile-{args.label}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
