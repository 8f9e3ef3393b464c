"""A live KV track is a plain MOQT track: independent subscribers receive a block's layers
through our relay while the block is still being computed.

Our holder's BlockPublisher (in this process) produces a block of LAYERS layers into our relay
(`python -m relay.service`): BEFORE layers exist when the peer subscribes, and from then on
layer l+1 is added only once the peer has reported layer l. So every later layer is proven to
reach the peer after its SUBSCRIBE was accepted and before the block was complete, and the
block can only be read whole if the relay forwards each layer as it comes. Each peer must get
every layer of group 0, in layer order, byte for byte (the SHA-256 of each payload against
the layer's K||V), the subgroup stream ended after the last layer.

1. aiomoqt (interop/peers/aiomoqt_sub.py --each) at drafts 18, 20, 22 and 14, our publisher
   on 18: the relay carries the live layers across drafts.
2. moq-rs (interop/peers/moqrs_sub.py) on the draft our relay picks from its offer (18), and
   with the relay and our publisher pinned to draft-14.
3. Both at once on one block: layer l+1 only once each of them has layer l.
4. Both at once on a pass track (DESIGN §9.6) of SLOTS blocks: object l is layer l of every
   block, slot by slot, the same way.

Every test fails (never skips) when a peer is not installed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, NamedTuple

import numpy as np
import pytest

from kvsp_moq.holder.moqt_publisher import BlockPublisher, LiveBlock
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.naming import BlockTrack, pass_track_name
from relay.relay import Relay, RelaySettings

from .conftest import HERE, PEER_PYTHON, PEERS, Process, our_relay, spawn

MOQRS_PYTHON = HERE / ".venv-moqrs" / "bin" / "python"
STEP = 20.0
HTTP_HOLDER = "http://127.0.0.1:8801/"
COMPAT, SCOPE = "ab" * 32, "cd" * 16
#: Layers of the live block, and how many of them exist when a peer subscribes.
LAYERS = 10
BEFORE = 2
#: Octets of each K and each V section (a layer's payload is twice this).
SECTION = 24 << 10
#: How long a peer may take over the whole block before it gives up and reports.
PEER_TIMEOUT = 60.0
#: Blocks of the pass track.
SLOTS = 3


class Track(NamedTuple):
    """A track the peers subscribe to: a block's, or a pass track (not a block's)."""

    namespace: tuple[bytes, ...]
    track_name: bytes


@pytest.fixture(scope="module", autouse=True)
def moqrs_peer() -> None:
    """Fail every test of this module, loudly, when the moq-rs peer is not installed (the
    session fixture of conftest.py does the same for aiomoqt)."""
    hint = "install it with network access: bash interop/install-moqrs.sh"
    if not MOQRS_PYTHON.exists():
        pytest.fail(f"the moq-rs peer is not installed ({MOQRS_PYTHON} is missing); {hint}", pytrace=False)
    check = subprocess.run([str(MOQRS_PYTHON), "-c", "import moq, moq_ffi"], capture_output=True, text=True,
                           timeout=60)
    if check.returncode != 0:
        pytest.fail(f"the moq-rs peer cannot be imported ({check.stderr.strip()[-300:]}); {hint}", pytrace=False)


def layers_of(seed: int) -> list[tuple[bytes, bytes]]:
    """The K and V sections of every layer of the block."""
    rng = np.random.default_rng(seed)
    return [(rng.bytes(SECTION), rng.bytes(SECTION)) for _ in range(LAYERS)]


def digests(layers: list[tuple[bytes, bytes]]) -> list[str]:
    """SHA-256 of each layer object's payload, K||V."""
    return [hashlib.sha256(k + v).hexdigest() for k, v in layers]


@asynccontextmanager
async def live_block(url: str, tag: bytes, draft: int) -> AsyncIterator[tuple[LiveBlock, BlockTrack]]:
    """Our holder's BlockPublisher at the relay `url`, speaking `draft`, producing one block
    (none of its layers added yet) whose namespace the relay has accepted."""
    store = BlockStore(host_bytes=64 << 20)
    publisher = await BlockPublisher(store, url, HTTP_HOLDER, verify=False, rescan_interval=0.1,
                                     settings=QuicSettings(client_drafts=(draft,))).start()
    try:
        bid = BlockId(COMPAT, SCOPE, hashlib.sha256(tag).hexdigest())
        live = publisher.produce(bid, layer_count=LAYERS, token_count=16)
        await publisher.wait_connected(STEP)
        for _ in range(400):
            if publisher.is_announced(COMPAT, SCOPE):
                break
            await asyncio.sleep(0.05)
        assert publisher.is_announced(COMPAT, SCOPE), "the relay never accepted the holder's namespace"
        assert publisher.connection is not None and publisher.connection.draft == draft
        yield live, publisher.track(bid)
        assert publisher.stats.subscribes >= 1
    finally:
        await publisher.aclose()


@dataclass
class Peer:
    """A subscriber peer as a child process, reporting each layer object as it arrives."""

    name: str
    process: Process
    log: Path
    kind: str  # "aiomoqt" or "moq-rs"
    got: list[tuple[int, int, str]] = field(default_factory=list)  # (group, place, sha256)
    summary: dict | None = None
    #: Lines read while waiting for SUBSCRIBED, not looked at yet (objects may come first).
    pending: list[str] = field(default_factory=list)

    def why(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return (f"\n{self.name} reported {[(g, i) for g, i, _ in self.got]}, printed {self.process.lines[-5:]}"
                f"\nthe end of its log ({self.log}):\n{text[-2500:]}")

    async def _line(self, what: str, pending: bool = True) -> str:
        if pending and self.pending:
            return self.pending.pop(0)
        try:
            return await self.process.line(STEP)
        except (AssertionError, asyncio.TimeoutError) as e:
            raise AssertionError(f"{self.name}: no {what} ({type(e).__name__} {e}){self.why()}") from None

    async def subscribed(self) -> None:
        """Until the peer says its SUBSCRIBE was accepted; what it printed before is kept."""
        for _ in range(1000):
            line = await self._line("SUBSCRIBED", pending=False)
            if line == "SUBSCRIBED":
                return
            self.pending.append(line)
        raise AssertionError(f"{self.name} printed too many lines{self.why()}")

    async def next_object(self) -> tuple[int, int, str]:
        """The next object the peer reports: (group, object id or, for moq-rs, which carries
        none, its place in the group, SHA-256 of the payload)."""
        for _ in range(1000):
            line = await self._line("further object")
            if self.kind == "aiomoqt" and line.startswith("OBJECT "):
                _, group, obj, _size, sha = line.split()
                self.got.append((int(group), int(obj), sha))
                return self.got[-1]
            if self.kind == "moq-rs" and line.startswith("{"):
                report = json.loads(line)
                self.got.append((report["group"], report["frame"], report["sha256"]))
                return self.got[-1]
            if line.startswith("SUMMARY "):
                self.summary = json.loads(line[len("SUMMARY "):])
                raise AssertionError(f"{self.name} ended before the block did{self.why()}")
        raise AssertionError(f"{self.name} printed too many lines{self.why()}")

    async def finished(self) -> None:
        """Until the peer says it is done; it must have reported nothing more."""
        if self.kind == "aiomoqt":
            await self.process.wait_for_line("DONE", STEP)
            extra = [line for line in self.process.lines if line.startswith("OBJECT ")][len(self.got):]
        else:
            line = await self.process.wait_for_line("SUMMARY ", PEER_TIMEOUT)
            self.summary = json.loads(line[len("SUMMARY "):])
            extra = [line for line in self.process.lines if line.startswith("{")][len(self.got):]
            assert self.summary["error"] is None, f"{self.name} failed: {self.summary['error']}{self.why()}"
            assert self.summary["complete_groups"] == 1 and self.summary["ended"] in ("groups", "track ended"), \
                f"group 0 never ended whole: {self.summary}{self.why()}"
        assert not extra, f"{self.name} reported more objects than the block has: {extra}{self.why()}"


@asynccontextmanager
async def aiomoqt_subscriber(url: str, track: BlockTrack | Track, draft: int, tmp_path: Path) -> AsyncIterator[Peer]:
    """aiomoqt subscribes from the start of the track (no filter; at draft-14 Absolute Start)."""
    namespace = "/".join(part.decode() for part in track.namespace)
    log = tmp_path / f"aiomoqt-sub-{draft}.log"
    async with spawn(str(PEER_PYTHON), str(PEERS / "aiomoqt_sub.py"), url, namespace, track.track_name.decode(),
                     str(LAYERS), str(tmp_path / f"aiomoqt-{draft}.json"), "--draft", str(draft), "--each",
                     name=f"aiomoqt subscriber (draft {draft})", stderr=log) as process:
        yield Peer(process.name, process, log, "aiomoqt")


@asynccontextmanager
async def moqrs_subscriber(url: str, track: BlockTrack | Track, tmp_path: Path) -> AsyncIterator[Peer]:
    """moq-rs names the track by its path, the namespace's fields joined by "/", and reads
    group 0 until its LAYERS frames have arrived and its stream has ended."""
    path = "/".join(part.decode() for part in track.namespace)
    log = tmp_path / "moqrs-sub.log"
    async with spawn(str(MOQRS_PYTHON), str(PEERS / "moqrs_sub.py"), url, path, track.track_name.decode(),
                     str(LAYERS), "16", "unused", "--groups", "1", "--wait", "request",
                     "--timeout", str(PEER_TIMEOUT), "--log", "debug",
                     name="moq-rs subscriber", stderr=log) as process:
        yield Peer(process.name, process, log, "moq-rs")


async def produce_for(live: LiveBlock, layers: list[tuple[bytes, bytes]], peers: list[Peer]) -> None:
    """Add the layers not added yet, each only once every peer has reported the one before,
    and check that every peer gets each layer in order, byte for byte, while the next one does
    not exist yet."""
    await deliver_in_step(peers, digests(layers), lambda: live.available,
                          lambda index: live.add_layer(*layers[index]))
    await live.finish()


async def deliver_in_step(peers: list[Peer], expected: list[str], available: Callable[[], int],
                          add: Callable[[int], object]) -> None:
    """Layer l+1 is added (`add`) only once every peer has reported layer l, which must be
    the `expected` octets (SHA-256), in order; then every peer must end the group."""
    for index in range(LAYERS):
        for peer in peers:
            group, place, sha = await peer.next_object()
            assert (group, place) == (0, index), f"expected layer {index} of group 0{peer.why()}"
            assert sha == expected[index], f"layer {index} is not byte for byte what was added{peer.why()}"
        # Each peer has layer `index`; past the first BEFORE, the next one is not computed yet.
        assert available() == max(index + 1, BEFORE)
        if index + 1 == available() < LAYERS:
            add(index + 1)
    for peer in peers:
        await peer.finished()
        assert [(g, i, s) for g, i, s in peer.got] == [(0, i, s) for i, s in enumerate(expected)], peer.why()


async def both_peers(relay: Relay, track: BlockTrack | Track, stack: AsyncExitStack, tmp_path: Path) -> list[Peer]:
    """aiomoqt subscribed from the start of the track, then moq-rs once the relay has had the
    first BEFORE layers (it gets those by its joining FETCH, from the relay's cache)."""
    aiomoqt = await stack.enter_async_context(aiomoqt_subscriber(relay.url, track, 18, tmp_path))
    await aiomoqt.subscribed()
    for _ in range(400):  # until the relay has had the first layers (bounded)
        if relay.stats.objects_in >= BEFORE:
            break
        await asyncio.sleep(0.05)
    assert relay.stats.objects_in == BEFORE, relay.snapshot()
    moqrs = await stack.enter_async_context(moqrs_subscriber(relay.url, track, tmp_path))
    await moqrs.subscribed()
    return [aiomoqt, moqrs]


def start(live: LiveBlock, layers: list[tuple[bytes, bytes]]) -> None:
    """The layers computed before anyone subscribes."""
    for k, v in layers[:BEFORE]:
        live.add_layer(k, v)


# --------------------------------------------------------------------------- 1


@pytest.mark.matrix("our holder (live block) -> aiomoqt subscriber (sub draft)", "our relay")
@pytest.mark.parametrize("draft", ["18", "20", "22", "14"])
async def test_live_block_reaches_aiomoqt_layer_by_layer(tmp_path, draft):
    layers = layers_of(1)
    async with our_relay(tmp_path) as url, live_block(url, b"live aiomoqt " + draft.encode(), 18) as (live, track):
        start(live, layers)
        async with aiomoqt_subscriber(url, track, int(draft), tmp_path) as peer:
            await peer.subscribed()
            await produce_for(live, layers, [peer])


# --------------------------------------------------------------------------- 2


@pytest.mark.matrix("our holder (live block) -> moq-rs subscriber", "our relay")
@pytest.mark.parametrize("draft", ["18", "14"], ids=["relay-picks-18", "relay-pinned-14"])
async def test_live_block_reaches_moqrs_layer_by_layer(tmp_path, draft):
    layers = layers_of(2)
    async with our_relay(tmp_path, None if draft == "18" else draft) as url, \
            live_block(url, b"live moq-rs " + draft.encode(), int(draft)) as (live, track):
        start(live, layers)
        async with moqrs_subscriber(url, track, tmp_path) as peer:
            await peer.subscribed()
            await produce_for(live, layers, [peer])


# --------------------------------------------------------------------------- 3


@pytest.mark.matrix("our holder (live block) -> aiomoqt and moq-rs subscribers at once", "our relay")
async def test_live_block_reaches_aiomoqt_and_moqrs_together(tmp_path):
    """The relay (in this process, for its counters) holds one upstream subscription to the
    block and fans it out to both peers. aiomoqt subscribes first, from the start of the
    track; moq-rs joins once the relay has forwarded the first BEFORE layers, so it gets those
    by its joining FETCH (from the relay's cache) and the rest live."""
    layers = layers_of(3)
    relay = await Relay(RelaySettings(certificate=generate_self_signed())).start()
    try:
        async with live_block(relay.url, b"live both", 18) as (live, track), AsyncExitStack() as stack:
            start(live, layers)
            peers = await both_peers(relay, track, stack, tmp_path)
            await produce_for(live, layers, peers)
        counters = relay.snapshot()
    finally:
        await relay.aclose()
    # One subscription to the holder, its LAYERS objects taken once, the first BEFORE
    # served again from the cache for moq-rs's joining FETCH.
    assert counters["upstream_subscribes"] == 1 and counters["objects_in"] == LAYERS, counters
    assert counters["subscribes"] == 2 and counters["upstream_fetches"] == 0, counters
    assert counters["cache_objects_served"] >= BEFORE, counters


# --------------------------------------------------------------------------- 4


@pytest.mark.matrix("our holder (live pass track) -> aiomoqt and moq-rs subscribers at once", "our relay")
async def test_a_pass_track_reaches_aiomoqt_and_moqrs_together(tmp_path):
    """A forward pass of SLOTS blocks publishes, beside each block's track, its pass track in
    the namespace of its first block: object l is layer l of every block, K||V slot after slot
    (the slots' digests and Block Keys ride properties the peers need not know). Both peers subscribe once
    the first BEFORE layers exist and get every later one as it is computed, byte for byte."""
    wholes = [layers_of(10 + j) for j in range(SLOTS)]
    relay = await Relay(RelaySettings(certificate=generate_self_signed())).start()
    try:
        async with live_block(relay.url, b"pass first", 18) as (first, first_track), AsyncExitStack() as stack:
            publisher = first.publisher
            # A pass whose blocks are the next ones (live_block's own block stays unused).
            ids = [BlockId(COMPAT, SCOPE, hashlib.sha256(b"pass slot %d" % j).hexdigest()) for j in range(SLOTS)]
            track = publisher.open_pass(ids[0], layer_count=LAYERS, token_count=16)
            blocks = [track.produce(bid) for bid in ids]
            assert publisher.live_record(blocks[2]).live_pass == (track.moqt_namespace, 2)

            def add(index: int) -> None:
                for block, layers in zip(blocks, wholes):
                    block.add_layer(*layers[index])
                track.add_layer(b"".join(k + v for k, v in (layers[index] for layers in wholes)),
                                b"".join(bytes.fromhex(digests([layers[index]])[0]) for layers in wholes),
                                SECTION)

            for index in range(BEFORE):
                add(index)
            pass_track = Track(publisher.track(ids[0]).namespace, pass_track_name())
            peers = await both_peers(relay, pass_track, stack, tmp_path)
            expected = [hashlib.sha256(b"".join(k + v for k, v in (layers[i] for layers in wholes))).hexdigest()
                        for i in range(LAYERS)]
            await deliver_in_step(peers, expected, lambda: track.available, add)
            for block in blocks:
                assert await block.finish() is not None
            first.abort("unused")
        counters = relay.snapshot()
    finally:
        await relay.aclose()
    assert counters["upstream_subscribes"] == 1 and counters["objects_in"] == LAYERS, counters
