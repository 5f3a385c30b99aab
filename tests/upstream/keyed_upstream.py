"""A loopback upstream that takes only the API keys it is given and counts calls per key:
the credential tests' stand-in for a provider whose keys rotate (test_credential_rotation,
test_config_reload). The simulator takes any key, so it cannot show which key was used."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

#: What every answer says, one content delta per word.
WORDS = tuple(f"w{n} " for n in range(8))


class KeyedUpstream:
    """Takes any key in ``keys`` (else 401, on chat and on ``/v1/models``), records each
    chat call's key in ``used``; answers of the model ``slow`` send one word every
    ``delay`` seconds (an answer still streaming while the configuration changes)."""

    def __init__(self, keys: set[str], delay: float = 0.0, words: tuple[str, ...] = WORDS) -> None:
        self.keys, self.delay, self.words = keys, delay, words
        self.used: list[str] = []
        self.url = ""

    def app(self) -> Starlette:
        def key_of(request: Request) -> str | None:
            key = (request.headers.get("authorization") or "").removeprefix("Bearer ")
            return key if key in self.keys else None

        async def chat(request: Request) -> Response:
            body = orjson.loads(await request.body())
            key = key_of(request)
            if key is None:
                return JSONResponse({"error": {"message": "Incorrect API key provided"}}, 401)
            self.used.append(key)
            return StreamingResponse(self._sse(body["model"]), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            if key_of(request) is None:
                return JSONResponse({"error": {"message": "Incorrect API key provided"}}, 401)
            return JSONResponse({"object": "list", "data": [{"id": "alpha", "object": "model"}]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])

    async def _sse(self, model: str) -> AsyncIterator[bytes]:
        base = {"id": "chatcmpl-keyed", "object": "chat.completion.chunk", "created": 1, "model": model}
        first = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
        yield b"data: " + orjson.dumps(base | first) + b"\n\n"
        for word in self.words:
            if self.delay and model == "slow":
                await asyncio.sleep(self.delay)
            chunk = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            yield b"data: " + orjson.dumps(base | chunk) + b"\n\n"
        usage = {"prompt_tokens": 1, "completion_tokens": len(self.words), "total_tokens": len(self.words) + 1}
        for chunk in ({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, {"choices": [], "usage": usage}):
            yield b"data: " + orjson.dumps(base | chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"
