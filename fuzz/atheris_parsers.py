"""Coverage-guided fuzzing of every parser that reads octets from the network or a disk.

The targets are those of the hypothesis tests (tests/protocol, tests/moqt), run here for as long as
one likes with libFuzzer's coverage feedback. Each target has the same rule as its test: the
input gives a value, or the documented error; any other exception is a finding, and libFuzzer
saves the input that raised it.

    python fuzz/atheris_parsers.py --list
    python fuzz/atheris_parsers.py TARGET [libFuzzer flags] [CORPUS_DIR ...]
    python fuzz/atheris_parsers.py all -runs=20000          # each target in turn, in-process
    python fuzz/atheris_parsers.py TARGET --self-test        # no atheris needed: random inputs
    python fuzz/atheris_parsers.py --seeds DIR               # valid inputs to start a corpus from

See docs/fuzzing.md.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsp_moq.errors import BadContainer, BadRecord
from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.d18.data import (
    DataStreamParser,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    PaddingHeader,
    SubgroupHeader,
    SubgroupObject,
    decode_datagram,
)
from kvsp_moq.moqt.errors import (
    KeyValueFormattingError,
    ProtocolViolation,
    SessionError,
)
from kvsp_moq.moqt.varint import encode_vi64
from kvsp_moq.naming import split_layer
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.container_parser import ContainerParser
from kvsp_moq.protocol.records import (
    InstanceStatus,
    LeaseRequest,
    LookupRequest,
    PrefetchDirective,
    ReplicaRecord,
    SessionCheckpoint,
    ShardMap,
    parse_reshard,
)

DATA_ITEMS = (SubgroupHeader, SubgroupObject, FetchHeader, FetchObject, FetchEndOfRange, PaddingHeader)
RECORD_PARSERS = (ReplicaRecord.from_json, InstanceStatus.from_json, SessionCheckpoint.from_json,
                  PrefetchDirective.from_json, LookupRequest.from_json, ShardMap.from_json,
                  parse_reshard, LeaseRequest.from_json)
MESSAGE_TYPES = sorted(m.MESSAGE_TYPES[18])


# --------------------------------------------------------------------------- targets


def container(data: bytes) -> None:
    """KVB1 container (§4.3): a container that re-encodes to the same length, or BadContainer."""
    try:
        c = Container(data)
    except BadContainer:
        return
    c.layer_digests()
    again = encode(c.first_layer, c.token_count, [(bytes(x.k), bytes(x.v)) for x in c.layers()],
                   codec=c.codec)
    assert len(again) == len(data), "a parsed container must re-encode to its own length"


def container_stream(data: bytes) -> None:
    """The incremental container parser of HTTP bodies, fed in pieces: layers or a refusal."""
    if not data:
        return
    piece = data[0] % 32 + 1
    body = data[1:]
    asm = ContainerParser(max_size=4096)
    try:
        for i in range(0, len(body), piece):
            for layer in asm.feed(body[i:i + piece]):
                assert layer.index >= asm.first_layer
        if asm.complete:
            asm.close()
    except BadContainer:
        return


#: A valid Replica Record: the records target changes one member of it (or merges an object
#: into it), so that inputs get past the first member check into every validation rule.
BASE_RECORD = {"block_key": "ab" * 32, "compat_id": "cd" * 32, "scope_id": "ef" * 16,
               "holder": "http://127.0.0.1:8801/", "codec": 1, "size": 4096,
               "digest": "sha-256:" + "00" * 32, "layer_digests": ["11" * 32], "ttl_ms": 60_000}


def records(data: bytes) -> None:
    """Every JSON record parser (§4.4 ff.): a record or BadRecord, for any JSON document."""
    if not data:
        return
    try:
        value = json.loads(data[1:].decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return
    keys = sorted(BASE_RECORD) + ["x"]
    doc: object
    if data[0] == 0:
        doc = value  # the document itself, whatever it is
    elif isinstance(value, dict):
        doc = {**BASE_RECORD, **value}
    else:
        doc = {**BASE_RECORD, keys[data[0] % len(keys)]: value}
    for parser in RECORD_PARSERS:
        try:
            parser(doc)
        except BadRecord:
            pass


def moqt_message(data: bytes) -> None:
    """One control message: a Message or a SessionError (a MOQT close code)."""
    try:
        message = m.decode_message(data)
    except SessionError:
        return
    assert isinstance(message, m.Message)


def moqt_message_typed(data: bytes) -> None:
    """A payload under each known message type: a Message that round-trips, or a SessionError."""
    if not data:
        return
    mtype = MESSAGE_TYPES[data[0] % len(MESSAGE_TYPES)]
    payload = data[1:0x10000]
    try:
        message = m.decode_message(encode_vi64(mtype) + len(payload).to_bytes(2, "big") + payload)
    except SessionError:
        return
    assert m.decode_message(message.encode()) == message, "a decoded message must round-trip"


def moqt_control_stream(data: bytes) -> None:
    """The control stream parser on arbitrary octets: messages or a SessionError."""
    parser = m.ControlStreamParser()
    try:
        parser.feed(data)
    except SessionError:
        pass


def moqt_auth_token(data: bytes) -> None:
    try:
        token = wire.AuthToken.decode(data)
    except KeyValueFormattingError:
        return
    assert wire.AuthToken.decode(token.encode()) == token


def moqt_filter(data: bytes) -> None:
    try:
        decoded = wire.SubscriptionFilter.decode(data)
    except ProtocolViolation:
        return
    assert wire.SubscriptionFilter.decode(decoded.encode()) == decoded


def moqt_data_stream(data: bytes) -> None:
    """Subgroup and fetch streams, fed in pieces: data items or a SessionError."""
    if not data:
        return
    piece = data[0] % 16 + 1
    body = data[1:]
    parser = DataStreamParser(max_object_size=10_000)
    try:
        for i in range(0, len(body), piece):
            for item in parser.feed(body[i:i + piece]):
                assert isinstance(item, DATA_ITEMS)
        parser.feed(b"", end_stream=True)
    except SessionError:
        pass


def moqt_datagram(data: bytes) -> None:
    try:
        decode_datagram(data)
    except SessionError:
        pass


def kv_object(data: bytes) -> None:
    """A KV layer object's payload and properties (DESIGN §4): a layer or BadRecord."""
    if len(data) < 2:
        return
    props = ((0x3800, data[0]), (0x3802, data[1] * 7)) if data[0] & 1 else ()
    try:
        layer, _ = split_layer(0, data[2:], props)
    except BadRecord:
        return
    assert len(layer.k) + len(layer.v) == len(data) - 2


TARGETS: dict[str, Callable[[bytes], None]] = {
    "container": container,
    "container_stream": container_stream,
    "records": records,
    "moqt_message": moqt_message,
    "moqt_message_typed": moqt_message_typed,
    "moqt_control_stream": moqt_control_stream,
    "moqt_auth_token": moqt_auth_token,
    "moqt_filter": moqt_filter,
    "moqt_data_stream": moqt_data_stream,
    "moqt_datagram": moqt_datagram,
    "kv_object": kv_object,
}


def _seeds() -> list[bytes]:
    """A few valid inputs, so the fuzzer starts from inside the formats."""
    good = encode(0, 16, [(b"k" * 8, b"v" * 8), (b"K" * 4, b"V" * 4)])
    return [good, b"\x05" + good, b"\x00" + json.dumps(BASE_RECORD).encode(), b"\x03" + b'"x"',
            m.Setup(path="/a").encode()]


# --------------------------------------------------------------------------- drivers


def self_test(name: str, runs: int, seed: int = 0) -> int:
    """Random and mutated inputs without atheris: checks that a target runs, not a fuzzer."""
    rnd = random.Random(seed)
    target = TARGETS[name]
    seeds = _seeds()
    for _ in range(runs):
        if rnd.random() < 0.5:
            data = bytearray(rnd.choice(seeds))
            for _ in range(rnd.randint(1, 4)):
                if data:
                    data[rnd.randrange(len(data))] = rnd.randrange(256)
            data = bytes(data)
        else:
            data = rnd.randbytes(rnd.randint(0, 200))
        target(data)
    return runs


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        print("targets:", " ".join(TARGETS), "all")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "--seeds":
        # A starting corpus of valid inputs: python fuzz/atheris_parsers.py --seeds DIR
        out = Path(rest[0] if rest else "fuzz/corpus")
        out.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(_seeds()):
            (out / f"seed-{i}").write_bytes(seed)
        print(f"{len(_seeds())} seeds in {out}")
        return 0
    names = list(TARGETS) if name == "all" else [name]
    for n in names:
        if n not in TARGETS:
            print(f"unknown target {n!r}; one of: {', '.join(TARGETS)}", file=sys.stderr)
            return 2
    if "--self-test" in rest:
        runs = int(os.environ.get("KVSP_FUZZ_RUNS", "2000"))
        for n in names:
            start = time.perf_counter()
            self_test(n, runs)
            print(f"{n}: {runs} inputs in {time.perf_counter() - start:.1f} s, no finding")
        return 0
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: pip install atheris (or use --self-test)", file=sys.stderr)
        return 2
    if name == "all":
        # libFuzzer runs one target per process: run each in a child with the same flags.
        import subprocess

        status = 0
        for n in names:
            print(f"== {n}", flush=True)
            status |= subprocess.call([sys.executable, __file__, n, *rest])
        return status
    target = TARGETS[name]

    def one_input(data: bytes) -> None:
        target(data)

    # The parsers were imported above, before atheris: instrument what is loaded now, so that
    # libFuzzer sees their branches (without this it reports "no interesting inputs").
    atheris.instrument_all()
    atheris.Setup([sys.argv[0], *rest], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
