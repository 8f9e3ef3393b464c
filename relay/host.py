"""What the parts of a relay use of the relay that holds them (`RelayHost`).

The parts (namespaces.py, subscriptions.py, feed.py, downstream.py, fetch.py, upstream.py)
each take the `Relay` as a `RelayHost` and use nothing else of it: its configuration, its
counters, its access policy and object cache, the task set it cancels when it closes, and
the routing of a request to a session.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Protocol

from .access import AccessPolicy
from .cache import ObjectCache
from .peers import Peer
from .settings import RelaySettings, RelayStats

__all__ = ["RelayHost"]


class RelayHost(Protocol):
    """The relay as its parts see it."""

    settings: RelaySettings
    stats: RelayStats
    policy: AccessPolicy
    cache: ObjectCache

    @property
    def closed(self) -> bool:
        """Whether the relay is closing (or closed)."""
        ...

    @property
    def upstream_peer(self) -> Peer | None:
        """The session to the upstream relay while it is up."""
        ...

    @property
    def upstream_ready(self) -> asyncio.Event | None:
        """Set while the session to the upstream relay is up; None without an upstream relay
        (or before the relay starts)."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        """Run `coro` as a task of the relay's, cancelled when the relay closes."""
        ...

    def notify(self) -> None:
        """Wake requests waiting for a publisher (rendezvous)."""
        ...

    def route(self, namespace: tuple[bytes, ...], requester: Peer) -> Peer | None:
        """The session to ask for a track: the longest announced prefix, else upstream."""
        ...
