"""An upstream answer that comes as one JSON body instead of a stream, read and reshaped.

Two cases reach it: a buffered request (``--upstream-stream never``, or ``auto`` after
the upstream refused to stream), and a 200 whose body is not ``text/event-stream`` (a
server that ignored ``stream: true``). :func:`completion_as_chunks` turns such an answer
into the stream chunks it is equivalent to, so the rest of the gateway cannot tell.
The reads here are unbounded on their own: :mod:`gateway.upstream.client` bounds them.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from gateway.errors import GatewayError
from gateway.redact import SECRETS

#: How much of a 200 body that is not a stream is read to find out what it says.
NON_STREAM_MAX_BYTES = 4 * 1024 * 1024


def is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").partition(";")[0].strip().lower() == "text/event-stream"


async def read_capped(response: httpx.Response) -> bytes:
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > NON_STREAM_MAX_BYTES:
            break
    return bytes(body)


async def read_json_answer(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = orjson.loads(await response.aread())
    except orjson.JSONDecodeError:
        raise GatewayError("upstream", "upstream_bad_frame", "the upstream answer is not JSON") from None
    if not isinstance(answer, dict):
        raise GatewayError("upstream", "upstream_bad_frame", "the upstream answer is not a JSON object")
    if answer.get("error"):
        return {"error": SECRETS.mask_value(answer["error"])}
    return answer


def completion_as_chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streaming ``chat.completion`` as the stream chunks it is equivalent to, so the
    accumulator, the modes and the encoders treat a buffered answer like any other."""
    if answer.get("error"):
        return [answer]
    chunks: list[dict[str, Any]] = []
    for choice in answer.get("choices") or ():
        message = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant"}
        for key in ("content", "reasoning_content", "reasoning", "refusal"):
            if message.get(key):
                delta[key] = message[key]
        calls = message.get("tool_calls") or []
        if calls:
            delta["tool_calls"] = [
                {"index": i, "id": c.get("id"), "type": "function",
                 "function": {"name": (c.get("function") or {}).get("name"),
                              "arguments": (c.get("function") or {}).get("arguments") or ""}}
                for i, c in enumerate(calls)
            ]
        elif isinstance(message.get("function_call"), dict):
            # the legacy shape alone (beside tool_calls it is the same call again, and
            # llama-cpp-python may even misspell its name there): the accumulator's rule
            delta["function_call"] = message["function_call"]
        out: dict[str, Any] = {"index": choice.get("index", 0), "delta": delta,
                               "finish_reason": choice.get("finish_reason")}
        for key in ("logprobs", "token_ids", "routed_experts"):
            if choice.get(key) is not None:
                out[key] = choice[key]
        chunk: dict[str, Any] = {"choices": [out]}
        for key in ("prompt_token_ids", "routed_experts"):
            if answer.get(key) is not None:
                chunk[key] = answer[key]
        chunks.append(chunk)
    if answer.get("usage"):
        chunks.append({"choices": [], "usage": answer["usage"]})
    return chunks
