"""Loads of KVSP blocks into vLLM's paged cache, through the project's one load path.

Everything a load needs is the library's, not the connector's: source ordering (MOQT through the
relay first when one is configured, then HTTP), a lease at each source's holder before its
first octet is read (§6.6) and renewed while the load lasts, verified layers in ascending order
(§6.7: every layer against its replica's record), fallback to the next replica at the first
missing layer, requests in layer-group-major order, and a layer marked ready only once every
block holds it. That is `kvsp_moq.fetch.prefix.PrefixLoader` over the sources of
`kvsp_moq.fetch.sources`, the agent's load path too.

The loader writes into `layout.PagedBlocks` (the request's paged blocks, with the slab layout of
the engine's backend) exactly as it writes into the agent's `KVPool`: both are `LayerPool`s.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from kvsp_moq.errors import KvspError
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.leases import LeaseClient, RttObserver
from kvsp_moq.fetch.prefix import PrefixLoader, Timeline, TransferObserver
from kvsp_moq.fetch.sources import HttpLayerSource, MoqtLayerSource, order_candidates
from kvsp_moq.integrations.vllm.config import ConnectorConfig
from kvsp_moq.integrations.vllm.layout import PagedBlocks
from kvsp_moq.integrations.vllm.loop import LoopThread
from kvsp_moq.protocol.records import ReplicaRecord

log = logging.getLogger("kvsp.vllm.transport")

__all__ = ["BlockTransport", "Load", "LoadOutcome"]


@dataclass
class LoadOutcome:
    """How one request's load ended."""

    #: slots (positions in the load) whose every layer is in the paged cache, verified
    complete: list[bool]
    #: loaded blocks per transport ("moqt", "http")
    by_kind: dict[str, int]
    failures: list[dict[str, str]]
    octets: int
    seconds: float
    timeline: list[dict[str, Any]] | None


class Load:
    """One request's blocks loading on the connector's loop; the model thread waits on it."""

    def __init__(self, loader: PrefixLoader, target: PagedBlocks, transport: "BlockTransport",
                 started: float) -> None:
        self.loader = loader
        self.target = target
        self.transport = transport
        self.started = started
        self.future = transport.loop.submit(loader.run())
        self.outcome: LoadOutcome | None = None

    def wait_layer(self, layer: int) -> bool:
        """Block until layer `layer` of every block is in place; False when the load failed or
        timed out (the blocks still missing are then load errors, see `finish`)."""
        try:
            self.loader.wait_for_layer(layer)
            return True
        except TimeoutError as e:
            # Later layers must not wait out the same timeout again: the load has failed.
            self.loader.fail(e)
            return False
        except (RuntimeError, KvspError):
            return False

    def wait_all(self, timeout: float) -> None:
        """Until the whole load has ended, however it ends (the non-pipelined baseline)."""
        try:
            self.future.result(timeout)
        except Exception:  # the outcome is read by `finish`
            pass

    def finish(self, timeout: float) -> LoadOutcome:
        """Wait up to `timeout` for the load to end, then stop it: after this returns no octet
        is written into the paged cache any more. Idempotent."""
        if self.outcome is not None:
            return self.outcome
        report = None
        try:
            report = self.future.result(timeout)
        except Exception as e:  # timed out, cancelled or failed: what is complete stays
            self.future.cancel()
            log.info("load of %d blocks stopped: %s", len(self.target.block_keys),
                     getattr(e, "detail", None) or type(e).__name__)
        self.target.close()
        self.transport.loop.submit(self.loader.release_leases())
        tl = self.loader.timeline
        self.outcome = LoadOutcome(
            complete=self.target.complete(),
            by_kind=dict(report.by_kind) if report is not None else {},
            failures=list(report.failures) if report is not None else [],
            octets=report.octets if report is not None else 0,
            seconds=time.perf_counter() - self.started,
            timeline=_timeline(tl) if self.transport.config.timeline else None)
        return self.outcome


def _timeline(tl: Timeline) -> list[dict[str, Any]]:
    """Per layer, in perf_counter seconds: when its load started and when its last block
    arrived, and when the forward pass began and ended waiting for it."""
    return [{"layer": i, "load_start": tl.load_start[i], "arrived": tl.load_end[i],
             "wait_start": tl.wait_start[i], "wait_end": tl.compute_start[i]}
            for i in range(tl.layers)]


class BlockTransport:
    """The sources, lease client and fetchers of one worker, on its loop."""

    def __init__(self, config: ConnectorConfig, loop: LoopThread, *,
                 on_transfer: TransferObserver | None = None,
                 on_rtt: RttObserver | None = None) -> None:
        self.config = config
        self.loop = loop
        #: link measurements (the engine's status reports them)
        self.on_transfer = on_transfer
        self.on_rtt = on_rtt
        self._sources: list[Any] = []
        self._client: httpx.AsyncClient | None = None
        self._fetcher: HttpFetcher | None = None
        self._moqt: Any = None
        self.leases: LeaseClient | None = None
        loop.call(self._open())

    async def _open(self) -> None:
        c = self.config
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0), trust_env=False)
        self._fetcher = HttpFetcher(token=c.token, timeout=10.0)
        self.leases = LeaseClient(self._client, token=c.token, on_rtt=self.on_rtt)
        if c.relay:
            from kvsp_moq.fetch.moqt import MoqtBlockFetcher
            from kvsp_moq.moqt.certs import client_tls

            tls = client_tls(c.relay, cafile=c.relay_ca, insecure=c.relay_insecure,
                             ca_option="relay_ca", insecure_option="relay_insecure")
            self._moqt = MoqtBlockFetcher(token=c.token, timeout=c.relay_timeout_s, tls=tls,
                                          settings=c.quic)
            source = MoqtLayerSource(self._moqt, c.relay)
            source.connect()  # the first load need not wait for a handshake
            self._sources.append(source)
        self._sources.append(HttpLayerSource(self._fetcher))

    def start(self, target: PagedBlocks, records: Sequence[Sequence[str]]) -> Load:
        """Start loading `target`'s blocks; `records` holds each block's Replica Records as
        JSON text (a record that does not validate is skipped)."""
        plans = []
        for texts in records:
            parsed = []
            for text in texts:
                try:
                    parsed.append(ReplicaRecord.from_json(json.loads(text)))
                except (KvspError, ValueError) as e:
                    log.info("skipping a replica record that does not validate: %s", e)
            plans.append(order_candidates(parsed, self._sources))
        assert self.leases is not None
        started = time.perf_counter()
        loader = PrefixLoader(target, plans,
                              leases=self.leases, lease_ms=self.config.lease_ms,
                              concurrency=self.config.load_concurrency,
                              layers_per_request=self.config.layers_per_request,
                              readiness_timeout=self.config.load_timeout_s,
                              on_transfer=self.on_transfer,
                              timeline=Timeline(target.num_layers))
        return Load(loader, target, self, started)

    def close(self) -> None:
        async def close_all() -> None:
            if self._moqt is not None:
                await self._moqt.aclose()
            if self._fetcher is not None:
                await self._fetcher.aclose()
            if self._client is not None:
                await self._client.aclose()

        try:
            self.loop.call(close_all(), 5.0)
        except Exception:  # closing anyway
            pass
