"""What every server checks about where it listens, before it binds (DESIGN §3).

Two rules, shared by `kvsp index`, `kvsp holder`, `kvsp relay` and `kvsp agent`:

* A server without a principals file (and an agent using the open scope, whose key is public)
  runs only on a loopback address (127.0.0.0/8, ::1, localhost). Anywhere else, 0.0.0.0 and ::
  included, it refuses to start unless given `--insecure-open`, and then it warns loudly.
* A server never advertises an address nobody can reach: one that listens on 0.0.0.0 or ::
  and puts its URL in records (or prints it for clients) needs `--public-url`, and a
  `--public-url` whose host is 0.0.0.0 or :: is refused.

Refusals are SettingErrors: one line on stderr and exit status 2.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from kvsp_moq.errors import SettingError
from kvsp_moq.protocol.urls import base_url

__all__ = ["AGENT_INSECURE_OPEN_HELP", "INSECURE_OPEN_HELP", "cannot_listen", "check_advertised",
           "check_exposure", "is_loopback", "is_unspecified", "listening", "normalize_public_url"]

#: The help of `--insecure-open` on the index, holder and relay.
INSECURE_OPEN_HELP = ("run without authentication on a non-loopback address: no principals file, "
                      "so anyone who can reach the address may read and write; logged as a "
                      "warning at start. Without it such a server refuses to start")
#: The help of `--insecure-open` on an agent, which alone has an open scope.
AGENT_INSECURE_OPEN_HELP = ("run on a non-loopback address without a principals file, or with the "
                            "open scope (no --scope-keys; its key is public), so anyone who can "
                            "reach the address may read and write, or compute the scope's block "
                            "keys; logged as a warning at start. Without it such an agent refuses "
                            "to start")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or `localhost` (any other name counts as remote;
    0.0.0.0 and :: are every interface, not loopback)."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """Whether `host` is an unspecified ("any") address: 0.0.0.0, :: or empty."""
    host = host.strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def check_exposure(service: str, host: str, *, authenticated: bool, open_scope: bool = False,
                   insecure_open: bool = False) -> list[str]:
    """Refuse (SettingError) to serve unauthenticated, or an agent's public open scope, on a
    non-loopback `host` unless `insecure_open`; returns the warnings to log at start (empty
    when nothing is open, or when it is open on loopback only)."""
    what, fixes = [], []
    if not authenticated:
        what.append("open (without --principals)")
        fixes.append("--principals FILE")
    if open_scope:
        what.append("with the open scope (no --scope-keys; its key is public)")
        fixes.append("--scope-keys FILE")
    if not what or is_loopback(host):
        return []
    shown = _shown(host)
    if not insecure_open:
        raise SettingError(f"refusing to run {' and '.join(what)} on {shown}: give "
                           f"{' and '.join(fixes)}, listen on 127.0.0.1, or pass --insecure-open")
    warnings = []
    if not authenticated:
        warnings.append(f"INSECURE: {service} serves {shown} WITHOUT AUTHENTICATION "
                        "(--insecure-open): anyone who can reach it may read and write")
    if open_scope:
        warnings.append(f"INSECURE: {service} uses the open scope on {shown} (--insecure-open): "
                        "its key is public, so anyone may compute its block keys")
    return warnings


def normalize_public_url(url: str | None, schemes: tuple[str, ...] = ("http", "https"),
                         *, option: str = "--public-url") -> str | None:
    """`url` checked (a scheme of `schemes`, a host that is not 0.0.0.0 or ::) and ending in
    "/" for http(s); SettingError otherwise."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # raises ValueError for a bad port
    except ValueError as e:
        raise SettingError(f"{option} {url}: {e}") from None
    if parts.scheme.lower() not in schemes or not parts.hostname:
        raise SettingError(f"{option} must be a {' or '.join(s + '://' for s in schemes)}HOST:PORT "
                           f"URL, not {url!r}")
    if is_unspecified(parts.hostname):
        raise SettingError(f"{option} {url} names {parts.hostname}: others cannot reach "
                           f"{parts.hostname}; give the address or name they use")
    if parts.scheme.lower() in ("http", "https"):
        url = base_url(url)
    return url


def check_advertised(host: str, public_url: str | None) -> None:
    """Refuse (SettingError) to advertise an unspecified listen address: listening on 0.0.0.0
    or :: needs `--public-url`."""
    if is_unspecified(host) and not public_url:
        shown = _shown(host)
        raise SettingError(f"listening on {shown} needs --public-url: others cannot reach {shown}")


def _shown(host: str) -> str:
    host = host.strip("[]") or "0.0.0.0"
    return f"[{host}]" if ":" in host else host


def cannot_listen(host: str, port: int, error: OSError) -> SettingError:
    """The one line for an address a server cannot bind ("... address already in use"): a
    setting to change, not a traceback."""
    reason = (error.strerror or str(error) or type(error).__name__).rstrip(".")
    return SettingError(f"cannot listen on {_shown(host)}:{port}: {reason[:1].lower()}{reason[1:]}",
                        member="listen")


def listening(host: str, port: int) -> socket.socket:
    """The listening TCP socket of a server, bound before anything slow (a model) is loaded, so
    that a port in use is said at once; SettingError (exit status 2) when it cannot be bound."""
    from kvsp_moq.web import bind_tcp  # the web stack only for HTTP servers

    try:
        return bind_tcp(host, port)
    except OSError as e:
        raise cannot_listen(host, port, e) from None
