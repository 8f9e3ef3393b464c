"""SUBSCRIBE_NAMESPACE up a chain of relays: a subscriber at relay B learns of namespaces
announced, and tracks published, at its upstream relay A."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import PrefixOverlap
from kvsp_moq.moqt.quic import NamespaceUpdate

from .conftest import CERT, STEP, dial, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
OTHER_NS = (b"kvsp", b"c" * 32, b"s" * 16, b"q" * 16)


async def next_update(subscription) -> NamespaceUpdate:
    return await asyncio.wait_for(subscription.__anext__(), STEP)


async def test_namespace_announced_and_published_at_the_upstream_relay_reach_a_subscriber_downstream():
    async with running_relay() as relay_a, running_relay(
            upstream=relay_a.url, upstream_cadata=CERT.certificate_pem) as relay_b:
        await relay_b.wait_upstream()
        watcher = await dial(relay_b.url)
        narrower = await dial(relay_b.url)
        publisher = await dial(relay_a.url)
        try:
            updates = await asyncio.wait_for(watcher.subscribe_namespace(NS[:2]), STEP)
            narrow_updates = await asyncio.wait_for(narrower.subscribe_namespace(NS[:3]), STEP)
            for _ in range(100):  # B's SUBSCRIBE_NAMESPACE reaches A
                if relay_b.stats.upstream_namespace_subscribes == 1 and relay_a.namespaces.watchers:
                    break
                await asyncio.sleep(0.02)
            # One upstream SUBSCRIBE_NAMESPACE serves both watchers (NS[:2] covers NS[:3]).
            assert relay_b.stats.upstream_namespace_subscribes == 1
            assert len(relay_a.namespaces.watchers) == 1

            announced = await asyncio.wait_for(publisher.publish_namespace(NS), STEP)
            assert await next_update(updates) == NamespaceUpdate(NS, True)
            assert await next_update(narrow_updates) == NamespaceUpdate(NS, True)

            # A track PUBLISHed at A makes its namespace known downstream too.
            outgoing = await asyncio.wait_for(publisher.publish(OTHER_NS + (b"k" * 32,), b"1"), STEP)
            track_ns = OTHER_NS + (b"k" * 32,)
            assert await next_update(updates) == NamespaceUpdate(track_ns, True)
            assert await next_update(narrow_updates) == NamespaceUpdate(track_ns, True)

            await announced.withdraw()
            assert await next_update(updates) == NamespaceUpdate(NS, False)
            await outgoing.finish()
            assert await next_update(updates) == NamespaceUpdate(track_ns, False)

            # A watcher arriving later is told at once what B already knows from A.
            late_publication = await asyncio.wait_for(publisher.publish_namespace(NS), STEP)
            assert await next_update(updates) == NamespaceUpdate(NS, True)
            late = await dial(relay_b.url)
            try:
                late_updates = await asyncio.wait_for(late.subscribe_namespace(NS[:1]), STEP)
                assert await next_update(late_updates) == NamespaceUpdate(NS, True)
            finally:
                await late.aclose()
            await late_publication.withdraw()
        finally:
            await publisher.aclose()
            await watcher.aclose()
            await narrower.aclose()


async def test_upstream_namespace_subscription_ends_with_its_last_watcher():
    async with running_relay() as relay_a, running_relay(
            upstream=relay_a.url, upstream_cadata=CERT.certificate_pem) as relay_b:
        await relay_b.wait_upstream()
        watcher = await dial(relay_b.url)
        try:
            updates = await asyncio.wait_for(watcher.subscribe_namespace(NS[:2]), STEP)
            for _ in range(100):
                if relay_a.namespaces.watchers:
                    break
                await asyncio.sleep(0.02)
            assert len(relay_a.namespaces.watchers) == 1
            await updates.cancel()
            for _ in range(100):
                if not relay_a.namespaces.watchers:
                    break
                await asyncio.sleep(0.02)
            assert not relay_a.namespaces.watchers and not relay_b.namespaces.upstream_watches
        finally:
            await watcher.aclose()


async def subscribe_tracks(connection, prefix):
    return await asyncio.wait_for(connection.subscribe_tracks(prefix), STEP)


async def test_overlapping_namespace_prefixes_in_one_session_are_refused():
    """draft-18 SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS: PREFIX_OVERLAP within a session;
    another session, or the other request type, may use the same prefixes."""
    async with running_relay() as relay:
        first = await dial(relay.url)
        second = await dial(relay.url)
        try:
            await asyncio.wait_for(first.subscribe_namespace(NS[:2]), STEP)
            for prefix in (NS[:2], NS[:1], NS[:3]):
                with pytest.raises(PrefixOverlap):
                    await asyncio.wait_for(first.subscribe_namespace(prefix), STEP)
            await asyncio.wait_for(first.subscribe_namespace((b"other",)), STEP)  # disjoint
            await asyncio.wait_for(second.subscribe_namespace(NS[:3]), STEP)  # another session
            await subscribe_tracks(first, NS[:3])  # another overlap space
            with pytest.raises(PrefixOverlap):
                await subscribe_tracks(first, NS[:2])
        finally:
            await first.aclose()
            await second.aclose()


async def test_a_wider_prefix_downstream_replaces_the_narrower_upstream_subscription():
    """The relay's own upstream namespace subscriptions never overlap: a wider prefix
    replaces the narrower one at the upstream, whose watcher keeps its namespaces."""
    async with running_relay() as relay_a, running_relay(
            upstream=relay_a.url, upstream_cadata=CERT.certificate_pem) as relay_b:
        await relay_b.wait_upstream()
        narrow = await dial(relay_b.url)
        wide = await dial(relay_b.url)
        publisher = await dial(relay_a.url)
        try:
            announced = await asyncio.wait_for(publisher.publish_namespace(NS), STEP)
            narrow_updates = await asyncio.wait_for(narrow.subscribe_namespace(NS[:3]), STEP)
            assert await next_update(narrow_updates) == NamespaceUpdate(NS, True)
            wide_updates = await asyncio.wait_for(wide.subscribe_namespace(NS[:2]), STEP)
            assert await next_update(wide_updates) == NamespaceUpdate(NS, True)
            for _ in range(100):
                prefixes = [w.prefix for w in relay_a.namespaces.watchers]
                if prefixes == [NS[:2]]:
                    break
                await asyncio.sleep(0.02)
            assert [w.prefix for w in relay_a.namespaces.watchers] == [NS[:2]]
            assert list(relay_b.namespaces.upstream_watches) == [NS[:2]]
            other = await asyncio.wait_for(publisher.publish_namespace(OTHER_NS), STEP)
            assert await next_update(narrow_updates) == NamespaceUpdate(OTHER_NS, True)
            assert await next_update(wide_updates) == NamespaceUpdate(OTHER_NS, True)
            await announced.withdraw()
            assert await next_update(narrow_updates) == NamespaceUpdate(NS, False)
            assert await next_update(wide_updates) == NamespaceUpdate(NS, False)
            await other.withdraw()
        finally:
            await publisher.aclose()
            await narrow.aclose()
            await wide.aclose()
