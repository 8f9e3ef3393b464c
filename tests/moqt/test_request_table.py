"""The table of live requests of a connection (ConnectionCore): requests of both directions
share it by Request ID, each handle leaves it when its request ends, and the end of the
session ends every handle still in it."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import SessionClosed, StreamResetCode
from kvsp_moq.moqt.quic import (
    NamespacePublisher,
    NamespaceRegistration,
    NamespaceSubscription,
    OutgoingSubscription,
    PublishedNamespace,
    Subscription,
)

from .test_quic import NS, STEP, dial, start


async def wait_until(condition, what: str) -> None:
    for _ in range(int(STEP / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_requests_of_both_directions_share_the_table_by_request_id():
    offered = asyncio.get_running_loop().create_future()
    served = []

    async def on_subscribe(request):
        request.accept()

    async def on_publish(request):
        offered.set_result(request.accept(forward=True))

    server = await start({"subscribe": on_subscribe}, on_connection=served.append)
    client = await dial(server)
    client.on_publish(on_publish)
    try:
        ours = await asyncio.wait_for(client.subscribe(NS, "ours"), STEP)
        await asyncio.wait_for(served[0].wait_ready(), STEP)
        published = await asyncio.wait_for(served[0].publish(NS, "theirs"), STEP)
        theirs = await asyncio.wait_for(offered, STEP)
        # The client's Request IDs are even, the server's odd: no two requests share one.
        assert ours.request_id % 2 == 0 and theirs.request_id % 2 == 1
        assert client.request_handle(ours.request_id) is ours
        assert client.request_handle(theirs.request_id) is theirs
        assert served[0].request_handle(published.request_id) is published
        await published.finish()
        await ours.unsubscribe()
        # Each handle forgets itself as its request ends.
        assert client.request_handle(ours.request_id) is None
        await wait_until(lambda: client.request_handle(theirs.request_id) is None, "the PUBLISH outlived its end")
        assert served[0].request_handle(published.request_id) is None
    finally:
        await client.aclose()
        await server.aclose()


async def test_the_end_of_the_session_ends_every_live_request():
    served = []
    accepted: list[object] = []

    async def accept(request):
        accepted.append(request.accept())

    server = await start(
        {"subscribe": accept, "publish_namespace": accept, "subscribe_namespace": accept},
        on_connection=served.append,
    )
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "t"), STEP)
        announced = await asyncio.wait_for(client.publish_namespace(NS[:2]), STEP)
        namespaces = await asyncio.wait_for(client.subscribe_namespace(NS[:1]), STEP)
        assert {type(h) for h in client.request_handles()} == {Subscription, PublishedNamespace, NamespaceSubscription}
        peer = served[0]
        assert {type(h) for h in peer.request_handles()} == {
            OutgoingSubscription, NamespaceRegistration, NamespacePublisher}

        client.close()
        assert client.request_handles() == []
        with pytest.raises(SessionClosed):
            await asyncio.wait_for(subscription.__anext__(), STEP)
        with pytest.raises(SessionClosed):
            await asyncio.wait_for(namespaces.__anext__(), STEP)
        assert announced.closed.result() == StreamResetCode.SESSION_CLOSED
        # The server's handles end too, whether by the peer's cancellations or the session's end.
        await wait_until(lambda: peer.request_handles() == [], "the server kept handles of a closed session")
        assert all(h.cancelled.done() if isinstance(h, OutgoingSubscription) else h.closed.done() for h in accepted)
    finally:
        await client.aclose()
        await server.aclose()
