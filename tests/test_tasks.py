"""``stop_tasks`` (gateway/tasks.py), fed tasks directly: every task ends, a dead task's
error is logged rather than cutting the shutdown short, and the caller's own cancel is kept."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from gateway.tasks import stop_tasks


async def test_running_tasks_are_cancelled_and_waited_for_and_none_is_skipped() -> None:
    cleaned: list[str] = []

    async def poller(name: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # its cleanup runs before stop_tasks returns
            cleaned.append(name)

    tasks = [asyncio.create_task(poller(n)) for n in ("a", "b")]
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await stop_tasks(tasks[0], None, tasks[1])
    assert cleaned == ["a", "b"] and all(t.cancelled() for t in tasks)
    await stop_tasks()  # nothing to stop
    await stop_tasks(*tasks)  # stopping again is harmless


async def test_a_task_that_died_of_an_error_is_logged_and_the_rest_are_still_stopped() -> None:
    async def broken() -> None:
        raise RuntimeError("the store went away")

    dead = asyncio.create_task(broken(), name="audit-retention")
    alive = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0.01)
    with structlog.testing.capture_logs() as logs:
        await stop_tasks(dead, alive)  # before: the RuntimeError came out here and the next step never ran
    assert alive.cancelled()
    assert [(e["event"], e["task"], e["error_type"], e["error"]) for e in logs] == [
        ("background_task_failed", "audit-retention", "RuntimeError", "the store went away")]


async def test_a_cancel_of_the_caller_while_it_waits_is_not_swallowed() -> None:
    stopping = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopping.set()
            await asyncio.shield(asyncio.sleep(0.3))  # a last write that outlives the first cancel

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    after: list[str] = []

    async def shutdown() -> None:
        await stop_tasks(task)
        after.append("went on as if stopped")

    caller = asyncio.create_task(shutdown())
    await stopping.wait()
    caller.cancel()  # e.g. the shutdown's own deadline
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert after == [] and caller.cancelled()


async def test_a_caller_already_cancelled_and_cleaning_up_still_stops_every_task() -> None:
    """A shutdown running in the ``finally`` of a cancelled task (a second signal) must not
    give up after the first task it stops: the audit writer's flush may come after it."""
    pollers = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    steps: list[str] = []

    async def lifespan() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await stop_tasks(pollers[0])
            await stop_tasks(*pollers[1:])
            steps.append("last flush")

    owner = asyncio.create_task(lifespan())
    await asyncio.sleep(0.01)
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    assert steps == ["last flush"] and all(p.cancelled() for p in pollers)
