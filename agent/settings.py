"""What an agent is configured with (`kvsp agent`, the demo, benchmarks, tests): one dataclass,
apart from the command line that fills it, so that the app and the service read the same fields
without importing one another; and where the model it names is found."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from agent.options import EngineOptions
from agent.tiny import ensure_tiny_model
from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import BadRecord
from kvsp_moq.fetch.sources import LayerSource
from kvsp_moq.holder.settings import HolderSettings
from kvsp_moq.model_descriptor import DEFAULT_BLOCK_TOKENS, DTYPES
from kvsp_moq.moqt.quic.settings import QuicSettings
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY

DEFAULT_PORT = 8900


@dataclass
class AgentSettings:
    """Everything an agent is configured with; nothing is read from module globals."""

    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    #: "tiny", or a local model directory (Hugging Face layout, safetensors)
    model: str = "tiny"
    #: parameters of `ensure_tiny_model` for --model tiny (the bench makes a larger one)
    tiny_options: Mapping[str, Any] = field(default_factory=dict)
    #: where --model tiny is made; default: under data_dir, else ~/.cache/kvsp-moq
    model_cache: str | Path | None = None
    device: str = "cpu"
    dtype: str = "float32"
    index_url: str | None = None
    pc_url: str | None = None
    #: MOQT relay: blocks with MOQT replicas are loaded through it first (HTTP is the fallback),
    #: and the agent's own blocks are published through it, each with a MOQT record too
    relay: str | None = None
    #: CA (or the relay's own certificate) the relay's certificate is checked against
    relay_ca: str | Path | None = None
    #: skip checking the relay's certificate, wherever it is (warned)
    relay_insecure: bool = False
    #: how long a MOQT request through the relay may go unanswered before HTTP takes over
    relay_timeout_s: float = 10.0
    data_dir: str | Path | None = None
    #: scope name -> scope key; empty: the open loopback scope
    scope_keys: Mapping[str, bytes] = field(default_factory=dict)
    scope: str | None = None
    public_url: str | None = None
    principals: str | Path | None = None
    auth: Authenticator | None = None
    #: bearer token presented to the IS, the PC, holders and other instances
    token: str | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    host_bytes: int = 1 << 30
    disk_bytes: int = 16 << 30
    max_block_bytes: int = 1 << 30
    max_lease_ttl_ms: int = 600_000
    max_lease_bytes: int = 16 << 30
    record_ttl_ms: int = 60_000
    status_ttl_ms: int = 3000
    #: ask the PC to sleep after this long without work; None: never
    sleep_after_s: float | None = None
    #: the instance epoch; None: the start time in milliseconds (§6.3)
    epoch: int | None = None
    lease_ms: int = 10_000
    load_concurrency: int = 8
    layers_per_request: int | None = None
    release_batch: int = 4
    max_unacked: int = 64
    token_interval_s: float = 0.0
    max_new_tokens: int = 4096
    replicate_to: Sequence[str] = ()
    #: keep each session's first logits (tests compare them with a recompute)
    keep_first_logits: bool = False
    #: load or recompute a cached prefix by the §6.4 estimates with measured rates
    #: (`agent.choice`); False loads whatever is cached (benchmarks of the load path)
    choose_by_cost: bool = True
    #: with a relay, publish computed prompt blocks layer by layer while computed (DESIGN §9)
    live_kv: bool = True
    #: tokens of a prefill at start, so the first status report carries measured rates
    warmup_tokens: int = 32
    http_timeout_s: float = 10.0
    #: block sources tried before HTTP, e.g. a MOQT fetcher
    layer_sources: Sequence[LayerSource] = ()
    #: cores of the loader's own, the model on the others (`agent.cores`); None: every thread
    #: on every core
    loader_cpus: frozenset[int] | None = None
    #: the QUIC engine and datagram size of its MOQT loads and publishing
    #: (`kvsp agent --quic-engine`, `--datagram-size`)
    quic: QuicSettings = field(default_factory=QuicSettings)

    def engine_options(self) -> EngineOptions:
        """The engine's tunables: every field of `EngineOptions` this class has too (the same
        name is the same setting), the rest at their defaults."""
        shared = {f.name for f in fields(EngineOptions)} & {f.name for f in fields(self)}
        values: dict[str, Any] = {name: getattr(self, name) for name in shared}
        values["replicate_to"] = tuple(self.replicate_to)
        return EngineOptions(**values)

    def holder_settings(self, descriptors: Mapping[str, CompatDescriptor]) -> HolderSettings:
        """The settings of the agent's own pool, a holder like any other (`holder.assembly`):
        the agent's URL, store, relay and token; blocks checked against its model's geometry."""
        return HolderSettings(
            listen=self.listen, data_dir=self.data_dir, index_url=self.index_url,
            public_url=self.public_url, host_bytes=self.host_bytes, disk_bytes=self.disk_bytes,
            record_ttl_ms=self.record_ttl_ms, relay=self.relay, relay_ca=self.relay_ca,
            relay_insecure=self.relay_insecure, principals=self.principals, auth=self.auth,
            index_token=self.token, max_lease_ttl_ms=self.max_lease_ttl_ms,
            max_lease_bytes=self.max_lease_bytes, max_block_bytes=self.max_block_bytes,
            descriptors=descriptors, quic=self.quic)

    def __post_init__(self) -> None:
        if not self.scope_keys:
            self.scope_keys = {OPEN_SCOPE: OPEN_SCOPE_KEY}
        if self.scope is None:
            self.scope = next(iter(self.scope_keys))
        if self.scope not in self.scope_keys:
            raise BadRecord(f"no key for scope {self.scope!r}", member="scope")
        if self.dtype not in DTYPES:
            raise BadRecord(f"must be one of {', '.join(DTYPES)}", member="dtype")


def model_cache_dir(settings: AgentSettings) -> Path:
    if settings.model_cache is not None:
        return Path(settings.model_cache)
    if settings.data_dir is not None:
        return Path(settings.data_dir) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvsp-moq"


def model_directory(settings: AgentSettings) -> Path:
    """The directory of the model the settings name; the tiny model is created once."""
    if settings.model == "tiny":
        suffix = "".join(f"-{k}{v}" for k, v in sorted(settings.tiny_options.items()))
        return ensure_tiny_model(model_cache_dir(settings) / f"tiny{suffix}",
                                 **settings.tiny_options)
    directory = Path(settings.model)
    if not directory.is_dir():
        raise BadRecord(f"{directory} is not a model directory", member="model")
    return directory


__all__ = ["DEFAULT_PORT", "AgentSettings", "model_cache_dir", "model_directory"]
