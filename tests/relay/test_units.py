"""The relay's sans-I/O parts: cache, routing table, authorization decisions."""

import pytest

from kvsp_moq.auth import Authenticator
from kvsp_moq.moqt.errors import RequestErrorCode, Unauthorized
from kvsp_moq.moqt.wire import Location, ObjectStatus
from kvsp_moq.naming import publisher_id
from relay.access import AccessPolicy, Action
from relay.cache import CachedObject, ObjectCache
from relay.routing import RouteTable, covers

T1 = ((b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16, b"k" * 32), b"1")
T2 = ((b"other",), b"track")


def obj(g: int, o: int, size: int = 100, status=ObjectStatus.NORMAL) -> CachedObject:
    return CachedObject(g, o, bytes([o % 256]) * size, 0, status)


# --------------------------------------------------------------------------- cache


def test_cache_keeps_objects_by_track_group_object():
    cache = ObjectCache(10_000)
    assert cache.put(T1, 1, obj(0, 0))
    assert cache.put(T2, 2, obj(0, 0, 50))
    assert cache.get(T1, (0, 0)).payload == bytes(100)
    assert len(cache.get(T2, (0, 0)).payload) == 50
    assert cache.get(T1, (0, 1)) is None
    assert cache.bytes == 100 + 50 + 2 * 64


def test_cache_evicts_least_recently_used_within_budget():
    cache = ObjectCache(3 * (100 + 64))
    for o in range(3):
        cache.put(T1, 1, obj(0, o))
    cache.get(T1, (0, 0))  # touch: object 1 is now the oldest
    cache.put(T1, 1, obj(0, 3))
    assert cache.get(T1, (0, 1)) is None
    assert all(cache.get(T1, (0, o)) is not None for o in (0, 2, 3))
    assert cache.bytes <= cache.max_bytes and cache.evictions == 1


def test_cache_refuses_an_object_larger_than_the_budget():
    cache = ObjectCache(1000)
    assert not cache.put(T1, 1, obj(0, 0, 5000))
    assert cache.bytes == 0


def test_cache_never_mixes_two_origins_of_one_track():
    cache = ObjectCache(10_000)
    cache.put(T1, 1, obj(0, 0))
    cache.put(T1, 1, obj(0, 1))
    cache.put(T1, 2, obj(0, 2))  # another publisher's object of the same track
    assert cache.get(T1, (0, 0)) is None and cache.get(T1, (0, 1)) is None
    assert cache.origin_of(T1) == 2
    assert cache.invalidations == 1
    assert cache.bytes == 164


def test_cache_lookup_serves_a_contiguous_range():
    cache = ObjectCache(100_000)
    for o in range(5):
        cache.put(T1, 1, obj(0, o))
    hit = cache.lookup(T1, Location(0, 1), Location(0, 4))  # objects 1..3
    assert [x.object_id for x in hit.objects] == [1, 2, 3] and hit.resume is None
    partial = cache.lookup(T1, Location(0, 3), Location(0, 8))
    assert [x.object_id for x in partial.objects] == [3, 4] and partial.resume == Location(0, 5)
    assert partial.origin == 1
    miss = cache.lookup(T2, Location(0, 0), Location(0, 1))
    assert miss.objects == [] and miss.resume == Location(0, 0)


def test_cache_lookup_of_a_whole_group_needs_its_end():
    cache = ObjectCache(100_000)
    for o in range(3):
        cache.put(T1, 1, obj(4, o))
    unknown = cache.lookup(T1, Location(4, 0), Location(4, 0))
    assert unknown.resume == Location(4, 3)
    cache.note_group_end(T1, 1, 4, 2)
    known = cache.lookup(T1, Location(4, 0), Location(4, 0))
    assert known.resume is None and len(known.objects) == 3
    cache.note_group_end(T1, 9, 5, 0)  # another origin's knowledge is ignored
    assert cache.lookup(T1, Location(5, 0), Location(5, 0)).resume == Location(5, 0)


def test_cache_lookup_stops_at_end_of_group_status():
    cache = ObjectCache(100_000)
    cache.put(T1, 1, obj(0, 0))
    cache.put(T1, 1, obj(0, 1, 0, ObjectStatus.END_OF_GROUP))
    cache.put(T1, 1, obj(1, 0))
    found = cache.lookup(T1, Location(0, 0), Location(1, 1))
    assert found.resume is None
    assert [(x.group_id, x.object_id) for x in found.objects] == [(0, 0), (0, 1), (1, 0)]


# --------------------------------------------------------------------------- routing


def test_routes_match_field_by_field_and_prefer_the_longest():
    table: RouteTable[str] = RouteTable()
    table.add((b"a",), "short")
    table.add((b"a", b"b"), "long")
    assert table.lookup((b"a", b"b", b"c")).owner == "long"
    assert table.lookup((b"a", b"x")).owner == "short"
    assert table.lookup((b"ab",)) is None
    assert covers((b"a",), (b"a", b"b")) and not covers((b"a", b"b"), (b"a",))


def test_routes_prefer_the_newest_of_equals_and_fall_back_on_removal():
    table: RouteTable[str] = RouteTable()
    old = table.add((b"a",), "old")
    new = table.add((b"a",), "new")
    assert table.lookup((b"a", b"t")).owner == "new"
    assert [r.owner for r in table.candidates((b"a", b"t"))] == ["new", "old"]
    table.remove(new)
    assert table.lookup((b"a", b"t")).owner == "old"
    assert table.remove_owner("old") == [old]
    assert table.lookup((b"a",)) is None and len(table) == 0


def test_routes_list_namespaces_under_a_prefix():
    table: RouteTable[int] = RouteTable()
    for ns in [(b"kvsp", b"1"), (b"kvsp", b"2"), (b"x",)]:
        table.add(ns, 0)
    assert sorted(table.under((b"kvsp",))) == [(b"kvsp", b"1"), (b"kvsp", b"2")]
    assert len(table.under(())) == 3


# --------------------------------------------------------------------------- access

SCOPE_A, SCOPE_B = "a" * 32, "b" * 32
HOLDER = "http://127.0.0.1:9000/"


def ns(scope: str, holder: str = HOLDER) -> tuple[bytes, ...]:
    return (b"kvsp", b"c" * 32, scope.encode(), publisher_id(holder).hex().encode())


def policy() -> AccessPolicy:
    return AccessPolicy(Authenticator.from_mapping({"principal": [
        {"name": "a", "token": "tok-a", "scopes": [SCOPE_A], "holders": [HOLDER], "roles": ["holder"]},
        {"name": "reader", "token": "tok-r", "scopes": [SCOPE_A], "roles": ["instance"]},
        {"name": "ops", "token": "tok-all", "scopes": ["*"], "roles": ["admin"]},
    ]}))


def test_open_policy_allows_everything():
    open_policy = AccessPolicy()
    assert open_policy.is_open
    open_policy.check(Action.ANNOUNCE, ns(SCOPE_B), [])
    open_policy.check(Action.SUBSCRIBE, (b"anything",), [])


def test_scope_token_is_confined_to_its_scope():
    p = policy()
    for action in (Action.ANNOUNCE, Action.SUBSCRIBE, Action.FETCH):
        p.check(action, ns(SCOPE_A), [b"tok-a"])
        with pytest.raises(Unauthorized) as e:
            p.check(action, ns(SCOPE_B), [b"tok-a"])
        assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
    p.check(Action.SUBSCRIBE, ns(SCOPE_A) + (b"k" * 32,), [b"Bearer tok-a"])


def test_publishing_needs_a_holder_the_principal_may_publish_for():
    p = policy()
    with pytest.raises(Unauthorized):
        p.check(Action.ANNOUNCE, ns(SCOPE_A, "http://elsewhere:1/"), [b"tok-a"])
    with pytest.raises(Unauthorized):
        p.check(Action.ANNOUNCE, ns(SCOPE_A), [b"tok-r"])  # a reader, not a publisher
    p.check(Action.SUBSCRIBE, ns(SCOPE_A), [b"tok-r"])
    p.check(Action.ANNOUNCE, ns(SCOPE_B, "http://elsewhere:1/"), [b"tok-all"])


def test_missing_unknown_and_spanning_tokens_are_refused():
    p = policy()
    with pytest.raises(Unauthorized):
        p.check(Action.SUBSCRIBE, ns(SCOPE_A), [])
    with pytest.raises(Unauthorized):
        p.check(Action.SUBSCRIBE, ns(SCOPE_A), [b"nope", b"\xff"])
    p.check(Action.SUBSCRIBE, ns(SCOPE_A), [b"nope", b"tok-a"])  # any valid token suffices
    with pytest.raises(Unauthorized):
        p.check(Action.SUBSCRIBE, (b"kvsp", b"c" * 32), [b"tok-a"])  # spans every scope
    with pytest.raises(Unauthorized):
        p.check(Action.FETCH, (b"other", b"ns"), [b"tok-a"])
    p.check(Action.FETCH, (b"other", b"ns"), [b"tok-all"])


def test_discovery_is_filtered_by_scope():
    p = policy()
    principals = p.check(Action.DISCOVER, (b"kvsp",), [b"tok-a"])
    assert p.may_see(principals, ns(SCOPE_A))
    assert not p.may_see(principals, ns(SCOPE_B))
    assert not p.may_see(principals, (b"other",))


def test_a_namespace_without_publisher_id_counts_as_any_publisher():
    """("kvsp", compat, scope) would draw the requests for every publisher of the scope: only a
    principal that may publish for any holder, or an admin, may announce or publish in it."""
    p = AccessPolicy(Authenticator.from_mapping({"principal": [
        {"name": "a", "token": "tok-a", "scopes": [SCOPE_A], "holders": [HOLDER], "roles": ["holder"]},
        {"name": "relay", "token": "tok-relay", "scopes": [SCOPE_A], "roles": ["relay"]},
        {"name": "any", "token": "tok-any", "scopes": [SCOPE_A], "holders": ["*"], "roles": ["holder"]},
        {"name": "ops", "token": "tok-all", "scopes": ["*"], "roles": ["admin"]},
    ]}))
    short = ns(SCOPE_A)[:3]
    for action in (Action.ANNOUNCE, Action.PUBLISH):
        for token in (b"tok-a", b"tok-relay"):
            with pytest.raises(Unauthorized, match="no publisher_id") as e:
                p.check(action, short, [token])
            assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
        p.check(action, short, [b"tok-any"])
        p.check(action, short, [b"tok-all"])
    p.check(Action.ANNOUNCE, ns(SCOPE_A), [b"tok-a"])  # its own publisher_id still works
    p.check(Action.SUBSCRIBE, short, [b"tok-relay"])  # reading a scope needs no publisher_id
