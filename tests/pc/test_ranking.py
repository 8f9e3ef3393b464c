"""The array ranking against the reference on random worlds: the same groups, the same
candidates in the same order with the same estimates (to the bit), the same directive."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

import kvsp_moq.index_client as index_client
from kvsp_moq.index_client import LookupBlock, LookupResult
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import InstanceStatus, Link, ReplicaRecord, Residency
from pc.lifecycle import InstanceRegistry
from pc.placement import MemoryIndex, PlacementSettings, PrefetchBlocks, Router, RouteRequest, directive_for
from pc.ranking import Grouping, LinkArrays, rank
from tests.pc.fakes import COMPAT, SCOPE_KEY

SCOPE = scope_id(SCOPE_KEY).hex()
HOLDERS = ["http://10.1.0.1/", "http://10.1.0.2/", "http://10.1.0.3", "moqt://relay:4443/"]
INSTANCES = ["http://10.0.0.1/", "http://10.0.0.2/", "http://10.0.0.3/", "http://10.0.0.4/"]
TIERS = [(), (Residency("device", (0, 1)), Residency("host", (2, 3), 497.3)),
         (Residency("disk", (1, 2), 1_999.9),), (Residency("device", (0, 3)),),
         (Residency("device", (0, 0)), Residency("host", (1, 1), 6_011.0))]  # 3 pieces


def record(key: str, holder: str, size: int, residency: tuple, layers: int | None,
           http_holder: str | None) -> ReplicaRecord:
    return ReplicaRecord(key, COMPAT, SCOPE, holder, 1, size, "sha-256:" + "00" * 32, 60_000,
                         None if layers is None else ("00" * 32,) * layers, residency,
                         "ns" if holder.startswith("moqt") else None, http_holder)


@st.composite
def worlds(draw):
    rates = st.sampled_from([800.0, 1_000.0, 9_973.0, 100_003.0])
    rtts = st.sampled_from([0.0, 17.3, 250.0])
    statuses = []
    for url in draw(st.lists(st.sampled_from(INSTANCES), min_size=1, max_size=4, unique=True)):
        known = draw(st.lists(st.sampled_from(HOLDERS + INSTANCES), max_size=6))
        statuses.append(InstanceStatus(
            url, 1, "active", 60_000, queued=draw(st.integers(0, 5)),
            prefill_tokens_per_s=draw(st.sampled_from([0.0, 5e3, 2e4, 3e4])),
            links=tuple(Link(h, draw(rates), draw(rtts)) for h in known)))
    shapes = []  # a few replica sets, reused by many blocks, as spans of a prompt are
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.lists(st.sampled_from(HOLDERS + INSTANCES), min_size=1, max_size=4,
                              unique=True))
        shapes.append([(h, draw(st.sampled_from([1 << 16, 1_572_871, (1 << 20) + 7])),
                        draw(st.sampled_from(TIERS)),
                        draw(st.sampled_from([None, 4])),
                        draw(st.sampled_from([None, INSTANCES[0], HOLDERS[0]])))
                       for h in where])
    blocks = []
    count = draw(st.integers(0, 80))
    spans = draw(st.booleans())  # blocks in long runs of one replica set, or mixed
    for n in range(count):
        key = f"{n:064x}"
        reps = []
        shape = shapes[n * len(shapes) // count] if spans else draw(st.sampled_from(shapes))
        for h, size, res, layers, http in shape:
            if layers is None:
                res = ()
            reps.append(record(key, h, size, res, layers, http))
        blocks.append(LookupBlock(key, tuple(reps)))
    matched = draw(st.integers(0, len(blocks)))
    tokens = 16 * matched + draw(st.sampled_from([0, 7, 4096]))
    return statuses, LookupResult(matched, tuple(blocks)), tokens


def check_same(statuses, result, tokens):
    fast_groups, ref_groups = Grouping.of(result), Grouping.by_signature(result)
    assert fast_groups.of_block == ref_groups.of_block
    assert [(g.count, g.replicas) for g in fast_groups.groups] == \
        [(g.count, g.replicas) for g in ref_groups.groups]
    arrays = LinkArrays()
    for _ in range(2):  # the second time from the kept link rows
        fast = rank(result, statuses, token_count=tokens, block_tokens=16, links=arrays,
                    grouping=fast_groups)
        ref = rank(result, statuses, token_count=tokens, block_tokens=16, reference=True)
        assert [(c.instance, c.resident_blocks, c.estimate) for c in fast] == \
            [(c.instance, c.resident_blocks, c.estimate) for c in ref]
    req = RouteRequest(SCOPE, COMPAT, tuple(b.block_key for b in result.blocks), tokens, 16, "r")
    reuse = PrefetchBlocks()
    for status in statuses * 2:  # the second time from entries built the first
        want = directive_for(result, req, status, PlacementSettings(), directive="d",
                             grouping=ref_groups)
        got = directive_for(result, req, status, PlacementSettings(), directive="d",
                            grouping=fast_groups, reuse=reuse, ranked=arrays)
        assert got == want


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_array_ranking_equals_the_reference(world):
    check_same(*world)


@settings(max_examples=50, deadline=None)
@given(worlds())
def test_equal_shapes_interned_apart_still_group_together(world):
    """After the intern table was emptied, equal shapes may be distinct objects: the grouping
    merges them by value, as the reference does."""
    statuses, result, tokens = world
    saved = (index_client._SHAPES_LIMIT, index_client._shape_tables[0])
    index_client._SHAPES_LIMIT = 1  # every new shape empties the table
    try:
        fresh = LookupResult(result.matched, tuple(LookupBlock(b.block_key, b.replicas)
                                                   for b in result.blocks))
        check_same(statuses, fresh, tokens)
    finally:
        index_client._SHAPES_LIMIT, index_client._shape_tables[0] = saved


@settings(max_examples=60, deadline=None)
@given(worlds(), st.integers(0, 3))
def test_router_decides_as_the_reference_router(world, routes):
    statuses, result, tokens = world
    index = MemoryIndex()
    for b in result.blocks[:result.matched]:
        for r in b.replicas:
            index.add(r)
    keys = tuple(b.block_key for b in result.blocks)

    async def decisions(reference: bool):
        registry = InstanceRegistry(clock=lambda: 1.0)
        for s in statuses:
            registry.report(s)
        sent = []

        async def send(instance, directive):
            sent.append((instance, directive.blocks))

        router = Router(registry, index.lookup, send, PlacementSettings(prefetch="always"),
                        reference=reference)
        out = []
        for i in range(routes + 1):  # each route counts in the chosen instance's queue
            d = await router.route(RouteRequest(SCOPE, COMPAT, keys, tokens, 16, f"r{i}"))
            out.append((d.instance, d.matched, d.reason, d.prefetch,
                        [(c.instance, c.resident_blocks, c.estimate) for c in d.candidates]))
        return out, sent

    assert asyncio.run(decisions(False)) == asyncio.run(decisions(True))


def test_memory_index_hands_out_the_same_blocks_and_stops_at_a_miss():
    from kvsp_moq.protocol.records import LookupRequest

    index = MemoryIndex()
    keys = [f"{n:064x}" for n in range(4)]
    for k in keys[:3]:
        index.add(record(k, HOLDERS[0], 1 << 16, (), None, None))
    index.add(record(keys[1], HOLDERS[1], 1 << 16, (), None, None))
    req = LookupRequest(SCOPE, COMPAT, (keys[0], keys[1], keys[3], keys[2]))
    first, again = asyncio.run(index.lookup(req)), asyncio.run(index.lookup(req))
    assert first.matched == 2 and [len(b.replicas) for b in first.blocks] == [1, 2]
    assert again.blocks[1] is first.blocks[1]
    assert asyncio.run(index.lookup(LookupRequest(SCOPE, "ff" * 32, tuple(keys)))).matched == 0
