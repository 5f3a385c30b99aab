"""Timing bounds of one upstream attempt: idle, total, and events that carry nothing.

An upstream that never ends held a request (and its connection) for good: one byte every
10 s kept httpx's read timeout happy past 260 s, and an endless stream of empty chunks
never ended at all (issue #31). This state class says, from the events the read loop of
:class:`~gateway.upstream.client.UpstreamClient` hands it, when the attempt must stop:

- **idle**: ``idle_timeout`` seconds without a *data-bearing* event. Bytes that complete
  no event, keepalive comments and events that carry nothing do not reset it;
- **total**: ``attempt_timeout`` seconds from the request's start, whatever arrives;
- **empty**: ``max_empty_events`` consecutive events that carry nothing (no content,
  reasoning, tool delta, usage, finish or error).

Pure: the caller passes the clock (``time.monotonic()``) and checks :attr:`deadline` as
each network read arrives (a read that never comes is httpx's read timeout, the same
``idle_timeout``); each bound ends in a ``timeout`` error (504 before the client's status
is committed, the in-stream error event after).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError

#: The delta fields that carry something a client sees.
_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "refusal", "tool_calls", "function_call")


def carries_something(chunk: Any) -> bool:
    """Whether one upstream chunk carries content, reasoning, a tool delta, usage, a
    finish or an error (anything else, a role-only or empty delta, counts as nothing)."""
    if not isinstance(chunk, dict):
        return False
    if chunk.get("usage") or chunk.get("error"):
        return True
    if chunk.get("content") or chunk.get("tokens") or chunk.get("stop") is True:
        return True  # llama.cpp's /completion (token-in): text, sampled ids, its end
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            return True  # not ours to judge: the accumulator says what is wrong with it
        if choice.get("finish_reason") or choice.get("token_ids") or choice.get("text"):
            return True  # (``text``: a text completion's, vLLM's token-in answer)
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            if delta is not None:
                return True
            continue
        for key in _DELTA_FIELDS:
            if delta.get(key):
                return True
    return False


class AttemptBounds:
    """When one upstream attempt must stop; fed each parsed event."""

    __slots__ = ("_empty", "_idle", "_idle_deadline", "_max_empty", "_total", "_total_deadline")

    def __init__(self, idle: float, total: float, max_empty: int, now: float) -> None:
        self._idle, self._total, self._max_empty = idle, total, max_empty
        self._total_deadline = now + total
        self._idle_deadline = now + idle
        self._empty = 0

    def answered(self, now: float) -> None:
        """The headers are in: the idle clock starts from here (the wait for them has
        its own bound, ``--first-byte-timeout``)."""
        self._idle_deadline = now + self._idle

    @property
    def deadline(self) -> float:
        """The next read must end by this time (the clock ``now`` came from)."""
        return min(self._idle_deadline, self._total_deadline)

    @property
    def total_deadline(self) -> float:
        return self._total_deadline

    def event(self, chunk: Any, now: float) -> None:
        """One parsed event; raises when it is one empty event too many."""
        if carries_something(chunk):
            self._empty = 0
            self._idle_deadline = now + self._idle
            return
        self._empty += 1
        if self._empty >= self._max_empty:
            raise GatewayError(
                "timeout", "upstream_empty_events",
                f"the upstream sent {self._empty} events in a row that carry nothing",
            )

    def expired(self, now: float) -> GatewayError:
        """The error for a read cut at :attr:`deadline`."""
        if now >= self._total_deadline:
            return GatewayError(
                "timeout", "upstream_attempt_timeout", f"the upstream answer took longer than {self._total:g} s"
            )
        return GatewayError(
            "timeout", "upstream_idle_timeout", f"the upstream sent nothing for {self._idle:g} s mid-answer"
        )
