"""Compatibility Descriptor and Compatibility ID (KVSP §4.1).

Two caches may substitute for each other only when their Compatibility IDs are equal, so
the descriptor is validated strictly: an unknown member would silently change the ID.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import rfc8785

from kvsp_moq.errors import BadDescriptor

COMPAT_LABEL = b"KVSP-COMPAT-1\x00"

#: KVSP Element Types registry (§11.2.3): name -> octets per element.
ELEMENT_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: KVSP Positional Encodings registry.
POSITIONAL_ENCODINGS = frozenset({"rope", "alibi", "learned", "none"})

#: KVSP Codecs registry (§11.2.2).
CODECS: dict[int, str] = {1: "raw"}
CODEC_RAW = 1

LAYOUTS = frozenset({"kvsp-layout-1"})

_DIGEST_RE = re.compile(r"^sha-256:[0-9a-f]{64}$")
_PARAM_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_PARAM_VALUE_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_MAX_INT = 2**31 - 1

_REQUIRED: dict[str, type] = {
    "model": str,
    "model_digest": str,
    "tokenizer_digest": str,
    "layers": int,
    "kv_heads": int,
    "head_dim": int,
    "kv_dtype": str,
    "positional": str,
    "block_tokens": int,
    "layout": str,
}
_OPTIONAL = {"adapters"}


def canonical_number(value: float | int) -> str:
    """Shortest round-trip text of a number, integers without a fraction (DESIGN §3)."""
    if isinstance(value, bool):
        raise ValueError("booleans are not numbers")
    f = float(value)
    if not math.isfinite(f):
        raise ValueError("number must be finite")
    if f.is_integer() and abs(f) < 1e16:
        return str(int(f))
    return repr(f)


def format_positional(name: str, params: Mapping[str, float | int | str] | None = None) -> str:
    """Build a registry-conformant positional string: names ascending, numbers canonical."""
    text = name
    params = params or {}
    for key in sorted(params):
        value = params[key]
        text += f";{key}={value if isinstance(value, str) else canonical_number(value)}"
    validate_positional(text)
    return text


def validate_positional(text: str) -> None:
    parts = text.split(";")
    if parts[0] not in POSITIONAL_ENCODINGS:
        raise BadDescriptor(f"unknown positional encoding {parts[0]!r}", member="positional")
    names: list[str] = []
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if not sep or not _PARAM_NAME_RE.match(name) or not value or not _PARAM_VALUE_RE.match(value):
            raise BadDescriptor(f"malformed parameter {part!r}", member="positional")
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and canonical_number(number) != value:
            raise BadDescriptor(
                f"parameter {name} must be written {canonical_number(number)}", member="positional"
            )
        names.append(name)
    if names != sorted(names) or len(set(names)) != len(names):
        raise BadDescriptor("parameters must be unique and in ascending order", member="positional")


def _check_digest(value: Any, member: str) -> str:
    if not isinstance(value, str) or not _DIGEST_RE.match(value):
        raise BadDescriptor('must be "sha-256:" and 64 lowercase hex digits', member=member)
    return value


@dataclass(frozen=True)
class CompatDescriptor:
    """A validated, immutable Compatibility Descriptor."""

    model: str
    model_digest: str
    tokenizer_digest: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    positional: str
    block_tokens: int
    layout: str = "kvsp-layout-1"
    adapters: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if not self.model:
            raise BadDescriptor("must be a non-empty string", member="model")
        _check_digest(self.model_digest, "model_digest")
        _check_digest(self.tokenizer_digest, "tokenizer_digest")
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_INT:
                raise BadDescriptor(f"must be an integer in [1, {_MAX_INT}]", member=name)
        if self.kv_dtype not in ELEMENT_SIZES:
            raise BadDescriptor(
                f"unknown element type {self.kv_dtype!r} (known: {', '.join(ELEMENT_SIZES)})",
                member="kv_dtype",
            )
        validate_positional(self.positional)
        if self.layout not in LAYOUTS:
            raise BadDescriptor(f"unknown layout {self.layout!r}", member="layout")
        if self.adapters is not None:
            if not isinstance(self.adapters, tuple) or not self.adapters:
                raise BadDescriptor("must be absent or a non-empty array", member="adapters")
            for i, digest in enumerate(self.adapters):
                _check_digest(digest, f"adapters[{i}]")

    @classmethod
    def from_dict(cls, data: Any) -> "CompatDescriptor":
        """Validate a parsed JSON descriptor; a refusal names the member at fault."""
        if not isinstance(data, dict):
            raise BadDescriptor("descriptor must be a JSON object")
        unknown = sorted(set(data) - set(_REQUIRED) - _OPTIONAL)
        if unknown:
            raise BadDescriptor("unknown member (it would change the ID)", member=unknown[0])
        for name, kind in _REQUIRED.items():
            if name not in data:
                raise BadDescriptor("required member is missing", member=name)
            value = data[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise BadDescriptor(f"must be a {'string' if kind is str else 'integer'}", member=name)
        adapters = data.get("adapters")
        if "adapters" in data:
            if not isinstance(adapters, list) or not adapters:
                raise BadDescriptor("must be absent or a non-empty array", member="adapters")
            adapters = tuple(adapters)
        return cls(
            model=data["model"],
            model_digest=data["model_digest"],
            tokenizer_digest=data["tokenizer_digest"],
            layers=data["layers"],
            kv_heads=data["kv_heads"],
            head_dim=data["head_dim"],
            kv_dtype=data["kv_dtype"],
            positional=data["positional"],
            block_tokens=data["block_tokens"],
            layout=data["layout"],
            adapters=adapters,
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: getattr(self, name) for name in _REQUIRED}
        if self.adapters is not None:
            data["adapters"] = list(self.adapters)
        return data

    @property
    def compat_id(self) -> bytes:
        """SHA-256("KVSP-COMPAT-1" || 0x00 || JCS(descriptor)), 32 octets."""
        return hashlib.sha256(COMPAT_LABEL + rfc8785.dumps(self.to_dict())).digest()

    @property
    def compat_hex(self) -> str:
        return self.compat_id.hex()

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZES[self.kv_dtype]

    def section_bytes(self, token_count: int) -> int:
        """Octets of one K (or V) section of a raw layer holding `token_count` tokens."""
        return token_count * self.kv_heads * self.head_dim * self.element_size

    def block_bytes(self, token_count: int | None = None) -> int:
        """Payload octets of a full raw block (all layers, K and V)."""
        tokens = self.block_tokens if token_count is None else token_count
        return 2 * self.layers * self.section_bytes(tokens)


def compat_id(descriptor: Mapping[str, Any] | CompatDescriptor) -> bytes:
    """Compatibility ID of a descriptor, validating it first."""
    if not isinstance(descriptor, CompatDescriptor):
        descriptor = CompatDescriptor.from_dict(dict(descriptor))
    return descriptor.compat_id


def content_digest(chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    """"sha-256:<hex>" of content given as its chunks in order (a file's, read by the caller:
    a tokenizer file's digest, for one)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return "sha-256:" + h.hexdigest()


def model_digest(files: Iterable[tuple[str, Iterable[bytes | bytearray | memoryview]]]) -> str:
    """Digest of weight files concatenated in ascending byte order of their file names.

    `files` pairs each file's name with its content as chunks, read by the caller; an
    iterator that reads the file as it is consumed keeps multi-GB weights out of memory.
    """
    ordered = sorted(files, key=lambda f: f[0].encode())
    if not ordered:
        raise BadDescriptor("no weight files", member="model_digest")
    h = hashlib.sha256()
    for _, chunks in ordered:
        for chunk in chunks:
            h.update(chunk)
    return "sha-256:" + h.hexdigest()
