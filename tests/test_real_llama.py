"""A real upstream: llama.cpp's llama-server with SmolLM2-135M-Instruct, through all three
protocols in both modes, driven by the strict SDK stream helpers (``make test-real``).

``scripts/build-llama-server.sh`` builds the server and fetches the model into a cache
directory outside the repo (``CODEBUDDY2API_LLAMA_DIR``, default
``~/.cache/codebuddy2api/llama``). Without them these tests skip, unless
``CODEBUDDY2API_REQUIRE_LLAMA`` is set (CI), which makes a missing build a failure.

What llama-server does that the simulator only imitates (../shared/PROTOCOLS.md): a first
chunk ``{"role":"assistant","content":null}``; tool calls with 32-character ids and
pretty-printed arguments; a mid-stream error as HTTP 200, role chunk, ``data: {"error"}``
and EOF without ``[DONE]``; a prompt over the context as a 400 ``exceed_context_size_error``.
A 135M model calls a tool reliably only with ``tool_choice: required`` and the prefill
``"<tool_call>\\n"``; the same prefill with ``auto`` yields its mid-stream error.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.drivers import DRIVERS, Ask, Outcome
from tests.processes import free_port, require_build, upstream_process

pytestmark = pytest.mark.real

LLAMA_DIR = Path(os.environ.get("CODEBUDDY2API_LLAMA_DIR", Path.home() / ".cache/codebuddy2api/llama"))
BINARY = LLAMA_DIR / "bin/llama-server"
MODEL = LLAMA_DIR / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEMPLATE = LLAMA_DIR / "templates/Qwen-Qwen2.5-7B-Instruct.jinja"
CONTEXT = 4096
TOOL_PREFILL = "<tool_call>\n"
MODES = ("compatible", "realtime")
HELLO = Ask(prompt="Say hello in one short sentence.", max_tokens=24, tools=False, temperature=0, timeout=600)


@pytest.fixture(scope="module")
def llama_url() -> Iterator[str]:
    """A llama-server on a free loopback port for this module."""
    require_build([p for p in (BINARY, MODEL, TEMPLATE) if not p.exists()], "scripts/build-llama-server.sh")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(BINARY), "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
            "--no-repack", "--jinja", "--chat-template-file", str(TEMPLATE),
            "-c", str(CONTEXT), "-np", "2", "-t", "2", "--seed", "1"]
    with upstream_process(argv, url + "/health", LLAMA_DIR / "llama-server-test.log"):
        yield url + "/v1"


def gateway_in_front(url: str, server_loop: ServerLoop, simulator: Simulator,
                     tmp_path_factory: pytest.TempPathFactory, **overrides: object) -> Gateway:
    """A gateway in front of the real upstream at ``url`` (``overrides``: more settings)."""
    return start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[url],
                         keepalive_interval=1.0, tool_repair_attempts=0,
                         # on a busy 2-core machine this model can drop to ~1 token/s, and
                         # llama-server says nothing while it parses a tool call
                         idle_timeout=600, first_byte_timeout=600, **overrides)


def gateways_in_front(url: str, server_loop: ServerLoop, simulator: Simulator,
                      tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    """One gateway per stream mode in front of the real upstream at ``url``."""
    return {mode: gateway_in_front(url, server_loop, simulator, tmp_path_factory, stream_mode=mode) for mode in MODES}


@pytest.fixture(scope="module")
def real_gateways(
    llama_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Gateway]:
    return gateways_in_front(llama_url, server_loop, simulator, tmp_path_factory)


def direct(llama_url: str, **body: object) -> dict:
    """The same question asked of llama-server itself (no gateway), non-streaming."""
    response = httpx.post(llama_url + "/chat/completions", json={"model": "smollm2", **body}, timeout=600)
    response.raise_for_status()
    return response.json()


def run(gateways: dict[str, Gateway], protocol: str, mode: str, tool_choice: str | None, ask: Ask) -> Outcome:
    outcome = DRIVERS[protocol](gateways[mode].url, "smollm2", tool_choice, ask)
    assert outcome.violations == []
    return outcome


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_plain_text(real_gateways: dict[str, Gateway], llama_url: str, protocol: str, mode: str) -> None:
    """Greedy decoding: the gateway's assembled text and usage are llama-server's own."""
    truth = direct(llama_url, messages=HELLO.chat_messages(), max_tokens=HELLO.max_tokens, temperature=0)
    outcome = run(real_gateways, protocol, mode, None, HELLO)
    assert outcome.ok, outcome.error
    choice = truth["choices"][0]
    assert outcome.text == choice["message"]["content"]
    assert outcome.finish == choice["finish_reason"]
    assert outcome.usage == (truth["usage"]["prompt_tokens"], truth["usage"]["completion_tokens"])
    assert outcome.tools == [] and outcome.reasoning == ""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_length(real_gateways: dict[str, Gateway], protocol: str, mode: str) -> None:
    ask = Ask(prompt="Write a long story about a dragon.", max_tokens=6, tools=False, temperature=0, timeout=600)
    outcome = run(real_gateways, protocol, mode, None, ask)
    assert outcome.ok, outcome.error
    assert outcome.finish == "length"
    assert outcome.usage is not None and outcome.usage[1] == 6
    assert outcome.text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_tool_call(real_gateways: dict[str, Gateway], protocol: str, mode: str) -> None:
    """llama-server's own tool-call shape (32-character bare ids, pretty-printed
    arguments) arrives as valid calls of the declared tool in every room. (Greedy, this
    model calls get_weather for Paris twice, as llama-server itself answers.)"""
    ask = Ask(prompt="What is the weather in Paris? Use the get_weather tool.", prefill=TOOL_PREFILL,
              max_tokens=96, temperature=0, timeout=600)
    outcome = run(real_gateways, protocol, mode, "required", ask)
    assert outcome.ok, outcome.error
    assert outcome.finish == "tool_calls"
    assert outcome.tools and [name for name, _ in outcome.tools] == ["get_weather"] * len(outcome.tools)
    assert all(args["city"] == "Paris" for _, args in outcome.tools)
    assert len(set(outcome.tool_ids)) == len(outcome.tools)
    assert all(len(i) == 32 and i.isalnum() for i in outcome.tool_ids)  # llama's ids, relayed as they are


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_mid_stream_error(real_gateways: dict[str, Gateway], protocol: str, mode: str) -> None:
    """The tool prefill with ``auto``: llama-server fails after its role chunk (200,
    ``data: {"error"}``, no ``[DONE]``); every room reports the upstream's error."""
    ask = Ask(prompt="What is the weather in Paris?", prefill=TOOL_PREFILL, max_tokens=24, temperature=0, timeout=600)
    outcome = run(real_gateways, protocol, mode, None, ask)
    assert not outcome.ok, outcome
    assert "upstream_error" in outcome.error and "the upstream reported an error" in outcome.error


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_context_size_is_a_400(real_gateways: dict[str, Gateway], protocol: str, mode: str) -> None:
    ask = Ask(prompt="word " * (CONTEXT + 500), max_tokens=8, tools=False, timeout=600)
    outcome = run(real_gateways, protocol, mode, None, ask)
    assert not outcome.ok, outcome
    assert "Error code: 400" in outcome.error and "upstream_rejected" in outcome.error
    assert "context" in outcome.error


def test_doctor_against_the_real_llama_server(llama_url: str) -> None:
    """``codebuddy2api doctor`` probes the real server the way the gateway will use it and
    finds nothing the gateway cannot handle (what a 135M model's tool call looks like is
    the model's business: reported, not judged)."""
    import json
    import sys

    import jsonschema

    from tests.test_doctor import JSON_SCHEMA

    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "doctor", llama_url, "--json"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    document = json.loads(run.stdout)
    jsonschema.validate(document, JSON_SCHEMA)
    assert document["ok"] is True and document["url"] == llama_url
    checks = {f["check"]: f["status"] for f in document["findings"]}
    # a real OpenAI-compatible server: models, a streamed text answer ending in [DONE]
    # with usage, a finish reason, a non-streamed answer
    for check in ("models list", "streamed text", "[DONE]", "include_usage", "finish_reason", "non-streamed answer"):
        assert checks.get(check) == "ok", (check, checks)
    assert document["recommended"]["command"].startswith(f"codebuddy2api serve --upstream-url {llama_url} ")


# -- rollouts: llama-server as the token source (--capture-tokens llamacpp) ----------------


def streamed_logprob_ids(llama_url: str, **body: object) -> list[int]:
    """The ids of llama-server's own logprobs entries, asked directly as the gateway asks
    (streamed; a non-streamed answer also has an entry for the end-of-generation token)."""
    import json

    ids: list[int] = []
    request = {"model": "smollm2", "stream": True, "logprobs": True, **body}
    with httpx.stream("POST", llama_url + "/chat/completions", json=request, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    ids += [e["id"] for e in (choice.get("logprobs") or {}).get("content") or []]
    return ids


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("mode", MODES)
def test_rollout_token_ids_are_llama_servers_own(
    llama_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory,
    mode: str, stream: bool,
) -> None:
    """Completion ids are the ids of llama-server's own logprobs entries (they detokenize to
    the answer, and greedy decoding asked directly gives the same ids); prompt ids are its
    /tokenize of its /apply-template of the request that was sent."""
    import secrets

    import openai

    gateway = gateway_in_front(llama_url, server_loop, simulator, tmp_path_factory, stream_mode=mode,
                               capture_tokens="llamacpp")
    rollout = "llama-" + secrets.token_hex(4)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key="unused-key-0123456789abcdef",
                           _strict_response_validation=True, max_retries=0, timeout=600)
    messages = HELLO.chat_messages()
    if stream:
        with client.chat.completions.stream(model="smollm2", messages=messages, max_tokens=HELLO.max_tokens, temperature=0) as s:  # type: ignore[arg-type]
            text = s.get_final_completion().choices[0].message.content
    else:
        text = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=HELLO.max_tokens,  # type: ignore[arg-type]
                                              temperature=0).choices[0].message.content
    snap = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin, timeout=30).json()
    [call] = snap["calls"]
    tokens = call["tokens"]
    assert call["token_source"] == "llamacpp" and tokens is not None
    root = llama_url.removesuffix("/v1")
    detok = httpx.post(root + "/detokenize", json={"tokens": tokens["completion_ids"]}, timeout=60).json()["content"]
    assert detok.strip() == (text or "").strip()
    assert streamed_logprob_ids(llama_url, messages=messages, max_tokens=HELLO.max_tokens, temperature=0) == tokens["completion_ids"]
    assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])
    assert all(lp <= 0 for lp in tokens["completion_logprobs"])
    sent = call["upstream_request"]
    prompt = httpx.post(root + "/apply-template", json={"messages": sent["messages"]}, timeout=60).json()["prompt"]
    ids = httpx.post(root + "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True},
                     timeout=60).json()["tokens"]
    assert tokens["prompt_ids"] == ids and call["continuity"]["prefix"] == "exact"
