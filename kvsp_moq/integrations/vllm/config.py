"""`kv_connector_extra_config` of the KVSP connector, parsed and checked before anything starts.

    "kv_connector_extra_config": {"index": "http://IS/", "scope_keys": "keys.toml",
        "scope": "team", "relay": "moqt://RELAY:4443", "holder": "embedded",
        "listen": "127.0.0.1:8801", "data": "DIR", "token_file": "TOKEN"}

With "pc" and "instance_url" the engine reports its status to the Placement Controller
(`integrations.vllm.status`).

A wrong value stops vLLM at start with one line that names the key (`SettingError`), never a
traceback from deep inside a worker: an engine that silently runs without its cache would
only be noticed in the latency graphs. Unknown keys are refused for the same reason (a typo
of "relay" must not quietly mean "no relay").

Without "scope_keys" the connector uses the agent's open loopback scope (its key is public), so
a vLLM and a `kvsp agent` started without keys files on one machine share blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from kvsp_moq.arguments import parse_listen
from kvsp_moq.cpus import format_cpu_list, parse_cpu_list, reserved_cpus, usable_cpus
from kvsp_moq.errors import KvspError, SettingError
from kvsp_moq.moqt.quic.settings import QuicSettings, check_engine, quic_settings
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY, choose_scope, read_scope_keys

__all__ = ["ConnectorConfig", "parse_extra_config"]

WHERE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector was configured with; both roles parse the same dict."""

    #: the Index Service's base URL (lookups and, through the holder, publishing)
    index: str
    scope_key: bytes
    scope: str
    #: "embedded" (a holder inside the worker), a holder's base URL (blocks are PUT there), or
    #: None (load only: nothing computed here is stored)
    holder: str | None = "embedded"
    #: where the embedded holder listens; port 0 takes a free one
    listen: str = "127.0.0.1:0"
    #: the embedded holder's base URL in its records (default http://LISTEN/)
    public_url: str | None = None
    #: the embedded holder's disk tier; blocks there survive a restart
    data: Path | None = None
    host_bytes: int = 1 << 30
    disk_bytes: int = 16 << 30
    #: the MOQT relay (moqt://HOST:PORT): loads go through it first, and the embedded holder
    #: publishes there too
    relay: str | None = None
    relay_ca: Path | None = None
    relay_insecure: bool = False
    relay_timeout_s: float = 5.0
    #: the bearer token presented to the IS, holders and the relay
    token: str | None = None
    #: the embedded holder's principals file; without it the holder runs open (loopback only)
    principals: Path | None = None
    lease_ms: int = 10_000
    #: how long the scheduler waits for a lookup (answering "ask again") before computing
    lookup_timeout_ms: int = 2_000
    #: how long a layer may be waited for before the blocks still missing are load errors
    load_timeout_s: float = 30.0
    record_ttl_ms: int = 60_000
    #: layers per block request: None sizes requests to about 1 MiB (the agent's rule); 1 loads
    #: strictly layer-major (layer l of every block before layer l+1 of any)
    layers_per_request: int | None = None
    load_concurrency: int = 8
    #: keep per-step load timelines (tests, the benchmark)
    timeline: bool = False
    #: False loads the whole prefix before the forward pass starts (the benchmark's baseline)
    pipelined: bool = True
    #: the interpreter's switch interval the worker sets, in microseconds (0: left alone); see
    #: `worker.WorkerSide`
    switch_interval_us: int = 200
    #: where the worker's loader threads run: "auto" (on a CPU backend, the cores vLLM keeps
    #: for a KV connector), "none" (left alone) or a CPU list; see `loader_cpus`
    cpus: str = "auto"
    #: the QUIC engine and datagram size of MOQT loads and of the embedded holder's publishing
    #: (keys "quic_engine" and "datagram_size"; by default those of the environment)
    quic: QuicSettings = field(default_factory=QuicSettings)
    #: the Placement Controller this engine reports its KVSP §6.3 status to (None: it does not)
    pc: str | None = None
    #: this engine's OpenAI-compatible base URL, as the PC routes to it and the gateway reaches it
    instance_url: str | None = None
    status_ttl_ms: int = 3_000
    #: publish each saved block's layers over MOQT as vLLM computes them (live KV: other
    #: instances subscribe while the prefill runs); needs "relay" and the embedded holder
    live_kv: bool = True
    #: which loads run beside the engine's steps rather than inside one (vLLM's asynchronous
    #: load, WAITING_FOR_REMOTE_KVS): "live" (blocks another instance is still computing, i.e.
    #: prefill and decode apart), "all", or "none". An asynchronous load lets the engine's other
    #: requests keep decoding while it waits; a synchronous one overlaps the request's own
    #: forward pass with its load layer by layer, which is faster for one request alone.
    load_async: str = "live"
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def embedded(self) -> bool:
        return self.holder == "embedded"

    def loader_cpus(self, device_type: str) -> frozenset[int] | None:
        """Where the worker's loader threads go on a worker whose cache lives on `device_type`
        (`cpus`); None leaves them where they are. "auto" picks the core `vllm serve` keeps
        out of its OpenMP binding for a KV connector, and only on a CPU backend: on a GPU the
        model does not compute on the host's cores."""
        if self.cpus == "none":
            return None
        if self.cpus == "auto":
            return reserved_cpus() if device_type == "cpu" else None
        return parse_cpu_list(self.cpus)  # checked when the settings were parsed


def _fail(key: str, problem: str) -> SettingError:
    return SettingError(f"{WHERE}: {key}: {problem}", member=key)


def _text(data: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
    value = data.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _fail(key, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _http_url(data: Mapping[str, Any], key: str) -> str | None:
    value = _text(data, key)
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise _fail(key, f"must be an http:// or https:// URL, got {value!r}")
    return value if value.endswith("/") else value + "/"


def _number(data: Mapping[str, Any], key: str, default: float, *, integer: bool = True,
            low: float = 1) -> Any:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not float(value).is_integer()):
        raise _fail(key, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value < low:
        raise _fail(key, f"must be at least {low}, got {value!r}")
    return int(value) if integer else float(value)


def _flag(data: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise _fail(key, f"must be true or false, got {value!r}")
    return value


def _file(data: Mapping[str, Any], key: str) -> Path | None:
    value = _text(data, key)
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise _fail(key, f"no such file: {value}")
    return path


_KEYS = frozenset({
    "index", "scope_keys", "scope", "holder", "listen", "public_url", "data", "host_bytes",
    "disk_bytes", "relay", "relay_ca", "relay_insecure", "relay_timeout_s", "token", "token_file",
    "principals", "lease_ms", "lookup_timeout_ms", "load_timeout_s", "record_ttl_ms",
    "layers_per_request", "load_concurrency", "timeline", "pipelined", "switch_interval_us",
    "cpus", "quic_engine", "datagram_size", "pc", "instance_url", "status_ttl_ms", "live_kv",
    "load_async",
})

LOAD_ASYNC = ("live", "all", "none")


def parse_extra_config(data: Mapping[str, Any] | None) -> ConnectorConfig:
    """The connector's settings from vLLM's `kv_connector_extra_config`; SettingError (one line
    naming the key) for anything missing, unknown or unusable."""
    data = dict(data or {})
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise _fail(unknown[0], f"unknown key (known: {', '.join(sorted(_KEYS))})")
    index = _http_url(data, "index")
    if index is None:
        raise _fail("index", "required: the Index Service's base URL, e.g. http://127.0.0.1:8700/")

    keys_file = _file(data, "scope_keys")
    scope = _text(data, "scope")
    if keys_file is not None:
        try:
            keys = read_scope_keys(keys_file)
            scope, scope_key = choose_scope(keys, scope, keys_file)
        except KvspError as e:
            raise _fail("scope_keys" if scope is None else "scope", e.detail) from None
    else:
        if scope is not None and scope != OPEN_SCOPE:
            raise _fail("scope", f"needs scope_keys (a keys file); without one the open scope "
                                 f"{OPEN_SCOPE!r} is used")
        scope, scope_key = OPEN_SCOPE, OPEN_SCOPE_KEY

    holder = data.get("holder", "embedded")
    if holder is not None and holder != "embedded":
        holder = _http_url(data, "holder")
    listen = _text(data, "listen", "127.0.0.1:0") or "127.0.0.1:0"
    try:
        parse_listen(listen)
    except SettingError:
        raise _fail("listen", f"must be HOST:PORT, got {listen!r}") from None
    public_url = _http_url(data, "public_url")
    data_dir = _text(data, "data")

    relay = _text(data, "relay")
    if relay is not None:
        parts = urlsplit(relay)
        if parts.scheme.lower() != "moqt" or not parts.hostname or not parts.port:
            raise _fail("relay", f"must be a moqt://HOST:PORT URL, got {relay!r}")
    relay_ca = _file(data, "relay_ca")
    relay_insecure = _flag(data, "relay_insecure")
    if relay_ca is not None and relay_insecure:
        raise _fail("relay_insecure", "give relay_ca or relay_insecure, not both")

    token = _text(data, "token")
    token_file = _file(data, "token_file")
    if token is not None and token_file is not None:
        raise _fail("token_file", "give token or token_file, not both")
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise _fail("token_file", f"cannot read {token_file}: {e}") from None
        if not token:
            raise _fail("token_file", f"{token_file} is empty")

    cpus = _text(data, "cpus", "auto")
    assert cpus is not None
    if cpus not in ("auto", "none"):
        try:
            listed = parse_cpu_list(cpus)
        except ValueError as e:
            raise _fail("cpus", f"must be auto, none or a CPU list such as 6,7 or 6-7 ({e})")
        missing = listed - usable_cpus()
        if missing:
            raise _fail("cpus", f"CPU {min(missing)} is not usable here (usable: "
                                f"{format_cpu_list(usable_cpus())})")
    layers_per_request = data.get("layers_per_request")
    if layers_per_request is not None:
        layers_per_request = _number(data, "layers_per_request", 1)
    pc, instance_url = _http_url(data, "pc"), _http_url(data, "instance_url")
    if pc is not None and instance_url is None:
        raise _fail("instance_url", "required with pc: this engine's OpenAI-compatible base URL, "
                                    "e.g. http://HOST:8000/")
    engine, size = _text(data, "quic_engine"), data.get("datagram_size")
    try:
        engine = check_engine(engine) if engine else None
    except SettingError as e:
        raise _fail("quic_engine", str(e)) from None
    try:
        quic = quic_settings(engine, size)
    except SettingError as e:
        raise _fail("datagram_size", str(e)) from None
    load_async = _text(data, "load_async", "live")
    if load_async not in LOAD_ASYNC:
        raise _fail("load_async", f"must be one of {', '.join(LOAD_ASYNC)}, got {load_async!r}")
    return ConnectorConfig(
        index=index, scope_key=scope_key, scope=scope, holder=holder, listen=listen,
        public_url=public_url, data=Path(data_dir).expanduser() if data_dir else None,
        host_bytes=_number(data, "host_bytes", 1 << 30),
        disk_bytes=_number(data, "disk_bytes", 16 << 30),
        relay=relay, relay_ca=relay_ca, relay_insecure=relay_insecure,
        relay_timeout_s=_number(data, "relay_timeout_s", 5.0, integer=False, low=0.01),
        token=token, principals=_file(data, "principals"),
        lease_ms=_number(data, "lease_ms", 10_000),
        lookup_timeout_ms=_number(data, "lookup_timeout_ms", 2_000),
        load_timeout_s=_number(data, "load_timeout_s", 30.0, integer=False, low=0.01),
        record_ttl_ms=_number(data, "record_ttl_ms", 60_000),
        layers_per_request=layers_per_request,
        load_concurrency=_number(data, "load_concurrency", 8),
        timeline=_flag(data, "timeline"), pipelined=_flag(data, "pipelined", True),
        switch_interval_us=_number(data, "switch_interval_us", 200, low=0), cpus=cpus,
        pc=pc, instance_url=instance_url, status_ttl_ms=_number(data, "status_ttl_ms", 3_000, low=300),
        quic=quic, live_kv=_flag(data, "live_kv", True),
        load_async=load_async, extra=data)
