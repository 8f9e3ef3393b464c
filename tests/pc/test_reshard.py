"""Resharding (§6.9): plans as a pure function, then commit or abort over HTTP."""

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol.records import ShardMap, parse_reshard
from pc.reshard import intersect, merge, plan_reshard, subtract
from tests.pc.fakes import fake_agents, pc_server
from tests.polling import eventually

U = ["http://127.0.0.1:9001/", "http://127.0.0.1:9002/", "http://127.0.0.1:9003/",
     "http://127.0.0.1:9004/"]


def smap(version, shards, name="m1"):
    return ShardMap.from_json({"map": name, "version": version,
                               "shards": [{"tokens": list(t), "instance": i} for t, i in shards]})


V4 = [((0, 32768), U[0]), ((32768, 65536), U[1]), ((65536, 98304), U[2])]
V5 = [((0, 49152), U[0]), ((49152, 98304), U[2])]


def test_plan_of_the_draft_example():
    plans = plan_reshard(smap(4, V4), smap(5, V5), 200)
    assert set(plans) == set(U[:3])
    p1, p2, p3 = (plans[u].to_json() for u in U[:3])
    assert p1 == {"map": "m1", "from": 4, "to": 5, "deadline_ms": 200,
                  "retain": [[0, 32768]],
                  "fetch": [{"tokens": [32768, 49152], "from": U[1]}], "release": []}
    assert p2["retain"] == [] and p2["fetch"] == [] and p2["release"] == [[32768, 65536]]
    assert p3["retain"] == [[65536, 98304]]
    assert p3["fetch"] == [{"tokens": [49152, 65536], "from": U[1]}] and p3["release"] == []
    for p in (p1, p2, p3):
        parse_reshard(p)                     # what instances will parse


def test_plan_refusals():
    with pytest.raises(BadRecord) as e:
        plan_reshard(smap(4, V4), smap(6, V5), 200)
    assert e.value.member == "version"
    with pytest.raises(BadRecord) as e:
        plan_reshard(smap(4, V4), smap(5, V5, name="other"), 200)
    assert e.value.member == "map"


def test_range_algebra():
    assert merge([(5, 7), (0, 2), (2, 3)]) == [(0, 3), (5, 7)]
    assert intersect([(0, 10)], [(2, 4), (8, 12)]) == [(2, 4), (8, 10)]
    assert subtract([(0, 10)], [(2, 4), (8, 12)]) == [(0, 2), (4, 8)]


@st.composite
def shard_maps(draw):
    """Two versions over the same context, cut at random points among random instances."""
    def cuts():
        points = sorted(draw(st.sets(st.integers(1, 99), max_size=6)))
        bounds = [0, *points, 100]
        return [((a, b), draw(st.sampled_from(U))) for a, b in zip(bounds, bounds[1:])]
    grow = draw(st.integers(0, 20))
    old = cuts()
    new = cuts()
    new[-1] = ((new[-1][0][0], 100 + grow), new[-1][1])
    return smap(1, old), smap(2, new)


@given(shard_maps())
def test_plans_never_fetch_what_they_retain(maps):
    old, new = maps
    plans = plan_reshard(old, new, 100)
    for inst, plan in plans.items():
        held_old = [s.tokens for s in old.shards if s.instance == inst]
        held_new = [s.tokens for s in new.shards if s.instance == inst]
        retain = list(plan.retain)
        fetched = [f.tokens for f in plan.fetch]
        assert intersect(retain, fetched) == []
        assert merge(retain) == intersect(held_old, held_new)
        assert all(f.source != inst for f in plan.fetch)
        # Each fetched range comes from the instance holding it in the old version.
        for f in plan.fetch:
            assert subtract([f.tokens], [s.tokens for s in old.shards
                                         if s.instance == f.source]) == []
        # Retained + fetched + new tokens nobody held = the new assignment.
        unheld = subtract(held_new, [s.tokens for s in old.shards])
        assert merge(retain + fetched + unheld) == merge(held_new)
        assert merge(plan.release) == subtract(held_old, held_new)


# --------------------------------------------------------------------------- over HTTP


def body(version, shards, **extra):
    return {"map": "m1", "version": version,
            "shards": [{"tokens": list(t), "instance": i} for t, i in shards], **extra}


async def test_reshard_commits_after_every_ack(tmp_path):
    with fake_agents(3) as agents, pc_server(str(tmp_path / "pc.db")) as pc:
        a1, a2, a3 = agents
        a1.reshard_delay_s = 0.15                     # the slowest acknowledges last
        urls = [a.url for a in agents]
        v4 = [(t, urls[i]) for i, (t, _) in enumerate(V4)]
        v5 = [((0, 49152), urls[0]), ((49152, 98304), urls[2])]
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(pc.url + "reshard/m1", json=body(4, v4))
            assert r.status_code == 201                # installed, no traffic
            assert a1.log == []
            r = await http.post(pc.url + "reshard/m1", json=body(5, v5, deadline_ms=2000))
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["committed"] and out["version"] == 5
            assert set(out["acks"].values()) == {"ok"}
            m = (await http.get(pc.url + "shardmaps/m1")).json()
            assert m["version"] == 5
        for a in agents:
            (plan,) = a.received("plan")
            fetched = [tuple(f["tokens"]) for f in plan["fetch"]]
            assert intersect([tuple(x) for x in plan["retain"]], fetched) == []
            assert a.received("decision") == [{"map": "m1", "commit": 5}]
        assert a1.received("plan")[0]["retain"] == [[0, 32768]]
        assert a3.received("plan")[0]["retain"] == [[65536, 98304]]
        # Commit only after the last acknowledgement.
        log = a1.log
        last_ack = max(t for t, _, kind, _ in log if kind == "ack")
        first_commit = min(t for t, _, kind, _ in log if kind == "decision")
        assert first_commit >= last_ack


async def test_reshard_aborts_when_one_member_does_not_ack(tmp_path):
    db = str(tmp_path / "pc.db")
    with fake_agents(3) as agents, pc_server(db) as pc:
        agents[2].reshard_delay_s = 1.0               # misses the 200 ms deadline
        urls = [a.url for a in agents]
        v4 = [(t, urls[i]) for i, (t, _) in enumerate(V4)]
        v5 = [((0, 49152), urls[0]), ((49152, 98304), urls[2])]
        async with httpx.AsyncClient(timeout=10) as http:
            await http.post(pc.url + "reshard/m1", json=body(4, v4))
            out = (await http.post(pc.url + "reshard/m1", json=body(5, v5, deadline_ms=200))).json()
            assert not out["committed"] and out["version"] == 4
            assert out["acks"][urls[2]] == "timeout"
            assert (await http.get(pc.url + "shardmaps/m1")).json()["version"] == 4
            for a in agents:
                assert a.received("decision") == [{"map": "m1", "abort": 5}]
            # A wrong version is refused and the map is untouched.
            r = await http.post(pc.url + "reshard/m1", json=body(7, v5))
            assert r.status_code == 400 and r.json()["member"] == "version"
            r = await http.post(pc.url + "reshard/m2", json=body(5, v5))
            assert r.status_code == 400 and r.json()["member"] == "map"
    with pc_server(db) as pc:                          # the map survives a restart
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(pc.url + "shardmaps/m1")).json()["version"] == 4
            assert (await http.get(pc.url + "shardmaps/zz")).status_code == 404


async def test_a_reshard_its_pc_left_is_finished_by_the_pc_after_it(tmp_path):
    """The PC running a reshard died between its plans and its decision (its pending reshard
    is in the store); the PC after it (a restart on the same file, or the one doing the duties
    on a shared store) sends the members abort, or commit where v+1 was installed."""
    import time

    from pc.reshard import PendingReshard, ShardMapStore
    from pc.sessions import open_database

    db = str(tmp_path / "pc.db")
    with fake_agents(2) as agents:
        urls = [a.url for a in agents]
        conn = open_database(db)
        left = ShardMapStore(conn)
        left.put(ShardMap.from_json(body(4, [((0, 65536), urls[0]), ((65536, 98304), urls[1])])))
        left.begin(PendingReshard("m1", 5, tuple(urls), time.time() - 1))
        left.put(ShardMap.from_json({**body(4, []), "map": "m2", "shards": [
            {"tokens": [0, 10], "instance": urls[0]}], "version": 8}))
        left.begin(PendingReshard("m2", 8, (urls[0],), time.time() - 1))  # v8 installed: commit
        left.begin(PendingReshard("m3", 2, (urls[1],), time.time() + 600))  # still running
        conn.close()
        with pc_server(db) as pc:
            await eventually(lambda: len(agents[0].received("decision")) == 2
                             and len(agents[1].received("decision")) == 1, timeout=10,
                             what="the left reshards finished")
            assert [p.map for p in pc.pc.maps.abandoned(time.time() + 3600)] == ["m3"]
        assert sorted(agents[0].received("decision"), key=lambda d: d["map"]) == [
            {"map": "m1", "abort": 5}, {"map": "m2", "commit": 8}]
        assert agents[1].received("decision") == [{"map": "m1", "abort": 5}]


async def test_a_reshard_that_ends_leaves_nothing_pending(tmp_path):
    import time

    with fake_agents(2) as agents, pc_server(str(tmp_path / "pc.db")) as pc:
        urls = [a.url for a in agents]
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(pc.url + "reshard/m1", json=body(4, [((0, 65536), urls[0]),
                                                                      ((65536, 98304), urls[1])]))
            assert r.status_code == 201
            r = await http.post(pc.url + "reshard/m1", json=body(5, [((0, 98304), urls[0])],
                                                                 deadline_ms=2000))
            assert r.status_code == 200 and r.json()["committed"]
        assert pc.pc.maps.abandoned(time.time() + 3600) == []
