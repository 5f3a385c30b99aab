"""Issue #25, part "secrets": the admin token, logins and masking, measured (not a test).

Starts, from the source tree given by ``--repo`` (default: this one, so the same script
measures ``main`` and a branch alike), one simulator (``codebuddy2api simulate``) and
gateways in front of it, all on loopback, then counts:

1. ``startup_token_in_json``: whether the JSON ``startup`` event (stderr, non-terminal)
   holds the generated admin token;
2. ``login_guesses_per_s``: wrong ``POST /admin/login`` attempts the gateway *evaluated*
   (401) per second on one keep-alive connection for 2 s, and how many it refused (429);
3. ``logout_old_cookie_status``: the old session cookie's status after ``/admin/logout``;
4. ``short_secrets_start``: whether ``--admin-token abc`` / ``--api-key k`` start;
5. ``split_secret_leaks``: per surface (realtime), at how many of the secret's offsets a
   split across two deltas reached the client whole (strict SDK stream helpers);
6. ``url_password_listed``: whether ``GET /admin/api/credentials`` shows a URL password;
7. ``bad_admin_urls_accepted`` (of 10) and ``client_500s_after`` (of 10 client calls).

Prints one JSON object (and writes ``bench/results/admin-secrets-<label>.json``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Server, before_after_main, free_port

SECRET = "sk-split-secret-0123456789abcdef"
ADMIN = "bench-secrets-admin-token-0001"
CHAT = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}
BAD_URLS = [
    "http://127.0.0.1:9/v1\r\nX-Injected: 1", "http:///v1", "http://:8080/v1", "http://127.0.0.1:9/v1#x",
    "http://127.0.0.1:9/api", "http://169.254.169.254/v1", "http://2852039166/v1", "http://[fd00:ec2::254]/v1",
    "http://metadata.google.internal/v1", "http://[fe80::1]/v1",
]
#: The ones a gateway that accepts them would really connect to: disabled at once (no
#: traffic leaves loopback); the others fail inside httpx or hit loopback port 9.
OFF_LOOPBACK = frozenset(BAD_URLS[5:])
CLIENT_CALLS = [
    ("POST", "/chat/completions", CHAT), ("POST", "/chat/completions", CHAT | {"stream": True}),
    ("POST", "/responses", {"model": "text", "input": "hi"}),
    ("POST", "/responses", {"model": "text", "input": "hi", "stream": True}),
    ("POST", "/messages", CHAT | {"max_tokens": 20}), ("POST", "/messages", CHAT | {"max_tokens": 20, "stream": True}),
    ("POST", "/messages/count_tokens", CHAT), ("POST", "/responses/compact", {"model": "text", "input": "hi"}),
    ("GET", "/models", None), ("GET", "/models/text", None),
]


def gateway(repo: Path, tmp: Path, name: str, *args: str) -> Server:
    port = free_port()
    server = Server(name, [sys.executable, "-m", "gateway", "serve", "--port", str(port),
                           "--data-dir", str(tmp / name), "--log-level", "warning", *args],
                    port, "/healthz", tmp / f"{name}.log", env={"PYTHONPATH": str(repo)}, cwd=repo)
    server.start()
    server.wait_ready()
    return server


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def script(sim: str, frames: list[dict[str, Any]]) -> str:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    answer = httpx.post(sim + "/_sim/scripts", json={"frames": [*frames, usage, {"_op": "done"}]})
    return "script:" + answer.json()["id"]


def assembled(surface: str, base: str, model: str) -> str:
    """What the client's SDK assembled (text, reasoning or the tool's city)."""
    oa = openai.OpenAI(base_url=base + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    messages = [{"role": "user", "content": "go"}]
    if surface == "messages":
        an = anthropic.Anthropic(base_url=base, api_key="k", _strict_response_validation=True, max_retries=0)
        with an.messages.stream(model=model, max_tokens=50, messages=messages) as stream:  # type: ignore[arg-type]
            return "".join(b.text for b in stream.get_final_message().content if b.type == "text")
    if surface == "responses":
        with oa.responses.stream(model=model, input="go") as stream:
            return "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with oa.chat.completions.stream(model=model, messages=messages, tools=tools) as stream:  # type: ignore[arg-type]
        message = stream.get_final_completion().choices[0].message
    if surface == "chat_tool_arguments":
        return json.loads(message.tool_calls[0].function.arguments)["city"]  # type: ignore[index]
    if surface == "chat_reasoning":
        return (message.model_extra or {}).get("reasoning_content") or ""
    return message.content or ""


def split_leaks(sim: str, base: str) -> dict[str, int]:
    leaks: dict[str, int] = {}
    for surface in ("chat_content", "chat_reasoning", "chat_tool_arguments", "messages", "responses"):
        leaks[surface] = 0
        for cut in range(1, len(SECRET)):
            a, b = f"x {SECRET[:cut]}", f"{SECRET[cut:]} y"
            if surface == "chat_tool_arguments":
                call = {"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "' + a}}
                frames = [chunk({"role": "assistant", "tool_calls": [call]}),
                          chunk({"tool_calls": [{"index": 0, "function": {"arguments": b + '"}'}}]}), chunk({}, "tool_calls")]
            elif surface == "chat_reasoning":
                frames = [chunk({"role": "assistant", "reasoning_content": a}), chunk({"reasoning_content": b}),
                          chunk({"content": "ok"}), chunk({}, "stop")]
            else:
                frames = [chunk({"role": "assistant", "content": a}), chunk({"content": b}), chunk({}, "stop")]
            leaks[surface] += SECRET in assembled(surface, base, script(sim, frames))
    return leaks


def login_rate(base: str, seconds: float = 2.0) -> dict[str, float]:
    counts = {"401": 0, "429": 0, "other": 0}
    with httpx.Client(base_url=base) as http:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            status = http.post("/admin/login", json={"token": f"guess-{n}"}).status_code
            counts[str(status) if status in (401, 429) else "other"] += 1
            n += 1
    return {"evaluated_per_s": round(counts["401"] / seconds, 1), "refused_429": counts["429"], "other": counts["other"]}


def starts(repo: Path, tmp: Path, *args: str) -> bool:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp / "short"), *args],
                            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"}, cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return proc.wait(8) != 2
    except subprocess.TimeoutExpired:
        return True
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def run(repo: Path, label: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-secrets-"))
    out: dict[str, Any] = {"label": label, "repo": str(repo)}
    sim_port = free_port()
    sim = Server("simulator", [sys.executable, "-m", "gateway", "simulate", "--port", str(sim_port)], sim_port, None,
                 tmp / "sim.log", env={"PYTHONPATH": str(repo)}, cwd=repo)
    sim.start()
    sim.wait_ready()
    servers = [sim]
    try:
        plain = gateway(repo, tmp, "plain")
        servers.append(plain)
        time.sleep(0.5)
        log = (tmp / "plain.log").read_text()
        login_file = tmp / "plain" / "admin-login-url"
        token = login_file.read_text().strip().rsplit("=", 1)[1] if login_file.exists() else \
            json.loads(next(line for line in log.splitlines() if '"startup"' in line))["admin_login_url"].rsplit("=", 1)[1]
        out["startup_token_in_json"] = token in log
        out["login"] = login_rate(plain.base)

        keyed = gateway(repo, tmp, "keyed", "--admin-token", ADMIN, "--upstream-url", sim.base + "/v1",
                        "--upstream-api-key", SECRET, "--stream-mode", "realtime")
        servers.append(keyed)
        cookie = httpx.post(keyed.base + "/admin/login", json={"token": ADMIN}).cookies["cb2a_admin"]
        httpx.post(keyed.base + "/admin/logout", json={}, cookies={"cb2a_admin": cookie}, headers={"origin": keyed.base})
        out["logout_old_cookie_status"] = httpx.get(keyed.base + "/admin/api/settings", cookies={"cb2a_admin": cookie}).status_code
        out["split_secret_leaks_of"] = len(SECRET) - 1
        out["split_secret_leaks"] = split_leaks(sim.base, keyed.base)

        admin = {"authorization": f"Bearer {ADMIN}"}
        userinfo = sim.base.replace("http://", "http://bench:url-password-0123456789@") + "/v1"
        added = httpx.post(keyed.base + "/admin/api/credentials", headers=admin,
                           json={"base_url": userinfo, "upstream": "userinfo"})
        listed = httpx.get(keyed.base + "/admin/api/credentials", headers=admin).text
        out["url_password_listed"] = "url-password-0123456789" in listed or "url-password-0123456789" in added.text
        accepted = 0
        for n, url in enumerate(BAD_URLS):
            answer = httpx.post(keyed.base + "/admin/api/credentials", headers=admin,
                                json={"base_url": url, "api_key": f"sk-bad-{n}-0000000000", "upstream": f"bad{n}"})
            accepted += answer.status_code == 201
            if answer.status_code == 201 and url in OFF_LOOPBACK:  # never contacted: loopback only
                httpx.post(f"{keyed.base}/admin/api/credentials/{answer.json()['id']}/disable", json={}, headers=admin)
        out["bad_admin_urls_accepted"] = f"{accepted}/{len(BAD_URLS)}"
        fails = 0
        for _ in range(3):  # round-robin over credentials: several passes
            for method, path, body in CLIENT_CALLS:
                fails += httpx.request(method, keyed.base + "/v1" + path, json=body, timeout=30).status_code >= 500
        out["client_5xx_after"] = f"{fails}/{3 * len(CLIENT_CALLS)}"
        out["short_secrets_start"] = {"--admin-token abc": starts(repo, tmp, "--admin-token", "abc"),
                                      "--api-key k": starts(repo, tmp, "--api-key", "k")}
    finally:
        for server in reversed(servers):
            server.stop()
    return out


if __name__ == "__main__":
    sys.exit(before_after_main(__doc__, run, "admin-secrets"))
