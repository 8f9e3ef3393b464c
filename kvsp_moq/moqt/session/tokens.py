"""The peer's authorization tokens (section 10.2.2): registrations from its SETUP and its
requests, kept up to the cache size this endpoint advertised, and every token resolved
to its USE_VALUE form. Ours are not tracked."""

from __future__ import annotations

from ..errors import AuthTokenCacheOverflow, DuplicateAuthTokenAlias, ProtocolViolation, UnknownAuthTokenAlias
from ..wire import AliasType, AuthToken

__all__ = ["TOKEN_ENTRY_OVERHEAD", "PeerTokens"]

TOKEN_ENTRY_OVERHEAD = 16  # section 9.3.3: 16 bytes + the Token Value


class PeerTokens:
    """The peer's registered tokens, up to `max_size` bytes (the MAX_AUTH_TOKEN_CACHE_SIZE
    this endpoint advertised), counted as section 9.3.3 does."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._tokens: dict[int, AuthToken] = {}
        self._bytes = 0

    def register_setup(self, tokens: tuple[AuthToken, ...]) -> None:
        """The tokens of the peer's SETUP: only USE_VALUE and REGISTER are allowed there."""
        for token in tokens:
            if token.alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                raise ProtocolViolation(f"{token.alias_type.name} token in SETUP")
            if token.alias_type == AliasType.REGISTER:
                # Section 9.3.4: a registration over the limit is used as USE_VALUE.
                size = TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                alias = _alias(token)
                if alias in self._tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {alias} already registered")
                if self._bytes + size <= self.max_size:
                    self._tokens[alias] = token
                    self._bytes += size

    def resolve(self, tokens: tuple[AuthToken, ...]) -> tuple[AuthToken, ...]:
        """Apply the peer's alias operations; return the tokens in USE_VALUE form."""
        resolved: list[AuthToken] = []
        for token in tokens:
            if token.alias_type == AliasType.USE_VALUE:
                resolved.append(token)
            elif token.alias_type == AliasType.REGISTER:
                alias = _alias(token)
                if alias in self._tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {alias} already registered")
                size = TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                if self._bytes + size > self.max_size:
                    raise AuthTokenCacheOverflow("authorization token cache full")
                self._tokens[alias] = token
                self._bytes += size
                resolved.append(AuthToken.use_value(token.value or b"", token.token_type or 0))
            elif token.alias_type == AliasType.USE_ALIAS:
                registered = self._tokens.get(_alias(token))
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                resolved.append(AuthToken.use_value(registered.value or b"", registered.token_type or 0))
            else:  # DELETE
                registered = self._tokens.pop(_alias(token), None)
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                self._bytes -= TOKEN_ENTRY_OVERHEAD + len(registered.value or b"")
        return tuple(resolved)


def _alias(token: AuthToken) -> int:
    """The alias of a REGISTER, USE_ALIAS or DELETE token, which `AuthToken.decode` always
    reads (the peer's tokens are decoded ones)."""
    if token.alias is None:
        raise ProtocolViolation(f"{token.alias_type.name} token without an alias")
    return token.alias
