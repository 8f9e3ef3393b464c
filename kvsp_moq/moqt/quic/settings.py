"""Settings of a MOQT endpoint over QUIC: the engine, datagram sizes, windows, buffers, drafts."""

from __future__ import annotations

import asyncio
import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Coroutine, Iterable, TypeVar

from ...errors import SettingError
from ...serving import is_loopback  # re-exported: where MOQT settings look it up
from ..drafts import SUPPORTED_DRAFTS, alpn_of, check_drafts  # re-exported

T = TypeVar("T")

KiB = 1024
MiB = 1024 * 1024

#: QUIC engines, by the name `--quic-engine` and KVSP_QUIC_ENGINE take: the module of each
#: one's adapter and the package it needs.
ENGINES: dict[str, tuple[str, str]] = {
    "aioquic": ("kvsp_moq.moqt.quic.aioquic_engine", "aioquic"),
    "qh3": ("kvsp_moq.moqt.quic.qh3_engine", "qh3"),
}
#: Sets the default engine of every MOQT endpoint of a process.
ENGINE_ENV = "KVSP_QUIC_ENGINE"
#: The engine used when nothing says otherwise, chosen by measurement (README, "QUIC engines"):
#: qh3 moves blocks through a relay 1.3x (loopback) to 9x (1,452-byte datagrams) faster.
DEFAULT_ENGINE = "qh3"

#: Sets the default max_datagram_size of every MOQT endpoint of a process (relay, holder,
#: agent, tools). Across machines, the path's UDP payload size (1,472 for a 1,500-byte MTU
#: over IPv4, 1,452 over IPv6) avoids IP fragmentation.
DATAGRAM_SIZE_ENV = "KVSP_MOQT_DATAGRAM_SIZE"
#: The datagram size towards a peer that is not on loopback: a 1,500-byte MTU over IPv6.
PATH_DATAGRAM_SIZE = 1452
#: The largest UDP payload a 65,536-byte loopback MTU carries comfortably (65,507 bytes
#: over IPv4, 65,488 over IPv6): fewer, larger packets cost the engines far less CPU.
LOOPBACK_DATAGRAM_SIZE = 60000
#: Both engines send an ACK 1 ms after the packet that asked for it: advertising less would be a lie.
MIN_MAX_ACK_DELAY = 0.001


def check_engine(name: str) -> str:
    """The engine's name when it is known and installed; SettingError (one line) otherwise."""
    if name not in ENGINES:
        raise SettingError(f"unknown QUIC engine {name!r}; choose one of: {', '.join(ENGINES)}")
    engine_module(name)
    return name


def engine_module(name: str) -> ModuleType:
    """The adapter module of an engine, imported on first use (an engine not installed is
    a SettingError naming the package, not an ImportError deep in a connection)."""
    module_name, package = ENGINES[name]
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == package:
            raise SettingError(f"QUIC engine {name!r} needs the {package!r} package, which is not installed") from None
        raise


def default_engine() -> str:
    """KVSP_QUIC_ENGINE when set, else DEFAULT_ENGINE."""
    text = os.environ.get(ENGINE_ENV, "").strip()
    if not text:
        return DEFAULT_ENGINE
    try:
        return check_engine(text)
    except SettingError as exc:
        raise SettingError(f"{ENGINE_ENV}: {exc}") from None


def check_datagram_size(text: str, what: str = DATAGRAM_SIZE_ENV) -> int:
    """A datagram size in bytes that QUIC can use; SettingError (one line) otherwise."""
    try:
        size = int(text)
    except ValueError:
        raise SettingError(f"{what}={text!r} is not a number of bytes") from None
    if not 1200 <= size <= 65507:
        raise SettingError(f"{what}={size}: QUIC needs at least 1,200 bytes and "
                           f"UDP carries at most 65,507")
    return size


def configured_datagram_size() -> int | None:
    """KVSP_MOQT_DATAGRAM_SIZE when set (checked), else None."""
    text = os.environ.get(DATAGRAM_SIZE_ENV, "").strip()
    return check_datagram_size(text) if text else None


def quic_settings(engine: str | None = None, datagram_size: str | int | None = None,
                  **others: Any) -> "QuicSettings":
    """QuicSettings of a service's options (`--quic-engine`, `--datagram-size`), each
    checked; what is not given keeps its default (KVSP_QUIC_ENGINE and
    KVSP_MOQT_DATAGRAM_SIZE, else the built-in one)."""
    if engine:
        others["engine"] = check_engine(engine)
    if datagram_size is not None:
        others["max_datagram_size"] = check_datagram_size(str(datagram_size), "--datagram-size")
    return QuicSettings(**others)


@dataclass
class QuicSettings:
    """QUIC and buffering settings. The defaults are tuned for large objects over
    loopback (a 16 MiB FETCH of 32 objects between two processes on two cores:
    about 175-195 MB/s median with 32,000-byte datagrams, 115-130 MB/s with 16,384;
    through a relay, 60,000-byte datagrams spend about 30% less CPU than 32,000).

    engine: the QUIC engine, "aioquic" or "qh3" (default: KVSP_QUIC_ENGINE, else
        DEFAULT_ENGINE). Peers need not use the same one.
    max_datagram_size: UDP payload size. None (the default, unless KVSP_MOQT_DATAGRAM_SIZE
        is set) picks it by destination: LOOPBACK_DATAGRAM_SIZE towards a loopback
        address, PATH_DATAGRAM_SIZE (a 1,500-byte MTU) otherwise; a server bound to a
        loopback address counts as one. There is no path MTU discovery: set it for
        jumbo-frame paths (9000). A size the engine cannot send is a SettingError at
        start. A peer's smaller max_udp_payload_size lowers it.
    congestion_control: "cubic" (or "reno").
    max_ack_delay: the longest this endpoint delays an ACK, as it advertises it (RFC 9000
        section 18.2), in seconds. The peer adds it to every probe timeout, the wait before
        a lost last packet of a response (or its lost ACK) is sent again. Both engines
        acknowledge within 1 ms but advertise 25 ms; 5 ms leaves room for a busy event
        loop. Under 5% loss on a sub-millisecond path a relay's FETCH responses came about
        1.6 times faster with 5 ms than with 25.
    max_data / max_stream_data: receive windows (connection / stream). With aioquic,
        credit is granted as the application consumes objects, so these bound what a
        slow subscriber buffers.
    socket_receive_buffer / socket_send_buffer: SO_RCVBUF / SO_SNDBUF of the UDP
        socket; bursts of large datagrams overflow the kernel defaults.
    stream_send_buffer / connection_send_buffer: bytes a writer may leave in the engine
        (aioquic: unacknowledged; qh3: not yet sent) before it waits.
    write_chunk_size: payloads are handed to the engine in pieces of this size.
    max_streams: concurrent streams of each direction the peer may open.
    max_object_size: largest object accepted from the peer.
    joining_fetch_wait: a subscription this endpoint ends before sending any object sends
        its PUBLISH_DONE no sooner than this many seconds after its SUBSCRIBE_OK, and
        after answering the joining FETCHes of it that came meanwhile (waiting at most
        `publish_done_grace` for them): a subscriber that sends its joining FETCH on
        receipt of SUBSCRIBE_OK (moq-rs does) would otherwise see a finished track end
        before its FETCH is answered, and its FETCH refused (drafts 14 and 18).
    use_uvloop: `run()` / `new_event_loop()` use uvloop when it is installed.
    draft14_fallback: a server also accepts draft-14 clients (ALPN "moq-00",
        offered after "moqt-18", so a client offering both gets draft-18). Off,
        a client offering only "moq-00" fails the TLS handshake (no common ALPN).
        Clients choose with `connect(drafts=...)`.
    server_drafts: the drafts a server accepts, in its order of preference (it
        picks the first one the client offers); None: 18, 20, 22, then 14 (see
        `draft14_fallback`).
    client_drafts: the drafts a client offers, most preferred first; None: 18.
    """

    engine: str = field(default_factory=default_engine)
    max_datagram_size: int | None = field(default_factory=configured_datagram_size)
    congestion_control: str = "cubic"
    max_ack_delay: float = 0.005
    max_data: int = 64 * MiB
    max_stream_data: int = 16 * MiB
    socket_receive_buffer: int = 4 * MiB
    socket_send_buffer: int = 4 * MiB
    idle_timeout: float = 30.0
    max_datagram_frame_size: int = 65536
    max_streams: int = 1024
    stream_send_buffer: int = 2 * MiB
    connection_send_buffer: int = 16 * MiB
    write_chunk_size: int = 256 * KiB
    max_object_size: int = 64 * MiB
    handshake_timeout: float = 10.0
    publish_done_grace: float = 2.0
    joining_fetch_wait: float = 0.1
    use_uvloop: bool = True
    draft14_fallback: bool = True
    server_drafts: tuple[int, ...] | None = None
    client_drafts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not MIN_MAX_ACK_DELAY <= self.max_ack_delay < 16.384:
            raise SettingError(f"max_ack_delay {self.max_ack_delay} s: the engines acknowledge after "
                               f"{MIN_MAX_ACK_DELAY * 1000:g} ms, and QUIC allows less than 16.384 s")

    def default_drafts(self, *, is_client: bool) -> tuple[int, ...]:
        """The drafts offered when none are given, most preferred first."""
        if not is_client and self.server_drafts is not None:
            return check_drafts(self.server_drafts)
        if is_client:
            if self.client_drafts is not None:
                return check_drafts(self.client_drafts)
            return (18,)  # what every peer in the field speaks (moq-rs: up to 19)
        if not self.draft14_fallback:
            return tuple(d for d in SUPPORTED_DRAFTS if d != 14)
        return SUPPORTED_DRAFTS

    def datagram_size_for(self, host: str) -> int:
        """The datagram size towards (or, for a server, bound to) `host`; SettingError when
        the engine cannot send it."""
        size = self.max_datagram_size
        if size is None:
            size = LOOPBACK_DATAGRAM_SIZE if is_loopback(host) else PATH_DATAGRAM_SIZE
            size = min(size, engine_module(self.engine).LARGEST_DATAGRAM_SIZE)
        engine_module(self.engine).check_datagram_size(size)
        return size

    def quic_configuration(
        self, *, is_client: bool, drafts: Iterable[int] | None = None, host: str = "127.0.0.1", **kwargs: Any
    ) -> Any:
        """The engine's QUIC configuration, offering the ALPNs of `drafts` (default:
        `default_drafts()`), with the datagram size for `host`."""
        offered = check_drafts(self.default_drafts(is_client=is_client) if drafts is None else drafts)
        return engine_module(check_engine(self.engine)).configuration(
            self,
            is_client=is_client,
            alpn_protocols=[alpn_of(draft) for draft in offered],
            max_datagram_size=self.datagram_size_for(host),
            **kwargs,
        )


def new_event_loop(settings: QuicSettings | None = None) -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed (and allowed), else asyncio's."""
    if settings is None or settings.use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is optional
            pass
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, settings: QuicSettings | None = None) -> T:
    """asyncio.run() on the loop new_event_loop() chooses."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(settings)) as runner:
        return runner.run(main)

