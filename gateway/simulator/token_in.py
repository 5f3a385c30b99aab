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


def completion_chunks(body: dict[str, Any], answer_id: str, created: int) -> list[dict[str, Any]]:
    """The streamed answer to a token-in ``/v1/completions`` request (usage last when
    ``stream_options.include_usage``)."""
    prompt = [int(t) for t in body["prompt"]]
    model = str(body.get("model") or "echo")
    chat = {**decode(prompt), "model": model, "stream": True}
    folded = assemble_completion(build_plan(model, chat).frames, model)
    text = hermes_text(folded["choices"][0]["message"])
    sampled: list[tuple[int, str]] = [(ord(ch), ch) for ch in text] + [(sim_tokens.END, "")]
    finish = "stop"
    limit = body.get("max_tokens")
    if isinstance(limit, int) and len(sampled) > limit:
        sampled, finish = sampled[:limit], "length"
    logprobs = body.get("logprobs")
    chunks: list[dict[str, Any]] = []
    for start in range(0, len(sampled), CHUNK_TOKENS):
        piece = sampled[start : start + CHUNK_TOKENS]
        choice: dict[str, Any] = {"index": 0, "text": "".join(t for _, t in piece), "finish_reason": None,
                                  "token_ids": [tid for tid, _ in piece]}
        if logprobs is not None:
            choice["logprobs"] = {"tokens": [t for _, t in piece],
                                  "token_logprobs": [sim_tokens.logprob(tid, start + k) for k, (tid, _) in enumerate(piece)],
                                  "top_logprobs": None, "text_offset": []}
        if start == 0:
            choice["prompt_token_ids"] = prompt
        chunks.append({"id": answer_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice]})
    chunks[-1]["choices"][0]["finish_reason"] = finish
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({"id": answer_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                       "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sampled),
                                 "total_tokens": len(prompt) + len(sampled)}})
    return chunks
