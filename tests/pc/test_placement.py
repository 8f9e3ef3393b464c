"""Ranking as a pure function, the in-process lookup adapter, and who may call the PC."""

import httpx
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.index_client import LookupBlock, LookupResult
from kvsp_moq.protocol.cost import estimate, fetch_us, mean_service_us
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import InstanceStatus, Link, LookupRequest, ReplicaRecord, Residency
from pc.placement import Grouping, PlacementSettings, RouteRequest, directive_for, holds, rank, replica_store_lookup
from tests.pc.fakes import COMPAT, SCOPE_KEY, checkpoint, fake_agents, new_session, pc_server, status, status_path

SCOPE = scope_id(SCOPE_KEY).hex()
HOLDERS = ["http://10.1.0.1/", "http://10.1.0.2/", "http://10.1.0.3/"]
INSTANCES = ["http://10.0.0.1/", "http://10.0.0.2/", "http://10.0.0.3/"]


def rec(key: str, holder: str, size: int, residency=()) -> ReplicaRecord:
    return ReplicaRecord(key, COMPAT, SCOPE, holder, 1, size, "sha-256:" + "00" * 32, 60_000,
                         ("00" * 32,) * 4 if residency else None, residency)


@st.composite
def worlds(draw):
    rates = st.sampled_from([1_000.0, 10_000.0, 100_000.0])
    statuses = [InstanceStatus(i, 1, "active", 60_000, queued=draw(st.integers(0, 4)),
                               prefill_tokens_per_s=draw(st.sampled_from([5e3, 2e4])),
                               links=tuple(Link(h, draw(rates), 20.0) for h in HOLDERS))
                for i in INSTANCES]
    tiers = st.sampled_from([(), (Residency("device", (0, 1)), Residency("host", (2, 3), 500.0))])
    blocks = []
    for n in range(draw(st.integers(0, 12))):
        key = f"{n:064x}"
        where = draw(st.lists(st.sampled_from(HOLDERS + INSTANCES), min_size=1, max_size=3,
                              unique=True))
        size = draw(st.sampled_from([1 << 16, 1 << 20]))
        res = draw(tiers)
        blocks.append(LookupBlock(key, tuple(rec(key, h, size, res) for h in where)))
    return statuses, LookupResult(len(blocks), tuple(blocks))


@given(worlds())
def test_grouped_rank_equals_block_by_block_estimate(world):
    statuses, result = world
    total = 16 * result.matched + 7
    ranked = rank(result, statuses, token_count=total, block_tokens=16)
    for cand in ranked:
        s = cand.status
        plan, resident = [], 0
        for g in Grouping.of(result).groups:
            if any(holds(s.instance, r) for r in g.replicas):
                resident += g.count
            else:   # the same source for each block of the group, as the grouping picks
                j = min(range(len(g.scaled)), key=lambda j: fetch_us(s, (g.scaled[j],)))
                plan += [b.replicas[j] for b in result.blocks
                         if tuple((r.holder, r.size, r.residency) for r in b.replicas)
                         == tuple((r.holder, r.size, r.residency) for r in g.replicas)]
        want = estimate(s, matched_tokens=16 * result.matched, total_tokens=total, plan=plan,
                        service_us=mean_service_us(s))
        assert cand.resident_blocks == resident
        assert abs(cand.cost_us - want.cost_us) <= 1e-6 * max(1.0, want.cost_us)
    costs = [c.cost_us for c in ranked]
    assert costs == sorted(costs)


def test_tier_read_rate_steers_the_source_and_directive_order():
    fast_link = InstanceStatus(INSTANCES[0], 1, "active", 60_000, prefill_tokens_per_s=1000.0,
                               links=(Link(HOLDERS[0], 100_000.0, 10.0),
                                      Link(HOLDERS[1], 50_000.0, 10.0)))
    key = "ab" * 32
    slow_tier = (Residency("disk", (0, 3), 1_000.0),)
    result = LookupResult(1, (LookupBlock(key, (rec(key, HOLDERS[0], 1 << 24, slow_tier),
                                                rec(key, HOLDERS[1], 1 << 24))),))
    req = RouteRequest(SCOPE, COMPAT, (key,), 16, 16, "ref")
    d = directive_for(result, req, fast_link, PlacementSettings())
    # HOLDERS[0] has the faster link, but reads the block from a slow tier.
    assert d.blocks[0].sources == (HOLDERS[1], HOLDERS[0]) and d.request_ref == "ref"
    (cand,) = rank(result, [fast_link], token_count=16, block_tokens=16)
    assert cand.estimate.fetch_us == fetch_us(fast_link, [result.blocks[0].replicas[1]])


async def test_replica_store_adapter():
    from index.store import MemoryReplicaStore

    key = "cd" * 32
    store = MemoryReplicaStore()
    await store.put(rec(key, HOLDERS[0], 100), 42.0)
    calls = []
    real_lookup = store.lookup

    async def counting(*args, **kw):
        calls.append(args)
        return await real_lookup(*args, **kw)

    store.lookup = counting
    lookup = replica_store_lookup(store, lambda: 42.0)
    req = LookupRequest(SCOPE, COMPAT, (key, "ef" * 32))
    first = await lookup(req)
    again = await lookup(req)
    assert first.matched == 1 and first.blocks[0].replicas[0].holder == HOLDERS[0]
    assert again.blocks[0].replicas[0] is first.blocks[0].replicas[0]   # parsed once
    assert calls[0] == (COMPAT, SCOPE, (key, "ef" * 32), 42.0)


async def test_roles_and_scopes(tmp_path):
    with fake_agents(1) as (a,):
        principals = tmp_path / "principals.toml"
        principals.write_text(f'''
[[principal]]
name = "ii"
token = "t-instance"
roles = ["instance"]
scopes = ["{SCOPE}"]
holders = ["{a.url}"]

[[principal]]
name = "tenant"
token = "t-tenant"
roles = ["client"]
scopes = ["{SCOPE}"]

[[principal]]
name = "other"
token = "t-other"
scopes = ["{'22' * 16}"]

[[principal]]
name = "ops"
token = "t-admin"
roles = ["admin"]
scopes = ["*"]
''')

        def auth(token):
            return {"Authorization": f"Bearer {token}"}

        s = new_session()
        route = {"block_keys": [], "scope_id": SCOPE, "compat_id": COMPAT}
        shard_map = {"map": "m", "version": 1,
                     "shards": [{"tokens": [0, 10], "instance": INSTANCES[0]}]}
        with pc_server(str(tmp_path / "pc.db"), principals=str(principals)) as pc:
            async with httpx.AsyncClient(timeout=10) as http:
                st_url = pc.url + status_path(a.url)
                assert (await http.put(st_url, json=status(a.url))).status_code == 401
                r = await http.put(st_url, json=status(a.url), headers=auth("t-tenant"))
                assert r.status_code == 403
                r = await http.put(st_url, json=status(a.url), headers=auth("t-instance"))
                assert r.status_code == 200
                cp_url = f"{pc.url}sessions/{s}/checkpoint"
                body = checkpoint(s, instance=a.url, scope_id=SCOPE)
                assert (await http.put(cp_url, json=body, headers=auth("t-tenant"))).status_code == 403
                assert (await http.put(cp_url, json=body, headers=auth("t-instance"))).status_code == 200
                # Routing: a principal holding the scope, with the client (or admin) role.
                assert (await http.post(pc.url + "route", json=route)).status_code == 401
                r = await http.post(pc.url + "route", json=route, headers=auth("t-other"))
                assert r.status_code == 403
                for token in ("t-tenant", "t-admin"):
                    r = await http.post(pc.url + "route", json=route, headers=auth(token))
                    assert r.status_code == 200 and r.json()["instance"] == a.url
                # Sessions are read by the scope's principals.
                r = await http.get(f"{pc.url}sessions/{s}", headers=auth("t-other"))
                assert r.status_code == 403
                r = await http.get(f"{pc.url}sessions/{s}", headers=auth("t-tenant"))
                assert r.status_code == 200
                # Resharding is for admins.
                r = await http.post(pc.url + "reshard/m", json=shard_map, headers=auth("t-tenant"))
                assert r.status_code == 403
                r = await http.post(pc.url + "reshard/m", json=shard_map, headers=auth("t-admin"))
                assert r.status_code == 201
