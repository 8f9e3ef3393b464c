"""`kvsp get`: fetch one block (or a layer range) from a holder or a relay, verified.

Every layer is checked against the Replica Record's layer digest before it counts, so a
source can be any server at all; the record comes from a file or from the Index Service.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvsp_moq.cli import STARTED
from kvsp_moq.errors import ForbiddenScope, KvspError, NotFound, Unauthorized
from kvsp_moq.moqt.certs import add_relay_tls_options
from kvsp_moq.protocol.container import Container, Layer, encode
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tools import (
    Failed,
    UsageError,
    add_common,
    guarded,
    hex_arg,
    layer_range,
    read_record,
)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Fetch a KV block, or a range of its layers, from an HTTP holder (http://...) or a MOQT "
        "relay (moqt://...), verify every layer against the block's Replica Record, and write "
        "the container. The record is read from --record, or looked up in the Index Service "
        "given by --index (the replica at SOURCE; for a relay, any MOQT replica). Exit status: "
        "0 fetched, 1 the fetch failed (miss, unreachable, digest mismatch), 2 bad arguments "
        "or a token refused (401, 403).")
    p.add_argument("source", metavar="SOURCE", help="http(s)://holder/ or moqt://relay:port")
    add_common(p)
    p.add_argument("--layers", metavar="A-B", help="inclusive layer range (default: all)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--record", metavar="FILE", help="Replica Record (JSON) to verify against")
    where.add_argument("--index", metavar="URL", help="Index Service to look the record up in")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write the container, - for stdout (default: stdout unless it "
                        "is a terminal; nothing with --json)")
    p.add_argument("--json", action="store_true",
                   help="print a summary (timings, source, layers, failures) as JSON on stdout")
    add_relay_tls_options(p, aliases=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return guarded("get", lambda: _get(args), args)


def relay_tls(args: argparse.Namespace, relay: str) -> Any:
    """`client_tls` for the relay, from --relay-ca / --relay-insecure; its note on stderr when
    the certificate goes unchecked (a warning with --relay-insecure; a loopback relay's only
    when stderr is a terminal, so scripts' stderr stays clean)."""
    from kvsp_moq.errors import SettingError
    from kvsp_moq.moqt.certs import client_tls

    try:
        tls = client_tls(relay, cafile=args.relay_ca, insecure=args.relay_insecure)
    except SettingError as e:
        raise UsageError(str(e)) from None
    if tls.note and (tls.warn or sys.stderr.isatty()):
        print(f"{'warning' if tls.warn else 'note'}: {tls.note}", file=sys.stderr)
    return tls


async def pick_record(args: argparse.Namespace, moqt: bool) -> ReplicaRecord:
    """The record to verify against: the file's, or the index's replica at SOURCE."""
    compat = hex_arg(args.compat, 32, "compat_id")
    scope = hex_arg(args.scope, 16, "scope_id")
    key = hex_arg(args.key, 32, "key")
    if args.record:
        record = read_record(args.record)
        for given, have, what in ((compat, record.compat_id, "compat"),
                                  (scope, record.scope_id, "scope"), (key, record.block_key, "key")):
            if given is not None and given != have:
                raise UsageError(f"--{what} {given} differs from the record's {have}")
        return record
    if not args.index:
        raise UsageError("give --record FILE or --index URL: a block is verified against its record")
    if compat is None or scope is None or key is None:
        raise UsageError("--compat, --scope and --key are needed to look the block up")
    from kvsp_moq.index_client import IndexClient

    async with IndexClient(args.index, token=args.token, timeout=args.timeout) as index:
        result = await index.lookup(scope, compat, [key])
    replicas = [r for b in result.blocks if b.block_key == key for r in b.replicas]
    if not replicas:
        raise NotFound(f"the index at {args.index} knows no replica of block {key}")
    source = base_url(args.source).lower()
    same = [r for r in replicas if base_url(r.holder).lower() == source]
    if same:
        return same[0]
    if moqt:
        listed = [r for r in replicas if r.is_moqt]
        if listed:
            return listed[0]
        http = [r for r in replicas if not r.is_moqt]
        from kvsp_moq.naming import moqt_record

        return moqt_record(http[0], args.source)
    held = ", ".join(sorted({r.holder for r in replicas}))
    raise NotFound(f"the index lists no replica of block {key} at {args.source} (it lists {held})")


class Progress:
    """Layer-by-layer progress on stderr, only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.enabled = sys.stderr.isatty()
        self.done = 0
        self.octets = 0

    def layer(self, layer: Layer) -> None:
        self.done += 1
        self.octets += len(layer.k) + len(layer.v)
        if self.enabled:
            print(f"\rlayer {layer.index} ({self.done}/{self.total})  {self.octets / 1e6:.1f} MB",
                  end="", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.enabled and self.done:
            print(file=sys.stderr, flush=True)


#: How a source's refusal of the token reads in a fetch's failures: an HTTP 401 or 403, or a
#: MOQT REQUEST_ERROR about authorization (`kvsp_moq.fetch`).
_REFUSED = re.compile(r"^(?:HTTP 40[13]\b|(?:UNAUTHORIZED|MALFORMED_AUTH_TOKEN|EXPIRED_AUTH_TOKEN):)")


def _refusal(error: KvspError) -> KvspError | None:
    """An Unauthorized (exit status 2) when every source refused the token, else None."""
    failures = getattr(error, "failures", None) or []
    if failures and all(_REFUSED.match(reason) for _, reason in failures):
        forbidden = any(reason.startswith("HTTP 403") for _, reason in failures)
        return (ForbiddenScope if forbidden else Unauthorized)(error.detail)
    return None


def _write(output: str, data: bytes | bytearray | memoryview) -> None:
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    path = Path(output)
    part = path.with_name(path.name + ".part")
    try:
        part.write_bytes(data)
        os.replace(part, path)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise Failed(f"cannot write {output}: {e.strerror or e}") from None


async def _get(args: argparse.Namespace) -> int:
    source = args.source
    scheme = source.split("://", 1)[0].lower() if "://" in source else ""
    if scheme not in ("http", "https", "moqt"):
        raise UsageError(f"SOURCE must be an http://, https:// or moqt:// URL, not {source!r}")
    moqt = scheme == "moqt"
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    wanted = layer_range(args.layers)
    output = args.output
    if output is None and not args.json:
        if sys.stdout.isatty():
            raise UsageError("refusing to write a binary container to a terminal; give -o FILE")
        output = "-"
    if output == "-" and args.json:
        raise UsageError("--json and -o - both write to stdout; give -o FILE")
    if moqt:  # imported before the clock starts: a transfer's figures are the transfer's
        from kvsp_moq.fetch.moqt import MoqtBlockFetcher
        from kvsp_moq.naming import moqt_record
    else:
        from kvsp_moq.fetch.http import HttpFetcher
    report: dict[str, Any] = {"source": source}
    try:
        record = await pick_record(args, moqt)
        if moqt and not record.is_moqt:
            record = moqt_record(record, source)  # an HTTP record names the same layers
        if moqt and base_url(record.holder).lower() != base_url(source).lower():
            record = dataclasses.replace(record, holder=source)
        n = record.layer_count
        if wanted is not None and n is not None and wanted[1] >= n:
            raise UsageError(f"--layers {args.layers}: the block has layers 0-{n - 1}")
        report["record_holder"] = record.holder
        total = (wanted[1] - wanted[0] + 1) if wanted else (n or 0)
        await _fetch(args, source, moqt, record, wanted, total, output, report,
                     MoqtBlockFetcher if moqt else HttpFetcher)
    except (KvspError, Failed, UsageError) as e:
        if args.json:  # a script reading stdout learns why, not only the exit status
            report["error"] = getattr(e, "detail", None) or str(e)
            report["total_seconds"] = round(time.perf_counter() - STARTED, 6)
            print(json.dumps(report))
        raise
    if args.json:
        print(json.dumps(report))
    return 0


async def _fetch(args: argparse.Namespace, source: str, moqt: bool, record: ReplicaRecord,
                 wanted: tuple[int, int] | None, total: int, output: str | None,
                 report: dict[str, Any], fetcher_class: Any) -> None:
    """Fetch, verify and write the layers, filling `report` as it goes: "seconds" is the
    transfer (connection included, closing not), "close_seconds" the close after it, and
    "total_seconds" everything since the command started (imports included)."""
    progress = Progress(total)
    if moqt:
        fetcher: Any = fetcher_class(token=args.token, tls=relay_tls(args, source),
                                     timeout=args.timeout, layer_timeout=args.timeout)
    else:
        fetcher = fetcher_class(token=args.token, timeout=args.timeout)
    started = time.perf_counter()
    stream = fetcher.layers([source], record, wanted)
    got: list[Layer] = []
    seconds = None
    try:
        try:
            async for layer in stream:
                got.append(layer)
                progress.layer(layer)
        except KvspError as e:
            if moqt and source in fetcher.untrusted:  # not a failed fetch: fix the options
                raise UsageError(fetcher.untrusted[source]) from None
            refusal = _refusal(e)
            if refusal is not None:  # exit status 2, as for `kvsp put`: fix the token
                raise refusal from None
            raise
        finally:
            progress.finish()
            seconds = time.perf_counter() - started
            report.update({
                "bytes_received": stream.bytes_received, "layer_count": len(got),
                "seconds": round(seconds, 6),
                "first_layer_ms": None if stream.first_layer_seconds is None
                else round(stream.first_layer_seconds * 1000, 3),
                "failures": [{"source": s, "reason": r} for s, r in stream.failures],
                "notes": list(stream.notes)})
        container = stream.container_if_single() if not moqt else None
        if container is None or (container.first_layer, container.last_layer) != (
                got[0].index, got[-1].index):  # several responses, or MOQT objects: rebuild
            container = Container(encode(got[0].index, stream.token_count or 0,
                                         [(layer.k, layer.v) for layer in got], codec=record.codec))
    finally:
        closing = time.perf_counter()
        await fetcher.aclose()
        report["close_seconds"] = round(time.perf_counter() - closing, 6)
    data = container.buffer
    if output is not None:
        _write(output, data)
    octets = sum(len(layer.k) + len(layer.v) for layer in got)
    report.update({
        "layers": [got[0].index, got[-1].index],
        "token_count": container.token_count,
        "container_bytes": len(data),
        "mb_per_s": round(octets / seconds / 1e6, 3) if seconds else None,
        "served_by": [list(s) for s in stream.served_by],
        "output": output,
        "total_seconds": round(time.perf_counter() - STARTED, 6)})
