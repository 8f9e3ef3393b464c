"""The one client interface for KV blocks (DESIGN §2, §5): layers a..b of block K from these
sources, verified, in ascending order, with fallback.

    http.py      HttpFetcher: layers over HTTP (§6.7) from a list of holders
    moqt.py      MoqtBlockFetcher: layers over MOQT (DESIGN §4) through relays
    stream.py    what both fetchers' streams share: the account of sources, SourceFailed,
                 FetchedBlock (a whole verified container)
    sources.py   LayerSource and its HTTP, MOQT and local implementations; SourceCandidate
                 (one replica and the source that reads it); order_candidates
    fallback.py  BlockCandidates / fetch_layers: candidates tried in order, leased, falling
                 back across transports and replicas mid-block
    leases.py    LeaseClient and LeaseKeeper (§6.6)
    prefix.py    PrefixLoader: the blocks of a prefix into a LayerPool, layer-group-major,
                 each layer marked ready once every block holds it (the pipelined load)

The agent and the vLLM connector use it alike. Names are importable from here too; each
submodule is imported on first use, so that a caller of the HTTP fetcher alone does not load
the MOQT binding.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "HttpFetcher": "http", "HttpLayerStream": "http", "fetch_block": "http",
    "MoqtBlockFetcher": "moqt", "MoqtLayerStream": "moqt",
    "FailureKind": "stream", "FetchedBlock": "stream", "SourceFailed": "stream", "VerifiedLayerStream": "stream",
    "LayerSource": "sources", "LayerTuple": "sources", "HttpLayerSource": "sources",
    "MoqtLayerSource": "sources", "LocalLayerSource": "sources", "SourceCandidate": "sources",
    "order_candidates": "sources",
    "Attempt": "fallback", "BlockCandidates": "fallback", "CandidatesExhausted": "fallback",
    "FallbackStream": "fallback", "SourcedLayer": "fallback", "fetch_layers": "fallback",
    "lease_first_candidates": "fallback",
    "LeaseClient": "leases", "LeaseKeeper": "leases", "lease_unavailable": "leases",
    "LayerPool": "prefix", "LayerReadiness": "prefix", "LoadReport": "prefix",
    "PrefixLoader": "prefix", "Timeline": "prefix",
}

# Spelled out, not sorted(_WHERE), so that linters and type checkers read it; the same names.
__all__ = [
    "Attempt", "BlockCandidates", "CandidatesExhausted", "FailureKind", "FallbackStream", "FetchedBlock",
    "HttpFetcher", "HttpLayerSource", "HttpLayerStream", "LayerPool", "LayerReadiness",
    "LayerSource", "LayerTuple", "LeaseClient", "LeaseKeeper", "LoadReport", "LocalLayerSource",
    "MoqtBlockFetcher", "MoqtLayerSource", "MoqtLayerStream", "PrefixLoader", "SourceCandidate",
    "SourceFailed", "SourcedLayer", "Timeline", "VerifiedLayerStream",
    "fetch_block", "fetch_layers", "lease_first_candidates", "lease_unavailable", "order_candidates",
]

if TYPE_CHECKING:
    from kvsp_moq.fetch.fallback import (
        Attempt,
        BlockCandidates,
        CandidatesExhausted,
        FallbackStream,
        SourcedLayer,
        fetch_layers,
        lease_first_candidates,
    )
    from kvsp_moq.fetch.http import HttpFetcher, HttpLayerStream, fetch_block
    from kvsp_moq.fetch.leases import LeaseClient, LeaseKeeper, lease_unavailable
    from kvsp_moq.fetch.moqt import MoqtBlockFetcher, MoqtLayerStream
    from kvsp_moq.fetch.prefix import LayerPool, LayerReadiness, LoadReport, PrefixLoader, Timeline
    from kvsp_moq.fetch.sources import (
        HttpLayerSource,
        LayerSource,
        LayerTuple,
        LocalLayerSource,
        MoqtLayerSource,
        SourceCandidate,
        order_candidates,
    )
    from kvsp_moq.fetch.stream import FailureKind, FetchedBlock, SourceFailed, VerifiedLayerStream


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
