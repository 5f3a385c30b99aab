"""Stopping the gateway's background tasks (pollers, writers, timers) at shutdown.

The hand-written ``task.cancel(); with suppress(CancelledError): await task`` has two faults:
it swallows a cancel aimed at the caller itself (a shutdown cut by its own deadline then goes
on as if nothing happened), and a task that had already died of an error raises that error
into the shutdown, skipping every step after it (the audit writer's last flush among them).
"""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("gateway.tasks")


async def stop_tasks(*tasks: asyncio.Task[object] | None) -> None:
    """Cancel the tasks and wait until each has ended. A task's own error is logged, not
    raised; a cancel of the caller while it waits is raised, never swallowed."""
    current = asyncio.current_task()
    # a caller already being cancelled (cleaning up in a ``finally``) still stops every task:
    # only a cancel that comes while it waits here is the caller's to raise
    cancels_before = current.cancelling() if current is not None else 0
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    for task in running:
        try:
            await task
        except asyncio.CancelledError:
            if current is not None and current.cancelling() > cancels_before:
                raise  # the caller is being cancelled, not just the task it stopped
        except Exception as exc:  # the task had died before: say so, and go on stopping the rest
            log.error("background_task_failed", task=task.get_name(), error_type=type(exc).__name__, error=str(exc))
