"""The trainer's side of a rollout (docs/capture.md): the capture export that reads the
store in every capture mode (admin route and CLI), rewards and groups, the bulk export in
each trainer's shape. Rollouts are driven through the running app with the official SDKs,
in front of the simulator's vLLM token fields."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.simulator.scenarios import assemble_completion, build_plan
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

CLIENT_KEY = "ck-trainer-export-key-0123456789"
CALLS = 'CALL get_weather {"city": "Paris"} then CALL get_time {"timezone": "Europe/Paris"}'
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "timezone": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")]


@pytest.fixture(scope="module")
def trainer_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY])


def new_rollout(kind: str) -> str:
    return f"{kind}.{secrets.token_hex(4)}:r-1"


def client_for(gateway: Gateway, rollout: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                         _strict_response_validation=True, max_retries=0, default_headers=headers)


def read_back(gateway: Gateway, rollout: str, part: str = "") -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}{part}", headers=gateway.admin, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def expected_tokens(body: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """What the simulator sampled for this upstream body: prompt ids, completion ids, logprobs."""
    folded = assemble_completion(build_plan(body["model"], body).frames, body["model"])
    choice = folded["choices"][0]
    return folded["prompt_token_ids"], choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def edited_rollout(gateway: Gateway, rollout: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Three calls: two tool turns in one chain, then a call whose history was edited (a
    rewritten tool result): two segments. The upstream bodies, in order."""
    client = client_for(gateway, rollout, headers)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{secrets.token_hex(6)}: {CALLS}"}]
    for _ in range(2):
        message = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=TOOLS).choices[0].message  # type: ignore[arg-type]
        assert message.tool_calls
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    messages[2] = {**messages[2], "content": "get_weather says 19 C"}  # the harness edits its history
    final = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert final.choices[0].message.content and final.choices[0].message.content.startswith("Done.")
    return [c["upstream_request"] for c in read_back(gateway, rollout)["calls"]]


# -- 1. the capture export reads the store --------------------------------------------------


def test_the_admin_capture_export_reads_the_store_without_a_capture_dir(trainer_gateway: Gateway) -> None:
    gateway, rollout = trainer_gateway, new_rollout("export")
    edited_rollout(gateway, rollout)
    url, admin = gateway.url + "/admin/api/capture/export", gateway.admin
    response = httpx.get(url, params={"rollout": rollout}, headers=admin)
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    exported = [json.loads(line) for line in response.text.splitlines()]
    assert exported == read_back(gateway, rollout)["calls"] and len(exported) == 3
    assert [r["seq"] for r in exported] == [0, 1, 2] and all(r["tokens"]["completion_ids"] for r in exported)
    unknown = httpx.get(url, params={"rollout": "no-such-rollout"}, headers=admin)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "rollout_not_found"
    files = httpx.get(url, params={"rollout": rollout, "source": "files"}, headers=admin)
    assert files.status_code == 404 and files.json()["error"]["code"] == "capture_disabled"
    for params, code in (({"rollout": "bad id"}, "invalid_rollout_id"), ({}, "missing_parameter"),
                         ({"rollout": rollout, "source": "disk"}, "invalid_parameter")):
        bad = httpx.get(url, params=params, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == code


def export_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``capture export`` run from ``cwd``, with no gateway settings in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run([sys.executable, "-m", "gateway", "capture", "export", *args],
                          capture_output=True, timeout=60, env=env, cwd=cwd)


def test_the_cli_export_reads_an_existing_store_and_never_creates_one(trainer_gateway: Gateway, tmp_path: Path) -> None:
    gateway, rollout = trainer_gateway, new_rollout("cli")
    edited_rollout(gateway, rollout)
    data_dir = str(gateway.live.current.data_dir)
    out = export_cli(tmp_path, "--rollout", rollout, "--data-dir", data_dir)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == read_back(gateway, rollout)["calls"]
    by_url = export_cli(tmp_path, "--rollout", rollout, "--database-url", f"sqlite:///{data_dir}/codebuddy2api.sqlite3")
    assert by_url.returncode == 0 and by_url.stdout == out.stdout
    unknown = export_cli(tmp_path, "--rollout", "no-such-rollout", "--data-dir", data_dir)
    assert (unknown.returncode, unknown.stdout) == (1, b"")
    assert unknown.stderr.decode() == "codebuddy2api: error: no rollout 'no-such-rollout' in the store\n"
    # from a folder without a store: one line, non-zero, and no ./data created there
    missing = export_cli(tmp_path, "--rollout", rollout)
    assert (missing.returncode, missing.stdout) == (2, b"")
    assert missing.stderr.decode() == ("codebuddy2api: error: no store at data/codebuddy2api.sqlite3 "
                                       "(give --data-dir or --database-url)\n")
    elsewhere = export_cli(tmp_path, "--rollout", rollout, "--database-url", f"sqlite:///{tmp_path}/none.sqlite3")
    assert elsewhere.returncode == 2 and elsewhere.stderr.decode().count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_cli_export_reads_a_postgresql_store(server_loop: ServerLoop, simulator: Simulator, postgres_schema: str,
                                                 tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            database_url=postgres_schema)
    rollout = new_rollout("pg")
    client_for(gateway, rollout).chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])
    out = export_cli(tmp_path, "--rollout", rollout, "--database-url", postgres_schema)
    assert out.returncode == 0, out.stderr
    [record] = [json.loads(line) for line in out.stdout.splitlines()]
    assert record == read_back(gateway, rollout)["calls"][0] and record["outcome"] == "success"
