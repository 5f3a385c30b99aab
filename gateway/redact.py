"""The one redaction point: every configured secret, masked in any text the gateway emits.

:data:`SECRETS` holds the live set: each owner (an app's settings, its credential pool, its
admin token) replaces its own share whenever that changes, and the masks apply the union.
The boundaries call it: bytes to clients and the admin API (:class:`RedactingSend`), the
log pipeline (a structlog processor), audit rows, capture records, and upstream error text
as it enters the gateway. One process-wide set because the log pipeline is process-wide;
holding another app's secrets too only ever masks more.

Secrets shorter than :data:`MIN_SECRET_LEN` are not masked (they would mangle ordinary
text); ``settings.py`` validation is the place to refuse such keys, not this.

A streamed answer is masked one delta at a time (:mod:`gateway.stream.masking`): a secret
the upstream split across two deltas must not reach the client in two halves, so
:meth:`SecretSet.held_tail` says how much of a delta's end could be the start of a secret.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MASK = "[redacted]"
_MASK_BYTES = MASK.encode()
MIN_SECRET_LEN = 6
#: Up to this many secrets, a text is first searched for each (cheap); past it, the one
#: pattern alone (one scan, however many secrets: a pool of many client keys).
FEW_SECRETS = 8


@dataclass(frozen=True)
class _Patterns:
    """What the masks use, compiled once per change of the set."""

    text: re.Pattern[str] | None = None
    bytes: re.Pattern[bytes] | None = None
    #: the secrets themselves while they are few: ``in`` (a C substring search) tells most
    #: text holds none faster than the pattern scans it (every client write)
    few_text: tuple[str, ...] | None = ()
    few_bytes: tuple[bytes, ...] | None = ()
    #: a proper prefix of any secret at the end of a text (a trie, so one branch per
    #: position however many secrets), and how far back it may start
    tail: re.Pattern[str] | None = None
    tail_window: int = 0
    long: tuple[str, ...] = ()  # secrets whose prefixes go past the trie's depth

    @classmethod
    def of(cls, secrets: Iterable[str]) -> _Patterns:
        every = sorted(secrets, key=len, reverse=True)  # longest first
        if not every:
            return cls()
        alternatives = "|".join(re.escape(s) for s in every)
        few = len(every) <= FEW_SECRETS
        return cls(
            text=re.compile(alternatives),
            bytes=re.compile(alternatives.encode()),
            few_text=tuple(every) if few else None,
            few_bytes=tuple(e.encode() for e in every) if few else None,
            tail=re.compile(f"(?:{_prefix_trie(every)})\\Z"),
            tail_window=min(max(len(s) for s in every) - 1, TRIE_DEPTH),
            long=tuple(s for s in every if len(s) - 1 > TRIE_DEPTH),
        )


class SecretSet:
    """Secrets by owner, and the patterns over all of them, compiled at the first use after
    a change (a change is cheap: apps stopping one after another, each dropping its share,
    recompiled the whole set each time, hundreds of secrets' trie included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_owner: dict[str, frozenset[str]] = {}
        self._patterns: _Patterns | None = _Patterns()  # None: to compile at the next use

    def set(self, owner: str, secrets: Iterable[str | None]) -> None:
        """Replace ``owner``'s share of the set."""
        share = frozenset(s for s in secrets if s and len(s) >= MIN_SECRET_LEN)
        with self._lock:
            if self._by_owner.get(owner, frozenset()) == share:
                return
            if share:
                self._by_owner[owner] = share
            else:
                self._by_owner.pop(owner, None)
            self._patterns = None

    def drop(self, owner: str) -> None:
        self.set(owner, ())

    def _current(self) -> _Patterns:
        patterns = self._patterns
        if patterns is None:
            with self._lock:
                if self._patterns is None:
                    self._patterns = _Patterns.of(set().union(*self._by_owner.values()))
                patterns = self._patterns
        return patterns

    def mask(self, value: str) -> str:
        p = self._current()
        if p.text is None or (p.few_text is not None and not any(s in value for s in p.few_text)):
            return value
        return p.text.sub(MASK, value)

    def mask_bytes(self, value: bytes) -> bytes:
        p = self._current()
        if p.bytes is None or (p.few_bytes is not None and not any(s in value for s in p.few_bytes)):
            return value
        return p.bytes.sub(_MASK_BYTES, value)

    def held_tail(self, text: str) -> int:
        """How many characters at the end of ``text`` could begin a secret (0 when none):
        the longest such tail, at most the longest secret's length - 1."""
        p = self._current()
        if p.tail is None or not text:
            return 0
        held = 0
        for secret in p.long:  # rare (a 200+ character key): candidates by its first character
            start = max(0, len(text) - len(secret) + 1)
            at = text.find(secret[0], start, len(text) - TRIE_DEPTH)
            while at >= 0:
                if secret.startswith(text[at:]):
                    held = max(held, len(text) - at)
                    break
                at = text.find(secret[0], at + 1, len(text) - TRIE_DEPTH)
        found = p.tail.search(text, max(0, len(text) - p.tail_window))
        return max(held, len(text) - found.start() if found else 0)

    def mask_value(self, value: Any) -> Any:
        """Strings anywhere inside dicts, lists and tuples (a copy only where one changed)."""
        if self._current().text is None:
            return value
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, dict):
            return {k: self.mask_value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mask_value(v) for v in value)
        return value


#: How deep the prefix trie (a nested regex) goes: ``re`` compiles nesting recursively.
#: Longer prefixes of longer secrets are found by :meth:`SecretSet.held_tail`'s loop.
TRIE_DEPTH = 200


def _prefix_trie(secrets: list[str]) -> str:
    """A regex matching every proper prefix of every secret (non-empty, at most
    :data:`TRIE_DEPTH` characters): a trie of the secrets without their last character,
    each step optional after the first."""
    trie: dict[str, Any] = {}
    for secret in secrets:
        node = trie
        for char in secret[: min(len(secret) - 1, TRIE_DEPTH)]:
            node = node.setdefault(char, {})

    def render(node: dict[str, Any]) -> str:
        branches = [re.escape(c) + (f"(?:{render(child)})?" if child else "") for c, child in sorted(node.items())]
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    return render(trie)


SECRETS = SecretSet()


def redact_log_event(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: every configured secret masked in every value (and traceback)."""
    for key, value in event_dict.items():
        if isinstance(value, (str, dict, list, tuple)):
            event_dict[key] = SECRETS.mask_value(value)
    return event_dict


class RedactingSend:
    """Pure ASGI middleware: every response header value and body, and every WebSocket
    frame, passes :data:`SECRETS` on its way out.

    Only ``/v1/`` and ``/admin`` (the static WebUI files hold no secret). A one-piece body
    (every JSON answer) is masked whole and its ``content-length`` corrected; a streamed
    body is masked piece by piece (each SSE write is whole frames), a WebSocket frame whole
    (each is one event). Header values are masked too: none carries upstream text today
    (``retry-after`` is re-rendered from a number), but a header set from upstream or config
    data later must not be the one way out.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope.get("path", "").startswith(("/v1/", "/admin")):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, _masking_websocket_send(send))
            return
        held: Message | None = None

        async def masking_send(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                held = _masked_headers(message)
                return
            if message["type"] == "http.response.body":
                body = SECRETS.mask_bytes(message.get("body", b""))
                if held is not None:
                    start, held = held, None
                    if not message.get("more_body", False):
                        start = _with_length(start, len(body))
                    await send(start)
                message = {**message, "body": body}
            elif held is not None:
                await send(held)
                held = None
            await send(message)

        await self.app(scope, receive, masking_send)
        if held is not None:
            await send(held)


def _masking_websocket_send(send: Send) -> Send:
    async def masking_send(message: Message) -> None:
        if message["type"] == "websocket.send":
            if message.get("text") is not None:
                message = {**message, "text": SECRETS.mask(message["text"])}
            elif message.get("bytes") is not None:
                message = {**message, "bytes": SECRETS.mask_bytes(message["bytes"])}
        elif message["type"] == "websocket.close" and message.get("reason"):
            message = {**message, "reason": SECRETS.mask(message["reason"])}
        elif message["type"] == "websocket.http.response.body":
            message = {**message, "body": SECRETS.mask_bytes(message.get("body", b""))}
        if "headers" in message:  # websocket.accept, websocket.http.response.start
            message = _masked_headers(message)
        await send(message)

    return masking_send


def _masked_headers(message: Message) -> Message:
    """``message`` with every header value masked."""
    headers = message.get("headers")
    if not headers:
        return message
    return {**message, "headers": [(name, SECRETS.mask_bytes(value)) for name, value in headers]}


def _with_length(start: Message, length: int) -> Message:
    headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
    if any(k.lower() == b"content-length" for k, _ in start.get("headers", ())):
        headers.append((b"content-length", str(length).encode()))
    return {**start, "headers": headers}
