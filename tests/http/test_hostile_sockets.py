"""Issue #25's socket attacks against the real CLI gateway (a subprocess, measured from
/proc): what 3 WebSockets that each sent a 28.6 MiB frame of a million tiny items leave in
its memory, and /healthz while keyless, cross-origin, slow-header and ignored-frame sockets
keep coming from another loopback address (tests/socket_attacks.py drives them, in a
process of its own)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import socket_attacks as attacks
from tests.processes import FREEZE_MS, GatewayProcess, paced_probe

# real processes and induced faults: `make test-faults` (CI runs it), not the default suite
pytestmark = pytest.mark.faults

KEY = "sk-hostile-sockets-0123456789abcdef"
AUTH = {"authorization": f"Bearer {KEY}"}
REPO = Path(__file__).resolve().parents[2]
MiB = 1024


def test_three_big_frames_leave_the_gateway_under_150_mib_more(tmp_path: Path) -> None:
    """On main each such socket kept ~625 MiB until it closed (3: 1.73 GB). Now the issue's
    frame (1 M tiny items) is refused by the item limit and leaves the gateway under +150 MiB
    while its sockets stay open; a frame under the limit is remembered packed (compressed
    JSON, bounded by its real size) and each socket continues from what it sent."""
    proc = GatewayProcess("--simulator", "--api-key", KEY, "--data-dir", str(tmp_path / "data"),
                          "--log-level", "warning", log_dir=tmp_path)
    try:
        proc.wait_healthy()

        async def attack() -> tuple[int, int, int, list[str], list[str]]:
            warm, _ = await attacks.big_frames(proc.url, 1, items=10, headers=AUTH)  # the WebSocket path loaded
            await warm[0].close()
            await asyncio.sleep(1)
            before = attacks.rss_kib(proc.proc.pid)
            # the frame (1 M tiny items) is now refused by the item limit, by name
            refused, errors = await attacks.big_frames(proc.url, 3, headers=AUTH)
            await asyncio.sleep(2)  # idle, as a socket between turns
            held = attacks.rss_kib(proc.proc.pid)  # the bar: 3 sockets, each sent a 28.6 MiB frame
            for ws in refused:
                await ws.close()
            assert all(e["type"] == "error" and "too_many_input_items" in json.dumps(e) for e in errors), errors
            # frames under the limit (45,000 items, 4.4 MiB each) are remembered, packed, and continued
            opened, answers = await attacks.big_frames(proc.url, 3, items=45_000, headers=AUTH, content="y" * 80)
            await asyncio.sleep(2)
            continued = []
            for ws, answer in zip(opened, answers):  # a prewarm continuing the big one: resolved, not upstream
                await ws.send(json.dumps({"type": "response.create", "model": "text", "generate": False, "input": "next",
                                          "previous_response_id": answer["response"]["id"]}))
                continued.append((await attacks.terminal(ws))["type"])
            await asyncio.sleep(2)
            after = attacks.rss_kib(proc.proc.pid)
            for ws in opened:
                await ws.close()
            return before, held, after, [a["type"] for a in answers], continued

        before, held, after, answers, continued = asyncio.run(attack())
        assert answers == continued == ["response.completed"] * 3
        assert (held - before) / MiB < 150, (before, held)
        assert (after - before) / MiB < 150, (before, after)
    finally:
        proc.stop()


def test_healthz_never_freezes_while_the_socket_attacks_run(tmp_path: Path) -> None:
    """For 10 s, from 127.0.0.2 (a niced process): keyless upgrades 8 at a time, cross-origin upgrades, 200
    slow-header sockets (one line a second) and a socket of ignored frames; meanwhile, from a
    process of its own, /healthz probes on fresh connections. The bound, at the machine's
    pace (tests/processes.Probes), catches a freeze (seconds, before the fix), not a busy
    machine; the measured p99 (under 100 ms idle) is in bench/hostile.md."""
    proc = GatewayProcess("--simulator", "--api-key", KEY, "--data-dir", str(tmp_path / "data"),
                          "--header-timeout", "2", "--ws-idle-timeout", "3", "--log-level", "error", log_dir=tmp_path)
    try:
        proc.wait_healthy()
        with paced_probe(proc.port) as probes:
            attack = subprocess.Popen([sys.executable, "-m", "tests.socket_attacks", proc.url, "10", KEY, "127.0.0.2"],
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = attack.communicate(timeout=120)
        assert attack.returncode == 0, err.decode()[-2000:]
        report = json.loads(out)
        # the attacks did run (how many rounds fit in 10 s is the machine's: the niced attacker
        # made 2 cross-origin rounds beside a whole suite and two busy loops on 2 cores)
        assert report["rounds"]["keyless"] > 0 and report["rounds"]["cross_origin"] > 0
        assert report["slow_headers"]["closed"] == 200  # every slow-header socket was closed
        assert report["ignored_frames_closed_after_s"] is not None  # ignored frames did not keep it open
        # every probe a 200 (a refusal counts as infinite), and the 99th percentile within the
        # freeze bound at the machine's pace
        assert len(probes.gateway) > 100 and max(probes.gateway) < float("inf")
        rank = max(1, len(probes.gateway) // 100)
        assert probes.stalled(FREEZE_MS, rank) == 0, (sorted(probes.gateway)[-5:], probes.pace)
    finally:
        proc.stop()


#: /healthz (ms) past this while the big frames arrive: one was read on the event loop
FRAME_FREEZE_MS = 250.0


def test_big_frames_are_read_off_the_event_loop(tmp_path: Path) -> None:
    """Two sockets send the issue's 28.6 MiB frame (1 M tiny items) at once, three times:
    each gets its named refusal, and ``/healthz`` never waits on their JSON (read in a
    worker process, as a dense HTTP body is). /healthz is probed from a process of its own:
    a probe thread here would time this process's frame building too."""
    proc = GatewayProcess("--simulator", "--api-key", KEY, "--data-dir", str(tmp_path / "data"),
                          "--log-level", "warning", log_dir=tmp_path)

    async def attack() -> list[dict[str, object]]:
        warm, _ = await attacks.big_frames(proc.url, 1, items=10, headers=AUTH)  # the WebSocket path loaded
        await warm[0].close()
        errors: list[dict[str, object]] = []
        for _ in range(3):
            rounds = await asyncio.gather(*(attacks.big_frames(proc.url, 1, headers=AUTH) for _ in range(2)))
            for sockets, answers in rounds:
                errors += answers
                await sockets[0].close()
        return errors

    try:
        proc.wait_healthy()
        with paced_probe(proc.port) as probes:
            errors = asyncio.run(attack())
        assert len(errors) == 6 and all("too_many_input_items" in json.dumps(e) for e in errors), errors
        # read on the loop (measured by putting read_frame back inline) the six worst probes
        # took 357-613 ms (3rd-worst 411) on an idle machine; read off it, 36-82 ms. A busy
        # machine stretches both by its pace (beside a whole suite and busy loops: ~1.5 s
        # off the loop), so the bound is taken at that pace (tests/processes.Probes).
        assert len(probes.gateway) > 20 and probes.stalled(FRAME_FREEZE_MS, 3) == 0, (
            sorted(probes.gateway)[-6:], probes.pace)
    finally:
        proc.stop()
