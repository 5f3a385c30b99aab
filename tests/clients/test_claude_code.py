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
