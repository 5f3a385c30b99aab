"""``/v1/completions`` and ``/v1/embeddings`` (gateway/generation/passthrough.py): relayed to the pool with
the same client keys, failover, audit record and metrics as the chat routes, driven by the
official openai SDK in strict mode against the simulator (gateway/simulator/completions.py)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import SecretStr

from gateway.errors import GatewayError
from gateway.generation.passthrough import CompletionsRoute, RelayedCall
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.settings import Settings
from gateway.simulator.completions import embedding_vector
from gateway.upstream.client import ANSWERED, DONE
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for


def client(gateway: Gateway, key: str = "unused", strict: bool = True) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, _strict_response_validation=strict, max_retries=0)


def audited(gateway: Gateway, request_id: str) -> dict[str, Any]:
    def row() -> dict[str, Any] | None:
        rows = httpx.get(gateway.url + "/admin/api/audit", params={"limit": 200}, headers=gateway.admin).json()["data"]
        return next((r for r in rows if r["request_id"] == request_id), None)

    wait_for(row)
    found = row()
    assert found is not None
    return found


def sent(simulator: Simulator, path: str) -> dict[str, Any]:
    return [r for r in simulator.requests() if r["path"] == path][-1]["body"]


# -- /v1/completions -----------------------------------------------------------------------


def test_a_text_completion_is_relayed_with_echo_suffix_and_logprobs(gateway: Gateway, simulator: Simulator) -> None:
    raw = client(gateway).completions.with_raw_response.create(
        model="base-model", prompt="the quick fox", max_tokens=16, echo=True, suffix="!", logprobs=2)
    answer = raw.parse()
    body = sent(simulator, "/v1/completions")
    assert (body["prompt"], body["echo"], body["suffix"], body["logprobs"]) == ("the quick fox", True, "!", 2)
    assert not body.get("stream")  # the client's JSON request stays one upstream JSON answer
    assert answer.id.startswith("cmpl-") and answer.model == "base-model" and answer.object == "text_completion"
    [choice] = answer.choices
    assert choice.text == "the quick fox -> the quick fox.!"
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.tokens == [" ->", " the", " quick", " fox", "."]
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 5)
    row = audited(gateway, raw.headers["x-request-id"])
    assert (row["protocol"], row["outcome"], row["streamed"]) == ("completions", "success", False)
    assert row["usage"]["prompt_tokens"] == 3 and row["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_streamed_text_completion_arrives_whole(gateway: Gateway, simulator: Simulator, include_usage: bool) -> None:
    """Not strict: the SDK reuses its ``Completion`` type, whose ``finish_reason`` is required,
    for stream chunks, so strict validation refuses every real legacy stream (OpenAI's own
    and vLLM's send ``finish_reason: null`` until the last chunk, as the gateway relays)."""
    options = {"include_usage": True} if include_usage else None
    raw = client(gateway, strict=False).completions.with_raw_response.create(
        model="base-model", prompt="a b c d e f g h", max_tokens=4, stream=True, stream_options=options)  # type: ignore[arg-type]
    chunks = list(raw.parse())
    assert raw.headers["x-codebuddy2api-stream-mode"] == gateway.live.current.stream_mode.value
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert {c.model for c in chunks} == {"base-model"} and {c.object for c in chunks} == {"text_completion"}
    text = "".join(choice.text for c in chunks for choice in c.choices)
    assert text == " -> a b c"  # four words: max_tokens cuts it
    finishes = [choice.finish_reason for c in chunks for choice in c.choices if choice.finish_reason]
    assert finishes == ["length"]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert (len(usage) == 1 and usage[0].completion_tokens == 4) if include_usage else not usage
    assert sent(simulator, "/v1/completions")["stream"] is True
    row = audited(gateway, raw.headers["x-request-id"])
    assert (row["protocol"], row["outcome"], row["finish_reason"]) == ("completions", "success", "length")
    assert row["usage"]["completion_tokens"] == 4  # the gateway asks for usage itself


def test_token_id_and_list_prompts_pass_as_sent(gateway: Gateway, simulator: Simulator) -> None:
    answer = client(gateway).completions.create(model="base-model", prompt=[[11, 12], [13]], max_tokens=8)
    assert sent(simulator, "/v1/completions")["prompt"] == [[11, 12], [13]]
    assert [c.text for c in answer.choices] == [" -> tok11 tok12.", " -> tok13."]
    answer = client(gateway).completions.create(model="base-model", prompt=[7, 8, 9], max_tokens=8)
    assert [c.text for c in answer.choices] == [" -> tok7 tok8 tok9."]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "prompt": 3}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": ["x"] * 2049}, "prompt"),
    ({"model": "m", "prompt": "x", "logprobs": 99}, "logprobs"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "input": [1.5]}, "input"),
])
def test_bad_bodies_get_a_named_400_before_the_upstream(gateway: Gateway, simulator: Simulator, body: dict[str, Any], param: str) -> None:
    route = "/completions" if param != "input" else "/embeddings"
    simulator.clear()
    answer = httpx.post(gateway.base_url + route, json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or "").split(".")[0] == param
    assert simulator.requests() == []


def test_an_upstream_failure_is_an_openai_error_with_one_record(gateway: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as failed:
        client(gateway).completions.create(model="server_error", prompt="x")
    assert failed.value.status_code == 502
    assert isinstance(failed.value.body, dict) and failed.value.body["code"] == "upstream_error"
    request_id = failed.value.response.headers["x-request-id"]
    row = audited(gateway, request_id)
    assert (row["protocol"], row["outcome"], row["error_code"]) == ("completions", "error", "upstream_error")


# -- /v1/embeddings ----------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [None, "float"])
def test_embeddings_are_relayed_exactly(gateway: Gateway, simulator: Simulator, encoding: str | None) -> None:
    """The SDK's default asks for base64 on the wire and decodes it itself, after
    validation: strict mode refuses any real base64 answer, so that case runs unstrict."""
    options: dict[str, Any] = {"encoding_format": encoding} if encoding else {}
    raw = client(gateway, strict=encoding is not None).embeddings.with_raw_response.create(
        model="embedder", input=["alpha beta", "gamma"], dimensions=4, **options)
    answer = raw.parse()
    body = sent(simulator, "/v1/embeddings")
    assert (body["input"], body["dimensions"], body["encoding_format"]) == (["alpha beta", "gamma"], 4, encoding or "base64")
    assert answer.model == "embedder" and [e.index for e in answer.data] == [0, 1]
    for item, text in zip(answer.data, ["alpha beta", "gamma"]):
        expected = embedding_vector(text, 4)
        assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(item.embedding, expected))
    assert answer.usage.prompt_tokens == 3
    row = audited(gateway, raw.headers["x-request-id"])
    assert (row["protocol"], row["outcome"], row["usage"]["prompt_tokens"]) == ("embeddings", "success", 3)


def test_embeddings_refuse_stream_and_relay_a_failure(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    refused = httpx.post(gateway.base_url + "/embeddings", json={"model": "e", "input": "x", "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "stream_not_supported"
    assert simulator.requests() == []
    with pytest.raises(openai.APIStatusError) as failed:
        client(gateway).embeddings.create(model="server_error", input="x")
    assert failed.value.status_code == 502


# -- keys, failover -------------------------------------------------------------------------

CLIENT_KEY = "sk-relayed-routes-client-key-0001"


@pytest.fixture(scope="module")
def failover_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    """A client key, and two upstreams: a dead port first, the simulator second."""
    config: Path = tmp_path_factory.mktemp("cfg") / "upstreams.toml"
    config.write_text(
        '[[upstreams]]\nname = "dead"\nbase_url = "http://127.0.0.1:9/v1"\n'
        f'[[upstreams]]\nname = "sim"\nbase_url = "{simulator.url}/v1"\n'
    )
    return start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[], config=config,
                         api_key=[SecretStr(CLIENT_KEY)], failover_max=2)


@pytest.mark.parametrize("route", ["completions", "embeddings"])
def test_the_client_key_is_required(failover_gateway: Gateway, route: str) -> None:
    body = {"model": "m", "prompt": "x"} if route == "completions" else {"model": "m", "input": "x"}
    refused = httpx.post(f"{failover_gateway.base_url}/{route}", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_dead_upstream_fails_over_to_a_live_one(failover_gateway: Gateway) -> None:
    attempts: list[list[str | None]] = []
    for _ in range(6):
        raw = client(failover_gateway, CLIENT_KEY).completions.with_raw_response.create(model="m", prompt="go on")
        assert raw.parse().choices[0].text == " -> go on."
        row = audited(failover_gateway, raw.headers["x-request-id"])
        attempts.append([a["upstream"] for a in row["upstream_attempts"]])
        embedded = client(failover_gateway, CLIENT_KEY).embeddings.create(model="m", input="x", encoding_format="float")
        assert len(embedded.data[0].embedding) == 8
    assert all(a[-1] == "sim" for a in attempts)
    assert any(a == ["dead", "sim"] for a in attempts), attempts  # at least one went through the dead one first


# -- RelayedCall on a fake attempts seam (the stream modes, keepalives, abort) ------------------


class FakeAttempts:
    """What RelayedCall needs of UpstreamAttempts: ``stream(body, send)``, ``log``, ``client``."""

    def __init__(self, chunks: list[dict[str, Any]], pause: float = 0.0) -> None:
        self.chunks, self.pause = chunks, pause
        self.log: list[dict[str, Any]] = [{"upstream": "fake", "status": 200}]
        self.upstream_model = "upstream-name"
        self.client = type("Client", (), {"stream_path": staticmethod(lambda path: None)})()

    async def stream(self, body: dict[str, Any], send: Any = None) -> Any:
        yield ANSWERED
        for chunk in self.chunks:
            await asyncio.sleep(self.pause)
            yield chunk
        yield DONE


def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "up", "object": "text_completion", "model": "up",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def relayed(mode: str, attempts: FakeAttempts) -> RelayedCall:
    route = CompletionsRoute()
    parsed = route.parse(b'{"model": "client-model", "prompt": "x", "stream": true}', {})
    policy = StreamPolicy.snapshot(Settings(stream_mode=mode, keepalive_interval=0.05))
    return RelayedCall(route, parsed, policy, RequestRecord("req_1", "completions", 0.0), attempts)  # type: ignore[arg-type]


def outputs(call: RelayedCall, abort_after: float | None = None) -> list[Any]:
    async def run() -> list[Any]:
        if abort_after is not None:
            asyncio.get_running_loop().call_later(abort_after, call.abort, GatewayError("overloaded", "server_shutting_down", "bye"))
        return [out async for out in call.stream()]

    return asyncio.run(run())


def test_compatible_holds_the_answer_until_it_finished_and_says_so_before_committing() -> None:
    unfinished = relayed("compatible", FakeAttempts([text_chunk("a"), text_chunk("b")]))
    [error] = outputs(unfinished)
    assert isinstance(error, GatewayError) and error.code == "upstream_incomplete" and not unfinished.committed
    finished = relayed("compatible", FakeAttempts([text_chunk("a"), text_chunk("b", "stop")]))
    [whole] = outputs(finished)
    assert isinstance(whole, bytes) and whole.endswith(b"data: [DONE]\n\n") and whole.count(b"data: ") == 3
    assert b'"model":"client-model"' in whole and b'"id":"up"' not in whole
    assert finished.record.finish_reason == "stop" and finished.record.upstream_model == "upstream-name"


def test_realtime_relays_at_once_and_ends_an_unfinished_stream_with_an_error_frame() -> None:
    call = relayed("realtime", FakeAttempts([text_chunk("a"), text_chunk("b")]))
    frames = outputs(call)
    assert [f.count(b"data: ") for f in frames] == [1, 1, 2]
    assert b'"code":"upstream_incomplete"' in frames[-1] and frames[-1].endswith(b"data: [DONE]\n\n")
    assert call.error is not None and call.committed


def test_quiet_intervals_send_keepalives_and_a_shutdown_abort_ends_it() -> None:
    slow = relayed("compatible", FakeAttempts([text_chunk("a"), text_chunk("b", "stop")], pause=0.12))
    frames = outputs(slow)
    assert frames[0] == b": keepalive\n\n" and slow.record.keepalives >= 2
    assert frames[-1].endswith(b"data: [DONE]\n\n")
    stalled = relayed("realtime", FakeAttempts([text_chunk("a")], pause=5))
    frames = outputs(stalled, abort_after=0.08)
    assert frames[0] == b": keepalive\n\n"  # committed by the keepalive: the error comes in-stream
    assert b'"code":"server_shutting_down"' in frames[-1] and stalled.error is not None


# -- a body of token ids: a bounded parse off the loop, a named answer ----------------------


def test_a_27_mib_body_of_token_ids_is_a_fast_named_413_while_healthz_answers(tmp_path: Path) -> None:
    """Issue #36: a 27 MiB ``/v1/completions`` body of token-id prompts took 62 s to reach a
    503 ``parser_busy`` (parsed and validated id by id in a thread that held the GIL) while
    ``/healthz`` stalled. Now such a body is parsed in a worker process, and its ids are
    counted before they are walked: past ``MAX_TOKEN_IDS`` it is a 413
    ``too_many_token_ids`` in the OpenAI shape. A body within the bound takes the same way and
    is served. ``/healthz`` is probed from a process of its own meanwhile: the bound only
    catches a frozen loop (timings are bench figures: bench/hostile.py --token-ids)."""
    from gateway.generation.passthrough import MAX_TOKEN_IDS
    from tests.processes import FREEZE_MS, GatewayProcess, paced_probe

    gateway = GatewayProcess("--simulator", "--data-dir", str(tmp_path / "data"), "--log-level", "warning",
                             log_dir=tmp_path)
    try:
        gateway.wait_healthy()
        huge = b'{"model":"base-model","max_tokens":5,"prompt":[' + b",".join(
            [b"[" + b",".join([b"%d" % (10_000 + j) for j in range(2600)]) + b"]"] * 2048) + b"]}"
        assert len(huge) > 27 * 1024 * 1024
        within = [[11 + (j % 7) for j in range(MAX_TOKEN_IDS // 4)]] * 4  # exactly the bound
        with paced_probe(gateway.port) as probes:
            refused = httpx.post(gateway.base_url + "/completions", content=huge, timeout=120,
                                 headers={"content-type": "application/json"})
            served = client(gateway).completions.create(model="base-model", prompt=within, max_tokens=3)  # type: ignore[arg-type]
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("too_many_token_ids", "prompt", "invalid_request_error")
        assert f"at most {MAX_TOKEN_IDS}" in error["message"] and "5324800 token ids" in error["message"]
        assert len(served.choices) == 4 and all(c.text for c in served.choices)
        # answered throughout, never frozen (62 s before): the 3rd-worst probe within the bound
        # at the machine's pace (one 1.3 s probe was seen at load 20 beside a whole suite)
        assert len(probes.gateway) > 5 and probes.stalled(FREEZE_MS * 2, 3) == 0, (
            sorted(probes.gateway)[-5:], probes.pace)
    finally:
        gateway.stop()
