"""The background reload of store-backed memory (gateway/store/refresher.py): bounded,
never raising, one warning per run of failures."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from gateway.store.refresher import Refresher


async def test_a_failing_or_stalled_reload_keeps_going_and_warns_once_per_run() -> None:
    outcomes = ["fail", "stall", "fail", "ok", "fail", "ok"]
    calls: list[str] = []

    async def reload() -> None:
        outcome = outcomes[len(calls)]
        calls.append(outcome)
        if outcome == "fail":
            raise OSError("the store is down")
        if outcome == "stall":
            await asyncio.sleep(10)  # past the bound: cut, counted as a failure

    refresher = Refresher("test", reload, every=0.01, bound=0.05)
    failing = []
    for _ in outcomes:
        await refresher.once()  # never raises
        failing.append(refresher.failing)
    assert calls == outcomes
    assert failing == [True, True, True, False, True, False]
    assert refresher.failed_reloads == 4 and refresher.failure_runs == 2  # one warning per run


async def test_the_loop_reloads_every_interval_until_closed() -> None:
    calls = 0

    async def reload() -> None:
        nonlocal calls
        calls += 1

    refresher = Refresher("test", reload, every=0.01, bound=1.0)
    await refresher.start()
    await asyncio.sleep(0.2)
    await refresher.aclose()
    seen = calls
    assert seen >= 3
    await asyncio.sleep(0.05)
    assert calls == seen  # closed: no more reloads


async def test_closing_never_waits_for_ever() -> None:
    """Closed while a reload is just finishing, the loop still stops: with ``wait_for``
    (Python 3.11) the cancel was swallowed there and ``aclose`` hung, 49 closes of 300."""

    async def reload() -> None:
        return None

    for _ in range(300):
        refresher = Refresher("test", reload, every=0.001, bound=1.0)
        await refresher.start()
        await asyncio.sleep(0.003)
        await asyncio.wait_for(asyncio.shield(refresher.aclose()), 30)  # a hang fails here


def test_no_wait_for_in_the_gateway() -> None:
    """Every bounded wait is ``asyncio.timeout``: on Python 3.11 ``asyncio.wait_for``
    swallows a cancel that lands as the awaited call finishes, so a loop stopped by a cancel
    (as above) runs on, and a request cancelled by its client's disconnect keeps going."""
    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and getattr(node.value, "id", "") == "asyncio":
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
