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


# -- token-in continuation (issue #27): llama-server's /completion with token ids ----------


class RecordingProxy:
    """A loopback proxy in front of llama-server that keeps every request it forwarded
    (path and JSON body): what the engine really received."""

    def __init__(self, target: str) -> None:
        import contextlib
        from collections.abc import AsyncIterator

        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.target = target.removesuffix("/v1")
        self.requests: list[tuple[str, object]] = []
        self.client: httpx.AsyncClient | None = None

        async def forward(request: Request) -> StreamingResponse:
            import json

            body = await request.body()
            try:
                self.requests.append((request.url.path, json.loads(body) if body else None))
            except ValueError:
                self.requests.append((request.url.path, None))
            if self.client is None:  # one pooled client, as the gateway's own
                self.client = httpx.AsyncClient(timeout=600)
            client = self.client
            upstream = await client.send(client.build_request(
                request.method, self.target + request.url.path, content=body,
                headers={"content-type": request.headers.get("content-type", "application/json")}), stream=True)

            async def relay():  # type: ignore[no-untyped-def]
                try:
                    async for piece in upstream.aiter_raw():
                        yield piece
                finally:
                    await upstream.aclose()

            return StreamingResponse(relay(), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type"))

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            if self.client is not None:
                await self.client.aclose()

        self.app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])], lifespan=lifespan)

    def completions(self) -> list[dict]:
        return [b for p, b in self.requests if p == "/completion" and isinstance(b, dict)]  # type: ignore[misc]


TOKEN_IN_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def token_in_gateway(llama_url: str, server_loop: ServerLoop, simulator: Simulator,
                     tmp_path_factory: pytest.TempPathFactory, mode: str) -> tuple[Gateway, RecordingProxy]:
    proxy = RecordingProxy(llama_url)
    url = server_loop.serve(proxy.app) + "/v1"
    # llama-server refuses logprobs on a streamed chat request with tools: auto falls back to JSON
    gateway = gateway_in_front(url, server_loop, simulator, tmp_path_factory, stream_mode=mode, token_in="llamacpp",
                               upstream_stream="auto")
    return gateway, proxy


def check_token_in(gateway: Gateway, proxy: RecordingProxy, rollout: str) -> list[dict]:
    snap = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin, timeout=30).json()
    calls = snap["calls"]
    assert snap["complete"] and [c["outcome"] for c in calls] == ["success"] * 3
    assert [c["token_in"]["status"] for c in calls] == ["skipped: first_turn", "used", "used"]
    sent = proxy.completions()
    assert len(sent) == 2 and all(isinstance(b["prompt"], list) for b in sent)
    for n in (1, 2):
        before = calls[n - 1]["tokens"]
        exact = before["prompt_ids"] + before["completion_ids"]
        assert sent[n - 1]["prompt"][: len(exact)] == exact  # turn n-1's prompt + completion, as sampled
        assert len(sent[n - 1]["prompt"]) > len(exact) and calls[n]["tokens"]["prompt_ids"] == sent[n - 1]["prompt"]
        assert calls[n]["continuity"]["prefix"] == "exact"
    [segment] = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}/trajectory", headers=gateway.admin,
                          timeout=30).json()["segments"]
    assert segment["call_ids"] == [c["call_id"] for c in calls]
    assert segment["tokens"] == calls[2]["tokens"]["prompt_ids"] + calls[2]["tokens"]["completion_ids"]
    costs = [(c["token_in"]["render_calls"], c["token_in"]["render_ms"]) for c in calls[1:]]
    print(f"\ntoken-in render cost per turn (calls, ms): {costs}")
    assert all(k == 2 for k, _ in costs)
    return calls


@pytest.mark.parametrize("mode", MODES)
def test_token_in_chat_three_turns(
    llama_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, mode: str,
) -> None:
    """Turn 1 goes the chat way; turns 2 and 3 reach llama-server's /completion as token ids
    that start with the previous turn's prompt + completion exactly; the tool call sampled
    through token-in (turn 2, a required call) reaches the SDK; one segment."""
    import json
    import secrets

    import openai

    gateway, proxy = token_in_gateway(llama_url, server_loop, simulator, tmp_path_factory, mode)
    rollout = "llama-ti-" + secrets.token_hex(4)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key="unused-key-0123456789abcdef",
                           _strict_response_validation=True, max_retries=0, timeout=600)
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": "Say hello in one short sentence."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=TOKEN_IN_TOOLS,  # type: ignore[arg-type]
                                           tool_choice="none", max_tokens=24, temperature=0).choices[0].message
    messages += [first.model_dump(exclude_none=True, exclude={"parsed"}),
                 {"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]
    with client.chat.completions.stream(model="smollm2", messages=messages, tools=TOKEN_IN_TOOLS,  # type: ignore[arg-type]
                                        tool_choice="required", max_tokens=64, temperature=0) as s:
        second = s.get_final_completion().choices[0]
    assert second.finish_reason == "tool_calls"
    [call] = second.message.tool_calls or []
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    messages += [second.message.model_dump(exclude_none=True, exclude={"parsed"}),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    third = client.chat.completions.create(model="smollm2", messages=messages, tools=TOKEN_IN_TOOLS,  # type: ignore[arg-type]
                                           tool_choice="none", max_tokens=24, temperature=0).choices[0].message
    assert third.content
    calls = check_token_in(gateway, proxy, rollout)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls[1]["answer"]["tool_calls"]] == [
        (call.function.name, json.loads(call.function.arguments))]
    assert "grammar" in proxy.completions()[0] and "grammar" not in proxy.completions()[1]

    # an edited history falls back to chat and says so
    edited = [messages[0], {"role": "user", "content": "Say hi."}, *messages[2:]]
    before = len(proxy.completions())
    client.chat.completions.create(model="smollm2", messages=edited, tools=TOKEN_IN_TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                   max_tokens=8, temperature=0)
    snap = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin, timeout=30).json()
    assert snap["calls"][-1]["token_in"]["status"] == "skipped: history_edited"
    assert len(proxy.completions()) == before and proxy.requests[-1][0] in ("/tokenize", "/v1/chat/completions")


@pytest.mark.parametrize("mode", MODES)
def test_token_in_messages_three_turns(
    llama_url: str, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, mode: str,
) -> None:
    """The same through Anthropic Messages (tool_use / tool_result); a compacted history
    (the conversation replaced by a summary) falls back and says so."""
    import secrets

    import anthropic

    gateway, proxy = token_in_gateway(llama_url, server_loop, simulator, tmp_path_factory, mode)
    rollout = "llama-ti-" + secrets.token_hex(4)
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key="unused-key-0123456789abcdef",
                                 _strict_response_validation=True, max_retries=0, timeout=600)
    tools = [{"name": "get_weather", "description": "Get the weather for a city",
              "input_schema": TOKEN_IN_TOOLS[0]["function"]["parameters"]}]
    system = "You are a helpful assistant."
    messages: list[dict] = [{"role": "user", "content": "Say hello in one short sentence."}]
    first = client.messages.create(model="smollm2", system=system, messages=messages, tools=tools,  # type: ignore[arg-type]
                                   tool_choice={"type": "none"}, max_tokens=24, extra_body={"temperature": 0})
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]
    with client.messages.stream(model="smollm2", system=system, messages=messages, tools=tools,  # type: ignore[arg-type]
                                tool_choice={"type": "any"}, max_tokens=64, extra_body={"temperature": 0}) as s:
        second = s.get_final_message()
    assert second.stop_reason == "tool_use"
    [use] = [b for b in second.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]}]
    with client.messages.stream(model="smollm2", system=system, messages=messages, tools=tools,  # type: ignore[arg-type]
                                tool_choice={"type": "none"}, max_tokens=24, extra_body={"temperature": 0}) as s:
        third = s.get_final_message()
    assert third.content and third.content[0].type == "text"
    check_token_in(gateway, proxy, rollout)

    compacted = [{"role": "user", "content": "Summary: the user asked for the weather in Paris; it is 18 C. Say thanks."}]
    client.messages.create(model="smollm2", system=system, messages=compacted, tools=tools,  # type: ignore[arg-type]
                           tool_choice={"type": "none"}, max_tokens=8, extra_body={"temperature": 0})
    snap = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin, timeout=30).json()
    assert snap["calls"][-1]["token_in"]["status"] == "skipped: history_truncated"
    assert len(proxy.completions()) == 2
