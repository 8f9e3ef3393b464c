"""Two chained relays, each with its own principals file: the downstream relay presents its
upstream token (a principal with the relay role there), the upstream relay bounds what it may
fetch by that principal's scopes, and each relay checks its own clients before forwarding."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest

from kvsp_moq.auth import Authenticator
from kvsp_moq.moqt.errors import RequestErrorCode, Unauthorized
from kvsp_moq.naming import pass_track_name, publisher_id

from .conftest import CERT, STEP, TrackPublisher, collect, dial, make_objects, publishing, running_relay

SCOPE, OTHER = "a1" * 16, "b2" * 16
HOLDER = "http://holder.test:8801/"
NAME = b"1"


def ns(scope: str = SCOPE) -> tuple[bytes, ...]:
    return (b"kvsp", b"c" * 32, scope.encode(), publisher_id(HOLDER).hex().encode())


def track(scope: str = SCOPE) -> tuple[bytes, ...]:
    return ns(scope) + (b"k" * 32,)


def triples(objects) -> list[tuple[int, int, bytes]]:
    return [(o.group_id, o.object_id, bytes(o.payload)) for o in objects]


#: The upstream relay's principals: a holder publishing there, and the downstream relays.
UPSTREAM = Authenticator.from_mapping({"principal": [
    {"name": "holder", "token": "up-holder", "scopes": [SCOPE, OTHER], "holders": [HOLDER],
     "roles": ["holder"]},
    {"name": "instance-up", "token": "up-instance", "scopes": [SCOPE], "roles": ["instance"]},
    {"name": "relay-b", "token": "relay-b", "scopes": [SCOPE], "holders": [HOLDER],
     "roles": ["relay"]},
    # A downstream relay whose token lacks the relay role, and one that lacks the scope.
    {"name": "not-a-relay", "token": "no-role", "scopes": [SCOPE], "roles": ["client"]},
    {"name": "relay-elsewhere", "token": "no-scope", "scopes": [OTHER], "roles": ["relay"]},
]})

#: The downstream relay's own principals: its clients. None of these tokens is known upstream.
DOWNSTREAM = Authenticator.from_mapping({"principal": [
    {"name": "instance", "token": "down-instance", "scopes": [SCOPE], "roles": ["instance"]},
    {"name": "other-tenant", "token": "down-other", "scopes": [OTHER], "roles": ["instance"]},
    # Of the scope, but only a client of the HTTP services: no role that may subscribe.
    {"name": "front-end", "token": "down-client", "scopes": [SCOPE], "roles": ["client"]},
    {"name": "holder-b", "token": "down-holder", "scopes": [SCOPE], "holders": [HOLDER],
     "roles": ["holder"]},
]})


@asynccontextmanager
async def chain(upstream_token: str) -> AsyncIterator[tuple]:
    async with running_relay(authenticator=UPSTREAM) as relay_a, running_relay(
            authenticator=DOWNSTREAM, upstream=relay_a.url, upstream_token=upstream_token,
            upstream_cadata=CERT.certificate_pem, upstream_timeout=STEP / 2) as relay_b:
        await relay_b.wait_upstream()
        yield relay_a, relay_b


async def test_a_scoped_client_at_the_downstream_relay_gets_what_the_upstream_has():
    objects = make_objects(1, 6, 2000)
    publisher = TrackPublisher(objects)
    async with chain("relay-b") as (relay_a, relay_b):
        async with publishing(relay_a.url, ns(), publisher, authorization="up-holder"):
            client = await dial(relay_b.url, authorization="down-instance")
            try:
                got = await collect(await client.fetch(track(), NAME, (0, 0), (0, 5), timeout=STEP))
                assert triples(got) == objects
                sub = await client.subscribe(track(), NAME, timeout=STEP)
                assert triples(await collect(sub)) == objects
            finally:
                await client.aclose()
        assert relay_a.stats.unauthorized == relay_b.stats.unauthorized == 0
        assert relay_b.stats.upstream_fetches == 1


async def test_a_client_lacking_the_scope_is_refused_at_the_downstream_relay():
    objects = make_objects(1, 2, 100)
    async with chain("relay-b") as (relay_a, relay_b):
        async with publishing(relay_a.url, ns(), TrackPublisher(objects), authorization="up-holder"):
            outsider = await dial(relay_b.url, authorization="down-other")
            anonymous = await dial(relay_b.url)
            try:
                for client in (outsider, anonymous):
                    with pytest.raises(Unauthorized) as e:
                        await client.fetch(track(), NAME, (0, 0), (0, 1), timeout=STEP)
                    assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
                    with pytest.raises(Unauthorized):
                        await client.subscribe(track(), NAME, timeout=STEP)
            finally:
                await asyncio.gather(outsider.aclose(), anonymous.aclose())
        # Refused before anything went upstream.
        assert relay_b.stats.upstream_requests == 0
        assert relay_a.stats.fetches == relay_a.stats.subscribes == 0


@pytest.mark.parametrize("upstream_token", ["no-role", "no-scope", "unknown"])
async def test_a_downstream_relay_without_the_relay_role_or_the_scope_gets_nothing_upstream(
        upstream_token: str):
    objects = make_objects(1, 2, 100)
    async with chain(upstream_token) as (relay_a, relay_b):
        async with publishing(relay_a.url, ns(), TrackPublisher(objects), authorization="up-holder"):
            client = await dial(relay_b.url, authorization="down-instance")
            try:
                # An error, promptly: not a hang.
                with pytest.raises(Unauthorized) as e:
                    await asyncio.wait_for(
                        client.fetch(track(), NAME, (0, 0), (0, 1), timeout=STEP), STEP)
                assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
                with pytest.raises(Unauthorized):
                    await asyncio.wait_for(client.subscribe(track(), NAME, timeout=STEP), STEP)
            finally:
                await client.aclose()
        assert relay_a.stats.unauthorized >= 2
        assert relay_a.stats.objects_out == 0


async def test_the_upstream_relay_reaches_a_publisher_behind_the_downstream_relay():
    """The direction that failed: a namespace announced at the downstream relay is forwarded up
    (authorized there as relay-b, which may publish for the holder), and the upstream relay's
    SUBSCRIBE and FETCH come back on the session the downstream relay opened: the downstream
    accepts them as its upstream's, though they carry no token it knows."""
    objects = make_objects(1, 4, 1000)
    publisher = TrackPublisher(objects)
    async with chain("relay-b") as (relay_a, relay_b):
        async with publishing(relay_b.url, ns(), publisher, authorization="down-holder"):
            for _ in range(100):
                if relay_a.routes.lookup(track()) is not None:
                    break
                await asyncio.sleep(0.05)
            client = await dial(relay_a.url, authorization="up-instance")
            try:
                got = await collect(await client.fetch(track(), NAME, (0, 0), (0, 3), timeout=STEP))
                assert triples(got) == objects
                sub = await client.subscribe(track(), NAME, timeout=STEP)
                assert triples(await collect(sub)) == objects
            finally:
                await client.aclose()
        assert relay_a.stats.unauthorized == relay_b.stats.unauthorized == 0
        assert publisher.fetches and publisher.subscribes


async def test_an_announcement_outside_the_relay_principal_is_not_forwarded():
    """relay-b may not speak upstream for a scope it lacks there, whoever announced it here."""
    async with chain("relay-b") as (relay_a, relay_b):
        wide = Authenticator.from_mapping({"principal": [
            {"name": "holder-b", "token": "down-holder", "scopes": [OTHER], "holders": [HOLDER],
             "roles": ["holder"]}]})
        relay_b.policy.authenticator = wide
        async with publishing(relay_b.url, ns(OTHER), TrackPublisher([]), authorization="down-holder"):
            for _ in range(20):
                if relay_a.stats.unauthorized:
                    break
                await asyncio.sleep(0.05)
            assert relay_a.routes.lookup(track(OTHER)) is None
            assert relay_a.stats.unauthorized == 1


async def test_a_pass_track_is_authorized_by_its_namespace_like_the_block_tracks():
    """A pass track (DESIGN §9.6) lives in the namespace of its first block: a client of the
    scope gets it; one of another tenant, one of the scope whose role may not subscribe, or one
    without a token is refused before anything goes to the publisher."""
    objects = make_objects(1, 3, 500)
    async with running_relay(authenticator=DOWNSTREAM) as relay:
        async with publishing(relay.url, ns(), TrackPublisher(objects), authorization="down-holder"):
            member = await dial(relay.url, authorization="down-instance")
            outsider = await dial(relay.url, authorization="down-other")
            no_role = await dial(relay.url, authorization="down-client")
            anonymous = await dial(relay.url)
            try:
                sub = await member.subscribe(track(), pass_track_name(), timeout=STEP)
                assert triples(await collect(sub)) == objects
                for client in (outsider, no_role, anonymous):
                    with pytest.raises(Unauthorized):
                        await client.subscribe(track(), pass_track_name(), timeout=STEP)
                    with pytest.raises(Unauthorized):
                        await client.fetch(track(), pass_track_name(), (0, 0), (0, 1), timeout=STEP)
            finally:
                await asyncio.gather(member.aclose(), outsider.aclose(), no_role.aclose(), anonymous.aclose())
        assert relay.stats.unauthorized >= 6 and relay.stats.upstream_subscribes == 1
