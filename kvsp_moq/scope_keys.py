"""The scope keys file (DESIGN §3): the one format every command reads scope keys from.

A TOML file of `name = "hex key"` lines, each key at least 32 octets. The PC, the agents,
`kvsp block-keys`, `kvsp lookup` and `kvsp keys` all read it here, so a file that one of them
accepts, every one accepts. Parsing is apart from reading so that callers with a mapping in
hand (tests, the bench) validate it the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping

from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol.keys import MIN_SCOPE_KEY_OCTETS, parse_scope_key_hex

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")

#: Scope name used when no keys file is given (loopback demos only).
OPEN_SCOPE = "default"
#: Derived from a public label: anyone can compute it, so it protects nothing; it only lets
#: instances started without a keys file on one machine (agents, vLLM) share caches.
OPEN_SCOPE_KEY = hashlib.sha256(b"kvsp-moq open loopback scope key").digest()


def parse_scope_keys(data: Mapping[str, Any], where: str = "scope keys") -> dict[str, bytes]:
    """Scope name -> key from a parsed keys file; `where` prefixes each refusal."""
    keys: dict[str, bytes] = {}
    for name, text in data.items():
        if not isinstance(text, str):
            raise BadRecord(f"{where}: scope {name!r} must be hex text")
        try:
            key = bytes.fromhex("".join(text.split()))
        except ValueError:
            raise BadRecord(f"{where}: scope {name!r} must be hex text") from None
        if len(key) < MIN_SCOPE_KEY_OCTETS:
            raise BadRecord(f"{where}: scope {name!r}: a scope key must have at least "
                            f"{MIN_SCOPE_KEY_OCTETS} octets")
        keys[name] = key
    return keys


def read_scope_keys(path: str | Path) -> dict[str, bytes]:
    """Scope name -> key from a keys file; a file without keys is refused (a mistake, surely)."""
    where = f"scope keys file {path}"
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise BadRecord(f"cannot read {where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise BadRecord(f"{where} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise BadRecord(f"{where} is not valid TOML: {e}") from None
    keys = parse_scope_keys(data, where)
    if not keys:
        raise BadRecord(f"{where} holds no keys")
    return keys


def choose_scope(keys: Mapping[str, bytes], name: str | None, path: str | Path) -> tuple[str, bytes]:
    """The scope `name` names, or the file's only scope when `name` is None."""
    if name is None:
        if len(keys) == 1:
            return next(iter(keys.items()))
        raise BadRecord(f"--scope NAME is needed: {path} holds {len(keys)} scopes "
                        f"({', '.join(sorted(keys))})")
    if name not in keys:
        raise BadRecord(f"no scope named {name!r} in {path} (it holds {', '.join(sorted(keys))})")
    return name, keys[name]


# --------------------------------------------------------------------------- writing


def toml_string(text: str) -> str:
    """`text` as a TOML basic string (JSON's escapes are TOML's, but for DEL)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_key(name: str) -> str:
    """`name` as a TOML key: bare where TOML allows, quoted otherwise."""
    return name if _BARE_KEY.match(name) else toml_string(name)


def scope_key_entry(name: str, key: bytes) -> str:
    """One line of a keys file, newline included."""
    if not name:
        raise BadRecord("a scope name must not be empty")
    return f"{toml_key(name)} = {toml_string(key.hex())}\n"


# --------------------------------------------------------------------------- command line


def add_scope_key_options(p: argparse.ArgumentParser) -> None:
    """--scope-keys FILE and --scope NAME, for commands that derive Block Keys."""
    p.add_argument("--scope-keys", metavar="FILE",
                   help="keys file (TOML: scope name = \"hex key\"), as the PC and agents read")
    p.add_argument("--scope", metavar="NAME",
                   help="scope in the keys file (needed when it holds more than one)")
    # Deprecated: a bare hex file. Kept for one release; not shown in --help.
    p.add_argument("--scope-key-file", metavar="KEYFILE", help=argparse.SUPPRESS)


def scope_key_from_args(args: argparse.Namespace, warn: Callable[[str], None]) -> bytes:
    """The scope key the options name; the deprecated --scope-key-file still works, with a
    line through `warn`."""
    if getattr(args, "scope_key_file", None):
        if args.scope_keys:
            raise BadRecord("give --scope-keys or --scope-key-file, not both")
        warn("--scope-key-file is deprecated and will be removed; use --scope-keys FILE "
             "(TOML: name = \"hex key\", see `kvsp keys scope`)")
        try:
            text = Path(args.scope_key_file).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise BadRecord(f"cannot read scope key file {args.scope_key_file}: {e}") from None
        return parse_scope_key_hex(text)
    if not args.scope_keys:
        raise BadRecord("--scope-keys FILE is required")
    _, key = choose_scope(read_scope_keys(args.scope_keys), args.scope, args.scope_keys)
    return key
