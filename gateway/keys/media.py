"""The input a key's reservation holds for media parts (pure: no I/O).

The byte bound of the input (a token is at least one byte) holds for text, and for media
sent inline whose token cost is below its bytes (base64 audio, files); it does not hold
for an image, whose cost is set by its pixels (OpenAI: 85 + 170 per 512-pixel tile;
Anthropic: width x height / 750), however few bytes its URL or data has: 100 tiny images
in 7.5 KB of JSON cost 76,525 tokens upstream. So each media part of the upstream body
is reserved at a per-item estimate (:data:`MEDIA_TOKENS`; an image instead of its URL's
bytes, the others on top of theirs) and the request is settled to the upstream's usage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gateway.protocols.tokens import IMAGE_TOKENS

#: Tokens reserved per content part of each kind (docs/keys.md gives each one's error bound).
MEDIA_TOKENS: dict[str, int] = {
    "image_url": IMAGE_TOKENS,  # 1,600: OpenAI high detail <= 1,445 (gpt-4o), Anthropic <= ~1,600
    "input_audio": 0,  # inline base64: its bytes are more than its tokens (~10 per second)
    "audio_url": 1_600,  # by reference (vLLM): ~2.7 minutes at Whisper-style 10 tokens per second
    "video_url": 16_384,  # by reference (vLLM): a Qwen2.5-VL video at its default pixel budget
    "file": 4_096,  # a document (PDF): its text plus page images, on top of any inline bytes
}


def media_parts(messages: Any) -> Iterator[dict[str, Any]]:
    """The non-text content parts of a chat body's messages."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in MEDIA_TOKENS:
                    yield part


def _url_bytes(part: dict[str, Any]) -> int:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    return len(url.encode("utf-8", "surrogatepass")) if isinstance(url, str) else 0


def media_adjustment(messages: Any) -> int:
    """What to add to the byte bound of ``messages`` for their media parts (negative when
    inline images are larger than their estimate)."""
    total = 0
    for part in media_parts(messages):
        kind = part["type"]
        total += MEDIA_TOKENS[kind] - (_url_bytes(part) if kind == "image_url" else 0)
    return total
