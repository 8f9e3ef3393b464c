"""Random well-formed requests for KV block tracks, through a relay to a real BlockPublisher:
each one is answered with layers or a specific refusal, never INTERNAL_ERROR, never a handler
failure or an unretrieved error in the logs, and the session stays open. Seeded and bounded."""

from __future__ import annotations

import asyncio
import random

from kvsp_moq.moqt.quic import connect
from kvsp_moq.moqt.wire import GroupOrder, Location
from kvsp_moq.naming import BlockTrack
from tests.block_tracks import CERT, SCOPE, STEP, stored, system
from tests.random_requests import outcome, random_filter, read_some, watching_logs

REQUESTS = 120
READ = 0.15
U62 = (1 << 62) - 1


def _number(rnd: random.Random) -> int:
    return rnd.choice([0, 0, 1, 2, 7, 8, rnd.randint(0, 100), U62])


async def _step(rnd: random.Random, client, tracks: list[BlockTrack], subscriptions: list) -> str:
    track = rnd.choice(tracks)
    namespace, name = track.namespace, track.track_name
    if rnd.random() < 0.25:  # a sibling that does not exist: another codec, a changed field
        name = rnd.choice([b"2", b"0", b"x", b""])
    elif rnd.random() < 0.15:
        namespace = namespace[:-1] + (bytes(len(namespace[-1])),)
    kind = rnd.choice(["subscribe", "fetch", "fetch", "joining_fetch", "track_status", "cancel"])
    if kind == "subscribe":
        sub = await client.subscribe(namespace, name, subscription_filter=random_filter(rnd, _number),
                                     forward=rnd.choice([None, True, False]),
                                     group_order=rnd.choice([None, *GroupOrder]), timeout=5)
        subscriptions.append(sub)
        await read_some(sub, READ, limit=40)
    elif kind == "fetch":
        if rnd.random() < 0.5:  # within the block's one group (layers 0-7) or just past it
            start, end = Location(0, rnd.randint(0, 9)), Location(rnd.choice([0, 1]), rnd.randint(0, 9))
        else:
            start, end = Location(_number(rnd), _number(rnd)), Location(_number(rnd), _number(rnd))
        result = await client.fetch(namespace, name, start, end,
                                    whole_end_group=rnd.random() < 0.3,
                                    group_order=rnd.choice([None, *GroupOrder]), timeout=5)
        await read_some(result, READ, limit=40)
    elif kind == "joining_fetch":
        if not subscriptions:
            return "skipped"
        result = await client.joining_fetch(rnd.choice(subscriptions), _number(rnd),
                                            absolute=rnd.random() < 0.5, timeout=5)
        await read_some(result, READ, limit=40)
    elif kind == "track_status":
        await client.track_status(namespace, name, timeout=5)
    else:
        if not subscriptions:
            return "skipped"
        await subscriptions.pop(rnd.randrange(len(subscriptions))).aclose()
    return kind


async def test_random_requests_for_block_tracks_get_layers_or_specific_refusals() -> None:
    seen: dict[str, int] = {}
    with watching_logs() as failures:
        async with system() as (relay, store, publisher, _):
            tracks = []
            for n in (1, 2):
                _, _, record = await stored(store, publisher, n, scope=SCOPE, layers=8, section=2_000)
                tracks.append(BlockTrack.from_record_namespace(record.moqt_namespace))
            for seed, drafts in ((1, (18,)), (2, (14,))):  # a draft-18 and a draft-14 client
                failures.seed = seed
                rnd = random.Random(seed)
                client = await asyncio.wait_for(
                    connect(relay.url, cadata=CERT.certificate_pem, drafts=drafts), STEP)
                subscriptions: list = []
                try:
                    for step in range(REQUESTS):
                        kind = await outcome(_step(rnd, client, tracks, subscriptions), seed, step)
                        seen[kind] = seen.get(kind, 0) + 1
                    assert not client.is_closed, f"seed {seed}: the session to the relay ended"
                finally:
                    for sub in subscriptions:
                        await sub.aclose()
                    await client.aclose()
    assert not failures.records, failures.report()
    assert seen.get("fetch: ok", 0) and seen.get("subscribe: ok", 0), seen
    assert seen.get("refused: DOES_NOT_EXIST", 0), seen
