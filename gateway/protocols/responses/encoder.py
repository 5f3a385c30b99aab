"""OpenAI Responses output: the Response object and its items, and the stream encoder.

Wire contracts (see docs/protocols/responses.md): ``sequence_number`` on every event,
contiguous from 0 (also on ``error`` and ``response.failed``); ``response.created`` then
``response.in_progress``; every delta belongs to an item announced by
``response.output_item.added`` and every added item gets ``response.output_item.done``;
one response id for the whole stream; the terminal event carries the full output, built
from exactly what was streamed; no ``[DONE]``. Keepalive is a repeated
``response.in_progress``. Streamed and JSON answers (the room, responses.py) are built by
the same item helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.responses.client_call_events import ClientCallEvents
from gateway.protocols.responses.compaction import compaction_item
from gateway.protocols.responses.items import (
    client_name_of,
    content_part,
    failed_error,
    function_call_item,
    logprob_object,
    message_item,
    new_id,
    reasoning_item,
    terminal_status,
    usage_object,
)
from gateway.protocols.responses.streamed_response import StreamedResponse
from gateway.protocols.responses.tools import ToolMap
from gateway.stream.events import (
    BlockDelta,
    BlockStart,
    BlockStop,
    Error,
    Event,
    Finish,
    Keepalive,
    TokenLogprobs,
)
from gateway.stream.text_log import TextLog

# -- the stream encoder -------------------------------------------------------------------


class ResponsesEncoder:
    """Canonical events -> Responses SSE events: which items and parts each block becomes
    (the Response and its sequence numbers are a :class:`StreamedResponse`)."""

    def __init__(
        self,
        response_id: str,
        *,
        echo: dict[str, Any],
        tool_map: ToolMap,
        envelope: bool,
        compaction: bool,
        logprobs: bool = False,
        tenant: Tenant = ANONYMOUS_TENANT,
    ) -> None:
        self.response = StreamedResponse(response_id, echo)
        self._event = self.response.event  # bound once: the per-delta call stays one call
        self.tool_map = tool_map
        self.envelope = envelope  # include reasoning.encrypted_content
        self.tenant = tenant  # whom envelopes are sealed for
        #: A compaction turn: the answer's text becomes one compaction item, nothing else.
        self.compaction = compaction
        self._summary: list[str] = []
        self._parts: dict[int, TextLog] = {}  # output index -> the text streamed for it (compact)
        #: client-executed tool calls (custom, shell, apply_patch, ...): their own items
        self._client_calls = ClientCallEvents(self.response, tool_map, self._finish_item)
        self._open: int | None = None
        self._refusals: set[int] = set()  # output indexes of refusal messages
        #: include message.output_text.logprobs: entries ride on the next output_text delta
        self.logprobs = logprobs
        self._logprobs_waiting: list[dict[str, Any]] = []
        self._part_logprobs: dict[int, list[dict[str, Any]]] = {}  # output index -> its part's
        self.final: dict[str, Any] | None = None

    def start(self) -> bytes:
        snapshot = self.response.snapshot
        return self._event("response.created", {"response": snapshot("in_progress")}) + self._event(
            "response.in_progress", {"response": snapshot("in_progress")}
        )

    # -- events ----------------------------------------------------------------------

    def encode(self, event: Event) -> bytes:
        if self.final is not None:
            return b""
        if self.compaction and isinstance(event, (BlockStart, BlockDelta, BlockStop, Finish)):
            return self._compaction(event)
        if isinstance(event, BlockDelta):
            return self._delta(event.index, event.text)
        if isinstance(event, BlockStart):
            return self._start(event)
        if isinstance(event, BlockStop):
            return self._stop(event.index, event.content, "completed")
        if isinstance(event, TokenLogprobs):
            if self.logprobs:
                self._logprobs_waiting.extend(logprob_object(e) for e in event.entries)
            return b""
        if isinstance(event, Keepalive):
            return self._event("response.in_progress", {"response": self.response.snapshot("in_progress")})
        if isinstance(event, Finish):
            out = self._close_open("completed")
            status, reason = terminal_status(event.finish_reason)
            self.final = self.response.snapshot(
                status, usage=usage_object(event.usage), incomplete_reason=reason
            )
            kind = "response.completed" if status == "completed" else "response.incomplete"
            return out + self._event(kind, {"response": self.final})
        if isinstance(event, Error):
            err = event.error
            out = self._close_open("incomplete")
            out += self._event("error", {"code": err.code, "message": err.message, "param": None})
            self.final = self.response.snapshot("failed", error=failed_error(err))
            return out + self._event("response.failed", {"response": self.final})
        return b""

    def _compaction(self, event: Event) -> bytes:
        """Text blocks feed the summary; the finish emits the one compaction item."""
        if isinstance(event, BlockStop) and event.kind == "text":
            self._summary.append(event.content)
        if not isinstance(event, Finish):
            return b""
        item = compaction_item("".join(self._summary), self.tenant)
        out = self.response.added(0, item) + self.response.finished(0, item)
        self.final = self.response.snapshot("completed", usage=usage_object(event.usage))
        return out + self._event("response.completed", {"response": self.final})

    def _start(self, event: BlockStart) -> bytes:
        out = self._close_open("completed")
        index = event.index
        self._open = index
        self._parts[index] = TextLog()
        if event.kind in ("text", "refusal"):
            item = message_item(new_id("msg_"), None, "in_progress")
            if event.kind == "refusal":
                self._refusals.add(index)
            part = content_part("", event.kind == "refusal")
            return out + self._added_with_part(index, item, "response.content_part.added", "content_index", part)
        if event.kind == "reasoning":
            item = reasoning_item(new_id("rs_"), None, None)
            part = {"type": "summary_text", "text": ""}
            return out + self._added_with_part(
                index, item, "response.reasoning_summary_part.added", "summary_index", part
            )
        call_id = event.call_id or new_id("call_")
        if self.tool_map.kinds.get(event.name or "") is not None:
            return out + self._client_calls.start(index, call_id, event.name or "")
        name = client_name_of(self.tool_map, event.name)
        item = function_call_item(new_id("fc_"), call_id, name, "", "in_progress")
        return out + self.response.added(index, item)

    def _added_with_part(
        self, index: int, item: dict[str, Any], part_event: str, part_key: str, part: dict[str, Any]
    ) -> bytes:
        """A message or reasoning item announced, then its first (empty) part."""
        added = self.response.added(index, item)
        return added + self._event(part_event, {"item_id": item["id"], "output_index": index, part_key: 0, "part": part})

    def _delta(self, index: int, text: str) -> bytes:
        item = self.response.items.get(index)
        if not text or item is None:
            return b""
        self._parts[index].append(text)
        if index in self._client_calls:
            return self._client_calls.delta(index, text)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message" and index in self._refusals:
            return self._event("response.refusal.delta", {**where, "content_index": 0, "delta": text})
        if item["type"] == "message":
            logprobs = self._take_logprobs(index)
            return self._event(
                "response.output_text.delta",
                {**where, "content_index": 0, "delta": text, "logprobs": logprobs},
            )
        if item["type"] == "reasoning":
            return self._event(
                "response.reasoning_summary_text.delta",
                {**where, "summary_index": 0, "delta": text},
            )
        return self._event("response.function_call_arguments.delta", {**where, "delta": text})

    def _take_logprobs(self, index: int) -> list[dict[str, Any]]:
        """The logprobs waiting for output, now the text part at ``index``'s."""
        taken, self._logprobs_waiting = self._logprobs_waiting, []
        if taken:
            self._part_logprobs.setdefault(index, []).extend(taken)
        return taken

    def _close_open(self, status: str) -> bytes:
        if self._open is None:
            return b""
        return self._stop(self._open, self._parts[self._open].text(), status)

    def _stop(self, index: int, content: str, status: str) -> bytes:
        if index not in self.response.items or index in self.response.done:
            return b""
        if index in self._client_calls:
            return self._client_calls.stop(index, content or self._parts[index].text(), status)
        out = b""
        sent = self._parts[index].text()
        if content != sent and content.startswith(sent):
            out += self._delta(index, content[len(sent) :])  # keep deltas and final in agreement
        text = self._parts[index].text()
        item = self.response.items[index]
        refusal = index in self._refusals
        logprobs = None
        if item["type"] == "message" and not refusal:
            self._take_logprobs(index)  # any that came after the last delta belong to this part
            logprobs = self._part_logprobs.get(index, [])
        done, final = item_done(self._event, item, index, text, status, refusal, logprobs,
                                self.tenant if self.envelope else None)
        return out + done + self._finish_item(index, final)

    def _finish_item(self, index: int, final: dict[str, Any]) -> bytes:
        if self._open == index:
            self._open = None
        return self.response.finished(index, final)


def item_done(
    event: Callable[[str, dict[str, Any]], bytes], item: dict[str, Any], index: int, text: str, status: str,
    refusal: bool, logprobs: list[dict[str, Any]] | None, sealed_for: Tenant | None,
) -> tuple[bytes, dict[str, Any]]:
    """The done events an output item of each type ends with (its text whole), and the
    item as it finally reads: a message (or a refusal), a reasoning summary, a function
    call's arguments. ``sealed_for``: whom a reasoning item's envelope is sealed for."""
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message" and refusal:
        part = content_part(text, True)
        out = event("response.refusal.done", {**where, "content_index": 0, "refusal": text})
        out += event("response.content_part.done", {**where, "content_index": 0, "part": part})
        return out, message_item(item["id"], text, status, refusal=True)
    if item["type"] == "message":
        logprobs = logprobs or []
        part = content_part(text, False, logprobs)
        out = event("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": logprobs})
        out += event("response.content_part.done", {**where, "content_index": 0, "part": part})
        return out, message_item(item["id"], text, status, logprobs=logprobs)
    if item["type"] == "reasoning":
        part = {"type": "summary_text", "text": text}
        out = event("response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": text})
        out += event("response.reasoning_summary_part.done", {**where, "summary_index": 0, "part": part})
        return out, reasoning_item(item["id"], text, sealed_for)
    out = event("response.function_call_arguments.done", {**where, "arguments": text})
    return out, {**item, "arguments": text, "status": status}
