"""The peer's token cache as an object of its own (section 9.3.3-9.3.4)."""

from __future__ import annotations

import pytest

from kvsp_moq.moqt.errors import (
    AuthTokenCacheOverflow,
    DuplicateAuthTokenAlias,
    ProtocolViolation,
    UnknownAuthTokenAlias,
)
from kvsp_moq.moqt.session.tokens import TOKEN_ENTRY_OVERHEAD, PeerTokens
from kvsp_moq.moqt.wire import AuthToken


def test_a_registered_token_is_used_by_alias_until_deleted() -> None:
    tokens = PeerTokens(max_size=TOKEN_ENTRY_OVERHEAD + 6)
    assert tokens.resolve((AuthToken.register(5, b"secret"),)) == (AuthToken.use_value(b"secret"),)
    assert tokens.resolve((AuthToken.use_alias(5),)) == (AuthToken.use_value(b"secret"),)
    with pytest.raises(DuplicateAuthTokenAlias):
        tokens.resolve((AuthToken.register(5, b"other"),))
    assert tokens.resolve((AuthToken.delete(5),)) == ()
    with pytest.raises(UnknownAuthTokenAlias):
        tokens.resolve((AuthToken.use_alias(5),))
    # The deletion gave the bytes back: the cache takes a token of the same size again.
    assert tokens.resolve((AuthToken.register(6, b"again!"),)) == (AuthToken.use_value(b"again!"),)


def test_a_request_registration_over_the_cache_size_is_an_overflow() -> None:
    tokens = PeerTokens(max_size=TOKEN_ENTRY_OVERHEAD + 5)
    with pytest.raises(AuthTokenCacheOverflow):
        tokens.resolve((AuthToken.register(1, b"secret"),))


def test_a_setup_registration_over_the_cache_size_is_not_kept() -> None:
    tokens = PeerTokens(max_size=0)
    tokens.register_setup((AuthToken.register(1, b"x"),))  # section 9.3.4: used as USE_VALUE
    with pytest.raises(UnknownAuthTokenAlias):
        tokens.resolve((AuthToken.use_alias(1),))
    with pytest.raises(ProtocolViolation):
        tokens.register_setup((AuthToken.use_alias(1),))
