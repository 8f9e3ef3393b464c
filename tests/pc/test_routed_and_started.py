"""What the PC knows before an instance reports it (§6.3, §6.4): requests it routed there, and
instances its start hook launched."""

import asyncio

import httpx
import pytest

from kvsp_moq.errors import StaleEpoch
from kvsp_moq.protocol.keys import block_keys, scope_id
from kvsp_moq.protocol.records import InstanceStatus
from pc.lifecycle import InstanceFailed, InstanceRegistry, LifecycleSettings, StateChanged
from pc.placement import PlacementSettings
from tests.pc.fakes import COMPAT, SCOPE_KEY, fake_agents, pc_server, replica, status, status_path
from tests.polling import eventually

SCOPE = scope_id(SCOPE_KEY).hex()
B = 16
URL = "http://127.0.0.1:9001/"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(epoch: int = 1, queued: int = 0, **extra) -> InstanceStatus:
    data = {"instance": URL, "epoch": epoch, "state": "active", "ttl_ms": 60_000,
            "batch_size": 10, "prefill_tokens_per_s": 1000, "queued": queued}
    data.update(extra)
    return InstanceStatus.from_json(data)


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def prompt(n_blocks: int = 8, extra: int = 5) -> tuple[list[int], list[str]]:
    tokens = list(range(1000, 1000 + n_blocks * B + extra))
    keys = [k.hex() for k in block_keys(SCOPE_KEY, bytes.fromhex(COMPAT), tokens, B)]
    return tokens, keys


async def instances(http: httpx.AsyncClient, pc) -> dict[str, dict]:
    listed = (await http.get(pc.url + "instances")).json()["instances"]
    return {i["instance"]: i for i in listed}


# --------------------------------------------------------------------------- routed requests


def test_routed_requests_count_in_the_queue_until_a_later_record():
    clock = Clock()
    reg = InstanceRegistry(LifecycleSettings(routed_settle_ms=100, routed_hold_ms=5000),
                           clock=clock)
    reg.report(record(queued=2))
    reg.note_routed(URL)
    reg.note_routed(URL)
    assert reg.pending(URL) == 2
    assert reg.get(URL).queued == 4 and reg.active()[0].queued == 4
    assert reg.describe()[0]["queued"] == 2 and reg.describe()[0]["routed"] == 2
    # A record arriving right after the routes may predate the requests: they still count.
    clock.now += 0.05
    reg.report(record(queued=2))
    assert reg.pending(URL) == 2
    # One sent after they could reach the instance accounts for them.
    clock.now += 0.1
    reg.report(record(queued=4))
    assert reg.pending(URL) == 0 and reg.get(URL).queued == 4
    # Without any record, a routed request is forgotten after routed_hold_ms.
    reg.note_routed(URL)
    clock.now += 4.9
    assert reg.pending(URL) == 1
    clock.now += 0.2
    assert reg.pending(URL) == 0 and reg.get(URL).queued == 4
    # A restart loses what the old incarnation was given; unknown instances count nothing.
    reg.note_routed(URL)
    reg.report(record(epoch=2))
    assert reg.pending(URL) == 0
    reg.note_routed("http://127.0.0.1:9/")
    assert reg.pending("http://127.0.0.1:9/") == 0


def test_records_that_count_admissions_account_for_exactly_the_admitted_routes():
    clock = Clock()
    reg = InstanceRegistry(LifecycleSettings(routed_settle_ms=100, routed_hold_ms=5000),
                           clock=clock)
    reg.report(record(admitted=7))
    reg.note_routed(URL)
    reg.note_routed(URL)
    # Long after the routes, a record that admitted nothing new still leaves both counted
    # (the time rule would have dropped them) ...
    clock.now += 1.0
    reg.report(record(admitted=7))
    assert reg.pending(URL) == 2
    # ... and one admission accounts for one of them, at once, however soon it comes.
    reg.note_routed(URL)
    reg.report(record(queued=1, admitted=8))
    assert reg.pending(URL) == 2 and reg.get(URL).queued == 3
    reg.report(record(admitted=12))  # more admissions than routes (direct clients)
    assert reg.pending(URL) == 0
    # A record without the member falls back to the time rule; one with it after such a
    # record has nothing to compare with and does the same.
    reg.note_routed(URL)
    reg.report(record())
    assert reg.pending(URL) == 1
    reg.report(record(admitted=12))
    assert reg.pending(URL) == 1
    clock.now += 0.2
    reg.report(record(admitted=12))
    assert reg.pending(URL) == 1
    reg.report(record(admitted=13))
    assert reg.pending(URL) == 0
    assert record(admitted=3).to_json()["admitted"] == 3 and "admitted" not in record().to_json()


async def test_a_burst_of_equal_routes_spreads_by_cost(tmp_path, http):
    """Six routes of one prompt whose blocks A holds, before any instance reports again: A
    takes the first; then its queue of one (51.2 ms at 10,000 tokens/s) costs more than
    recomputing the prompt elsewhere (13.3 ms), and the routes alternate by cost."""
    with fake_agents(3) as (a, b, c), pc_server(str(tmp_path / "pc.db")) as pc:
        tokens, keys = prompt(8)
        for k in keys:
            pc.index.add(replica(k, a.url, scope_id=SCOPE))
        for x in (a, b, c):
            await http.put(pc.url + status_path(x.url), json=status(x.url))
        body = {"tokens": tokens, "scope": "tenant", "compat_id": COMPAT}
        decisions = [(await http.post(pc.url + "route", json=body)).json() for _ in range(6)]
        chosen = [d["instance"] for d in decisions]
        # Equal costs of B and C are ordered by URL, so which of them comes first varies.
        assert chosen[0] == chosen[3] == a.url
        assert {chosen[1], chosen[2]} == {chosen[4], chosen[5]} == {b.url, c.url}
        # What each later route saw: the earlier ones in the queues.
        last = {e["instance"]: e for e in decisions[-1]["estimates"]}
        assert last[a.url]["wait_us"] == pytest.approx(2 * 51_200)
        assert last[chosen[5]]["wait_us"] == pytest.approx(51_200)
        listed = await instances(http, pc)
        assert {u: listed[u]["routed"] for u in listed} == {a.url: 2, b.url: 2, c.url: 2}
        assert {u: listed[u]["queued"] for u in listed} == {a.url: 0, b.url: 0, c.url: 0}

        # Concurrent routes see each other too.
        rs = await asyncio.gather(*(http.post(pc.url + "route", json=body) for _ in range(6)))
        assert sorted(r.json()["instance"] for r in rs) == sorted([a.url, b.url, c.url] * 2)

        # Records sent after the requests arrived account for them: A is first again.
        await asyncio.sleep(0.15)
        for x in (a, b, c):
            await http.put(pc.url + status_path(x.url), json=status(x.url))
        assert {u: i["routed"] for u, i in (await instances(http, pc)).items()} == {
            a.url: 0, b.url: 0, c.url: 0}
        d = (await http.post(pc.url + "route", json=body)).json()
        assert d["instance"] == a.url


async def test_a_route_can_exclude_instances(tmp_path, http):
    """A front end that found A busy asks for the best of the others."""
    with fake_agents(3) as (a, b, c), pc_server(str(tmp_path / "pc.db")) as pc:
        tokens, keys = prompt(8)
        for k in keys:
            pc.index.add(replica(k, a.url, scope_id=SCOPE))
        for x in (a, b, c):
            await http.put(pc.url + status_path(x.url), json=status(x.url))
        body = {"tokens": tokens, "scope": "tenant", "compat_id": COMPAT}
        assert (await http.post(pc.url + "route", json=body)).json()["instance"] == a.url
        d = (await http.post(pc.url + "route", json={**body, "exclude": [a.url]})).json()
        assert d["instance"] in (b.url, c.url)
        assert {e["instance"] for e in d["estimates"]} == {b.url, c.url}
        listed = await instances(http, pc)
        assert listed[a.url]["routed"] == 1 and listed[d["instance"]]["routed"] == 1
        r = await http.post(pc.url + "route", json={**body, "exclude": ["ftp://x/"]})
        assert r.status_code == 400 and "exclude" in r.json()["detail"] + r.json().get("member", "")


# --------------------------------------------------------------------------- started instances


def test_started_instance_is_provisional_until_its_first_record():
    clock = Clock()
    reg = InstanceRegistry(LifecycleSettings(start_grace_ms=3000), clock=clock)
    assert reg.register_started(URL.rstrip("/"))
    assert reg.is_active(URL) and reg.active()[0].instance == URL
    item = reg.describe()[0]
    assert item["provisional"] and item["reported_state"] is None and item["state"] == "active"
    # Its first record replaces the provisional one whatever its epoch, and keeps its queue.
    reg.note_routed(URL)
    reply = reg.report(record(epoch=1_700_000_000_000))
    assert reply.state == "active"
    assert not any(isinstance(e, InstanceFailed) for e in reply.events)
    assert StateChanged(URL, 1_700_000_000_000, "active", "active") in reply.events
    assert not reg.describe()[0]["provisional"] and reg.pending(URL) == 1
    # Already reporting: the hook naming it again changes nothing.
    assert reg.register_started(URL)
    assert reg.get(URL).epoch == 1_700_000_000_000

    # Restarted by the hook after a failure: a record of the failed incarnation is stale.
    clock.now += 61
    assert reg.expire() == [InstanceFailed(URL, 1_700_000_000_000, "expired")]
    assert reg.register_started(URL) and reg.is_active(URL)
    with pytest.raises(StaleEpoch):
        reg.report(record(epoch=1_700_000_000_000))
    # One that never reports fails after start_grace_ms.
    clock.now += 3.1
    assert reg.expire() == [InstanceFailed(URL, 1_700_000_000_000, "expired")]
    assert reg.report(record(epoch=1_700_000_000_001)).state == "active"


def test_hook_record_gives_rates_to_rank_by():
    reg = InstanceRegistry(LifecycleSettings(start_grace_ms=3000), clock=Clock())
    assert reg.register_started(record(epoch=0, queued=7, state="sleeping",
                                       prefill_tokens_per_s=5000, ttl_ms=1))
    got = reg.get(URL)
    assert (got.state, got.ttl_ms, got.prefill_tokens_per_s, got.queued) == ("active", 3000,
                                                                           5000, 7)
    # A draining instance named by the hook may not take the request.
    other = "http://127.0.0.1:9002/"
    reg.report(InstanceStatus(instance=other, epoch=1, state="draining", ttl_ms=60_000))
    assert not reg.register_started(other) and not reg.is_active(other)


async def test_started_instance_is_registered_and_gets_the_next_requests(tmp_path, http):
    started: list[str | None] = []
    with fake_agents(2) as (holder, fresh):
        async def start(request):
            started.append(request.request_ref)
            return fresh.url.rstrip("/")

        tokens, keys = prompt(8)
        place = PlacementSettings(max_cost_us=100_000.0, prefetch="always")
        life = LifecycleSettings(start_grace_ms=400)
        with pc_server(str(tmp_path / "pc.db"), start_hook=start, placement=place,
                       lifecycle=life) as pc:
            for k in keys:
                pc.index.add(replica(k, holder.url, scope_id=SCOPE))
            body = {"tokens": tokens, "scope": "tenant", "compat_id": COMPAT}
            d = (await http.post(pc.url + "route", json=body | {"request_ref": "r1"})).json()
            assert d["reason"] == "started" and d["instance"] == fresh.url and started == ["r1"]
            assert d["prefetch"] == "accepted"
            (got,) = fresh.received("prefetch")
            assert got["directive"] == d["directive"] and len(got["blocks"]) == 8
            listed = await instances(http, pc)
            assert list(listed) == [fresh.url]
            item = listed[fresh.url]
            assert item["state"] == "active" and item["provisional"] and item["routed"] == 1

            # It reports before the grace period ends: now an ordinary active instance, cheap
            # enough (no queue any more) to take the next request without the hook.
            await asyncio.sleep(0.15)
            # (a prefill slow enough that loading the 8 MiB prefix beats recomputing it, so
            # that the PC sends a directive: §6.4)
            r = await http.put(pc.url + status_path(fresh.url),
                               json=status(fresh.url, epoch=42, prefill_tokens_per_s=1000))
            assert r.json() == {"state": "active"}
            item = (await instances(http, pc))[fresh.url]
            assert not item["provisional"] and item["epoch"] == 42 and item["routed"] == 0
            d = (await http.post(pc.url + "route", json=body)).json()
            assert d["reason"] == "lowest-cost" and d["instance"] == fresh.url
            assert started == ["r1"] and len(fresh.received("prefetch")) == 2


async def test_started_instance_that_never_reports_fails(tmp_path, http):
    with fake_agents(1) as (fresh,):
        async def start(request):
            return fresh.url

        life = LifecycleSettings(start_grace_ms=200)
        with pc_server(str(tmp_path / "pc.db"), start_hook=start, lifecycle=life) as pc:
            tokens, _ = prompt(2)
            d = (await http.post(pc.url + "route", json={"tokens": tokens, "scope": "tenant",
                                                         "compat_id": COMPAT})).json()
            assert d["reason"] == "started" and d["instance"] == fresh.url

            async def failed():
                return (await instances(http, pc))[fresh.url]["state"] == "failed"

            await eventually(failed, timeout=3, what="the fresh instance failed")
            # A restart with any epoch above the provisional one brings it back.
            r = await http.put(pc.url + status_path(fresh.url), json=status(fresh.url, epoch=5))
            assert r.json() == {"state": "active"}


async def test_start_command_from_the_command_line(tmp_path, http):
    """`kvsp index --start-command CMD`: the command learns the request from its environment
    and prints the instance's URL; only that first line is waited for."""
    import argparse

    from index import service

    seen = tmp_path / "seen.txt"
    with fake_agents(1) as (fresh,):
        script = tmp_path / "start.sh"
        script.write_text(f'echo "$KVSP_REQUEST_REF $KVSP_SCOPE_ID $KVSP_TOKEN_COUNT" > {seen}\n'
                          f'echo {fresh.url}\nsleep 0.3\n')
        p = argparse.ArgumentParser()
        service.configure_parser(p)
        args = p.parse_args(["--start-command", f"sh {script}", "--db", str(tmp_path / "x.db")])
        assert service.pc_settings_from_args(args).start_command == f"sh {script}"
        with pc_server(str(tmp_path / "pc.db"), start_command=f"sh {script}") as pc:
            tokens, _ = prompt(2)
            d = (await http.post(pc.url + "route", json={
                "tokens": tokens, "scope": "tenant", "compat_id": COMPAT,
                "request_ref": "ref-9"})).json()
            assert d["reason"] == "started" and d["instance"] == fresh.url
            assert seen.read_text().split() == ["ref-9", SCOPE, str(len(tokens))]
            assert (await instances(http, pc))[fresh.url]["provisional"]


def test_routed_requests_count_up_to_the_cap_per_scope_as_they_come_and_go():
    clock = Clock()
    reg = InstanceRegistry(LifecycleSettings(routed_cap_per_scope=3, routed_settle_ms=100,
                                             routed_hold_ms=10_000), clock=clock)
    reg.report(record())
    other = "22" * 16
    for _ in range(5):
        reg.note_routed(URL, SCOPE)
    assert reg.pending(URL) == 3 and reg.active()[0].queued == 3
    reg.note_routed(URL, other)
    assert reg.pending(URL) == 4 and reg.pending(URL) == 4   # counted again only on change
    reg.note_routed(URL, other)
    assert reg.pending(URL) == 5 and reg.active()[0].queued == 5
    clock.now += 1.0
    reg.note_routed(URL, other)  # a record a second later accounts for all but this one
    clock.now += 0.05
    reg.report(record(queued=7))
    assert reg.pending(URL) == 1 and reg.active()[0].queued == 8
    clock.now += 11.0  # and the last is forgotten after routed_hold_ms
    assert reg.pending(URL) == 0
