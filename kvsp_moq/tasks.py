"""Background tasks: holding them while they run, and ending them on stop.

The event loop keeps only weak references to tasks, so a task started and not held may be
collected mid-run; and a task cancelled on stop must also be awaited, or it still runs (its
`finally` blocks included) after the owner has closed what it uses.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Iterator, TypeVar

__all__ = ["TaskSet", "cancel_and_wait"]

T = TypeVar("T")
F = TypeVar("F", bound="asyncio.Future[Any]")


async def cancel_and_wait(task: "asyncio.Future[Any] | None") -> None:
    """Cancel `task` (None: nothing) and return once it has ended.

    What the task raised on its way out is retrieved and dropped: the owner is stopping it.
    A cancellation of the caller itself still propagates.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class TaskSet:
    """Tasks an owner started and holds until each is done (then it forgets them)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None,
              loop: asyncio.AbstractEventLoop | None = None) -> "asyncio.Task[T]":
        """Run `coro` as a task of this set (on `loop`, default the running loop)."""
        return self.add((loop or asyncio.get_running_loop()).create_task(coro, name=name))

    def add(self, task: F) -> F:
        """Hold an already started task (or future) until it is done."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator["asyncio.Future[Any]"]:
        return iter(list(self._tasks))

    def __contains__(self, task: object) -> bool:
        return task in self._tasks

    def cancel(self) -> None:
        """Cancel every task held, without waiting for them."""
        for task in list(self._tasks):
            task.cancel()

    async def cancel_and_wait(self) -> None:
        """Cancel every task held and return once all have ended (what they raised is dropped)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
