"""Training-harness mode: a buffered upstream (`--upstream-stream never`) behind a
streaming client, engine extras for token data, and per-rollout capture export."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.app import create_app
from gateway.rollout import capture_files as capture
from gateway.rollout.capture_files import CaptureWriter, open_append
from gateway.settings import Settings
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for

UPSTREAM_KEY = "sk-upstream-secret-77"
CLIENT_KEY = "ck-client-secret-88"
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}]


def training_gateway(server_loop: ServerLoop, simulator: Simulator, data: Path, capture: Path, mode: str) -> Gateway:
    settings = Settings(
        upstream_url=[simulator.url + "/v1"], upstream_api_key=UPSTREAM_KEY, api_key=[CLIENT_KEY],
        data_dir=data, capture_dir=capture, stream_mode=mode, upstream_stream="never", keepalive_interval=0.5,
        engine_extras={"*": {"logprobs": True, "return_token_ids": True}, "nothing-*": {"top_k": 1}},
    )
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


def turn(gateway: Gateway, rollout: str, model: str, messages: list[dict[str, Any]]) -> Any:
    client = anthropic.Anthropic(base_url=gateway.url, api_key=CLIENT_KEY, _strict_response_validation=True,
                                 max_retries=0, default_headers={"x-rollout-id": rollout})
    with client.messages.stream(model=model, max_tokens=512, messages=messages, tools=TOOLS) as stream:
        return stream.get_final_message()


def conversation(gateway: Gateway, rollout: str) -> list[Any]:
    """Three turns: text + tool call, then (after the tool result) another call, then text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    finals = []
    for model in ["text_then_tool;chunk=6", "tool;chunk=3", "text;chunk=5"]:
        final = turn(gateway, rollout, model, messages)
        finals.append(final)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        tool_uses = [b for b in final.content if b.type == "tool_use"]
        if tool_uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": t.id, "content": "18 C and sunny"} for t in tool_uses]})
        else:
            messages.append({"role": "user", "content": "thanks"})
    return finals


def export_cli(capture: Path, rollout: str) -> list[dict[str, Any]]:
    """The capture files' records of ``rollout`` (none yet: exit status 1 and one line)."""
    out = subprocess.run([sys.executable, "-m", "gateway", "capture", "export", "--rollout", rollout,
                          "--capture-dir", str(capture)], capture_output=True, timeout=30)
    if out.returncode == 1:
        assert out.stdout == b"" and out.stderr.decode() == f"codebuddy2api: error: no records of rollout {rollout!r} in {capture}\n"
        return []
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def exported(capture: Path, rollout: str, count: int) -> list[dict[str, Any]]:
    """The rollout's records once ``count`` of them are on disk (the writer batches)."""
    wait_for(lambda: len(export_cli(capture, rollout)) >= count)
    return export_cli(capture, rollout)


def check_record(record: dict[str, Any], final: Any, rollout: str, n: int) -> None:
    assert record["rollout_id"] == rollout and record["protocol"] == "messages"
    assert record["outcome"] == "success" and record["mode"] == "compatible"
    sent = record["upstream_request"]
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and "top_k" not in sent
    assert [m["role"] for m in sent["messages"]][: 1 + 2 * n][-1] in ("user", "tool")
    text = "".join(b.text for b in final.content if b.type == "text")
    calls = [(b.id, b.name, b.input) for b in final.content if b.type == "tool_use"]
    answer = record["answer"]
    assert answer["text"] == text
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in answer["tool_calls"]] == calls
    assert answer["usage"]["completion_tokens"] == final.usage.output_tokens
    tokens = record["token_data"]
    generated = text + "".join(c["arguments"] for c in answer["tool_calls"])
    assert "".join(t["token"] for t in tokens["logprobs"]) == generated
    assert all(t["logprob"] < 0 and bytes(t["bytes"]).decode() == t["token"] for t in tokens["logprobs"])
    assert tokens["token_ids"] and len(tokens["token_ids"]) == len(tokens["logprobs"])
    assert tokens["prompt_token_ids"]


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_three_turn_rollout_is_captured_with_token_data(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path, mode: str) -> None:
    capture = tmp_path / "capture"
    gateway = training_gateway(server_loop, simulator, tmp_path / "data", capture, mode)
    simulator.clear()
    rollout = f"rollout-{mode}"
    finals = conversation(gateway, rollout)
    assert finals[0].stop_reason == "tool_use" and finals[2].stop_reason == "end_turn"
    sent = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    assert len(sent) == 3 and all(body["stream"] is False for body in sent)
    records = exported(capture, rollout, 3)
    assert [r["upstream_request"]["model"] for r in records] == ["text_then_tool;chunk=6", "tool;chunk=3", "text;chunk=5"]
    for n, (record, final) in enumerate(zip(records, finals)):
        check_record(record, final, rollout, n)
    # the second turn's request carries the first turn's tool call and its result
    second = records[1]["upstream_request"]["messages"]
    assert second[-2]["tool_calls"][0]["id"] == records[0]["answer"]["tool_calls"][0]["id"]
    assert second[-1] == {"role": "tool", "tool_call_id": records[0]["answer"]["tool_calls"][0]["id"], "content": "18 C and sunny"}
    files = httpx.get(gateway.url + "/admin/api/capture/export", params={"rollout": rollout, "source": "files"}, headers=gateway.admin)
    assert [json.loads(line) for line in files.text.splitlines()] == records
    # by default the export reads the store, where the rollout's call records are (every capture mode)
    stored = httpx.get(gateway.url + "/admin/api/capture/export", params={"rollout": rollout}, headers=gateway.admin)
    calls = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin).json()["calls"]
    assert [json.loads(line) for line in stored.text.splitlines()] == calls
    assert [c["call_id"] for c in calls] == [r["request_id"] for r in records]
    text = "\n".join(p.read_text() for p in capture.glob("*.jsonl"))
    assert UPSTREAM_KEY not in text and CLIENT_KEY not in text
    def metrics() -> str:  # what an operator sees of it (counted just after the fsync)
        return httpx.get(gateway.url + "/metrics").text

    wait_for(lambda: 'codebuddy2api_capture_records_total{outcome="written"} 3.0' in metrics())
    assert 'codebuddy2api_capture_records_total{outcome="lost"} 0.0' in metrics()


def test_records_survive_a_restart_mid_rollout(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> None:
    capture = tmp_path / "capture"
    first = training_gateway(server_loop, simulator, tmp_path / "data", capture, "realtime")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
    final = turn(first, "r-restart", "tool;chunk=4", messages)
    server_loop.run(stop_last(server_loop))  # graceful shutdown drains the writer
    records = export_cli(capture, "r-restart")
    assert len(records) == 1 and records[0]["answer"]["tool_calls"][0]["id"] == final.content[0].id
    second = training_gateway(server_loop, simulator, tmp_path / "data", capture, "realtime")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[0].id, "content": "ok"}]}]
    turn(second, "r-restart", "text", messages)
    records = exported(capture, "r-restart", 2)
    assert [r["upstream_request"]["model"] for r in records] == ["tool;chunk=4", "text"]
    assert records[0]["started_at"] < records[1]["started_at"]


async def stop_last(server_loop: ServerLoop) -> None:
    from gateway.http.servers import stop_embedded

    server, task = server_loop._servers.pop()
    await stop_embedded(server, task)


def test_streaming_clients_see_the_same_answer_with_capture(server_loop: ServerLoop, simulator: Simulator, gateways: dict[str, Gateway], tmp_path: Path) -> None:
    gateway = training_gateway(server_loop, simulator, tmp_path / "data", tmp_path / "capture", "realtime")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_capture = turn(gateway, "same", "text_then_tool;chunk=2", messages)
    client = anthropic.Anthropic(base_url=gateways["compatible"].url, api_key="k", _strict_response_validation=True, max_retries=0)
    with client.messages.stream(model="text_then_tool;chunk=2", max_tokens=512, messages=messages, tools=TOOLS) as stream:
        plain = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in with_capture.content] == [b.model_dump(exclude={"id"}) for b in plain.content]
    assert with_capture.stop_reason == plain.stop_reason


# -- the writer on a failing disk (fed directly) --------------------------------------------

class FullDisk:
    """The ``open_file`` seam: real files whose writes fail with ENOSPC while ``full`` is
    set, after half of the bytes reached the disk (the torn line a real full disk leaves)."""

    def __init__(self) -> None:
        self.full = False

    def open(self, path: Path) -> Any:
        real, disk = open_append(path), self

        class File:
            def write(self, data: Any) -> int:
                if disk.full:
                    real.write(bytes(data[: len(data) // 2]))
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real.write(data)

            def fileno(self) -> int:
                return real.fileno()

            def close(self) -> None:
                real.close()

        return File()


def test_a_full_disk_holds_capture_records_and_writes_them_once_it_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture, "RETRY_SECONDS", 0.05)
    disk, written, lost = FullDisk(), [], []
    writer = CaptureWriter(tmp_path, open_file=disk.open, on_written=written.append, on_lost=lost.append)
    writer.submit({"request_id": "r1"})
    wait_for(lambda: writer.written == 1)
    disk.full = True
    writer.submit({"request_id": "r2", "secret": "x" * 100})
    writer.submit({"request_id": "r3"})
    wait_for(lambda: writer.held == 2)
    # the failed batch was cut back off the file: no torn half line, nothing twice
    assert [json.loads(line) for line in (tmp_path / "capture-000000.jsonl").read_bytes().splitlines()] == [{"request_id": "r1"}]
    disk.full = False
    wait_for(lambda: writer.written == 3)
    writer.close()
    assert [r["request_id"] for r in capture.read_records(tmp_path)] == ["r1", "r2", "r3"]
    assert writer.lost == 0 and lost == [] and sum(written) == 3 and writer.held == 0


def test_capture_records_past_the_hold_or_held_at_shutdown_are_lost_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture, "RETRY_SECONDS", 0.05)
    disk, lost = FullDisk(), []
    disk.full = True
    writer = CaptureWriter(tmp_path, open_file=disk.open, hold_max_bytes=60, on_lost=lost.append)
    for i in range(3):  # each line is 30 bytes: the 60-byte hold keeps the newest two
        writer.submit({"request_id": f"r{i}", "pad": "p"})
        wait_for(lambda: writer.held + writer.lost == i + 1)
    assert writer.held == 2 and writer.lost == 1
    writer.close()  # the disk is still full: what is held is lost, and said
    assert writer.lost == 3 and sum(lost) == 3 and writer.written == 0
    assert list(capture.read_records(tmp_path)) == []
