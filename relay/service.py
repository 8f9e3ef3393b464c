"""`kvsp relay`: the MOQT relay as a service, and the same relay on a background thread.

    kvsp relay --listen 127.0.0.1:4443 [--public-url moqt://relay.example:4443]
               [--cert CERT --key KEY | --cert-dir DIR] [--cache-bytes 1G]
               [--upstream moqt://127.0.0.1:4444 [--upstream-ca FILE | --upstream-insecure]]
               [--principals FILE | --insecure-open] [--metrics 127.0.0.1:9464]

Without --cert a self-signed certificate is generated for the listen address (unless it is
0.0.0.0 or ::), the host of --public-url and the loopback names, and written to --cert-dir
(kept, and reused at the next start while it covers those names and is valid) or to a
temporary directory removed at exit; its path and SHA-256 fingerprint are
printed so that clients elsewhere can trust it (`--relay-ca PATH`). Without --principals
the relay runs open, on loopback only unless --insecure-open (kvsp_moq.serving). The first
line on stdout is "relay listening on moqt://HOST:PORT" (the --public-url when given); with
--metrics, the line after the notes is "metrics at http://HOST:PORT/metrics" (GET /metrics
in Prometheus text, GET /healthz). With --principals, /metrics wants the token of a principal
with the "metrics" role, as at every server (its counters add up every tenant's traffic);
/healthz takes none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Coroutine, Sequence, TypeVar
from urllib.parse import urlsplit

from kvsp_moq.allocator import tune_allocator
from kvsp_moq.arguments import listen_type, parse_size
from kvsp_moq.auth import Authenticator, add_token_options, token_from_args
from kvsp_moq.errors import KvspError, SettingError
from kvsp_moq.moqt.certs import certificate_names, client_tls, fingerprint, load_or_generate
from kvsp_moq.moqt.drafts import parse_drafts
from kvsp_moq.moqt.quic import new_event_loop
from kvsp_moq.moqt.quic import run as run_loop
from kvsp_moq.moqt.quic.settings import quic_settings
from kvsp_moq.serving import INSECURE_OPEN_HELP, cannot_listen, check_advertised, check_exposure, normalize_public_url

from .relay import Relay, RelaySettings

log = logging.getLogger("kvsp.relay")
T = TypeVar("T")
DEFAULT_PORT = 4443
def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Relay MOQT sessions (drafts 18, 20, 22 and 14) between KV block publishers and subscribers, "
                     "with an object cache, scope authorization and relay chaining.")
    p.add_argument("--listen", type=listen_type(), default=("127.0.0.1", DEFAULT_PORT), metavar="HOST:PORT",
                   help=f"UDP address to serve on (default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--public-url", metavar="URL",
                   help="moqt://HOST:PORT at which others reach this relay: printed at start and "
                        "put in the generated certificate (needed when listening on 0.0.0.0 or ::)")
    p.add_argument("--cert", metavar="FILE", help="certificate chain (PEM); default: generate one")
    p.add_argument("--key", metavar="FILE", help="private key of --cert (PEM)")
    p.add_argument("--cert-dir", metavar="DIR",
                   help="where to write a generated certificate and key, kept after exit (default: "
                        "a temporary directory removed at exit)")
    p.add_argument("--cache-bytes", type=parse_size, default=256 << 20, metavar="N",
                   help="object cache budget, e.g. 1G (default 256M)")
    p.add_argument("--max-object-bytes", type=parse_size, default=None, metavar="N",
                   help="largest object accepted from a peer; a larger one closes that peer's "
                        "session with PROTOCOL_VIOLATION (default 64M). Control messages are "
                        "bounded by their 16-bit length (64 KiB)")
    p.add_argument("--upstream", metavar="URL",
                   help="moqt:// URL of the relay asked for tracks no local publisher announced")
    add_token_options(p, "upstream-token", what="token presented to the upstream relay: a principal "
                      "there with the relay role and the scopes this relay serves")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--upstream-ca", metavar="FILE",
                     help="CA, or the upstream relay's own certificate, to verify it against; "
                          "default: none for a loopback relay, the system's CAs otherwise")
    tls.add_argument("--upstream-insecure", action="store_true",
                     help="do not verify the upstream relay's certificate (warned at start)")
    p.add_argument("--principals", metavar="FILE",
                   help="principals file (TOML); without it the relay runs open, on loopback only")
    p.add_argument("--insecure-open", action="store_true", help=INSECURE_OPEN_HELP)
    p.add_argument("--subscriber-queue-bytes", type=parse_size, default=32 << 20, metavar="N",
                   help="objects queued for one subscriber before it is dropped as too slow (default 32M)")
    p.add_argument("--max-rendezvous-ms", type=int, default=30_000, metavar="MS",
                   help="longest RENDEZVOUS_TIMEOUT honoured (default %(default)s)")
    p.add_argument("--probe-interval", type=float, default=2.0, metavar="SECONDS",
                   help="PING every session this often and close one that leaves a PING unanswered "
                        "for --probe-timeout while sending nothing (a peer still sending is on a "
                        "lossy path, and kept), withdrawing its announcements (0: never; default "
                        "%(default)s); without it a vanished peer lingers until QUIC's idle timeout (30 s)")
    p.add_argument("--probe-timeout", type=float, default=6.0, metavar="SECONDS",
                   help="how long a PING may go unanswered (default %(default)s)")
    p.add_argument("--no-draft14", action="store_true",
                   help="do not serve draft-14 clients (ALPN moq-00); by default they are served "
                        "after drafts 18, 20 and 22")
    p.add_argument("--drafts", type=parse_drafts, default=None, metavar="N,N,...",
                   help="the MOQT drafts to serve, most preferred first: a client offering several "
                        "gets the first of these it offers (default: 18,20,22,14)")
    p.add_argument("--metrics", type=listen_type(), default=None, metavar="HOST:PORT",
                   help="serve GET /metrics (Prometheus text; with --principals, for a principal "
                        "with the metrics role) and GET /healthz over HTTP on this TCP address "
                        "(default: no metrics server)")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace,
                       cleanup: contextlib.ExitStack | None = None) -> tuple[RelaySettings, list[str]]:
    """Relay settings, and lines to print at start (certificate location and fingerprint).

    Refusals are SettingErrors, raised before anything is bound or written. A generated
    certificate's temporary directory is removed when `cleanup` closes (at exit without it).
    """
    host, port = args.listen
    notes: list[str] = []
    authenticator = Authenticator.from_file(args.principals)
    warnings = check_exposure("the relay", host, authenticated=not authenticator.is_open,
                              insecure_open=getattr(args, "insecure_open", False))
    public_url = normalize_public_url(getattr(args, "public_url", None), ("moqt",))
    if public_url is not None:
        public_url = public_url.rstrip("/")
    check_advertised(host, public_url)
    upstream_tls = None
    if args.upstream:
        upstream_tls = client_tls(args.upstream, cafile=args.upstream_ca, insecure=args.upstream_insecure,
                                  peer="upstream relay", ca_option="--upstream-ca",
                                  insecure_option="--upstream-insecure")
    if args.probe_interval < 0 or args.probe_timeout <= 0:
        raise SettingError("--probe-interval must be 0 or more and --probe-timeout more than 0")
    if bool(args.cert) != bool(args.key):
        raise SettingError("--cert and --key go together")
    if args.cert and args.cert_dir:
        raise SettingError("--cert-dir is where a generated certificate goes; not with --cert")
    settings = RelaySettings(
        host=host, port=port, cache_bytes=args.cache_bytes, upstream=args.upstream,
        upstream_token=token_from_args(args, "upstream-token"),
        upstream_verify=upstream_tls.verify if upstream_tls else True,
        upstream_cafile=upstream_tls.cafile if upstream_tls else None, upstream_tls=upstream_tls,
        authenticator=authenticator, public_url=public_url,
        subscriber_queue_bytes=args.subscriber_queue_bytes, max_rendezvous_ms=args.max_rendezvous_ms,
        probe_interval=args.probe_interval, probe_timeout=args.probe_timeout,
    )
    settings.quic = quic_settings(getattr(args, "quic_engine", None),
                                  getattr(args, "datagram_size", None))
    if args.no_draft14:
        settings.quic.draft14_fallback = False
    if getattr(args, "max_object_bytes", None) is not None:
        settings.quic.max_object_size = args.max_object_bytes
    if args.drafts is not None:
        settings.quic.server_drafts = tuple(d for d in args.drafts if not (args.no_draft14 and d == 14))
    if args.cert:
        settings.certfile, settings.keyfile = args.cert, args.key
        try:
            pem = Path(args.cert).read_bytes()
            notes.append(f"certificate {args.cert}")
            notes.append(f"certificate SHA-256 fingerprint {fingerprint(pem)}")
        except (OSError, ValueError) as e:
            raise SettingError(f"cannot read --cert {args.cert}: {getattr(e, 'strerror', None) or e}") from None
    else:
        names = certificate_names(host, urlsplit(public_url).hostname if public_url else None)
        if args.cert_dir:
            directory = Path(args.cert_dir)
            directory.mkdir(parents=True, exist_ok=True)
        else:
            directory = Path(tempfile.mkdtemp(prefix="kvsp-relay-"))
            if cleanup is not None:
                cleanup.callback(shutil.rmtree, directory, ignore_errors=True)
            else:
                import atexit

                atexit.register(shutil.rmtree, directory, ignore_errors=True)
        cert_path, key_path = directory / "relay-cert.pem", directory / "relay-key.pem"
        certificate, reused = load_or_generate(cert_path, key_path, names)
        settings.certificate = certificate
        notes.append(f"self-signed certificate {cert_path} (key {key_path}) for {', '.join(names)}"
                     + ("; reused" if reused else "") + ("" if args.cert_dir else "; removed at exit")
                     + "; clients on other machines take a copy as --relay-ca (relays: --upstream-ca)")
        notes.append(f"certificate SHA-256 fingerprint {fingerprint(certificate.certificate_pem)}")
    if authenticator.is_open:
        notes.append("no principals file: running open, every client may announce, subscribe and fetch")
    notes.extend(warnings)
    return settings, notes


async def serve_forever(settings: RelaySettings, notes: Sequence[str] = (),
                        metrics: tuple[str, int] | None = None) -> None:
    """Run the relay (and its metrics server, given an address) until SIGINT or SIGTERM."""
    from .metrics import start_metrics_server  # web stack only when asked for

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # from the start: a stop must clean up
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        relay = await Relay(settings).start()
    except OSError as e:  # a port in use: one line, exit status 2
        raise cannot_listen(settings.host, settings.port, e) from None
    print(f"relay listening on {settings.public_url or relay.url}", flush=True)
    if settings.public_url and settings.public_url != relay.url:
        print(f"bound to {relay.url}", flush=True)
    for note in notes:
        print(note, flush=True)
        if note.startswith("INSECURE"):
            log.warning("%s", note)
    if settings.upstream_tls is not None:
        settings.upstream_tls.log_note(log)
    metrics_server = None
    if metrics is not None:
        try:
            metrics_server = await start_metrics_server(relay, *metrics)
        except BaseException as e:
            await relay.aclose()
            if isinstance(e, OSError):
                raise cannot_listen(*metrics, e) from None
            raise
        print(f"metrics at {metrics_server.url}metrics", flush=True)
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

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the cleanup below

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminated)  # until the event loop takes it over
    with contextlib.ExitStack() as cleanup:
        settings, notes = settings_from_args(args, cleanup)
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
    except SettingError as e:
        print(f"kvsp relay: {e}", file=sys.stderr)
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
