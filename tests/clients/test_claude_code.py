"""Claude Code (pinned, real binary) through the gateway, both stream modes: ``claude -p``
with ANTHROPIC_BASE_URL at the gateway; the simulator's ``agent`` model calls Bash as the
prompt asks and answers with the tool's output."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.clients.conftest import ClientGateway


def test_claude_code_tool_turn(claude_bin: Path, client_gateway: ClientGateway, tmp_path: Path) -> None:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = {
        **os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": client_gateway.url, "ANTHROPIC_API_KEY": "test-key",
        "IS_SANDBOX": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    prompt = 'Run it. CALL Bash {"command": "echo hello-from-claude", "description": "print a word"}'
    done = subprocess.run(
        [str(claude_bin), "-p", "--model", "agent", "--output-format", "stream-json", "--verbose",
         "--dangerously-skip-permissions", prompt],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    uses = [b for e in events if e["type"] == "assistant" for b in e["message"]["content"] if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]["command"]) for u in uses] == [("Bash", "echo hello-from-claude")]
    results = [b for e in events if e["type"] == "user" for b in e["message"]["content"] if b.get("type") == "tool_result"]
    assert [(r["content"], r["is_error"]) for r in results] == [("hello-from-claude", False)]
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"]
    assert result["result"] == "Done. The tool said: hello-from-claude"
    assert client_gateway.recorded.count("http", "/v1/messages", "POST") >= 2


def test_claude_code_tool_turn_under_a_rollout_base_url(claude_bin: Path, client_gateway: ClientGateway, tmp_path: Path) -> None:
    """``ANTHROPIC_BASE_URL=http://gw/rollouts/R``: the tool turn and the answer (and any
    side call Claude Code makes) are each one call record of rollout R."""
    import secrets

    import httpx

    rollout = f"claude-{secrets.token_hex(4)}"
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = {
        **os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": f"{client_gateway.url}/rollouts/{rollout}",
        "ANTHROPIC_API_KEY": "test-key", "IS_SANDBOX": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    prompt = 'Run it. CALL Bash {"command": "echo hello-from-rollout", "description": "print a word"}'
    done = subprocess.run(
        [str(claude_bin), "-p", "--model", "agent", "--output-format", "stream-json", "--verbose",
         "--dangerously-skip-permissions", prompt],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-1]
    assert result["result"] == "Done. The tool said: hello-from-rollout"
    snap = httpx.get(f"{client_gateway.url}/admin/api/rollouts/{rollout}", headers=client_gateway.admin, timeout=30).json()
    calls = snap["calls"]
    assert snap["complete"] is True
    assert len(calls) == client_gateway.recorded.count("http", f"/rollouts/{rollout}/v1/messages", "POST")
    assert all(c["protocol"] == "messages" and c["tokens"] for c in calls)
    tool = next(c for c in calls if [t["name"] for t in c["answer"]["tool_calls"]] == ["Bash"])
    final = next(c for c in calls if c["answer"]["text"] == "Done. The tool said: hello-from-rollout")
    assert final["continuity"]["previous_call_id"] == tool["call_id"]
