"""`kvsp agent`: the inference instance as a service, and the same agent in process.

    kvsp agent --listen 127.0.0.1:8900 --model tiny --index http://127.0.0.1:8700/ \\
               [--pc URL] [--relay URL [--relay-ca FILE | --relay-insecure]] [--data DIR] \\
               [--scope-keys FILE --scope NAME] [--device cpu|cuda] [--public-url URL] \\
               [--principals FILE | --insecure-open] [--token TOKEN]

Without --principals, or without --scope-keys (the open scope, whose key is public), the agent
runs on loopback only unless --insecure-open; listening on 0.0.0.0 or :: needs --public-url
(`kvsp_moq.serving`). The relay's certificate is checked by `kvsp_moq.moqt.certs.client_tls`,
as by every MOQT client of the project.

`--model tiny` creates the small test model once (under `--data`, else ~/.cache/kvsp-moq) and
reuses it afterwards. `Agent` runs the app on a background uvicorn server on 127.0.0.1 and a
free port, for tests, the demo and the benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any, Coroutine, Sequence, TypeVar

import uvicorn

from agent.cores import loader_cpus
from agent.model import ModelAdapter
from agent.settings import DEFAULT_PORT, AgentSettings
from kvsp_moq.allocator import tune_allocator
from kvsp_moq.arguments import parse_listen, parse_size, positive_int
from kvsp_moq.auth import add_token_options, token_from_args
from kvsp_moq.errors import KvspError, SettingError
from kvsp_moq.model_descriptor import DTYPES
from kvsp_moq.moqt.certs import add_relay_tls_options
from kvsp_moq.moqt.quic.settings import quic_settings
from kvsp_moq.scope_keys import read_scope_keys
from kvsp_moq.serving import AGENT_INSECURE_OPEN_HELP, check_advertised, check_exposure, listening, normalize_public_url
from kvsp_moq.web import BackgroundServer, uvicorn_config

log = logging.getLogger("kvsp.agent")
T = TypeVar("T")



#: Seconds a thread may hold the GIL while another waits for it (Python's default is 0.005).
SWITCH_INTERVAL_S = 0.0002


def tune_interpreter(switch_interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Hand the GIL over sooner, for a process that runs an agent.

    The model thread needs the GIL only briefly, to dispatch each kernel, but while the event
    loop parses and verifies arriving blocks it waits up to the whole switch interval for it,
    once per kernel: with the default 5 ms, layers computed during a load took several times
    as long as the same layers computed alone (measured on 2 cores). Process-wide, so it is
    set by the process's entry point (`kvsp agent`, the benchmarks), not by the library.
    """
    sys.setswitchinterval(switch_interval_s)


class Agent:
    """An agent running in this process on a background server (tests, the demo, benchmarks).

    Its parts are on `context` (engine, store, publisher, meters); their state belongs to the
    server's event loop, so work on them goes through `call()`.
    """

    def __init__(self, settings: AgentSettings, *, adapter: ModelAdapter | None = None) -> None:
        from agent.app import create_app

        self.settings = settings
        self.app = create_app(settings, adapter=adapter)
        self.context = self.app.state.agent
        self._server: BackgroundServer | None = None

    def start(self) -> "Agent":
        host, port = parse_listen(self.settings.listen, DEFAULT_PORT)
        server = BackgroundServer(self.app, host, port)
        self.context.url = self.settings.public_url or server.url
        server.start(timeout=120.0)
        self._server = server
        return self

    def stop(self) -> None:
        """Stop serving: running sessions end unfinished (the PC fails them over)."""
        if self._server is None:
            return
        loop = self.context.loop
        if loop is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self.context.engine.close(), loop).result(10)
            except Exception as e:  # stopping anyway
                log.warning("closing the engine: %s", e)
        self._server.stop()
        self._server = None

    @property
    def url(self) -> str:
        return self.context.url

    @property
    def engine(self) -> Any:
        return self.context.engine

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the agent's loop from another thread and return its result."""
        loop = self.context.loop
        if loop is None:
            coro.close()
            raise RuntimeError("the agent is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def __enter__(self) -> "Agent":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- command line


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Serve an inference instance: generation with cached prefixes loaded while the "
                     "model computes (KVSP §6.5-§6.9), and its own KV blocks as a holder.")
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="address to serve on (default %(default)s)")
    p.add_argument("--model", default="tiny", metavar="tiny|DIR",
                   help="'tiny' (made once, locally) or a local model directory")
    p.add_argument("--index", metavar="URL", help="base URL of the Index Service")
    p.add_argument("--pc", metavar="URL[,URL...]",
                   help="base URL of the Placement Controller; several PC processes on one store "
                        "(kvsp index --store redis://...) comma-separated: status and checkpoints "
                        "go to one, and to the next when it fails")
    p.add_argument("--relay", metavar="URL",
                   help="moqt:// URI of the MOQT relay: blocks are loaded through it first and "
                        "this agent's blocks are published through it")
    add_relay_tls_options(p)
    p.add_argument("--data", metavar="DIR", help="directory of the block store's disk tier and models")
    p.add_argument("--scope-keys", metavar="FILE",
                   help="keys file (TOML: scope name = hex key); without it the agent uses the "
                        "open scope, whose key is public, on loopback only")
    p.add_argument("--scope", metavar="NAME", help="scope of requests that name none")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:n] (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="of the model's weights and of its KV blocks; part of the "
                        "Compatibility ID, so instances that share blocks must agree "
                        "(default %(default)s)")
    p.add_argument("--public-url", metavar="URL",
                   help="this agent's base URL as others reach it, put in its records (default "
                        "http://LISTEN/; needed when listening on 0.0.0.0 or ::)")
    p.add_argument("--principals", metavar="FILE",
                   help="principals file (TOML); without it the agent runs open, on loopback only")
    p.add_argument("--insecure-open", action="store_true", help=AGENT_INSECURE_OPEN_HELP)
    add_token_options(p, what="bearer token presented to other services")
    p.add_argument("--block-tokens", type=positive_int, default=AgentSettings.block_tokens,
                   metavar="B",
                   help="tokens per KV block; every instance and the Index Service of a fleet "
                        "must agree (default %(default)s)")
    p.add_argument("--host-bytes", type=parse_size, default=1 << 30, metavar="N",
                   help="host memory for this agent's blocks, e.g. 4G (default 1G); the least "
                        "recently used move to --data, or are dropped without it")
    p.add_argument("--disk-bytes", type=parse_size, default=16 << 30, metavar="N",
                   help="disk budget for blocks under --data (default 16G)")
    p.add_argument("--status-ttl-ms", type=positive_int, default=3000, metavar="N",
                   help="lifetime of each status report to the PC (§6.3); the agent reports "
                        "again well before it ends (default %(default)s)")
    p.add_argument("--replicate-to", action="append", default=[], metavar="URL",
                   help="holder that also stores every new block (repeatable)")
    p.add_argument("--loader-cpus", metavar="auto|LIST",
                   help="cores for the loader alone, the model computing on the others: auto (the "
                        "last core of each NUMA node) or a CPU list such as 6,7; by default every "
                        "thread runs everywhere. Worth it where cores are plenty: the loader then "
                        "no longer slows the forward pass it overlaps")
    p.add_argument("--no-live-kv", dest="live_kv", action="store_false",
                   help="do not publish the prompt blocks a prefill computes while it computes them "
                        "(live KV over the relay, with in-production records in the index); they are "
                        "published once stored, as every block")
    p.add_argument("--always-load", action="store_true",
                   help="load every cached block found, even when recomputing it would be "
                        "cheaper by the measured rates (by default the agent chooses, KVSP §6.4)")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    keys = read_scope_keys(args.scope_keys) if args.scope_keys else {}
    public = normalize_public_url(args.public_url)
    return AgentSettings(
        listen=args.listen, model=args.model, device=args.device, dtype=args.dtype,
        index_url=args.index, pc_url=args.pc, relay=args.relay, relay_ca=args.relay_ca,
        relay_insecure=args.relay_insecure, data_dir=args.data,
        scope_keys=keys, scope=args.scope, public_url=public, principals=args.principals,
        token=token_from_args(args), block_tokens=args.block_tokens, status_ttl_ms=args.status_ttl_ms,
        host_bytes=args.host_bytes, disk_bytes=args.disk_bytes,
        replicate_to=tuple(args.replicate_to), choose_by_cost=not args.always_load, live_kv=args.live_kv,
        loader_cpus=loader_cpus(args.loader_cpus),
        quic=quic_settings(getattr(args, "quic_engine", None), getattr(args, "datagram_size", None)))


def check_serving(args: argparse.Namespace) -> list[str]:
    """The refusals of `kvsp_moq.serving` for these options (SettingError), before anything is
    bound or loaded; the warnings to log at start."""
    host, _ = parse_listen(args.listen, DEFAULT_PORT)
    warnings = check_exposure("the agent", host, authenticated=args.principals is not None,
                              open_scope=not args.scope_keys, insecure_open=args.insecure_open)
    check_advertised(host, normalize_public_url(args.public_url))
    return warnings


def run(args: argparse.Namespace) -> int:
    """Serve in the foreground until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warnings = check_serving(args)
    tune_interpreter()
    settings = settings_from_args(args)
    host, port = parse_listen(settings.listen, DEFAULT_PORT)
    sock = listening(host, port)  # a port in use is said at once, not after loading the model
    for warning in warnings:
        log.warning("%s", warning)
    if not args.scope_keys:
        log.warning("no --scope-keys: using the open loopback scope (its key is public)")
    if args.relay:
        log.info("loading MOQT replicas through %s first, HTTP as the fallback; publishing "
                 "this agent's blocks there too", args.relay)
    from agent.app import create_app

    app = create_app(settings)
    shown = f"[{host}]" if ":" in host else host
    url = settings.public_url or f"http://{shown}:{sock.getsockname()[1]}/"
    app.state.agent.url = url
    if app.state.auth.is_open:
        log.warning("no principals file: serving without authentication at %s", url)
    log.info("agent at %s (model %s, %s, compat %s)", url, settings.model, settings.device,
             app.state.agent.compat_id)
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agent.service`: the same as `kvsp agent`."""
    parser = argparse.ArgumentParser(prog="kvsp agent")
    configure_parser(parser)
    args = parser.parse_args(argv)
    tune_allocator()
    try:
        return args.func(args)
    except (KvspError, SettingError) as e:
        print(f"kvsp agent: {getattr(e, 'detail', e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
