"""Codex CLI (pinned, real binary) through the gateway, both stream modes: ``codex exec``
with a temporary CODEX_HOME whose provider is named "OpenAI" (so Codex compacts remotely)
and points at the gateway; the simulator's ``agent`` model makes the tool calls the
prompt lists (``CALL <tool> <JSON>``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from gateway.protocols.responses.compaction import SUMMARY_PROMPT
from gateway.routes.codex_catalog import BASE_INSTRUCTIONS
from tests.clients.conftest import ClientGateway
from tests.conftest import ServerLoop, Simulator, start_gateway
from tests.test_recipes import DOC_URL, recipes

#: the client key the recipe's environment variable carries
RECIPE_KEY = "sk-your-client-key"


def run_codex(
    codex_bin: Path, catalog: Path, gw: ClientGateway, workdir: Path, prompt: str,
    websockets: bool, base_url: str | None = None, **config: Any,
) -> list[dict[str, Any]]:
    """``codex exec --json``: its events (the run must exit 0)."""
    home = workdir.parent / (workdir.name + "-codex-home")
    home.mkdir()
    extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in config.items())
    (home / "config.toml").write_text(
        f'model = "agent"\nmodel_provider = "gateway"\nmodel_catalog_json = {json.dumps(str(catalog))}\n{extra}'
        "[model_providers.gateway]\n"
        'name = "OpenAI"\n'
        f'base_url = "{base_url or gw.base_url}"\n'
        'wire_api = "responses"\n'
        'env_key = "GATEWAY_KEY"\n'
        f"supports_websockets = {'true' if websockets else 'false'}\n"
        "request_max_retries = 0\nstream_max_retries = 0\n"
    )
    done = subprocess.run(
        [str(codex_bin), "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", prompt],
        cwd=workdir, env={**os.environ, "CODEX_HOME": str(home), "GATEWAY_KEY": "test-key"},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("type") == "error" or (e.get("item") or {}).get("type") == "error"]
    assert errors == [], errors  # no fallback notice, no error item, no failed turn
    assert events[-1]["type"] == "turn.completed", events[-1]
    return events


def items(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind]


def transport_counts(gw: ClientGateway) -> tuple[int, int]:
    return gw.recorded.count("websocket", "/v1/responses"), gw.recorded.count("http", "/v1/responses", "POST")


@pytest.mark.parametrize("websockets", [True, False], ids=["websocket", "https"])
def test_codex_runs_a_tool(codex_bin: Path, codex_catalog: Path, client_gateway: ClientGateway, tmp_path: Path, websockets: bool) -> None:
    work = tmp_path / "work"
    work.mkdir()
    events = run_codex(
        codex_bin, codex_catalog, client_gateway, work,
        'Run the command. CALL exec_command {"cmd": "echo hello-from-tool"}', websockets,
    )
    [command] = items(events, "command_execution")
    assert command["exit_code"] == 0 and command["aggregated_output"].strip() == "hello-from-tool"
    [answer] = items(events, "agent_message")
    assert "hello-from-tool" in answer["text"]
    ws, https = transport_counts(client_gateway)
    assert (ws >= 1, https) == ((True, 0) if websockets else (False, 2))


@pytest.mark.parametrize("websockets", [True, False], ids=["websocket", "https"])
def test_codex_compacts_and_continues(
    codex_bin: Path, codex_catalog: Path, client_gateway: ClientGateway, simulator: Simulator, tmp_path: Path, websockets: bool
) -> None:
    """A small auto-compact limit: Codex compacts mid-task through the gateway (one
    compaction item, replayed), and the task's second step still runs after it."""
    work = tmp_path / "work"
    work.mkdir()
    simulator.clear()
    events = run_codex(
        codex_bin, codex_catalog, client_gateway, work,
        'Two steps. CALL exec_command {"cmd": "echo step-one"} CALL exec_command {"cmd": "echo step-two"}',
        websockets, model_auto_compact_token_limit=5000,
    )
    outputs = [c["aggregated_output"].strip() for c in items(events, "command_execution")]
    assert outputs == ["step-one", "step-two"]  # each step once: the plan survived compaction
    bodies = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    summaries = [i for i, b in enumerate(bodies) if b["messages"][-1].get("content") == SUMMARY_PROMPT]
    assert summaries, "Codex never compacted"
    resumed = bodies[summaries[0] + 1]["messages"]
    assert any("Progress: 1 tool call(s) completed." in str(m.get("content")) for m in resumed)
    assert "tools" not in bodies[summaries[0]]
    ws, https = transport_counts(client_gateway)
    assert (ws >= 1, https == 0) == (websockets, websockets)


@pytest.mark.parametrize("websockets", [True, False], ids=["websocket", "https"])
def test_codex_creates_a_file_with_freeform_apply_patch(
    codex_bin: Path, codex_catalog: Path, client_gateway: ClientGateway, tmp_path: Path, websockets: bool
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hello from apply_patch\n*** End Patch\n"
    events = run_codex(
        codex_bin, codex_catalog, client_gateway, work,
        "Make the file. CALL apply_patch " + json.dumps({"input": patch}), websockets,
    )
    assert (work / "hello.txt").read_text() == "hello from apply_patch\n"
    [change] = items(events, "file_change")
    assert change["status"] == "completed" and change["changes"][0]["kind"] == "add"


@pytest.mark.parametrize("websockets", [True, False], ids=["websocket", "https"])
def test_codex_tool_turn_under_a_rollout_base_url(
    codex_bin: Path, codex_catalog: Path, client_gateway: ClientGateway, tmp_path: Path, websockets: bool
) -> None:
    """``base_url = http://gw/rollouts/R/v1``: every model call Codex makes is one call
    record of rollout R, readable through the admin API, with the simulator's token ids."""
    import secrets

    import httpx

    rollout = f"codex-{secrets.token_hex(4)}"
    work = tmp_path / "work"
    work.mkdir()
    events = run_codex(
        codex_bin, codex_catalog, client_gateway, work,
        'Run the command. CALL exec_command {"cmd": "echo hello-from-rollout"}', websockets,
        base_url=f"{client_gateway.url}/rollouts/{rollout}/v1",
    )
    [answer] = items(events, "agent_message")
    assert "hello-from-rollout" in answer["text"]
    snap = httpx.get(f"{client_gateway.url}/admin/api/rollouts/{rollout}", headers=client_gateway.admin, timeout=30).json()
    calls = snap["calls"]
    assert snap["complete"] is True and len(calls) >= 2
    assert all(c["protocol"] == "responses" and c["outcome"] == "success" and c["tokens"] for c in calls)
    assert {c["transport"] for c in calls} == {"websocket" if websockets else "http"}
    tool = next(c for c in calls if [t["name"] for t in c["answer"]["tool_calls"]] == ["exec_command"])
    final = calls[-1]
    assert "hello-from-rollout" in final["answer"]["text"]
    assert final["continuity"]["previous_call_id"] == tool["call_id"]


def test_codex_through_the_docs_recipe_finds_its_model_metadata(
    codex_bin: Path, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """docs/clients.md's Codex recipe, as written (only the host replaced), against a keyed
    gateway whose ``--config`` states the model's limits: Codex reads the model from the
    gateway's catalog (``/v1/models?client_version=``), so it prints no "Model metadata
    for `my-model` not found" warning, and the entry's fields reach the request (the
    freeform ``apply_patch`` a ``tools`` model gets)."""
    lang, code = recipes()["codex"]
    assert lang == "toml"
    config = tmp_path_factory.mktemp("codex-recipe") / "gateway.toml"
    config.write_text(
        f'[[upstreams]]\nname = "sim"\nbase_url = "{simulator.url}/v1"\nmodels = ["my-model"]\n\n'
        '[models."my-model"]\nmax_input_tokens = 131072\nmax_output_tokens = 16384\n'
        "capabilities = { tools = true, reasoning = true }\n"
    )
    gw = start_gateway(server_loop, simulator, tmp_path_factory, config=config, api_key=[SecretStr(RECIPE_KEY)])
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(code.replace(DOC_URL, gw.url))
    work = tmp_path / "work"
    work.mkdir()
    simulator.clear()
    done = subprocess.run(
        [str(codex_bin), "exec", "--json", "--skip-git-repo-check", "hello from the codex recipe"],
        cwd=work, env={**os.environ, "CODEX_HOME": str(home), "CODEBUDDY2API_CLIENT_KEY": RECIPE_KEY},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Model metadata" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("type") == "error" or (e.get("item") or {}).get("type") == "error"]
    assert errors == [], errors
    [answer] = items(events, "agent_message")
    assert "hello from the codex recipe" in answer["text"]
    [body] = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    assert body["model"] == "my-model"
    assert "apply_patch" in {t["function"]["name"] for t in body["tools"]}  # from the gateway's entry
    assert BASE_INSTRUCTIONS.splitlines()[0] in json.dumps(body["messages"][0])  # and its prompt
    # the entry as Codex parsed it (its catalog, re-serialised by the binary)
    dump = subprocess.run(
        [str(codex_bin), "debug", "models"], env={**os.environ, "CODEX_HOME": str(home), "CODEBUDDY2API_CLIENT_KEY": RECIPE_KEY},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=True,
    )
    [entry] = [m for m in json.loads(dump.stdout)["models"] if m["slug"] == "my-model"]
    assert (entry["context_window"], entry["max_context_window"], entry["effective_context_window_percent"]) == (131072, 131072, 87)
    assert (entry["apply_patch_tool_type"], entry["default_reasoning_level"], entry["base_instructions"]) == ("freeform", "medium", BASE_INSTRUCTIONS)
