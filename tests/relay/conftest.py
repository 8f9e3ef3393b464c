"""Relays, publishers and subscribers over real aioquic sessions on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterable

from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import (
    IncomingFetch,
    IncomingSubscribe,
    MoqtConnection,
    QuicSettings,
    connect,
)
from kvsp_moq.moqt.wire import GroupOrder, Location
from relay.relay import Relay, RelaySettings

CERT = generate_self_signed()
STEP = 10.0  # seconds any single awaited step may take


@asynccontextmanager
async def running_relay(**overrides) -> AsyncIterator[Relay]:
    settings = RelaySettings(certificate=CERT, **overrides)
    relay = await Relay(settings).start()
    try:
        yield relay
    finally:
        await relay.aclose()


async def dial(url: str, *, settings: QuicSettings | None = None, **kwargs) -> MoqtConnection:
    return await asyncio.wait_for(connect(url, cadata=CERT.certificate_pem, settings=settings, **kwargs), STEP)


async def collect(iterator, limit: int = 100_000, timeout: float = STEP) -> list:
    out = []

    async def run() -> None:
        async for item in iterator:
            out.append(item)
            assert len(out) <= limit

    await asyncio.wait_for(run(), timeout)
    return out


def make_objects(groups: int, per_group: int, size: int = 1000, seed: int = 0) -> list[tuple[int, int, bytes]]:
    rnd = os.urandom if seed == 0 else None
    out = []
    for g in range(groups):
        for o in range(per_group):
            payload = rnd(size + o) if rnd else bytes([(seed + g + o) % 256]) * (size + o)
            out.append((g, o, payload))
    return out


#: The object property moq-rs puts on every object (a timestamp in microseconds).
TIMESTAMP_PROPERTY = 0x10


class TrackPublisher:
    """A publisher that serves fixed objects: SUBSCRIBE sends them (once `gate` opens) on one
    subgroup stream per group; FETCH answers the requested range. With `timestamps`, every
    object carries a timestamp property, as moq-rs's do."""

    def __init__(self, objects: Iterable[tuple[int, int, bytes]], *, gate: asyncio.Event | None = None,
                 pace: float = 0.0, end: bool = True, timestamps: bool = False) -> None:
        self.timestamps = timestamps
        self.objects = sorted(objects)
        self.gate = gate
        self.pace = pace
        self.end = end
        self.subscribes: list[IncomingSubscribe] = []
        self.fetches: list[tuple[Location, Location]] = []
        self.sent = 0
        self.fetch_sent = 0  # objects written in FETCH responses

    def attach(self, connection: MoqtConnection) -> None:
        connection.on_subscribe(self.on_subscribe)
        connection.on_fetch(self.on_fetch)

    async def on_subscribe(self, req: IncomingSubscribe) -> None:
        self.subscribes.append(req)
        sub = req.accept()
        if self.gate is not None:
            await self.gate.wait()
        sender, group = None, None
        for g, o, payload in self.objects:
            if g != group:
                if sender is not None:
                    sender.close()
                sender, group = sub.open_subgroup(g, has_properties=self.timestamps), g
            await sender.send(o, payload, properties=self.properties_of(g, o))
            self.sent += 1
            if self.pace:
                await asyncio.sleep(self.pace)
        if sender is not None:
            sender.close()
        if self.end:
            await sub.finish()
        else:
            await asyncio.sleep(3600)

    def properties_of(self, group: int, obj: int) -> tuple:
        return ((TIMESTAMP_PROPERTY, 1000 * group + obj),) if self.timestamps else ()

    async def on_fetch(self, req: IncomingFetch) -> None:
        self.fetches.append((req.start, req.end))
        wanted = [x for x in self.objects if req.includes((x[0], x[1]))]
        if not wanted:
            from kvsp_moq.moqt.errors import InvalidRange

            raise InvalidRange("nothing in range")
        last = wanted[-1]
        sender = req.accept(end=(last[0], last[1] + 1))
        if req.group_order == GroupOrder.DESCENDING:  # groups newest first, objects ascending
            wanted.sort(key=lambda x: (-x[0], x[1]))
        for g, o, payload in wanted:
            await sender.send(g, o, payload, properties=self.properties_of(g, o))
            self.fetch_sent += 1
        sender.close()


@asynccontextmanager
async def publishing(url: str, namespace, publisher: TrackPublisher, **kwargs) -> AsyncIterator[MoqtConnection]:
    connection = await dial(url, **kwargs)
    publisher.attach(connection)
    try:
        await asyncio.wait_for(connection.publish_namespace(namespace, authorization=kwargs.get("authorization")), STEP)
        yield connection
    finally:
        await connection.aclose()
