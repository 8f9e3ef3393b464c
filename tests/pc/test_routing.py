"""Lifecycle and routing over HTTP: a real PC and fake instances on 127.0.0.1."""

import asyncio

import httpx
import pytest

from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.protocol.keys import block_keys, scope_id
from pc.lifecycle import LifecycleSettings
from pc.placement import PlacementSettings
from tests.pc.fakes import COMPAT, SCOPE_KEY, fake_agents, pc_server, replica, status, status_path
from tests.polling import eventually

SCOPE = scope_id(SCOPE_KEY).hex()
B = 16


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def prompt(n_blocks=8, extra=5):
    tokens = list(range(1000, 1000 + n_blocks * B + extra))
    keys = [k.hex() for k in block_keys(SCOPE_KEY, bytes.fromhex(COMPAT), tokens, B)]
    return tokens, keys


async def put_status(http, pc, body):
    return await http.put(pc.url + status_path(body["instance"]), json=body)


# --------------------------------------------------------------------------- lifecycle


async def test_status_epochs_ids_and_bodies(tmp_path, http):
    with fake_agents(1) as (a,), pc_server(str(tmp_path / "pc.db")) as pc:
        r = await put_status(http, pc, status(a.url, epoch=7))
        assert r.status_code == 200 and r.json() == {"state": "active"}
        r = await put_status(http, pc, status(a.url, epoch=6))
        assert r.status_code == 409
        assert r.json()["type"] == "urn:kvsp:problem:kvsp-stale-epoch"
        # The id in the path must name the body's instance.
        r = await http.put(pc.url + status_path("http://127.0.0.1:1/"), json=status(a.url, epoch=8))
        assert r.status_code == 400 and r.json()["member"] == "instance"
        # Malformed bodies name the member at fault.
        bad = status(a.url, epoch=8)
        del bad["ttl_ms"]
        r = await put_status(http, pc, bad)
        assert r.status_code == 400 and r.json()["member"] == "ttl_ms"
        r = await http.put(pc.url + status_path(a.url), content=b"{not json")
        assert r.status_code == 400 and r.json()["member"] == "body"
        listed = (await http.get(pc.url + "instances")).json()["instances"]
        assert [(i["instance"], i["epoch"], i["id"]) for i in listed] == [
            (a.url, 7, instance_id(a.url))]


async def test_expiry_marks_failed_and_never_routes_there(tmp_path, http):
    with fake_agents(1) as (a,), pc_server(str(tmp_path / "pc.db")) as pc:
        await put_status(http, pc, status(a.url, ttl_ms=150))

        async def failed():
            listed = (await http.get(pc.url + "instances")).json()["instances"]
            return listed[0]["state"] == "failed"

        await eventually(failed, timeout=3, what="the instance failed")
        r = await http.post(pc.url + "route", json={"tokens": list(range(40)), "scope": "tenant",
                                                    "compat_id": COMPAT})
        assert r.status_code == 503 and r.json()["type"].endswith("kvsp-no-instance")
        # The same incarnation stays failed; a restart comes back.
        assert (await put_status(http, pc, status(a.url)) ).json() == {"state": "failed"}
        assert (await put_status(http, pc, status(a.url, epoch=2))).json() == {"state": "active"}


async def test_sleep_policy_and_state_changes(tmp_path, http):
    life = LifecycleSettings(sleep_load_threshold=0.2, sleep_after_ms=200)
    always = PlacementSettings(prefetch="always")
    with fake_agents(2) as (a, b), pc_server(str(tmp_path / "pc.db"), lifecycle=life,
                                             placement=always) as pc:
        await put_status(http, pc, status(b.url))
        await put_status(http, pc, status(a.url))
        r = await put_status(http, pc, status(a.url, requested_state="sleeping"))
        assert r.json() == {"state": "active"}         # not quiet for long enough yet
        await asyncio.sleep(0.25)
        busy = status(a.url, requested_state="sleeping", running=6)
        assert (await put_status(http, pc, busy)).json() == {"state": "active"}
        await put_status(http, pc, status(a.url))
        await asyncio.sleep(0.25)
        r = await put_status(http, pc, status(a.url, requested_state="sleeping"))
        assert r.json() == {"state": "draining"}

        # Never a request or a prefetch to a draining instance, even one holding the prefix.
        tokens, keys = prompt()
        for k in keys:
            pc.index.add(replica(k, a.url, scope_id=SCOPE))
        d = (await http.post(pc.url + "route", json={"tokens": tokens, "scope": "tenant",
                                                     "compat_id": COMPAT})).json()
        assert d["instance"] == b.url and [e["instance"] for e in d["estimates"]] == [b.url]

        r = await put_status(http, pc, status(a.url, state="sleeping", running=0))
        assert r.json() == {"state": "sleeping"}
        assert (await put_status(http, pc, status(a.url))).json() == {"state": "sleeping"}
        # The PC's word wakes it, and is forwarded with PUT {ii}state.
        r = await http.put(pc.url + f"instances/{instance_id(a.url)}/state",
                           json={"state": "active"})
        assert r.status_code == 200 and r.json()["state"] == "active" and r.json()["forwarded"]
        assert a.received("state") == [{"state": "active", "epoch": 1}]
        d = (await http.post(pc.url + "route", json={"tokens": tokens, "scope": "tenant",
                                                     "compat_id": COMPAT})).json()
        assert d["instance"] == a.url
        assert len(a.received("prefetch")) == 1    # only after it became active again
        r = await http.put(pc.url + f"instances/{instance_id(a.url)}/state",
                           json={"state": "bogus"})
        assert r.status_code == 400 and r.json()["member"] == "state"


# --------------------------------------------------------------------------- routing


async def test_no_prefetch_where_recomputing_beats_loading(tmp_path, http):
    """An instance whose measured link to the holder is slow recomputes the prefix (§6.4):
    the PC sends it no directive, which would make it load over that link anyway."""
    with fake_agents(2) as (a, holder), pc_server(str(tmp_path / "pc.db")) as pc:
        tokens, keys = prompt(n_blocks=16)
        for k in keys:
            pc.index.add(replica(k, holder.url, scope_id=SCOPE))
        slow = [{"holder": holder.url, "mbit_per_s": 1.0, "rtt_us": 1000.0}]
        await put_status(http, pc, status(a.url, links=slow))
        d = (await http.post(pc.url + "route", json={"tokens": tokens, "scope": "tenant",
                                                     "compat_id": COMPAT})).json()
        (est,) = d["estimates"]
        assert d["instance"] == a.url and est["uses_cache"] is False
        assert d["matched"] == 16 and d["directive"] is None and d["prefetch"] == "none"
        assert a.received("prefetch") == []
        # The same instance on a fast link, with a request queued there, loads: the directive
        # goes out (it loads while the request waits).
        fast = [{"holder": holder.url, "mbit_per_s": 10_000.0, "rtt_us": 100.0}]
        await put_status(http, pc, status(a.url, links=fast, queued=1))
        d = (await http.post(pc.url + "route", json={"tokens": tokens, "scope": "tenant",
                                                     "compat_id": COMPAT})).json()
        assert d["estimates"][0]["uses_cache"] is True and d["prefetch"] == "accepted"
        assert len(a.received("prefetch")) == 1


async def test_by_default_a_directive_only_where_the_request_would_wait(tmp_path, http):
    """A request that starts at once loads its prefix layer by layer while it computes; a
    directive just before it would make it wait for whole blocks instead (PlacementSettings.
    prefetch "queued", the default). Queued behind another request, it is worth sending."""
    with fake_agents(2) as (a, holder), pc_server(str(tmp_path / "pc.db")) as pc:
        tokens, keys = prompt(n_blocks=16)
        for k in keys:
            pc.index.add(replica(k, holder.url, scope_id=SCOPE))
        fast = [{"holder": holder.url, "mbit_per_s": 10_000.0, "rtt_us": 100.0}]
        await put_status(http, pc, status(a.url, links=fast, prefill_tokens_per_s=100))
        body = {"tokens": tokens, "scope": "tenant", "compat_id": COMPAT}
        d = (await http.post(pc.url + "route", json=body)).json()
        (est,) = d["estimates"]
        assert d["instance"] == a.url and est["uses_cache"] is True and est["wait_us"] == 0
        assert d["directive"] is None and d["prefetch"] == "none" and a.received("prefetch") == []
        # The next request is queued behind the one just routed there (not yet reported).
        d = (await http.post(pc.url + "route", json=body)).json()
        assert d["estimates"][0]["wait_us"] > 0 and d["prefetch"] == "accepted"
        (got,) = a.received("prefetch")
        assert got["directive"] == d["directive"] and len(got["blocks"]) == 16
    with pytest.raises(ValueError):
        PlacementSettings(prefetch="sometimes")


async def test_routes_to_prefix_holder_unless_its_queue_costs_more(tmp_path, http):
    with fake_agents(2) as (a, b), pc_server(str(tmp_path / "pc.db"),
                                             placement=PlacementSettings(prefetch="always")) as pc:
        tokens, keys = prompt(n_blocks=64)
        for k in keys:
            pc.index.add(replica(k, a.url, scope_id=SCOPE))   # A holds the prefix itself
        await put_status(http, pc, status(a.url))
        # (B prefills slowly enough that loading the 64 MiB prefix beats recomputing it)
        await put_status(http, pc, status(b.url, prefill_tokens_per_s=1000))
        body = {"tokens": tokens, "scope": "tenant", "compat_id": COMPAT, "request_ref": "r-1"}
        d = (await http.post(pc.url + "route", json=body)).json()
        assert d["instance"] == a.url and d["reason"] == "lowest-cost"
        assert d["matched"] == 64 and d["matched_tokens"] == 64 * B
        assert d["request_ref"] == "r-1" and d["prefetch"] == "accepted"
        est = {e["instance"]: e for e in d["estimates"]}
        assert est[a.url]["resident_blocks"] == 64 and est[a.url]["fetch_us"] == 0
        assert est[b.url]["resident_blocks"] == 0 and est[b.url]["fetch_us"] > 0
        # The directive reached A before the answer, naming the same directive and ref.
        (got,) = a.received("prefetch")
        assert got["directive"] == d["directive"] and got["request_ref"] == "r-1"
        assert [blk["block_key"] for blk in got["blocks"]] == keys
        assert got["scope_id"] == SCOPE and got["compat_id"] == COMPAT
        assert b.received("prefetch") == []

        # A long queue at A makes B, which must load the prefix from A, the cheaper choice.
        await put_status(http, pc, status(a.url, queued=40))
        d2 = (await http.post(pc.url + "route", json=body | {"request_ref": "r-2"})).json()
        assert d2["instance"] == b.url
        est = {e["instance"]: e for e in d2["estimates"]}
        assert est[a.url]["wait_us"] > est[b.url]["cost_us"] > 0
        (got,) = b.received("prefetch")
        assert got["request_ref"] == "r-2" and got["blocks"][0]["sources"] == [a.url]
        assert len(a.received("prefetch")) == 1
        assert d2["directive"] != d["directive"]


async def test_route_with_block_keys_and_bad_bodies(tmp_path, http):
    with fake_agents(1) as (a,), pc_server(str(tmp_path / "pc.db")) as pc:
        await put_status(http, pc, status(a.url))
        _, keys = prompt(4)
        d = (await http.post(pc.url + "route", json={"block_keys": keys, "scope_id": SCOPE,
                                                     "compat_id": COMPAT})).json()
        assert d["instance"] == a.url and d["matched"] == 0 and d["directive"] is None
        assert d["prefetch"] == "none" and d["token_count"] == 4 * B and d["request_ref"]
        assert a.received("prefetch") == []
        for body, member in [
            ({"tokens": [1, 2], "scope": "nope", "compat_id": COMPAT}, "scope"),
            ({"tokens": [1, -2], "scope": "tenant", "compat_id": COMPAT}, "tokens[1]"),
            ({"tokens": [1, 2], "scope": "tenant"}, "compat_id"),
            ({"scope": "tenant", "compat_id": COMPAT}, "tokens"),
            ({"tokens": [1], "scope_id": "22" * 16, "compat_id": COMPAT}, "scope_id"),
            ({"block_keys": ["zz"], "scope_id": SCOPE, "compat_id": COMPAT}, "block_keys[0]"),
            ([1, 2], "record"),
        ]:
            r = await http.post(pc.url + "route", json=body)
            assert r.status_code == 400, body
            assert r.json()["member"] == member, (body, r.json())


async def test_start_hook_when_no_instance_is_acceptable(tmp_path, http):
    started = []
    with fake_agents(2) as (a, fresh):
        async def start(request):
            started.append(request.request_ref)
            return fresh.url

        tokens, keys = prompt(8)
        place = PlacementSettings(max_cost_us=1.0)     # nothing is that cheap
        with pc_server(str(tmp_path / "pc.db"), start_hook=start, placement=place) as pc:
            for k in keys:
                pc.index.add(replica(k, a.url, scope_id=SCOPE, size=1 << 24))
            body = {"tokens": tokens, "scope": "tenant", "compat_id": COMPAT}
            # No active instance at all: the started one gets the directive at once.
            d = (await http.post(pc.url + "route", json=body | {"request_ref": "x"})).json()
            assert d["reason"] == "started" and d["instance"] == fresh.url and started == ["x"]
            (got,) = fresh.received("prefetch")
            assert got["directive"] == d["directive"] and len(got["blocks"]) == 8
            # An active instance whose cost is over the threshold: started again.
            await put_status(http, pc, status(a.url, queued=100))
            d = (await http.post(pc.url + "route", json=body)).json()
            assert d["reason"] == "started" and len(fresh.received("prefetch")) == 2
            assert a.received("prefetch") == []


async def test_over_threshold_without_hook_uses_best_active(tmp_path, http):
    with fake_agents(1) as (a,), pc_server(str(tmp_path / "pc.db"),
                                           placement=PlacementSettings(max_cost_us=1.0)) as pc:
        await put_status(http, pc, status(a.url))
        d = (await http.post(pc.url + "route", json={"tokens": list(range(64)), "scope": "tenant",
                                                     "compat_id": COMPAT})).json()
        assert d["instance"] == a.url and d["reason"] == "over-threshold"
