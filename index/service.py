"""`kvsp index`: the Index Service and the Placement Controller, together or apart.

Together (the default) they share one process and port: the PC reads the IS store directly
and the IS takes instance status and links from the PC for lookup targets.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import uvicorn

from index.app import IndexSettings, create_app
from index.store import MemoryReplicaStore, ReplicaStore
from kvsp_moq.arguments import parse_listen
from kvsp_moq.auth import Authenticator, add_token_options, token_from_args
from kvsp_moq.errors import KvspError
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.serving import INSECURE_OPEN_HELP, check_advertised, check_exposure, listening, normalize_public_url
from kvsp_moq.web import uvicorn_config

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from pc.controller import PCSettings

DEFAULT_PORT = 8700
log = logging.getLogger("kvsp.index")


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Options of `kvsp index`."""
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"address to serve on (default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--max-ttl-ms", type=int, default=600_000, metavar="N",
                   help="cap on the ttl_ms of published replica records (default 600000)")
    p.add_argument("--principals", metavar="FILE",
                   help="principals file (TOML); without it the service runs open, on "
                        "loopback only")
    p.add_argument("--insecure-open", action="store_true", help=INSECURE_OPEN_HELP)
    p.add_argument("--public-url", metavar="URL",
                   help="this service's base URL as others reach it: logged at start and given to "
                        "--start-command as KVSP_INDEX_URL and KVSP_PC_URL (needed with "
                        "--start-command when listening on 0.0.0.0 or ::)")
    p.add_argument("--role", choices=("is", "pc", "both"), default="both",
                   help="which services this process runs (default both)")
    p.add_argument("--db", default=None, metavar="FILE",
                   help="PC: SQLite file of sessions and shard maps (default kvsp-pc.sqlite3 "
                        "in the current directory)")
    p.add_argument("--scope-keys", metavar="FILE",
                   help="PC: keys file (TOML: scope name -> hex key), to route from tokens")
    p.add_argument("--index", metavar="URL",
                   help="PC with --role pc: base URL of the Index Service to look up in")
    add_token_options(p, what="bearer token the PC presents to instances and to a remote IS")
    p.add_argument("--max-cost-us", type=float, metavar="US",
                   help="PC: cost above which a new instance is wanted")
    from pc.placement import PREFETCH_POLICIES

    p.add_argument("--prefetch", choices=PREFETCH_POLICIES, default=PREFETCH_POLICIES[0],
                   help="PC: when a routed request's instance gets a prefetch directive (§6.5): "
                        "only when requests are queued ahead of it there (default), or always. "
                        "A request that starts at once loads its prefix layer by layer while it "
                        "computes; a directive just before it makes it wait for whole blocks")
    p.add_argument("--pd", type=_split_policy, default="never", metavar="POLICY",
                   help="PC: when a request's prefill runs on another instance than its decode, "
                        "which subscribes to the prompt's layers as they are computed (live KV): "
                        "never (default), length:N (at least N uncached prompt tokens), or cost "
                        "(when the KVSP §6.4 estimates say it is sooner)")
    p.add_argument("--duties-ttl-ms", type=int, default=3000, metavar="MS",
                   help="PC with --store redis://...: how long the duties lease (failing expired "
                        "instances and moving their sessions) outlives its holder; another PC "
                        "takes the duties over within this plus a quarter second (default 3000)")
    p.add_argument("--start-command", metavar="CMD",
                   help="PC: shell command that starts an instance when none has acceptable "
                        "cost and prints its base URL (see pc.instances_client.command_start_hook)")
    p.add_argument("--descriptor", action="append", default=[], metavar="DESCRIPTOR.json",
                   help="a Compatibility Descriptor whose block size lets lookups with "
                        "targets estimate recompute_us (repeatable)")
    p.add_argument("--block-tokens", type=int, metavar="B",
                   help="block size assumed for compat IDs without a --descriptor")
    p.add_argument("--store", default="memory", metavar="memory|redis://HOST:PORT/DB",
                   help="where replica records and the PC's state (instances, sessions and "
                        "checkpoints, shard maps) live: in this process (default; the PC's "
                        "sessions in --db), or in Redis/Valkey, shared by every process that "
                        "names the same URL, which then act as one IS and one PC")
    p.add_argument("--store-password-file", metavar="FILE",
                   help="with --store redis://...: a file holding the store's password "
                        "(Redis requirepass), kept off the command line")


def redacted(url: str) -> str:
    """A store URL fit for logs: a password in it replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def store_password(args: argparse.Namespace) -> str | None:
    """The password of --store-password-file (first line); ValueError when unreadable."""
    path = getattr(args, "store_password_file", None)
    if path is None:
        return None
    if not args.store.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("--store-password-file needs --store redis://...")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --store-password-file {path}: {e}") from None
    if not lines or not lines[0].strip():
        raise ValueError(f"--store-password-file {path} is empty")
    return lines[0].strip()


def store_from_arg(value: str, password: str | None = None) -> ReplicaStore:
    """The replica store `--store` names; ValueError for anything else."""
    if value == "memory":
        return MemoryReplicaStore()
    if value.startswith(("redis://", "rediss://", "unix://")):
        from index.redis_store import RedisReplicaStore

        try:
            if password is not None:
                return RedisReplicaStore(value, password=password)
            return RedisReplicaStore(value)
        except RuntimeError as e:  # redis-py missing
            raise ValueError(f"--store: {e}") from None
    raise ValueError("--store must be memory or a redis://HOST:PORT/DB URL")


def settings_from_args(args: argparse.Namespace) -> IndexSettings:
    """The settings the command line describes; a refusal raises KvspError or ValueError."""
    if args.max_ttl_ms < 1:
        raise ValueError("--max-ttl-ms must be at least 1")
    if args.block_tokens is not None and args.block_tokens < 1:
        raise ValueError("--block-tokens must be at least 1")
    block_tokens: dict[str, int] = {}
    for path in args.descriptor:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read descriptor {path}: {e}") from None
        descriptor = CompatDescriptor.from_dict(data)
        block_tokens[descriptor.compat_hex] = descriptor.block_tokens
    return IndexSettings(store=store_from_arg(args.store, store_password(args)),
                         auth=Authenticator.from_file(args.principals),
                         max_ttl_ms=args.max_ttl_ms, block_tokens=block_tokens,
                         default_block_tokens=args.block_tokens)


def _split_policy(text: str) -> str:
    from pc.disaggregation import SplitPolicy

    try:
        return str(SplitPolicy.parse(text))
    except KvspError as e:
        raise argparse.ArgumentTypeError(e.detail) from None


def pc_settings_from_args(args: argparse.Namespace) -> "PCSettings":
    from pc.controller import PCSettings
    from pc.disaggregation import SplitPolicy
    from pc.placement import PlacementSettings

    token = token_from_args(args)
    placement = PlacementSettings(block_tokens=args.block_tokens or 16,
                                  max_cost_us=args.max_cost_us,
                                  prefetch=args.prefetch)
    public_url = normalize_public_url(getattr(args, "public_url", None))
    index_url = args.index if args.role == "pc" else public_url
    start_env = {}
    if public_url:
        start_env["KVSP_PC_URL"] = public_url
    if index_url:
        start_env["KVSP_INDEX_URL"] = index_url
    if args.duties_ttl_ms < 100:
        raise ValueError("--duties-ttl-ms must be at least 100")
    store = args.store if args.store.startswith(("redis://", "rediss://", "unix://")) else None
    if store is not None and args.db is not None:
        raise ValueError("--db and --store redis://... exclude each other: with a shared store "
                         "the PC keeps its sessions there")
    return PCSettings(database=args.db or "kvsp-pc.sqlite3", store=store,
                      store_password=store_password(args), principals=args.principals,
                      scope_keys=args.scope_keys, index_url=args.index, token=token,
                      placement=placement, start_command=args.start_command,
                      start_command_env=start_env, pd=SplitPolicy.parse(str(args.pd)),
                      duties_ttl_ms=args.duties_ttl_ms)


def create_combined_app(index_settings: IndexSettings, pc_settings: "PCSettings") -> "Starlette":
    """IS and PC in one app: the PC looks up in the IS store, the IS reads the PC's registry."""
    from pc.controller import PlacementController
    from pc.placement import replica_store_lookup
    from pc.routes import create_pc_routes

    pc = PlacementController(pc_settings,
                             lookup=replica_store_lookup(index_settings.store, index_settings.clock))
    index_settings.instances = pc.registry
    app = create_app(index_settings, extra_routes=create_pc_routes(pc), on_startup=[pc.start],
                     on_shutdown=[pc.close])
    app.state.pc = pc
    return app


def check_serving(args: argparse.Namespace) -> list[str]:
    """The refusals of `kvsp_moq.serving` for these options (SettingError), before anything is
    bound; the warnings to log at start."""
    host, _ = parse_listen(args.listen, DEFAULT_PORT)
    warnings = check_exposure("the index", host, authenticated=args.principals is not None,
                              insecure_open=getattr(args, "insecure_open", False))
    public_url = normalize_public_url(getattr(args, "public_url", None))
    if args.start_command and args.role != "is":  # the only place it tells others its URL
        check_advertised(host, public_url)
    return warnings


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 with one line on stderr when the options are refused."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        host, port = parse_listen(args.listen, DEFAULT_PORT)
        warnings = check_serving(args)
        public_url = normalize_public_url(getattr(args, "public_url", None))
        settings = settings_from_args(args)
        pc_settings = pc_settings_from_args(args) if args.role != "is" else None
        sock = listening(host, port)  # a port in use is one line, before the PC opens its db
    except (KvspError, ValueError, OSError) as e:  # SettingError is a ValueError
        print(f"kvsp index: {getattr(e, 'detail', e)}", file=sys.stderr)
        return 2
    for warning in warnings:
        log.warning("%s", warning)
    if public_url:
        log.info("public URL %s", public_url)
    if settings.auth.is_open and not warnings:
        log.warning("running OPEN: no principals file, every request is allowed (loopback only)")
    else:
        log.info("authenticating with principals from %s", args.principals)
    log.info("index service on http://%s:%d/ (max ttl %d ms)", host, port, settings.max_ttl_ms)
    if args.role != "pc":
        log.info("replica store: %s", "memory" if args.store == "memory" else settings.store)
    if pc_settings is not None and pc_settings.store is not None:
        log.info("PC state (instances, sessions, shard maps) in %s, shared with every PC on it",
                 redacted(pc_settings.store))
    elif pc_settings is not None:
        db = pc_settings.database
        log.info("PC sessions and shard maps in %s", db if db == ":memory:" else Path(db).resolve())
    if pc_settings is None:  # role "is"
        app = create_app(settings)
    elif args.role == "pc":
        from pc.app import create_pc_app

        app = create_pc_app(pc_settings)
    else:
        app = create_combined_app(settings, pc_settings)
    log.info("roles: %s", {"is": "Index Service", "pc": "Placement Controller",
                           "both": "Index Service + Placement Controller"}[args.role])
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
    return 0
