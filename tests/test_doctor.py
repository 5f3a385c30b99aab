"""``codebuddy2api doctor``: the probes against the simulator's quirk scenarios (real HTTP),
the pure analyser fed frames directly, the table and the ``--json`` schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from gateway.doctor import analyse, render_table, run_probes
from gateway.doctor.findings import Probes, StreamCapture, parse_sse_lines
from tests.conftest import Gateway, Simulator


def doctor(simulator: Simulator, model: str):  # type: ignore[no-untyped-def]
    report = analyse(run_probes(simulator.url + "/v1", None, model, timeout=30))
    return report, render_table(report)


@pytest.mark.parametrize(
    ("model", "quirks", "mode"),
    [
        ("missing_index", {"missing_tool_index"}, "compatible"),
        ("repeated_id", {"repeated_tool_id"}, "realtime"),  # harmless for realtime: repeats are ignored
        ("late_name", {"late_tool_name"}, "compatible"),
        ("text;usage=last;done=0;unstable_id=1", {"usage_on_last_chunk", "no_done", "unstable_chunk_id"}, "compatible"),
        ("tool;finish_chunk=last", {"finish_on_content_chunk"}, "realtime"),
        ("reasoning_field", {"reasoning_field"}, "compatible"),
        ("empty_tool_array", {"empty_tool_calls_array"}, "compatible"),
        ("fenced_json", {"tool_arguments_repaired"}, "compatible"),
        ("text;usage=none", {"no_usage"}, "compatible"),
    ],
)
def test_doctor_names_each_quirk_the_gateway_normalises(simulator: Simulator, model: str, quirks: set[str], mode: str) -> None:
    report, table = doctor(simulator, model)
    assert set(report.quirks()) == quirks, report.findings
    assert report.problems() == []
    for quirk in quirks:
        row = next(line for line in table.splitlines() if f" {quirk} " in line)
        assert "QUIRK" in row
    assert "nothing the gateway cannot normalise" in table
    # realtime only when a tool call was seen and none of its quirks needs the whole answer first
    assert report.stream_mode == mode


@pytest.mark.parametrize(
    ("model", "quirk", "verdict"),
    [
        ("identity_change", "tool_identity_change", "tool_identity_changed"),
        ("no_finish", "no_finish_reason", "upstream_incomplete"),
        ("error_frame", "error_in_stream", "upstream_error"),
    ],
)
def test_doctor_reports_what_the_gateway_cannot_relay(simulator: Simulator, model: str, quirk: str, verdict: str) -> None:
    report, table = doctor(simulator, model)
    assert quirk in report.quirks()
    problems = report.problems()
    assert any(f.quirk == quirk for f in problems)
    assert any(f.check.startswith("gateway relays") and verdict in f.detail for f in problems)
    assert f"{len(problems)} problem(s) the gateway cannot normalise" in table
    assert "PROBLEM" in next(line for line in table.splitlines() if f" {quirk} " in line)


def test_doctor_on_a_well_behaved_upstream_recommends_realtime(simulator: Simulator) -> None:
    report, table = doctor(simulator, "tool")
    assert report.quirks() == [] and report.problems() == []
    assert report.stream_mode == "realtime" and report.upstream_stream == "always"
    assert "--stream-mode realtime --upstream-stream always" in table
    checks = {f.check: f for f in report.findings}
    assert checks["tool index"].status == "ok" and checks["tool finish_reason"].detail == "'tool_calls'"
    assert checks["[DONE]"].status == "ok" and checks["include_usage"].status == "ok"
    assert checks["non-streamed answer"].status == "ok"


def test_doctor_sees_invalid_arguments_and_argument_objects(simulator: Simulator) -> None:
    report, _ = doctor(simulator, "invalid_json")
    assert "tool_arguments_invalid" in report.quirks()
    objects = simulator.script([
        {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"_op": "done"},
    ])
    report, table = doctor(simulator, objects)
    assert "tool_arguments_objects" in report.quirks() and "no_usage" in report.quirks()
    assert "arguments arrive as JSON objects" in table
    # a problem while the accumulator drops object arguments, a quirk once it keeps them
    finding = next(f for f in report.findings if f.quirk == "tool_arguments_objects")
    assert finding.status == ("quirk" if _keeps_object_arguments() else "problem")


def _keeps_object_arguments() -> bool:
    from gateway.stream.accumulator import ChatSSEAccumulator

    acc = ChatSSEAccumulator()
    acc.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}, "finish_reason": "tool_calls"}]})
    return json.loads(acc.seal().tool_calls[0].arguments or "{}") == {"a": 1}


def test_doctor_reports_a_failing_upstream(simulator: Simulator) -> None:
    report, table = doctor(simulator, "unauthorized")
    problems = {f.check: f.detail for f in report.problems()}
    assert problems["streamed text"].startswith("HTTP 401") and "Incorrect API key" in problems["streamed text"]
    assert "non-streamed answer" in problems
    assert report.stream_mode == "compatible"


def test_keepalive_comments_and_raw_lines_are_parsed() -> None:
    lines = [": keepalive", "", 'data: {"id":"a","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}', "",
             ": ping", "", 'data: {"id":"a","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', "",
             "data: not json", "", "data: [DONE]", ""]
    capture = parse_sse_lines(lines, StreamCapture(status=200, content_type="text/event-stream"))
    assert capture.comments == 2 and capture.done and len(capture.chunks) == 2 and capture.unparsed == ["not json"]
    report = analyse(Probes(url="http://h/v1", model="m", text=capture, tool=StreamCapture(status=200, content_type="text/event-stream", chunks=capture.chunks[:], done=True)))
    assert "keepalive_comments" in report.quirks() and "no_usage" in report.quirks()
    assert any(f.check == "streamed text" and f.status == "problem" and "not JSON" in f.detail for f in report.findings)


def test_error_shapes() -> None:
    openai_shape = Probes(url="u", model="m", bad_request_status=400, bad_request_body='{"error":{"message":"bad"}}')
    other = Probes(url="u", model="m", bad_request_status=422, bad_request_body='{"detail":[{"msg":"field required"}]}')
    assert next(f for f in analyse(openai_shape).findings if f.check == "error shape").status == "ok"
    finding = next(f for f in analyse(other).findings if f.check == "error shape")
    assert finding.quirk == "error_shape_not_openai" and "HTTP 422" in finding.detail


JSON_SCHEMA = {
    "type": "object",
    "required": ["url", "model", "findings", "quirks", "recommended", "ok"],
    "additionalProperties": False,
    "properties": {
        "url": {"type": "string"},
        "model": {"type": "string"},
        "ok": {"type": "boolean"},
        "quirks": {"type": "array", "items": {"type": "string"}},
        "findings": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["check", "status", "detail", "quirk"],
            "properties": {
                "check": {"type": "string"}, "detail": {"type": "string"},
                "status": {"enum": ["ok", "quirk", "problem", "info"]}, "quirk": {"type": ["string", "null"]},
            },
        }},
        "recommended": {
            "type": "object", "additionalProperties": False, "required": ["stream_mode", "upstream_stream", "command", "notes"],
            "properties": {
                "stream_mode": {"enum": ["compatible", "realtime"]},
                "upstream_stream": {"enum": ["always", "never", "auto"]},
                "command": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


def test_doctor_cli_json_schema_and_exit_status(simulator: Simulator) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "doctor", simulator.url + "/v1", "--model", "late_name", "--json"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)
    jsonschema.validate(document, JSON_SCHEMA)
    assert document["quirks"] == ["late_tool_name"] and document["ok"] is True
    assert document["recommended"]["command"].startswith(f"codebuddy2api serve --upstream-url {simulator.url}/v1 --stream-mode compatible")
    failing = subprocess.run(
        [sys.executable, "-m", "gateway", "doctor", simulator.url + "/v1", "--model", "identity_change"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert failing.returncode == 1 and "tool_identity_change" in failing.stdout
    bad = subprocess.run([sys.executable, "-m", "gateway", "doctor", "vllm:8000"], capture_output=True, text=True, timeout=30, env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "vllm:8000" in bad.stderr


@pytest.mark.parametrize("model", ["missing_index", "late_name", "text;usage=last;done=0;unstable_id=1", "reasoning_field"])
def test_the_gateway_in_front_of_a_quirky_upstream_has_no_quirks(gateways: dict[str, Gateway], simulator: Simulator, model: str) -> None:
    """What the doctor finds at the upstream, the gateway (in either mode) has normalised away."""
    assert analyse(run_probes(simulator.url + "/v1", None, model, timeout=30)).quirks()
    for gateway in gateways.values():
        report = analyse(run_probes(gateway.base_url, None, model, timeout=30))
        # keepalive comments: the gateway's own, when a loaded machine makes it wait
        assert set(report.quirks()) - {"keepalive_comments"} == set(), (gateway.url, report.findings)
        assert report.problems() == []
        assert next(f for f in report.findings if f.check == "error shape").status == "ok"
