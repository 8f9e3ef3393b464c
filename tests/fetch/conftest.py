"""Fixtures of the fetcher tests: the real holders they fetch from are those of tests/holder."""

from tests.holder.conftest import start_holder  # noqa: F401 (a fixture)
