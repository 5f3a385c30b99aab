"""Client-executed tool calls (``custom``, ``local_shell``, ``shell``, ``apply_patch``) in a
Responses stream: each becomes the client's own output item, not a ``function_call``.

A ``custom`` call's freeform input streams as it is decoded from the upstream's JSON
arguments (``response.custom_tool_call_input.delta``); the other kinds need their whole
action or operation, so they are announced once the call's arguments are complete.
The encoder (encoder.py) hands each such block here by output index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.protocols.responses.client_tool_calls import CustomInputStream
from gateway.protocols.responses.items import new_id, tool_call_item
from gateway.protocols.responses.streamed_response import StreamedResponse
from gateway.protocols.responses.tools import ToolMap


class ClientCallEvents:
    """The events of client-executed calls; ``finish_item(index, final)`` ends an item the
    way the encoder ends every item (its open block closed, ``output_item.done``)."""

    def __init__(
        self, response: StreamedResponse, tool_map: ToolMap, finish_item: Callable[[int, dict[str, Any]], bytes]
    ) -> None:
        self.response = response
        self.tool_map = tool_map
        self.finish_item = finish_item
        self._pending: set[int] = set()  # calls not yet announced (their action comes whole)
        self._custom: dict[int, CustomInputStream] = {}  # open custom calls' decoded input

    def __contains__(self, index: int) -> bool:
        return index in self._pending or index in self._custom

    def start(self, index: int, call_id: str, upstream: str) -> bytes:
        if self.tool_map.kinds.get(upstream) == "custom":
            item = tool_call_item(self.tool_map, new_id("ctc_"), call_id, upstream, "", "in_progress")
            item["input"] = ""
            self._custom[index] = CustomInputStream()
            return self.response.added(index, item)
        self.response.items[index] = {"id": new_id("ctc_"), "call_id": call_id, "upstream": upstream}
        self._pending.add(index)
        return b""

    def delta(self, index: int, text: str) -> bytes:
        stream = self._custom.get(index)
        new = stream.feed(text) if stream is not None else ""
        if not new:
            return b""
        where = {"item_id": self.response.items[index]["id"], "output_index": index}
        return self.response.event("response.custom_tool_call_input.delta", {**where, "delta": new})

    def stop(self, index: int, arguments: str, status: str) -> bytes:
        if index in self._custom:
            return self._stop_custom(index, arguments, status)
        self._pending.discard(index)  # announced now (in progress, whole), then done
        pending = self.response.items[index]
        item_id, call_id, upstream = pending["id"], pending["call_id"], pending["upstream"]
        added = tool_call_item(self.tool_map, item_id, call_id, upstream, arguments, "in_progress")
        final = tool_call_item(self.tool_map, item_id, call_id, upstream, arguments, status)
        return self.response.added(index, added) + self.finish_item(index, final)

    def _stop_custom(self, index: int, arguments: str, status: str) -> bytes:
        """The rest of the input, ``custom_tool_call_input.done``, the item done: the final
        input is exactly the concatenated deltas."""
        stream = self._custom.pop(index)
        item = self.response.items[index]
        where = {"item_id": item["id"], "output_index": index}
        out = b""
        rest = stream.finish(arguments)
        if rest:
            out += self.response.event("response.custom_tool_call_input.delta", {**where, "delta": rest})
        out += self.response.event("response.custom_tool_call_input.done", {**where, "input": stream.sent})
        return out + self.finish_item(index, {**item, "input": stream.sent, "status": status})
