"""Token-in continuation (issue #27, docs/capture.md): one upstream attempt that sends the
engine a token-id prompt and yields the same canonical Chat Completions chunks as a chat
attempt, so the accumulator, both stream modes and every encoder work unchanged.

- :class:`EngineStream` (pure): the engine's completion chunks (vLLM ``/v1/completions``,
  llama.cpp ``/completion``) -> chat chunks: text through :class:`~gateway.upstream.hermes.HermesParser`
  (text, Hermes tool calls), the sampled ids and logprobs as vLLM's chat fields
  (``choices[].token_ids``, ``logprobs.content[]`` with each ``id``), the prompt ids sent
  as ``prompt_token_ids``, a finish and a usage chunk.
- :func:`engine_body` (pure): the chat body's sampling fields for the engine's endpoint.
- :class:`TokenIn` (the I/O shell): per request, the plan from
  :func:`gateway.rollout.chain.continuation`; at the attempt, the engine's rendering of
  the new messages (vLLM ``/tokenize``; llama.cpp ``/apply-template`` + ``/tokenize``),
  the splice, then the engine's own stream. Anything that does not fit (the upstream has
  no ``token_in``, the plan says skipped, a regeneration body, a rendering that fails or
  is not append-only) goes the chat way, and :attr:`TokenIn.status` says why.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import structlog

from gateway.engines.seam import CutTail
from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.rollout.chain import TokenInPlan, splice
from gateway.stream.events import routed_experts_of
from gateway.upstream.client import ANSWERED, DONE, UpstreamClient, UpstreamItem
from gateway.upstream.credential import Credential
from gateway.upstream.hermes import HermesParser

log = structlog.get_logger("gateway.token_in")

ENGINES = ("vllm", "llamacpp")

#: chat body field -> (vLLM /v1/completions field, llama.cpp /completion field)
_SAMPLING = {
    "max_tokens": ("max_tokens", "n_predict"), "max_completion_tokens": ("max_tokens", "n_predict"),
    "temperature": ("temperature", "temperature"), "top_p": ("top_p", "top_p"), "top_k": ("top_k", "top_k"),
    "min_p": ("min_p", "min_p"), "seed": ("seed", "seed"), "stop": ("stop", "stop"),
    "presence_penalty": ("presence_penalty", "presence_penalty"),
    "frequency_penalty": ("frequency_penalty", "frequency_penalty"),
    "repetition_penalty": ("repetition_penalty", "repeat_penalty"),
    "stop_token_ids": ("stop_token_ids", None), "logit_bias": ("logit_bias", "logit_bias"),
}


_JSON_RULES = r"""
object ::= "{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* )? ws "}"
value ::= object | array | string | number | "true" | "false" | "null"
array ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws ::= " "?
"""


def required_call_grammar(body: dict[str, Any]) -> str | None:
    """llama.cpp's GBNF for a chat ``tool_choice`` that requires a call (``required``, or
    an object naming the function): one Hermes ``<tool_call>`` of a declared tool, as
    llama-server's own chat endpoint constrains it. None when no call is required."""
    choice = body.get("tool_choice")
    names = [str((t.get("function") or {}).get("name")) for t in body.get("tools") or []
             if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        names = [choice["function"]["name"]]
    elif choice != "required":
        return None
    if not names:
        return None
    alternatives = " | ".join(json.dumps(json.dumps(n)[1:-1]) for n in names)
    return ('root ::= "<tool_call>\\n{\\"name\\": \\"" name "\\", \\"arguments\\": " object "}\\n</tool_call>"\n'
            f"name ::= {alternatives}\n" + _JSON_RULES.strip() + "\n")


def engine_body(engine: str, body: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """The engine's token-in request for chat ``body``: the same sampling fields, stop
    sequences and logprobs, the prompt as ids, and (llama.cpp) a required tool call as a
    grammar. (The transport adds ``stream``.)"""
    column = 0 if engine == "vllm" else 1
    out: dict[str, Any] = {"prompt": prompt}
    for field, names in _SAMPLING.items():
        name = names[column]
        if name is not None and body.get(field) is not None and name not in out:
            out[name] = body[field]
    top = body.get("top_logprobs") or 0
    if engine == "vllm":
        out["model"] = body.get("model")
        out.setdefault("max_tokens", None)  # a text completion's default is 16; chat's is the context left
        out["return_token_ids"] = True
        out["logprobs"] = int(top)  # the sampled token's logprob always, plus the top N
        if body.get("return_routed_experts") is not None:  # MoE routing replay (an engine extra)
            out["return_routed_experts"] = body["return_routed_experts"]
    else:
        out["n_probs"] = max(1, int(top))
        out["return_tokens"] = True
        out["cache_prompt"] = True
        grammar = required_call_grammar(body)
        if grammar is not None:
            out["grammar"] = grammar
    return out


def _stop_reason(engine: str, chunk: dict[str, Any]) -> str | None:
    if engine == "vllm":
        choice = (chunk.get("choices") or [{}])[0]
        return choice.get("finish_reason") if isinstance(choice, dict) else None
    if chunk.get("stop") is True:
        return "length" if chunk.get("stop_type") == "limit" else "stop"
    return None


class EngineStream:
    """One engine answer -> canonical chat chunks (pure: ``handle`` per engine chunk,
    ``finish`` at the end of the stream)."""

    def __init__(self, engine: str, prompt: list[int], parser: HermesParser | CutTail | None = None,
                 continued: bool = False) -> None:
        """``parser``: the reader of the engine's text (a continuation's, after a cut);
        ``continued``: an abort leaves what the parser holds in it (the next leg goes on
        from it), not flushed as text."""
        self.engine = engine
        self.continued = continued
        self.prompt = prompt
        self.parser = parser if parser is not None else HermesParser()
        self.finished = False
        self._first = True
        self._completion_tokens = 0
        self._usage: dict[str, Any] | None = None

    def _chunk(self, delta: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None, **(extra or {})}
        chunk: dict[str, Any] = {"choices": [choice]}
        if self._first:
            self._first = False
            choice["delta"] = {"role": "assistant", **delta}
            chunk["prompt_token_ids"] = list(self.prompt)
        return chunk

    def handle(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self.finished:
            return []
        if chunk.get("error"):
            return [chunk]
        if self.engine == "vllm":
            if chunk.get("usage"):
                self._usage = chunk["usage"]
            choices = chunk.get("choices") or []
            choice = choices[0] if choices and isinstance(choices[0], dict) else {}
            text = choice.get("text") or ""
            ids = [int(i) for i in choice.get("token_ids") or []]
            legacy = choice.get("logprobs") or {}
            tokens = legacy.get("tokens") or []
            values = legacy.get("token_logprobs") or []
            experts = routed_experts_of(chunk, choice)
            entries = [{"id": tid, "token": tokens[k] if k < len(tokens) else "",
                        "logprob": values[k] if k < len(values) else None,
                        "bytes": list(str(tokens[k] if k < len(tokens) else "").encode()), "top_logprobs": []}
                       for k, tid in enumerate(ids)]
        else:
            experts = None
            text = chunk.get("content") or ""
            ids = [int(i) for i in chunk.get("tokens") or []]
            probs = chunk.get("completion_probabilities") or []
            entries = []
            for k, tid in enumerate(ids):
                p = probs[k] if k < len(probs) and isinstance(probs[k], dict) else {}
                lp = p.get("logprob")
                if lp is None and isinstance(p.get("prob"), (int, float)) and p["prob"] > 0:
                    lp = math.log(p["prob"])
                entries.append({"id": tid, "token": p.get("token", ""), "logprob": lp,
                                "bytes": p.get("bytes") or list(str(p.get("token", "")).encode()),
                                "top_logprobs": [{"token": t.get("token", ""), "logprob": t.get("logprob")}
                                                 for t in p.get("top_logprobs") or [] if isinstance(t, dict)]})
            if chunk.get("stop") is True:
                self._usage = {"prompt_tokens": chunk.get("tokens_evaluated", len(self.prompt)),
                               "completion_tokens": chunk.get("tokens_predicted", self._completion_tokens + len(ids))}
        self._completion_tokens += len(ids)
        out: list[dict[str, Any]] = []
        deltas = self.parser.feed(text) if text else []
        extra: dict[str, Any] = {}
        if ids:
            extra = {"token_ids": ids, "logprobs": {"content": entries}}
        if experts is not None:  # for the record (TokenData); never a client's
            extra["routed_experts"] = experts
        if extra or self._first:
            out.append(self._chunk(deltas.pop(0) if deltas else {}, extra))
        out += [self._chunk(d) for d in deltas]
        reason = _stop_reason(self.engine, chunk)
        if reason is not None:
            out += self.finish(reason)
        return out

    def finish(self, reason: str | None = None) -> list[dict[str, Any]]:
        """The rest of the answer, its finish and usage (once); ``reason`` None: the
        engine stream ended without saying why (the accumulator's judgement then)."""
        if self.finished:
            return []
        self.finished = True
        out = [] if self.continued and reason == "abort" else [self._chunk(d) for d in self.parser.finish()]
        if reason is None:
            return out
        if self.parser.calls and reason == "stop":
            reason = "tool_calls"
        out.append(self._chunk({}, {"finish_reason": reason}))
        usage = self._usage or {}
        prompt_tokens = int(usage.get("prompt_tokens") or len(self.prompt))
        completion_tokens = int(usage.get("completion_tokens") or self._completion_tokens)
        out.append({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                             "total_tokens": prompt_tokens + completion_tokens}})
        return out


async def as_chat_items(items: AsyncIterator[UpstreamItem], stream: EngineStream) -> AsyncIterator[UpstreamItem]:
    """An engine's completion items as chat items: ``ANSWERED`` passes, each chunk goes
    through ``stream``, and its end is flushed also when the engine sends no ``[DONE]``
    (llama.cpp). Used by token-in and by a continuation through token ids."""
    async with contextlib.aclosing(items) as engine_items:  # type: ignore[type-var]
        async for item in engine_items:
            if item is ANSWERED:
                yield item
            elif item is DONE:
                for chunk in stream.finish():
                    yield chunk
                yield DONE
            elif isinstance(item, dict):
                for chunk in stream.handle(item):
                    yield chunk
    for chunk in stream.finish():
        yield chunk


class TokenIn:
    """Per request: the continuation plan, and what became of it (:attr:`status`,
    :attr:`prompt_ids`, the rendering's cost)."""

    def __init__(self, plan: TokenInPlan, body: dict[str, Any], client: UpstreamClient) -> None:
        self.plan = plan
        self.messages = body.get("messages")
        self.client = client
        #: ``used`` | ``skipped: <reason>``; None while no token-in upstream was tried
        self.status: str | None = None
        self.prompt_ids: list[int] | None = None
        self.render_calls = 0
        self.render_ms = 0.0
        #: the last token-in attempt's text reader: an abort leaves a call it had begun in
        #: it, for the continuation (gateway/engines/continuation.py); None after a chat attempt
        self.reader: HermesParser | CutTail | None = None

    def describe(self) -> dict[str, Any] | None:
        if self.status is None:
            return None
        return {"status": self.status, "previous_call_id": self.plan.previous_call_id,
                "render_calls": self.render_calls, "render_ms": round(self.render_ms, 1)}

    async def send(
        self, credential: Credential, body: dict[str, Any], policy: StreamPolicy,
        extra_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[UpstreamItem]:
        """One attempt: token-in when this credential's upstream has it and the plan
        holds, else the chat request."""
        engine = credential.upstream.token_in
        prompt: list[int] | str | None = None
        self.prompt_ids = None  # this attempt's, not an earlier (failed over) one's
        if engine not in ENGINES and self.status is not None:
            self.status = "skipped: chat_upstream"  # failed over to an upstream without token-in
        elif engine in ENGINES:
            if not self.plan.used:
                self.status = self.plan.status
            elif body.get("messages") != self.messages:
                self.status = "skipped: regeneration"
            else:
                prompt = await self._prompt(engine, credential, body, policy)
                self.status = "used" if isinstance(prompt, list) else "skipped: " + str(prompt)
        self.reader = None
        if not isinstance(prompt, list):
            async for item in self.client.stream_chat(credential, body, policy, extra_headers):
                yield item
            return
        self.prompt_ids = prompt
        stream = EngineStream(str(engine), prompt, continued=True)
        self.reader = stream.parser
        path, root = ("/completions", False) if engine == "vllm" else ("/completion", True)
        items = self.client.stream_path(path, root=root)(credential, engine_body(str(engine), body, prompt),
                                                         policy, extra_headers)
        async for item in as_chat_items(items, stream):
            yield item

    async def _prompt(self, engine: str, credential: Credential, body: dict[str, Any], policy: StreamPolicy) -> list[int] | str:
        request: dict[str, Any] = {"messages": list(self.plan.render_messages)}
        for key in ("tools", "tool_choice", "chat_template_kwargs"):
            if key in body and (key != "tool_choice" or engine == "llamacpp"):
                request[key] = body[key]
        started = time.monotonic()
        try:
            if engine == "vllm":
                self.render_calls += 1
                answer = await self.client.post_json(
                    credential, "/tokenize", {"model": body.get("model"), **request, "add_generation_prompt": True},
                    policy, root=True)
                rendered = [int(t) for t in answer["tokens"]]
            else:
                self.render_calls += 1
                templated = await self.client.post_json(credential, "/apply-template", request, policy, root=True)
                self.render_calls += 1
                answer = await self.client.post_json(
                    credential, "/tokenize", {"content": templated["prompt"], "add_special": True, "parse_special": True},
                    policy, root=True)
                rendered = [t if isinstance(t, int) else int(t["id"]) for t in answer["tokens"]]
        except (GatewayError, httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            log.warning("token_in_render_failed", engine=engine, upstream=credential.upstream.name,
                        error=type(exc).__name__)
            return "render_failed"
        finally:
            self.render_ms += (time.monotonic() - started) * 1000
        last = self.plan.prefix_ids[-1] if len(self.plan.prefix_ids) > len(self.plan.previous_prompt) else None
        return splice(self.plan, rendered, last)
