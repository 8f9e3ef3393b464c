"""`kvsp put`: store a container at a holder (KVSP §6.7 PUT with If-None-Match: *).

The container is parsed here first, so a wrong file is refused before anything is sent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvsp_moq.errors import KvspError, reason_of
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tools import Failed, UsageError, add_common, guarded, hex_arg


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Store a KV block container at a holder with PUT and If-None-Match: *, and print the "
        "Replica Record the holder answers with. A holder that already holds the block keeps "
        "its copy (exit 1).")
    p.add_argument("holder", metavar="HOLDER", help="the holder's HTTP base URL")
    p.add_argument("file", metavar="FILE", help="container file, or - for stdin")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return guarded("put", lambda: _put(args), args)


async def _put(args: argparse.Namespace) -> int:
    import httpx

    from kvsp_moq.index_client import raise_for_problem
    from kvsp_moq.protocol.container import MEDIA_TYPE, Container

    if not args.holder.lower().startswith(("http://", "https://")):
        raise UsageError(f"HOLDER must be an http:// or https:// URL, not {args.holder!r}")
    compat = hex_arg(args.compat, 32, "compat_id")
    scope = hex_arg(args.scope, 16, "scope_id")
    key = hex_arg(args.key, 32, "key")
    if compat is None or scope is None or key is None:
        raise UsageError("--compat, --scope and --key are required")
    try:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {args.file}: {e.strerror or e}") from None
    try:
        Container(data)
    except KvspError as e:
        raise UsageError(f"{args.file} is not a KVB1 container: {e.detail}") from None
    url = f"{base_url(args.holder)}blocks/{compat}/{scope}/{key}"
    headers = {"If-None-Match": "*", "Content-Type": MEDIA_TYPE}
    if args.token:
        headers["Authorization"] = f"Bearer {args.token}"
    try:
        async with httpx.AsyncClient(timeout=args.timeout, trust_env=False) as client:
            response = await client.put(url, content=data, headers=headers)
    except httpx.HTTPError as e:
        raise Failed(f"holder {args.holder} unreachable: {reason_of(e, named=True)}") from None
    if response.status_code == 412:
        raise Failed(f"{args.holder} already holds block {key}; its copy is kept")
    raise_for_problem(response)
    if response.status_code not in (200, 201):
        raise Failed(f"unexpected answer HTTP {response.status_code} from {args.holder}")
    try:
        print(json.dumps(response.json()))
    except ValueError:
        raise Failed(f"{args.holder} answered {response.status_code} without a record") from None
    return 0
