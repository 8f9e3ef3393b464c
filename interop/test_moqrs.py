"""Interop with moq-rs 0.5.1 (the Python package of the Rust moq-dev stack, moq-ffi 0.4.18), a
second independent MOQT implementation, through our relay over raw QUIC (moqt://, draft-18).

The moq-rs side runs as child processes in its own virtual environment (interop/.venv-moqrs,
made by interop/install-moqrs.sh): interop/peers/moqrs_pub.py writes groups of frames whose
sizes cycle through 16 B, 1 KiB, 64 KiB and 256 KiB, interop/peers/moqrs_sub.py reads them and
checks every byte (payloads: interop/peers/moqrs_common.py).

1. moq-rs publisher -> our relay -> moq-rs subscriber, with the track finished after the last
   group, and with the track left open: then every group must end by itself (its subgroup
   stream ends with FIN, or its header says END_OF_GROUP), not at PUBLISH_DONE.
2. moq-rs publisher -> our relay -> our subscriber.
3. our publisher -> our relay -> moq-rs subscriber, the track finished or left open.
4. 20 groups, a subscriber from the start and one joining late.
5. moq-rs publisher -> our relay -> aiomoqt subscriber (interop/peers/aiomoqt_sub.py).
6. aiomoqt publisher (interop/peers/aiomoqt_pub.py) -> our relay -> moq-rs subscriber, the
   track left live: each group must end by its own stream's end.
7. moq-rs publisher -> aiomoqt's relay -> moq-rs subscriber: the two peers agree without us.
8. Our client straight against a moq-rs server (moq.Server, draft-18 over raw QUIC, ALPN
   moqt-18): our subscriber reads a broadcast the server publishes, and the server reads one
   our publisher announces to it.
9. A KV block track (2 MiB, 32 layers) from our holder, read by a moq-rs subscriber through
   our relay byte for byte; and moq-rs sessions on a relay where a KV holder announces.

Cases 5 and 6 also run with 1 MiB objects, and with aiomoqt on drafts 20 and 22 (moq-rs on
18: the relay carries the objects across). Cases 1-3 run on the draft our relay picks from
moq-rs's offer (18), and with the relay pinned to draft-14 (moq-00), the other draft both speak.
Every test fails (never skips) when moq-rs or aiomoqt is not installed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest

from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.moqt.errors import RequestError
from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.moqt.quic import IncomingSubscribe, connect
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol.container import Container

from .conftest import HERE, PEER_PYTHON, PEERS, aiomoqt_relay, our_relay, spawn
from .test_drafts import kv_block

sys.path.insert(0, str(PEERS))
from moqrs_common import DEFAULT_SIZES, object_size, payload

MOQRS_VENV = HERE / ".venv-moqrs"
MOQRS_PYTHON = MOQRS_VENV / "bin" / "python"
SIZES = ",".join(str(s) for s in DEFAULT_SIZES)
#: Frame sizes of the 1 MiB cases: two 1 MiB objects in every group of three.
MIB_SIZES = (1 << 20, 16, 1 << 20, 64 << 10)
STEP = 20.0
#: How long a moq-rs subscriber waits for its groups before it reports what it has.
SUB_TIMEOUT = 15.0


@pytest.fixture(scope="module", autouse=True)
def moqrs_peer() -> None:
    """Fail every test of this module, loudly, when the moq-rs peer is not installed."""
    hint = "install it with network access: bash interop/install-moqrs.sh"
    if not MOQRS_PYTHON.exists():
        pytest.fail(f"the moq-rs peer is not installed ({MOQRS_PYTHON} is missing); {hint}", pytrace=False)
    check = subprocess.run([str(MOQRS_PYTHON), "-c", "import moq, moq_ffi"], capture_output=True, text=True,
                           timeout=60)
    if check.returncode != 0:
        pytest.fail(f"the moq-rs peer in {MOQRS_VENV} cannot be imported ({check.stderr.strip()[-300:]}); {hint}",
                    pytrace=False)


def broadcast_path() -> str:
    return f"kvsp/{secrets.token_hex(6)}/layers"


def publisher_argv(url: str, path: str, groups: int, objects: int, seed: str, *extra: str,
                   sizes: str = SIZES) -> list[str]:
    return [str(MOQRS_PYTHON), str(PEERS / "moqrs_pub.py"), url, path, "t", str(groups), str(objects), sizes,
            seed, "--log", "debug", *extra]


def subscriber_argv(url: str, path: str, objects: int, seed: str, *extra: str, sizes: str = SIZES,
                    track: str = "t") -> list[str]:
    return [str(MOQRS_PYTHON), str(PEERS / "moqrs_sub.py"), url, path, track, str(objects), sizes, seed,
            "--timeout", str(SUB_TIMEOUT), "--log", "debug", *extra]


class Received:
    """What a moq-rs subscriber reported: one dict per object and its summary."""

    def __init__(self, objects: list[dict], summary: dict, log: Path) -> None:
        self.objects = objects
        self.summary = summary
        self.log = log

    def explain(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()
        notable = [line for line in lines
                   if (" WARN" in line or " ERROR" in line or "publish done" in line or "subscribe ok" in line
                       or "error" in line.lower())
                   and "moq_sock::bind" not in line and "verification is disabled" not in line]
        return (f"\nmoq-rs subscriber summary: {json.dumps(self.summary)}\nits log ({self.log}), notable lines:\n  "
                + "\n  ".join(notable[-15:]))


async def read_subscriber(sub, timeout: float = SUB_TIMEOUT + 20) -> tuple[list[dict], dict]:
    objects: list[dict] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for _ in range(100_000):
        line = await sub.line(max(0.1, deadline - loop.time()))
        if line.startswith("SUMMARY "):
            return objects, json.loads(line[len("SUMMARY "):])
        if line.startswith("{"):
            objects.append(json.loads(line))
    raise AssertionError("the moq-rs subscriber printed too many lines")


def assert_all_groups(received: Received, groups: range, objects: int, end_marker: bool = False) -> None:
    """Every object of `groups`, byte for byte, each group ended by itself. No group may arrive
    empty, except (with `end_marker`) the one after the last, where moq-rs's publisher puts its
    END_OF_TRACK status object."""
    s = received.summary
    why = received.explain()
    assert s["error"] is None, f"the moq-rs subscriber failed: {s['error']}{why}"
    assert s["empty_groups"] in ([], [groups.stop] if end_marker else []), \
        f"groups that arrived with no object: {s['empty_groups']}{why}"
    assert s["mismatches"] == 0, f"{s['mismatches']} objects were not byte for byte what was sent{why}"
    got = sorted((o["group"], o["object"]) for o in received.objects)
    assert got == [(g, o) for g in groups for o in range(objects)], f"objects received: {got}{why}"
    assert s["complete_groups"] == len(groups), (
        f"{s['complete_groups']} of {len(groups)} groups ended (all their objects arrived: "
        f"{s['objects']} of {len(groups) * objects}); the subscriber stopped on: {s['ended']}{why}")


# --------------------------------------------------------------------------- 1


@pytest.mark.matrix("moq-rs publisher -> moq-rs subscriber", "our relay")
@pytest.mark.parametrize("draft", ["18", "14"], ids=["relay-picks-18", "relay-pinned-14"])
@pytest.mark.parametrize("live", [False, True], ids=["track-finished", "track-live"])
async def test_moqrs_publisher_through_our_relay_to_moqrs_subscriber(tmp_path, live, draft):
    """4 groups x 3 objects (16 B, 1 KiB, 64 KiB, 256 KiB cycled), byte for byte. With the
    track left live, the subscriber sees a group end only when its subgroup stream ends (FIN or
    END_OF_GROUP): a relay that keeps downstream streams open leaves every group unfinished."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    # moq-rs offers moqt-19 down to moq-00: our relay's own list picks 18; pinned to 14 it
    # answers moq-00 (draft-14), the other draft both speak.
    async with our_relay(tmp_path, None if draft == "18" else draft) as url, spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber", *(["--live"] if live else [])),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups)),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
    assert_all_groups(received, range(groups), objects)
    if not live:
        assert received.summary["ended"] in ("groups", "track ended"), received.explain()


@pytest.mark.matrix("moq-rs publisher -> moq-rs subscriber (1 MiB objects)", "our relay")
async def test_moqrs_one_mib_objects_back_to_back_through_our_relay(tmp_path):
    """1 MiB objects with no pause between groups, the track left live: a newer group's
    stream must not overtake the end of an older one (moq-rs drops an unfinished group when
    a newer one begins), so every group arrives whole and ends by itself."""
    seed, groups, objects, path = secrets.token_hex(8), 6, 3, broadcast_path()
    sizes = f"{1 << 20},16,{1 << 20},{64 << 10}"
    async with our_relay(tmp_path) as url, spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber", "--live",
                            "--pause-ms", "0", sizes=sizes),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups), sizes=sizes),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
    assert_all_groups(received, range(groups), objects)


# --------------------------------------------------------------------------- 2


async def our_subscriber_reads(url: str, path: str, count: int, timeout: float = STEP, draft: int = 18,
                               log: Path | None = None) -> list:
    """Our client subscribes to track t of the namespace `path` names (its "/"-separated fields)
    at `url` and collects objects until it has `count` of them, or `timeout` has passed. Objects
    the relay had before the SUBSCRIBE (a publisher that did not wait for this subscriber, or a
    draft-14 PUBLISH the relay accepted first) come by a joining FETCH from group 0, as any late
    subscriber gets them; the subscription's copies of fetched objects are left out (and any
    other object it repeats is kept, for the caller to see). Fewer than `count` objects fail
    the test with how the subscription went (and the publisher's `log`)."""
    client = await connect(url, verify=False, timeout=STEP, drafts=(draft,))
    got: list = []
    fetched: set[tuple[int, int]] = set()
    story: list[str] = []

    try:
        subscription = await client.subscribe(path.split("/"), "t", timeout=STEP)
        story.append(f"SUBSCRIBE_OK with largest {subscription.largest}")

        async def read() -> None:
            if subscription.largest is not None:
                try:
                    fetch = await client.joining_fetch(subscription, 0, absolute=True, timeout=STEP)
                except RequestError as e:
                    story.append(f"joining FETCH refused: {e}")
                else:
                    async for obj in fetch:
                        fetched.add((obj.group_id, obj.object_id))
                        got.append(obj)
                    story.append(f"joining FETCH brought {sorted(fetched)}")
                if len(got) >= count:
                    return
            async for obj in subscription:
                if (obj.group_id, obj.object_id) not in fetched:
                    got.append(obj)
                if len(got) >= count:
                    return
            story.append(f"the subscription ended: {subscription.done}, "
                         f"{subscription.streams_timed_out} streams timed out")

        try:
            await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            story.append(f"nothing more within {timeout} s")
    finally:
        await client.aclose()
    if len(got) < count:
        seen = [(o.group_id, o.object_id, o.status.name) for o in got]
        tail = ""
        if log is not None and log.exists():
            tail = "\npublisher log (tail):\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"{len(got)} of {count} objects: {seen}; " + "; ".join(story) + tail)
    return got


def assert_our_objects(got: list, seed: str, groups: int, objects: int,
                       sizes: tuple[int, ...] = DEFAULT_SIZES) -> None:
    normal = [o for o in got if o.status == ObjectStatus.NORMAL]
    summary = sorted((o.group_id, o.object_id, len(o.payload)) for o in normal)
    expected = [(g, o, object_size(g, o, objects, sizes)) for g in range(groups) for o in range(objects)]
    assert summary == expected, f"received {summary}"
    for obj in normal:
        assert obj.payload == payload(seed, obj.group_id, obj.object_id, objects, sizes), \
            (obj.group_id, obj.object_id)


@pytest.mark.matrix("moq-rs publisher -> our subscriber", "our relay")
@pytest.mark.parametrize("draft", ["18", "14"], ids=["relay-picks-18", "relay-pinned-14"])
async def test_moqrs_publisher_through_our_relay_to_our_subscriber(tmp_path, draft):
    """moq-rs's broadcast path kvsp/<n>/layers is the namespace (kvsp, <n>, layers); our client
    subscribes to its track t and receives every object byte for byte, in groups 0-3."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    async with our_relay(tmp_path, None if draft == "18" else draft) as url, spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber"),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        got = await our_subscriber_reads(url, path, groups * objects, draft=int(draft),
                                         log=tmp_path / "moqrs-pub.log")
    assert_our_objects(got, seed, groups, objects)


# --------------------------------------------------------------------------- 3


@asynccontextmanager
async def our_publisher(url: str, path: str, seed: str, groups: int, objects: int, live: bool,
                        sizes: tuple[int, ...] = DEFAULT_SIZES, draft: int = 18) -> AsyncIterator[asyncio.Event]:
    """Our client at `url` announces the namespace `path` names and answers a SUBSCRIBE with
    `groups` subgroup streams of `objects` objects, each stream ended with FIN. Track finished:
    PUBLISH_DONE right after; live: only when the block is left. Yields an event set once the
    last group is sent."""
    release = asyncio.Event()
    sent = asyncio.Event()
    handlers: list[asyncio.Task] = []
    publisher = await connect(url, verify=False, timeout=STEP, drafts=(draft,))

    async def serve(req: IncomingSubscribe) -> None:
        handlers.append(asyncio.current_task())
        subscription = req.accept()
        for g in range(groups):
            sender = subscription.open_subgroup(g)
            for o in range(objects):
                await sender.send(o, payload(seed, g, o, objects, sizes))
            sender.close()
            await asyncio.sleep(0.02)
        sent.set()
        if live:
            await release.wait()
        await subscription.finish()

    publisher.on_subscribe(serve)
    try:
        await publisher.publish_namespace(path.split("/"), timeout=STEP)
        yield sent
    finally:
        release.set()
        if handlers:
            await asyncio.wait(handlers, timeout=5)
        await publisher.aclose()


async def wait_sent(sent: asyncio.Event, received: Received) -> None:
    try:  # (the subscriber may be done before the publisher's last pause is over)
        await asyncio.wait_for(sent.wait(), STEP)
    except asyncio.TimeoutError:
        raise AssertionError(f"our publisher was never asked for the track{received.explain()}") from None


@pytest.mark.matrix("our publisher -> moq-rs subscriber", "our relay")
@pytest.mark.parametrize("draft", ["18", "14"], ids=["relay-picks-18", "relay-pinned-14"])
@pytest.mark.parametrize("live", [False, True], ids=["track-finished", "track-live"])
async def test_our_publisher_through_our_relay_to_moqrs_subscriber(tmp_path, live, draft):
    """Our publisher announces (kvsp, <n>, layers) and answers the relay's SUBSCRIBE with 4
    subgroup streams of 3 objects, each ended with FIN. Track finished: PUBLISH_DONE right after;
    live: only after the moq-rs subscriber has reported, so each group must end by itself."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    async with our_relay(tmp_path, None if draft == "18" else draft) as url, our_publisher(
            url, path, seed, groups, objects, live, draft=int(draft)) as sent:
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups)),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
        await wait_sent(sent, received)
    assert_all_groups(received, range(groups), objects)


# --------------------------------------------------------------------------- 4


@pytest.mark.matrix("moq-rs publisher -> moq-rs subscribers, one late", "our relay")
async def test_many_groups_and_a_late_subscriber(tmp_path):
    """20 groups of 3 objects, 100 ms apart. A moq-rs subscriber from the start gets all 20,
    byte for byte; one that joins after group 8 gets every later group whole (the group in
    progress when it joined may start mid-group, but what it holds must be right) up to 19."""
    seed, groups, objects, path = secrets.token_hex(8), 20, 3, broadcast_path()
    async with our_relay(tmp_path) as url, spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber", "--pause-ms", "100"),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups)),
                         name="moq-rs subscriber (first)", stderr=tmp_path / "moqrs-sub-first.log") as first:
            await pub.wait_for_line("GROUP 8", STEP)
            async with spawn(*subscriber_argv(url, path, objects, seed), name="moq-rs subscriber (late)",
                             stderr=tmp_path / "moqrs-sub-late.log") as late:
                early = Received(*await read_subscriber(first), tmp_path / "moqrs-sub-first.log")
                joined = Received(*await read_subscriber(late), tmp_path / "moqrs-sub-late.log")
    assert_all_groups(early, range(groups), objects)

    s = joined.summary
    why = joined.explain()
    assert s["error"] is None, f"the late subscriber failed: {s['error']}{why}"
    assert s["mismatches"] == 0, why
    assert s["ended"] == "track ended", why
    seqs = sorted({o["group"] for o in joined.objects})
    assert seqs and 8 <= seqs[0] <= 12 and seqs[-1] == groups - 1, f"late subscriber's groups: {seqs}{why}"
    assert seqs == list(range(seqs[0], groups)), f"late subscriber's groups: {seqs}{why}"
    for g in seqs[1:]:
        got = [o["object"] for o in joined.objects if o["group"] == g]
        assert got == list(range(objects)), f"group {g}: objects {got}{why}"
    first_group = [o["object"] for o in joined.objects if o["group"] == seqs[0]]
    assert first_group == list(range(objects - len(first_group), objects)), f"group {seqs[0]}: {first_group}{why}"


# --------------------------------------------------------------------------- 5


def sizes_text(sizes: tuple[int, ...]) -> str:
    return ",".join(str(s) for s in sizes)


def assert_aiomoqt_received(out: Path, seed: str, groups: int, objects: int, sizes: tuple[int, ...],
                            log: Path) -> None:
    """What interop/peers/aiomoqt_sub.py wrote: every object once, byte for byte."""
    why = f"\naiomoqt subscriber log ({log}):\n" + (log.read_text(errors="replace")[-2000:] if log.exists() else "")
    assert out.exists(), f"the aiomoqt subscriber wrote nothing{why}"
    got = [(g, o, bytes.fromhex(p)) for g, o, p in json.loads(out.read_text())]
    keys = sorted((g, o) for g, o, _ in got)
    assert keys == [(g, o) for g in range(groups) for o in range(objects)], f"objects received: {keys}{why}"
    for g, o, data in got:
        assert data == payload(seed, g, o, objects, sizes), \
            f"object {g}/{o}: {len(data)} octets, not the {object_size(g, o, objects, sizes)} sent{why}"


#: (object sizes, pub->sub drafts): moq-rs speaks 18 to our relay; aiomoqt, on 18, 20 or 22,
#: has its objects carried across drafts by the relay. 14->14: the relay pinned to draft-14.
CROSS_DRAFT = [(DEFAULT_SIZES, "18->18"), (MIB_SIZES, "18->18"), (DEFAULT_SIZES, "18->20"), (DEFAULT_SIZES, "18->22"),
               (DEFAULT_SIZES, "14->14")]
CROSS_IDS = [f"{'1MiB' if sizes is MIB_SIZES else '16B-256KiB'}-{d}" for sizes, d in CROSS_DRAFT]


@pytest.mark.matrix("moq-rs publisher -> aiomoqt subscriber (pub->sub draft)", "our relay")
@pytest.mark.parametrize(("sizes", "draft"), CROSS_DRAFT, ids=CROSS_IDS)
async def test_moqrs_publisher_through_our_relay_to_aiomoqt_subscriber(tmp_path, sizes, draft):
    """moq-rs publishes kvsp/<n>/layers; aiomoqt subscribes to (kvsp, <n>, layers)/t through our
    relay and gets 4 groups x 3 objects byte for byte, the track finished after the last."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    out = tmp_path / "aiomoqt-received.json"
    async with our_relay(tmp_path, "14" if draft == "14->14" else None) as url, spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber", sizes=sizes_text(sizes)),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(str(PEER_PYTHON), str(PEERS / "aiomoqt_sub.py"), url, path, "t", str(groups * objects),
                         str(out), "--draft", draft.split("->")[1], name="aiomoqt subscriber",
                         stderr=tmp_path / "aiomoqt-sub.log") as sub:
            await sub.wait_for_line("SUBSCRIBED", STEP)
            await sub.wait_for_line("DONE", 40)
    assert_aiomoqt_received(out, seed, groups, objects, sizes, tmp_path / "aiomoqt-sub.log")


# --------------------------------------------------------------------------- 6


@pytest.mark.matrix("aiomoqt publisher -> moq-rs subscriber (pub->sub draft)", "our relay")
@pytest.mark.parametrize(("sizes", "draft"), [(sizes, "->".join(reversed(d.split("->")))) for sizes, d in CROSS_DRAFT],
                         ids=[f"{'1MiB' if sizes is MIB_SIZES else '16B-256KiB'}-{'->'.join(reversed(d.split('->')))}"
                              for sizes, d in CROSS_DRAFT])
async def test_aiomoqt_publisher_through_our_relay_to_moqrs_subscriber(tmp_path, sizes, draft):
    """aiomoqt announces (kvsp, <n>, layers) and sends 4 subgroup streams of 3 objects, each
    ended by FIN, and no PUBLISH_DONE until the moq-rs subscriber has reported: every group
    must reach moq-rs whole and end by its own stream's end."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    async with our_relay(tmp_path, "14" if draft == "14->14" else None) as url, spawn(
            str(PEER_PYTHON), str(PEERS / "aiomoqt_pub.py"), url, path, "t", str(groups), str(objects),
            sizes_text(sizes), seed, "--live", "--pause-ms", "20", "--timeout", "60", "--draft", draft.split("->")[0],
            name="aiomoqt publisher", stderr=tmp_path / "aiomoqt-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups),
                                          sizes=sizes_text(sizes)),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
    assert_all_groups(received, range(groups), objects)


# --------------------------------------------------------------------------- 7


@pytest.mark.matrix("moq-rs publisher -> moq-rs subscriber", "aiomoqt relay")
@pytest.mark.parametrize("live", [False, True], ids=["track-finished", "track-live"])
async def test_moqrs_publisher_through_aiomoqt_relay_to_moqrs_subscriber(tmp_path, live):
    """The reference pairing without us: moq-rs to moq-rs through aiomoqt's relay
    (moq-interop-relay --quic --draft 18), the same 4 groups x 3 objects byte for byte. Track
    finished, moq-rs's subscriber may also see an empty group 4, its END_OF_TRACK."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    async with aiomoqt_relay(tmp_path) as url, spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber", *(["--live"] if live else [])),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups)),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
    # aiomoqt's relay forwards the stream of moq-rs's END_OF_TRACK (group 4, a status object
    # alone) under its own subgroup header; moq-rs then no longer takes it for the end of the
    # track and hands its subscriber an empty group 4 (through our relay it does not).
    assert_all_groups(received, range(groups), objects, end_marker=not live)


# --------------------------------------------------------------------------- 8


@pytest.mark.matrix("our subscriber -> moq-rs server", "direct")
async def test_our_subscriber_against_a_moqrs_server(tmp_path):
    """moq-rs as a server (moq.Server, ALPN moqt-18): it publishes kvsp/<n>/layers itself and
    our client, connected straight to it, subscribes and reads every object byte for byte."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    async with spawn(*publisher_argv("127.0.0.1:0", path, groups, objects, seed, "--wait-subscriber", "--serve"),
                     name="moq-rs server (publisher)", stderr=tmp_path / "moqrs-server.log") as server:
        url = (await server.wait_for_line("LISTEN ", STEP)).split()[-1]
        await server.wait_for_line("READY", STEP)
        got = await our_subscriber_reads(url, path, groups * objects, log=tmp_path / "moqrs-server.log")
    assert_our_objects(got, seed, groups, objects)


@pytest.mark.matrix("our publisher -> moq-rs server", "direct")
@pytest.mark.parametrize("live", [False, True], ids=["track-finished", "track-live"])
async def test_our_publisher_against_a_moqrs_server(tmp_path, live):
    """moq-rs as a server (moq.Server): our client connects, announces (kvsp, <n>, layers) and
    answers the server's SUBSCRIBE; the server side reads every group whole, byte for byte."""
    seed, groups, objects, path = secrets.token_hex(8), 4, 3, broadcast_path()
    async with spawn(*subscriber_argv("127.0.0.1:0", path, objects, seed, "--groups", str(groups), "--serve"),
                     name="moq-rs server (subscriber)", stderr=tmp_path / "moqrs-server.log") as server:
        url = (await server.wait_for_line("LISTEN ", STEP)).split()[-1]
        async with our_publisher(url, path, seed, groups, objects, live) as sent:
            received = Received(*await read_subscriber(server), tmp_path / "moqrs-server.log")
            await wait_sent(sent, received)
    assert_all_groups(received, range(groups), objects)


# --------------------------------------------------------------------------- 9


@asynccontextmanager
async def kv_holder(url: str, data: bytes, tag: bytes) -> AsyncIterator[BlockTrack]:
    """Our holder's BlockPublisher at the relay `url`, holding one block (`data`) and announcing
    its ("kvsp", compat, scope, publisher) prefix; yields the block's track."""
    http = "http://127.0.0.1:8801/"
    store = BlockStore(host_bytes=64 << 20)
    publisher = await BlockPublisher(store, url, http, verify=False, rescan_interval=0.1).start()
    try:
        bid = BlockId("ab" * 32, "cd" * 16, hashlib.sha256(tag).hexdigest())
        await store.put(bid, data)
        await publisher.wait_connected(STEP)
        for _ in range(200):
            if (bid.compat_id, bid.scope_id) in publisher.announced:
                break
            await asyncio.sleep(0.05)
        assert (bid.compat_id, bid.scope_id) in publisher.announced
        yield BlockTrack.for_holder(bid.compat_id, bid.scope_id, bid.block_key, http)
    finally:
        await publisher.aclose()


@pytest.mark.matrix("our holder -> moq-rs subscriber (KV block, 2 MiB, 32 layers)", "our relay")
async def test_kv_block_track_reaches_moqrs_byte_exact(tmp_path):
    """moq-rs names the block's track by its path, the namespace's fields joined by "/" (each
    ID is hex text), subscribes (newest first, then its joining FETCH) and reads group 0: the
    32 layers, each byte for byte (its SHA-256 is the layer digest of the record)."""
    data = kv_block()
    async with our_relay(tmp_path) as url, kv_holder(url, data, b"moq-rs") as track:
        path = "/".join(field.decode() for field in track.namespace)
        async with spawn(*subscriber_argv(url, path, 32, "unused", "--groups", "1", "--wait", "request",
                                          track=track.track_name.decode()),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
    why = received.explain()
    assert received.summary["error"] is None, why
    assert [(o["group"], o["frame"]) for o in received.objects] == [(0, i) for i in range(32)], why
    assert [o["sha256"] for o in received.objects] == [d.hex() for d in Container(data).layer_digests()], why


@pytest.mark.matrix("moq-rs publisher -> moq-rs subscriber, beside a KV holder", "our relay")
async def test_moqrs_sessions_survive_kv_namespaces_on_our_relay(tmp_path):
    """moq-rs discovers every namespace (SUBSCRIBE_NAMESPACE with no prefix) and closes its
    session on a field that is not UTF-8: with a KV holder announcing on the same relay, a
    moq-rs publisher and subscriber still exchange every object."""
    seed, groups, objects, path = secrets.token_hex(8), 3, 3, broadcast_path()
    async with our_relay(tmp_path) as url, kv_holder(url, kv_block(4, 1 << 16), b"beside"), spawn(
            *publisher_argv(url, path, groups, objects, seed, "--wait-subscriber"),
            name="moq-rs publisher", stderr=tmp_path / "moqrs-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(*subscriber_argv(url, path, objects, seed, "--groups", str(groups)),
                         name="moq-rs subscriber", stderr=tmp_path / "moqrs-sub.log") as sub:
            received = Received(*await read_subscriber(sub), tmp_path / "moqrs-sub.log")
    assert_all_groups(received, range(groups), objects)
