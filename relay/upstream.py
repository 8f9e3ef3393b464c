"""The session to the upstream relay (`UpstreamLink`), for a relay configured with one.

What no local publisher announced is asked of the upstream relay (a chain of relays). The
relay keeps one session there while it runs, connecting again with a growing backoff when
it ends or cannot be opened; on each new session the local namespaces are announced there
again. Upstream this relay is authorized as itself, by the token of its SETUP there
(`upstream_token`, a principal with the relay role).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from kvsp_moq.errors import reason_of
from kvsp_moq.moqt.certs import ClientTls, untrusted_certificate
from kvsp_moq.moqt.quic import connect

from .host import RelayHost
from .peers import Peer

__all__ = ["Handlers", "UpstreamLink"]

log = logging.getLogger("kvsp.relay")

Handlers = dict[str, Callable[[Any], Awaitable[None]]]
"""A session's request handlers, by kind of request (`MoqtConnection.set_handler`)."""


class UpstreamLink:
    """Keeps a session to the upstream relay while the relay runs (`run`).

    `new_peer` makes the `Peer` of each attempt and `handlers` its request handlers;
    `connected` is called with it once its session is up, and `lost` once it has ended.
    """

    def __init__(self, host: RelayHost, *, new_peer: Callable[[], Peer], handlers: Callable[[Peer], Handlers],
                 connected: Callable[[Peer], None], lost: Callable[[], None]) -> None:
        self.host = host
        #: the session while it is up
        self.peer: Peer | None = None
        #: set while the session is up
        self.ready = asyncio.Event()
        self._new_peer = new_peer
        self._handlers = handlers
        self._connected = connected
        self._lost = lost

    async def run(self) -> None:
        """Keep a session to the upstream relay, re-announcing local namespaces on each."""
        s = self.host.settings
        assert s.upstream is not None
        backoff = s.upstream_retry_initial
        untrusted_said = False
        tls = s.upstream_tls or ClientTls(s.upstream_verify, s.upstream_cafile, peer="upstream relay",
                                          ca_option="--upstream-ca", insecure_option="--upstream-insecure")
        while not self.host.closed:
            peer = self._new_peer()
            try:
                connection = await connect(
                    s.upstream, settings=s.quic, verify=s.upstream_verify, cadata=s.upstream_cadata,
                    cafile=s.upstream_cafile, authorization=s.upstream_token, handlers=self._handlers(peer),
                    timeout=s.upstream_timeout)
            except Exception as e:  # any failure to connect: try again later
                line = untrusted_certificate(e, s.upstream, tls)
                if line is None:
                    log.info("upstream relay %s unreachable (%s); retrying in %.1fs", s.upstream, reason_of(e),
                             backoff)
                elif not untrusted_said:  # said once; the upstream may get another certificate
                    untrusted_said = True
                    log.error("%s", line)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, s.upstream_retry_max)
                continue
            backoff = s.upstream_retry_initial
            untrusted_said = False
            peer.connection = connection
            self.peer = peer
            self.ready.set()
            log.info("connected to upstream relay %s", s.upstream)
            self._connected(peer)
            try:
                await connection.wait_closed()
            finally:
                self.ready.clear()
                self.peer = None
                self._lost()
            log.info("session to upstream relay %s ended", s.upstream)
