"""Endpoints: `connect()` opens a client session, `serve()` accepts sessions.

A server offers ALPN ``moqt-18`` (draft-18 section 3.1.2) and, unless
`QuicSettings.draft14_fallback` is off, ``moq-00`` after it (draft-14, whose ALPN names
no version); it picks the first of its own list that the client offers, so draft-18
stays preferred. A client offers ``moqt-18`` only, unless `connect(drafts=...)` says
otherwise: a client of ours must not be moved to the weaker draft just because a
server lists it first. Both take the QUIC engine and datagram size from `QuicSettings`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

from ...tasks import TaskSet
from ..certs import SelfSignedCertificate
from ..d18.messages import Setup
from .connection import Handler, MoqtConnection
from .core import token_parameters
from .settings import QuicSettings, check_drafts, check_engine, engine_module

__all__ = ["MoqtServer", "connect", "serve"]


def _udp_socket(family: int, bind_host: str, settings: QuicSettings, port: int = 0) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, settings.socket_receive_buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.socket_send_buffer)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if bind_host == "::" else 1)
        sock.bind((bind_host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _local_bind_address(family: int, remote_host: str) -> str:
    """Loopback for a loopback peer, the family's wildcard otherwise."""
    try:
        if ipaddress.ip_address(remote_host).is_loopback:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
    except ValueError:
        pass
    return "0.0.0.0" if family == socket.AF_INET else "::"


def _ssl_verify_settings(verify: bool, cadata: bytes | None, cafile: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if not verify:
        kwargs["verify_mode"] = ssl.CERT_NONE
    if cadata is not None:
        kwargs["cadata"] = cadata
    if cafile is not None:
        kwargs["cafile"] = cafile
    return kwargs


async def connect(
    url: str,
    *,
    settings: QuicSettings | None = None,
    verify: bool = True,
    cadata: bytes | None = None,
    cafile: str | None = None,
    server_name: str | None = None,
    authorization: Any = None,
    handlers: Mapping[str, Handler] | None = None,
    implementation: str | None = None,
    timeout: float | None = None,
    drafts: Iterable[int] | None = None,
) -> MoqtConnection:
    """Open a MOQT session to ``moqt://host[:port][/path][?query]`` over raw QUIC.

    `drafts` are the MOQT drafts offered, most preferred first: draft-18 only by
    default; ``(18, 14)`` falls back to draft-14 (ALPN "moq-00") with a server
    that lacks draft-18, ``(14,)`` offers only "moq-00". The server's choice is
    `MoqtConnection.draft`.

    The socket is bound to the loopback address for a loopback peer (the engines' own
    connect() binds every interface). PATH and AUTHORITY Setup Options come from the
    URL (section 9.3); `authorization` tokens go in SETUP. Returns once the peer's
    SETUP arrived.
    """
    settings = settings or QuicSettings()
    engine = engine_module(check_engine(settings.engine))
    offered = check_drafts(settings.default_drafts(is_client=True) if drafts is None else drafts)
    parts = urlsplit(url)
    if parts.scheme != "moqt":
        raise ValueError(f"not a moqt:// URL: {url!r}")
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    host = parts.hostname
    port = parts.port or 443
    path = parts.path or ""
    if parts.query:
        path += "?" + parts.query
    setup = Setup(
        path=path,
        authority=parts.netloc.rsplit("@", 1)[-1],
        authorization_tokens=token_parameters(authorization),
        implementation=implementation,
    )
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, address = infos[0]
    remote_host = str(address[0])  # an IPv4 or IPv6 address: the family is AF_INET or AF_INET6
    configuration = settings.quic_configuration(
        is_client=True, drafts=offered, host=remote_host, server_name=server_name or host,
        **_ssl_verify_settings(verify, cadata, cafile),
    )
    quic = engine.client_connection(configuration, settings)
    sock = _udp_socket(family, _local_bind_address(family, remote_host), settings)
    try:
        _, protocol = await engine.create_endpoint(
            loop,
            lambda: MoqtConnection(quic, settings=settings, setup=setup, handlers=handlers, drafts=offered,
                                   owns_transport=True),
            sock,
        )
    except BaseException:
        sock.close()
        raise
    connection: MoqtConnection = protocol
    connection.connect(address)
    try:
        limit = settings.handshake_timeout if timeout is None else timeout
        await asyncio.wait_for(connection.wait_ready(), limit)
    except BaseException:
        connection.close()
        if connection._transport is not None:
            connection._transport.close()
        raise
    return connection


class MoqtServer:
    """A listening MOQT server; `connections` are the live sessions."""

    def __init__(self, quic_server: Any, transport: asyncio.DatagramTransport, host: str, port: int):
        self._quic_server = quic_server
        self._transport = transport
        self.host = host
        self.port = port
        self.connections: set[MoqtConnection] = set()
        self._watchers = TaskSet()  # each forgets a connection once closed

    def _watch(self, connection: MoqtConnection) -> None:
        self._watchers.spawn(_forget_when_closed(self, connection), loop=connection.loop)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"moqt://{host}:{self.port}"

    def close(self) -> None:
        for connection in list(self.connections):
            connection.close()
        self._watchers.cancel()
        self._quic_server.close()

    async def aclose(self, timeout: float = 2.0) -> None:
        connections = list(self.connections)
        for connection in connections:
            connection.close()
        if connections:
            await asyncio.wait([asyncio.ensure_future(c.wait_closed()) for c in connections], timeout=timeout)
        for connection in connections:
            connection.cancel_tasks()
        self._watchers.cancel()
        self._quic_server.close()

    async def __aenter__(self) -> "MoqtServer":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


async def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    certificate: SelfSignedCertificate | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    settings: QuicSettings | None = None,
    handlers: Mapping[str, Handler] | None = None,
    on_connection: Callable[[MoqtConnection], None] | None = None,
    accept_path: Iterable[str] | None = None,
    max_auth_token_cache_size: int = 0,
    drafts: Iterable[int] | None = None,
) -> MoqtServer:
    """Listen for MOQT sessions on `host`:`port` (loopback and an ephemeral port by
    default). `handlers` apply to every connection; `on_connection` is called once a
    connection's session exists, to set per-connection handlers. `drafts` are the
    drafts accepted, most preferred first (default: 18, then 14 unless
    `settings.draft14_fallback` is off); `MoqtConnection.draft` is each one's."""
    settings = settings or QuicSettings()
    engine = engine_module(check_engine(settings.engine))
    accepted = check_drafts(settings.default_drafts(is_client=False) if drafts is None else drafts)
    configuration = settings.quic_configuration(is_client=False, drafts=accepted, host=host)
    if certificate is None and certfile is None:
        raise ValueError("a server needs a certificate")
    engine.load_certificate(configuration, certificate, certfile, keyfile)
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = _udp_socket(family, host, settings, port)
    server_ref: list[MoqtServer] = []

    def on_session(connection: MoqtConnection) -> None:
        server = server_ref[0]
        server.connections.add(connection)
        server._watch(connection)
        if on_connection is not None:
            on_connection(connection)

    def create_protocol(quic: Any, stream_handler: Any = None) -> MoqtConnection:
        return MoqtConnection(
            engine.wrap(quic, settings),
            settings=settings,
            handlers=handlers,
            accept_path=accept_path,
            max_auth_token_cache_size=max_auth_token_cache_size,
            on_session=on_session,
            drafts=accepted,
        )

    try:
        transport, protocol = await engine.create_endpoint(
            loop, lambda: engine.QuicServer(configuration=configuration, create_protocol=create_protocol), sock
        )
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()
    server = MoqtServer(protocol, transport, bound[0], bound[1])
    server_ref.append(server)
    return server


async def _forget_when_closed(server: MoqtServer, connection: MoqtConnection) -> None:
    await connection.wait_closed()
    server.connections.discard(connection)
