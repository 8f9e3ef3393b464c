"""Index Service test fixtures: principals, records, a movable clock and real servers.

Every test that starts a server runs once per replica store, "memory" and "redis" (a real
redis-server, see tests/index_redis/redis_server.py), except those marked `memory_store`:
they move the fake clock past records' expiry, and Redis expires records by its own clock
(tests/index_redis/ tests the same behaviour with real, short TTLs).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from index.app import IndexSettings, create_app
from index.store import MemoryInstanceDirectory, ReplicaStore
from kvsp_moq.auth import Authenticator
from kvsp_moq.protocol.records import replica_id
from kvsp_moq.web import BackgroundServer
from tests.index_redis.redis_server import redis_server, redis_url  # noqa: F401 (fixtures)

COMPAT = "c0" * 32
SCOPE = "5c" * 16
OTHER = "a1" * 16
H1 = "http://h1.test/kvsp/"
H2 = "http://h2.test/kvsp/"
RELAY = "moqt://relay.test:4443/"

#: token -> principal; every test server uses these.
PRINCIPALS = {
    "principal": [
        {"name": "h1", "token": "t-h1", "scopes": [SCOPE], "holders": [H1], "roles": ["holder"]},
        {"name": "h2", "token": "t-h2", "scopes": [SCOPE, OTHER], "holders": [H2],
         "roles": ["holder"]},
        # Publishes on behalf of H1 without being it (e.g. an agent's sidecar).
        {"name": "proxy", "token": "t-proxy", "scopes": [SCOPE], "holders": [H1],
         "roles": ["instance"]},
        {"name": "pc", "token": "t-pc", "scopes": [SCOPE], "roles": ["pc"]},
        {"name": "outsider", "token": "t-out", "scopes": [OTHER], "holders": [H1],
         "roles": ["holder"]},
        {"name": "admin", "token": "t-admin", "scopes": ["*"], "roles": ["admin"]},
        {"name": "scraper", "token": "t-metrics", "roles": ["metrics"]},
    ]
}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def key(i: int) -> str:
    return hashlib.sha256(b"block %d" % i).hexdigest()


def record(block_key: str, *, holder: str = H1, scope: str = SCOPE, compat: str = COMPAT,
           ttl_ms: int = 60_000, layers: int = 4, size: int = 4_000_000,
           residency: list | None = None, moqt_namespace: str | None = None,
           http_holder: str | None = None, **extra: Any) -> dict[str, Any]:
    """A valid Replica Record (§4.4) as JSON, its digests consistent."""
    digests = [hashlib.sha256(f"{block_key}{holder}{i}".encode()).hexdigest()
               for i in range(layers)]
    whole = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    out: dict[str, Any] = {
        "block_key": block_key, "compat_id": compat, "scope_id": scope, "holder": holder,
        "codec": 1, "size": size, "digest": "sha-256:" + whole, "layer_digests": digests,
        "ttl_ms": ttl_ms,
    }
    if residency is not None:
        out["residency"] = residency
    if moqt_namespace is not None:
        out["moqt_namespace"] = moqt_namespace
    if http_holder is not None:
        out["http_holder"] = http_holder
    out.update(extra)
    return out


def path(rec: dict[str, Any]) -> str:
    rid = replica_id(rec["holder"], rec.get("moqt_namespace"))
    return f"replicas/{rec['compat_id']}/{rec['scope_id']}/{rec['block_key']}/{rid}"


def lookup_body(keys: list[str], scope: str = SCOPE, **extra: Any) -> dict[str, Any]:
    return {"scope_id": scope, "compat_id": COMPAT, "block_keys": keys, **extra}


class Clock:
    """Seconds that move only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Index:
    url: str
    settings: IndexSettings
    clock: Clock
    instances: MemoryInstanceDirectory

    @property
    def store(self) -> ReplicaStore:
        return self.settings.store


STORES = ("memory", "redis")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "memory_store: runs against the in-memory store only, "
                                       "since it moves the fake clock past records' expiry")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store_kind" in metafunc.fixturenames:
        only_memory = metafunc.definition.get_closest_marker("memory_store") is not None
        metafunc.parametrize("store_kind", STORES[:1] if only_memory else STORES)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def serve(clock: Clock, store_kind: str, request: pytest.FixtureRequest) -> Any:
    """Start an Index Service on 127.0.0.1 with test settings; stopped after the test."""
    servers: list[BackgroundServer] = []
    stores: list[Any] = []
    url = request.getfixturevalue("redis_url") if store_kind == "redis" else None

    def start(**overrides: Any) -> Index:
        instances = MemoryInstanceDirectory(clock)
        fields: dict[str, Any] = {
            "auth": Authenticator.from_mapping(PRINCIPALS), "clock": clock,
            "instances": instances, "sweep_interval_s": None,
        }
        if url is not None:
            from index.redis_store import RedisReplicaStore

            fields["store"] = RedisReplicaStore(url)
        fields.update(overrides)
        settings = IndexSettings(**fields)
        hooks = []
        if hasattr(settings.store, "aclose"):  # a store with connections: close them
            stores.append(settings.store)
            hooks.append(settings.store.aclose)  # those of the server's loop
        server = BackgroundServer(create_app(settings, on_shutdown=hooks)).start()
        servers.append(server)
        return Index(server.url, settings, clock, instances)

    yield start
    for server in servers:
        server.stop()
    for store in stores:
        await store.aclose()  # the test loop's, when the test used the store itself


@pytest.fixture
async def http() -> Any:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def assert_problem(r: httpx.Response, status: int, problem: str, member: str | None = None
                   ) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["type"] == "urn:kvsp:problem:" + problem, doc
    assert doc["status"] == status
    if member is not None:
        assert doc.get("member") == member, doc
    return doc
