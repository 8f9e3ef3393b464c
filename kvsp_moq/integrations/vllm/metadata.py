"""What the scheduler's connector tells the workers' each step: plain data only.

vLLM sends this object from the scheduler to every worker process (pickled, through a
shared-memory queue). So it holds ints and strings: block ids, Block Keys, and the Replica
Records of the lookup as the JSON text the Index Service sent, which each worker parses and
validates again (`ReplicaRecord.from_json`). No object built from network input crosses the
process boundary, and nothing here needs the connector's classes to be unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["KVSPMetadata", "KVSPWorkerMetadata", "LoadSpec", "RequestSpec", "SaveSpec", "is_plain"]


@dataclass(frozen=True)
class LoadSpec:
    """Load block `block_key` into paged block `block_id` from one of `records`."""

    block_id: int
    block_key: str
    #: the block's Replica Records (JSON text, as the IS returned them), in its order
    records: tuple[str, ...]


@dataclass(frozen=True)
class SaveSpec:
    """Paged block `block_id` completes block `block_key` of the prompt in this step."""

    block_id: int
    block_key: str


@dataclass(frozen=True)
class RequestSpec:
    req_id: str
    scope_id: str
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    #: the loads run beside the engine's steps (the request waits in WAITING_FOR_REMOTE_KVS and
    #: the worker reports it in get_finished), not inside this step's forward pass
    async_load: bool = False


@dataclass
class KVSPMetadata(KVConnectorMetadata):
    """One engine step's loads and saves, for the requests that have any."""

    compat_id: str = ""
    requests: list[RequestSpec] = field(default_factory=list)

    @property
    def has_loads(self) -> bool:
        return any(r.loads for r in self.requests)

    @property
    def has_saves(self) -> bool:
        return any(r.saves for r in self.requests)


@dataclass
class KVSPWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers saw of their links in one step, for the engine's §6.3 status (the
    scheduler reports it; the workers load): per transfer (holder URL, octets, seconds), per
    lease round trip (holder URL, seconds)."""

    transfers: list[tuple[str, int, float]] = field(default_factory=list)
    rtts: list[tuple[str, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVSPWorkerMetadata":
        if not isinstance(other, KVSPWorkerMetadata):
            return self
        return KVSPWorkerMetadata(self.transfers + other.transfers, self.rtts + other.rtts)


def is_plain(value: object) -> bool:
    """Whether `value` is built only of str, int, bool, None, tuples, lists and the dataclasses
    of this module (the tests check every metadata object the scheduler makes)."""
    if value is None or isinstance(value, (str, int, bool)):
        return True
    if isinstance(value, (tuple, list)):
        return all(is_plain(v) for v in value)
    if isinstance(value, (LoadSpec, SaveSpec, RequestSpec, KVSPMetadata)):
        return all(is_plain(v) for v in vars(value).values())
    return False
