"""Ranking active instances for a prompt by the §6.4 cost (pure: a lookup answer and status
records in, candidates best first out).

The matched blocks are grouped first: blocks whose replica sets look alike (same holders,
sizes, layer counts and residency) cost alike and load from one source together, so costing
is O(groups) per candidate instead of O(blocks). Two implementations give the same answer to
the bit:

- the reference (`Grouping.by_signature`, `rank(..., reference=True)`): a signature hashed
  for every replica of every block, then each candidate costed in turn, replica by replica,
  through `kvsp_moq.protocol.cost`;
- the array one (the default): blocks grouped by their interned `LookupBlock.shape` (computed
  once per block object), and every candidate costed at once in numpy, with the candidates'
  links kept between routes in `LinkArrays`. The floating-point operations are those of the
  reference, in the same order (tier terms and each source's loads added left to right), so
  costs, source choices and the order of the candidates agree exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvsp_moq.index_client import LookupBlock, LookupResult, ReplicaShape, replica_shape, shapes_interned_once
from kvsp_moq.protocol.cost import (
    Estimate,
    LinkTable,
    Profile,
    assumed_link,
    bytes_us,
    estimate,
    link_table,
    mean_service_us,
    replica_link,
    resides_at,
    tier_octets,
)
from kvsp_moq.protocol.records import InstanceStatus, Link, ReplicaRecord
from kvsp_moq.protocol.urls import base_url

__all__ = ["Candidate", "Grouping", "LinkArrays", "Links", "ReplicaGroup", "holds", "links_of",
           "load_us", "rank"]


def holds(instance: str, record: ReplicaRecord) -> bool:
    """Whether the replica sits at the instance itself (§6.4's rule, `cost.resides_at`)."""
    return resides_at(instance, record)


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


@dataclass(frozen=True)
class Candidate:
    status: InstanceStatus
    estimate: Estimate
    resident_blocks: int
    """Matched blocks the instance holds itself (nothing to load for them)."""

    @property
    def instance(self) -> str:
        return self.status.instance

    @property
    def cost_us(self) -> float:
        return self.estimate.cost_us

    def to_json(self) -> dict:
        e = self.estimate
        return {"instance": self.instance, "fetch_us": _finite(e.fetch_us),
                "recompute_us": _finite(e.recompute_us), "wait_us": _finite(e.wait_us),
                "recompute_all_us": _finite(e.recompute_all_us), "cost_us": _finite(e.cost_us),
                "resident_blocks": self.resident_blocks, "uses_cache": e.uses_cache}


@dataclass(frozen=True)
class ReplicaGroup:
    """Matched blocks whose replica sets look alike (same holders, sizes, layer counts and
    residency) cost alike, and are loaded from one source together."""

    count: int
    replicas: tuple[ReplicaRecord, ...]
    """The replicas of the group's first block."""
    shape: ReplicaShape | None = dataclasses.field(default=None, compare=False)
    """Their `replica_shape`, when the grouping had it at hand."""

    @functools.cached_property
    def scaled(self) -> tuple[ReplicaRecord, ...]:
        """The replicas with the size of the whole group, for fetch_us (linear in size)."""
        n = self.count
        return (self.replicas if n == 1 else
                tuple(dataclasses.replace(r, size=r.size * n) for r in self.replicas))

    @functools.cached_property
    def profiles(self) -> tuple[Profile, ...]:
        """Per replica, the group's octets by tier read rate: what choosing a source needs."""
        return tuple(tier_octets(r, self.count) for r in self.replicas)


@dataclass(frozen=True)
class Grouping:
    """The matched blocks of a lookup, grouped so that ranking costs O(groups) per candidate
    instead of O(blocks)."""

    groups: tuple[ReplicaGroup, ...]
    of_block: tuple[int, ...]
    """Group index of each matched block, in prefix order."""
    runs: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    """Where each run of consecutive blocks of one group starts, when known."""

    @classmethod
    def of(cls, result: LookupResult) -> "Grouping":
        """Groups in order of first appearance, by block shape: by the identity of the
        interned shapes (one C-level pass over the blocks, then numpy over the runs of alike
        blocks, or a sort when there are many), the distinct shape objects merged by value
        only if the intern table was ever emptied. The same groups as `by_signature`."""
        blocks = result.blocks[:result.matched]
        n = len(blocks)
        if not n:
            return cls((), ())
        ids = np.fromiter(map(_shape_id, blocks), np.uintp, n)
        if not ids.all():  # blocks not grouped before: their shapes first
            for b in blocks:
                b.shape
            ids = np.fromiter(map(_shape_id, blocks), np.uintp, n)
        cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        if len(cuts) * 8 < n:  # a prompt's blocks come in spans held alike: group the runs
            starts = [0, *cuts.tolist()]
            lengths = np.diff(starts + [n])
            group_of: dict[int, int] = {}
            heads: list[LookupBlock] = []
            run_group = []
            for i, start in zip(ids[starts].tolist(), starts):
                g = group_of.setdefault(i, len(heads))
                if g == len(heads):
                    heads.append(blocks[start])
                run_group.append(g)
            of_block = np.repeat(np.array(run_group, np.intp), lengths)
            counts = np.bincount(run_group, weights=lengths, minlength=len(heads)).astype(int)
        else:
            _, first, inverse, counts = np.unique(ids, return_index=True, return_inverse=True,
                                                  return_counts=True)
            order = np.argsort(first)  # distinct shape objects by first appearance
            heads = [blocks[i] for i in first[order].tolist()]
            rank_of = np.empty(len(order), np.intp)
            rank_of[order] = np.arange(len(order))
            of_block = rank_of[inverse.reshape(-1)]
            counts = counts[order]
        if len(heads) > 1 and not shapes_interned_once():
            merged: dict[ReplicaShape, int] = {}
            to = np.array([merged.setdefault(b.shape, len(merged)) for b in heads], np.intp)
            if len(merged) < len(heads):
                of_block = to[of_block]
                counts = np.bincount(of_block, minlength=len(merged))
                keep = np.unique(to, return_index=True)[1]
                heads = [heads[i] for i in keep.tolist()]
        groups = tuple(ReplicaGroup(c, b.replicas, b.shape)
                       for c, b in zip(counts.tolist(), heads))
        runs = np.flatnonzero(of_block[1:] != of_block[:-1]) + 1
        return cls(groups, tuple(of_block.tolist()), (0, *runs.tolist()))

    @classmethod
    def by_signature(cls, result: LookupResult) -> "Grouping":
        """The reference grouping: a signature built and hashed for every block."""
        index: dict[tuple, int] = {}
        members: list[list] = []
        of_block = []
        for block in result.blocks[:result.matched]:
            reps = block.replicas
            sig = tuple([(r.holder, r.http_holder, r.size,
                          None if r.layer_digests is None else len(r.layer_digests), r.residency)
                         for r in reps])
            g = index.get(sig)
            if g is None:
                g = index[sig] = len(members)
                members.append([0, reps])
            members[g][0] += 1
            of_block.append(g)
        groups = tuple(ReplicaGroup(n, reps) for n, reps in members)
        return cls(groups, tuple(of_block))


#: An instance's reported links by holder, and the link assumed for any other holder.
Links = tuple[LinkTable, tuple[float, float]]


def links_of(status: InstanceStatus) -> Links:
    return link_table(status.links), assumed_link(tuple(status.links))


def load_us(links: Links, record: ReplicaRecord, profile: Profile) -> float:
    """rtt + 8 * octets / rate from one source, each tier at min(link, tier read rate): the
    fetch_us of §6.4 for a single source, used to pick the source of a group."""
    known, assumed = links
    rate, rtt = replica_link(known, record) or assumed
    return rtt + bytes_us(profile, rate)


def rank(result: LookupResult, candidates: Iterable[InstanceStatus], *, token_count: int,
         block_tokens: int, mean_service_tokens: float = 512.0,
         grouping: Grouping | None = None, links: "LinkArrays | None" = None,
         reference: bool = False) -> list[Candidate]:
    """Candidates by ascending §6.4 cost; ties go to the one holding more, then by URL.

    Blocks resident at an instance cost nothing there; each other group of alike blocks is
    charged to the replica holder that loads the whole group fastest for that instance; bytes
    from one source add up and sources load in parallel (fetch_us is a max over sources).
    `links` keeps the candidates' links as arrays between calls (a router passes its own);
    `reference` ranks with the reference implementation (see the module's docstring).
    """
    matched_tokens = min(result.matched * block_tokens, token_count)
    if reference:
        groups = (grouping or Grouping.by_signature(result)).groups
        return _rank_reference(groups, candidates, matched_tokens, token_count,
                               mean_service_tokens)
    groups = (grouping or Grouping.of(result)).groups
    statuses = list(candidates)
    if not statuses:
        return []
    arrays = links if links is not None else LinkArrays()
    return _rank_arrays(groups, statuses, matched_tokens, token_count, mean_service_tokens,
                        arrays)


def _rank_reference(groups: Sequence[ReplicaGroup], candidates: Iterable[InstanceStatus],
                    matched_tokens: int, token_count: int, mean_service_tokens: float
                    ) -> list[Candidate]:
    out = []
    for status in candidates:
        url = status.instance
        links = links_of(status)
        plan: list[ReplicaRecord] = []
        resident = 0
        for g in groups:
            if any(holds(url, r) for r in g.replicas):
                resident += g.count
            elif len(g.scaled) == 1:
                plan.append(g.scaled[0])
            elif g.scaled:
                j = min(range(len(g.replicas)),
                        key=lambda j: load_us(links, g.replicas[j], g.profiles[j]))
                plan.append(g.scaled[j])
        est = estimate(status, matched_tokens=matched_tokens, total_tokens=token_count, plan=plan,
                       service_us=mean_service_us(status, mean_service_tokens))
        out.append(Candidate(status, est, resident))
    out.sort(key=lambda c: (c.cost_us, -c.resident_blocks, c.instance))
    return out


# --------------------------------------------------------------------------- arrays


_shape_id = operator.attrgetter("shape_id")
_prefill = operator.attrgetter("prefill_tokens_per_s")
_queued = operator.attrgetter("queued")


class LinkArrays:
    """The candidates' links to each replica holder as rows over the candidates (rate, RTT,
    whether the replica sits at the candidate), kept while the candidates and their reported
    links stay the same objects: a router ranks many prompts between two status reports.
    It also keeps the last ranking's per-replica load times, for the directive's source
    order at the chosen instance (`sources`)."""

    ROWS_LIMIT = 4096
    """Rows kept before they are all dropped (holders come and go)."""

    def __init__(self) -> None:
        self._urls: list[str] = []
        self._links: list[tuple[Link, ...]] = []
        self._tables: list[Links] = []
        self._column: dict[str, int] = {}
        self._rows: dict[tuple[str, str | None], int] = {}
        self._rate = np.empty((0, 0))
        self._rtt = np.empty((0, 0))
        self._here = np.empty((0, 0), bool)
        self._base_index: dict[str, list[int]] = {}
        self._last: _Loads | None = None

    def bind(self, statuses: Sequence[InstanceStatus]) -> None:
        """Use these candidates, in this order; rows are kept when nothing they depend on
        changed (the records themselves are new on every route: "queued" counts routes)."""
        self._last = None
        urls = [s.instance for s in statuses]
        links = [s.links for s in statuses]
        if urls == self._urls and all(map(operator.is_, links, self._links)):
            return
        self._urls, self._links = urls, links
        self._tables = [links_of(s) for s in statuses]
        self._column = {u: c for c, u in enumerate(urls)}
        self._base_index = {}
        for c, u in enumerate(urls):
            self._base_index.setdefault(base_url(u), []).append(c)
        self._reset_rows()

    def _reset_rows(self) -> None:
        self._rows = {}
        n = len(self._urls)
        self._rate = np.empty((16, n))
        self._rtt = np.empty((16, n))
        self._here = np.zeros((16, n), bool)

    def _row(self, holder: str, http_holder: str | None) -> int:
        key = (holder, http_holder)
        r = self._rows.get(key)
        if r is not None:
            return r
        if len(self._rows) >= self.ROWS_LIMIT:
            raise _RowsFull
        r = len(self._rows)
        if r == len(self._rate):
            self._rate = np.concatenate([self._rate, np.empty_like(self._rate)])
            self._rtt = np.concatenate([self._rtt, np.empty_like(self._rtt)])
            self._here = np.concatenate([self._here, np.zeros_like(self._here)])
        rates, rtts = [], []
        for known, assumed in self._tables:  # as `load_us` and `cost.source_rate` find it
            link = known.get(holder)
            if link is None and http_holder is not None:
                link = known.get(http_holder)
            rate, rtt = link or assumed
            rates.append(rate)
            rtts.append(rtt)
        self._rate[r] = rates
        self._rtt[r] = rtts
        here = self._here[r]
        here[:] = False
        for url in (holder, http_holder):  # as `cost.resides_at` decides
            if url is not None:
                here[self._base_index.get(base_url(url), [])] = True
        self._rows[key] = r
        return r

    def rows(self, pairs: Sequence[tuple[str, str | None]]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rate, rtt, here) of replicas held by each (holder, http_holder), a row each."""
        try:
            index = [self._row(h, hh) for h, hh in pairs]
        except _RowsFull:
            self._reset_rows()
            index = [self._row(h, hh) for h, hh in pairs]
        return self._rate[index], self._rtt[index], self._here[index]

    def sources(self, groups: Sequence[ReplicaGroup], status: InstanceStatus
                ) -> list[tuple[str, ...]] | None:
        """Per group, the holders of its replicas fastest first for the instance (ties in
        listed order), from the last ranking of these groups; None when that ranking did
        not cost this instance with these links."""
        last = self._last
        c = self._column.get(status.instance)
        if last is None or last.groups is not groups or c is None or status.links is not self._links[c]:
            return None
        load = last.load[:, c].tolist()
        out: list[tuple[str, ...]] = []
        k = 0
        for g in groups:
            n = len(g.replicas)
            order = sorted(range(k, k + n), key=load.__getitem__)
            out.append(tuple(dict.fromkeys([last.holders[r] for r in order])))
            k += n
        return out


class _RowsFull(Exception):
    pass


@dataclass(frozen=True)
class _Loads:
    groups: Sequence[ReplicaGroup]
    load: np.ndarray
    """(replicas of all groups, candidates): rtt + octets / rate of loading the group."""
    holders: list[str]


class _ShapeArrays:
    """A shape's replicas as arrays: what `tier_octets` needs, by replica."""

    __slots__ = ("shape", "pairs", "holders", "scalars", "size", "pieces", "caps", "width",
                 "max_size")

    def __init__(self, shape: ReplicaShape) -> None:
        self.shape = shape
        self.pairs = [(h, hh) for h, hh, *_ in shape]
        self.holders = [h for h, *_ in shape]
        self.max_size = max((size for _, _, size, _, _ in shape), default=0)
        scalars, pieces, caps = [], [], []
        for _, _, size, layers, residency in shape:
            if not (layers and residency):  # one piece, no tier limit
                scalars.append((float(size), 1.0, 0.0))
                pieces.append([1])
                caps.append([math.inf])
                continue
            counts, rates = [], []
            covered = 0
            for tier in residency:
                n = tier.layers[1] - tier.layers[0] + 1
                covered += n
                counts.append(n)
                rates.append(math.inf if tier.read_mbit_per_s is None else tier.read_mbit_per_s)
            if layers > covered:
                counts.append(layers - covered)
                rates.append(math.inf)
            scalars.append((float(size), float(layers), 1.0))
            pieces.append(counts)
            caps.append(rates)
        self.width = max((len(p) for p in pieces), default=1)
        self.scalars = np.array(scalars, float).reshape(-1, 3)  # float size, layers, profiled
        self.size = np.array([size for _, _, size, _, _ in shape], np.int64)
        self.pieces = np.zeros((len(shape), self.width))
        self.caps = np.full((len(shape), self.width), math.inf)
        for j, (p, r) in enumerate(zip(pieces, caps)):
            self.pieces[j, :len(p)] = p
            self.caps[j, :len(r)] = r

    def padded(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        if width == self.width:
            return self.pieces, self.caps
        extra = width - self.width
        return (np.pad(self.pieces, ((0, 0), (0, extra))),
                np.pad(self.caps, ((0, 0), (0, extra)), constant_values=math.inf))


_SHAPE_ARRAYS: dict[int, _ShapeArrays] = {}


def _shape_arrays(shape: ReplicaShape) -> _ShapeArrays:
    """Per shape object (kept while it is: the entry holds it, so its id stays its own)."""
    found = _SHAPE_ARRAYS.get(id(shape))
    if found is not None and found.shape is shape:
        return found
    if len(_SHAPE_ARRAYS) >= 4096:
        _SHAPE_ARRAYS.clear()
    made = _SHAPE_ARRAYS[id(shape)] = _ShapeArrays(shape)
    return made


def _bytes_us(octets: np.ndarray, caps: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """`cost.bytes_us` for rows of pieces (P, T) over links (P, C): a row's pieces added left
    to right; padding pieces are 0 octets, which add nothing."""
    bits = 8 * octets
    out = None
    for t in range(octets.shape[1]):
        # min(link, tier): `rate if cap > rate else cap`, as neither is NaN (both validated)
        term = bits[:, t:t + 1] / np.minimum(rate, caps[:, t:t + 1])
        out = term if out is None else out + term
    assert out is not None
    return out


def _recompute_us(tokens: int, prefill: np.ndarray) -> np.ndarray:
    """`cost.recompute_us` over the candidates' prefill rates."""
    if tokens <= 0:
        return np.zeros(len(prefill))
    unmeasured = prefill <= 0
    return np.where(unmeasured, math.inf, (1e6 * tokens) / np.where(unmeasured, 1.0, prefill))


def _rank_arrays(groups: Sequence[ReplicaGroup], statuses: list[InstanceStatus],
                 matched_tokens: int, token_count: int, mean_service_tokens: float,
                 arrays: LinkArrays) -> list[Candidate]:
    arrays.bind(statuses)
    C = len(statuses)
    fetched = _fetch_arrays(groups, arrays, C)
    if fetched is None:  # sizes past float precision: only the reference's ints are exact
        return _rank_reference(groups, statuses, matched_tokens, token_count,
                               mean_service_tokens)
    fetch, resident = fetched
    prefill = np.fromiter(map(_prefill, statuses), float, C)
    queued = np.fromiter(map(_queued, statuses), float, C)
    service = np.where(prefill == 0, 0.0, _recompute_us(int(mean_service_tokens), prefill))
    wait = queued * service
    recompute = _recompute_us(token_count - matched_tokens, prefill)
    recompute_all = _recompute_us(token_count, prefill)
    cost = wait + np.minimum(fetch + recompute, recompute_all)
    res_l = resident.tolist()
    urls = [s.instance for s in statuses]
    keys = list(zip(cost.tolist(), (-r for r in res_l), urls))
    order = sorted(range(C), key=keys.__getitem__)
    fetch_l, rec_l, all_l, wait_l = (fetch.tolist(), recompute.tolist(), recompute_all.tolist(),
                                     wait.tolist())
    return [Candidate(statuses[c],
                      Estimate(urls[c], fetch_l[c], rec_l[c], wait_l[c], matched_tokens,
                               token_count, all_l[c]),
                      res_l[c])
            for c in order]


def _fetch_arrays(groups: Sequence[ReplicaGroup], arrays: LinkArrays, C: int
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """fetch_us and resident blocks of every candidate, as `_rank_reference` and
    `cost.fetch_us` compute them: per group, resident, or loaded from the replica that loads
    it fastest; a source's loads add up in prefix order, sources load in parallel. A row per
    replica of each group (P), a column per candidate (C)."""
    kept = [g for g in groups if g.replicas]
    if not kept:
        arrays._last = _Loads(groups, np.zeros((0, C)), [])
        return np.zeros(C), np.zeros(C, np.int64)
    info = [_shape_arrays(g.shape if g.shape is not None else replica_shape(g.replicas))
            for g in kept]
    count_of = [g.count for g in kept]
    if max(i.max_size for i in info) * max(count_of) >= 1 << 53:
        return None
    width = max(i.width for i in info)
    per_group = [len(i.pairs) for i in info]
    starts = np.cumsum([0] + per_group[:-1])
    pairs = [p for i in info for p in i.pairs]
    holders = [h for i in info for h in i.holders]
    sources: dict[str, int] = {}
    source = np.array([sources.setdefault(h, len(sources)) for h in holders], np.intp)
    if len(info) == 1:
        scalars, size = info[0].scalars, info[0].size
        pieces, caps = info[0].padded(width)
    else:
        scalars = np.concatenate([i.scalars for i in info])
        size = np.concatenate([i.size for i in info])
        padded = [i.padded(width) for i in info]
        pieces = np.concatenate([p for p, _ in padded])
        caps = np.concatenate([c for _, c in padded])
    count = np.repeat(np.array(count_of, np.int64), per_group)
    rate, rtt, here = arrays.rows(pairs)
    # tier_octets(replica, n) to choose the source; tier_octets(replica of size * n) for
    # fetch_us: the total, per layer where there is a profile, times each piece's layers.
    size_f, layers, profiled = scalars[:, 0], scalars[:, 1], scalars[:, 2] > 0
    choose_total = size_f * count
    fetch_total = (size * count).astype(float)
    choose_bytes = _bytes_us(
        np.where(profiled, choose_total / layers, choose_total)[:, None] * pieces, caps, rate)
    fetch_bytes = (choose_bytes if (choose_total == fetch_total).all() else _bytes_us(
        np.where(profiled, fetch_total / layers, fetch_total)[:, None] * pieces, caps, rate))
    load = rtt + choose_bytes
    arrays._last = _Loads(groups, load, holders)
    # Per group and candidate, the first of its fastest replicas (as min() picks), and
    # whether one of them sits at the candidate.
    G, J = len(kept), per_group[0]
    if per_group.count(J) == G:  # as many replicas in every group: a (G, J, C) view
        picked = load.reshape(G, J, C).argmin(axis=1) + (np.arange(G) * J)[:, None]
        at_home = here.reshape(G, J, C).any(axis=1)
    else:
        P = len(pairs)
        fastest = np.repeat(np.minimum.reduceat(load, starts, axis=0), per_group, axis=0)
        picked = np.minimum.reduceat(np.where(load == fastest, np.arange(P)[:, None], P),
                                     starts, axis=0)
        at_home = np.logical_or.reduceat(here, starts, axis=0)
    resident = (np.array(count_of, np.int64)[:, None] * at_home).sum(axis=0)
    gi, ci = np.nonzero(~at_home)  # group-major: a source's loads add up in prefix order
    rows = picked[gi, ci]
    where = (ci, source[rows])
    us = np.zeros((C, len(sources)))
    rtts = np.full((C, len(sources)), -math.inf)
    used = np.zeros((C, len(sources)), bool)
    np.add.at(us, where, fetch_bytes[rows, ci])
    np.maximum.at(rtts, where, rtt[rows, ci])
    used[where] = True
    per_source = np.where(used, rtts + us, -math.inf)
    fetch = np.where(used.any(axis=1), per_source.max(axis=1), 0.0)
    return fetch, resident
