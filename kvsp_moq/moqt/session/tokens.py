"""The peer's authorization tokens (section 10.2.2): registrations from its SETUP and its
requests, kept up to the cache size this endpoint advertised, and every token resolved
to its USE_VALUE form. Ours are not tracked."""

from __future__ import annotations

from ..errors import AuthTokenCacheOverflow, DuplicateAuthTokenAlias, ProtocolViolation, UnknownAuthTokenAlias
from ..wire import AliasType, AuthToken
from .core import SessionCore
from .records import RequestT

__all__ = ["TOKEN_ENTRY_OVERHEAD", "AuthTokenCache"]

TOKEN_ENTRY_OVERHEAD = 16  # section 9.3.3: 16 bytes + the Token Value


class AuthTokenCache(SessionCore[RequestT]):
    """Registering and resolving the peer's tokens (state: `_peer_tokens`, `_peer_token_bytes`)."""

    def _register_setup_tokens(self, tokens: tuple[AuthToken, ...]) -> None:
        for token in tokens:
            if token.alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                raise ProtocolViolation(f"{token.alias_type.name} token in SETUP")
            if token.alias_type == AliasType.REGISTER:
                # Section 9.3.4: a registration over the limit is used as USE_VALUE.
                size = TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                alias = _alias(token)
                if alias in self._peer_tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {alias} already registered")
                if self._peer_token_bytes + size <= self._max_auth_token_cache_size:
                    self._peer_tokens[alias] = token
                    self._peer_token_bytes += size

    def _resolve_tokens(self, tokens: tuple[AuthToken, ...]) -> tuple[AuthToken, ...]:
        """Apply the peer's alias operations; return the tokens in USE_VALUE form."""
        resolved: list[AuthToken] = []
        for token in tokens:
            if token.alias_type == AliasType.USE_VALUE:
                resolved.append(token)
            elif token.alias_type == AliasType.REGISTER:
                alias = _alias(token)
                if alias in self._peer_tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {alias} already registered")
                size = TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                if self._peer_token_bytes + size > self._max_auth_token_cache_size:
                    raise AuthTokenCacheOverflow("authorization token cache full")
                self._peer_tokens[alias] = token
                self._peer_token_bytes += size
                resolved.append(AuthToken.use_value(token.value or b"", token.token_type or 0))
            elif token.alias_type == AliasType.USE_ALIAS:
                registered = self._peer_tokens.get(_alias(token))
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                resolved.append(AuthToken.use_value(registered.value or b"", registered.token_type or 0))
            else:  # DELETE
                registered = self._peer_tokens.pop(_alias(token), None)
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                self._peer_token_bytes -= TOKEN_ENTRY_OVERHEAD + len(registered.value or b"")
        return tuple(resolved)


def _alias(token: AuthToken) -> int:
    """The alias of a REGISTER, USE_ALIAS or DELETE token, which `AuthToken.decode` always
    reads (the peer's tokens are decoded ones)."""
    if token.alias is None:
        raise ProtocolViolation(f"{token.alias_type.name} token without an alias")
    return token.alias
