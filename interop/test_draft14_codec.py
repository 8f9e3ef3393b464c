"""Our draft-14 codec against bytes made by aiomoqt's draft-14 encoder (the peer's own venv,
offline): every message, stream and datagram it encodes decodes to what it meant, and our
encoder produces the same control-message octets."""

from __future__ import annotations

import json
import subprocess

from kvsp_moq.moqt.d14 import data as d14data
from kvsp_moq.moqt.d14 import messages as d
from kvsp_moq.moqt.wire import FetchType, GroupOrder, Location, SubscriptionFilter

from .conftest import PEER_PYTHON

# ---------------------------------------------------------------------------
# Bytes from another implementation: aiomoqt's draft-14 encoder (interop peer venv)
# ---------------------------------------------------------------------------

_AIOMOQT_PYTHON = PEER_PYTHON

_AIOMOQT_SCRIPT = r"""
import json
from aiomoqt.context import PROFILES
from aiomoqt.types import MOQTDraft, MOQT_VERSION_DRAFT14, GroupOrder, ContentExistsCode, ObjectStatus
from aiomoqt.messages.session_setup import ClientSetup, ServerSetup
from aiomoqt.messages.subscribe import Subscribe, SubscribeOk, SubscribeError, Unsubscribe
from aiomoqt.messages.fetch import Fetch, FetchOk, FetchCancel
from aiomoqt.messages.data import SubgroupHeader, FetchHeader, FetchObject, ObjectDatagram, ObjectDatagramStatus

prof = PROFILES[MOQTDraft.DRAFT_14]

def out(buf):
    if isinstance(buf, (bytes, bytearray)):
        return bytes(buf).hex()
    return bytes(buf.data_slice(0, buf.tell())).hex()

res = {}
res["client_setup"] = out(ClientSetup(versions=[MOQT_VERSION_DRAFT14],
    parameters={1: b"/kv", 2: 100}).serialize(prof=prof))
res["server_setup"] = out(ServerSetup(selected_version=MOQT_VERSION_DRAFT14, parameters={2: 50}).serialize(prof=prof))
res["subscribe"] = out(Subscribe(request_id=2, track_namespace=(b"kv", b"ns"), track_name=b"t", priority=7,
    group_order=2, forward=1, filter_type=4, start_group=3, start_object=1, end_group=9,
    parameters={2: 1000}).serialize(prof=prof))
res["subscribe_ok"] = out(SubscribeOk(request_id=2, track_alias=5, expires=0, group_order=GroupOrder(1),
    content_exists=ContentExistsCode(1), largest_group_id=4, largest_object_id=2, parameters={}).serialize(prof=prof))
res["subscribe_error"] = out(SubscribeError(request_id=2, error_code=4, reason="nope").serialize(prof=prof))
res["unsubscribe"] = out(Unsubscribe(request_id=2).serialize(prof=prof))
res["fetch"] = out(Fetch(request_id=4, subscriber_priority=9, group_order=1, fetch_type=1, namespace=(b"kv",),
    track_name=b"t", start_group=1, start_object=0, end_group=3, end_object=0, parameters={}).serialize(prof=prof))
res["fetch_ok"] = out(FetchOk(request_id=4, group_order=1, end_of_track=1, largest_group_id=3, largest_object_id=0,
    parameters={}).serialize(prof=prof))
res["fetch_cancel"] = out(FetchCancel(request_id=4).serialize(prof=prof))
h = SubgroupHeader(track_alias=2, group_id=5, subgroup_id=3, publisher_priority=7, extensions_present=True,
    end_of_group=True, subgroup_id_mode=2, prof=prof)
res["subgroup"] = (out(h.serialize()) + out(h.next_object(payload=b"abcd", extensions={4: 9, 77: b"tr"}, object_id=0))
    + out(h.next_object(payload=b"", status=ObjectStatus.END_OF_GROUP, object_id=3)))
res["fetch_stream"] = out(FetchHeader(request_id=4).serialize(prof)) + out(FetchObject(group_id=1, subgroup_id=0,
    object_id=2, publisher_priority=9, extensions={2: 5}, payload=b"xy").serialize(prof=prof))
res["datagram"] = out(ObjectDatagram(track_alias=1, group_id=2, object_id=0, publisher_priority=5, payload=b"hi",
    end_of_group=True).serialize(prof))
res["datagram_status"] = out(ObjectDatagramStatus(track_alias=1, group_id=2, object_id=3, publisher_priority=5,
    status=ObjectStatus.END_OF_TRACK).serialize(prof))
print(json.dumps(res))
"""


def test_decodes_aiomoqt_draft14_encodings() -> None:
    done = subprocess.run(
        [str(_AIOMOQT_PYTHON), "-c", _AIOMOQT_SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    wire = {name: bytes.fromhex(value) for name, value in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    expected_messages = {
        "client_setup": d.ClientSetup((d.VERSION,), d.SetupParameters(path="/kv", max_request_id=100)),
        "server_setup": d.ServerSetup(d.VERSION, d.SetupParameters(max_request_id=50)),
        "subscribe": d.Subscribe(2, (b"kv", b"ns"), b"t", 7, GroupOrder.DESCENDING, True,
                                 SubscriptionFilter.absolute_range(3, 1, 9), d.Parameters(delivery_timeout=1000)),
        "subscribe_ok": d.SubscribeOk(2, 5, 0, GroupOrder.ASCENDING, Location(4, 2)),
        "subscribe_error": d.SubscribeError(2, d.SubscribeErrorCode.TRACK_DOES_NOT_EXIST, "nope"),
        "unsubscribe": d.Unsubscribe(2),
        "fetch": d.Fetch(4, FetchType.STANDALONE, (b"kv",), b"t", Location(1, 0), Location(3, 0),
                         subscriber_priority=9, group_order=GroupOrder.ASCENDING),
        "fetch_ok": d.FetchOk(4, GroupOrder.ASCENDING, True, Location(3, 0)),
        "fetch_cancel": d.FetchCancel(4),
    }
    for name, message in expected_messages.items():
        assert d.decode_message(wire[name]) == message, name
        assert message.encode() == wire[name], name

    header = d14data.SubgroupHeader(2, 5, 3, 7, True, True, d.SubgroupIdMode.EXPLICIT)
    assert d14data.DataStreamParser().feed(wire["subgroup"], end_stream=True) == [
        header,
        d14data.SubgroupObject(0, 3, d.ObjectStatus.NORMAL, b"abcd", ((4, 9), (77, b"tr"))),
        d14data.SubgroupObject(3, 3, d.ObjectStatus.END_OF_GROUP, b""),
    ]
    assert d14data.DataStreamParser().feed(wire["fetch_stream"], end_stream=True) == [
        d14data.FetchHeader(4),
        d14data.FetchObject(1, 0, 2, 9, d.ObjectStatus.NORMAL, b"xy", ((2, 5),)),
    ]
    assert d14data.decode_datagram(wire["datagram"]) == d14data.ObjectDatagram(1, 2, 0, b"hi", 5, end_of_group=True)
    assert d14data.decode_datagram(wire["datagram_status"]) == d14data.ObjectDatagram(
        1, 2, 3, b"", 5, d.ObjectStatus.END_OF_TRACK)
