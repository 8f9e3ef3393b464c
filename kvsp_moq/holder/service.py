"""`kvsp holder`: the block store as a service, and the same holder in process.

    kvsp holder --listen 127.0.0.1:8801 --data DIR --index http://127.0.0.1:8700/ \
                [--public-url URL] [--principals FILE | --insecure-open] \
                [--relay moqt://127.0.0.1:4443 [--relay-ca FILE | --relay-insecure]] \
                [--serve-scope HEX ...] [--scope-quota N] [--max-leases N] \
                [--max-put-inflight N]

The holder stores blocks of its own scopes only: those of --serve-scope, else those of the
principal its --token belongs to (`kvsp_moq.holder.tenancy`); each scope within its quota.

With --relay the blocks are also published over MOQT through that relay (DESIGN §4), and each
replica gets a second record in the index, the MOQT one. The relay's certificate is checked as
every MOQT client of the project checks it (`kvsp_moq.moqt.certs.client_tls`): against
--relay-ca when given; else not at all for a loopback relay (127.0.0.0/8, ::1, localhost; said
in a log line), and against the system's CAs for any other; --relay-insecure skips it anywhere,
with a warning. A rejected certificate is logged once, at error level, and the holder keeps
retrying. Without --principals the holder runs open, on loopback only unless --insecure-open;
listening on 0.0.0.0 or :: needs --public-url (`kvsp_moq.serving`).

`Holder` runs the app on a background uvicorn server (127.0.0.1, any free port) for tests and
the demo; `run()` serves in the foreground for the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any, Coroutine, TypeVar

import uvicorn

from kvsp_moq.arguments import parse_listen, parse_size, positive_int
from kvsp_moq.auth import add_token_options, token_from_args
from kvsp_moq.errors import BadRecord
from kvsp_moq.holder.app import create_app
from kvsp_moq.holder.leases import MAX_LEASES_TOTAL, Clock
from kvsp_moq.holder.settings import DEFAULT_PORT, HolderSettings
from kvsp_moq.holder.tenancy import parse_scopes
from kvsp_moq.moqt.certs import add_relay_tls_options
from kvsp_moq.moqt.quic.settings import quic_settings
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.serving import INSECURE_OPEN_HELP, check_advertised, check_exposure, listening, normalize_public_url
from kvsp_moq.web import BackgroundServer, uvicorn_config

log = logging.getLogger("kvsp.holder")
T = TypeVar("T")


class Holder:
    """A holder running in this process on a background server (tests, the demo).

    The store, lease table and publisher are exposed for inspection; their state belongs
    to the server's event loop, so changes go through `call()`.
    """

    def __init__(self, settings: HolderSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.app = create_app(settings, clock=clock)
        self.store = self.app.state.store
        self.leases = self.app.state.leases
        self.publisher = self.app.state.publisher
        self._server: BackgroundServer | None = None

    @property
    def moqt_publisher(self) -> Any:
        """The BlockPublisher serving the store over MOQT (None without a relay, or before
        the holder started)."""
        return self.app.state.moqt_publisher

    def start(self) -> "Holder":
        host, port = parse_listen(self.settings.listen, DEFAULT_PORT)
        server = BackgroundServer(self.app, host, port)
        self.publisher.holder_url = self.settings.public_url or server.url
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def url(self) -> str:
        """The holder's base URL (ending in "/")."""
        return self.publisher.holder_url

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop, from another thread, and return its result."""
        loop = self.app.state.loop
        if loop is None:
            coro.close()
            raise RuntimeError("the holder is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def __enter__(self) -> "Holder":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- command line


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Serve KV blocks over HTTP (KVSP §6.6, §6.7) from host memory and a data "
                     "directory, and publish their replica records to an Index Service (§6.1).")
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="address to serve on (default %(default)s)")
    p.add_argument("--data", metavar="DIR",
                   help="directory of the disk tier; blocks found there are served and "
                        "published at start (without it, blocks live in memory only)")
    p.add_argument("--index", metavar="URL",
                   help="base URL of the Index Service to publish replica records to")
    p.add_argument("--public-url", metavar="URL",
                   help="this holder's base URL as clients reach it, put in its records "
                        "(default http://LISTEN/; needed when listening on 0.0.0.0 or ::)")
    p.add_argument("--host-bytes", type=parse_size, default=1 << 30, metavar="N",
                   help="host memory budget, e.g. 4G (default 1G)")
    p.add_argument("--disk-bytes", type=parse_size, default=16 << 30, metavar="N",
                   help="disk budget under --data (default 16G)")
    p.add_argument("--device-bytes", type=parse_size, default=0, metavar="N",
                   help="accelerator memory budget; used only when CUDA is available")
    p.add_argument("--device-layers", type=positive_int, default=None, metavar="N",
                   help="keep at most the first N layers of each block on the device")
    p.add_argument("--record-ttl-ms", type=positive_int, default=60_000, metavar="N",
                   help="ttl_ms of published records; refreshed every third of it")
    p.add_argument("--relay", metavar="URI",
                   help="moqt:// URI of a relay to publish the blocks through over MOQT "
                        "(each replica then also gets a MOQT record)")
    add_relay_tls_options(p)
    p.add_argument("--principals", metavar="FILE",
                   help="principals file (TOML); without it the holder runs open, on loopback only")
    p.add_argument("--insecure-open", action="store_true", help=INSECURE_OPEN_HELP)
    add_token_options(p, what="bearer token this holder presents to the Index Service and the relay")
    p.add_argument("--max-lease-ttl-ms", type=positive_int, default=600_000, metavar="N",
                   help="longest lease a client may hold (default %(default)s)")
    p.add_argument("--max-lease-bytes", type=parse_size, default=16 << 30, metavar="N",
                   help="octets a client may hold under leases (default 16G)")
    p.add_argument("--max-leases", type=positive_int, default=1024, metavar="N",
                   help="leases one principal may hold at once (default %(default)s; beyond "
                        "it, 429)")
    p.add_argument("--max-leases-total", type=positive_int, default=MAX_LEASES_TOTAL,
                   metavar="N", help="leases the holder keeps at once, all principals together "
                                     "(default %(default)s)")
    p.add_argument("--serve-scope", action="append", default=[], metavar="HEX",
                   help="Scope ID whose blocks this holder stores (repeatable); by default the "
                        "scopes of the principal of --token; blocks of any other scope are "
                        "refused with 403")
    p.add_argument("--scope-quota", type=parse_size, default=None, metavar="N",
                   help="octets of blocks one scope may hold, e.g. 2G (default: an equal share "
                        "of the store among the scopes served); a store beyond it evicts that "
                        "scope's own oldest blocks, or answers 507")
    p.add_argument("--max-put-inflight", type=parse_size, default=None, metavar="N",
                   help="octets that block PUTs being received may declare together, e.g. 4G "
                        "(default: twice the largest block); a PUT beyond it is answered 503 "
                        "with Retry-After, so slow senders cannot reserve unbounded memory")
    p.add_argument("--descriptor", action="append", default=[], metavar="FILE",
                   help="compatibility descriptor whose geometry stored blocks must match "
                        "(repeatable)")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> HolderSettings:
    import json

    descriptors = {}
    for path in args.descriptor:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BadRecord(f"cannot read descriptor {path}: {e}", member="descriptor") from None
        d = CompatDescriptor.from_dict(data)
        descriptors[d.compat_hex] = d
    public_url = normalize_public_url(args.public_url)
    return HolderSettings(
        listen=args.listen, data_dir=args.data, index_url=args.index, public_url=public_url,
        host_bytes=args.host_bytes, disk_bytes=args.disk_bytes, device_bytes=args.device_bytes,
        device_layers=args.device_layers,
        record_ttl_ms=args.record_ttl_ms, relay=args.relay, relay_ca=args.relay_ca,
        relay_insecure=args.relay_insecure, principals=args.principals,
        index_token=token_from_args(args), max_lease_ttl_ms=args.max_lease_ttl_ms,
        max_lease_bytes=args.max_lease_bytes, descriptors=descriptors,
        max_leases=args.max_leases, max_leases_total=args.max_leases_total,
        serve_scopes=tuple(parse_scopes(args.serve_scope)), scope_quota=args.scope_quota,
        max_put_inflight_bytes=args.max_put_inflight,
        quic=quic_settings(getattr(args, "quic_engine", None), getattr(args, "datagram_size", None)),
    )


def check_serving(args: argparse.Namespace) -> list[str]:
    """The refusals of `kvsp_moq.serving` for these options (SettingError), before anything is
    bound; the warnings to log at start."""
    host, _ = parse_listen(args.listen, DEFAULT_PORT)
    warnings = check_exposure("the holder", host, authenticated=args.principals is not None,
                              insecure_open=args.insecure_open)
    check_advertised(host, normalize_public_url(args.public_url))
    return warnings


def run(args: argparse.Namespace) -> int:
    """Serve in the foreground until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warnings = check_serving(args)
    settings = settings_from_args(args)
    host, port = parse_listen(settings.listen, DEFAULT_PORT)
    sock = listening(host, port)  # a port in use is one line, before the store is opened
    app = create_app(settings)
    for warning in warnings:
        log.warning("%s", warning)
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = settings.public_url or f"http://{shown}:{bound_port}/"
    app.state.publisher.holder_url = url
    if app.state.auth.is_open:
        log.warning("no principals file: serving without authentication at %s", url)
    if settings.data_dir is None:
        log.warning("no --data directory: blocks are kept in memory only")
    if not settings.index_url:
        log.warning("no --index: replica records are not published")
    log.info("holder at %s (host %d octets, disk %d octets)", url, settings.host_bytes,
             settings.disk_bytes if settings.data_dir else 0)
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
    return 0
