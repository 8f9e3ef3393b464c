"""docs/authorization.md is the authorization table, and it is true, cell by cell.

The document's tables are read here: the roles column of each row must be `PERMISSIONS` of its
action; every route the servers serve must have its row and every row a route; every role is
tried against every HTTP row (a role outside the row is refused with `kvsp-forbidden-role`, a
role in it is not); and for every row with a scope rule, a principal of the resource's own scope
is served where a principal of another scope, with the same roles, is refused. Relay rows are
tried against the relay's access policy. The gateway answers in OpenAI's error shape; its
refusals carry the problem name as the error's "code".
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from index.app import IndexSettings
from index.service import create_combined_app
from kvsp_moq.auth import ANY, EVERYONE, PERMISSIONS, ROLES, Action, Authenticator
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import replica_id
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings
from relay.access import AccessPolicy
from relay.access import Action as MoqtAction
from tests.pc.fakes import checkpoint as fake_checkpoint
from tests.pc.fakes import status as fake_status

from .conftest import COMPAT, container

DOC = Path(__file__).resolve().parents[2] / "docs" / "authorization.md"
SERVERS = ("index", "pc", "holder", "agent", "gateway", "every", "relay")

KEYS = {t: hashlib.sha256(f"table scope key {t}".encode()).digest() for t in "abc"}
SCOPES = {t: scope_id(k).hex() for t, k in KEYS.items()}
INST = {t: f"http://inst-{t}.test/" for t in "abc"}
HOLDER = {t: f"http://holder-{t}.test/" for t in "abc"}


def _p(name: str, roles: list[str], scopes: list[str], holders: list[str] = ()) -> dict[str, Any]:
    return {"name": name, "token": f"t-{name}", "roles": roles, "scopes": scopes,
            "holders": list(holders)}


PRINCIPALS: dict[str, Any] = {"principal": [
    # One principal per role, and one with none, for the role cells: every scope and holder,
    # so that only the role decides.
    *(_p(f"role-{r}", [r], [ANY], [ANY]) for r in sorted(ROLES)),
    _p("role-none", [], [ANY], [ANY]),
    # For the scope cells: per tenant, each kind of principal it has.
    *(p for t in "abc" for p in (
        _p(f"client-{t}", ["client"], [SCOPES[t]]),
        _p(f"inst-{t}", ["instance", "holder"], [SCOPES[t]], [INST[t], HOLDER[t]]),
        _p(f"pc-{t}", ["pc"], [SCOPES[t]]),
        _p(f"relay-{t}", ["relay"], [SCOPES[t]]),
    )),
    # The servers' own: the holder and the agent serve tenants a and b.
    _p("holder", ["holder"], [SCOPES["a"], SCOPES["b"]], [ANY]),
    _p("agent", ["instance", "holder"], [SCOPES["a"], SCOPES["b"]], [ANY]),
    _p("admin", ["admin"], [ANY], [ANY]),
    # The gateway's own, towards its PC and the agent: a client of tenants a and b.
    _p("gateway", ["client"], [SCOPES["a"], SCOPES["b"]]),
]}


def tok(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer t-{name}"}


def problem_name(r: httpx.Response) -> str:
    """The problem type of a refusal: a problem document's, or the "code" of an OpenAI-shaped
    error (the gateway's)."""
    body = r.json()
    return body["error"]["code"] if "error" in body else body["type"]


# --------------------------------------------------------------------------- the document


@dataclass(frozen=True)
class Row:
    server: str
    method: str  # an HTTP method, or a MOQT message
    path: str  # "" for MOQT
    action: str  # an Action name, or "-"
    roles: str
    rule: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.server, self.method, self.path)

    def __str__(self) -> str:
        return f"{self.server} {self.method} {self.path}".strip()


def read_rows() -> list[Row]:
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] not in SERVERS:
            continue
        if len(cells) == 6:
            rows.append(Row(*cells))
        elif len(cells) == 5:  # MOQT: server, message, action, roles, rule
            rows.append(Row(cells[0], cells[1], "", cells[2], cells[3], cells[4]))
        else:
            raise AssertionError(f"malformed row: {line}")
    return rows


ROWS = read_rows()
HTTP_ROWS = [r for r in ROWS if r.server != "relay"]
RULES = set(re.findall(r"^\| `([a-z+-]+)` \|", DOC.read_text(encoding="utf-8"), re.M))


def roles_of(row: Row) -> frozenset[str]:
    if row.roles == "(admin only)":
        return frozenset({"admin"})
    if row.roles == "(any valid token)":
        return frozenset({EVERYONE})
    return frozenset(x.strip() for x in row.roles.split(","))


def test_the_document_has_every_kind_of_row() -> None:
    assert {r.server for r in ROWS} == set(SERVERS)
    assert len({r.key for r in ROWS}) == len(ROWS), "a row is listed twice"
    assert {r.rule for r in ROWS} <= RULES, "a rule used in a table is not defined"
    assert {r.rule for r in ROWS} == RULES, "a rule is defined but no row uses it"


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_roles_column_is_the_permission_table(row: Row) -> None:
    if row.action == "-":
        assert row.roles == "-" and row.rule == "open"
        return
    assert roles_of(row) == PERMISSIONS[Action[row.action]], row


def test_every_action_has_a_row() -> None:
    assert {r.action for r in ROWS if r.action != "-"} == {a.name for a in Action}


# --------------------------------------------------------------------------- the servers


@dataclass
class Env:
    http: httpx.Client
    urls: dict[str, str]  # server -> base URL
    apps: dict[str, Any]  # server -> Starlette app (for its routes)
    agent: Any


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    from agent.service import Agent, AgentSettings
    from agent.tiny import ensure_tiny_model
    from kvsp_moq.gateway.app import GatewaySettings
    from kvsp_moq.gateway.app import create_app as create_gateway_app
    from kvsp_moq.holder.service import Holder, HolderSettings
    from pc.app import create_pc_app

    auth = Authenticator.from_mapping(PRINCIPALS)
    db = tmp_path_factory.mktemp("table-pc") / "pc.sqlite3"
    index_app = create_combined_app(IndexSettings(auth=auth, sweep_interval_s=None,
                                                  default_block_tokens=16),
                                    PCSettings(database=str(db)))
    model = ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")
    with BackgroundServer(index_app) as index, \
            Holder(HolderSettings(listen="127.0.0.1:0", auth=auth, index_token="t-holder")) as holder, \
            Agent(AgentSettings(listen="127.0.0.1:0", model=str(model), block_tokens=16,
                                warmup_tokens=0, scope_keys={"a": KEYS["a"], "b": KEYS["b"]},
                                scope="a", auth=auth, token="t-agent")) as agent, \
            httpx.Client(timeout=60, trust_env=False) as http:
        # The gateway has a PC of its own, where only the agent reports (the PC rows route
        # to instances that are not there).
        gateway_pc = create_pc_app(PCSettings(database=str(db.with_name("gateway-pc.sqlite3"))))
        gateway_pc.state.auth = auth
        gateway_app = create_gateway_app(GatewaySettings(
            pc_url="http://unset.test/", model_dir=model, block_tokens=16, auth=auth,
            token="t-gateway", scope_keys={"a": KEYS["a"], "b": KEYS["b"]}))
        with BackgroundServer(gateway_pc) as pc, BackgroundServer(gateway_app) as gateway:
            gateway_app.state.gateway.backend.pc_url = pc.url
            r = http.put(f"{pc.url}instances/{instance_id(agent.url)}/status",
                         json=status_record(agent.url), headers=tok("agent"))
            assert r.status_code == 200, r.text
            yield Env(http, {"index": index.url, "pc": index.url, "holder": holder.url,
                             "agent": agent.url, "gateway": gateway.url},
                      {"index": index_app, "pc": index_app, "holder": holder.app,
                       "agent": agent.app, "gateway": gateway_app},
                      agent)


def served_routes(env: Env) -> set[tuple[str, str, str]]:
    """(server, method, path) of every route of every server; the PC's are those of the
    combined app that the IS alone does not have."""
    from index.app import create_app as create_index_app

    def routes(app: Any) -> set[tuple[str, str]]:
        out = set()
        for route in app.routes:
            methods = set(getattr(route, "methods", None) or ())
            if "GET" in methods:
                methods.discard("HEAD")  # Starlette answers HEAD for every GET itself
            out |= {(m, route.path) for m in methods}
        return out

    common = {("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/openapi.json")}
    index_only = routes(create_index_app(IndexSettings()))
    combined = routes(env.apps["pc"])
    holder = routes(env.apps["holder"])
    agent = routes(env.apps["agent"])
    gateway = routes(env.apps["gateway"])
    out = {("every", m, p) for m, p in common}
    # The gateway's API is OpenAI's: /metrics and /healthz, and no /openapi.json of ours.
    service = common - {("GET", "/openapi.json")}
    assert service <= gateway
    out |= {("gateway", m, p) for m, p in gateway - service}
    for server, found in (("index", index_only), ("pc", combined - index_only),
                          ("holder", holder), ("agent", agent)):
        if server != "pc":  # the PC's routes are the combined app's, less the IS's
            assert common <= found, server
        out |= {(server, m, p) for m, p in found - common}
    # HEAD of a block is its own row: the holder serves it with GET, from one handler.
    for server in ("holder", "agent"):
        out.add((server, "HEAD", "/blocks/{compat}/{scope}/{key}"))
    return out


def test_every_route_has_its_row_and_every_row_a_route(env: Env) -> None:
    documented = {r.key for r in HTTP_ROWS}
    served = served_routes(env)
    assert served - documented == set(), "routes without a row in docs/authorization.md"
    assert documented - served == set(), "rows without a route"


# --------------------------------------------------------------------------- role cells


def concrete(path: str) -> str:
    """A path of the row's shape with well-formed identifiers (of nothing that exists)."""
    values = {"compat": COMPAT, "scope": SCOPES["a"], "key": "ee" * 32, "block_key": "ee" * 32,
              "replica_id": "ee" * 16, "id": instance_id(INST["c"]), "session": str(uuid.uuid4()),
              "map": "no-such-map", "lease": uuid.uuid4().hex, "directive": str(uuid.uuid4()),
              "model": "no-such-model"}
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)


def role_cells() -> list[tuple[Row, str]]:
    return [(row, role) for row in HTTP_ROWS if row.action != "-"
            for role in [*sorted(ROLES), "none"]]


@pytest.mark.parametrize(("row", "role"), role_cells(),
                         ids=lambda x: str(x) if isinstance(x, Row) else x)
def test_role_cell(env: Env, row: Row, role: str) -> None:
    allowed = roles_of(row)
    permitted = role == "admin" or role in allowed or EVERYONE in allowed
    servers = ("index", "holder", "agent") if row.server == "every" else (row.server,)
    for server in servers:
        url = env.urls[server] + concrete(row.path).lstrip("/")
        body = b"{}" if row.method in ("PUT", "POST") else None
        r = env.http.request(row.method, url, headers={**tok(f"role-{role}"),
                                                       "Content-Type": "application/json"},
                             content=body)
        assert r.status_code != 401, (server, r.text)
        role_refusal = r.status_code == 403 and (
            row.method == "HEAD" or problem_name(r).endswith("kvsp-forbidden-role"))
        if permitted:
            assert not role_refusal, (server, r.status_code, r.text)
        else:
            assert role_refusal, (server, r.status_code, r.text)


def test_no_token_is_refused_everywhere_but_the_open_rows(env: Env) -> None:
    for row in HTTP_ROWS:
        for server in (("index", "holder", "agent") if row.server == "every" else (row.server,)):
            r = env.http.request(row.method, env.urls[server] + concrete(row.path).lstrip("/"))
            assert (r.status_code == 401) == (row.rule != "open"), (row, server, r.status_code)


# --------------------------------------------------------------------------- scope cells
#
# One case per row: `own` is a principal of the resource's scope, `other` one of another scope
# with the same roles; the case asserts that the first is served and the second refused.


def refused(r: httpx.Response, *, as_absent: bool = False) -> None:
    if as_absent:
        assert r.status_code == 404, r.text
    else:
        assert r.status_code == 403, r.text
        assert problem_name(r).endswith("kvsp-forbidden-scope"), r.text


def ok(r: httpx.Response, *codes: int) -> httpx.Response:
    assert r.status_code in (codes or (200,)), r.text
    return r


def replica(t: str, n: int) -> dict[str, Any]:
    key = hashlib.sha256(f"table {t} {n}".encode()).hexdigest()
    digests = [hashlib.sha256(f"{key}{i}".encode()).hexdigest() for i in range(2)]
    whole = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    return {"block_key": key, "compat_id": COMPAT, "scope_id": SCOPES[t], "holder": HOLDER[t],
            "codec": 1, "size": 4096, "digest": "sha-256:" + whole, "layer_digests": digests,
            "ttl_ms": 60_000}


def replica_path(rec: dict[str, Any]) -> str:
    return (f"replicas/{rec['compat_id']}/{rec['scope_id']}/{rec['block_key']}/"
            f"{replica_id(rec['holder'], None)}")


def status_record(url: str, epoch: int = 1) -> dict[str, Any]:
    return fake_status(url, epoch=epoch, ttl_ms=600_000)


def checkpoint(session: str, t: str, *, epoch: int = 1, offset: int = 3,
               instance: str | None = None) -> dict[str, Any]:
    """A Session Checkpoint of tenant t's scope."""
    return fake_checkpoint(session, epoch=epoch, offset=offset, instance=instance,
                           scope_id=SCOPES[t])


Case = Callable[[Env, str], None]
CASES: dict[tuple[str, str, str], Case] = {}


def case(server: str, method: str, path: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[(server, method, path)] = fn
        return fn
    return register


# ---- Index Service

@case("index", "PUT", "/replicas/{compat}/{scope}/{block_key}/{replica_id}")
def _(env: Env, base: str) -> None:
    rec = replica("a", 1)
    refused(env.http.put(base + replica_path(rec), json=rec, headers=tok("inst-b")))
    # B's own holder named, A's scope: still refused.
    forged = {**rec, "holder": HOLDER["b"]}
    refused(env.http.put(base + replica_path(forged), json=forged, headers=tok("inst-b")))
    ok(env.http.put(base + replica_path(rec), json=rec, headers=tok("inst-a")), 200, 201)


@case("index", "DELETE", "/replicas/{compat}/{scope}/{block_key}/{replica_id}")
def _(env: Env, base: str) -> None:
    rec = replica("a", 2)
    ok(env.http.put(base + replica_path(rec), json=rec, headers=tok("inst-a")), 200, 201)
    refused(env.http.delete(base + replica_path(rec), headers=tok("inst-b")))
    ok(env.http.delete(base + replica_path(rec), headers=tok("inst-a")), 200, 204)


@case("index", "POST", "/replicas:batch")
def _(env: Env, base: str) -> None:
    recs = [replica("a", 3), replica("a", 4)]
    refused(env.http.post(base + "replicas:batch", json={"records": recs}, headers=tok("inst-b")))
    ok(env.http.post(base + "replicas:batch", json={"records": recs}, headers=tok("inst-a")),
       200, 201)


@case("index", "POST", "/lookup")
def _(env: Env, base: str) -> None:
    rec = replica("a", 5)
    ok(env.http.put(base + replica_path(rec), json=rec, headers=tok("inst-a")), 200, 201)
    body = {"compat_id": COMPAT, "scope_id": SCOPES["a"], "block_keys": [rec["block_key"]]}
    for who in ("inst-b", "pc-b"):
        refused(env.http.post(base + "lookup", json=body, headers=tok(who)))
    for who in ("inst-a", "pc-a"):
        assert ok(env.http.post(base + "lookup", json=body, headers=tok(who))).json()["matched"] == 1


# ---- Placement Controller

EPOCHS = {t: 1 for t in INST}
"""The epoch each test instance reports under (the PC keeps the highest it has seen)."""


def report(env: Env, base: str, t: str, epoch: int | None = None, who: str | None = None
           ) -> httpx.Response:
    return env.http.put(f"{base}instances/{instance_id(INST[t])}/status",
                        json=status_record(INST[t], epoch or EPOCHS[t]),
                        headers=tok(who or f"inst-{t}"))


@case("pc", "PUT", "/instances/{id}/status")
def _(env: Env, base: str) -> None:
    ok(report(env, base, "a"))
    # B speaks for A's instance: neither a higher epoch nor a failure is taken.
    refused(report(env, base, "a", epoch=10**9, who="inst-b"))
    failed = {**status_record(INST["a"], 10**9), "state": "failed"}
    refused(env.http.put(f"{base}instances/{instance_id(INST['a'])}/status", json=failed,
                         headers=tok("inst-b")))
    EPOCHS["a"] += 1
    ok(report(env, base, "a"))


@case("pc", "PUT", "/instances/{id}/state")
def _(env: Env, base: str) -> None:
    ok(report(env, base, "a"))
    url = f"{base}instances/{instance_id(INST['a'])}/state"
    refused(env.http.put(url, json={"state": "sleeping"}, headers=tok("pc-b")))
    # The PC forwards the change to the instance, which is not there: answered all the same.
    r = env.http.put(url, json={"state": "active"}, headers=tok("pc-a"))
    assert r.status_code == 200, r.text


@case("pc", "GET", "/instances")
def _(env: Env, base: str) -> None:
    ok(report(env, base, "a"), 200)
    ok(report(env, base, "b"), 200)
    seen = {t: {i["instance"] for i in ok(env.http.get(base + "instances",
                                                        headers=tok(f"inst-{t}"))).json()["instances"]}
            for t in "ab"}
    assert INST["a"] in seen["a"] and INST["a"] not in seen["b"]
    assert INST["b"] in seen["b"] and INST["b"] not in seen["a"]


@case("pc", "PUT", "/sessions/{session}/checkpoint")
def _(env: Env, base: str) -> None:
    sid = str(uuid.uuid4())
    url = f"{base}sessions/{sid}/checkpoint"
    ok(env.http.put(url, json=checkpoint(sid, "a", instance=INST["a"]), headers=tok("inst-a")))
    # B's instance, in B's scope or claiming A's, with a higher epoch: refused.
    refused(env.http.put(url, json=checkpoint(sid, "b", epoch=51, instance=INST["b"]),
                         headers=tok("inst-b")))
    refused(env.http.put(url, json=checkpoint(sid, "a", epoch=51, instance=INST["b"]),
                         headers=tok("inst-b")))
    ok(env.http.put(url, json=checkpoint(sid, "a", offset=5, instance=INST["a"]),
                    headers=tok("inst-a")))


def a_session(env: Env, base: str) -> str:
    sid = str(uuid.uuid4())
    ok(env.http.put(f"{base}sessions/{sid}/checkpoint", json=checkpoint(sid, "a", instance=INST["a"]),
                    headers=tok("inst-a")))
    return sid


@case("pc", "GET", "/sessions/{session}")
def _(env: Env, base: str) -> None:
    sid = a_session(env, base)
    for who in ("client-b", "inst-b", "pc-b"):
        refused(env.http.get(f"{base}sessions/{sid}", headers=tok(who)))
    for who in ("client-a", "inst-a", "pc-a"):
        assert ok(env.http.get(f"{base}sessions/{sid}", headers=tok(who))).json()["epoch"] == 1


@case("pc", "DELETE", "/sessions/{session}")
def _(env: Env, base: str) -> None:
    sid = a_session(env, base)
    refused(env.http.delete(f"{base}sessions/{sid}", headers=tok("inst-b")))
    ok(env.http.delete(f"{base}sessions/{sid}", headers=tok("inst-a")), 204)


@case("pc", "POST", "/route")
def _(env: Env, base: str) -> None:
    ok(report(env, base, "a"))
    ok(report(env, base, "b"))
    for t in "ab":
        body = {"block_keys": [], "scope_id": SCOPES[t], "compat_id": COMPAT}
        other = "b" if t == "a" else "a"
        refused(env.http.post(base + "route", json=body, headers=tok(f"client-{other}")))
        # Routed, and only ever to an instance of its own scope, however many routes.
        for _n in range(5):
            assert ok(env.http.post(base + "route", json=body,
                                    headers=tok(f"client-{t}"))).json()["instance"] == INST[t]


@case("pc", "GET", "/shardmaps/{map}")
def _(env: Env, base: str) -> None:
    name = f"table-{uuid.uuid4().hex[:8]}"
    body = {"map": name, "version": 1, "scope_id": SCOPES["a"],
            "shards": [{"tokens": [0, 16], "instance": INST["a"]}]}
    ok(env.http.post(f"{base}reshard/{name}", json=body, headers=tok("admin")), 201)
    for who in ("inst-b", "pc-b"):
        refused(env.http.get(f"{base}shardmaps/{name}", headers=tok(who)))
    for who in ("inst-a", "pc-a"):
        assert ok(env.http.get(f"{base}shardmaps/{name}", headers=tok(who))).json()["map"] == name


# ---- holders (and the agent's own holder)

def put_block(env: Env, base: str, t: str, n: int, who: str) -> tuple[str, httpx.Response]:
    key = hashlib.sha256(f"table block {t} {n}".encode()).hexdigest()
    r = env.http.put(f"{base}blocks/{COMPAT}/{SCOPES[t]}/{key}", content=container(n),
                     headers={**tok(who), "If-None-Match": "*"})
    return key, r


def holder_case(method: str, path: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[("holder", method, path)] = fn
        CASES[("agent", method, path)] = fn
        return fn
    return register


@holder_case("GET", "/blocks/{compat}/{scope}/{key}")
def _(env: Env, base: str) -> None:
    key, r = put_block(env, base, "a", 10, "inst-a")
    ok(r, 201, 204)
    url = f"{base}blocks/{COMPAT}/{SCOPES['a']}/{key}"
    refused(env.http.get(url, headers=tok("inst-b")))
    refused(env.http.get(url, headers=tok("relay-b")))
    assert ok(env.http.get(url, headers=tok("inst-a"))).content == container(10)
    ok(env.http.get(url, headers=tok("relay-a")))


@holder_case("HEAD", "/blocks/{compat}/{scope}/{key}")
def _(env: Env, base: str) -> None:
    key, r = put_block(env, base, "a", 11, "inst-a")
    ok(r, 201, 204)
    url = f"{base}blocks/{COMPAT}/{SCOPES['a']}/{key}"
    assert env.http.head(url, headers=tok("inst-b")).status_code == 403
    ok(env.http.head(url, headers=tok("inst-a")))


@holder_case("PUT", "/blocks/{compat}/{scope}/{key}")
def _(env: Env, base: str) -> None:
    _key, r = put_block(env, base, "a", 12, "inst-b")
    refused(r)
    # A scope this server does not serve, with a principal that holds it: refused too.
    _key, r = put_block(env, base, "c", 12, "inst-c")
    refused(r)
    _key, r = put_block(env, base, "a", 12, "inst-a")
    ok(r, 201, 204)


def lease(env: Env, base: str, keys: list[str], who: str) -> httpx.Response:
    return env.http.post(base + "leases", json={"block_keys": keys, "ttl_ms": 5000},
                         headers=tok(who))


@holder_case("POST", "/leases")
def _(env: Env, base: str) -> None:
    key, r = put_block(env, base, "a", 13, "inst-a")
    ok(r, 201, 204)
    absent = hashlib.sha256(b"table no such block").hexdigest()
    foreign, missing = lease(env, base, [key], "inst-b"), lease(env, base, [absent], "inst-b")
    refused(foreign, as_absent=True)
    assert foreign.json()["type"] == missing.json()["type"]  # not an oracle
    granted = ok(lease(env, base, [key], "inst-a"), 201)
    ok(env.http.delete(f"{base}leases/{granted.json()['lease']}", headers=tok("inst-a")), 204)


@holder_case("PUT", "/leases/{lease}")
def _(env: Env, base: str) -> None:
    key, r = put_block(env, base, "a", 14, "inst-a")
    ok(r, 201, 204)
    lid = ok(lease(env, base, [key], "inst-a"), 201).json()["lease"]
    refused(env.http.put(f"{base}leases/{lid}", json={"ttl_ms": 5000}, headers=tok("inst-b")),
            as_absent=True)
    ok(env.http.put(f"{base}leases/{lid}", json={"ttl_ms": 5000}, headers=tok("inst-a")))
    ok(env.http.delete(f"{base}leases/{lid}", headers=tok("inst-a")), 204)


@holder_case("DELETE", "/leases/{lease}")
def _(env: Env, base: str) -> None:
    key, r = put_block(env, base, "a", 15, "inst-a")
    ok(r, 201, 204)
    lid = ok(lease(env, base, [key], "inst-a"), 201).json()["lease"]
    refused(env.http.delete(f"{base}leases/{lid}", headers=tok("inst-b")), as_absent=True)
    ok(env.http.delete(f"{base}leases/{lid}", headers=tok("inst-a")), 204)


# ---- the agent

PROMPT = list(range(500, 500 + 32))


def generate(env: Env, base: str, who: str, scope: str = "a") -> httpx.Response:
    return env.http.post(base + "generate", headers=tok(who),
                         json={"tokens": PROMPT, "max_new_tokens": 2, "scope": scope})


@case("agent", "POST", "/generate")
def _(env: Env, base: str) -> None:
    refused(generate(env, base, "client-b"))
    ok(generate(env, base, "client-a"))


@case("agent", "POST", "/prefill")
def _(env: Env, base: str) -> None:
    def prefill(who: str) -> httpx.Response:
        return env.http.post(base + "prefill", headers=tok(who), json={"tokens": PROMPT, "scope": "a"})
    refused(prefill("client-b"))
    # Past the scope check: this agent has no relay, so it cannot publish a prefill live.
    r = prefill("client-a")
    assert r.status_code == 409 and r.json()["type"].endswith("kvsp-no-live-kv"), r.text


def agent_session(env: Env, base: str) -> dict[str, Any]:
    return ok(generate(env, base, "client-a")).json()


@case("agent", "GET", "/sessions/{session}")
def _(env: Env, base: str) -> None:
    sid = agent_session(env, base)["session"]
    for who in ("client-b", "inst-b", "pc-b"):
        refused(env.http.get(f"{base}sessions/{sid}", headers=tok(who)))
    for who in ("client-a", "inst-a", "pc-a"):
        ok(env.http.get(f"{base}sessions/{sid}", headers=tok(who)))


@case("agent", "DELETE", "/sessions/{session}")
def _(env: Env, base: str) -> None:
    sid = agent_session(env, base)["session"]
    refused(env.http.delete(f"{base}sessions/{sid}", headers=tok("client-b")))
    ok(env.http.delete(f"{base}sessions/{sid}", headers=tok("client-a")), 204)


@case("agent", "GET", "/sessions/{session}/stream")
def _(env: Env, base: str) -> None:
    sid = agent_session(env, base)["session"]
    refused(env.http.get(f"{base}sessions/{sid}/stream", headers=tok("client-b")))
    lines = ok(env.http.get(f"{base}sessions/{sid}/stream", headers=tok("client-a"))).text
    assert lines.strip().splitlines()


@case("agent", "POST", "/sessions/{session}/resume")
def _(env: Env, base: str) -> None:
    session = env.agent.context.engine.sessions[agent_session(env, base)["session"]]
    cp = session.checkpoint(1).to_json()
    url = f"{base}sessions/{session.id}/resume"
    refused(env.http.post(url, json={"checkpoint": cp, "epoch": 2}, headers=tok("pc-b")))
    # The checkpoint moved to B's scope, by B's PC: the session here is A's.
    moved = {**cp, "scope_id": SCOPES["b"]}
    refused(env.http.post(url, json={"checkpoint": moved, "epoch": 2}, headers=tok("pc-b")))
    ok(env.http.post(url, json={"checkpoint": cp, "epoch": 2}, headers=tok("pc-a")), 202)


def directive(t: str) -> dict[str, Any]:
    return {"directive": str(uuid.uuid4()), "scope_id": SCOPES[t],
            "compat_id": "", "blocks": [], "deadline_ms": 5000, "lease_ms": 5000}


@case("agent", "POST", "/prefetch")
def _(env: Env, base: str) -> None:
    body = {**directive("a"), "compat_id": env.agent.context.compat_id}
    refused(env.http.post(base + "prefetch", json=body, headers=tok("pc-b")))
    ok(env.http.post(base + "prefetch", json=body, headers=tok("pc-a")), 202)


@case("agent", "GET", "/prefetch/{directive}")
def _(env: Env, base: str) -> None:
    body = {**directive("a"), "compat_id": env.agent.context.compat_id}
    ok(env.http.post(base + "prefetch", json=body, headers=tok("pc-a")), 202)
    url = f"{base}prefetch/{body['directive']}"
    for who in ("inst-b", "pc-b"):
        refused(env.http.get(url, headers=tok(who)))
    for who in ("inst-a", "pc-a"):
        ok(env.http.get(url, headers=tok(who)))


@case("agent", "PUT", "/state")
def _(env: Env, base: str) -> None:
    epoch = ok(env.http.get(base + "status", headers=tok("pc-a"))).json()["epoch"]
    # The agent serves a and b: a PC principal of one of them cannot put both to sleep.
    for who in ("pc-a", "pc-b"):
        refused(env.http.put(base + "state", json={"state": "sleeping", "epoch": epoch},
                             headers=tok(who)))
    assert ok(env.http.put(base + "state", json={"state": "active", "epoch": epoch},
                           headers=tok("role-pc"))).json()["state"] == "active"


@case("agent", "GET", "/status")
def _(env: Env, base: str) -> None:
    # The agent serves a and b; c is another tenant's.
    for who in ("inst-c", "pc-c"):
        refused(env.http.get(base + "status", headers=tok(who)))
    for who in ("inst-a", "inst-b", "pc-a"):
        ok(env.http.get(base + "status", headers=tok(who)))


def seeded(env: Env, base: str) -> str:
    name = f"table-{uuid.uuid4().hex[:8]}"
    ok(env.http.put(f"{base}shards/{name}", headers=tok("pc-a"),
                    json={"version": 1, "tokens": PROMPT, "ranges": [[0, 16]],
                          "scope_id": SCOPES["a"]}))
    return name


@case("agent", "PUT", "/shards/{map}")
def _(env: Env, base: str) -> None:
    name = f"table-{uuid.uuid4().hex[:8]}"
    body = {"version": 1, "tokens": PROMPT, "ranges": [[0, 16]], "scope_id": SCOPES["a"]}
    refused(env.http.put(f"{base}shards/{name}", json=body, headers=tok("pc-b")))
    ok(env.http.put(f"{base}shards/{name}", json=body, headers=tok("pc-a")))
    # B cannot put its own context under A's map either.
    refused(env.http.put(f"{base}shards/{name}", headers=tok("pc-b"),
                         json={**body, "scope_id": SCOPES["b"]}))


@case("agent", "GET", "/reshard/{map}")
def _(env: Env, base: str) -> None:
    name = seeded(env, base)
    for who in ("inst-b", "pc-b"):
        refused(env.http.get(f"{base}reshard/{name}", headers=tok(who)))
    for who in ("inst-a", "pc-a"):
        assert ok(env.http.get(f"{base}reshard/{name}", headers=tok(who))).json()["ranges"] == [[0, 16]]


@case("agent", "POST", "/reshard")
def _(env: Env, base: str) -> None:
    name = seeded(env, base)
    plan = {"map": name, "from": 1, "to": 2, "deadline_ms": 5000, "retain": [[0, 16]],
            "fetch": [], "release": []}
    refused(env.http.post(base + "reshard", json=plan, headers=tok("pc-b")))
    refused(env.http.post(base + "reshard", json={"map": name, "commit": 2}, headers=tok("pc-b")))
    ok(env.http.post(base + "reshard", json=plan, headers=tok("pc-a")))


@case("agent", "GET", "/kv")
def _(env: Env, base: str) -> None:
    name = seeded(env, base)
    params = {"map": name, "tokens": "0-16"}
    refused(env.http.get(base + "kv", params=params, headers=tok("inst-b")))
    assert ok(env.http.get(base + "kv", params=params, headers=tok("inst-a"))).content


# ---- the gateway

GATEWAY_MODEL = "llama-tiny"


def gateway_case(path: str, body: dict[str, Any]) -> Case:
    def case_fn(env: Env, base: str) -> None:
        url = base + path.lstrip("/")
        request = {"model": GATEWAY_MODEL, "max_tokens": 2, "temperature": 0, **body}
        # B's client naming A's scope: refused; A's client, naming it or not (its only scope
        # here): served, in A's scope, at the agent.
        refused(env.http.post(url, json=request, headers={**tok("client-b"),
                                                          "X-KVSP-Scope": "a"}))
        ok(env.http.post(url, json=request, headers={**tok("client-a"), "X-KVSP-Scope": "a"}))
        ok(env.http.post(url, json=request, headers=tok("client-a")))
        # A principal of several of the gateway's scopes must name one.
        r = env.http.post(url, json=request, headers=tok("gateway"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-KVSP-Scope", r.text
    return case_fn


CASES[("gateway", "POST", "/v1/completions")] = gateway_case(
    "/v1/completions", {"prompt": " ".join(f"w{i}" for i in range(40, 60))})
CASES[("gateway", "POST", "/v1/chat/completions")] = gateway_case(
    "/v1/chat/completions", {"messages": [{"role": "user", "content": "w40 w41 w42"}]})


def scope_rows() -> list[Row]:
    return [r for r in HTTP_ROWS if r.rule not in ("open", "none")]


@pytest.mark.parametrize("row", scope_rows(), ids=str)
def test_scope_cell(env: Env, row: Row) -> None:
    assert row.key in CASES, f"no scope case for {row}"
    CASES[row.key](env, env.urls[row.server])


def test_every_case_is_a_row() -> None:
    assert set(CASES) <= {r.key for r in scope_rows()}


# --------------------------------------------------------------------------- relay cells

MESSAGES = {"PUBLISH_NAMESPACE": MoqtAction.ANNOUNCE, "PUBLISH": MoqtAction.PUBLISH,
            "SUBSCRIBE": MoqtAction.SUBSCRIBE, "TRACK_STATUS": MoqtAction.SUBSCRIBE,
            "FETCH": MoqtAction.FETCH, "SUBSCRIBE_NAMESPACE": MoqtAction.DISCOVER}


def namespace(t: str, holder: str | None = None) -> tuple[bytes, ...]:
    """A block's track namespace in scope t, published by `holder` (None: the three-field
    prefix, which names no publisher)."""
    track = BlockTrack.for_holder(COMPAT, SCOPES[t], "ee" * 32, holder or HOLDER[t])
    return track.namespace if holder is not None else track.namespace[:3]


@pytest.mark.parametrize("row", [r for r in ROWS if r.server == "relay"], ids=str)
def test_relay_cells(row: Row) -> None:
    from kvsp_moq.moqt.errors import UnauthorizedRequest

    policy = AccessPolicy(Authenticator.from_mapping(PRINCIPALS))
    action = MESSAGES[row.method]
    allowed = roles_of(row)

    def permitted(who: str, ns: tuple[bytes, ...]) -> bool:
        try:
            policy.check(action, ns, [f"t-{who}".encode()])
        except UnauthorizedRequest:
            return False
        return True

    full = namespace("a", HOLDER["a"])
    for role in [*sorted(ROLES), "none"]:
        expect = role == "admin" or role in allowed or EVERYONE in allowed
        assert permitted(f"role-{role}", full) == expect, (row, role)
    if row.rule == "filtered":  # discovery: any token, and it reveals only its scopes
        assert policy.may_see(policy.principals([b"t-inst-a"]), full)
        assert not policy.may_see(policy.principals([b"t-inst-b"]), full)
        return
    assert permitted("inst-a", full) and not permitted("inst-b", full)
    if row.rule == "namespace-scope+publisher":
        assert not permitted("inst-a", namespace("a", HOLDER["b"]))  # another publisher
        assert not permitted("inst-a", namespace("a"))  # any publisher: holders * only
        assert permitted("role-holder", namespace("a"))
    else:
        assert permitted("inst-a", namespace("a")) and not permitted("inst-b", namespace("a"))
