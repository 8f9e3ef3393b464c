"""Roles at the relay (kvsp_moq.auth.PERMISSIONS): announcing and publishing need holder,
instance or relay; subscribing, fetching and TRACK_STATUS need instance, holder or relay;
discovery needs only a valid token. Every principal here holds the scope and may publish for
any holder, so a refusal can only be for its roles; it is REQUEST_ERROR UNAUTHORIZED."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.auth import PERMISSIONS, Authenticator
from kvsp_moq.auth import Action as Doing
from kvsp_moq.moqt.errors import RequestErrorCode, Unauthorized
from kvsp_moq.naming import publisher_id
from relay.access import AccessPolicy, Action

from .conftest import STEP, TrackPublisher, collect, dial, make_objects, running_relay

SCOPE = "5c" * 16
HOLDER = "http://holder.test/"
NAME = b"1"
NAMES = ("holder", "pc", "instance", "relay", "client", "admin", "none")
AUTH = Authenticator.from_mapping({"principal": [
    {"name": n, "token": f"t-{n}", "scopes": [SCOPE], "holders": ["*"],
     "roles": [] if n == "none" else [n]} for n in NAMES]})


def ns() -> tuple[bytes, ...]:
    return (b"kvsp", b"c" * 32, SCOPE.encode(), publisher_id(HOLDER).hex().encode())


def track() -> tuple[bytes, ...]:
    return ns() + (b"k" * 32,)


def allowed(action: Doing) -> list[str]:
    return [n for n in NAMES if n == "admin" or n in PERMISSIONS[action]]


def refused(action: Doing) -> list[str]:
    return [n for n in NAMES if n not in allowed(action)]


def test_policy_follows_the_table():
    policy = AccessPolicy(AUTH)
    for action, doing in ((Action.ANNOUNCE, Doing.ANNOUNCE), (Action.PUBLISH, Doing.ANNOUNCE),
                          (Action.SUBSCRIBE, Doing.SUBSCRIBE), (Action.FETCH, Doing.SUBSCRIBE)):
        for name in allowed(doing):
            policy.check(action, track(), [f"t-{name}".encode()])
        for name in refused(doing):
            with pytest.raises(Unauthorized, match="lacks a role"):
                policy.check(action, track(), [f"t-{name}".encode()])
            # Another token of the request or session that has the role is enough.
            policy.check(action, track(), [f"t-{name}".encode(), b"t-admin"])
    for name in NAMES:
        policy.check(Action.DISCOVER, (b"kvsp",), [f"t-{name}".encode()])
    assert refused(Doing.SUBSCRIBE) == ["pc", "client", "none"]
    assert refused(Doing.ANNOUNCE) == ["pc", "client", "none"]


async def test_moqt_requests_without_the_role_are_refused():
    objects = make_objects(1, 2, 100)
    async with running_relay(authenticator=AUTH) as relay:
        publisher = await dial(relay.url, authorization="t-holder")
        TrackPublisher(objects).attach(publisher)
        clients = {n: await dial(relay.url, authorization=f"t-{n}") for n in NAMES}
        try:
            await publisher.publish_namespace(ns(), timeout=STEP)
            for name in refused(Doing.ANNOUNCE):
                with pytest.raises(Unauthorized) as e:
                    await clients[name].publish_namespace(ns(), timeout=STEP)
                assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
                with pytest.raises(Unauthorized):
                    await clients[name].publish(ns() + (b"p" * 32,), NAME, timeout=STEP)
            for name in refused(Doing.SUBSCRIBE):
                client = clients[name]
                with pytest.raises(Unauthorized) as e:
                    await client.subscribe(track(), NAME, timeout=STEP)
                assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
                with pytest.raises(Unauthorized):
                    await client.fetch(track(), NAME, (0, 0), (0, 1), timeout=STEP)
                with pytest.raises(Unauthorized):
                    await client.track_status(track(), NAME, timeout=STEP)
            for name in allowed(Doing.SUBSCRIBE):
                got = await collect(await clients[name].fetch(track(), NAME, (0, 0), (0, 1),
                                                              timeout=STEP))
                assert len(got) == 2
            # Discovery: any valid token, even one without roles.
            watch = await clients["none"].subscribe_namespace((b"kvsp",), timeout=STEP)
            update = await asyncio.wait_for(watch.__anext__(), STEP)
            assert update.active and tuple(update.namespace) == ns()
            for i, name in enumerate(allowed(Doing.ANNOUNCE)):
                if name != "holder":  # it announced above
                    await clients[name].publish_namespace(ns()[:3] + (bytes([i]) * 16,),
                                                          timeout=STEP)
        finally:
            await asyncio.gather(publisher.aclose(), *(c.aclose() for c in clients.values()))
