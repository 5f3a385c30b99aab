"""Secrets masked in the block events themselves, across delta boundaries.

The bytes a client gets pass :class:`gateway.redact.RedactingSend`, one write at a time;
but a secret the upstream split across two deltas (``"sk-ab"`` then ``"cd..."``) is two
separate JSON strings on the wire, so no byte mask can see it, and the client's SDK joins
the halves. :class:`DeltaMasker` sits between the answer state and the encoder: per block
it masks each delta together with the short tail it held back from the one before, and
holds back again only what could be the beginning of a secret (at most the longest
secret's length - 1 characters); the tail is released with the next delta or at the
block's end. ``BlockStop`` content (the whole text, shown again by Responses' ``done``
events) is masked whole, so both agree with what the deltas assembled.

Pure: the secrets come in as any object with ``mask(str)`` and ``held_tail(str)`` (the
live :data:`gateway.redact.SECRETS`); no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from gateway.stream.events import BlockDelta, BlockStop, Event


class Masks(Protocol):
    def mask(self, value: str) -> str: ...

    def held_tail(self, text: str) -> int: ...


class DeltaMasker:
    """Block events in, the same events out with every secret masked, even one split
    across deltas (a delta may come out shorter, or not at all, while its tail waits)."""

    def __init__(self, secrets: Masks) -> None:
        self.secrets = secrets
        self._held: dict[int, str] = {}  # block index -> the tail not yet released

    def feed(self, events: list[Event]) -> list[Event]:
        if not events:
            return events
        return list(self.stream(events))

    def stream(self, events: Iterable[Event]) -> Iterator[Event]:
        """:meth:`feed`, lazily: each event masked as it is taken (a compatible replay)."""
        for event in events:
            if isinstance(event, BlockDelta):
                delta = self._delta(event)
                if delta is not None:
                    yield delta
            elif isinstance(event, BlockStop):
                rest = self._held.pop(event.index, "")
                if rest:
                    yield BlockDelta(event.index, event.kind, rest)
                content = self.secrets.mask(event.content) if event.content else event.content
                yield event if content is event.content else BlockStop(event.index, event.kind, content)
            else:
                yield event

    def _delta(self, event: BlockDelta) -> BlockDelta | None:
        held = self._held.pop(event.index, "")
        text = self.secrets.mask(held + event.text if held else event.text)
        keep = self.secrets.held_tail(text)
        if keep:
            self._held[event.index] = text[-keep:]
            text = text[:-keep]
        if not text:
            return None
        return event if text is event.text else BlockDelta(event.index, event.kind, text)
