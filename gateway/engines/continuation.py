"""Transparent continuation: a chat answer the engine ended with ``finish_reason: "abort"``
(a weight-update pause, or an abort the gateway was not told about) is continued, not
shown to the client. Once the engine accepts again, the same call goes on: with token ids
(the engine sent ``prompt_token_ids`` and every chunk's ``token_ids``: ``--capture-tokens
vllm``), through the engine's token-in endpoint with the prompt ids plus the completion
ids so far; else through chat with the answer so far as an assistant prefill (vLLM
``continue_final_message: true, add_generation_prompt: false``). What comes back follows
the partial answer, so the client sees one answer (in realtime, the deltas already sent
stay and the continuation follows) — a cut reasoning goes on as reasoning, a cut tool
call's arguments go on in the same call.

The pure parts are :class:`~gateway.engines.partial.PartialAnswer` (what was said) and
:class:`~gateway.engines.seam.CutTail` (the raw text after the cut); ``continuing`` is the
I/O shell around one attempt's send.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.engines.partial import ABORT, MAX_CONTINUATIONS, PartialAnswer
from gateway.engines.seam import CutTail
from gateway.engines.versions import VersionTrail
from gateway.generation.policy import StreamPolicy
from gateway.stream.answer import DONE
from gateway.upstream.client import ANSWERED, Send, UpstreamItem
from gateway.upstream.credential import Credential
from gateway.upstream.hermes import HermesParser
from gateway.upstream.token_in import EngineStream, as_chat_items, engine_body

__all__ = ["ABORT", "MAX_CONTINUATIONS", "PartialAnswer", "continuing", "token_in_body"]

#: What reads a token-in leg's raw text (its state goes on into the next leg).
Reader = HermesParser | CutTail
#: Waits until the credential's engine accepts again (bounded; raises engine_paused): its
#: weight version then, when known.
Resumed = Callable[[Credential, StreamPolicy], Awaitable["str | None"]]


def token_in_body(body: dict[str, Any], prompt: list[int], sampled: int) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` request continuing chat ``body`` from ``prompt`` (the
    prompt ids plus the ``sampled`` completion ids): the same sampling, the token budget
    that is left."""
    out = engine_body("vllm", body, prompt)
    if isinstance(out.get("max_tokens"), int):
        out["max_tokens"] = max(1, out["max_tokens"] - sampled)
    return out


def through_tail(chunk: dict[str, Any], tail: CutTail) -> list[dict[str, Any]]:
    """A chat continuation's chunk with its text read by ``tail`` (a markup prefill): the
    chunk (its token data, no text) then one chunk per delta; the finish last, a tool
    call's ``stop`` as ``tool_calls``."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return [chunk]
    choice = choices[0]
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    finish = choice.get("finish_reason")
    if delta.get("reasoning_content") or delta.get("reasoning"):
        tail.parsed_upstream()
    text = delta.get("content")
    deltas = tail.feed(text) if isinstance(text, str) and text else []
    if finish:
        deltas += tail.finish()
        if finish == "stop" and tail.calls:
            finish = "tool_calls"
    head = {**chunk, "choices": [{**choice, "delta": {k: v for k, v in delta.items() if k != "content"},
                                  "finish_reason": None}]}
    out = [head] + [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    if finish:
        out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    return out


def continuing(send: Send, resumed: Resumed, on_continued: Callable[[], None] | None = None,
               trail: VersionTrail | None = None, token_send: Send | None = None,
               first_reader: Callable[[], Reader | None] | None = None) -> Send:
    """``send`` (a chat attempt) with its aborts continued on the same credential;
    ``trail``: the attempt's weight versions (fed every chunk, told the version a
    continuation runs on); ``token_send``: the engine's ``/completions`` (a continuation
    with token ids goes there); ``first_reader``: the text reader of a first leg that was
    itself token-in (a rollout call's), which the continuation goes on with."""

    async def attempt(credential: Credential, body: dict[str, Any], policy: StreamPolicy,
                      headers: dict[str, str] | None = None) -> AsyncIterator[UpstreamItem]:
        partial = PartialAnswer()
        leg = send(credential, body, policy, headers)
        tail: CutTail | None = None
        token_tail: list[Reader] = []  # the last token-in leg's reader: an abort leaves its state in it
        while True:
            async with contextlib.aclosing(leg) as items:  # type: ignore[type-var]
                async for item in items:
                    if item is ANSWERED or item is DONE:
                        if (item is ANSWERED and not partial.legs) or (item is DONE and not partial.aborted):
                            yield item
                        continue
                    if trail is not None:
                        trail.count(item)  # type: ignore[arg-type]
                    if tail is None:
                        out = partial.feed(item)  # type: ignore[arg-type]
                        if out is not None:
                            yield out
                        continue
                    for chunk in through_tail(item, tail):  # type: ignore[arg-type]
                        out = partial.feed(chunk)
                        if out is not None:
                            yield out
            if not partial.aborted:
                return
            version = await resumed(credential, policy)
            if trail is not None:
                trail.switch(version)
            if not token_tail and not partial.legs and first_reader is not None:
                token_tail[:] = [r for r in (first_reader(),) if r is not None]
            leg, tail = _next_leg(partial, send, token_send, credential, body, policy, headers, token_tail)
            partial.next_leg()
            if on_continued is not None:
                on_continued()

    return attempt  # type: ignore[return-value]


def _next_leg(partial: PartialAnswer, send: Send, token_send: Send | None, credential: Credential,
              body: dict[str, Any], policy: StreamPolicy, headers: dict[str, str] | None,
              token_tail: list[Reader]) -> tuple[AsyncIterator[UpstreamItem], CutTail | None]:
    """The continuation's items, and the reader its chat chunks' text needs (None: none,
    or the token-in leg reads it itself). A token-in leg after a token-in leg goes on
    with that leg's reader (a call it had begun is held there, not yet said)."""
    upstream = getattr(credential, "upstream", None)
    vllm = getattr(upstream, "token_in", None) in (None, "vllm")  # llama.cpp's /completion is not vLLM's: through chat
    prompt = partial.token_prompt() if token_send is not None and vllm else None
    if prompt is not None and token_send is not None:
        sampled = len(prompt) - len(partial.prompt_ids or [])
        request = token_in_body(body, prompt, sampled)
        reader = token_tail[-1] if token_tail else partial.tail()
        token_tail[:] = [reader]
        return _token_in_leg(token_send(credential, request, policy, headers), prompt, reader), None
    tail = partial.tail() if partial.needs_tail() else None
    return send(credential, partial.continuation_body(body), policy, headers), tail


async def _token_in_leg(items: AsyncIterator[UpstreamItem], prompt: list[int],
                        tail: Reader) -> AsyncIterator[UpstreamItem]:
    """The engine's completion chunks as chat chunks (its text read by ``tail``)."""
    stream = EngineStream("vllm", prompt, parser=tail, continued=True)
    async for item in as_chat_items(items, stream):
        yield item
