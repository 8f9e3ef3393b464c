"""The polling helpers every waiting test relies on: they hand back what was awaited, and a wait
that runs out fails within its bound, naming what it waited for."""

from __future__ import annotations

import time

import pytest

from tests.polling import eventually, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    looks = iter([0, None, [], {"found": 1}, "later"])
    assert wait_until(lambda: next(looks), timeout=5, what="a value", step=0) == {"found": 1}


def test_wait_until_fails_within_its_bound_naming_what_it_waited_for() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"the sky falling: not within 0.1 s"):
        wait_until(lambda: False, timeout=0.1, what="the sky falling", step=0.01)
    assert time.monotonic() - start < 5


def test_ignored_exceptions_count_as_not_yet_and_others_propagate() -> None:
    calls = []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise OSError("not up yet")
        return True

    assert wait_until(flaky, timeout=5, what="a server", step=0, ignoring=(OSError,)) is True
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], timeout=5, what="a key", ignoring=(OSError,))


async def test_eventually_takes_plain_and_awaitable_predicates() -> None:
    looks = iter([False, False, "plain"])
    assert await eventually(lambda: next(looks), timeout=5, what="a plain value", step=0) == "plain"

    async def answer() -> int:
        return 42

    assert await eventually(answer, timeout=5, what="an awaited value") == 42
    with pytest.raises(AssertionError, match=r"nothing: not within 0.05 s"):
        await eventually(lambda: None, timeout=0.05, what="nothing", step=0.01)
