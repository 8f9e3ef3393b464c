"""What a holder is configured with (`kvsp holder`, the agent's own pool, the vLLM connector's
embedded holder): one dataclass, apart from the command line that fills it, so that the app, the
service and every embedding read the same fields without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from kvsp_moq.auth import Authenticator
from kvsp_moq.holder.leases import MAX_LEASES_TOTAL, LeaseLimits
from kvsp_moq.holder.store import TierRates
from kvsp_moq.moqt.quic.settings import QuicSettings
from kvsp_moq.protocol.compat import CompatDescriptor

DEFAULT_PORT = 8801


@dataclass
class HolderSettings:
    """Everything a holder is configured with; nothing is read from module globals."""

    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    #: the directory of the disk tier; without it the holder keeps blocks in memory only
    data_dir: str | Path | None = None
    #: the Index Service to publish to; without it nothing is published
    index_url: str | None = None
    #: the base URL put in records; by default http://{listen}/
    public_url: str | None = None
    host_bytes: int = 1 << 30
    disk_bytes: int = 16 << 30
    device_bytes: int = 0
    #: at most this many leading layers of each block are kept on the device (None: all)
    device_layers: int | None = None
    record_ttl_ms: int = 60_000
    #: the MOQT relay (moqt://host:port) the holder publishes its blocks through; with it, each
    #: replica also gets a MOQT record in the index
    relay: str | None = None
    #: CA (or pinned certificate) file the relay's certificate is checked against
    relay_ca: str | Path | None = None
    #: skip checking the relay's certificate, wherever it is (a loopback relay is not checked
    #: without relay_ca anyway, see the module docstring)
    relay_insecure: bool = False
    principals: str | Path | None = None
    #: an Authenticator to use instead of reading `principals`
    auth: Authenticator | None = None
    #: the bearer token this holder presents to the Index Service and to the relay
    index_token: str | None = None
    max_lease_ttl_ms: int = 600_000
    max_lease_bytes: int = 16 << 30
    #: leases one principal may hold at once, and the holder in all
    max_leases: int = 1024
    max_leases_total: int = MAX_LEASES_TOTAL
    lease_limits: Mapping[str, LeaseLimits] = field(default_factory=dict)
    #: the scopes stored here (Scope IDs); empty: its own principal's (`holder.tenancy`)
    serve_scopes: tuple[str, ...] = ()
    #: octets one scope may hold; None: an equal share of the store among several scopes
    scope_quota: int | None = None
    max_block_bytes: int = 1 << 30
    #: octets that block PUTs being received may reserve together (the sum of their declared
    #: lengths); a PUT beyond it is answered 503 with Retry-After. None: twice max_block_bytes
    max_put_inflight_bytes: int | None = None
    #: descriptors by compat ID (hex): PUT bodies are checked against their geometry
    descriptors: Mapping[str, CompatDescriptor] = field(default_factory=dict)
    rates: TierRates = field(default_factory=TierRates)
    chunk_bytes: int = 1 << 20
    #: the QUIC engine and datagram size of its MOQT publishing (`kvsp holder --quic-engine`)
    quic: QuicSettings = field(default_factory=QuicSettings)


__all__ = ["DEFAULT_PORT", "HolderSettings"]
