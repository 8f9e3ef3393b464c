"""Fixtures of the Redis store tests: a real redis-server, the store on it, and the IS
fixtures of tests/index bound to the Redis store."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from index.redis_store import RedisReplicaStore
from tests.index.conftest import clock, http, serve  # noqa: F401 (fixtures)
from tests.index_redis.redis_server import own_redis, redis_server, redis_url  # noqa: F401


@pytest.fixture
def store_kind() -> str:
    """`serve` starts Index Services on the Redis store."""
    return "redis"


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisReplicaStore]:  # noqa: F811
    s = RedisReplicaStore(redis_url)
    yield s
    await s.aclose()
