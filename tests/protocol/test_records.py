import hashlib
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol.records import (
    InstanceStatus,
    LeaseGrant,
    LeaseRequest,
    LookupRequest,
    PrefetchDirective,
    ReplicaRecord,
    ReshardDecision,
    ReshardPlan,
    SessionCheckpoint,
    ShardMap,
    parse_reshard,
    replica_id,
)

LD = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
DIGEST = "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in LD)).hexdigest()


def replica(**over):
    base = {
        "block_key": "aa" * 32, "compat_id": "bb" * 32, "scope_id": "cc" * 16,
        "holder": "http://127.0.0.1:8801/", "codec": 1, "size": 4096, "digest": DIGEST,
        "layer_digests": LD,
        "residency": [{"tier": "device", "layers": [0, 1]},
                      {"tier": "host", "layers": [2, 3], "read_mbit_per_s": 400000}],
        "ttl_ms": 600000,
    }
    base.update(over)
    return base


def test_replica_round_trip_and_unknown_members_ignored():
    r = ReplicaRecord.from_json({**replica(), "future": {"x": 1}})
    assert r.to_json() == replica()
    assert ReplicaRecord.from_json(r.to_json()) == r
    assert r.tier_of(3).tier == "host" and r.layer_count == 4


def test_a_replica_record_encodes_to_its_json_once():
    import dataclasses
    import json

    r = ReplicaRecord.from_json(replica())
    assert json.loads(r.encoded) == r.to_json()
    assert r.encoded is r.encoded  # kept
    other = dataclasses.replace(r, ttl_ms=1000)  # a record made anew is encoded anew
    assert json.loads(other.encoded)["ttl_ms"] == 1000
    assert other == ReplicaRecord.from_json(json.loads(other.encoded)) and other != r


def test_hex_is_normalised_to_lowercase():
    r = ReplicaRecord.from_json(replica(block_key="AA" * 32))
    assert r.block_key == "aa" * 32


@pytest.mark.parametrize(
    "over, member",
    [
        ({"block_key": "aa" * 31}, "block_key"),
        ({"scope_id": "cc" * 32}, "scope_id"),
        ({"holder": "ftp://x/"}, "holder"),
        ({"codec": "1"}, "codec"),
        ({"size": -1}, "size"),
        ({"ttl_ms": 0}, "ttl_ms"),
        ({"digest": "sha-256:" + "00" * 32}, "digest"),
        ({"layer_digests": []}, "layer_digests"),
        ({"residency": [{"tier": "host", "layers": [0, 2]}, {"tier": "disk", "layers": [2, 3]}]},
         "residency"),
        ({"residency": [{"tier": "host", "layers": [3, 2]}]}, "residency[0].layers"),
        ({"residency": [{"tier": "host", "layers": [0, 9]}]}, "residency[0].layers"),
        ({"residency": [{"tier": "host", "layers": [0, 1], "read_mbit_per_s": 0}]},
         "residency[0].read_mbit_per_s"),
        ({"holder": "moqt://relay:4443/"}, "moqt_namespace"),
        ({"http_holder": "moqt://x/"}, "http_holder"),
    ],
)
def test_replica_refusals_name_the_member(over, member):
    with pytest.raises(BadRecord) as e:
        ReplicaRecord.from_json(replica(**over))
    assert e.value.member == member


def test_missing_member():
    d = replica()
    del d["digest"]
    with pytest.raises(BadRecord) as e:
        ReplicaRecord.from_json(d)
    assert e.value.member == "digest"
    with pytest.raises(BadRecord):
        ReplicaRecord.from_json([1, 2])


def test_replica_id_separates_holders_and_namespaces():
    a = replica_id("http://h1/")
    assert a == hashlib.sha256(b"http://h1/\x00").digest()[:16].hex()
    assert len({a, replica_id("http://h2/"), replica_id("moqt://r/", "ns1"),
                replica_id("moqt://r/", "ns2")}) == 4


STATUS = {
    "instance": "http://127.0.0.1:8900/", "epoch": 12, "state": "active",
    "running": 18, "queued": 3, "batch_size": 32, "kv_utilization": 0.71,
    "prefill_tokens_per_s": 42000, "decode_tokens_per_s": 3100,
    "links": [{"holder": "http://127.0.0.1:8801/", "mbit_per_s": 200000, "rtt_us": 12}],
    "requested_state": None, "ttl_ms": 3000,
}


def test_status_round_trip_and_refusals():
    s = InstanceStatus.from_json(STATUS)
    assert s.to_json() == STATUS
    for over, member in [({"state": "zombie"}, "state"), ({"kv_utilization": 1.5}, "kv_utilization"),
                         ({"requested_state": "dead"}, "requested_state"),
                         ({"links": [{"holder": "http://x/", "mbit_per_s": 0}]}, "links[0].mbit_per_s"),
                         ({"epoch": -1}, "epoch")]:
        with pytest.raises(BadRecord) as e:
            InstanceStatus.from_json({**STATUS, **over})
        assert e.value.member == member


CHECKPOINT = {
    "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11", "epoch": 1,
    "compat_id": "bb" * 32, "scope_id": "cc" * 16, "prompt_blocks": ["aa" * 32, "dd" * 32],
    "prompt_tail": [374, 264], "generated": [1296, 315, 279], "output_offset": 3,
    "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 3,
                "deterministic": False},
}


def test_checkpoint_round_trip_and_refusals():
    c = SessionCheckpoint.from_json(CHECKPOINT)
    assert c.to_json() == CHECKPOINT
    for over, member in [({"session": "nope"}, "session"), ({"output_offset": 4}, "output_offset"),
                         ({"generated": [1, -2]}, "generated[1]"),
                         ({"sampler": {"params": {}}}, "sampler.method"),
                         ({"prompt_blocks": ["aa"]}, "prompt_blocks[0]")]:
        with pytest.raises(BadRecord) as e:
            SessionCheckpoint.from_json({**CHECKPOINT, **over})
        assert e.value.member == member


def test_shard_map_contiguity():
    good = {"map": "m", "version": 4, "shards": [
        {"tokens": [0, 10], "instance": "http://a/"}, {"tokens": [10, 20], "instance": "http://b/"}]}
    m = ShardMap.from_json(good)
    assert m.to_json() == good and m.ranges_of("http://b/") == [(10, 20)]
    gap = {**good, "shards": [{"tokens": [0, 10], "instance": "http://a/"},
                              {"tokens": [11, 20], "instance": "http://b/"}]}
    overlap = {**good, "shards": [{"tokens": [0, 10], "instance": "http://a/"},
                                  {"tokens": [9, 20], "instance": "http://b/"}]}
    empty = {**good, "shards": [{"tokens": [5, 5], "instance": "http://a/"}]}
    for bad in (gap, overlap, empty):
        with pytest.raises(BadRecord):
            ShardMap.from_json(bad)


def test_reshard_messages():
    plan = {"map": "m", "from": 4, "to": 5, "deadline_ms": 200, "retain": [[0, 32768]],
            "fetch": [{"tokens": [32768, 49152], "from": "http://b/"}], "release": []}
    p = parse_reshard(plan)
    assert isinstance(p, ReshardPlan) and p.to_json() == plan
    assert parse_reshard({"map": "m", "commit": 5}) == ReshardDecision("m", "commit", 5)
    assert parse_reshard({"map": "m", "abort": 5}).kind == "abort"
    with pytest.raises(BadRecord):
        parse_reshard({**plan, "to": 7})
    with pytest.raises(BadRecord):
        parse_reshard({**plan, "retain": [[0, 40000]]})  # overlaps a fetched range


def test_prefetch_directive():
    d = {"directive": str(uuid.uuid4()), "request_ref": "r1", "scope_id": "cc" * 16,
         "compat_id": "bb" * 32, "blocks": [{"block_key": "aa" * 32, "sources": ["http://h/"]}],
         "layer_order": "ascending", "deadline_ms": 50, "lease_ms": 2000}
    assert PrefetchDirective.from_json(d).to_json() == d
    with pytest.raises(BadRecord) as e:
        PrefetchDirective.from_json({**d, "blocks": [{"block_key": "aa" * 32, "sources": []}]})
    assert e.value.member == "blocks[0].sources"


def test_leases_and_lookup():
    assert LeaseRequest.from_json({"block_keys": ["aa" * 32], "ttl_ms": 10}).ttl_ms == 10
    with pytest.raises(BadRecord):
        LeaseRequest.from_json({"block_keys": [], "ttl_ms": 10})
    assert LeaseGrant.from_json({"lease": "x", "ttl_ms": 5}).to_json() == {"lease": "x", "ttl_ms": 5}
    req = {"scope_id": "cc" * 16, "compat_id": "bb" * 32, "block_keys": ["aa" * 32],
           "targets": ["http://i/"]}
    assert LookupRequest.from_json(req).to_json() == req


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)


@given(st.dictionaries(st.sampled_from(list(replica()) + ["x"]), json_values, max_size=12))
def test_arbitrary_json_gives_a_record_or_bad_record(data):
    for parser in (ReplicaRecord.from_json, InstanceStatus.from_json, SessionCheckpoint.from_json,
                   PrefetchDirective.from_json, LookupRequest.from_json, ShardMap.from_json,
                   parse_reshard, LeaseRequest.from_json):
        try:
            parser(data)
        except BadRecord:
            pass


@pytest.mark.parametrize("bad, index", [([1, 2, -1], 2), ([1, True], 1), ([1, 2.0, 3], 1),
                                        ([5, 1 << 32], 1), ([0, "x"], 1)])
def test_token_arrays_name_their_first_bad_element(bad, index):
    from kvsp_moq.protocol import validate as v

    with pytest.raises(BadRecord) as e:
        v.tokens(bad, "tokens")
    assert e.value.member == f"tokens[{index}]"
    assert v.tokens([0, 0xFFFFFFFF], "tokens") == [0, 0xFFFFFFFF] and v.tokens([], "t") == []


@pytest.mark.parametrize("bad, index", [(["ab" * 32, "ab" * 31 + "g1"], 1), (["ab" * 32, 7], 1),
                                        (["ab" * 31 + "a\n"], 0), (["ab" * 32, "ab" * 33], 1),
                                        ([" " + "ab" * 31 + "a"], 0)])
def test_hex_arrays_are_read_in_bulk_and_name_their_first_bad_element(bad, index):
    from kvsp_moq.protocol import validate as v

    with pytest.raises(BadRecord) as e:
        v.hex_array(bad, 32, "layer_digests")
    assert e.value.member == f"layer_digests[{index}]"
    assert v.hex_array(["AB" * 32, "0c" * 32], 32, "layer_digests") == ("ab" * 32, "0c" * 32)
    assert v.hex_array(["0c" * 32], 32, "layer_digests") == ("0c" * 32,) and v.hex_array([], 32, "k") == ()


def test_layer_digests_in_uppercase_are_normalised_and_give_the_replica_digest():
    layer = hashlib.sha256(b"layer").hexdigest()
    r = ReplicaRecord.from_json(replica(layer_digests=[layer.upper()], residency=[],
                                        digest="sha-256:" + hashlib.sha256(bytes.fromhex(layer)).hexdigest()))
    assert r.layer_digests == (layer,)


def test_an_in_production_record_names_its_pass_track_and_slot():
    from kvsp_moq.protocol.records import LIVE_DIGEST

    live = replica(holder="moqt://127.0.0.1:4443/", moqt_namespace="bnM", digest=LIVE_DIGEST,
                   layer_digests=None, residency=[], live=True,
                   live_pass={"moqt_namespace": "cGFzcw", "slot": 3})
    del live["layer_digests"]
    r = ReplicaRecord.from_json(live)
    assert r.live_pass == ("cGFzcw", 3) and ReplicaRecord.from_json(r.to_json()) == r
    for bad, member in (({"live": False}, "live_pass"), ({"live_pass": {"slot": 1}}, "live_pass.moqt_namespace"),
                        ({"live_pass": {"moqt_namespace": "cGFzcw", "slot": -1}}, "live_pass.slot")):
        with pytest.raises(BadRecord) as e:
            ReplicaRecord.from_json({**live, **bad})
        assert e.value.member == member
