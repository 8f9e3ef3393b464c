"""Placement estimates of KVSP §6.4, as pure functions.

The IS uses them to answer a lookup with targets and the PC to rank instances; keeping them in
one place makes both agree on what "cost" means.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

from kvsp_moq.protocol.records import InstanceStatus, Link, ReplicaRecord
from kvsp_moq.protocol.urls import base_url

#: Link rate assumed when the instance has reported no link at all (1 Gbit/s, 1 ms).
DEFAULT_MBIT_PER_S = 1000.0
DEFAULT_RTT_US = 1000.0


@functools.lru_cache(maxsize=4096)
def assumed_link(links: tuple[Link, ...]) -> tuple[float, float]:
    """(mbit_per_s, rtt_us) for a source the instance has not reported: the median rate and
    RTT of the links it has reported (its network and its load path, which a new source
    shares), else the defaults. An instance whose loads have run at 100 Mbit/s is not
    promised 1 Gbit/s from a holder it has never tried."""
    if not links:
        return DEFAULT_MBIT_PER_S, DEFAULT_RTT_US
    rates = sorted(link.mbit_per_s for link in links)
    rtts = sorted(link.rtt_us for link in links)
    middle = len(links) // 2
    if len(links) % 2:
        return rates[middle], rtts[middle]
    return (rates[middle - 1] + rates[middle]) / 2, (rtts[middle - 1] + rtts[middle]) / 2


@dataclass(frozen=True)
class Estimate:
    instance: str
    fetch_us: float
    recompute_us: float
    wait_us: float
    matched_tokens: int
    total_tokens: int
    recompute_all_us: float

    @property
    def cost_us(self) -> float:
        return self.wait_us + min(self.fetch_us + self.recompute_us, self.recompute_all_us)

    @property
    def uses_cache(self) -> bool:
        return self.fetch_us + self.recompute_us < self.recompute_all_us

    def to_json(self) -> dict:
        return {"instance": self.instance, "fetch_us": round(self.fetch_us, 3),
                "recompute_us": round(self.recompute_us, 3)}


def recompute_us(tokens: int, prefill_tokens_per_s: float) -> float:
    """1e6 * tokens / prefill rate; an instance with no measured rate cannot be costed."""
    if tokens <= 0:
        return 0.0
    if prefill_tokens_per_s <= 0:
        return float("inf")
    return 1e6 * tokens / prefill_tokens_per_s


class Placed(Protocol):
    """Where a replica sits: a record, or the Index Service's summary of one."""

    @property
    def holder(self) -> str: ...

    @property
    def http_holder(self) -> str | None: ...


def resides_at(instance: str, replica: Placed) -> bool:
    """Whether the replica sits at the instance itself (an instance is also a holder): its
    holder, or for a MOQT replica its HTTP holder, is the instance's base URL. Such a block is
    resident and costs nothing to load (§6.4)."""
    here = base_url(instance)
    return base_url(replica.holder) == here or (
        replica.http_holder is not None and base_url(replica.http_holder) == here)


#: An instance's reported links by holder: (mbit_per_s, rtt_us), the first report of each.
LinkTable = Mapping[str, tuple[float, float]]


def link_table(links: Iterable[Link]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for link in links:
        out.setdefault(link.holder, (link.mbit_per_s, link.rtt_us))
    return out


def replica_link(table: LinkTable, replica: Placed) -> tuple[float, float] | None:
    """The instance's link to a replica: the one reported for its holder, else (a MOQT
    replica read through a relay) the one for its HTTP holder; None when neither is known."""
    link = table.get(replica.holder)
    if link is None and replica.http_holder is not None:
        link = table.get(replica.http_holder)
    return link


def source_rate(status: InstanceStatus, record: ReplicaRecord, layer: int | None = None
                ) -> tuple[float, float]:
    """(mbit_per_s, rtt_us) from the instance to the record's holder, capped by the tier read
    rate of the layer's residency entry."""
    rate, rtt = (replica_link(link_table(status.links), record)
                 or assumed_link(tuple(status.links)))
    if layer is not None:
        tier = record.tier_of(layer)
        if tier is not None and tier.read_mbit_per_s is not None:
            rate = min(rate, tier.read_mbit_per_s)
    return rate, rtt


#: A replica's octets by the read rate of the tier holding them (None: no tier limit).
Profile = tuple[tuple[float, float | None], ...]


def tier_octets(record: ReplicaRecord, count: int = 1) -> Profile:
    """The octets of `count` replicas like `record`, by the read rate of the tier each layer
    sits in: its residency entries in order, then the layers no entry covers (no tier limit).
    A record without layers or residency is one piece with no tier limit."""
    layers = record.layer_count
    total = float(record.size) * count
    if not (layers and record.residency):
        return ((total, None),)
    per_layer = total / layers
    out = []
    covered = 0
    for tier in record.residency:
        n = tier.layers[1] - tier.layers[0] + 1
        covered += n
        out.append((per_layer * n, tier.read_mbit_per_s))
    if layers > covered:
        out.append((per_layer * (layers - covered), None))
    return tuple(out)


def bytes_us(profile: Profile, mbit_per_s: float) -> float:
    """Microseconds to move `profile` over a link of `mbit_per_s`, each tier's octets at
    min(link rate, tier read rate): sum of 8 * octets / rate (no round trip), added left to
    right (not `sum`, which compensates on newer Pythons), as the PC's array ranking adds them."""
    us = 0.0
    for octets, cap in profile:
        us += 8 * octets / (mbit_per_s if cap is None or cap > mbit_per_s else cap)
    return us


def combine_sources(loads: Iterable[tuple[str, float, float]]) -> float:
    """fetch_us from (source, bytes_us, rtt_us) loads: the bytes from one source add up, its
    round trip is the longest of its loads', and sources load in parallel (max over them)."""
    per_source: dict[str, tuple[float, float]] = {}  # source -> (microseconds of bytes, rtt)
    for source, us, rtt in loads:
        prev_us, prev_rtt = per_source.get(source, (0.0, rtt))
        per_source[source] = (prev_us + us, max(prev_rtt, rtt))
    return max((rtt + us for us, rtt in per_source.values()), default=0.0)


def fetch_us(
    status: InstanceStatus,
    plan: Iterable[ReplicaRecord],
) -> float:
    """max over sources s of (rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s)).

    `plan` lists, for each block not yet resident at the instance, the replica it would load;
    each layer's bytes are charged at the rate of the tier it sits in.
    """
    def loads() -> Iterable[tuple[str, float, float]]:
        for record in plan:
            rate, rtt = source_rate(status, record)
            yield record.holder, bytes_us(tier_octets(record), rate), rtt

    return combine_sources(loads())


def mean_service_us(status: InstanceStatus, mean_tokens: float = 512.0) -> float:
    """A service-time estimate from the instance's own reported rates."""
    return recompute_us(int(mean_tokens), status.prefill_tokens_per_s) if status.prefill_tokens_per_s else 0.0


def estimate(
    status: InstanceStatus,
    *,
    matched_tokens: int,
    total_tokens: int,
    plan: Sequence[ReplicaRecord],
    resident: Mapping[str, bool] | None = None,
    service_us: float | None = None,
) -> Estimate:
    """Cost of serving a prompt at one instance (§6.4)."""
    resident = resident or {}
    to_load = [r for r in plan if not resident.get(r.block_key)]
    wait = status.queued * (service_us if service_us is not None else mean_service_us(status))
    return Estimate(
        instance=status.instance,
        fetch_us=fetch_us(status, to_load),
        recompute_us=recompute_us(total_tokens - matched_tokens, status.prefill_tokens_per_s),
        wait_us=wait,
        matched_tokens=matched_tokens,
        total_tokens=total_tokens,
        recompute_all_us=recompute_us(total_tokens, status.prefill_tokens_per_s),
    )
