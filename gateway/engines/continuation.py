"""Transparent continuation: a chat answer the engine ended with ``finish_reason: "abort"``
(a weight-update pause, or an abort the gateway was not told about) is continued, not
shown to the client. Once the engine accepts again, the same call goes on through chat with
the partial answer as an assistant prefill (vLLM ``continue_final_message: true,
add_generation_prompt: false``); what comes back follows the partial answer, so the client
sees one answer (in realtime, the deltas already sent stay and the continuation follows).

``PartialAnswer`` is the pure part, fed one chunk at a time; ``continue_after_abort`` is
the I/O shell around one attempt's send. Only a text answer is continued: a partial with
reasoning or a tool call (neither can be prefilled through chat) keeps its abort, as
without the gateway.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.engines.versions import VersionTrail
from gateway.generation.policy import StreamPolicy
from gateway.stream.answer import DONE
from gateway.upstream.client import ANSWERED, Send, UpstreamItem
from gateway.upstream.credential import Credential

ABORT = "abort"
#: Continuations of one call at most (each after an abort): a bound on a flapping engine.
MAX_CONTINUATIONS = 8


class PartialAnswer:
    """What one call's engine legs said so far: the text, whether the last leg ended in an
    abort that can be continued, and the usage of the legs before."""

    def __init__(self) -> None:
        self._pieces: list[str] = []  # joined only for a continuation (a str grown by += copied it whole per chunk)
        self.blocked: str | None = None  # why this answer cannot be continued (reasoning, tool_call)
        self.aborted = False  # the current leg ended in an abort that will be continued
        self.legs = 0  # continuations sent so far
        self.earlier_usage: dict[str, Any] | None = None  # the aborted legs' usage, summed

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk to pass on (None: held back): an abort to continue is taken out of its
        chunk; a continuation leg's role and prompt token ids are dropped (the client and
        the record have them from the first leg); its usage counts every leg."""
        if self.aborted:  # after a continued abort: its usage is kept, nothing else passes
            self._keep_usage(chunk.get("usage"))
            return None
        choices = chunk.get("choices") if isinstance(chunk.get("choices"), list) else []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        self._note(delta)
        if choice.get("finish_reason") == ABORT and self.blocked is None and self.legs < MAX_CONTINUATIONS:
            self.aborted = True
            self._keep_usage(chunk.get("usage"))
            if not delta.get("content"):
                return None
            return {**{k: v for k, v in chunk.items() if k != "usage"}, "choices": [{**choice, "finish_reason": None}]}
        if self.legs:
            chunk = self._as_continued(chunk, choice, delta)
        return chunk

    def _note(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self._pieces.append(delta["content"])
        if delta.get("reasoning_content") or delta.get("reasoning"):
            self.blocked = self.blocked or "reasoning"
        if delta.get("tool_calls"):
            self.blocked = self.blocked or "tool_call"

    @property
    def text(self) -> str:
        """The answer's text so far."""
        return "".join(self._pieces)

    def _keep_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.earlier_usage = _summed(self.earlier_usage, usage, keep_prompt=True)

    def _as_continued(self, chunk: dict[str, Any], choice: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
        if "role" in delta:
            out["choices"] = [{**choice, "delta": {k: v for k, v in delta.items() if k != "role"}}]
        if isinstance(chunk.get("usage"), dict) and self.earlier_usage is not None:
            out["usage"] = _summed(self.earlier_usage, chunk["usage"], keep_prompt=True)
        return out

    def continuation_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The next leg's request: the call's own, with the answer so far as an assistant
        prefill the engine continues (a client's own prefill grows by it)."""
        self.aborted, self.legs = False, self.legs + 1
        text = self.text
        if not text:  # nothing said yet: the same request again
            return body
        messages = list(body.get("messages") or [])
        last = messages[-1] if messages and isinstance(messages[-1], dict) else None
        if last is not None and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        return {**body, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}


def _summed(first: dict[str, Any] | None, then: dict[str, Any], keep_prompt: bool) -> dict[str, Any]:
    """Usage over legs: the first leg's prompt, every leg's completion."""
    if first is None:
        return dict(then)
    prompt = first.get("prompt_tokens", 0) if keep_prompt else then.get("prompt_tokens", 0)
    completion = int(first.get("completion_tokens") or 0) + int(then.get("completion_tokens") or 0)
    return {**then, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": int(prompt or 0) + completion}


#: Waits until the credential's engine accepts again (bounded; raises engine_paused): its
#: weight version then, when known.
Resumed = Callable[[Credential, StreamPolicy], Awaitable["str | None"]]


def continuing(send: Send, resumed: Resumed, on_continued: Callable[[], None] | None = None,
               trail: VersionTrail | None = None) -> Send:
    """``send`` (a chat attempt) with its aborts continued on the same credential;
    ``trail``: the attempt's weight versions (fed every chunk, told the version a
    continuation runs on)."""

    async def attempt(credential: Credential, body: dict[str, Any], policy: StreamPolicy,
                      headers: dict[str, str] | None = None) -> AsyncIterator[UpstreamItem]:
        partial = PartialAnswer()
        leg_body = body
        while True:
            async with contextlib.aclosing(send(credential, leg_body, policy, headers)) as items:  # type: ignore[type-var]
                async for item in items:
                    if item is ANSWERED or item is DONE:
                        if (item is ANSWERED and not partial.legs) or (item is DONE and not partial.aborted):
                            yield item
                        continue
                    if trail is not None:
                        trail.count(item)  # type: ignore[arg-type]
                    out = partial.feed(item)  # type: ignore[arg-type]
                    if out is not None:
                        yield out
            if not partial.aborted:
                return
            version = await resumed(credential, policy)
            if trail is not None:
                trail.switch(version)
            leg_body = partial.continuation_body(body)
            if on_continued is not None:
                on_continued()

    return attempt  # type: ignore[return-value]
