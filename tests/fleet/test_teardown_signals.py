"""A fleet's teardown is not cut short by a second ^C or SIGTERM (timeout(1) signals the command
and then its process group: the command gets two), which left processes and namespaces behind."""

from __future__ import annotations

import os
import signal

import pytest

from kvsp_moq.fleet.services import terminate_as_interrupt, uninterrupted


def test_signals_during_the_teardown_are_ignored_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with terminate_as_interrupt():
        with pytest.raises(KeyboardInterrupt):  # the first one interrupts the work ...
            os.kill(os.getpid(), signal.SIGTERM)
        with uninterrupted():  # ... the next ones do not interrupt the teardown
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            torn_down = True
        assert torn_down
        with pytest.raises(KeyboardInterrupt):  # and afterwards a signal interrupts again
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is before
