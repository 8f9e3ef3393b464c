"""A holder's parts, wired once: the store, its lease table, the index publisher, the MOQT block
publisher and the HTTP handlers over them, with their start and stop.

`kvsp holder` (`holder.app.create_app`), an agent's own pool (`agent.app`) and, through
`holder.service.Holder`, the vLLM connector's embedded holder all assemble a holder here, so
that a rule of how the parts meet (who withdraws a record when a block goes, what the relay
is told when a block moves between tiers, which scopes are stored) is written once.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import httpx

from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import BadRecord
from kvsp_moq.holder.api import HolderApi
from kvsp_moq.holder.index_publisher import IndexPublisher
from kvsp_moq.holder.leases import Clock, LeaseLimits, LeaseTable
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.settings import HolderSettings
from kvsp_moq.holder.store import BlockStore
from kvsp_moq.index_client import IndexClient
from kvsp_moq.moqt.certs import client_tls
from kvsp_moq.web import Metrics

log = logging.getLogger("kvsp.holder")

__all__ = ["HolderAssembly"]


class HolderAssembly:
    """The parts of one holder and their life.

    `client` is the HTTP client the index publisher uses (the agent shares its own); without
    one the assembly makes and closes its own. `what` names the holder in refusals ("the
    agent's", "the holder's").
    """

    def __init__(self, settings: HolderSettings, *, auth: Authenticator,
                 clock: Clock | None = None, client: httpx.AsyncClient | None = None,
                 what: str = "the holder's") -> None:
        self.settings = settings
        self.what = what
        self.leases = LeaseTable(
            limits=LeaseLimits(max_ttl_ms=settings.max_lease_ttl_ms,
                               max_octets=settings.max_lease_bytes, max_leases=settings.max_leases),
            per_client=settings.lease_limits,
            clock=clock or time.monotonic,
            max_total=settings.max_leases_total,
        )
        self.store = BlockStore(
            host_bytes=settings.host_bytes,
            disk_bytes=settings.disk_bytes if settings.data_dir is not None else 0,
            data_dir=settings.data_dir,
            device_bytes=settings.device_bytes,
            device_layers=settings.device_layers,
            rates=settings.rates,
            is_protected=self.leases.is_protected,
            descriptors=settings.descriptors,
        )
        self._own_client: httpx.AsyncClient | None = None
        self.index: IndexClient | None = None
        if settings.index_url:
            if client is None:
                client = self._own_client = httpx.AsyncClient(timeout=5.0, trust_env=False)
            self.index = IndexClient(settings.index_url, token=settings.index_token, client=client,
                                     lean=True)
        self.relay = settings.relay or None
        self.relay_tls = (client_tls(self.relay, cafile=settings.relay_ca,
                                     insecure=settings.relay_insecure) if self.relay else None)
        # With a relay every replica has two records, HTTP and MOQT, and the store is served
        # over MOQT by a BlockPublisher from startup on.
        self.publisher = IndexPublisher(self.store, self.index, holder_url=settings.public_url or "",
                                        record_ttl_ms=settings.record_ttl_ms, relay_url=self.relay)
        # A block that goes: its records are withdrawn; one stored or moved between tiers: its
        # records to the IS, its namespace to the relay (once `use_moqt` connects the two).
        self.store.withdraw = self.publisher.withdraw
        self.store.on_change = self.publisher.announce
        self.api = HolderApi(self.store, self.leases, self.publisher,
                             max_block_bytes=settings.max_block_bytes,
                             chunk_bytes=settings.chunk_bytes, scope_quota=settings.scope_quota,
                             max_put_inflight_bytes=settings.max_put_inflight_bytes)
        self.api.resolve_tenancy(auth, settings.index_token, settings.serve_scopes)
        self.moqt_publisher: BlockPublisher | None = None
        self.on_moqt: Callable[[BlockPublisher | None], None] | None = None
        """Told of the MOQT publisher once it runs, and of None once it stops."""

    @property
    def holder_url(self) -> str:
        """The base URL records name (set it before `start` when known only once bound)."""
        return self.publisher.holder_url

    @holder_url.setter
    def holder_url(self, value: str) -> None:
        self.publisher.holder_url = value

    async def start(self) -> None:
        """Load the store (blocks of scopes no longer served stay on disk, unserved), then
        publish: over MOQT through the relay, and to the IS."""
        log.info("storing blocks of %s", self.api.tenancy.describe())
        await self.store.load(keep=lambda bid: self.api.tenancy.serves(bid.scope_id))
        if (self.index is not None or self.relay) and not self.holder_url:
            raise BadRecord(f"{self.what} public URL is unknown; records cannot be published",
                            member="public_url")
        if self.relay:
            assert self.relay_tls is not None
            self.relay_tls.log_note(log)
            self.moqt_publisher = BlockPublisher(self.store, self.relay, self.holder_url,
                                                 token=self.settings.index_token,
                                                 tls=self.relay_tls, settings=self.settings.quic)
            self.publisher.use_moqt(self.moqt_publisher)
            if self.on_moqt is not None:
                self.on_moqt(self.moqt_publisher)
            await self.moqt_publisher.start()
            log.info("publishing blocks over MOQT through %s", self.relay)
        await self.publisher.start()

    async def stop(self) -> None:
        await self.publisher.stop()
        if self.moqt_publisher is not None:
            await self.moqt_publisher.aclose()
            self.moqt_publisher = None
            if self.on_moqt is not None:
                self.on_moqt(None)
        await self.store.close()
        if self._own_client is not None:
            await self._own_client.aclose()

    def add_gauges(self, metrics: Metrics) -> None:
        """The holder's figures on an app's /metrics."""
        store, gauges = self.store, metrics.gauges

        def used(tier: str) -> Callable[[], float]:
            return lambda: store.used[tier]

        for tier in ("device", "host", "disk"):
            gauges[f"store_{tier}_bytes"] = used(tier)
        gauges["store_blocks"] = lambda: len(store)
        gauges["store_evictions"] = lambda: store.evictions
        gauges["leases"] = lambda: len(self.leases)
        gauges["put_inflight_bytes"] = lambda: self.api.put_inflight_bytes
        gauges["index_publish_failures"] = lambda: self.publisher.failures
        gauges["index_refused_records"] = lambda: self.publisher.refused
