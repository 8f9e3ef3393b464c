"""Fixtures of the shared-PC tests: a real redis-server (tests/index_redis) and an HTTP client."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest

from tests.index_redis.redis_server import own_redis, redis_server, redis_url  # noqa: F401


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client
