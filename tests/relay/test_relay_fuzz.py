"""Random well-formed requests against a relay with a live publisher behind it: every one is
answered (objects, or a REQUEST_ERROR naming what is wrong), never with INTERNAL_ERROR, never a
handler failure in the relay's log, and the session stays open. Seeded, so a failure names the
seed and step that reproduce it; bounded in requests and in time."""

from __future__ import annotations

import asyncio
import logging
import random

from kvsp_moq.moqt.errors import MoqtError, RequestError, RequestErrorCode, SessionClosed
from kvsp_moq.moqt.messages import FilterType, GroupOrder, Location, SubscriptionFilter

from .conftest import TrackPublisher, dial, make_objects, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK = b"t"
U62 = (1 << 62) - 1
REQUESTS = 120
READ = 0.15  # seconds a step reads objects before it moves on


class _Failures(logging.Handler):
    """Log records of failed handlers (their requests got INTERNAL_ERROR)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seed = 0
        self.records: list[tuple[int, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.seed, record))


def _namespace(rnd: random.Random) -> tuple[bytes, ...]:
    return rnd.choice([
        NS, NS[:3], NS[:1], NS + (b"extra",), (b"kvsp", b"other"), (b"x",),
        tuple(bytes([i]) for i in range(rnd.randint(2, 32))), (b"k" * rnd.randint(1, 1024),),
    ])


def _number(rnd: random.Random) -> int:
    return rnd.choice([0, 1, 2, 3, 5, rnd.randint(0, 1000), U62])


def _location(rnd: random.Random) -> Location:
    return Location(_number(rnd), _number(rnd))


def _filter(rnd: random.Random) -> SubscriptionFilter | None:
    kind = rnd.choice([None, *FilterType])
    if kind is None:
        return None
    if kind in (FilterType.NEXT_GROUP_START, FilterType.LARGEST_OBJECT):
        return SubscriptionFilter(kind)
    if kind == FilterType.ABSOLUTE_START:
        return SubscriptionFilter(kind, _location(rnd))
    start = _location(rnd)
    return SubscriptionFilter(kind, start, rnd.choice([start.group, start.group + 1, _number(rnd)]))


async def _read(iterator, limit: int = 20) -> int:
    count = 0

    async def run() -> None:
        nonlocal count
        async for _ in iterator:
            count += 1
            if count >= limit:
                return

    try:
        await asyncio.wait_for(run(), READ)
    except asyncio.TimeoutError:
        pass
    return count


async def _step(rnd: random.Random, client, subscriptions: list) -> str:
    kind = rnd.choice(["subscribe", "fetch", "joining_fetch", "track_status", "subscribe_namespace",
                       "subscribe_tracks", "publish_namespace", "cancel"])
    if rnd.random() < 0.5:  # the published track, so that requests get past routing
        ns, track = NS, TRACK
    else:
        ns, track = _namespace(rnd), rnd.choice([TRACK, b"", b"missing", b"n" * 200])
    if kind == "subscribe":
        sub = await client.subscribe(ns, track, subscription_filter=_filter(rnd),
                                     forward=rnd.choice([None, True, False]),
                                     subscriber_priority=rnd.choice([None, 0, 255]),
                                     group_order=rnd.choice([None, *GroupOrder]), timeout=5)
        subscriptions.append(sub)
        await _read(sub)
    elif kind == "fetch":
        result = await client.fetch(ns, track, _location(rnd), _location(rnd),
                                    whole_end_group=rnd.random() < 0.3,
                                    group_order=rnd.choice([None, *GroupOrder]), timeout=5)
        await _read(result)
    elif kind == "joining_fetch":
        if not subscriptions:
            return "skipped"
        result = await client.joining_fetch(rnd.choice(subscriptions), _number(rnd),
                                            absolute=rnd.random() < 0.5, timeout=5)
        await _read(result)
    elif kind == "track_status":
        await client.track_status(ns, track, timeout=5)
    elif kind in ("subscribe_namespace", "subscribe_tracks"):
        prefix = ns[:rnd.randint(0, len(ns))]
        request = getattr(client, kind)
        sub = await request(prefix, timeout=5)
        await _read(sub, limit=5)
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
    publisher = TrackPublisher(make_objects(3, 4, size=200, seed=1), end=False)
    async with running_relay() as relay:
        async with publishing(relay.url, NS, publisher):
            client = await dial(relay.url, drafts=drafts)
            subscriptions: list = []
            try:
                for step in range(REQUESTS):
                    try:
                        kind = await _step(rnd, client, subscriptions)
                        outcome = kind if kind == "skipped" else f"{kind}: ok"
                    except ValueError as e:  # refused by our own client before sending
                        outcome = f"local: {type(e).__name__}"
                    except RequestError as e:
                        assert e.error_code != RequestErrorCode.INTERNAL_ERROR, (seed, step, e)
                        outcome = f"refused: {RequestErrorCode(e.error_code).name}"
                    except SessionClosed as e:
                        raise AssertionError(f"seed {seed} step {step}: the relay closed the session: {e}")
                    except MoqtError as e:
                        outcome = f"error: {type(e).__name__}"
                    except asyncio.TimeoutError:
                        outcome = "timed out"
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                assert not client.is_closed, f"seed {seed}: the session to the relay ended"
            finally:
                for sub in subscriptions:
                    await sub.aclose()
                await client.aclose()
    return outcomes


async def test_random_requests_are_answered_without_internal_errors() -> None:
    failures = _Failures()
    loggers = [logging.getLogger(name) for name in ("kvsp_moq.moqt.quic", "kvsp.relay", "asyncio")]
    for logger in loggers:
        logger.addHandler(failures)
    try:
        seen: dict[str, int] = {}
        for seed, drafts in ((1, (18,)), (2, (18,)), (3, (14,))):  # the last one as a draft-14 client
            failures.seed = seed
            for outcome, n in (await asyncio.wait_for(_run(seed, drafts), 120)).items():
                seen[outcome] = seen.get(outcome, 0) + n
    finally:
        for logger in loggers:
            logger.removeHandler(failures)
    assert not failures.records, [f"seed {seed}: {r.getMessage()}\n{r.exc_text or ''}"
                                  for seed, r in failures.records]
    # The requests reached the interesting paths: objects served and specific refusals.
    assert seen.get("subscribe: ok", 0) and seen.get("fetch: ok", 0), seen
    assert any(k.startswith("refused: DOES_NOT_EXIST") for k in seen), seen
