"""`kvsp keys`: the key material of a deployment, made rather than hand-written (DESIGN §3).

    kvsp keys token [--out FILE [--force]]
    kvsp keys principal --name NAME [--role R]... [--scope ID|NAME|*]... [--holder URL|*]...
                        (--token TOKEN | --token-file FILE) [--scope-keys FILE] [--append FILE]
    kvsp keys scope NAME [--out FILE [--force] | --append FILE] [--json]
    kvsp keys scope-id --scope-keys FILE [NAME...] [--json]

A principals entry carries the SHA-256 of its token, never the token. Secrets are written with
mode 0600, an existing --out file is replaced only with --force, and an --append refuses a name
or token already in the file, so that a typo cannot silently shadow another principal. Every
entry is read back with the project's own readers before it is written.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import secrets
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit

from kvsp_moq.auth import ANY, ROLES, Authenticator, principal_entry, token_digest
from kvsp_moq.errors import KvspError
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.scope_keys import parse_scope_keys, read_scope_keys, scope_key_entry
from kvsp_moq.tools import EXIT_USAGE, UsageError, say

_SCOPE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
_HOLDER_SCHEMES = ("http", "https", "moqt")
SCOPE_KEY_OCTETS = 32


# --------------------------------------------------------------------------- validation


def check_roles(values: Iterable[str]) -> list[str]:
    """Roles given as repeated and/or comma-separated options, each one of auth.ROLES."""
    roles: list[str] = []
    for value in values:
        for role in (r.strip() for r in value.split(",")):
            if role not in ROLES:
                raise UsageError(f"unknown role {role!r}; roles are {', '.join(sorted(ROLES))}")
            if role not in roles:
                roles.append(role)
    return roles


def check_scopes(values: Iterable[str], names: dict[str, bytes] | None = None) -> list[str]:
    """Scope IDs (32 hex digits, KVSP §4.2), `*`, or scope names of a keys file when given."""
    out: list[str] = []
    for value in values:
        if names is not None and value in names:
            sid = scope_id(names[value]).hex()
        elif value == ANY or _SCOPE_ID.match(value):
            sid = value.lower()
        else:
            hint = " nor a scope of --scope-keys" if names is not None else \
                " (`kvsp keys scope-id` prints them, or give --scope-keys to use names)"
            raise UsageError(f"--scope {value!r} is not a Scope ID (32 hex digits) or *{hint}")
        if sid not in out:
            out.append(sid)
    return out


def check_holders(values: Iterable[str]) -> list[str]:
    """Holder base URLs, normalised as the principals reader does, or `*`."""
    out: list[str] = []
    for value in values:
        if value != ANY:
            parts = urlsplit(value)
            if parts.scheme not in _HOLDER_SCHEMES or not parts.netloc:
                raise UsageError(f"--holder {value!r} is not a holder base URL "
                                 f"(http://HOST:PORT/, https://... or moqt://...) or *")
            value = base_url(value)
        if value not in out:
            out.append(value)
    return out


def check_token(token: str) -> str:
    """The token as servers compare it (surrounding whitespace is not part of it)."""
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise UsageError("a bearer token must be non-empty and hold no whitespace")
    return token


def existing_principals(text: str, path: str) -> list[dict[str, Any]]:
    """The `[[principal]]` entries of a principals file's text, validated as servers would."""
    try:
        data = tomllib.loads(text)
        Authenticator.from_mapping(data)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"principals file {path} is not valid TOML: {e}") from None
    except KvspError as e:
        raise UsageError(f"principals file {path}: {e.detail}") from None
    entries = data.get("principal", [])
    return entries if isinstance(entries, list) else []


def refuse_duplicate_principal(entries: Sequence[dict[str, Any]], name: str, digest: str,
                               path: str) -> None:
    for entry in entries:
        if entry.get("name") == name:
            raise UsageError(f"a principal named {name!r} is already in {path}")
        theirs = entry.get("token_sha256")
        if theirs is None and "token" in entry:
            theirs = token_digest(str(entry["token"]))
        if isinstance(theirs, str) and theirs.lower() == digest:
            raise UsageError(f"this token is already in {path} (principal "
                             f"{entry.get('name', '?')!r}); make a new one with `kvsp keys token`")


def joined(existing: str, entry: str, *, blank_line: bool) -> str:
    """What to append to `existing` so that `entry` starts on a line of its own."""
    if not existing:
        return entry
    sep = "" if existing.endswith("\n") else "\n"
    return sep + ("\n" if blank_line else "") + entry


# --------------------------------------------------------------------------- files


def _warn(command: str, text: str) -> None:
    say(f"keys {command}", f"warning: {text}")


def write_new_private(path: str, text: str, *, force: bool) -> None:
    """Write a new file with mode 0600, whole or not at all; replace one only with `force`."""
    target = Path(path)
    if target.exists() and not force:
        raise UsageError(f"{path} exists; --force replaces it")
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # mkstemp makes it 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)  # fails, rather than replaces, if the file appeared meanwhile
    except FileExistsError:
        raise UsageError(f"{path} exists; --force replaces it") from None
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def append_private(path: str, command: str, addition: Callable[[str], str]) -> None:
    """Append `addition(existing text)` to a file, created with mode 0600 when missing.

    The file is locked from reading to writing, so two appends at once cannot both pass the
    duplicate checks `addition` makes.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as e:
        raise UsageError(f"cannot open {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "r+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        mode = os.fstat(f.fileno()).st_mode & 0o777
        try:
            existing = f.read().decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not UTF-8 text") from None
        text = addition(existing)
        try:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    if mode & 0o077:
        _warn(command, f"{path} is readable or writable by others (mode {mode:04o}); "
                       f"chmod 600 {path}")


def read_token(args: argparse.Namespace) -> str:
    if args.token is not None:
        return check_token(args.token)
    try:
        text = sys.stdin.read() if args.token_file == "-" else \
            Path(args.token_file).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read token file {args.token_file}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"token file {args.token_file} is not UTF-8 text") from None
    return check_token(text)


# --------------------------------------------------------------------------- subcommands


def cmd_token(args: argparse.Namespace) -> int:
    token = secrets.token_urlsafe(32)
    if args.out:
        write_new_private(args.out, token + "\n", force=args.force)
    else:
        print(token)
    return 0


def cmd_principal(args: argparse.Namespace) -> int:
    if not args.name.strip():
        raise UsageError("--name must not be empty")
    roles = check_roles(args.role)
    names = read_scope_keys(args.scope_keys) if args.scope_keys else None
    scopes = check_scopes(args.scope, names)
    holders = check_holders(args.holder)
    digest = token_digest(read_token(args))
    entry = principal_entry(args.name, digest, scopes, holders, roles)
    Authenticator.from_mapping(tomllib.loads(entry))  # reads back as servers will read it
    if not args.append:
        sys.stdout.write(entry)
        return 0

    def addition(existing: str) -> str:
        refuse_duplicate_principal(existing_principals(existing, args.append), args.name,
                                   digest, args.append)
        text = joined(existing, entry, blank_line=True)
        existing_principals(existing + text, args.append)  # the whole file still reads
        return text

    append_private(args.append, "principal", addition)
    return 0


def _keys_in(text: str, path: str) -> dict[str, bytes]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"scope keys file {path} is not valid TOML: {e}") from None
    return parse_scope_keys(data, f"scope keys file {path}")


def cmd_scope(args: argparse.Namespace) -> int:
    if not args.name:
        raise UsageError("a scope name must not be empty")
    if args.force and not args.out:
        raise UsageError("--force goes with --out")
    key = secrets.token_bytes(SCOPE_KEY_OCTETS)
    entry = scope_key_entry(args.name, key)
    sid = scope_id(key).hex()
    path = args.out or args.append
    if args.out:
        write_new_private(args.out, entry, force=args.force)
    elif args.append:
        def addition(existing: str) -> str:
            if args.name in _keys_in(existing, args.append):
                raise UsageError(f"a scope named {args.name!r} is already in {args.append}")
            text = joined(existing, entry, blank_line=False)
            _keys_in(existing + text, args.append)
            return text

        append_private(args.append, "scope", addition)
    if args.json:
        out: dict[str, Any] = {"name": args.name, "scope_id": sid, "key_file": path}
        if path is None:
            out["key"] = key.hex()
        print(json.dumps(out))
    elif path is None:
        sys.stdout.write(entry)
        say("keys scope", f"Scope ID of {args.name}: {sid}")
    else:
        print(sid)
    return 0


def cmd_scope_id(args: argparse.Namespace) -> int:
    keys = read_scope_keys(args.scope_keys)
    wanted = args.names or list(keys)
    missing = [n for n in wanted if n not in keys]
    if missing:
        raise UsageError(f"no scope named {missing[0]!r} in {args.scope_keys} "
                         f"(it holds {', '.join(sorted(keys))})")
    ids = {name: scope_id(keys[name]).hex() for name in wanted}
    if args.json:
        print(json.dumps(ids))
    elif args.names:
        print("\n".join(ids[n] for n in wanted))
    else:
        print("\n".join(f"{sid}  {name}" for name, sid in ids.items()))
    return 0


# --------------------------------------------------------------------------- parser


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Make bearer tokens, principals entries (TOML, with the token's SHA-256) "
                     "and scope keys, and print Scope IDs. Secrets are written with mode 0600.")
    sub = p.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    sub.required = True

    s = sub.add_parser("token", help="print a new random bearer token",
                       description="Print a new random bearer token (32 random octets, "
                                   "URL-safe base64).")
    s.add_argument("--out", metavar="FILE", help="write it to FILE (mode 0600) instead")
    s.add_argument("--force", action="store_true", help="replace an existing --out file")
    s.set_defaults(keys_func=cmd_token)

    s = sub.add_parser("principal", help="print or append a [[principal]] entry",
                       description="Print one [[principal]] entry of a principals file, with "
                                   "the SHA-256 of the token (never the token itself).")
    s.add_argument("--name", required=True, help="the principal's name (in logs and errors)")
    s.add_argument("--role", action="append", default=[], metavar="ROLE",
                   help=f"one of {', '.join(sorted(ROLES))} (repeatable, or comma-separated); "
                        "each role's actions: README, Tokens and principals")
    s.add_argument("--scope", action="append", default=[], metavar="SCOPE_ID|NAME|*",
                   help="a Scope ID (32 hex digits), a scope name of --scope-keys, or * for "
                        "every scope (repeatable)")
    s.add_argument("--holder", action="append", default=[], metavar="URL|*",
                   help="holder base URL it may publish records for, or * (repeatable)")
    token = s.add_mutually_exclusive_group(required=True)
    token.add_argument("--token", metavar="TOKEN", help="the bearer token (visible to ps)")
    token.add_argument("--token-file", metavar="FILE",
                       help="file holding the bearer token, or - for stdin")
    s.add_argument("--scope-keys", metavar="FILE",
                   help="keys file whose scope names --scope may use")
    s.add_argument("--append", metavar="FILE",
                   help="append to this principals file (created with mode 0600), refusing a "
                        "name or token already in it")
    s.set_defaults(keys_func=cmd_principal)

    s = sub.add_parser("scope", help="make a random scope key",
                       description="Make a random 32-octet scope key and print its keys-file "
                                   "line (NAME = \"hex\"), with its Scope ID on stderr; with a "
                                   "file, write the line there and print the Scope ID.")
    s.add_argument("name", metavar="NAME", help="the scope's name in the keys file")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE", help="write a new keys file (mode 0600)")
    where.add_argument("--append", metavar="FILE",
                       help="append to a keys file (created with mode 0600), refusing a name "
                            "already in it")
    s.add_argument("--force", action="store_true", help="replace an existing --out file")
    s.add_argument("--json", action="store_true",
                   help="print {name, scope_id, key_file} (and key, when no file is written)")
    s.set_defaults(keys_func=cmd_scope)

    s = sub.add_parser("scope-id", help="print the Scope IDs of a keys file",
                       description="Print the Scope ID (KVSP §4.2) of each named scope, one "
                                   "per line; without names, 'SCOPE_ID  NAME' for every scope.")
    s.add_argument("--scope-keys", required=True, metavar="FILE", help="keys file (TOML)")
    s.add_argument("names", nargs="*", metavar="NAME", help="scopes to print (default: all)")
    s.add_argument("--json", action="store_true", help="print {name: scope_id}")
    s.set_defaults(keys_func=cmd_scope_id)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run a subcommand; a refusal is one line on stderr and exit status 2."""
    name = f"keys {args.keys_command}"
    try:
        return int(args.keys_func(args))
    except UsageError as e:
        say(name, str(e))
    except KvspError as e:
        say(name, e.detail)
    except BrokenPipeError:
        return 0
    return EXIT_USAGE
