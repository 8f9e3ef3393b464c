"""Our draft-20 and draft-22 codec against aiomoqt's (the peer's own venv, offline): what
aiomoqt's d20/d22 encoders write decodes with ours to what it meant (LOCATION_FILTER forms,
FILL_PARAMETERS, FETCH ranges with two-byte fields, FETCH_OK's inclusive end, GOAWAY
without Request ID, PUBLISH_OK with EXPIRES only, PUBLISH_STATE_NOTIFY, the bare
TRACK_NAMESPACE_PREFIX of 22, a fetch stream with an End of Timed-Out Range marker), our
encoder writes the same octets, and aiomoqt's decoders read what ours writes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.d18.data import (
    DataStreamParser,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    FetchStreamWriter,
)
from kvsp_moq.moqt.errors import ProtocolViolation
from kvsp_moq.moqt.wire import (
    FetchType,
    FilterType,
    GroupOrder,
    Location,
    SubscriptionFilter,
)

from .conftest import PEER_PYTHON

DRAFTS = (20, 22)
NS = (b"kvsp", b"x")
LF = m.LocationFilterType

# ---------------------------------------------------------------------------
# aiomoqt's encoders: one script, both drafts, output as hex in JSON
# ---------------------------------------------------------------------------

_ENCODE_SCRIPT = r"""
import json
from aiomoqt.context import profile_for
from aiomoqt.messages import (
    Fetch, FetchHeader, FetchObject, FetchOk, GoAway, LocationFilter, PublishOk,
    PublishStateNotify, RequestOk, RequestUpdate, Subscribe, SubscribeNamespace,
)

NS = (b"kvsp", b"x")

def out(buf):
    if isinstance(buf, (bytes, bytearray)):
        return bytes(buf).hex()
    return bytes(buf.data_slice(0, buf.tell())).hex()

def sub(request_id=0, **kw):
    return Subscribe(request_id=request_id, track_namespace=NS, track_name=b"t", **kw)

def fetch(request_id, start, end, priority=None, order=None):
    return Fetch(fetch_type=1, request_id=request_id, subscriber_priority=priority, group_order=order,
                 namespace=NS, track_name=b"t", start_group=start[0], start_object=start[1],
                 end_group=None if end is None else end[0], end_object=None if end is None else end[1])

res = {}
for draft in (20, 22):
    p = profile_for(draft)
    r = res[draft] = {}
    r["fetch_kv"] = out(fetch(0, (0, 2), (0, 6)).serialize(prof=p))
    r["fetch_big"] = out(fetch(4, (200, 130), (300, 150), priority=9, order=2).serialize(prof=p))
    r["fetch_whole_group"] = out(fetch(6, (5, 0), (7, 0)).serialize(prof=p))
    r["fetch_open"] = out(fetch(8, (3, 1), None, order=1).serialize(prof=p))
    r["fetch_ok"] = out(FetchOk(request_id=0, end_of_track=0, largest_group_id=0,
                                largest_object_id=6).serialize(prof=p))
    r["fetch_ok_big"] = out(FetchOk(request_id=0, end_of_track=1, largest_group_id=300,
                                    largest_object_id=200).serialize(prof=p))
    r["goaway"] = out(GoAway(new_session_uri="", timeout=5, request_id=3).serialize(prof=p))
    r["goaway_uri"] = out(GoAway(new_session_uri="moqt://relay.example/next", timeout=1000).serialize(prof=p))
    r["publish_ok"] = out(PublishOk(expires=1000).serialize(prof=p))
    r["request_ok"] = out(RequestOk(parameters={0x08: 5, 0x09: (3, 4)}).serialize(prof=p))
    r["psn"] = out(PublishStateNotify(largest_group_id=1, largest_object_id=2, forward=0).serialize(prof=p))
    r["psn_filter"] = out(PublishStateNotify(largest_group_id=300, largest_object_id=7, forward=1,
                                             location_filter=LocationFilter.next_object()).serialize(prof=p))
    r["update_prefix"] = out(RequestUpdate(request_id=2, parameters={0x34: (b"a", b"b")}).serialize(prof=p))
    r["update_fill"] = out(RequestUpdate(request_id=2,
                                         parameters={0x23: {0x21: LocationFilter.relative(1)}}).serialize(prof=p))
    r["sub_next_object_fill"] = out(sub(location_filter=LocationFilter.next_object(),
                                        parameters={0x23: {0x21: LocationFilter.relative(1)}}).serialize(prof=p))
    r["sub_range_fill"] = out(sub(location_filter=LocationFilter.absolute(0, 2, 0, 5),
                                  parameters={0x23: {}}).serialize(prof=p))
    r["sub_next_group"] = out(sub(location_filter=LocationFilter.relative(0)).serialize(prof=p))
    r["sub_abs_start"] = out(sub(location_filter=LocationFilter.absolute(3, 4)).serialize(prof=p))
    r["sub_abs_zero"] = out(sub(location_filter=LocationFilter.absolute(0, 0)).serialize(prof=p))
    r["sub_big"] = out(sub(6, priority=7, forward=1, location_filter=LocationFilter.absolute(200, 130, 300),
                           parameters={0x35: 0, 0x23: {0x0A: 500, 0x20: 200,
                                                       0x21: LocationFilter.absolute(200, 0, 205, 149),
                                                       0x22: 2}}).serialize(prof=p))
    r["sub_namespace"] = out(SubscribeNamespace(request_id=0, namespace_prefix=(b"kvsp",),
                                                parameters={}).serialize(prof=p))
    o1 = FetchObject(group_id=0, subgroup_id=0, object_id=2, publisher_priority=128, payload=b"A")
    o2 = FetchObject(group_id=0, subgroup_id=0, object_id=3, publisher_priority=128, payload=b"B")
    o3 = FetchObject(group_id=0, object_id=5, end_of_range=0x20C)
    o4 = FetchObject(group_id=1, subgroup_id=0, object_id=0, publisher_priority=128, payload=b"C")
    r["stream"] = (out(FetchHeader(request_id=0).serialize(p)) + out(o1.serialize(prof=p))
                   + out(o2.serialize(prof=p, prior=o1)) + out(o3.serialize(prof=p, prior=o2))
                   + out(o4.serialize(prof=p, prior=o3)))
print(json.dumps(res))
"""

# ---------------------------------------------------------------------------
# aiomoqt's decoders, fed what our encoder writes (JSON on stdin)
# ---------------------------------------------------------------------------

_DECODE_SCRIPT = r"""
import dataclasses, enum, json, sys
from aiomoqt.context import profile_for
from aiomoqt.messages import (
    Fetch, FetchHeader, FetchObject, FetchOk, GoAway, LocationFilter, PublishOk,
    PublishStateNotify, RequestOk, RequestUpdate, Subscribe, SubscribeNamespace,
)
from aiomoqt.utils.buffer import Buffer

CLASSES = {c.__name__: c for c in (Fetch, FetchOk, GoAway, PublishOk, PublishStateNotify, RequestOk,
                                   RequestUpdate, Subscribe, SubscribeNamespace)}

def conv(v):
    if isinstance(v, LocationFilter):
        return [int(v.type), v.start_group, v.start_object, v.end_group, v.end_object]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    if isinstance(v, enum.Enum):
        return int(v.value)
    if isinstance(v, dict):
        return {str(int(k)): conv(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [conv(x) for x in v]
    return v

def fields_of(msg):
    return {f.name: conv(getattr(msg, f.name, None)) for f in dataclasses.fields(msg) if not f.name.startswith("_")}

def control(data, cls, prof):
    buf = Buffer(data=data, vi64=True)
    mtype = buf.pull_vint()
    length = buf.pull_uint16()
    end = buf.tell() + length
    msg = cls.deserialize(buf, prof=prof, buf_end=end)
    assert buf.tell() == end == len(data), (cls.__name__, buf.tell(), end, len(data))
    return dict(fields_of(msg), type=mtype)

def stream(data, prof):
    buf = Buffer(data=data, vi64=True)
    assert buf.pull_vint() == 5
    items = [["header", FetchHeader.deserialize(buf).request_id]]
    prior = None
    while buf.tell() < len(data):
        obj = FetchObject.deserialize(buf, prior=prior, prof=prof)
        items.append([obj.group_id, obj.subgroup_id, obj.object_id, obj.publisher_priority, obj.payload.hex(),
                      obj.end_of_range])
        prior = obj
    return items

res = {}
for draft, todo in json.load(sys.stdin).items():
    prof = profile_for(int(draft))
    res[draft] = {name: stream(bytes.fromhex(data), prof) if cls == "stream"
                  else control(bytes.fromhex(data), CLASSES[cls], prof)
                  for name, (cls, data) in todo.items()}
print(json.dumps(res))
"""


def _run_peer(script: str, stdin: str | None = None) -> dict[str, Any]:
    done = subprocess.run([str(PEER_PYTHON), "-c", script], input=stdin, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def aiomoqt_wire() -> dict[int, dict[str, bytes]]:
    """What aiomoqt's d20 and d22 encoders write, by draft and name."""
    raw = _run_peer(_ENCODE_SCRIPT)
    return {int(draft): {name: bytes.fromhex(value) for name, value in items.items()} for draft, items in raw.items()}


# ---------------------------------------------------------------------------
# The same messages in our model
# ---------------------------------------------------------------------------


def _sub(request_id: int = 0, **parameters: Any) -> m.Subscribe:
    return m.Subscribe(request_id, NS, b"t", m.Parameters(**parameters))


def _fetch(request_id: int, start: Location, end: Location, **parameters: Any) -> m.Fetch:
    return m.Fetch(request_id, FetchType.STANDALONE, NS, b"t", start, end, parameters=m.Parameters(**parameters))


#: name -> (our message for a draft, whether our encoder writes aiomoqt's octets).
OURS: dict[str, tuple[Callable[[int], m.Message], bool]] = {
    "fetch_kv": (lambda d: _fetch(0, Location(0, 2), Location(0, 6)), True),
    "fetch_big": (lambda d: _fetch(4, Location(200, 130), Location(300, 150), subscriber_priority=9,
                                   group_order=GroupOrder.DESCENDING), True),
    "fetch_whole_group": (lambda d: _fetch(6, Location(5, 0), Location(7, 0)), True),
    "fetch_open": (lambda d: _fetch(8, Location(3, 1), m.OPEN_END, group_order=GroupOrder.ASCENDING), True),
    "fetch_ok": (lambda d: m.FetchOk(False, Location(0, 6)), True),
    "fetch_ok_big": (lambda d: m.FetchOk(True, Location(300, 200)), True),
    "goaway": (lambda d: m.Goaway("", 5, None), True),
    "goaway_uri": (lambda d: m.Goaway("moqt://relay.example/next", 1000, None), True),
    "publish_ok": (lambda d: m.RequestOk(m.Parameters(expires=1000)), True),
    "request_ok": (lambda d: m.RequestOk(m.Parameters(expires=5, largest_object=Location(3, 4))), True),
    "psn": (lambda d: m.PublishStateNotify(m.Parameters(largest_object=Location(1, 2), forward=False)), True),
    "psn_filter": (lambda d: m.PublishStateNotify(m.Parameters(
        largest_object=Location(300, 7), forward=True,
        subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT))), True),
    "update_prefix": (lambda d: m.RequestUpdate(2, m.Parameters(track_namespace_prefix=(b"a", b"b"))), True),
    "update_fill": (lambda d: m.RequestUpdate(2, m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,))))),
                    True),
    "sub_next_object_fill": (lambda d: _sub(subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT),
                                            fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))), True),
    # Our subscription filter has no end Object: only the decode is compared here.
    "sub_range_fill": (lambda d: _sub(subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_RANGE,
                                                                             Location(0, 2), 0, 5),
                                      fill=m.Fill()), True),
    "sub_next_group": (lambda d: _sub(subscription_filter=SubscriptionFilter(FilterType.NEXT_GROUP_START)), True),
    "sub_abs_start": (lambda d: _sub(subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(3, 4))),
                      True),
    # Draft-20 writes an absolute start at {0,0} as no filter (two zeros mean Next Object).
    "sub_abs_zero": (lambda d: _sub(subscription_filter=None if d == 20 else
                                    SubscriptionFilter(FilterType.ABSOLUTE_START, Location(0, 0))), True),
    "sub_big": (lambda d: _sub(6, subscriber_priority=7, forward=True, include_properties=False,
                               subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_RANGE,
                                                                      Location(200, 130), 300),
                               fill=m.Fill(location_filter=(LF.ABSOLUTE_RANGE, (200, 0, 5, 149)), fill_timeout=500,
                                           subscriber_priority=200, group_order=GroupOrder.DESCENDING)), True),
    "sub_namespace": (lambda d: m.SubscribeNamespace(0, (b"kvsp",)), True),
}
BYTE_EXACT = [name for name, (_, exact) in OURS.items() if exact]


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("name", list(OURS))
def test_aiomoqt_encodings_decode_with_ours(aiomoqt_wire: dict[int, dict[str, bytes]], draft: int, name: str) -> None:
    assert m.decode_message(aiomoqt_wire[draft][name], draft) == OURS[name][0](draft)


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("name", BYTE_EXACT)
def test_our_encoder_writes_aiomoqt_octets(aiomoqt_wire: dict[int, dict[str, bytes]], draft: int, name: str) -> None:
    message = OURS[name][0](draft)
    if name == "sub_abs_zero":  # the {0,0} start itself, which draft-20 writes as no filter
        message = _sub(subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(0, 0)))
    assert message.encode(draft).hex(" ") == aiomoqt_wire[draft][name].hex(" ")


def test_the_drafts_differ_where_the_notes_say(aiomoqt_wire: dict[int, dict[str, bytes]]) -> None:
    """20 and 22 differ in LOCATION_FILTER (Next Object, {0,0}, fields over 127) and in
    TRACK_NAMESPACE_PREFIX, and agree elsewhere; the checks above are not vacuous."""
    d20, d22 = aiomoqt_wire[20], aiomoqt_wire[22]
    differ = {name for name in d20 if d20[name] != d22[name]}
    assert differ == {"fetch_big", "psn_filter", "update_prefix", "sub_next_object_fill", "sub_abs_zero", "sub_big"}
    assert d20["fetch_kv"].hex(" ") == "16 00 12 00 02 04 6b 76 73 70 01 78 01 74 01 21 04 00 02 00 05"
    assert d20["fetch_ok"].hex(" ") == "18 00 04 00 00 05 00"
    assert d20["goaway"].hex(" ") == "10 00 02 00 05"
    assert d20["psn"].hex(" ") == "22 00 06 02 09 01 02 07 00"
    assert d20["sub_range_fill"].hex(" ") == (
        "03 00 15 00 02 04 6b 76 73 70 01 78 01 74 02 21 04 00 02 00 05 02 01 00")
    assert d20["update_prefix"].endswith(bytes.fromhex("34 05 02 01 61 01 62"))
    assert d22["update_prefix"].endswith(bytes.fromhex("34 02 01 61 01 62"))


@pytest.mark.parametrize("draft", DRAFTS)
def test_aiomoqt_fetch_stream_with_a_timed_out_range(aiomoqt_wire: dict[int, dict[str, bytes]], draft: int) -> None:
    """Objects 0/2 and 0/3, End of Timed-Out Range up to 0/5 (`82 0c`), then 1/0 delta-coded
    from the marker: read on 20 and 22, a PROTOCOL_VIOLATION for a draft-18 reader."""
    data = aiomoqt_wire[draft]["stream"]
    assert bytes.fromhex("82 0c 00 05") in data
    assert DataStreamParser(timed_out_range=True).feed(data, end_stream=True) == [
        FetchHeader(0),
        FetchObject(0, 0, 2, 128, b"A"),
        FetchObject(0, 0, 3, 128, b"B"),
        FetchEndOfRange(Location(0, 5), True),
        FetchObject(1, 0, 0, 128, b"C"),
    ]
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(data, end_stream=True)


# ---------------------------------------------------------------------------
# aiomoqt reads what we write
# ---------------------------------------------------------------------------

#: name -> aiomoqt class that decodes it (REQUEST_OK to a PUBLISH is its PublishOk).
_PEER_CLASS = {
    "fetch_kv": "Fetch", "fetch_big": "Fetch", "fetch_whole_group": "Fetch", "fetch_open": "Fetch",
    "fetch_ok": "FetchOk", "fetch_ok_big": "FetchOk", "goaway_uri": "GoAway", "publish_ok": "PublishOk",
    "request_ok": "RequestOk", "psn_filter": "PublishStateNotify", "update_prefix": "RequestUpdate",
    "update_fill": "RequestUpdate", "sub_next_object_fill": "Subscribe", "sub_big": "Subscribe",
    "sub_abs_zero": "Subscribe",
}


def _our_fetch_stream() -> bytes:
    """Our fetch stream writer: objects across groups, then both draft-18 markers."""
    w = FetchStreamWriter(9)
    data = bytearray(w.header_bytes())
    for group, obj, payload in ((4, 1, b"x"), (4, 2, b"y"), (6, 0, b"z")):
        data += w.object_header(group, obj, len(payload)) + payload
    data += w.end_of_range(6, 3, unknown=True)
    data += w.end_of_range(7, 0)
    return bytes(data)


@pytest.fixture(scope="module")
def aiomoqt_reads_ours() -> dict[int, dict[str, Any]]:
    todo: dict[str, dict[str, list[str]]] = {}
    for draft in DRAFTS:
        items = {name: [cls, OURS[name][0](draft).encode(draft).hex()] for name, cls in _PEER_CLASS.items()}
        items["sub_abs_zero"][1] = _sub(subscription_filter=SubscriptionFilter(
            FilterType.ABSOLUTE_START, Location(0, 0))).encode(draft).hex()
        items["stream"] = ["stream", _our_fetch_stream().hex()]
        todo[str(draft)] = items
    raw = _run_peer(_DECODE_SCRIPT, json.dumps(todo))
    return {int(draft): items for draft, items in raw.items()}


@pytest.mark.parametrize("draft", DRAFTS)
def test_aiomoqt_reads_our_fetches(aiomoqt_reads_ours: dict[int, dict[str, Any]], draft: int) -> None:
    """aiomoqt gives our inclusive LOCATION_FILTER ranges back in its d18 form (End = last + 1,
    Object 0 the whole group, None to Largest), with the filter type it read."""
    got = aiomoqt_reads_ours[draft]
    fields = ("request_id", "start_group", "start_object", "end_group", "end_object")
    assert [got["fetch_kv"][f] for f in fields] == [0, 0, 2, 0, 6]
    assert got["fetch_kv"]["location_filter"] == [LF.ABSOLUTE_RANGE, 0, 2, 0, 5]
    assert [got["fetch_big"][f] for f in fields] == [4, 200, 130, 300, 150]
    assert (got["fetch_big"]["subscriber_priority"], got["fetch_big"]["group_order"]) == (9, 2)
    assert [got["fetch_whole_group"][f] for f in fields] == [6, 5, 0, 7, 0]
    assert got["fetch_whole_group"]["location_filter"][0] == LF.ABSOLUTE_GROUP_END
    assert [got["fetch_open"][f] for f in fields] == [8, 3, 1, None, None]
    assert got["fetch_open"]["location_filter"] == [LF.ABSOLUTE_START, 3, 1, None, None]
    assert all(got[name]["type"] == 0x16 for name in ("fetch_kv", "fetch_big", "fetch_whole_group", "fetch_open"))


@pytest.mark.parametrize("draft", DRAFTS)
def test_aiomoqt_reads_our_answers(aiomoqt_reads_ours: dict[int, dict[str, Any]], draft: int) -> None:
    got = aiomoqt_reads_ours[draft]
    assert (got["fetch_ok"]["end_of_track"], got["fetch_ok"]["largest_group_id"],
            got["fetch_ok"]["largest_object_id"]) == (0, 0, 6)
    assert (got["fetch_ok_big"]["end_of_track"], got["fetch_ok_big"]["largest_group_id"],
            got["fetch_ok_big"]["largest_object_id"]) == (1, 300, 200)
    assert (got["goaway_uri"]["new_session_uri"], got["goaway_uri"]["timeout"], got["goaway_uri"]["request_id"]) == (
        "moqt://relay.example/next", 1000, None)
    assert (got["publish_ok"]["type"], got["publish_ok"]["expires"],
            got["publish_ok"]["parameters"]) == (0x07, 1000, {})
    assert got["request_ok"]["parameters"] == {"8": 5, "9": [3, 4]}
    psn = got["psn_filter"]
    assert (psn["type"], psn["forward"], psn["largest_group_id"], psn["largest_object_id"]) == (0x22, 1, 300, 7)
    assert psn["location_filter"] == [LF.NEXT_OBJECT, None, None, None, None]


@pytest.mark.parametrize("draft", DRAFTS)
def test_aiomoqt_reads_our_subscribes_and_updates(aiomoqt_reads_ours: dict[int, dict[str, Any]], draft: int) -> None:
    got = aiomoqt_reads_ours[draft]
    assert got["update_prefix"]["parameters"] == {"52": [b"a".hex(), b"b".hex()]}
    assert got["update_fill"]["parameters"] == {"35": {"33": [LF.RELATIVE_START, 1, None, None, None]}}
    nof = got["sub_next_object_fill"]
    assert nof["location_filter"] == [LF.NEXT_OBJECT, None, None, None, None]
    assert nof["parameters"] == {"35": {"33": [LF.RELATIVE_START, 1, None, None, None]}}
    big = got["sub_big"]
    assert (big["request_id"], big["priority"], big["forward"]) == (6, 7, 1)
    assert big["location_filter"] == [LF.ABSOLUTE_GROUP_END, 200, 130, 300, None]
    assert big["parameters"] == {
        "53": 0,
        "35": {"10": 500, "32": 200, "33": [LF.ABSOLUTE_RANGE, 200, 0, 205, 149], "34": 2},
    }
    zero = got["sub_abs_zero"]["location_filter"]
    # Draft-20 cannot say "from {0,0}" but by no filter; draft-22 has type 0x02 for it.
    assert zero == ([LF.NONE, None, None, None, None] if draft == 20 else [LF.ABSOLUTE_START, 0, 0, None, None])


@pytest.mark.parametrize("draft", DRAFTS)
def test_aiomoqt_reads_our_fetch_stream(aiomoqt_reads_ours: dict[int, dict[str, Any]], draft: int) -> None:
    assert aiomoqt_reads_ours[draft]["stream"] == [
        ["header", 9],
        [4, 0, 1, 128, b"x".hex(), None],
        [4, 0, 2, 128, b"y".hex(), None],
        [6, 0, 0, 128, b"z".hex(), None],
        [6, 0, 3, 128, "", 0x10C],
        [7, 0, 0, 128, "", 0x8C],
    ]
