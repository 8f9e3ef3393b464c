"""The inputs of `kvsp bench route`: 64 active instances with their links, 2,048-key prompts
and an index of their replicas, the same for the same seed (one process routes on them, or
several processes over a shared store: `kvsp_moq.bench.route_pcs`)."""

from __future__ import annotations

import random
from typing import Any

from kvsp_moq.index_client import LookupBlock, LookupResult
from kvsp_moq.protocol.keys import block_keys, scope_id
from kvsp_moq.protocol.records import InstanceStatus, Link, LookupRequest, ReplicaRecord, Residency

INSTANCES = 64
KEYS = 2048
BLOCK_TOKENS = 16
LAYERS = 32
HOLDERS = 8  # dedicated block stores besides the instances


class _ReferenceIndex:
    """The in-memory index as it was: a list of replicas per (compat, scope, key), a new
    answer built on every lookup."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], list[ReplicaRecord]] = {}

    def add(self, record: ReplicaRecord) -> None:
        self._by_key.setdefault((record.compat_id, record.scope_id, record.block_key),
                                []).append(record)

    async def lookup(self, req: LookupRequest) -> LookupResult:
        blocks = []
        table = self._by_key
        for key in req.block_keys:
            reps = table.get((req.compat_id, req.scope_id, key))
            if not reps:
                break
            blocks.append(LookupBlock(key, tuple(reps)))
        return LookupResult(len(blocks), tuple(blocks))


def _registry(seed: int) -> Any:
    """64 active instances with their links; the same for the same seed."""
    from pc.lifecycle import InstanceRegistry

    rng = random.Random(seed)
    instances = [f"http://10.0.{i // 250}.{i % 250 + 1}:8000/" for i in range(INSTANCES)]
    holders = [f"http://10.1.0.{i + 1}:8100/" for i in range(HOLDERS)]
    registry = InstanceRegistry()
    for url in instances:
        links = tuple(Link(h, rng.choice([25_000.0, 100_000.0, 200_000.0]), rng.uniform(5, 50))
                      for h in holders + rng.sample(instances, 8))
        registry.report(InstanceStatus(
            instance=url, epoch=1, state="active", ttl_ms=3_600_000, running=rng.randint(0, 16),
            queued=rng.randint(0, 6), batch_size=32, kv_utilization=0.5,
            prefill_tokens_per_s=rng.choice([20_000.0, 40_000.0]), decode_tokens_per_s=3000.0,
            links=links))
    return registry


def _world(seed: int = 7) -> dict[str, Any]:
    from pc.placement import MemoryIndex

    rng = random.Random(seed)
    scope_key, compat = rng.randbytes(32), rng.randbytes(32)
    sid = scope_id(scope_key).hex()
    instances = [f"http://10.0.{i // 250}.{i % 250 + 1}:8000/" for i in range(INSTANCES)]
    holders = [f"http://10.1.0.{i + 1}:8100/" for i in range(HOLDERS)]
    index, reference_index = MemoryIndex(), _ReferenceIndex()
    tokens = [rng.randrange(1 << 31) for _ in range(KEYS * BLOCK_TOKENS)]
    keys = [k.hex() for k in block_keys(scope_key, compat, tokens, BLOCK_TOKENS)]
    digests = tuple("00" * 32 for _ in range(LAYERS))
    size = 2 * LAYERS * BLOCK_TOKENS * 8 * 128 * 2  # 8 KV heads, head_dim 128, bfloat16
    split = (Residency("device", (0, 15)), Residency("host", (16, LAYERS - 1), 400_000.0))
    # The prompt's prefix is held in spans: a span's blocks share their holders, as when one
    # instance computed and published them.
    span = 256
    for start in range(0, KEYS, span):
        where = [rng.choice(holders), *rng.sample(instances, 2)]
        for k in keys[start:start + span]:
            for h in where:
                record = ReplicaRecord(k, compat.hex(), sid, h, 1, size, "sha-256:" + "00" * 32,
                                       600_000, digests, split if h in instances else ())
                index.add(record)
                reference_index.add(record)
    return {"registry": _registry(seed), "index": index, "reference_index": reference_index,
            "keys": keys, "tokens": tokens, "scope_key": scope_key, "compat": compat.hex(),
            "sid": sid, "seed": seed}
