"""What the property tests that send random well-formed MOQT requests through a relay share:
random subscription filters, bounded reading, the classification of each request's outcome
(with the failures that end the test), and a watch on the logs for failed handlers."""

from __future__ import annotations

import asyncio
import logging
import random
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterator

from kvsp_moq.moqt.errors import (
    MoqtError,
    RequestError,
    RequestErrorCode,
    SessionClosed,
)
from kvsp_moq.moqt.wire import FilterType, Location, SubscriptionFilter

#: The loggers a failed handler or an unretrieved task error shows up in.
WATCHED = ("kvsp_moq.moqt.quic", "kvsp.relay", "kvsp.holder.moqt_publisher", "asyncio")


class LogFailures(logging.Handler):
    """ERROR records (failed handlers answer INTERNAL_ERROR), each with the seed running."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seed = 0
        self.records: list[tuple[int, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.seed, record))

    def report(self) -> list[str]:
        return [f"seed {seed}: {r.getMessage()}\n{r.exc_text or ''}" for seed, r in self.records]


@contextmanager
def watching_logs() -> Iterator[LogFailures]:
    failures = LogFailures()
    loggers = [logging.getLogger(name) for name in WATCHED]
    for logger in loggers:
        logger.addHandler(failures)
    try:
        yield failures
    finally:
        for logger in loggers:
            logger.removeHandler(failures)


def random_filter(rnd: random.Random, number: Callable[[random.Random], int]) -> SubscriptionFilter | None:
    """Any kind of subscription filter, or none, with positions drawn by `number`."""
    kind = rnd.choice([None, *FilterType])
    if kind is None:
        return None
    if kind in (FilterType.NEXT_GROUP_START, FilterType.LARGEST_OBJECT):
        return SubscriptionFilter(kind)
    start = Location(number(rnd), number(rnd))
    if kind == FilterType.ABSOLUTE_START:
        return SubscriptionFilter(kind, start)
    return SubscriptionFilter(kind, start, rnd.choice([start.group, start.group + 1, number(rnd)]))


async def read_some(iterator, seconds: float, limit: int) -> int:
    """Objects read from a subscription or FETCH within `seconds` (at most `limit`)."""
    count = 0

    async def run() -> None:
        nonlocal count
        async for _ in iterator:
            count += 1
            if count >= limit:
                return

    try:
        await asyncio.wait_for(run(), seconds)
    except asyncio.TimeoutError:
        pass
    return count


async def outcome(request: Awaitable[str], seed: int, step: int) -> str:
    """How one random request ended. INTERNAL_ERROR, or the relay closing the session, fails
    the test; anything else the draft allows is a named outcome."""
    try:
        kind = await request
        return kind if kind == "skipped" else f"{kind}: ok"
    except ValueError as e:  # refused by our own client before sending
        return f"local: {type(e).__name__}"
    except RequestError as e:
        assert e.error_code != RequestErrorCode.INTERNAL_ERROR, (seed, step, e)
        return f"refused: {RequestErrorCode(e.error_code).name}"
    except SessionClosed as e:
        raise AssertionError(f"seed {seed} step {step}: the relay closed the session: {e}")
    except MoqtError as e:
        return f"error: {type(e).__name__}"
    except asyncio.TimeoutError:
        return "timed out"
