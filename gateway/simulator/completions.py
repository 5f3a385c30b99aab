"""The simulator's text completions (``/v1/completions``) and embeddings (``/v1/embeddings``):
pure functions from a request body to the answer an OpenAI-compatible server (vLLM,
llama.cpp) gives, deterministic so tests can assert them exactly. The HTTP shell is
:mod:`gateway.simulator.server`.

A completion continues each prompt with ``" -> <first words of the prompt>"`` (token ids
as prompts are echoed back as ``tok<N>`` words), word by word, at most ``max_tokens``
words (then ``finish_reason: "length"``); ``echo`` puts the prompt first, ``suffix`` last;
``logprobs: N`` adds the legacy logprobs object (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``). An embedding is ``dimensions`` (default 8) floats
derived from the input's bytes; ``encoding_format: "base64"`` packs them as little-endian
float32, as OpenAI does. The model ``server_error`` answers 500 (failover tests).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

from gateway.simulator.tokens import routed_experts

COMPLETION_MODEL_ERROR = "server_error"


def _prompts(value: Any) -> list[str]:
    """Each prompt as text (a list of token ids reads as ``tok<N>`` words)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [" ".join(f"tok{v}" for v in value)]
    if isinstance(value, list):
        return [p if isinstance(p, str) else " ".join(f"tok{v}" for v in p) for p in value]
    return [""]


def _words(prompt: str, max_tokens: int) -> tuple[list[str], str]:
    """The continuation's words (each a token here) and its finish reason."""
    words = [" ->"] + [" " + w for w in prompt.split()[:6]] + ["."]
    if len(words) > max_tokens:
        return words[:max_tokens], "length"
    return words, "stop"


def _logprobs(words: list[str], start: int, top: int) -> dict[str, Any]:
    offsets, at = [], start
    for w in words:
        offsets.append(at)
        at += len(w)
    values = [round(-0.05 * (i + 1), 4) for i in range(len(words))]
    return {
        "tokens": words,
        "token_logprobs": values,
        "top_logprobs": [{w: v} for w, v in zip(words, values)] if top else None,
        "text_offset": offsets,
    }


def completion_choices(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One choice per prompt (``n`` choices each), as the non-streamed answer lists them."""
    max_tokens = int(body.get("max_tokens") or 16)
    top = int(body.get("logprobs") or 0)
    choices = []
    for prompt in _prompts(body.get("prompt")):
        for _ in range(int(body.get("n") or 1)):
            words, finish = _words(prompt, max_tokens)
            head = prompt if body.get("echo") else ""
            tail = str(body.get("suffix") or "")
            choice: dict[str, Any] = {
                "index": len(choices), "text": head + "".join(words) + tail, "finish_reason": finish,
                "logprobs": _logprobs(words, len(head), top) if body.get("logprobs") is not None else None,
            }
            if body.get("return_routed_experts") is True:  # SGLang's MoE routing, per choice
                choice["routed_experts"] = routed_experts([ord(ch) for ch in prompt + "".join(words)])
            choice["_words"] = words
            choices.append(choice)
    return choices


def _usage(body: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(len(p.split()) for p in _prompts(body.get("prompt")))
    completion = sum(len(c["_words"]) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_answer(body: dict[str, Any], answer_id: str, created: int) -> dict[str, Any]:
    """The ``text_completion`` object of a non-streamed request."""
    choices = completion_choices(body)
    usage = _usage(body, choices)
    for c in choices:
        del c["_words"]
    return {"id": answer_id, "object": "text_completion", "created": created, "model": body.get("model"),
            "choices": choices, "usage": usage}


def completion_chunks(body: dict[str, Any], answer_id: str, created: int) -> list[dict[str, Any]]:
    """The stream of a streamed request: one chunk per word per choice, a finish chunk per
    choice, then the usage chunk when ``stream_options.include_usage``."""
    choices = completion_choices(body)
    frame = {"id": answer_id, "object": "text_completion", "created": created, "model": body.get("model")}
    chunks: list[dict[str, Any]] = []
    for c in choices:
        pieces = ([body["prompt"]] if body.get("echo") and isinstance(body.get("prompt"), str) else []) + c["_words"]
        for n, word in enumerate(pieces):
            lp = _logprobs([word], 0, int(body.get("logprobs") or 0)) if body.get("logprobs") is not None else None
            chunks.append({**frame, "choices": [{"index": c["index"], "text": word, "finish_reason": None, "logprobs": lp}]})
        if body.get("suffix"):
            chunks.append({**frame, "choices": [{"index": c["index"], "text": str(body["suffix"]), "finish_reason": None, "logprobs": None}]})
        finish = {"index": c["index"], "text": "", "finish_reason": c["finish_reason"], "logprobs": None}
        if "routed_experts" in c:
            finish["routed_experts"] = c["routed_experts"]
        chunks.append({**frame, "choices": [finish]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**frame, "choices": [], "usage": _usage(body, choices)})
    return chunks


def embedding_vector(text: str, dimensions: int) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((digest[i % len(digest)] - 128) / 128, 6) for i in range(dimensions)]


def embeddings_answer(body: dict[str, Any]) -> dict[str, Any]:
    """The ``list`` of embeddings for ``input`` (a text, texts, or token ids)."""
    dimensions = int(body.get("dimensions") or 8)
    texts = _prompts(body.get("input"))
    data = []
    for index, text in enumerate(texts):
        vector: Any = embedding_vector(text, dimensions)
        if body.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(len(t.split()) for t in texts)
    return {"object": "list", "data": data, "model": body.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
