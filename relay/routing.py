"""Which publisher a relay asks for a track (draft-18 "Publisher Interactions").

Namespaces are matched field by field: a PUBLISH_NAMESPACE of (a, b) covers (a, b) and
(a, b, c), never (ab). Among the publishers whose namespace covers a track, the one with the
longest namespace is chosen, and among equals the most recent, since a publisher that just
(re)announced is the one most likely alive. The draft lets a relay send SUBSCRIBE to every
matching publisher; one upstream per track keeps the cache single-origin (see cache.py).

Sans-I/O: owners are opaque values compared by identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

from kvsp_moq.moqt.wire import TrackNamespace

T = TypeVar("T")


def covers(prefix: TrackNamespace, namespace: TrackNamespace) -> bool:
    """Whether `prefix` matches `namespace` field by field (equal counts as a match)."""
    return len(prefix) <= len(namespace) and namespace[: len(prefix)] == prefix


@dataclass(frozen=True)
class Route(Generic[T]):
    namespace: TrackNamespace
    owner: T
    serial: int


class RouteTable(Generic[T]):
    """Announced namespaces and who announced them."""

    def __init__(self) -> None:
        self._routes: dict[TrackNamespace, list[Route[T]]] = {}
        self._serial = 0

    def add(self, namespace: TrackNamespace, owner: T) -> Route[T]:
        self._serial += 1
        route = Route(tuple(namespace), owner, self._serial)
        self._routes.setdefault(route.namespace, []).append(route)
        return route

    def remove(self, route: Route[T]) -> bool:
        routes = self._routes.get(route.namespace)
        if not routes or route not in routes:
            return False
        routes.remove(route)
        if not routes:
            del self._routes[route.namespace]
        return True

    def remove_owner(self, owner: T) -> list[Route[T]]:
        """Drop every route of one owner (its session ended); returns them."""
        gone = []
        for namespace in list(self._routes):
            for route in list(self._routes[namespace]):
                if route.owner is owner:
                    self.remove(route)
                    gone.append(route)
        return gone

    def lookup(self, namespace: TrackNamespace, *, exclude: T | None = None) -> Route[T] | None:
        """The route for a track's namespace: longest covering namespace, newest first."""
        namespace = tuple(namespace)
        for length in range(len(namespace), -1, -1):
            routes = self._routes.get(namespace[:length])
            if routes:
                for route in reversed(routes):
                    if exclude is None or route.owner is not exclude:
                        return route
        return None

    def candidates(self, namespace: TrackNamespace) -> Iterator[Route[T]]:
        """Every route covering a namespace, in order of preference."""
        namespace = tuple(namespace)
        for length in range(len(namespace), -1, -1):
            yield from reversed(list(self._routes.get(namespace[:length], ())))

    def under(self, prefix: TrackNamespace) -> list[TrackNamespace]:
        """Announced namespaces that `prefix` covers (for SUBSCRIBE_NAMESPACE)."""
        return [ns for ns in self._routes if covers(prefix, ns)]

    def is_announced(self, namespace: TrackNamespace) -> bool:
        return tuple(namespace) in self._routes

    def __iter__(self) -> Iterator[Route[T]]:
        for routes in list(self._routes.values()):
            yield from list(routes)

    def __len__(self) -> int:
        return sum(len(r) for r in self._routes.values())
