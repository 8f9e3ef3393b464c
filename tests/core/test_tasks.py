"""kvsp_moq.tasks: a stopped task has ended (its cleanup included) when the stop returns."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.tasks import TaskSet, cancel_and_wait


async def _run_until_cancelled(started: asyncio.Event, cleaned: list[str], name: str) -> None:
    started.set()
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.sleep(0)  # cleanup that itself awaits
        cleaned.append(name)


async def test_cancel_and_wait_returns_after_the_task_cleaned_up() -> None:
    started, cleaned = asyncio.Event(), []
    task = asyncio.create_task(_run_until_cancelled(started, cleaned, "a"))
    await started.wait()
    await cancel_and_wait(task)
    assert task.cancelled() and cleaned == ["a"]


async def test_cancel_and_wait_accepts_none_and_finished_tasks() -> None:
    await cancel_and_wait(None)

    async def fails() -> None:
        raise RuntimeError("on its way out")

    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    await cancel_and_wait(task)  # what it raised is the stopped task's, not the caller's
    assert isinstance(task.exception(), RuntimeError)


async def test_cancelling_the_caller_still_propagates() -> None:
    inner_started, cleaned = asyncio.Event(), []
    inner = asyncio.create_task(_run_until_cancelled(inner_started, cleaned, "inner"))
    await inner_started.wait()
    stopping = asyncio.Event()

    async def stopper() -> None:
        stopping.set()
        await cancel_and_wait(inner)

    outer = asyncio.create_task(stopper())
    await stopping.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer


async def test_task_set_holds_tasks_until_done_and_stops_them() -> None:
    tasks = TaskSet()
    done = tasks.spawn(asyncio.sleep(0), name="short")
    started = [asyncio.Event(), asyncio.Event()]
    cleaned: list[str] = []
    running = [tasks.spawn(_run_until_cancelled(e, cleaned, f"t{i}")) for i, e in enumerate(started)]
    for e in started:
        await e.wait()
    await done
    await asyncio.sleep(0)  # done callbacks run on the next turn
    assert done not in tasks and len(tasks) == 2 and set(tasks) == set(running)
    await tasks.cancel_and_wait()
    assert sorted(cleaned) == ["t0", "t1"] and all(t.cancelled() for t in running)
    assert len(tasks) == 0


async def test_task_set_holds_futures_added_to_it() -> None:
    tasks = TaskSet()
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert tasks.add(future) is future and future in tasks
    tasks.cancel()
    assert future.cancelled()
    await asyncio.sleep(0)
    assert not tasks
