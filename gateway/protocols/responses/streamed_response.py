"""The Response object as a Responses stream has told it so far: the one ``sequence_number``
counter and each output item's latest state, shared by the encoder (encoder.py) and the
client-executed calls' events (client_call_events.py)."""

from __future__ import annotations

import time
from typing import Any

from gateway.protocols.base import dumps, sse
from gateway.protocols.responses.items import response_object


class StreamedResponse:
    """The Response object as the stream has told it so far. Every event takes the next
    ``sequence_number`` here (one counter, contiguous from 0); each output index's item is
    kept in its latest state (as announced, then final), and the order items finished is
    the ``output`` of every snapshot: the terminal object is exactly what was streamed."""

    def __init__(self, response_id: str, echo: dict[str, Any]) -> None:
        self.response_id = response_id
        self.echo = echo  # the request fields the Response object repeats
        self.created_at = int(time.time())
        self.items: dict[int, dict[str, Any]] = {}  # output index -> item (in progress, then final)
        self.done: list[int] = []  # output indexes in the order their items finished
        self._seq = 0

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        """One SSE event, numbered."""
        data = {"type": kind, **payload, "sequence_number": self._seq}
        self._seq += 1
        return sse(dumps(data), event=kind)

    def snapshot(self, status: str, **kwargs: Any) -> dict[str, Any]:
        """The Response object now (``output`` only once it is no longer in progress)."""
        output = [self.items[i] for i in self.done] if status != "in_progress" else []
        return response_object(self.echo, self.response_id, self.created_at, status, output, **kwargs)

    def added(self, index: int, item: dict[str, Any]) -> bytes:
        """``response.output_item.added``: ``item`` is the output at ``index`` from now on."""
        self.items[index] = item
        return self.event("response.output_item.added", {"output_index": index, "item": item})

    def finished(self, index: int, final: dict[str, Any]) -> bytes:
        """``response.output_item.done``: ``final`` is the item's last state."""
        self.items[index] = final
        self.done.append(index)
        return self.event("response.output_item.done", {"output_index": index, "item": final})
