"""Random well-formed requests against a relay with a live publisher behind it: every one is
answered (objects, or a REQUEST_ERROR naming what is wrong), never with INTERNAL_ERROR, never a
handler failure in the relay's log, and the session stays open. Seeded, so a failure names the
seed and step that reproduce it; bounded in requests and in time.

The publisher does what moq-rs does: a timestamp property on every object, and an object of
1 MiB; among the requests is moq-rs's join (SUBSCRIBE in descending order from the Largest
Object, then at once a joining FETCH of offset 0). Clients speak drafts 18, 14, 20 and 22 (the
last two join with FILL_PARAMETERS, as they have no joining FETCH)."""

from __future__ import annotations

import asyncio
import random

from kvsp_moq.moqt.d18.messages import Fill, Parameters
from kvsp_moq.moqt.wire import GroupOrder, Location, SubscriptionFilter
from tests.random_requests import outcome, random_filter, read_some, watching_logs

from .conftest import TrackPublisher, dial, make_objects, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK = b"t"
U62 = (1 << 62) - 1
REQUESTS = 120
READ = 0.15  # seconds a step reads objects before it moves on


def _namespace(rnd: random.Random) -> tuple[bytes, ...]:
    return rnd.choice([
        NS, NS[:3], NS[:1], NS + (b"extra",), (b"kvsp", b"other"), (b"x",),
        tuple(bytes([i]) for i in range(rnd.randint(2, 32))), (b"k" * rnd.randint(1, 1024),),
    ])


def _number(rnd: random.Random) -> int:
    return rnd.choice([0, 1, 2, 3, 5, rnd.randint(0, 1000), U62])


def _location(rnd: random.Random) -> Location:
    return Location(_number(rnd), _number(rnd))


async def _step(rnd: random.Random, client, subscriptions: list) -> str:
    kind = rnd.choice(["subscribe", "fetch", "joining_fetch", "track_status", "subscribe_namespace",
                       "subscribe_tracks", "publish_namespace", "cancel", "join"])
    if client.draft >= 20 and kind == "joining_fetch":
        kind = "join"
    if rnd.random() < 0.5:  # the published track, so that requests get past routing
        ns, track = NS, TRACK
    else:
        ns, track = _namespace(rnd), rnd.choice([TRACK, b"", b"missing", b"n" * 200])
    if kind == "subscribe":
        sub = await client.subscribe(ns, track, subscription_filter=random_filter(rnd, _number),
                                     forward=rnd.choice([None, True, False]),
                                     subscriber_priority=rnd.choice([None, 0, 255]),
                                     group_order=rnd.choice([None, *GroupOrder]), timeout=5)
        subscriptions.append(sub)
        await read_some(sub, READ, limit=20)
    elif kind == "fetch":
        result = await client.fetch(ns, track, _location(rnd), _location(rnd),
                                    whole_end_group=rnd.random() < 0.3,
                                    group_order=rnd.choice([None, *GroupOrder]), timeout=5)
        await read_some(result, READ, limit=20)
    elif kind == "join":
        # moq-rs: the newest objects first, and what came before them at once (draft-20+:
        # FILL_PARAMETERS in the SUBSCRIBE instead of a joining FETCH).
        fill = Parameters(fill=Fill()) if client.draft >= 20 else None
        sub = await client.subscribe(ns, track, subscription_filter=SubscriptionFilter.largest_object(),
                                     group_order=GroupOrder.DESCENDING, timeout=5,
                                     **({"parameters": fill} if fill is not None else {}))
        subscriptions.append(sub)
        if fill is None:
            result = await client.joining_fetch(sub, 0, absolute=False, timeout=5)
            await read_some(result, READ, limit=20)
        await read_some(sub, READ, limit=20)
    elif kind == "joining_fetch":
        if not subscriptions:
            return "skipped"
        result = await client.joining_fetch(rnd.choice(subscriptions), _number(rnd),
                                            absolute=rnd.random() < 0.5, timeout=5)
        await read_some(result, READ, limit=20)
    elif kind == "track_status":
        await client.track_status(ns, track, timeout=5)
    elif kind in ("subscribe_namespace", "subscribe_tracks"):
        prefix = ns[:rnd.randint(0, len(ns))]
        request = getattr(client, kind)
        sub = await request(prefix, timeout=5)
        await read_some(sub, READ, limit=5)
        await sub.cancel()
    elif kind == "publish_namespace":
        # Only namespaces beside the publisher's: one equal to or under a prefix of it would
        # take its requests (the longest prefix wins), and this client serves nothing.
        ns = rnd.choice([(b"kvsp", b"other"), (b"x",), NS[:3] + (b"q",), (b"k" * rnd.randint(1, 64),)])
        announced = await client.publish_namespace(ns, timeout=5)
        if rnd.random() < 0.5:
            await announced.withdraw()
    elif kind == "cancel":
        if not subscriptions:
            return "skipped"
        await subscriptions.pop(rnd.randrange(len(subscriptions))).aclose()
    return kind


async def _run(seed: int, drafts: tuple[int, ...] = (18,)) -> dict[str, int]:
    rnd = random.Random(seed)
    outcomes: dict[str, int] = {}
    objects = make_objects(3, 4, size=200, seed=1) + [(3, 0, bytes([3]) * (1 << 20)), (3, 1, b"after 1 MiB")]
    publisher = TrackPublisher(objects, end=False, timestamps=True)
    async with running_relay() as relay:
        async with publishing(relay.url, NS, publisher):
            client = await dial(relay.url, drafts=drafts)
            subscriptions: list = []
            try:
                for step in range(REQUESTS):
                    kind = await outcome(_step(rnd, client, subscriptions), seed, step)
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                assert not client.is_closed, f"seed {seed}: the session to the relay ended"
            finally:
                for sub in subscriptions:
                    await sub.aclose()
                await client.aclose()
    return outcomes


async def test_random_requests_are_answered_without_internal_errors() -> None:
    seen: dict[str, int] = {}
    with watching_logs() as failures:
        for seed, drafts in ((1, (18,)), (2, (18,)), (3, (14,)), (4, (20,)), (5, (22,))):
            failures.seed = seed
            for kind, n in (await asyncio.wait_for(_run(seed, drafts), 120)).items():
                seen[kind] = seen.get(kind, 0) + n
    assert not failures.records, failures.report()
    # The requests reached the interesting paths: objects served and specific refusals.
    assert seen.get("subscribe: ok", 0) and seen.get("fetch: ok", 0), seen
    assert any(k.startswith("refused: DOES_NOT_EXIST") for k in seen), seen
