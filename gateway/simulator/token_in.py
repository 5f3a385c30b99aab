"""The simulator's vLLM token-in endpoints, pure: ``/tokenize`` (a chat request through
:mod:`gateway.simulator.tokens`' template, or a text) and ``/v1/completions`` with a
token-id ``prompt`` and ``return_token_ids`` (docs/capture.md, token-in continuation).

A token-id prompt is read back through the template into messages (roles, texts, the
declared tool names), the chat scenario named by ``model`` answers them, and the answer is
sampled as raw text the way a Hermes / Qwen model writes it: reasoning in
``<think>...</think>``, then the text, then each tool call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; one token per character,
then the end-of-turn token (``END``, text ``""``), which vLLM reports among the sampled
ids. ``max_tokens`` cuts it (``finish_reason: "length"``, no end token).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.simulator import tokens as sim_tokens
from gateway.simulator.scenarios import assemble_completion, build_plan

_ROLE_OF = {v: k for k, v in reversed(sim_tokens.ROLES.items())}  # "system" over "developer"
CHUNK_TOKENS = 7


def is_token_in(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    return (body.get("return_token_ids") is True and isinstance(prompt, list) and bool(prompt)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def tokenize(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/tokenize``: ``messages`` (+ ``tools``, ``add_generation_prompt``) through
    the chat template, or a ``prompt`` text one id per character."""
    if isinstance(body.get("messages"), list):
        ids = sim_tokens.prompt_ids(body)
        if body.get("add_generation_prompt") is False:
            ids = ids[:-1]
    else:
        ids = sim_tokens.chars(str(body.get("prompt") or ""))
    return {"count": len(ids), "max_model_len": 1 << 20, "tokens": ids}


def partial_of(ids: list[int]) -> list[int]:
    """The completion ids a prompt ends with after its generation prompt (a continuation:
    prompt ids + the partial answer's ids), else none."""
    last = max((i for i, t in enumerate(ids) if t == sim_tokens.ROLES["assistant"]), default=None)
    if last is None or sim_tokens.END in ids[last + 1 :]:
        return []
    return ids[last + 1 :]


def decode(ids: list[int]) -> dict[str, Any]:
    """A token-id prompt back to the chat body it renders (tool names only)."""
    tools: list[str] = []
    messages: list[dict[str, Any]] = []
    i = 0
    if ids and ids[0] == sim_tokens.TOOLS:
        end = ids.index(sim_tokens.END) if sim_tokens.END in ids else len(ids)
        tools = [n for n in "".join(chr(t) for t in ids[1:end] if t < 0x110000).split(",") if n]
        i = end + 1
    while i < len(ids):
        role = _ROLE_OF.get(ids[i], "user")
        end = ids.index(sim_tokens.END, i + 1) if sim_tokens.END in ids[i + 1 :] else len(ids)
        text = "".join(chr(t) for t in ids[i + 1 : end] if t < 0x110000)
        if end < len(ids):
            messages.append({"role": role, "content": text})
        i = end + 1
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": n}} for n in tools]
    return body


def hermes_text(message: dict[str, Any]) -> str:
    text = ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        text += f"<think>{reasoning}</think>"
    text += message.get("content") or ""
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = function.get("arguments")
        text += "<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments}) + "\n</tool_call>"
    return text


def chat_sampled(message: dict[str, Any]) -> list[tuple[int | None, str]]:
    """The answer as the chat endpoint samples it (sim_tokens: the reasoning, text and
    arguments, one id per character) with its Hermes markup between, as text without ids
    (the chat stream reports none for it)."""
    pieces: list[tuple[int | None, str]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        pieces += [(None, "<think>"), *[(ord(ch), ch) for ch in reasoning], (None, "</think>")]
    pieces += [(ord(ch), ch) for ch in message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        pieces.append((None, '<tool_call>\n{"name": ' + json.dumps(function.get("name")) + ', "arguments": '))
        pieces += [(ord(ch), ch) for ch in function.get("arguments") or ""]
        pieces.append((None, "}\n</tool_call>"))
    return pieces


def continued(message: dict[str, Any], partial: list[int]) -> list[tuple[int | None, str]] | None:
    """What follows ``partial`` (the chat-sampled ids of a cut answer) in ``message``:
    the rest of its pieces (None: the partial is not how this answer begins)."""
    pieces = chat_sampled(message)
    said = 0
    for at, (tid, _) in enumerate(pieces):
        if said == len(partial):
            return pieces[at:]
        if tid is not None:
            if tid != partial[said]:
                return None
            said += 1
    return [] if said == len(partial) else None


def completion_chunks(body: dict[str, Any], answer_id: str, created: int) -> list[dict[str, Any]]:
    """The streamed answer to a token-in ``/v1/completions`` request (usage last when
    ``stream_options.include_usage``). A prompt that ends inside the assistant's answer
    (a continuation after an abort) gets the rest of that answer as the chat endpoint
    samples it (:func:`continued`): exactly the ids an uncut chat stream has."""
    prompt = [int(t) for t in body["prompt"]]
    model = str(body.get("model") or "echo")
    partial = partial_of(prompt)
    chat = {**decode(prompt[: len(prompt) - len(partial)]), "model": model, "stream": True}
    folded = assemble_completion(build_plan(model, chat).frames, model)
    message = folded["choices"][0]["message"]
    rest = continued(message, partial) if partial else None
    whole = [(ord(ch), ch) for ch in hermes_text(message)]
    if partial and rest is None and [tid for tid, _ in whole[: len(partial)]] == partial:
        rest = list(whole[len(partial) :])  # a token-in answer cut: its own ids go on
    if rest is not None:
        sampled: list[tuple[int | None, str]] = [*rest, (sim_tokens.END, "")]
    else:
        text = hermes_text(folded["choices"][0]["message"])
        sampled = [(ord(ch), ch) for ch in text] + [(sim_tokens.END, "")]
    finish = "stop"
    limit = body.get("max_tokens")
    if isinstance(limit, int) and len(sampled) > limit:
        sampled, finish = sampled[:limit], "length"
    logprobs = body.get("logprobs")
    ids_of = [tid for tid, _ in sampled if tid is not None]
    chunks: list[dict[str, Any]] = []
    for start in range(0, len(sampled), CHUNK_TOKENS):
        piece = sampled[start : start + CHUNK_TOKENS]
        ids = [(tid, t) for tid, t in piece if tid is not None]
        choice: dict[str, Any] = {"index": 0, "text": "".join(t for _, t in piece), "finish_reason": None,
                                  "token_ids": [tid for tid, _ in ids]}
        if logprobs is not None:
            choice["logprobs"] = {"tokens": [t for _, t in ids],
                                  "token_logprobs": [sim_tokens.logprob(tid, start + k) for k, (tid, _) in enumerate(ids)],
                                  "top_logprobs": None, "text_offset": []}
        if start == 0:
            choice["prompt_token_ids"] = prompt
        chunks.append({"id": answer_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice]})
    chunks[-1]["choices"][0]["finish_reason"] = finish
    if body.get("return_routed_experts") is True:  # as on the chat endpoint: the prompt and every sampled id
        chunks[-1]["choices"][0]["routed_experts"] = sim_tokens.routed_experts(prompt + ids_of)
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({"id": answer_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                       "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids_of),
                                 "total_tokens": len(prompt) + len(ids_of)}})
    return chunks
