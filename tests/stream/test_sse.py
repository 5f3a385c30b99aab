"""The bytes SSE parser, fed directly: the WHATWG rules the gateway relies on, whatever the
network reads' boundaries; and the same data as httpx-sse's decoder (the library it
replaced on the hot path) for any stream and any split."""

from __future__ import annotations

from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstream.sse import SSEDataParser


def feed_all(reads: list[bytes]) -> list[bytes]:
    parser = SSEDataParser()
    return [data for read in reads for data in parser.feed(read)]


def byte_by_byte(stream: bytes) -> list[bytes]:
    return feed_all([stream[i : i + 1] for i in range(len(stream))])


def test_one_event_per_blank_line_with_its_data_as_bytes() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert feed_all([stream]) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
    assert byte_by_byte(stream) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_line_ends_crlf_cr_and_lf_even_split_between_reads() -> None:
    assert feed_all([b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"]) == [b"a", b"b", b"c"]
    # a CR ending one read and the LF opening the next are one line end, not two
    assert feed_all([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [b"a\nb"]
    # an empty read between them too (Hypothesis found it: the pairing was forgotten, and the
    # LF made a blank line that ended the event early)
    assert feed_all([b"data: a\r", b"", b"\ndata: b\n\n"]) == [b"a\nb"]
    # a CR at the end of a read ends its line at once (nothing waits for the next read)
    parser = SSEDataParser()
    assert parser.feed(b"data: a\r\r") == [b"a"]
    assert parser.feed(b"data: b\n\n") == [b"b"]


def test_comments_other_fields_and_events_without_data_are_not_data() -> None:
    stream = b": keepalive\n\nevent: ping\nid: 7\nretry: 100\n\n:x\ndata: real\n\n"
    assert feed_all([stream]) == [b"real"]


def test_data_lines_join_with_lf_and_one_leading_space_is_stripped() -> None:
    stream = b"data: one\ndata:two\ndata:  three\ndata\ndata:\n\n"
    assert feed_all([stream]) == [b"one\ntwo\n three\n\n"]
    assert feed_all([b"datum: no\ndata2: no\n\n"]) == []  # only the field named data


def test_an_event_cut_by_the_end_of_the_stream_is_dropped() -> None:
    parser = SSEDataParser()
    assert parser.feed(b"data: whole\n\ndata: cut") == [b"whole"]
    assert parser.feed(b" off\n") == []  # its line ended, the event did not


def test_a_byte_order_mark_opening_the_stream_is_dropped_even_split() -> None:
    stream = b"\xef\xbb\xbfdata: first\n\ndata: \xef\xbb\xbfkept\n\n"
    assert feed_all([stream]) == [b"first", b"\xef\xbb\xbfkept"]  # only at the start
    assert byte_by_byte(stream) == [b"first", b"\xef\xbb\xbfkept"]
    assert feed_all([b"\xef", b"\xbb", b"\xbfdata: a\n\n"]) == [b"a"]
    assert feed_all([b"d", b"ata: short\n\n"]) == [b"short"]  # a first read shorter than a BOM


def oracle(stream: bytes) -> list[bytes]:
    """httpx-sse's line and event decoders on the decoded text (what EventSource does)."""
    lines, events = SSELineDecoder(), SSEDecoder()
    out: list[bytes] = []
    for line in [*lines.decode(stream.decode("utf-8")), *lines.flush()]:
        event = events.decode(line)
        if event is not None and event.data:
            out.append(event.data.encode())
    return out


piece = st.sampled_from([
    b"data: ", b"data:", b"data", b"event: x", b"id: 1", b": comment", b"retry: 5", b"{\"k\":\"v\xc3\xa9\"}",
    b"[DONE]", b" ", b"x", b"\n", b"\r", b"\r\n", b"\n\n", b"\r\n\r\n", b"\r\r", b"dat", b"a: y",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(piece, max_size=40), st.data())
def test_same_data_as_httpx_sse_for_any_stream_and_any_split(pieces: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(pieces) + b"\n\n"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    ours = [d for d in feed_all(reads) if d]
    assert ours == oracle(stream)
    assert [d for d in byte_by_byte(stream) if d] == ours
