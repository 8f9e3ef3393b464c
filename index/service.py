"""`kvsp index`: run the Index Service (and, later, the Placement Controller in-process)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import sys
from pathlib import Path

from index.app import IndexSettings, create_app
from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import KvspError
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.web import parse_listen, run as serve

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
    p.add_argument("--role", choices=("is", "pc", "both"), default="both",
                   help="which services this process runs (default both; only the Index "
                        "Service exists so far)")
    p.add_argument("--descriptor", action="append", default=[], metavar="DESCRIPTOR.json",
                   help="a Compatibility Descriptor whose block size lets lookups with "
                        "targets estimate recompute_us (repeatable)")
    p.add_argument("--block-tokens", type=int, metavar="B",
                   help="block size assumed for compat IDs without a --descriptor")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    return IndexSettings(auth=Authenticator.from_file(args.principals),
                         max_ttl_ms=args.max_ttl_ms, block_tokens=block_tokens,
                         default_block_tokens=args.block_tokens)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 with one line on stderr when the options are refused."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.role == "pc":
        print("kvsp index: the placement controller is not available yet; use --role is",
              file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(args)
        host, port = parse_listen(args.listen, DEFAULT_PORT)
    except (KvspError, ValueError) as e:
        print(f"kvsp index: {getattr(e, 'detail', e)}", file=sys.stderr)
        return 2
    if settings.auth.is_open and not _loopback(host):
        print(f"kvsp index: refusing to run open on {host}; give --principals or listen on "
              "127.0.0.1", file=sys.stderr)
        return 2
    if args.role == "both":
        log.info("role both: only the Index Service exists so far; no placement controller")
    if settings.auth.is_open:
        log.warning("running OPEN: no principals file, every request is allowed (loopback only)")
    else:
        log.info("authenticating with principals from %s", args.principals)
    log.info("index service on http://%s:%d/ (max ttl %d ms)", host, port, settings.max_ttl_ms)
    try:
        serve(create_app(settings), args.listen, DEFAULT_PORT)
    except OSError as e:
        print(f"kvsp index: cannot listen on {args.listen}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0
