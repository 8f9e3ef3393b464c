"""The PC's state in Redis (`pc.redis_state`, `pc.duties`): several stores on one server act
as one PC's, with the rules of §6.3 and §6.8 applied atomically across them."""

from __future__ import annotations

import time

import pytest

from kvsp_moq.auth import Principal
from kvsp_moq.errors import ForbiddenScope, StaleEpoch, StoreUnavailable
from kvsp_moq.protocol.records import InstanceStatus, SessionCheckpoint
from pc.duties import DutyLease
from pc.lifecycle import InstanceFailed, LifecycleSettings
from pc.redis_state import RedisSessionStore, RedisState, SharedInstanceRegistry
from pc.sessions import accept_checkpoint
from tests.pc.fakes import checkpoint, new_session, status

A, B = "http://127.0.0.1:9001/", "http://127.0.0.1:9002/"


def cp(session: str, **kw) -> SessionCheckpoint:
    return SessionCheckpoint.from_json(checkpoint(session, **kw))


def record(url: str, **kw) -> InstanceStatus:
    return InstanceStatus.from_json(status(url, **kw))


def test_sessions_follow_the_rules_across_stores(redis_url: str) -> None:
    one, two = RedisState(redis_url), RedisState(redis_url)
    s1, s2 = RedisSessionStore(one), RedisSessionStore(two)
    sid = new_session()
    st = s1.checkpoint(cp(sid, offset=3), A)
    assert (st.epoch, st.instance, st.output_offset) == (1, A, 3)
    assert s2.get(sid) == st  # what one process stored, the other reads
    assert s2.checkpoint(cp(sid, offset=2), None) == st  # an older one is kept out
    assert s2.checkpoint(cp(sid, offset=5), A).output_offset == 5
    assert s1.get(sid).output_offset == 5
    # One move wins; the other process's compare-and-set sees the new epoch.
    assert s1.move(sid, B, expect_epoch=1).epoch == 2
    assert s2.move(sid, "http://127.0.0.1:9003/", expect_epoch=1) is None
    with pytest.raises(StaleEpoch):
        s2.checkpoint(cp(sid, epoch=1, offset=9), A)
    assert [x.session for x in s2.on_instance(B)] == [sid] and s2.on_instance(A) == []
    assert s1.instances() == {B} and s1.count() == 1
    # The same answers as the rules alone give.
    other = new_session()
    assert s1.checkpoint(cp(other, epoch=4, offset=1), A) == accept_checkpoint(
        None, cp(other, epoch=4, offset=1), A)
    assert s2.delete(other) and s1.get(other).ended and not s1.delete(other)
    assert s1.instances() == {B} and s2.count() == 1 and s1.on_instance(A) == []
    with pytest.raises(StaleEpoch):  # no checkpoint brings an ended session back
        s1.checkpoint(cp(other, epoch=4, offset=2), A)
    assert s1.move(other, B, expect_epoch=4) is None
    ttl = one.client.pttl(f"kvsp:pc:s:{other}")
    assert 0 < ttl <= 300_000  # what remains of it expires in the store
    one.close(), two.close()


def test_a_status_reported_to_one_process_is_seen_by_another(redis_url: str) -> None:
    r1 = SharedInstanceRegistry(RedisState(redis_url))
    r2 = SharedInstanceRegistry(RedisState(redis_url))
    tenant = Principal("tenant-a", scopes=frozenset({"aa" * 32}), holders=frozenset({A}))
    other = Principal("tenant-b", scopes=frozenset({"bb" * 32}), holders=frozenset({A}))
    assert r1.report(record(A, epoch=5, queued=3), tenant).state == "active"
    assert not r2.known(A)
    r2.refresh()
    assert r2.is_active(A) and r2.get(A).queued == 3 and r2.serves(A, "aa" * 32)
    # The rules hold across processes: an older epoch, another principal's report.
    with pytest.raises(StaleEpoch):
        r2.report(record(A, epoch=4), tenant)
    with pytest.raises(ForbiddenScope):
        r2.report(record(A, epoch=6), other)
    r2.report(record(A, epoch=5, queued=7), tenant)
    r1.refresh()
    assert r1.get(A).queued == 7
    r1.forget(A)
    r2.refresh()
    assert not r2.known(A)


def test_an_expired_instance_fails_once_whoever_sweeps(redis_url: str) -> None:
    now = [1000.0]
    regs = [SharedInstanceRegistry(RedisState(redis_url), LifecycleSettings(),
                                   clock=lambda: now[0]) for _ in range(3)]
    regs[0].report(record(A, ttl_ms=500))
    regs[1].report(record(B, ttl_ms=60_000))
    now[0] += 1.0
    events = [e for reg in regs for e in reg.expire()]
    assert events == [InstanceFailed(A, 1, "expired")]
    for reg in regs:
        reg.refresh()
        assert reg.status_of(A).state == "failed" and reg.is_active(B)


def test_the_duties_lease_has_one_holder_and_passes_on_when_it_lapses(redis_url: str) -> None:
    first = DutyLease(RedisState(redis_url), ttl_ms=300, name="first")
    second = DutyLease(RedisState(redis_url), ttl_ms=300, name="second")
    assert first.hold() and not second.hold() and first.hold()  # renewed, still one holder
    assert second.holder() == "first"
    deadline = time.monotonic() + 5
    while not second.hold():  # first stopped renewing: second takes over after the TTL
        assert time.monotonic() < deadline, "the lease never lapsed"
        time.sleep(0.05)
    assert not first.hold() and second.holder() == "second"
    second.release()
    assert first.hold()  # given up: taken at once


def test_a_store_that_cannot_be_reached_is_a_503(own_redis) -> None:
    server = own_redis()
    state = RedisState(server.url, timeout_s=0.3)
    reg = SharedInstanceRegistry(state, stale_after_s=0.2)
    reg.report(record(A))
    reg.refresh()
    reg.require_fresh()
    server.kill()
    time.sleep(0.3)
    with pytest.raises(StoreUnavailable) as e:
        reg.require_fresh()
    assert e.value.status == 503 and "old" in e.value.detail
    with pytest.raises(StoreUnavailable):
        RedisSessionStore(state).get(new_session())
    assert not DutyLease(state).hold()  # duties wait rather than run blind


def test_pc_endpoints_move_to_the_next_pc_when_one_fails() -> None:
    from kvsp_moq.pc_endpoints import PCEndpoints

    pcs = PCEndpoints("http://10.0.0.1:8700, http://10.0.0.2:8700/")
    assert pcs.urls == ["http://10.0.0.1:8700/", "http://10.0.0.2:8700/"]
    assert pcs.url == "http://10.0.0.1:8700/"
    pcs.failed("http://10.0.0.1:8700/")
    assert pcs.url == "http://10.0.0.2:8700/"
    pcs.failed("http://10.0.0.1:8700/")  # a late failure of the one left: nothing changes
    assert pcs.url == "http://10.0.0.2:8700/"
    pcs.failed("http://10.0.0.2:8700")
    assert pcs.url == "http://10.0.0.1:8700/"  # round again
    one = PCEndpoints("http://10.0.0.1:8700/")
    one.failed(one.url)
    assert one.url == "http://10.0.0.1:8700/" and str(PCEndpoints(pcs)) == str(pcs)
    with pytest.raises(ValueError):
        PCEndpoints(" , ")


def test_a_pending_reshard_is_shared_and_found_abandoned_after_its_time(redis_url: str) -> None:
    from pc.redis_state import RedisShardMapStore
    from pc.reshard import PendingReshard

    one, two = RedisShardMapStore(RedisState(redis_url)), RedisShardMapStore(RedisState(redis_url))
    one.begin(PendingReshard("m1", 5, (A, B), decide_by=1000.0))
    one.begin(PendingReshard("m2", 3, (A,), decide_by=5000.0))
    assert two.abandoned(2000.0) == [PendingReshard("m1", 5, (A, B), 1000.0)]
    two.end("m1")
    assert one.abandoned(2000.0) == [] and [p.map for p in one.abandoned(9000.0)] == ["m2"]
