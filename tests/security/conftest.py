"""Two tenants, A and B, each holding one scope, and real servers on 127.0.0.1 that know them.

Every server of these tests reads the same principals, so a refusal seen at one component
cannot be an artefact of another component's configuration.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import httpx
import pytest

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.auth import Authenticator
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.protocol.container import encode
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.web import BackgroundServer

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
SCOPE_A = scope_id(KEY_A).hex()
SCOPE_B = scope_id(KEY_B).hex()
COMPAT = "c0" * 32
HOLDER_A = "http://holder-a.test/"
HOLDER_B = "http://holder-b.test/"
TOKEN_A, TOKEN_B, TOKEN_AGENT = "tok-tenant-a", "tok-tenant-b", "tok-agent"
TOKEN_METRICS = "tok-metrics"  # the operator's scraper: /metrics and nothing else

PRINCIPALS: dict[str, Any] = {"principal": [
    {"name": "tenant-a", "token": TOKEN_A, "scopes": [SCOPE_A], "holders": [HOLDER_A],
     "roles": ["holder", "pc", "instance", "client"]},
    {"name": "tenant-b", "token": TOKEN_B, "scopes": [SCOPE_B], "holders": [HOLDER_B],
     "roles": ["holder", "pc", "instance", "client"]},
    # An instance serving both tenants: what a confused deputy would act with.
    {"name": "agent", "token": TOKEN_AGENT, "scopes": [SCOPE_A, SCOPE_B], "holders": ["*"],
     "roles": ["instance"]},
    {"name": "scraper", "token": TOKEN_METRICS, "roles": ["metrics"]},
]}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def bkey(n: int, tenant: str = "b") -> str:
    return hashlib.sha256(f"{tenant} block {n}".encode()).hexdigest()


def container(n: int, layers: int = 2, section: int = 256) -> bytes:
    """A small valid KVB1 container (distinct content per `n`)."""
    raw = hashlib.sha256(str(n).encode()).digest() * (2 * layers * section // 32)
    mv = memoryview(raw)
    parts = [(mv[2 * i * section:(2 * i + 1) * section],
              mv[(2 * i + 1) * section:(2 * i + 2) * section]) for i in range(layers)]
    return encode(0, 16, parts)


def replica(block_key: str, scope: str, holder: str, n: int = 0) -> dict[str, Any]:
    """A Replica Record (§4.4) with consistent digests."""
    digests = [hashlib.sha256(f"{block_key}{holder}{i}".encode()).hexdigest() for i in range(2)]
    whole = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    return {"block_key": block_key, "compat_id": COMPAT, "scope_id": scope, "holder": holder,
            "codec": 1, "size": 4096 + n, "digest": "sha-256:" + whole,
            "layer_digests": digests, "ttl_ms": 60_000}


def authenticator() -> Authenticator:
    return Authenticator.from_mapping(PRINCIPALS)


@pytest.fixture(scope="module")
def index_server() -> Iterator[tuple[str, IndexSettings]]:
    settings = IndexSettings(auth=authenticator(), sweep_interval_s=None)
    with BackgroundServer(create_index_app(settings)) as server:
        yield server.url, settings


@pytest.fixture(scope="module")
def index_url(index_server: tuple[str, IndexSettings]) -> str:
    return index_server[0]


@pytest.fixture(scope="module")
def holder() -> Iterator[Holder]:
    h = Holder(HolderSettings(listen="127.0.0.1:0", auth=authenticator())).start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="session")
def agent_index() -> Iterator[tuple[str, IndexSettings]]:
    """The Index Service the agent publishes to (its own, so other tests' records stay apart)."""
    settings = IndexSettings(auth=authenticator(), sweep_interval_s=None)
    with BackgroundServer(create_index_app(settings)) as server:
        yield server.url, settings


@pytest.fixture(scope="session")
def agent(tmp_path_factory: pytest.TempPathFactory,
          agent_index: tuple[str, IndexSettings]) -> Iterator[Any]:
    """One agent on the tiny model for the whole session: starting one is the slow part."""
    from agent.service import Agent, AgentSettings
    from agent.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")
    settings = AgentSettings(listen="127.0.0.1:0", model=str(model), block_tokens=16,
                             warmup_tokens=0, scope_keys={"a": KEY_A, "b": KEY_B}, scope="a",
                             auth=authenticator(), token=TOKEN_AGENT, index_url=agent_index[0])
    with Agent(settings) as a:
        yield a


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        yield c


#: The one principal of the fuzzed servers: every scope, holder and role, so a request is refused
#: for what it says and not for who sent it, while a missing or wrong token still gets a 401.
FUZZ_TOKEN = "tok-fuzz"


def fuzz_authenticator() -> Authenticator:
    return Authenticator.from_mapping({"principal": [
        {"name": "fuzz", "token": FUZZ_TOKEN, "scopes": ["*"], "holders": ["*"],
         "roles": ["admin"]}]})


@pytest.fixture(scope="module")
def fuzz_index_pc_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Index Service and the PC in one app with its own store (fuzzing writes freely)."""
    from index.service import create_combined_app
    from pc.app import PCSettings

    db = tmp_path_factory.mktemp("fuzz-pc") / "pc.sqlite3"
    app = create_combined_app(IndexSettings(auth=fuzz_authenticator(), sweep_interval_s=None),
                              PCSettings(database=str(db)))
    with BackgroundServer(app) as server:
        yield server.url


@pytest.fixture(scope="module")
def fuzz_holder() -> Iterator[Holder]:
    """A holder of its own, so fuzzed writes never meet the tenants' blocks."""
    h = Holder(HolderSettings(listen="127.0.0.1:0", auth=fuzz_authenticator())).start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def fuzz_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An agent of its own: fuzzing changes its state, which the shared agent must keep."""
    from agent.service import Agent, AgentSettings
    from agent.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")
    settings = AgentSettings(listen="127.0.0.1:0", model=str(model), block_tokens=16,
                             warmup_tokens=0, scope_keys={"a": KEY_A, "b": KEY_B}, scope="a",
                             auth=fuzz_authenticator(), max_new_tokens=4)
    with Agent(settings) as a:
        yield a
