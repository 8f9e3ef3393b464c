"""The bare QUIC engines, with no MOQT on top: one stream between two processes on loopback.

What the MOQT data plane can get at most from aioquic or qh3 on this machine: a server
process writes N octets (64 MiB by default) on one stream, a client process reads them to the
FIN, each engine through its own asyncio protocol class, at a given datagram size. Reported:
MB/s (10^6 octets per second, timed by the client from the request to the FIN) and the CPU
seconds per GB (10^9 octets) each process spent (getrusage, user + system, from the request
to the FIN for the client, from the request to the end of the connection for the server).

    python -m kvsp_moq.bench.quic_engine [--engines aioquic,qh3] [--sizes 1452,9000,60000]
                                         [--bytes N] [--gso on|off|both] [--repeat R]

Per engine:

  aioquic  max_datagram_size up to 16384 only: above that aioquic 1.7.2 writes the STREAM
           frame length as a 2-octet varint and corrupts the frame ("unsupported" here).
           With long_frames (--long-frames), both processes' connections write frame lengths
           as the MOQT adapter's long-frame patch does (kvsp_moq.moqt.quic.aioquic_engine),
           so larger sizes run as MOQT runs them; nothing else of aioquic changes.
           The sender keeps at most ~4 MiB unacknowledged (its stream's sender buffer).
  qh3      The client advertises max_udp_payload_size 1472 whatever its configuration
           (qh3/quic/tls_bridge.py), and the core sends no larger datagram than the peer
           advertises; so for larger sizes the client process replaces the TLS bridge class
           by one that advertises the configured size (a monkeypatch inside the bench client
           process only). With gso (the default) both sides use qh3's GSO/GRO transport
           (create_optimized_datagram_transport: recvmmsg + GRO, sendmsg + UDP_SEGMENT); the
           server does so through a QuicServer that hands batches to datagrams_received.
           Without it both use a plain asyncio datagram endpoint, as aioquic does. The sender
           keeps at most ~4 MiB queued and not yet sent (get_send_buffer_size).

Both engines' own connect() bind the wildcard address "::"; here the client binds 127.0.0.1
(same protocol class, same QuicConnection, only the socket differs). Sockets get 4 MiB
buffers. Every transfer is checked (CRC-32 of what arrived against what was sent); the CPU
that check costs is subtracted from the client's figure and reported apart. Beside the figures:
the largest datagram the client received (what the sender really used), the server's timer
firings by kind (qh3: pacing, ack, ...) and its congestion window and smoothed RTT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable

ENGINES = ("aioquic", "qh3")
DATAGRAM_SIZES = (1452, 9000, 60000)
DEFAULT_BYTES = 64 << 20
AIOQUIC_MAX_DATAGRAM = 16384
QH3_CLIENT_ADVERTISED = 1472
SEND_BACKLOG = 4 << 20
SOCKET_BUFFER = 4 << 20
MAX_DATA = 64 << 20
MAX_STREAM_DATA = 16 << 20
PATTERN_BYTES = 1 << 20
ALPN = "kvsp-quic-bench"
MB = 1e6
GB = 1e9

__all__ = ["ENGINES", "DATAGRAM_SIZES", "supported", "run_bare", "run", "main"]


def supported(engine: str, datagram_size: int, long_frames: bool = False) -> str | None:
    """Why `engine` cannot carry `datagram_size` here, or None when it can (`long_frames`:
    with the MOQT adapter's long-frame patch for aioquic, where it applies)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    if datagram_size < 1200:
        return "QUIC needs datagrams of at least 1200 octets"
    if engine == "aioquic" and datagram_size > AIOQUIC_MAX_DATAGRAM:
        if long_frames:
            try:
                _long_frame_class()
            except (ImportError, AttributeError, KeyError, ValueError) as exc:
                return f"the long-frame patch is not available: {exc}"
            from kvsp_moq.errors import SettingError
            from kvsp_moq.moqt.quic.aioquic_engine import check_datagram_size

            try:
                check_datagram_size(datagram_size)
            except SettingError as exc:
                return str(exc)
            return None
        return (f"aioquic 1.7.2 writes STREAM frame lengths above {AIOQUIC_MAX_DATAGRAM} as a "
                "2-octet varint and corrupts the frame")
    return None


def _long_frame_class() -> type:
    """aioquic's QuicConnection with only the frame writers of the MOQT adapter's long-frame
    connection (its flow-control changes left out), so the bare figures stay aioquic's own."""
    from aioquic.quic.connection import QuicConnection

    from kvsp_moq.moqt.quic.aioquic_engine import _LongFrameConnection

    methods = {name: _LongFrameConnection.__dict__[name]
               for name in ("_write_stream_frame", "_write_crypto_frame")}
    return type("LongFrameQuicConnection", (QuicConnection,), methods)


def _pattern() -> bytes:
    """The 1 MiB the server repeats; both processes derive the same octets."""
    return random.Random(0x6B7673).randbytes(PATTERN_BYTES)


def _expected_crc(total: int) -> int:
    pattern = _pattern()
    crc = 0
    for offset in range(0, total, PATTERN_BYTES):
        crc = zlib.crc32(pattern[:min(PATTERN_BYTES, total - offset)], crc)
    return crc


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _socket_buffers(sock: Any) -> None:
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass  # left at the system's default


def _configuration(engine: str, is_client: bool, datagram_size: int, idle_timeout: float) -> Any:
    # aioquic's or qh3's class: the same interface (qh3 adds probe_datagram_size), no common base.
    QuicConfiguration: Any
    if engine == "aioquic":
        from aioquic.quic.configuration import QuicConfiguration
    else:
        from qh3.quic.configuration import QuicConfiguration
    configuration = QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN])
    configuration.max_datagram_size = datagram_size
    configuration.max_data = MAX_DATA
    configuration.max_stream_data = MAX_STREAM_DATA
    configuration.idle_timeout = idle_timeout
    if engine == "qh3":
        # The size under test, not PMTU discovery's (a client below 1472 would probe up to it).
        configuration.probe_datagram_size = False
    if is_client:
        configuration.verify_mode = ssl.CERT_NONE  # only the transfer is measured
    return configuration


def _advertise_client_datagram_size() -> None:
    """Make this (client) process's qh3 advertise its configured max_datagram_size.

    qh3 2.1.0 always advertises max_udp_payload_size 1472 from a client, and its core caps
    what it sends at what the peer advertises, so without this a qh3 server never sends a
    datagram larger than 1472 to a qh3 client.
    """
    import qh3.quic.connection as qh3_connection
    from qh3._hazmat import Buffer
    from qh3.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
    from qh3.quic.tls_bridge import QuicTlsBridge

    class AdvertisingTlsBridge(QuicTlsBridge):
        def serialize_transport_parameters(self) -> bytes:
            data = super().serialize_transport_parameters()
            size = self.configuration.max_datagram_size
            if not self.configuration.is_client or size <= QH3_CLIENT_ADVERTISED:
                return data
            parameters = pull_quic_transport_parameters(Buffer(data=data))
            parameters.max_udp_payload_size = size
            out = Buffer(capacity=3 * size + len(data))
            push_quic_transport_parameters(out, parameters)
            return out.data

    qh3_connection.QuicTlsBridge = AdvertisingTlsBridge  # type: ignore[misc]  # deliberate monkeypatch, this process only


def _protocol_classes(engine: str, long_frames: bool = False) -> tuple[Any, Any]:
    """The server and client protocols, subclasses of the engine's QuicConnectionProtocol
    (`long_frames`: aioquic connections get the long-frame writers before any packet).

    Typed Any: their base is aioquic's or qh3's class, picked at run time (the two have the
    same interface but no common base, and only qh3's takes datagrams_received batches)."""
    connection_class = _long_frame_class() if long_frames and engine == "aioquic" else None
    QuicConnectionProtocol: Any
    ConnectionTerminated: Any
    StreamDataReceived: Any
    if engine == "aioquic":
        from aioquic.asyncio.protocol import QuicConnectionProtocol
        from aioquic.quic.events import ConnectionTerminated, StreamDataReceived

        def backlog(quic: Any, stream_id: int) -> int:
            # Octets written and not yet acknowledged.
            stream = quic._streams.get(stream_id)
            if stream is None:
                return 0
            return stream.sender._buffer_stop - stream.sender._buffer_start

        def sender_state(quic: Any) -> dict[str, Any]:
            loss = quic._loss
            return {"cwnd": loss.congestion_window, "srtt_ms": round(loss._rtt_smoothed * 1e3, 3)}
    else:
        from qh3.asyncio.protocol import QuicConnectionProtocol
        from qh3.quic.events import ConnectionTerminated, StreamDataReceived

        def backlog(quic: Any, stream_id: int) -> int:
            # Octets written and not yet sent once.
            return quic.get_send_buffer_size(stream_id)

        def sender_state(quic: Any) -> dict[str, Any]:
            core = quic._core
            return {"cwnd": core.congestion_window,
                    "srtt_ms": round((core.smoothed_rtt or 0.0) * 1e3, 3),
                    "lost": core.loss_total, "pto": core.pto_total}

    pattern = _pattern()  # made before any transfer is timed

    class ServerProtocol(QuicConnectionProtocol):
        """Answers a request of N octets (ASCII, on a client bidi stream) with N octets."""

        done: asyncio.Future | None = None  # set per process: the server's report

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if connection_class is not None:
                self._quic.__class__ = connection_class
            self.progress = asyncio.Event()
            self.requests: dict[int, bytearray] = {}
            self.started: tuple[float, float] | None = None
            self.timers: dict[str, int] = {}
            self.terminated = False
            self.task: asyncio.Task | None = None
            self.sender: dict[str, Any] = {}
            self.largest_cwnd = 0

        def datagram_received(self, data: Any, addr: Any) -> None:
            super().datagram_received(data, addr)
            self.progress.set()

        def datagrams_received(self, data: list[bytes], addr: Any) -> None:  # qh3's batch
            super().datagrams_received(data, addr)
            self.progress.set()

        def _handle_timer(self) -> None:
            core = getattr(self._quic, "_core", None)
            timer = core.get_timer() if core is not None else None
            kind = timer[0] if timer else "timer"
            self.timers[kind] = self.timers.get(kind, 0) + 1
            super()._handle_timer()

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, StreamDataReceived):
                request = self.requests.setdefault(event.stream_id, bytearray())
                request += event.data
                if event.end_stream and self.task is None:
                    self.started = _cpu()
                    self.task = asyncio.ensure_future(
                        self._send(event.stream_id, int(request.decode())))
            elif isinstance(event, ConnectionTerminated):
                self.terminated = True
                self.progress.set()
                done = type(self).done
                if done is not None and not done.done():
                    user, system = _cpu()
                    start = self.started or (user, system)
                    done.set_result({"cpu_user_s": user - start[0],
                                     "cpu_sys_s": system - start[1],
                                     "answered": self.started is not None,
                                     "timers": self.timers,
                                     "sender": {**self.sender,
                                                "largest_cwnd": self.largest_cwnd}})

        async def _send(self, stream_id: int, total: int) -> None:
            sent = 0
            while sent < total and not self.terminated:
                while backlog(self._quic, stream_id) > SEND_BACKLOG and not self.terminated:
                    self.progress.clear()
                    await self.progress.wait()
                n = min(PATTERN_BYTES, total - sent)
                piece = pattern if n == PATTERN_BYTES else pattern[:n]
                self._quic.send_stream_data(stream_id, piece, end_stream=sent + n == total)
                sent += n
                self.transmit()
                await asyncio.sleep(0)  # let acknowledgements in between pieces
                self.largest_cwnd = max(self.largest_cwnd, sender_state(self._quic)["cwnd"])
            self.sender = sender_state(self._quic)  # when the last octet is queued

    class ClientProtocol(QuicConnectionProtocol):
        """Reads one stream to its FIN, counting and checksumming what arrives."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if connection_class is not None:
                self._quic.__class__ = connection_class
            self.stream_id: int | None = None
            self.received = 0
            self.crc = 0
            self.verify_cpu = 0.0
            self.largest_datagram = 0
            self.finished: asyncio.Future = asyncio.get_running_loop().create_future()

        def datagram_received(self, data: Any, addr: Any) -> None:
            if len(data) > self.largest_datagram:
                self.largest_datagram = len(data)
            super().datagram_received(data, addr)

        def datagrams_received(self, data: list[bytes], addr: Any) -> None:  # qh3's batch
            largest = max(map(len, data), default=0)
            if largest > self.largest_datagram:
                self.largest_datagram = largest
            super().datagrams_received(data, addr)

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, StreamDataReceived) and event.stream_id == self.stream_id:
                self.received += len(event.data)
                before = time.process_time()
                self.crc = zlib.crc32(event.data, self.crc)
                self.verify_cpu += time.process_time() - before
                if event.end_stream and not self.finished.done():
                    self.finished.set_result(time.perf_counter())
            elif isinstance(event, ConnectionTerminated) and not self.finished.done():
                self.finished.set_exception(ConnectionError(
                    f"connection ended after {self.received} octets: "
                    f"{event.error_code} {event.reason_phrase}"))

    return ServerProtocol, ClientProtocol


def _gro_server_class() -> type:
    """qh3's QuicServer, able to take a batch of datagrams from the GRO transport."""
    from qh3._hazmat import pull_quic_header
    from qh3.asyncio.server import QuicServer

    class GroQuicServer(QuicServer):
        def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
            cid_length = self._configuration.connection_id_length
            group: list[bytes] = []
            target: Any = None
            for data in datagrams:
                try:
                    protocol = self._protocols.get(pull_quic_header(data, 0, cid_length)[3])
                except ValueError:
                    continue
                if protocol is not target and group:
                    target.datagrams_received(group, addr)
                    group = []
                target = protocol
                if protocol is None:
                    self.datagram_received(data, addr)  # a new connection, or a stray
                else:
                    group.append(data)
            if group:
                target.datagrams_received(group, addr)

    return GroQuicServer


async def _serve(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    server_protocol, _ = _protocol_classes(args.engine, args.long_frames)
    server_protocol.done = loop.create_future()
    configuration = _configuration(args.engine, False, args.datagram_size, args.timeout)
    configuration.load_cert_chain(args.cert, args.key)
    server: Any  # the engine's QuicServer (the GroQuicServer with GSO)
    if args.engine == "qh3" and args.gso:
        from qh3.asyncio._transport import create_optimized_datagram_transport

        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _socket_buffers(sock)
        sock.bind(("127.0.0.1", 0))
        server_class = _gro_server_class()
        transport, server = await create_optimized_datagram_transport(
            loop, lambda: server_class(configuration=configuration, create_protocol=server_protocol),
            sock=sock, gro_segment_size=args.datagram_size)
    else:
        serve: Any  # aioquic's or qh3's, the same signature
        if args.engine == "aioquic":
            from aioquic.asyncio import serve
        else:
            from qh3.asyncio import serve
        server = await serve("127.0.0.1", 0, configuration=configuration,
                             create_protocol=server_protocol)
        transport = server._transport
        _socket_buffers(transport.get_extra_info("socket"))
    port = transport.get_extra_info("sockname")[1]
    ready = Path(args.port_file)
    ready.with_suffix(".tmp").write_text(str(port))
    ready.with_suffix(".tmp").rename(ready)
    try:
        return await asyncio.wait_for(server_protocol.done, args.timeout)
    finally:
        server.close()


async def _fetch(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    _, client_protocol = _protocol_classes(args.engine, args.long_frames)
    configuration = _configuration(args.engine, True, args.datagram_size, args.timeout)
    QuicConnection: Any  # aioquic's or qh3's class, the same interface
    if args.engine == "aioquic":
        from aioquic.quic.connection import QuicConnection
    else:
        if args.datagram_size > QH3_CLIENT_ADVERTISED:
            _advertise_client_datagram_size()
        from qh3.quic.connection import QuicConnection
    connection = QuicConnection(configuration=configuration)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _socket_buffers(sock)
    sock.bind(("127.0.0.1", 0))
    protocol: Any  # the ClientProtocol of _protocol_classes
    if args.engine == "qh3" and args.gso:
        from qh3.asyncio._transport import create_optimized_datagram_transport

        transport, protocol = await create_optimized_datagram_transport(
            loop, lambda: client_protocol(connection), sock=sock,
            gro_segment_size=args.datagram_size)
    else:
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: client_protocol(connection), sock=sock)
    try:
        protocol.connect(("127.0.0.1", args.port))
        await asyncio.wait_for(protocol.wait_connected(), args.timeout)
        stream_id = connection.get_next_available_stream_id()
        protocol.stream_id = stream_id
        cpu0 = _cpu()
        t0 = time.perf_counter()
        connection.send_stream_data(stream_id, str(args.bytes).encode(), end_stream=True)
        protocol.transmit()
        t1 = await asyncio.wait_for(protocol.finished, args.timeout)
        cpu1 = _cpu()
    finally:
        protocol.close()
        try:
            await asyncio.wait_for(protocol.wait_closed(), 2.0)
        except asyncio.TimeoutError:
            pass
        transport.close()
    return {"received": protocol.received, "seconds": t1 - t0,
            "cpu_user_s": cpu1[0] - cpu0[0] - protocol.verify_cpu,
            "cpu_sys_s": cpu1[1] - cpu0[1], "verify_cpu_s": protocol.verify_cpu,
            "crc": protocol.crc, "largest_datagram": protocol.largest_datagram}


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _report(proc: subprocess.Popen, deadline: float, name: str, log: Path) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the {name} did not finish in time: {_tail(log)}") from None
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {name} failed (exit {proc.returncode}): {_tail(log)}")
    return json.loads(lines[-1])


def run_bare(engine: str, datagram_size: int, size: int = DEFAULT_BYTES, gso: bool = True,
             timeout: float = 60.0, long_frames: bool = False) -> dict[str, Any]:
    """One transfer of `size` octets on one stream, server process to client process.

    Returns the rate and each process's CPU per GB, or {"unsupported": why} where the engine
    cannot carry `datagram_size`; raises when the transfer fails or takes over `timeout`.
    `gso` only concerns qh3 (aioquic has no GSO/GRO transport); `long_frames` only aioquic
    above 16384 octets (the MOQT adapter's frame-length patch, so `kvsp bench moqt` can set
    its loopback cells beside the bare engine at the same size).
    """
    gso = bool(gso) and engine == "qh3"
    long_frames = bool(long_frames) and engine == "aioquic" and datagram_size > AIOQUIC_MAX_DATAGRAM
    result: dict[str, Any] = {"engine": engine, "datagram_size": datagram_size, "bytes": size,
                              "gso": gso, **({"long_frames": True} if long_frames else {})}
    why = supported(engine, datagram_size, long_frames)
    if why is not None:
        return {**result, "unsupported": why}
    from kvsp_moq.moqt.certs import generate_self_signed

    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="kvsp-quic-bench-") as tmp:
        folder = Path(tmp)
        cert, key = folder / "cert.pem", folder / "key.pem"
        generate_self_signed(("localhost", "127.0.0.1")).write(cert, key)
        common = ["--engine", engine, "--datagram-size", str(datagram_size), "--bytes", str(size),
                  "--timeout", str(timeout), *([] if gso else ["--no-gso"]),
                  *(["--long-frames"] if long_frames else [])]
        module = [sys.executable, "-m", "kvsp_moq.bench.quic_engine"]
        server_log, client_log = folder / "server.log", folder / "client.log"
        port_file = folder / "port"
        server = client = None
        try:
            with open(server_log, "wb") as log:
                server = subprocess.Popen(
                    [*module, "--role", "server", "--cert", str(cert), "--key", str(key),
                     "--port-file", str(port_file), *common],
                    stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
            while not port_file.exists():
                if server.poll() is not None:
                    raise RuntimeError(f"the server did not start: {_tail(server_log)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server did not start in time: {_tail(server_log)}")
                time.sleep(0.02)
            port = int(port_file.read_text())
            with open(client_log, "wb") as log:
                client = subprocess.Popen(
                    [*module, "--role", "client", "--port", str(port), *common],
                    stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
            fetched = _report(client, deadline, "client", client_log)
            served = _report(server, deadline + 5.0, "server", server_log)
        finally:
            _stop(client)
            _stop(server)
    if fetched["received"] != size:
        raise RuntimeError(f"{engine} delivered {fetched['received']} of {size} octets")
    if fetched["crc"] != _expected_crc(size):
        raise RuntimeError(f"{engine} delivered {size} octets, but not the ones sent")
    gigabytes = size / GB
    client_cpu = fetched["cpu_user_s"] + fetched["cpu_sys_s"]
    server_cpu = served["cpu_user_s"] + served["cpu_sys_s"]
    return {**result,
            "mb_per_s": round(size / MB / fetched["seconds"], 1),
            "seconds": round(fetched["seconds"], 3),
            "server_cpu_s_per_gb": round(server_cpu / gigabytes, 2),
            "client_cpu_s_per_gb": round(client_cpu / gigabytes, 2),
            "server_sys_share": round(served["cpu_sys_s"] / server_cpu, 2) if server_cpu else None,
            "client_sys_share": round(fetched["cpu_sys_s"] / client_cpu, 2) if client_cpu else None,
            "client_verify_cpu_s": round(fetched["verify_cpu_s"], 3),
            "largest_datagram_received": fetched["largest_datagram"],
            "server_timers": served["timers"],
            "server_sender": served["sender"]}


def run_matrix(engines: tuple[str, ...] = ENGINES, sizes: tuple[int, ...] = DATAGRAM_SIZES,
               size: int = DEFAULT_BYTES, gso_modes: tuple[bool, ...] = (True, False),
               repeat: int = 1, timeout: float = 60.0,
               progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every engine x datagram size (x GSO on/off for qh3); a failed cell reports its error."""
    rows = []
    for _ in range(repeat):
        for engine in engines:
            for datagram_size in sizes:
                for gso in (gso_modes if engine == "qh3" else (False,)):
                    try:
                        row = run_bare(engine, datagram_size, size, gso, timeout)
                    except Exception as exc:  # one cell's failure is a figure
                        row = {"engine": engine, "datagram_size": datagram_size, "bytes": size,
                               "gso": gso, "error": f"{type(exc).__name__}: {exc}"}
                    rows.append(row)
                    if progress is not None:
                        progress(row)
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    """The matrix, as the other `kvsp bench` modules report (quick: 8 MiB per transfer)."""
    size = 8 << 20 if quick else DEFAULT_BYTES
    return {"bytes": size, "rows": run_matrix(size=size)}


def _child(args: argparse.Namespace) -> int:
    coroutine = _serve(args) if args.role == "server" else _fetch(args)
    report = asyncio.run(coroutine)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the matrix and print it as JSON (or, with --role, be one side of a transfer)."""
    parser = argparse.ArgumentParser(prog="python -m kvsp_moq.bench.quic_engine",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--sizes", default=",".join(map(str, DATAGRAM_SIZES)),
                        help="datagram sizes (max_datagram_size)")
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="octets per transfer")
    parser.add_argument("--gso", choices=("on", "off", "both"), default="both",
                        help="qh3's GSO/GRO transport (aioquic has none)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    # One side of a transfer (run_bare starts these).
    parser.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--datagram-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-gso", dest="gso_child", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument("--long-frames", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        args.gso = args.gso_child
        return _child(args)
    gso_modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.gso]
    rows = run_matrix(tuple(e for e in args.engines.split(",") if e),
                      tuple(int(s) for s in args.sizes.split(",") if s), args.bytes, gso_modes,
                      args.repeat, args.timeout,
                      progress=lambda row: print(json.dumps(row), file=sys.stderr, flush=True))
    print(json.dumps({"bytes": args.bytes, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
