"""Block tools of the `kvsp` command line: get, subscribe, put, lookup.

Each tool is a module with `configure_parser(p)` and `run(args) -> int`. A tool never lets a
traceback out: refusals (bad arguments, authorization) exit 2 and failed operations (a miss,
an unreachable source, a digest mismatch) exit 1, each with one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Coroutine

from kvsp_moq.auth import add_token_options, token_from_args
from kvsp_moq.errors import BadRecord, Failed, ForbiddenScope, KvspError, SettingError, Unauthorized, UsageError
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.records import ReplicaRecord

EXIT_FAILED = 1
EXIT_USAGE = 2

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")



def say(name: str, text: str) -> None:
    """One line on stderr, prefixed with the command's name."""
    print(f"kvsp {name}: {text}", file=sys.stderr, flush=True)


def guarded(name: str, body: Callable[[], Coroutine[Any, Any, int]],
            args: argparse.Namespace | None = None) -> int:
    """Run a tool's coroutine and turn every error into one line and an exit status; `args`'
    --token-file, if any, is read first (its token replaces args.token)."""
    try:
        if args is not None and hasattr(args, "token_file"):
            args.token = token_from_args(args)
        return asyncio.run(body())
    except (UsageError, SettingError) as e:
        say(name, str(e))
        return EXIT_USAGE
    except Failed as e:
        say(name, str(e))
        return EXIT_FAILED
    except (Unauthorized, ForbiddenScope) as e:
        say(name, e.detail)
        return EXIT_USAGE
    except KvspError as e:
        say(name, e.detail)
        return EXIT_FAILED
    except KeyboardInterrupt:
        say(name, "interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        say(name, f"{type(e).__name__}: {e.strerror or e}")
        return EXIT_FAILED
    except Exception as e:  # a bug must still read as one line, not a traceback
        say(name, f"unexpected error: {type(e).__name__}: {e}")
        return EXIT_FAILED


def hex_arg(value: str | None, octets: int, what: str) -> str | None:
    if value is None:
        return None
    try:
        return v.hexn(value.strip(), octets, what)
    except BadRecord:
        raise UsageError(f"--{what.replace('_id', '').replace('_', '-')} must be "
                         f"{2 * octets} hex digits") from None


def layer_range(text: str | None) -> tuple[int, int] | None:
    """`a-b` (or one layer `a`) as an inclusive range."""
    if text is None:
        return None
    m = _RANGE.match(text)
    if not m:
        raise UsageError(f"--layers must look like 0-7 or 3, not {text!r}")
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if a > b:
        raise UsageError(f"--layers {text}: the first layer is after the last")
    return a, b


def read_json_file(path: str, what: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno}") from None


def read_record(path: str) -> ReplicaRecord:
    data = read_json_file(path, "record")
    try:
        return ReplicaRecord.from_json(data)
    except KvspError as e:
        raise UsageError(f"record {path}: {e.detail}") from None


def add_common(p: argparse.ArgumentParser, *, block: bool = True, timeout: bool = True) -> None:
    """Options shared by the tools that address one block."""
    if block:
        p.add_argument("--compat", metavar="HEX", help="Compatibility ID (64 hex digits)")
        p.add_argument("--scope", metavar="HEX", help="Scope ID (32 hex digits)")
        p.add_argument("--key", metavar="HEX", help="Block Key (64 hex digits)")
    add_token_options(p, what="bearer token presented to every server")
    if timeout:
        p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                       help="seconds any one network step may take (default %(default)s)")
