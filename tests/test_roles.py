"""Roles (kvsp_moq.auth.PERMISSIONS) at every HTTP resource: a principal whose roles may not
take the action is refused with a 403 kvsp-forbidden-role problem and nothing changes; one
whose role may, succeeds. Every principal here holds the scope and may publish for the holder,
so a refusal can only be for its roles. (The relay's MOQT side: tests/relay/test_access_roles.py.)
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.auth import OPEN, PERMISSIONS, ROLES, Action, Authenticator, Principal
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.web import BackgroundServer
from tests.holder.conftest import make_block
from tests.index.conftest import H1, key, lookup_body, path, record
from tests.pc.fakes import COMPAT as PC_COMPAT
from tests.pc.fakes import checkpoint, fake_agents, pc_server, status, status_path

SCOPE_KEY = bytes(range(7, 39))
SCOPE = scope_id(SCOPE_KEY).hex()
NAMES = ("holder", "pc", "instance", "relay", "client", "admin", "none")

PRINCIPALS: dict[str, Any] = {"principal": [
    {"name": n, "token": f"t-{n}", "scopes": [SCOPE], "holders": ["*"],
     "roles": [] if n == "none" else [n]} for n in NAMES]}
AUTH = Authenticator.from_mapping(PRINCIPALS)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer t-{name}"}


def allowed(action: Action) -> list[str]:
    return [n for n in NAMES if n == "admin" or n in PERMISSIONS[action]]


def refused(action: Action) -> list[str]:
    return [n for n in NAMES if n not in allowed(action)]


def assert_refused(r: httpx.Response, action: Action) -> None:
    assert r.status_code == 403, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["type"] == "urn:kvsp:problem:kvsp-forbidden-role"
    assert f"lacks a role that may {action.value}" in problem["detail"]


def test_the_table_covers_every_action_and_admin_and_open_may_everything():
    assert set(PERMISSIONS) == set(Action)
    for action, roles in PERMISSIONS.items():
        assert roles <= ROLES | {"*"}, action
        assert OPEN.may(action) and Principal("a", roles=frozenset({"admin"})).may(action)
        for role in ROLES - {"admin"}:
            assert Principal("p", roles=frozenset({role})).may(action) == (
                role in roles or "*" in roles), (action, role)
    # Only discovery at a relay is open to any valid token; nothing else to a role-less one.
    nobody = Principal("nobody", frozenset({"*"}), frozenset({"*"}))
    assert [a for a in Action if nobody.may(a)] == [Action.DISCOVER]


def test_a_principals_file_with_an_unknown_role_is_refused():
    from kvsp_moq.errors import BadRecord
    with pytest.raises(BadRecord):
        Authenticator.from_mapping({"principal": [{"token": "t", "roles": ["tenant"]}]})


# --------------------------------------------------------------------------- Index Service


@pytest.fixture(scope="module")
def index() -> Iterator[tuple[str, IndexSettings]]:
    settings = IndexSettings(auth=AUTH, sweep_interval_s=None)
    with BackgroundServer(create_index_app(settings)) as server:
        yield server.url, settings


def matched(c: httpx.Client, url: str, k: str) -> int:
    r = c.post(url + "lookup", json=lookup_body([k], scope=SCOPE), headers=auth("admin"))
    assert r.status_code == 200
    return r.json()["matched"]


def test_index_publishing_needs_holder_or_instance(index) -> None:
    url, _ = index
    action = Action.PUBLISH_REPLICAS
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as c:
        for n, name in enumerate(refused(action)):
            rec = record(key(100 + n), scope=SCOPE, holder=H1)
            assert_refused(c.put(path(rec), json=rec, headers=auth(name)), action)
            assert_refused(c.post(url + "replicas:batch", json={"records": [rec]}, headers=auth(name)),
                           action)
            assert matched(c, url, rec["block_key"]) == 0
        for n, name in enumerate(allowed(action)):
            rec = record(key(200 + n), scope=SCOPE, holder=H1)
            assert c.put(path(rec), json=rec, headers=auth(name)).status_code == 201
            assert matched(c, url, rec["block_key"]) == 1
            for other in refused(action):
                assert_refused(c.delete(path(rec), headers=auth(other)), action)
            assert matched(c, url, rec["block_key"]) == 1
            assert c.delete(path(rec), headers=auth(name)).status_code == 204
            assert matched(c, url, rec["block_key"]) == 0
            batch = {"records": [record(key(300 + n), scope=SCOPE, holder=H1)]}
            assert c.post(url + "replicas:batch", json=batch, headers=auth(name)).status_code == 200


def test_index_lookup_needs_instance_pc_or_holder(index) -> None:
    url, _ = index
    body = lookup_body([key(1)], scope=SCOPE)
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as c:
        for name in refused(Action.LOOKUP):
            assert_refused(c.post("lookup", json=body, headers=auth(name)), Action.LOOKUP)
        for name in allowed(Action.LOOKUP):
            assert c.post("lookup", json=body, headers=auth(name)).status_code == 200
    assert set(allowed(Action.LOOKUP)) == {"instance", "pc", "holder", "admin"}


# --------------------------------------------------------------------------- holder


@pytest.fixture(scope="module")
def holder() -> Iterator[Holder]:
    h = Holder(HolderSettings(listen="127.0.0.1:0", auth=AUTH)).start()
    try:
        yield h
    finally:
        h.stop()


PUT = {"If-None-Match": "*"}


def test_holder_storing_needs_instance_or_holder(holder: Holder) -> None:
    action = Action.STORE_BLOCKS
    with httpx.Client(base_url=holder.url, timeout=10, trust_env=False) as c:
        for n, name in enumerate(refused(action)):
            block = make_block(10 + n, scope=SCOPE)
            assert_refused(c.put(block.path, content=block.data, headers=PUT | auth(name)), action)
            assert block.bid not in holder.store
            assert c.get(block.path, headers=auth("admin")).status_code == 404
        for n, name in enumerate(allowed(action)):
            block = make_block(20 + n, scope=SCOPE)
            r = c.put(block.path, content=block.data, headers=PUT | auth(name))
            assert r.status_code == 201, r.text
            assert block.bid in holder.store


def test_holder_reading_and_leases_need_instance_holder_or_relay(holder: Holder) -> None:
    action = Action.READ_BLOCKS
    block = make_block(40, scope=SCOPE)
    lease_body = {"block_keys": [block.bid.block_key], "ttl_ms": 5_000}
    with httpx.Client(base_url=holder.url, timeout=10, trust_env=False) as c:
        assert c.put(block.path, content=block.data, headers=PUT | auth("holder")).status_code == 201
        leases = len(holder.leases)
        for name in refused(action):
            assert_refused(c.get(block.path, headers=auth(name)), action)
            assert c.head(block.path, headers=auth(name)).status_code == 403  # no body
            assert_refused(c.post("leases", json=lease_body, headers=auth(name)), action)
            assert len(holder.leases) == leases
        for name in allowed(action):
            r = c.get(block.path, headers=auth(name))
            assert r.status_code == 200 and r.content == block.data
            r = c.post("leases", json=lease_body, headers=auth(name))
            assert r.status_code == 201, r.text
            lease = r.headers["location"]
            for other in refused(action):
                assert_refused(c.put(lease, json={"ttl_ms": 1000}, headers=auth(other)), action)
                assert_refused(c.delete(lease, headers=auth(other)), action)
            assert c.put(lease, json={"ttl_ms": 1000}, headers=auth(name)).status_code == 200
            assert c.delete(lease, headers=auth(name)).status_code == 204
    assert set(allowed(action)) == {"instance", "holder", "relay", "admin"}


# --------------------------------------------------------------------------- PC


def principals_file(tmp_path: Path) -> str:
    lines = []
    for p in PRINCIPALS["principal"]:
        lines += ["[[principal]]", f'name = "{p["name"]}"', f'token = "{p["token"]}"',
                  f'scopes = ["{SCOPE}"]', 'holders = ["*"]',
                  "roles = [" + ", ".join(f'"{r}"' for r in p["roles"]) + "]", ""]
    out = tmp_path / "principals.toml"
    out.write_text("\n".join(lines))
    return str(out)


def test_pc_resources_check_roles(tmp_path: Path) -> None:
    with fake_agents(1) as (agent,), pc_server(str(tmp_path / "pc.db"),
                                               principals=principals_file(tmp_path)) as pc, \
            httpx.Client(base_url=pc.url, timeout=10, trust_env=False) as c:
        def instances() -> list:
            r = c.get("instances", headers=auth("admin"))
            assert r.status_code == 200
            return r.json()["instances"]

        # Instance status: instances only; the table stays empty until one reports.
        st = status(agent.url)
        for name in refused(Action.REPORT):
            assert_refused(c.put(status_path(agent.url), json=st, headers=auth(name)), Action.REPORT)
        assert instances() == []
        assert c.put(status_path(agent.url), json=st, headers=auth("instance")).status_code == 200
        assert [i["instance"] for i in instances()] == [agent.url]

        # Checkpoints and the end of a session: instances only.
        session = str(uuid.uuid4())
        body = checkpoint(session, instance=agent.url, scope_id=SCOPE)
        for name in refused(Action.REPORT):
            assert_refused(c.put(f"sessions/{session}/checkpoint", json=body, headers=auth(name)),
                           Action.REPORT)
            assert c.get(f"sessions/{session}", headers=auth("admin")).status_code == 404
        assert c.put(f"sessions/{session}/checkpoint", json=body,
                     headers=auth("instance")).status_code == 200

        # Reading a session: its client, the PC, instances.
        for name in refused(Action.READ_SESSIONS):
            assert_refused(c.get(f"sessions/{session}", headers=auth(name)), Action.READ_SESSIONS)
        for name in allowed(Action.READ_SESSIONS):
            assert c.get(f"sessions/{session}", headers=auth(name)).status_code == 200
        for name in refused(Action.REPORT):
            assert_refused(c.delete(f"sessions/{session}", headers=auth(name)), Action.REPORT)
        assert c.get(f"sessions/{session}", headers=auth("admin")).status_code == 200

        # Routing: clients and the PC; a principal with the scope and no role no longer may.
        route = {"block_keys": [], "scope_id": SCOPE, "compat_id": PC_COMPAT}
        for name in refused(Action.ROUTE):
            assert_refused(c.post("route", json=route, headers=auth(name)), Action.ROUTE)
        assert "none" in refused(Action.ROUTE) and "instance" in refused(Action.ROUTE)
        for name in allowed(Action.ROUTE):
            r = c.post("route", json=route, headers=auth(name))
            assert r.status_code == 200 and r.json()["instance"] == agent.url

        # State changes go through the PC's role; nothing reaches the instance otherwise.
        for name in refused(Action.DIRECT):
            r = c.put(f"instances/{status_path(agent.url).split('/')[1]}/state",
                      json={"state": "draining"}, headers=auth(name))
            assert_refused(r, Action.DIRECT)
        assert agent.received("state") == []
        assert instances()[0]["state"] == "active"

        # Observing the cluster: the PC and instances.
        for name in refused(Action.OBSERVE):
            assert_refused(c.get("instances", headers=auth(name)), Action.OBSERVE)
            assert_refused(c.get("shardmaps/m", headers=auth(name)), Action.OBSERVE)
        for name in allowed(Action.OBSERVE):
            assert c.get("instances", headers=auth(name)).status_code == 200

        # Resharding at the PC: admin only.
        shard_map = {"map": "m", "version": 1,
                     "shards": [{"tokens": [0, 10], "instance": agent.url}]}
        for name in refused(Action.RESHARD):
            assert_refused(c.post("reshard/m", json=shard_map, headers=auth(name)), Action.RESHARD)
        assert c.get("shardmaps/m", headers=auth("pc")).status_code == 404
        assert c.post("reshard/m", json=shard_map, headers=auth("admin")).status_code == 201


# --------------------------------------------------------------------------- instance


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, index) -> Iterator[Any]:
    from agent.service import Agent, AgentSettings
    from agent.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")
    settings = AgentSettings(listen="127.0.0.1:0", model=str(model), block_tokens=16,
                             warmup_tokens=0, scope_keys={"a": SCOPE_KEY}, scope="a",
                             auth=AUTH, token="t-instance", index_url=index[0])
    with Agent(settings) as a:
        yield a


def test_instance_resources_check_roles(agent) -> None:
    engine = agent.context.engine
    gen = {"tokens": list(range(3, 40)), "max_new_tokens": 2,
           "sampler": {"method": "greedy"}}
    with httpx.Client(base_url=agent.url, timeout=60, trust_env=False) as c:
        # Generating: clients only.
        for name in refused(Action.GENERATE):
            assert_refused(c.post("generate", json=gen, headers=auth(name)), Action.GENERATE)
        assert engine.sessions == {}
        r = c.post("generate", json=gen, headers=auth("client"))
        assert r.status_code == 200, r.text
        session = r.json()["session"]

        for name in refused(Action.READ_SESSIONS):
            assert_refused(c.get(f"sessions/{session}", headers=auth(name)), Action.READ_SESSIONS)
            assert_refused(c.get(f"sessions/{session}/stream", headers=auth(name)),
                           Action.READ_SESSIONS)
        for name in allowed(Action.READ_SESSIONS):
            assert c.get(f"sessions/{session}", headers=auth(name)).status_code == 200

        # Directions from the PC: prefetch, state, resume, reshard, seeding shards.
        directive = {"directive": str(uuid.uuid4()), "scope_id": SCOPE,
                     "compat_id": agent.context.compat_id, "blocks": [], "deadline_ms": 50,
                     "lease_ms": 1000}
        epoch = agent.context.epoch
        for name in refused(Action.DIRECT):
            for method, where, body in (
                    ("POST", "prefetch", directive),
                    ("PUT", "state", {"state": "sleeping", "epoch": epoch}),
                    ("POST", f"sessions/{uuid.uuid4()}/resume", {"checkpoint": {}, "epoch": 2}),
                    ("POST", "reshard", {}),
                    ("PUT", "shards/m", {})):
                assert_refused(c.request(method, where, json=body, headers=auth(name)),
                               Action.DIRECT)
        assert engine.state == "active"
        assert agent.context.prefetcher.get(directive["directive"]) is None
        r = c.put("state", json={"state": "active", "epoch": epoch}, headers=auth("pc"))
        assert r.status_code == 200
        assert c.post("prefetch", json=directive, headers=auth("pc")).status_code == 202

        for name in refused(Action.OBSERVE):
            for where in ("status", f"prefetch/{directive['directive']}", "reshard/m"):
                assert_refused(c.get(where, headers=auth(name)), Action.OBSERVE)
        for name in allowed(Action.OBSERVE):
            assert c.get("status", headers=auth(name)).status_code == 200

        for name in refused(Action.TRANSFER_SHARDS):
            assert_refused(c.get("kv", params={"map": "m", "tokens": "0-16"}, headers=auth(name)),
                           Action.TRANSFER_SHARDS)
