"""Which scopes a holder serves (`kvsp_moq.holder.tenancy`), and what its quotas become."""

from __future__ import annotations

import httpx
import pytest

from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import SettingError
from kvsp_moq.holder.tenancy import Tenancy, resolve
from tests.holder.conftest import OTHER_SCOPE, SCOPE, make_block

THIRD = "12" * 16
AUTH = Authenticator.from_mapping({"principal": [
    {"name": "holder-a", "token": "tok-holder", "scopes": [SCOPE], "roles": ["holder"]},
    {"name": "writer-b", "token": "tok-b", "scopes": [OTHER_SCOPE], "roles": ["instance"]},
    {"name": "client-c", "token": "tok-c", "scopes": [THIRD], "roles": ["client"]},
]})
PUT = {"If-None-Match": "*"}


def test_the_holder_serves_its_own_principals_scopes() -> None:
    t = resolve(AUTH, "tok-holder")
    assert t.scopes == {SCOPE} and t.serves(SCOPE.upper()) and not t.serves(OTHER_SCOPE)
    assert "holder-a" in t.source


def test_a_configured_list_wins_and_is_checked() -> None:
    t = resolve(AUTH, "tok-holder", [OTHER_SCOPE.upper(), THIRD])
    assert t.scopes == {OTHER_SCOPE, THIRD} and t.source == "--serve-scope"
    with pytest.raises(SettingError, match="32 hex digits"):
        resolve(AUTH, None, ["tenant-a"])


def test_open_holders_serve_every_scope_and_unknown_tokens_are_refused() -> None:
    assert resolve(Authenticator.open(), None).serves_any
    assert resolve(Authenticator.open(), "anything").serves_any
    with pytest.raises(SettingError, match="not one of its principals"):
        resolve(AUTH, "tok-unknown")


def test_without_a_token_the_principals_that_store_blocks_are_served() -> None:
    t = resolve(AUTH, None)
    assert t.scopes == {SCOPE, OTHER_SCOPE}  # client-c may not store blocks


def test_quotas_are_an_equal_share_among_several_scopes() -> None:
    assert Tenancy.any().quota(1000, None) is None
    assert Tenancy(frozenset({SCOPE}), "x").quota(1000, None) is None
    assert Tenancy(frozenset({SCOPE, OTHER_SCOPE}), "x").quota(1000, None) == 500
    assert Tenancy(frozenset({SCOPE, OTHER_SCOPE}), "x").quota(1000, 300) == 300


def test_a_foreign_scope_is_refused_before_the_body(start_holder) -> None:
    holder = start_holder(auth=AUTH, index_token="tok-holder")
    mine, theirs = make_block(1), make_block(2, scope=OTHER_SCOPE)
    writer = {"Authorization": "Bearer tok-b"}
    with httpx.Client(base_url=holder.url, trust_env=False, timeout=10) as c:
        r = c.put(theirs.path, content=theirs.data, headers=PUT | writer)
        assert r.status_code == 403 and r.json()["type"].endswith("kvsp-forbidden-scope")
        assert "does not store blocks of this scope" in r.json()["detail"]
        assert theirs.bid not in holder.store
        # The holder's own principal stores in its scope as before.
        own = {"Authorization": "Bearer tok-holder"}
        assert c.put(mine.path, content=mine.data, headers=PUT | own).status_code == 201
    assert holder.app.state.api.tenancy.scopes == {SCOPE}


def test_api_resolve_tenancy_sets_quotas_and_lease_shares(start_holder) -> None:
    holder = start_holder(host_bytes=1000, serve_scopes=(SCOPE, OTHER_SCOPE))
    api = holder.app.state.api
    assert api.quota_of(SCOPE) == 500 and holder.store.scope_quota(SCOPE) == 500
    assert holder.leases.scope_limit(SCOPE) == 500
    api.resolve_tenancy(AUTH, "tok-holder")
    assert api.quota_of(SCOPE) is None and api.lease_share(SCOPE) == 1000
