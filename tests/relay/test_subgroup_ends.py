"""A relay ends its stream of a subgroup when the publisher ends its own, with the header's
END_OF_GROUP bit as the publisher sent it (draft-18 "Closing Subgroup Streams"): subscribers
that take a group as complete only when its stream ends (moq-rs, which drops an unfinished
group once a newer one begins) get every group whole, while the track goes on."""

from __future__ import annotations

import asyncio

from kvsp_moq.moqt.quic import IncomingSubscribe, MoqtObject, SubgroupEnd

from .conftest import STEP, dial, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK_NS = NS + (b"k" * 32,)
NAME = b"1"


class GroupPublisher:
    """Sends each group on its own subgroup stream and ends the stream (with or without the
    END_OF_GROUP bit), then holds the subscription open until `more` is set."""

    def __init__(self, groups: list[tuple[int, bool, list[bytes]]]) -> None:
        self.groups = groups
        self.more = asyncio.Event()

    def attach(self, connection) -> None:
        connection.on_subscribe(self.on_subscribe)

    async def on_subscribe(self, req: IncomingSubscribe) -> None:
        sub = req.accept()
        for group, end_of_group, payloads in self.groups:
            sender = sub.open_subgroup(group, end_of_group=end_of_group)
            for i, payload in enumerate(payloads):
                await sender.send(i, payload)
            sender.close()
        await self.more.wait()
        await sub.finish()


async def next_items(subscription, count: int) -> list:
    return [await asyncio.wait_for(subscription.__anext__(), STEP) for _ in range(count)]


async def test_each_subgroup_stream_ends_when_the_publishers_did_with_its_end_of_group_bit():
    groups = [(0, True, [b"a" * 16, b"b" * 1024, b"c" * 65536]),
              (1, False, [b"d" * 262144, b"e" * 16])]
    publisher = GroupPublisher(groups)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        client = await dial(relay.url)
        try:
            sub = await asyncio.wait_for(client.subscribe(TRACK_NS, NAME), STEP)
            sub.subgroup_ends = True
            # groups travel on separate streams: collect both, then look at each one's order
            items = await next_items(sub, 3 + 1 + 2 + 1)  # while the publisher holds the track
            by_group: dict[int, list] = {0: [], 1: []}
            for item in items:
                by_group[item.group_id].append(item)
            for group, end_of_group, payloads in groups:
                got = by_group[group]
                assert [o.payload for o in got[:-1]] == payloads
                assert all(isinstance(o, MoqtObject) and o.end_of_group == end_of_group
                           for o in got[:-1])
                assert got[-1] == SubgroupEnd(group, 0, end_of_group)  # the stream's end, last
            publisher.more.set()
            assert [x async for x in sub] == []  # then the track ends
        finally:
            await client.aclose()
