"""Token estimates for requests the gateway translated, with the o200k_base BPE.

The upstream's own tokenizer is unknown, so the Messages room estimates with OpenAI's
o200k_base (``bpe-openai`` ships its tables inside the wheel: no download). It counts
what the upstream will actually read: every message's text (system, user, assistant,
tool), assistant reasoning and tool-call names/arguments, and the JSON of the tool
schemas — never base64 image payloads, which count a flat :data:`IMAGE_TOKENS` each.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import orjson

from gateway.stream.events import Completion, Usage

#: Per message: role and separators, as OpenAI's chat format spends them.
MESSAGE_OVERHEAD = 3
#: Once per request: the assistant reply's priming.
REPLY_PRIMING = 3
#: One image, whatever its size (its pixels are unknown to the gateway).
IMAGE_TOKENS = 1600


@lru_cache(maxsize=1)
def _tables() -> Any:
    # imported on first use: the tables cost ~140 MiB of RSS and 2-4 s of CPU to load, which
    # a gateway that never counts should not carry
    import bpe_openai

    return bpe_openai.get_encoding("o200k_base")


_LOADING = threading.Lock()  # one load at a time: two threads would each build the tables


def _encoding() -> Any:
    if _tables.cache_info().currsize:
        return _tables()
    with _LOADING:
        return _tables()


def tokenizer_loaded() -> bool:
    """True once the tables are in memory (loading them takes seconds: a caller on the
    event loop awaits :func:`tokenizer_ready` first)."""
    return _tables.cache_info().currsize > 0


def load_tokenizer() -> None:
    """Blocking: load the tables (once)."""
    _encoding()


async def tokenizer_ready() -> None:
    """The tables loaded, in a worker thread when they are not yet: the first count on the
    loop (a ``count_tokens``, an answer without usage) froze it for 2-4 s while they loaded."""
    if not tokenizer_loaded():
        await asyncio.to_thread(load_tokenizer)


#: Characters fed to the tokenizer at once: it refuses 1 M characters and 200 k tokens a
#: call, and one character can be up to four byte-tokens.
PIECE_CHARS = 40_000
#: Characters counted exactly per string (2 Mi: ~0.15 s of CPU for prose); beyond, the rest
#: is estimated at the counted part's rate, so no string costs seconds of counting.
EXACT_CHARS = 2 * 1024 * 1024


def _pieces(text: str) -> list[str]:
    """``text`` cut into tokenizer-sized pieces, at whitespace where there is some (a cut
    inside a word adds at most a token or two to the count)."""
    pieces = []
    start = 0
    while len(text) - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        space = text.rfind(" ", start + PIECE_CHARS // 2, end)
        end = space if space > start else end
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def count_text(text: str) -> int:
    """Tokens of one string (special-token text counted as ordinary text), of any length."""
    if not text:
        return 0
    encoding = _encoding()
    if len(text) <= PIECE_CHARS:
        return len(encoding.encode_ordinary(text))
    head = text[:EXACT_CHARS]
    tokens = sum(len(encoding.encode_ordinary(piece)) for piece in _pieces(head))
    rest = len(text) - len(head)
    return tokens + (rest * tokens + len(head) - 1) // len(head) if rest else tokens


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return count_text(content)
    total = 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url":
                total += IMAGE_TOKENS
            elif isinstance(part.get("text"), str):
                total += count_text(part["text"])
    return total


def count_chat_tokens(body: dict[str, Any]) -> int:
    """Estimated prompt tokens of an upstream Chat Completions body."""
    total = REPLY_PRIMING
    for message in body.get("messages") or ():
        total += MESSAGE_OVERHEAD + count_text(str(message.get("role", "")))
        total += _content_tokens(message.get("content"))
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            total += count_text(reasoning)
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            total += count_text(function.get("name") or "") + count_text(
                function.get("arguments") or ""
            )
    for tool in body.get("tools") or ():
        total += count_text(orjson.dumps(tool).decode())
    return total


def quick_token_estimate(body: dict[str, Any]) -> int:
    """A cheap stand-in for :func:`count_chat_tokens` (UTF-8 bytes of the messages and
    tools, four to a token): for ``message_start``, before the upstream's real count."""
    size = len(orjson.dumps(body.get("messages") or [])) + len(orjson.dumps(body.get("tools") or []))
    return size // 4 + 1


def usage_estimator(body: dict[str, Any]) -> Callable[[Completion], Usage]:
    """The one rule for every room when the upstream reports no usage at all: prompt
    tokens are :func:`count_chat_tokens` of the body sent upstream, completion tokens
    the o200k count of the answer's reasoning, text and tool arguments (reasoning tokens
    of its reasoning). Zeros the upstream did report are kept as reported."""

    def estimate(completion: Completion) -> Usage:
        reasoning = count_text(completion.reasoning)
        output = reasoning + count_text(completion.text) + sum(count_text(c.arguments) for c in completion.tool_calls)
        prompt = count_chat_tokens(body)
        return Usage(prompt_tokens=prompt, completion_tokens=output, total_tokens=prompt + output,
                     reasoning_tokens=reasoning, estimated=True)

    return estimate
