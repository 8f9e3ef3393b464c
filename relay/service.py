"""`kvsp relay`: the MOQT relay as a service, and the same relay on a background thread.

    kvsp relay --listen 127.0.0.1:4443 [--cert CERT --key KEY] [--cache-bytes 1G]
               [--upstream moqt://127.0.0.1:4444] [--principals FILE]
               [--metrics 127.0.0.1:9464]

Without --cert a self-signed certificate is generated and written to a fresh directory; its
location and SHA-256 fingerprint are printed so that clients can pin it. Without
--principals the relay runs open and says so at start. The first line on stdout is
"relay listening on moqt://HOST:PORT"; with --metrics, the line after the notes is
"metrics at http://HOST:PORT/metrics" (GET /metrics in Prometheus text, GET /healthz).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import re
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Coroutine, Sequence, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvsp_moq.allocator import tune_allocator
from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import KvspError
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import new_event_loop
from kvsp_moq.moqt.quic import run as run_loop

from .relay import Relay, RelaySettings

log = logging.getLogger("kvsp.relay")
T = TypeVar("T")
DEFAULT_PORT = 4443
_SIZE = re.compile(r"^(\d+)\s*([kmgt]i?b?|b)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Octets from "268435456", "256M", "1GiB" and the like (binary units)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 256M, 1G)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()[:1]]


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def fingerprint(certificate_pem: bytes) -> str:
    """SHA-256 of the certificate's DER form, as colon-separated hex (as openssl prints it)."""
    cert = x509.load_pem_x509_certificate(certificate_pem)
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Relay MOQT (draft-18) sessions between KV block publishers and subscribers, "
                     "with an object cache, scope authorization and relay chaining.")
    p.add_argument("--listen", type=parse_listen, default=("127.0.0.1", DEFAULT_PORT), metavar="HOST:PORT",
                   help=f"UDP address to serve on (default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--cert", metavar="FILE", help="certificate chain (PEM); default: generate one")
    p.add_argument("--key", metavar="FILE", help="private key of --cert (PEM)")
    p.add_argument("--cert-dir", metavar="DIR",
                   help="where to write a generated certificate (default: a new temporary directory)")
    p.add_argument("--cache-bytes", type=parse_size, default=256 << 20, metavar="N",
                   help="object cache budget, e.g. 1G (default 256M)")
    p.add_argument("--upstream", metavar="URL",
                   help="moqt:// URL of the relay asked for tracks no local publisher announced")
    p.add_argument("--upstream-token", metavar="TOKEN",
                   help="token presented to the upstream relay: a principal there with the relay "
                        "role and the scopes this relay serves (it speaks upstream for itself)")
    p.add_argument("--upstream-ca", metavar="FILE", help="CA (or pinned certificate) of the upstream relay")
    p.add_argument("--upstream-insecure", action="store_true",
                   help="do not verify the upstream relay's certificate")
    p.add_argument("--principals", metavar="FILE",
                   help="principals file (TOML); without it the relay runs open")
    p.add_argument("--subscriber-queue-bytes", type=parse_size, default=32 << 20, metavar="N",
                   help="objects queued for one subscriber before it is dropped as too slow (default 32M)")
    p.add_argument("--max-rendezvous-ms", type=int, default=30_000, metavar="MS",
                   help="longest RENDEZVOUS_TIMEOUT honoured (default %(default)s)")
    p.add_argument("--probe-interval", type=float, default=2.0, metavar="SECONDS",
                   help="PING every session this often and close one that leaves a PING unanswered "
                        "for --probe-timeout, withdrawing its announcements (0: never; default "
                        "%(default)s); without it a vanished peer lingers until QUIC's idle timeout (30 s)")
    p.add_argument("--probe-timeout", type=float, default=6.0, metavar="SECONDS",
                   help="how long a PING may go unanswered (default %(default)s)")
    p.add_argument("--no-draft14", action="store_true",
                   help="accept only draft-18 sessions (ALPN moqt-18); by default draft-14 clients "
                        "(ALPN moq-00) are served too")
    p.add_argument("--metrics", type=parse_listen, default=None, metavar="HOST:PORT",
                   help="serve GET /metrics (Prometheus text) and GET /healthz over HTTP on this "
                        "TCP address (default: no metrics server)")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> tuple[RelaySettings, list[str]]:
    """Relay settings, and lines to print at start (certificate location and fingerprint)."""
    host, port = args.listen
    notes: list[str] = []
    settings = RelaySettings(
        host=host, port=port, cache_bytes=args.cache_bytes, upstream=args.upstream,
        upstream_token=args.upstream_token, upstream_verify=not args.upstream_insecure,
        upstream_cafile=args.upstream_ca, authenticator=Authenticator.from_file(args.principals),
        subscriber_queue_bytes=args.subscriber_queue_bytes, max_rendezvous_ms=args.max_rendezvous_ms,
        probe_interval=args.probe_interval, probe_timeout=args.probe_timeout,
    )
    if args.probe_interval < 0 or args.probe_timeout <= 0:
        raise SystemExit("kvsp relay: --probe-interval must be 0 or more and --probe-timeout more than 0")
    if args.no_draft14:
        settings.quic.draft14_fallback = False
    if args.cert:
        if not args.key:
            raise SystemExit("kvsp relay: --cert needs --key")
        settings.certfile, settings.keyfile = args.cert, args.key
        notes.append(f"certificate {args.cert}")
        notes.append(f"certificate SHA-256 fingerprint {fingerprint(Path(args.cert).read_bytes())}")
    else:
        certificate = generate_self_signed()
        directory = Path(args.cert_dir) if args.cert_dir else Path(tempfile.mkdtemp(prefix="kvsp-relay-"))
        directory.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = directory / "relay-cert.pem", directory / "relay-key.pem"
        certificate.write(cert_path, key_path)
        settings.certificate = certificate
        notes.append(f"self-signed certificate {cert_path} (key {key_path})")
        notes.append(f"certificate SHA-256 fingerprint {fingerprint(certificate.certificate_pem)}")
    if settings.authenticator is None or settings.authenticator.is_open:
        notes.append("no principals file: running open, every client may announce, subscribe and fetch")
    return settings, notes


async def serve_forever(settings: RelaySettings, notes: Sequence[str] = (),
                        metrics: tuple[str, int] | None = None) -> None:
    """Run the relay (and its metrics server, given an address) until SIGINT or SIGTERM."""
    from .metrics import start_metrics_server  # noqa: PLC0415  (web stack only when asked for)

    relay = await Relay(settings).start()
    print(f"relay listening on {relay.url}", flush=True)
    for note in notes:
        print(note, flush=True)
    metrics_server = None
    if metrics is not None:
        try:
            metrics_server = await start_metrics_server(relay, *metrics)
        except BaseException:
            await relay.aclose()
            raise
        print(f"metrics at {metrics_server.url}metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        if metrics_server is not None:
            await loop.run_in_executor(None, metrics_server.stop)
        await relay.aclose()


def run(args: argparse.Namespace) -> int:
    """Serve in the foreground until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection event
    settings, notes = settings_from_args(args)
    run_loop(serve_forever(settings, notes, getattr(args, "metrics", None)), settings=settings.quic)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsp relay")
    configure_parser(parser)
    args = parser.parse_args(argv)
    tune_allocator()
    try:
        return args.func(args)
    except KvspError as e:
        print(f"kvsp relay: {e.detail}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# --------------------------------------------------------------------------- in process


class BackgroundRelay:
    """A relay on its own event loop in a background thread (for synchronous callers such as
    the demo); `call()` runs a coroutine on that loop."""

    def __init__(self, settings: RelaySettings | None = None) -> None:
        self.settings = settings or RelaySettings()
        self.relay: Relay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> "BackgroundRelay":
        self._loop = new_event_loop(self.settings.quic)
        self._thread = threading.Thread(target=self._main, name="kvsp-relay", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the relay did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            self.relay = loop.run_until_complete(Relay(self.settings).start())
        except BaseException as e:  # reported to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        loop.run_until_complete(self.relay.aclose())
        loop.close()

    @property
    def url(self) -> str:
        assert self.relay is not None
        return self.relay.url

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def snapshot(self) -> dict[str, int]:
        assert self.relay is not None
        relay = self.relay

        async def take() -> dict[str, int]:
            return relay.snapshot()

        return self.call(take())

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._thread = None

    def __enter__(self) -> "BackgroundRelay":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
