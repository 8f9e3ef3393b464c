"""The QUIC engine of the session-pair tests: a module that marks its tests with
`pytest.mark.usefixtures("pair_engine")` runs each of them on every engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import pair


@pytest.fixture(params=pair.ENGINES)
def pair_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The engine of the SessionPairs a test makes without naming one."""
    monkeypatch.setattr(pair, "default_engine", request.param)
    yield request.param
