"""A second real upstream: llama-cpp-python's OpenAI-compatible server (``python -m
llama_cpp.server``) with SmolLM2-135M-Instruct, through all three protocols in both modes,
streamed and not, driven by the strict SDKs (``make test-real-lcp``).

``scripts/build-llama-cpp-python.sh`` installs the server into its own venv in a cache
directory outside the repo (``CODEBUDDY2API_LCP_DIR``, default
``~/.cache/codebuddy2api/llama-cpp-python``); the model is the GGUF the llama-server suite
uses. Without them these tests skip, unless ``CODEBUDDY2API_REQUIRE_LLAMA`` is set (CI).

The server runs with ``--chat_format chatml-function-calling``, its own tool-calling format:
a ``tool_choice`` naming a function constrains the answer to that function's JSON schema (a
grammar), so even a 135M model calls the tool every time. What it sends that other servers
do not (``test_raw_quirks`` records each from the wire; docs/upstreams.md):

- a tool call as a legacy ``function_call`` delta *and* a ``tool_calls`` delta on every
  chunk, each repeating the id and the name, beside explicit ``"role": null,
  "content": null``;
- no usage at all in a stream, ``stream_options.include_usage`` or not (the gateway
  estimates it; ``--upstream-stream never`` gets the server's own counts);
- ``tool_choice: "required"`` (what Messages' ``any`` becomes) is unsupported: a stream is
  HTTP 200 whose body ends before the first byte;
- ``tool_choice: "auto"`` when the model picks a tool cannot be streamed either (the same
  empty 200); tools without any ``tool_choice`` are ignored;
- any other request for the model (even ``GET /v1/models``) cuts a running stream short:
  ``data: [DONE]`` with no ``finish_reason`` before it, then the connection drops;
- a body without ``Content-Type: application/json`` is refused (HTTP 500).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator
from tests.drivers import DRIVERS, TOOLS, UNARY_DRIVERS, Ask, Named, Outcome
from tests.processes import free_port, require_build, upstream_process
from tests.test_real_llama import MODEL, MODES, gateway_in_front, gateways_in_front

pytestmark = pytest.mark.real

LCP_DIR = Path(os.environ.get("CODEBUDDY2API_LCP_DIR", Path.home() / ".cache/codebuddy2api/llama-cpp-python"))
LCP_VERSION = "0.3.36"  # scripts/build-llama-cpp-python.sh
PYTHON = LCP_DIR / "venv/bin/python"
STAMP = LCP_DIR / f"venv/.built-llama-cpp-python-{LCP_VERSION}"
CONTEXT = 4096
HELLO = Ask(prompt="Say hello in one short sentence.", max_tokens=24, tools=False, temperature=0, timeout=600)
WEATHER = Ask(prompt="What is the weather in Paris?", max_tokens=64, temperature=0, timeout=600)
#: the drivers' tools as the server's own Chat request declares them
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["schema"]}} for t in TOOLS]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
STREAMED = {"streamed": DRIVERS, "unary": UNARY_DRIVERS}


@pytest.fixture(scope="module")
def lcp_url() -> Iterator[str]:
    """llama-cpp-python's server on a free loopback port for this module."""
    require_build([p for p in (STAMP, MODEL) if not p.exists()], "scripts/build-llama-cpp-python.sh")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    argv = [str(PYTHON), "-m", "llama_cpp.server", "--model", str(MODEL), "--model_alias", "smollm2",
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(CONTEXT),
            "--chat_format", "chatml-function-calling", "--seed", "1", "--verbose", "False",
            # one thread: two spin-waiting threads on a shared 2-core machine stall for seconds
            "--n_threads", "1", "--n_threads_batch", "1"]
    with upstream_process(argv, url + "/models", LCP_DIR / "server-test.log"):
        yield url


@pytest.fixture(scope="module")
def lcp_gateways(
    lcp_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Gateway]:
    return gateways_in_front(lcp_url, server_loop, simulator, tmp_path_factory)


@pytest.fixture(scope="module")
def buffered_gateway(
    lcp_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> Gateway:
    """A gateway that asks the upstream for JSON answers (``--upstream-stream never``)."""
    return gateway_in_front(lcp_url, server_loop, simulator, tmp_path_factory, stream_mode="realtime",
                            upstream_stream="never")


@pytest.fixture(scope="module")
def fallback_gateway(
    lcp_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> Gateway:
    """A gateway that streams from the upstream and asks for JSON when that fails
    (``--upstream-stream auto``)."""
    return gateway_in_front(lcp_url, server_loop, simulator, tmp_path_factory, stream_mode="realtime",
                            upstream_stream="auto")


def direct(lcp_url: str, **body: object) -> dict:
    """The same question asked of the server itself (no gateway), non-streaming."""
    response = httpx.post(lcp_url + "/chat/completions", json={"model": "smollm2", **body}, timeout=600)
    response.raise_for_status()
    return response.json()


def raw_stream(lcp_url: str, **body: object) -> tuple[int, str]:
    """The server's own SSE bytes for one streamed request (status, body text)."""
    with httpx.stream("POST", lcp_url + "/chat/completions", timeout=600,
                      json={"model": "smollm2", "stream": True, **body}) as response:
        return response.status_code, b"".join(response.iter_raw()).decode()


def frames(sse: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` stays a string)."""
    out: list[Any] = []
    for line in sse.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run(gateways: dict[str, Gateway], protocol: str, mode: str, streamed: str, tool_choice: Any, ask: Ask) -> Outcome:
    outcome = STREAMED[streamed][protocol](gateways[mode].url, "smollm2", tool_choice, ask)
    assert outcome.violations == []
    return outcome


# -- what the server itself sends (no gateway) ---------------------------------------------


def test_raw_quirks(lcp_url: str) -> None:
    """Each quirk the gateway normalises, seen on the wire from this server."""
    # plain text: a role-only first delta, a finish chunk with an empty delta, and no usage
    # anywhere although include_usage was asked for
    status, sse = raw_stream(lcp_url, messages=HELLO.chat_messages(), max_tokens=8, temperature=0,
                             stream_options={"include_usage": True})
    assert status == 200
    text = frames(sse)
    assert text[-1] == "[DONE]"
    chunks = text[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert not any("usage" in c for c in chunks)

    # a named tool: every chunk carries the legacy function_call beside tool_calls, both
    # repeating the name (and the call its id), with explicit nulls for the rest
    status, sse = raw_stream(lcp_url, messages=WEATHER.chat_messages(), max_tokens=64, temperature=0,
                             tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert status == 200
    calls = frames(sse)[:-1]
    assert calls[0]["choices"][0]["delta"] == {"role": "assistant", "content": None, "function_call": None,
                                               "tool_calls": None}
    body = [c["choices"][0]["delta"] for c in calls[1:-1]]
    assert len(body) > 1
    assert all(d["role"] is None and d["content"] is None for d in body)
    assert all(d["function_call"]["name"] == "get_weather" for d in body)
    assert all(d["tool_calls"][0]["function"]["name"] == "get_weather" for d in body)
    assert len({d["tool_calls"][0]["id"] for d in body}) == 1  # the same id on every chunk
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in body)
    assert arguments == "".join(d["function_call"]["arguments"] for d in body)
    assert isinstance(json.loads(arguments), dict)
    assert calls[-1]["choices"][0] == {"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                                       "delta": {"role": None, "content": None, "function_call": None, "tool_calls": None}}
    assert not any("usage" in c for c in calls)

    # tool_choice "required" is not supported: 200, then nothing (not streamed: a 500)
    status, sse = raw_stream(lcp_url, messages=WEATHER.chat_messages(), max_tokens=16,
                             tools=CHAT_TOOLS, tool_choice="required")
    assert (status, sse) == (200, "")

    # tools without a tool_choice are not even shown to the model: plain text
    plain = direct(lcp_url, messages=WEATHER.chat_messages(), max_tokens=16, temperature=0, tools=CHAT_TOOLS)
    assert plain["choices"][0]["message"]["content"] and not plain["choices"][0]["message"].get("tool_calls")

    # a body that does not say it is JSON is no body to FastAPI (the gateway says so since)
    body = json.dumps({"model": "smollm2", "messages": HELLO.chat_messages(), "max_tokens": 4}).encode()
    refused = httpx.post(lcp_url + "/chat/completions", content=body, timeout=600)
    assert refused.status_code == 500 and "valid dictionary" in refused.text


def test_raw_stream_cut_by_a_second_request(lcp_url: str) -> None:
    """A request waiting for the model (even ``GET /v1/models``) makes the server end the
    running stream at once: ``data: [DONE]`` with no finish_reason ever sent. How the
    connection then ends depends on the server's sse-starlette/uvicorn versions (its
    ``[server]`` extra is unpinned): older ones drop it without the chunked body's end, newer
    ones end the body cleanly. Either way the stream carries no finish_reason."""
    interrupt = threading.Thread(target=lambda: httpx.get(lcp_url + "/models", timeout=600))
    chunks: list[Any] = []
    try:
        with httpx.stream("POST", lcp_url + "/chat/completions", timeout=600,
                          json={"model": "smollm2", "stream": True, "messages": STORY, "max_tokens": 400,
                                "temperature": 0}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    chunks.append(data if data == "[DONE]" else json.loads(data))
                    if len(chunks) == 3:
                        interrupt.start()
    except httpx.RemoteProtocolError as dropped:
        assert "incomplete chunked read" in str(dropped)
    interrupt.join(600)
    assert chunks[-1] == "[DONE]"
    assert 3 <= len(chunks) < 400
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


# -- through the gateway -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hello_truth(lcp_url: str) -> dict:
    """The server's own greedy answer to HELLO (no gateway, not streamed)."""
    return direct(lcp_url, messages=HELLO.chat_messages(), max_tokens=HELLO.max_tokens, temperature=0)


@pytest.fixture(scope="module")
def weather_truth(lcp_url: str) -> dict:
    """The server's own call of get_weather for WEATHER (no gateway, not streamed)."""
    return direct(lcp_url, messages=WEATHER.chat_messages(), max_tokens=WEATHER.max_tokens, temperature=0,
                  tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})


def both(gateways: dict[str, Gateway], protocol: str, mode: str, tool_choice: Any, ask: Ask) -> dict[str, Outcome]:
    """The same request streamed and not, through one room of one gateway."""
    return {streamed: run(gateways, protocol, mode, streamed, tool_choice, ask) for streamed in STREAMED}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_plain_text(lcp_gateways: dict[str, Gateway], hello_truth: dict, protocol: str, mode: str) -> None:
    """Greedy decoding: the assembled text is the server's own answer, streamed or not, in
    every room. The server streams no usage, so the gateway's estimate stands in: positive,
    and the same for the same answer whichever way the client asked."""
    choice = hello_truth["choices"][0]
    outcomes = both(lcp_gateways, protocol, mode, None, HELLO)
    for streamed, outcome in outcomes.items():
        assert outcome.ok, (streamed, outcome.error)
        assert outcome.text and outcome.text == choice["message"]["content"], streamed
        assert outcome.finish == choice["finish_reason"], streamed
        assert outcome.tools == [] and outcome.reasoning == ""
        assert outcome.usage is not None and min(outcome.usage) > 0, streamed
    assert outcomes["streamed"].usage == outcomes["unary"].usage


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_buffered_upstream_relays_the_servers_own_usage(
    buffered_gateway: Gateway, hello_truth: dict, protocol: str
) -> None:
    """With ``--upstream-stream never`` the server's JSON answer carries its own token
    counts, and every room reports exactly those, streamed or not."""
    usage = (hello_truth["usage"]["prompt_tokens"], hello_truth["usage"]["completion_tokens"])
    assert min(usage) > 0
    for streamed, outcome in both({"realtime": buffered_gateway}, protocol, "realtime", None, HELLO).items():
        assert outcome.ok, (streamed, outcome.error)
        assert outcome.text == hello_truth["choices"][0]["message"]["content"], streamed
        assert outcome.usage == usage, streamed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_length(lcp_gateways: dict[str, Gateway], protocol: str, mode: str) -> None:
    ask = Ask(prompt="Write a long story about a dragon.", max_tokens=6, tools=False, temperature=0, timeout=600)
    outcomes = both(lcp_gateways, protocol, mode, None, ask)
    for streamed, outcome in outcomes.items():
        assert outcome.ok, (streamed, outcome.error)
        assert outcome.finish == "length" and outcome.text, streamed
    assert outcomes["streamed"].text == outcomes["unary"].text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_named_tool_call(lcp_gateways: dict[str, Gateway], weather_truth: dict, protocol: str, mode: str) -> None:
    """A named tool_choice in every room's spelling reaches the server as its function
    object; the call it streams twice over (``function_call`` and ``tool_calls``, id and name
    on every chunk) arrives as ONE call of that tool with the server's own arguments."""
    expected = json.loads(weather_truth["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert isinstance(expected, dict) and isinstance(expected.get("city"), str)
    for streamed, outcome in both(lcp_gateways, protocol, mode, Named("get_weather"), WEATHER).items():
        assert outcome.ok, (streamed, outcome.error)
        assert outcome.finish == "tool_calls", streamed
        assert outcome.tools == [("get_weather", expected)], streamed
        assert len(outcome.tool_ids) == 1 and outcome.tool_ids[0].startswith("call__0_get_weather_"), streamed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_unsupported_tool_choice_is_an_upstream_error(lcp_gateways: dict[str, Gateway], protocol: str, mode: str) -> None:
    """``required``/``any``: the server's 200 with an empty body is reported as the
    upstream's failure in the room's own error shape, not an empty success."""
    for streamed, outcome in both(lcp_gateways, protocol, mode, "required", WEATHER).items():
        assert not outcome.ok, (streamed, outcome)
        assert "upstream" in outcome.error, (streamed, outcome.error)


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_auto_tool_choice_needs_a_json_upstream_answer(
    lcp_gateways: dict[str, Gateway], buffered_gateway: Gateway, fallback_gateway: Gateway, protocol: str
) -> None:
    """``tool_choice: auto`` when the model picks a tool: the server cannot stream that
    (HTTP 200, empty body: "Automatic streaming tool choice is not supported"), so with
    ``--upstream-stream always`` it fails as ``upstream_empty_response``; with ``never``,
    and with ``auto`` (which then asks again for JSON), the same question is one call of
    the tool, streamed to the client or not (the legacy ``function_call`` copy, named
    ``get_weather:`` there, is not a second call)."""
    failed = run(lcp_gateways, protocol, "realtime", "streamed", "auto", WEATHER)
    assert not failed.ok and "upstream_empty_response" in failed.error, failed
    for gateway in (buffered_gateway, fallback_gateway):
        for streamed, outcome in both({"realtime": gateway}, protocol, "realtime", "auto", WEATHER).items():
            assert outcome.ok, (streamed, outcome.error)
            assert outcome.finish == "tool_calls", streamed
            assert [name for name, _ in outcome.tools] == ["get_weather"], streamed
            assert isinstance(outcome.tools[0][1].get("city"), str), streamed


def _stream_story(protocol: str, base_url: str, on_text: Any) -> str:
    """Stream a long answer through ``protocol``'s SDK helper, calling ``on_text`` at each
    text delta; returns the error the client saw ("" when the answer completed)."""
    if protocol == "messages":
        messages = anthropic.Anthropic(base_url=base_url, api_key="k", _strict_response_validation=True, max_retries=0)
        try:
            with messages.messages.stream(model="smollm2", messages=STORY, max_tokens=400,  # type: ignore[arg-type]
                                          extra_body={"temperature": 0}, timeout=600) as stream:
                for event in stream:
                    if event.type == "text":
                        on_text()
                stream.get_final_message()
        except anthropic.APIError as exc:
            return f"{exc} {exc.body}"
        return ""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    try:
        if protocol == "chat":
            with client.chat.completions.stream(model="smollm2", messages=STORY, max_tokens=400,  # type: ignore[arg-type]
                                                temperature=0, timeout=600) as chat:
                for chunk in chat:
                    if chunk.type == "content.delta":
                        on_text()
                chat.get_final_completion()
            return ""
        failed = []
        with client.responses.stream(model="smollm2", input=STORY[0]["content"], max_output_tokens=400,
                                     temperature=0, timeout=600) as responses:
            for event in responses:
                if event.type == "response.output_text.delta":
                    on_text()
                elif event.type in ("error", "response.failed"):
                    failed.append(json.dumps(event.to_dict()))
        return " ".join(failed)
    except openai.APIError as exc:
        return f"{exc} {exc.body}"


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_a_second_request_cuts_the_stream_and_the_client_is_told(
    lcp_gateways: dict[str, Gateway], lcp_url: str, protocol: str
) -> None:
    """The server ends a running stream with ``[DONE]`` and no finish_reason as soon as
    another request waits for the model (here ``GET /v1/models``, sent once the first text
    has arrived); the client gets the room's error, never a silently shortened answer.
    (Realtime: it is the mode in which the client sees text while the upstream streams.)"""
    interrupt = threading.Thread(target=lambda: httpx.get(lcp_url + "/models", timeout=600))
    texts: list[int] = []

    def on_text() -> None:
        texts.append(1)
        if len(texts) == 3:
            interrupt.start()

    error = _stream_story(protocol, lcp_gateways["realtime"].url, on_text)
    interrupt.join(600)
    assert texts and interrupt.ident is not None
    assert "upstream_incomplete" in error, error


def test_doctor_recommends_auto_for_this_server(lcp_url: str) -> None:
    """``codebuddy2api doctor`` against this server: every probe answered (each on its own
    connection: the one its failed tool stream used is closed by the server), no usage
    and the empty tool stream named as quirks, and ``--upstream-stream auto`` recommended,
    which makes that tool question work (test_auto_tool_choice_needs_a_json_upstream_answer)."""
    import subprocess
    import sys

    import jsonschema

    from tests.test_doctor import JSON_SCHEMA

    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    run = subprocess.run([sys.executable, "-m", "gateway", "doctor", lcp_url, "--json"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    document = json.loads(run.stdout)
    jsonschema.validate(document, JSON_SCHEMA)
    assert document["ok"] is True
    checks = {f["check"]: (f["status"], f["quirk"]) for f in document["findings"]}
    for check in ("models list", "streamed text", "[DONE]", "finish_reason", "non-streamed answer", "error shape"):
        assert checks[check][0] == "ok", (check, checks)
    assert checks["include_usage"] == ("quirk", "no_usage")
    assert checks["streamed tool call"] == ("quirk", "empty_stream")
    assert document["recommended"]["upstream_stream"] == "auto"
