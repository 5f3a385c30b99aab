"""Server-sent events read on bytes: the ``data`` of each event, as the upstream sent it.

Why not httpx-sse (used before): it decodes every network read to ``str``, splits lines
and builds an event object through four stacked async generators, and the gateway then
hands the text to ``orjson``, which takes bytes anyway. On the hot path (one call per
upstream chunk) that was ≈ 4–5% of a streamed request's CPU (docs/performance.md). This
parser keeps the WHATWG event-stream rules the gateway relies on and nothing more:

- lines end with CRLF, LF or CR (a CR at the end of one read and an LF at the start of
  the next are one line end);
- a line starting with ``:`` is a comment (keepalives), ignored;
- ``field:value`` with one leading space stripped from the value; ``data`` lines of one
  event are joined with LF; every other field (``event``, ``id``, ``retry``) is ignored;
- a blank line ends an event; an event without a ``data`` line is not one; an event cut
  by the end of the stream (no blank line) is dropped, as the spec says;
- a byte order mark opening the stream is dropped (httpx-sse kept it, losing the first event).

A pure state class fed one network read at a time (openai-python's stream-state style);
the I/O loop is :func:`gateway.upstream.client.UpstreamClient._request`.
"""

from __future__ import annotations

_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark: the spec drops one at the stream's start


class SSEDataParser:
    """``feed(read) -> [data, ...]``: the complete events' data in that read, in order."""

    __slots__ = ("_data", "_partial", "_skip_lf", "_started")

    def __init__(self) -> None:
        self._partial = b""  # the start of a line whose end has not arrived
        self._data: list[bytes] | None = None  # this event's data lines so far
        self._skip_lf = False  # the last read ended in CR: an LF opening the next is its pair
        self._started = False  # the stream's first bytes are in (a BOM there is dropped)

    def feed(self, read: bytes) -> list[bytes]:
        if not self._started:
            if len(self._partial) + len(read) < len(_BOM) and _BOM.startswith(self._partial + read):
                self._partial += read  # too few bytes yet to tell a BOM from a line
                return []
            read, self._partial, self._started = (self._partial + read).removeprefix(_BOM), b"", True
        if self._skip_lf and read:  # an empty read between the CR and its LF changes nothing
            self._skip_lf = False
            if read[:1] == b"\n":
                read = read[1:]
        if b"\r" in read:
            if read[-1:] == b"\r":
                self._skip_lf = True
            read = read.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in read:
            self._partial += read
            return []
        lines = read.split(b"\n")
        if self._partial:
            lines[0] = self._partial + lines[0]
        self._partial = lines.pop()
        out: list[bytes] = []
        for line in lines:
            if not line:  # the blank line: the event ends
                if self._data is not None:
                    out.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = None
            elif line[:5] == b"data:":
                value = line[6:] if line[5:6] == b" " else line[5:]
                if self._data is None:
                    self._data = [value]
                else:
                    self._data.append(value)
            elif line == b"data":  # a field name alone: an empty value
                if self._data is None:
                    self._data = [b""]
                else:
                    self._data.append(b"")
            # comments and the other fields: nothing the gateway reads
        return out
