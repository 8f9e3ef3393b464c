import pytest

from kvsp_moq import errors
from kvsp_moq.protocol.cost import DEFAULT_MBIT_PER_S, DEFAULT_RTT_US, assumed_link, estimate, fetch_us, recompute_us
from kvsp_moq.protocol.problems import Problem
from kvsp_moq.protocol.records import InstanceStatus, ReplicaRecord
from tests.protocol.test_records import STATUS, replica


@pytest.mark.parametrize("cls", [errors.LeaseQuota, errors.LayersUnavailable, errors.StaleEpoch,
                                 errors.BadRecord, errors.ForbiddenScope, errors.Unauthorized,
                                 errors.DigestMismatch])
def test_problem_round_trip_keeps_the_error_class(cls):
    err = cls("detail here", member="m") if cls is errors.BadRecord else cls("detail here")
    doc = Problem.from_error(err).to_json()
    assert doc["type"] == "urn:kvsp:problem:" + cls.problem and doc["status"] == cls.status
    back = Problem.from_json(doc).to_error()
    assert isinstance(back, type(err).__mro__[0] if cls is not errors.BadRecord else errors.ProtocolViolation)
    assert "detail here" in back.detail


def test_foreign_problem_maps_by_status():
    assert isinstance(Problem.from_json({"type": "about:blank", "status": 404}).to_error(), errors.NotFound)
    assert isinstance(Problem.from_json("junk", status=500).to_error(), errors.KvspError)


def test_recompute_and_fetch_formulas():
    assert recompute_us(42000, 42000) == 1e6
    assert recompute_us(10, 0) == float("inf")
    status = InstanceStatus.from_json(STATUS)  # link to 127.0.0.1:8801 at 200000 Mbit/s, 12 us
    rec = ReplicaRecord.from_json(replica(size=4_000_000, residency=[]))
    # 8 * 4e6 bytes / 2e5 Mbit/s = 160 us, plus 12 us
    assert fetch_us(status, [rec]) == pytest.approx(172.0)
    # Host tier at 400000 does not slow a 200000 link; a slow disk tier does.
    slow = ReplicaRecord.from_json(replica(size=4_000_000, residency=[
        {"tier": "device", "layers": [0, 1]},
        {"tier": "disk", "layers": [2, 3], "read_mbit_per_s": 1000}]))
    assert fetch_us(status, [slow]) == pytest.approx(12 + 80 + 8 * 2e6 / 1000)
    # Two blocks from one source add; the max is over sources.
    assert fetch_us(status, [rec, rec]) == pytest.approx(332.0)


def test_an_unreported_source_is_assumed_like_the_reported_ones():
    """A holder the instance never loaded from gets the median of the links it reported, not
    1 Gbit/s: the demo's agents load at ~100 Mbit/s effective, and a first estimate at 1 Gbit/s
    was ten times too optimistic."""
    rec = ReplicaRecord.from_json(replica(size=1_000_000, residency=[],
                                          holder="http://127.0.0.1:9999/"))
    links = [{"holder": f"http://10.0.0.{i}:8801/", "mbit_per_s": rate, "rtt_us": rtt}
             for i, (rate, rtt) in enumerate([(100, 500), (80, 900), (2000, 100)])]
    status = InstanceStatus.from_json({**STATUS, "links": links})
    assert assumed_link(status.links) == (100, 500)
    assert fetch_us(status, [rec]) == pytest.approx(500 + 8e6 / 100)
    even = InstanceStatus.from_json({**STATUS, "links": links[:2]})
    assert assumed_link(even.links) == (90, 700)
    none = InstanceStatus.from_json({**STATUS, "links": []})
    assert fetch_us(none, [rec]) == pytest.approx(DEFAULT_RTT_US + 8e6 / DEFAULT_MBIT_PER_S)
    # A reported link to the holder itself is used as it is.
    own = InstanceStatus.from_json({**STATUS, "links": links + [
        {"holder": "http://127.0.0.1:9999/", "mbit_per_s": 4000, "rtt_us": 10}]})
    assert fetch_us(own, [rec]) == pytest.approx(10 + 8e6 / 4000)


def test_estimate_prefers_cache_unless_queue_is_long():
    status = InstanceStatus.from_json({**STATUS, "queued": 0})
    rec = ReplicaRecord.from_json(replica(size=1_000_000, residency=[]))
    e = estimate(status, matched_tokens=2048, total_tokens=2100, plan=[rec] * 4)
    assert e.uses_cache and e.cost_us < e.recompute_all_us
    busy = InstanceStatus.from_json({**STATUS, "queued": 50})
    assert estimate(busy, matched_tokens=2048, total_tokens=2100, plan=[rec] * 4).cost_us > e.cost_us
    resident = estimate(status, matched_tokens=2048, total_tokens=2100, plan=[rec],
                        resident={rec.block_key: True})
    assert resident.fetch_us == 0.0


def test_a_replica_resides_at_an_instance_only_at_its_exact_base_url():
    """One rule for the PC, the IS and the agent: the holder (or a MOQT replica's HTTP holder)
    is the instance's base URL; a URL that merely starts like it is another server."""
    from types import SimpleNamespace

    from kvsp_moq.protocol.cost import resides_at

    here = "http://10.0.0.1:80"
    assert resides_at(here, SimpleNamespace(holder="http://10.0.0.1:80/", http_holder=None))
    assert resides_at(here + "/", SimpleNamespace(holder="http://10.0.0.1:80", http_holder=None))
    moqt = SimpleNamespace(holder="moqt://relay:4443", http_holder="http://10.0.0.1:80/")
    assert resides_at(here, moqt)
    for other in ("http://10.0.0.1:8000/", "http://10.0.0.10:80/", "http://10.0.0.1:80/x/"):
        assert not resides_at(here, SimpleNamespace(holder=other, http_holder=None)), other
        assert not resides_at(here, SimpleNamespace(holder="moqt://relay:4443", http_holder=other))


def test_the_link_to_a_replica_is_its_holders_then_its_http_holders():
    from types import SimpleNamespace

    from kvsp_moq.protocol.cost import link_table, replica_link, source_rate
    from kvsp_moq.protocol.records import Link

    links = [Link(holder="http://h:8801/", mbit_per_s=100, rtt_us=50),
             Link(holder="moqt://relay:4443", mbit_per_s=900, rtt_us=20),
             Link(holder="http://h:8801/", mbit_per_s=1, rtt_us=1)]  # a later report: ignored
    table = link_table(links)
    moqt = SimpleNamespace(holder="moqt://relay:4443", http_holder="http://h:8801/")
    assert replica_link(table, moqt) == (900, 20)  # the relay's link, though the HTTP one is first
    assert replica_link(table, SimpleNamespace(holder="moqt://other:1", http_holder="http://h:8801/")) == (100, 50)
    assert replica_link(table, SimpleNamespace(holder="http://x:1/", http_holder=None)) is None
    status = InstanceStatus.from_json({**STATUS, "links": [link.to_json() for link in links]})
    rec = ReplicaRecord.from_json(replica(holder="http://h:8801/", residency=[]))
    assert source_rate(status, rec) == (100, 50)
