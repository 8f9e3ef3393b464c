"""A subscription after PUBLISH_DONE (draft 18 "PUBLISH_DONE"): it ends once the streams its
Stream Count promises have ended; after the grace period it gives up streams that never
opened, but an open stream still delivers its objects before the subscription ends."""

import asyncio

import pytest

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.moqt.quic.subscriber import Subscription
from kvsp_moq.moqt.wire import ObjectStatus

GRACE = 0.05
STEP = 5.0
RID = 4


class FakeSession:
    closed = False

    def __init__(self) -> None:
        self.open: set[int] = set()
        self.released: list[int] = []

    def incoming_stream_open(self, stream_id: int) -> bool:
        return stream_id in self.open

    def release(self, request_id: int) -> None:
        self.released.append(request_id)


class FakeCore:
    """What a Subscription uses of its connection."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.settings = QuicSettings(publish_done_grace=GRACE)
        self.session = FakeSession()
        self.held = 0

    def register(self, handle: object) -> None:
        pass

    def forget(self, request_id: int) -> None:
        pass

    def hold(self, stream_id: int, size: int) -> None:
        self.held += size

    def consumed(self, stream_id: int, size: int) -> None:
        self.held -= size


def opened(core: FakeCore, sub: Subscription, sid: int) -> None:
    core.session.open.add(sid)
    sub.deliver(ev.SubgroupStreamOpened(RID, sid, None))


def obj(sub: Subscription, sid: int, object_id: int, payload: bytes) -> None:
    sub.deliver(ev.ObjectReceived(RID, 1, 0, 0, object_id, 128, ObjectStatus.NORMAL, payload, (), sid, False))


def ended(core: FakeCore, sub: Subscription, sid: int) -> None:
    core.session.open.discard(sid)
    sub.deliver(ev.DataStreamEnded(RID, sid, False, False, None))


def done(sub: Subscription, streams: int) -> None:
    sub.deliver(ev.PublishDoneReceived(RID, PublishDoneCode.TRACK_ENDED, streams, ""))


async def read_all(sub: Subscription) -> list[bytes]:
    async def run() -> list[bytes]:
        return [o.payload async for o in sub]
    return await asyncio.wait_for(run(), STEP)


async def test_an_open_stream_outlives_the_grace_period():
    core = FakeCore()
    sub = Subscription(core, RID, ("ns",), b"t")  # type: ignore[arg-type]
    opened(core, sub, 3)
    obj(sub, 3, 0, b"first")
    done(sub, 1)  # on the control stream, ahead of the data stream's last octets
    await asyncio.sleep(4 * GRACE)
    assert not core.session.released  # the stream is open: nothing given up
    obj(sub, 3, 1, b"late")
    ended(core, sub, 3)
    assert await read_all(sub) == [b"first", b"late"]
    assert core.session.released == [RID] and core.held == 0


async def test_a_stream_that_never_opens_is_given_up_after_the_grace_period():
    core = FakeCore()
    sub = Subscription(core, RID, ("ns",), b"t")  # type: ignore[arg-type]
    opened(core, sub, 3)
    obj(sub, 3, 0, b"first")
    ended(core, sub, 3)
    done(sub, 2)  # a second stream was opened, and never arrives
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await read_all(sub) == [b"first"]
    assert GRACE * 0.9 <= loop.time() - started < STEP
    assert core.session.released == [RID]


async def test_the_count_met_ends_the_subscription_at_once():
    core = FakeCore()
    sub = Subscription(core, RID, ("ns",), b"t")  # type: ignore[arg-type]
    core.settings = QuicSettings(publish_done_grace=60.0)
    opened(core, sub, 3)
    obj(sub, 3, 0, b"only")
    done(sub, 1)
    ended(core, sub, 3)
    assert await read_all(sub) == [b"only"]
    assert not core.session.released  # the session forgets it by its own count


@pytest.mark.parametrize("streams", [1, 2])
async def test_after_the_grace_period_the_last_open_stream_ends_it(streams):
    core = FakeCore()
    sub = Subscription(core, RID, ("ns",), b"t")  # type: ignore[arg-type]
    opened(core, sub, 3)
    opened(core, sub, 7)
    done(sub, 2 + streams)  # more streams promised than will come
    await asyncio.sleep(4 * GRACE)
    ended(core, sub, 3)
    assert not core.session.released
    obj(sub, 7, 0, b"x")
    ended(core, sub, 7)
    assert await read_all(sub) == [b"x"]
    assert core.session.released == [RID]
