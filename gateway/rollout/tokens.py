"""Token sources: what to add to the upstream body, and where the ids come back.

- ``vllm``: ``return_token_ids`` + ``logprobs`` in the body; the answer's top-level
  ``prompt_token_ids`` and ``choices[].token_ids`` (per streamed chunk too), logprobs 1:1.
- ``llamacpp`` (llama-server): ``logprobs`` in the body; completion ids are the ``id`` of
  each ``logprobs.content`` entry; prompt ids come from the same server: its
  ``/apply-template`` of the request's messages, then its ``/tokenize`` of that text
  (``add_special`` and ``parse_special`` on, as the server tokenizes a chat prompt).
- ``none``: nothing added; records have ``tokens: null``.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx

from gateway.stream.events import TokenData

TokenSource = Literal["none", "vllm", "llamacpp"]
SOURCES = ("none", "vllm", "llamacpp")
#: Seconds the llama.cpp prompt look-up (two local calls) may take in all.
LLAMACPP_TIMEOUT = 5.0


def with_token_fields(body: dict[str, Any], source: str | None) -> dict[str, Any]:
    """The upstream body asking the engine for token data (the client's own
    ``top_logprobs`` kept; ``logprobs`` on, since a trainer needs them)."""
    if source == "vllm":
        return {**body, "return_token_ids": True, "logprobs": True}
    if source == "llamacpp":
        return {**body, "logprobs": True}
    return body


def tokens_from(data: TokenData | None, source: str | None, prompt_ids: list[int] | None = None) -> dict[str, Any] | None:
    """The record's ``tokens`` (``None`` without a complete set: ids missing, or logprobs
    not one per id)."""
    if data is None or source not in ("vllm", "llamacpp"):
        return None
    logprobs = [e.get("logprob") for e in data.logprobs]
    if source == "vllm":
        prompt, completion = data.prompt_token_ids, data.token_ids
    else:
        ids = [e.get("id") for e in data.logprobs]
        prompt, completion = prompt_ids, ids if all(isinstance(i, int) for i in ids) else None
    if prompt is None or completion is None or len(logprobs) != len(completion):
        return None
    if not all(isinstance(lp, (int, float)) for lp in logprobs):
        return None
    return {"prompt_ids": list(prompt), "completion_ids": list(completion),
            "completion_logprobs": [float(lp) for lp in logprobs]}


def server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port`` (llama-server's own endpoints)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def llamacpp_prompt_ids(
    http: httpx.AsyncClient, base_url: str, api_key: str | None, body: dict[str, Any]
) -> list[int]:
    """The prompt ids llama-server used for ``body``: its template, then its tokenizer."""
    root = server_root(base_url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    request: dict[str, Any] = {"messages": body.get("messages") or []}
    for key in ("tools", "tool_choice", "chat_template_kwargs"):
        if key in body:
            request[key] = body[key]
    templated = await http.post(root + "/apply-template", json=request, headers=headers, timeout=LLAMACPP_TIMEOUT)
    templated.raise_for_status()
    prompt = templated.json()["prompt"]
    tokenized = await http.post(root + "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True},
                                headers=headers, timeout=LLAMACPP_TIMEOUT)
    tokenized.raise_for_status()
    tokens = tokenized.json()["tokens"]
    return [t if isinstance(t, int) else int(t["id"]) for t in tokens]

