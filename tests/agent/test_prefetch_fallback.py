"""How the prefetcher reads a block (KVSP §6.5, §6.6), without a network or a model: the listed
sources in order, each over MOQT through the agent's relay and then over HTTP, under a lease,
through `kvsp_moq.fetch`'s candidates and fallback; a block the store refuses is read again
from the next candidate."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Sequence

from agent.prefetch import Prefetcher
from kvsp_moq.errors import BadContainer, LeaseQuota, TransportError
from kvsp_moq.fetch.sources import LayerTuple
from kvsp_moq.fetch.stream import FetchedBlock
from kvsp_moq.holder.store import BlockId
from kvsp_moq.index_client import LookupBlock, LookupResult
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.records import PrefetchBlock, PrefetchDirective, ReplicaRecord

COMPAT = "bb" * 32
SCOPE = "cc" * 16
H1, H2, RELAY = "http://h1/", "http://h2/", "moqt://relay/"


def key(n: int) -> str:
    return f"{n:02x}" * 32


def http_record(k: str, holder: str) -> ReplicaRecord:
    return ReplicaRecord(block_key=k, compat_id=COMPAT, scope_id=SCOPE, holder=holder, codec=1,
                         size=1, digest="sha-256:" + "00" * 32, ttl_ms=1000)


def moqt_record(k: str, http_holder: str) -> ReplicaRecord:
    return ReplicaRecord(block_key=k, compat_id=COMPAT, scope_id=SCOPE, holder=RELAY, codec=1,
                         size=1, digest="sha-256:" + "00" * 32, ttl_ms=1000,
                         moqt_namespace="kvsp/ns", http_holder=http_holder)


def fetched() -> FetchedBlock:
    container = Container(encode(0, 16, [(b"k" * 8, b"v" * 8)]))
    return FetchedBlock(container, (0, 0), [], bytes_received=len(container), seconds=0.001)


class Store:
    """A holder store double that refuses the first `refuse` blocks offered to it."""

    def __init__(self, refuse: int = 0) -> None:
        self.held: dict[BlockId, bytes] = {}
        self.refuse = refuse

    def get(self, bid: BlockId) -> bytes | None:
        return self.held.get(bid)

    def __contains__(self, bid: object) -> bool:
        return bid in self.held

    async def put(self, bid: BlockId, buffer: Any) -> BlockId:
        if self.refuse:
            self.refuse -= 1
            raise BadContainer("not a block of this compat ID")
        self.held[bid] = bytes(buffer)
        return bid


class Index:
    def __init__(self, records: dict[str, list[ReplicaRecord]]) -> None:
        self.records = records

    async def lookup(self, scope: str, compat: str, keys: Sequence[str]) -> LookupResult:
        found = [LookupBlock(k, tuple(self.records[k])) for k in keys if k in self.records]
        return LookupResult(len(found), tuple(found))


class Http:
    """An HttpFetcher double: whole blocks from the holders not in `failing`."""

    def __init__(self, failing: Sequence[str] = ()) -> None:
        self.failing = set(failing)
        self.asked: list[str] = []

    async def fetch_block(self, sources: Sequence[str], record: ReplicaRecord) -> FetchedBlock:
        self.asked.append(f"http {sources[0]}")
        if sources[0] in self.failing:
            raise TransportError("cut off")
        return fetched()


class Moqt:
    """A MoqtLayerSource double, sharing the account of what was asked with `Http`."""

    kind = "moqt"
    needs_lease = True
    reachable = True

    def __init__(self, asked: list[str], *, fail: bool = False) -> None:
        self.asked = asked
        self.fail = fail

    def accepts(self, record: ReplicaRecord) -> bool:
        return record.is_moqt and record.http_holder is not None

    async def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]:
        raise AssertionError("a prefetch reads whole blocks")
        yield

    async def fetch_block(self, record: ReplicaRecord) -> FetchedBlock:
        self.asked.append(f"moqt {record.http_holder}")
        if self.fail:
            raise TransportError("the relay cut the stream")
        return fetched()


class Leases:
    """A LeaseClient double: grants, or refuses at the holders in `refuse`."""

    def __init__(self, refuse: Sequence[str] = ()) -> None:
        self.refuse = set(refuse)
        self.acquired: list[tuple[str, list[str]]] = []
        self.released: list[str] = []

    async def acquire(self, holder: str, keys: list[str], ttl_ms: int) -> str:
        if holder in self.refuse:
            raise LeaseQuota("too many leases")
        self.acquired.append((holder, list(keys)))
        return f"lease-{len(self.acquired)}"

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> int:
        return ttl_ms

    async def release(self, holder: str, lease: str) -> None:
        self.released.append(lease)


def prefetcher(store: Store, http: Http, leases: Leases, records: dict[str, list[ReplicaRecord]],
               moqt: Moqt | None = None) -> tuple[Prefetcher, list[Any], list[tuple[str, int]]]:
    announced: list[Any] = []
    seen: list[tuple[str, int]] = []
    p = Prefetcher(store, announced.append, http, leases, Index(records),  # type: ignore[arg-type]
                   moqt=moqt, on_transfer=lambda holder, octets, s: seen.append((holder, octets)))  # type: ignore[arg-type]
    return p, announced, seen


def directive(blocks: dict[str, list[str]]) -> PrefetchDirective:
    return PrefetchDirective(directive=str(uuid.uuid4()), scope_id=SCOPE, compat_id=COMPAT,
                             blocks=tuple(PrefetchBlock(k, tuple(s)) for k, s in blocks.items()),
                             deadline_ms=10_000, lease_ms=2_000)


async def run(p: Prefetcher, d: PrefetchDirective) -> dict[str, Any]:
    state = p.submit(d)
    assert state.task is not None
    await state.task
    await p.close()
    return state.to_json()


async def test_the_listed_sources_in_order_each_over_moqt_then_http() -> None:
    k = key(1)
    records = {k: [http_record(k, H2), moqt_record(k, H1), http_record(k, H1)]}
    http, leases, store = Http(failing=[H1]), Leases(), Store()
    p, announced, seen = prefetcher(store, http, leases, records, Moqt(http.asked, fail=True))
    done = await run(p, directive({k: ["http://dead/", H1, H2]}))
    assert done["state"] == "complete" and done["sources"] == {"http": 1}
    assert http.asked == [f"moqt {H1}", f"http {H1}", f"http {H2}"]
    assert p.stats == {"moqt": 0, "http": 1}
    assert announced == [BlockId(COMPAT, SCOPE, k)] and BlockId(COMPAT, SCOPE, k) in store
    # one lease at H1 for both of its candidates, one at H2; both released once stored
    assert leases.acquired == [(H1, [k]), (H2, [k])]
    assert sorted(leases.released) == ["lease-1", "lease-2"]
    assert seen == [(H2, len(fetched().container))]  # the source the block came from


async def test_a_block_the_store_refuses_is_read_again_from_the_next_candidate() -> None:
    k = key(2)
    records = {k: [moqt_record(k, H1), http_record(k, H1)]}
    http, leases, store = Http(), Leases(), Store(refuse=1)
    p, announced, _ = prefetcher(store, http, leases, records, Moqt(http.asked))
    done = await run(p, directive({k: [H1]}))
    assert done["state"] == "complete" and done["sources"] == {"http": 1}
    assert http.asked == [f"moqt {H1}", f"http {H1}"]
    assert len(announced) == 1


async def test_without_a_relay_or_a_record_at_any_source_the_block_fails() -> None:
    k, missing = key(3), key(4)
    records = {k: [moqt_record(k, H1)]}  # published over MOQT only: the agent has no relay
    http, leases, store = Http(), Leases(), Store()
    p, announced, _ = prefetcher(store, http, leases, records)
    done = await run(p, directive({k: [H1], missing: [H1]}))
    assert done["state"] == "failed" and sorted(done["failed"]) == sorted([k, missing])
    assert http.asked == [] and announced == []


async def test_a_refused_lease_moves_on_to_the_next_source() -> None:
    k = key(5)
    records = {k: [http_record(k, H1), http_record(k, H2)]}
    http, leases, store = Http(), Leases(refuse=[H1]), Store()
    p, _, _ = prefetcher(store, http, leases, records)
    done = await run(p, directive({k: [H1, H2]}))
    assert done["state"] == "complete"
    assert http.asked == [f"http {H2}"] and leases.acquired == [(H2, [k])]


async def test_one_lease_covers_the_blocks_at_their_first_source() -> None:
    keys = [key(n) for n in (6, 7, 8)]
    records = {k: [http_record(k, H1), http_record(k, H2)] for k in keys}
    http, leases, store = Http(), Leases(), Store()
    p, announced, seen = prefetcher(store, http, leases, records)
    other = key(9)  # listed at H2 first: the batch at H1 does not cover it
    records[other] = [http_record(other, H1), http_record(other, H2)]
    done = await run(p, directive({**{k: [H1, H2] for k in keys}, other: [H2, H1]}))
    assert done["state"] == "complete" and len(announced) == 4
    assert sorted(leases.acquired) == [(H1, keys), (H2, [other])]
    assert sorted(leases.released) == ["lease-1", "lease-2"]
    assert sorted(seen) == [(H1, 3 * len(fetched().container)), (H2, len(fetched().container))]
