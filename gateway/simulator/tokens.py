"""The simulator's vLLM token fields (``return_token_ids``, ``logprobs``), from a
deterministic tokenizer and chat template, so rollout tests know every id exactly.

Tokenizer: one token per character (``id = ord(ch)``), plus special tokens above the
Unicode range for the template. Template: each message is ``<role> content <end>``; an
assistant message renders its reasoning (when the client sent it back), its content, then
each tool call's arguments (re-serialised the way the simulator writes them), and
consecutive assistant messages render as one; the prompt ends with ``<assistant>`` (the
generation prompt). So an append-only conversation is token-append-only: the next
prompt starts with the previous prompt plus exactly the sampled completion ids.

``;tokens=drift`` in the model string samples text as two-character tokens instead
(a BPE re-split): the re-rendered history then differs from what was sampled, right
where the assistant's answer begins.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any

Frame = dict[str, Any]

#: Special tokens, above every Unicode code point.
END = 0x110000
ROLES = {"system": 0x110001, "developer": 0x110001, "user": 0x110002, "assistant": 0x110003, "tool": 0x110004}
TOOLS = 0x110005
DRIFT_BASE = 0x120000


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chars(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def canonical_arguments(arguments: Any) -> str:
    """Tool arguments as the simulator writes them (``json.dumps`` defaults), whatever
    spacing the client re-serialised them with."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
    else:
        parsed = arguments
    return json.dumps(parsed)


def _assistant_ids(message: Mapping[str, Any]) -> list[int]:
    ids: list[int] = []
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str):
            ids += chars(message[key])
    ids += chars(_text_of(message.get("content")))
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            ids += chars(canonical_arguments((call.get("function") or {}).get("arguments") or ""))
    return ids


def prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """The request's messages (and declared tool names) through the template, ending
    with the generation prompt."""
    ids: list[int] = []
    tools = [t.get("function", {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
    if tools:
        ids += [TOOLS, *chars(",".join(str(n) for n in tools)), END]
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    i = 0
    while i < len(messages):
        role = str(messages[i].get("role"))
        ids.append(ROLES.get(role, ROLES["user"]))
        if role == "assistant":
            while i < len(messages) and messages[i].get("role") == "assistant":
                ids += _assistant_ids(messages[i])
                i += 1
        else:
            ids += chars(_text_of(messages[i].get("content")))
            i += 1
        ids.append(END)
    return ids + [ROLES["assistant"]]


def _piece(delta: Mapping[str, Any]) -> str:
    text = (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")
    for call in delta.get("tool_calls") or []:
        args = (call.get("function") or {}).get("arguments") or ""
        text += args if isinstance(args, str) else json.dumps(args)
    return text


def sampled(piece: str, drift: bool) -> list[tuple[int, str]]:
    """The (id, token text) pairs a fragment was sampled as."""
    if not drift:
        return [(ord(ch), ch) for ch in piece]
    pairs = [piece[i : i + 2] for i in range(0, len(piece), 2)]
    return [(DRIFT_BASE + zlib.crc32(p.encode()) % 100_000 if len(p) == 2 else ord(p), p) for p in pairs]


def logprob(token: int, position: int) -> float:
    """A deterministic sampled logprob (always < 0)."""
    return -round(((token * 31 + position) % 97 + 1) / 100, 4)


#: MoE routing the simulator reports: layers, experts chosen per token per layer, experts.
EXPERT_LAYERS, EXPERT_TOP_K, EXPERTS = 2, 2, 64


def routed_experts(ids: list[int]) -> str:
    """SGLang's / vLLM's MoE routing for ``ids`` (prompt then completion): base64 of an
    int32 array [tokens, layers, top_k], little-endian; deterministic per token id."""
    values = [(tid * 7 + layer * 3 + k) % EXPERTS for tid in ids for layer in range(EXPERT_LAYERS)
              for k in range(EXPERT_TOP_K)]
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def add_token_data(chunks: list[Frame], deltas: list[Mapping[str, Any]], body: Mapping[str, Any]) -> None:
    """What vLLM adds to each streamed chunk when asked: ``logprobs.content`` (one entry
    per sampled token), ``choices[].token_ids`` and, on the first chunk, the top-level
    ``prompt_token_ids``; with ``return_routed_experts`` (SGLang's request field) the
    last chunk's choice carries ``routed_experts`` for the prompt and every sampled token."""
    want_ids = body.get("return_token_ids") is True
    want_logprobs = body.get("logprobs") is True
    if body.get("return_routed_experts") is True and chunks:
        drift = "tokens=drift" in str(body.get("model") or "").replace(" ", "")
        sampled_ids = [tid for delta in deltas for tid, _ in sampled(_piece(delta), drift)]
        chunks[-1]["choices"][0]["routed_experts"] = routed_experts(prompt_ids(body) + sampled_ids)
    if not (want_ids or want_logprobs):
        return
    drift = "tokens=drift" in str(body.get("model") or "").replace(" ", "")
    position = 0
    for n, (chunk, delta) in enumerate(zip(chunks, deltas)):
        tokens = sampled(_piece(delta), drift)
        choice = chunk["choices"][0]
        if want_logprobs and tokens:
            choice["logprobs"] = {"content": [
                {"token": text, "logprob": logprob(tid, position + k), "bytes": list(text.encode()), "top_logprobs": []}
                for k, (tid, text) in enumerate(tokens)
            ]}
        if want_ids:
            choice["token_ids"] = [tid for tid, _ in tokens]
            if n == 0:
                chunk["prompt_token_ids"] = prompt_ids(body)
        position += len(tokens)
