"""A client that stops reading holds the gateway back, in both stream modes.

Realtime: the upstream read pauses once the bytes in between (the gateway's small queue and
transport buffer, the kernel's socket buffers) are full; compatible: the answer is collected
within ``--max-collect-bytes`` (it is validated whole), then replayed a bounded piece at a
time. Either way the gateway's own write buffer for the stalled client stays small, and the
client that reads again gets the whole answer, driven through the official SDK's stream
helper (strict). Not timed: each wait only catches a run that never settles.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.simulator.reply import GREETING
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.processes import own_simulator

#: The answer's text: far more than the kernel's socket buffers between the three parties
#: (loopback autotunes them to a few MiB) can hold.
ANSWER = 16 * 1024 * 1024
#: The gateway's own write buffer for one stalled client may hold at most this: the
#: transport's high-water mark plus one write (64 KiB each). Before the fix a compatible
#: replay put the whole encoded answer there at once.
WRITE_BUFFER_BOUND = 512 * 1024


@pytest.fixture
def own_sim(server_loop: ServerLoop) -> Iterator[Simulator]:
    with own_simulator(server_loop) as sim:
        yield sim


def settled(read: Any, quiet: float = 1.5, timeout: float = 120.0) -> int:
    """``read()`` once it has stopped growing for ``quiet`` s (the stall has settled)."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return int(now)
    raise AssertionError(f"still growing after {timeout} s: {last}")


def write_buffers(server_loop: ServerLoop, gateway: Gateway) -> list[int]:
    """The bytes waiting in the gateway server's transport write buffers, per connection."""
    server = next(s for s, _ in server_loop._servers if s.config.app is gateway.app)

    async def sizes() -> list[int]:
        return [c.transport.get_write_buffer_size() for c in list(server.server_state.connections)
                if c.transport is not None and not c.transport.is_closing()]

    return server_loop.run(sizes())  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["realtime", "compatible"])
def test_a_stalled_reader_holds_the_upstream_back_and_then_reads_the_whole_answer(
    server_loop: ServerLoop, own_sim: Simulator, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    gateway = start_gateway(server_loop, own_sim, tmp_path_factory, stream_mode=mode,
                            max_collect_bytes=2 * ANSWER, keepalive_interval=5.0)
    with httpx.Client(timeout=120) as http:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, http_client=http,
                               _strict_response_validation=True)
        stream = client.chat.completions.create(
            model=f"large;size={ANSWER};chunk=4096", stream=True, messages=[{"role": "user", "content": "hi"}],
            stream_options={"include_usage": True})
        # the headers are in; the client reads nothing more for now
        if mode == "compatible":  # it collects the whole answer whatever the client does (a
            # loaded machine can pause the upstream's writes past settled()'s quiet 1.5 s)
            wait_for(lambda: own_sim.stats()["bytes_sent"] > ANSWER, timeout=120)
        sent = settled(lambda: own_sim.stats()["bytes_sent"])
        settled(lambda: sum(write_buffers(server_loop, gateway)))  # the gateway's writes have settled too
        buffered = write_buffers(server_loop, gateway)
        if mode == "realtime":  # the upstream read paused: most of the answer is still unsent
            assert sent < ANSWER // 2, f"the upstream wrote {sent} bytes to a reader that read nothing"
        else:  # collected whole (validated before any of it is replayed), then held back
            assert sent > ANSWER
        assert own_sim.stats()["open_streams"] == (1 if mode == "realtime" else 0)
        assert buffered and max(buffered) <= WRITE_BUFFER_BOUND, buffered
        text, finish, usage = [], None, None
        for chunk in stream:  # reading again: the rest of the answer
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
    answer = "".join(text)
    assert len(answer) == ANSWER and answer == (GREETING * (ANSWER // len(GREETING) + 1))[:ANSWER]
    assert finish == "stop" and usage is not None and usage.completion_tokens > 0
    assert own_sim.stats()["completed"] == 1
