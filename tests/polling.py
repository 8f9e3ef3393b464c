"""Waiting for a condition that another thread, process or task brings about.

Every test that polls uses these two, so that every wait is bounded in time and a wait that
runs out fails the same way: an AssertionError that says what was awaited and for how long.
`wait_until` blocks the calling thread; `eventually` sleeps on the event loop, so that servers
running on that loop go on while the test waits.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

#: Seconds between two looks when the caller names none.
STEP = 0.02


def wait_until(predicate: Callable[[], T], *, timeout: float, what: str, step: float = STEP,
               ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """The first truthy value of `predicate()`, looked at every `step` seconds for at most
    `timeout` seconds; an exception of a type in `ignoring` counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignoring:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(step)


async def eventually(predicate: Callable[[], T | Awaitable[T]], *, timeout: float, what: str,
                     step: float = STEP, ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """As `wait_until`, without blocking the event loop; `predicate` may be plain or return an
    awaitable, whose result is then the value looked at."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignoring:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(step)
