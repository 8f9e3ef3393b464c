"""The Placement Controller without its HTTP face: lifecycle, sessions, routing and
resharding bundled in `PlacementController`, with the background tasks that tie them
(expiry sweeps, failovers). `pc.routes` serves it over HTTP."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx

from kvsp_moq.errors import KvspError, StoreUnavailable
from kvsp_moq.index_client import IndexClient
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.records import SessionCheckpoint
from kvsp_moq.tasks import TaskSet, cancel_and_wait
from pc.disaggregation import InFlight, SplitPolicy
from pc.duties import DutyLease
from pc.instances_client import InstanceClient, command_start_hook
from pc.lifecycle import InstanceFailed, InstanceRegistry, LifecycleSettings, StateChanged
from pc.placement import (
    LookupFn,
    MemoryIndex,
    PlacementSettings,
    Router,
    ScopeKeys,
    StartHook,
    index_client_lookup,
)
from pc.redis_state import RedisSessionStore, RedisShardMapStore, RedisState, SharedInstanceRegistry
from pc.reshard import Resharder, ReshardSettings, ShardMaps, ShardMapStore
from pc.sessions import Failover, FailoverSettings, Sessions, SessionState, SessionStore, open_database

__all__ = ["PCSettings", "PlacementController"]

log = logging.getLogger("kvsp.pc")


@dataclass(frozen=True)
class PCSettings:
    database: str = "kvsp-pc.sqlite3"
    """SQLite file of sessions and shard maps (WAL); it survives a PC restart."""
    store: str | None = None
    """A redis:// URL: the PC's state lives there, shared by every PC process naming it
    (`pc.redis_state`), and `database` is not used; None: this process (memory + SQLite)."""
    ended_sessions_keep_s: float = 300.0
    """How long an ended (deleted) session stays readable: a front end whose stream broke
    learns where it ended, and a late checkpoint cannot bring it back."""
    store_password: str | None = None
    """The store's password (Redis requirepass), when not in the URL."""
    duties_ttl_ms: int = 3000
    """With a shared store: how long the duties lease lasts unrenewed (`pc.duties`)."""
    principals: str | None = None
    """Principals file (TOML); None runs open on loopback."""
    scope_keys: str | None = None
    """Keys file (TOML: scope name -> hex key), needed to route from prompt tokens."""
    index_url: str | None = None
    """Base URL of a remote Index Service, when no lookup function is given."""
    token: str | None = None
    """Bearer token the PC presents to instances and to the Index Service."""
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    failover: FailoverSettings = field(default_factory=FailoverSettings)
    reshard: ReshardSettings = field(default_factory=ReshardSettings)
    sweep_interval_s: float = 0.25
    """How often expired instance records are looked for."""
    startup_grace_ms: int = 10_000
    """After a start, sessions whose instance has not reported within this are failed over."""
    http_timeout_s: float = 5.0
    start_command: str | None = None
    """Shell command of the start hook (see `command_start_hook`); None: no hook."""
    start_command_timeout_s: float = 60.0
    start_command_env: dict[str, str] = field(default_factory=dict)
    """Added to the start command's environment (`kvsp index`: KVSP_PC_URL, KVSP_INDEX_URL)."""
    pd: SplitPolicy = field(default_factory=SplitPolicy)
    """When a request's prefill runs on another instance than its decode (`pc.disaggregation`)."""



class PlacementController:
    """Lifecycle, sessions, routing and resharding of one PC, and the tasks that tie them."""

    def __init__(self, settings: PCSettings, *, lookup: LookupFn | None = None,
                 start_hook: StartHook | None = None, keys: ScopeKeys | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.shared: RedisState | None = None
        self.registry: InstanceRegistry
        self.sessions: Sessions
        self.maps: ShardMaps
        self.db: sqlite3.Connection | None = None
        if settings.store is not None:
            self.shared = RedisState(settings.store, password=settings.store_password)
            self.registry = SharedInstanceRegistry(
                self.shared, settings.lifecycle,
                stale_after_s=max(2.0, 8 * settings.sweep_interval_s))
            self.sessions = RedisSessionStore(self.shared,
                                              ended_keep_s=settings.ended_sessions_keep_s)
            self.maps = RedisShardMapStore(self.shared)
        else:
            self.registry = InstanceRegistry(settings.lifecycle, clock=clock)
            self.db = open_database(settings.database)
            self.sessions = SessionStore(self.db)
            self.maps = ShardMapStore(self.db)
        self.duties = DutyLease(self.shared, ttl_ms=settings.duties_ttl_ms)
        self.instances = InstanceClient(token=settings.token, timeout=settings.http_timeout_s,
                                        client=client)
        self._index: IndexClient | None = None
        if lookup is None:
            if settings.index_url:
                self._index = IndexClient(settings.index_url, token=settings.token)
                lookup = index_client_lookup(self._index)
            else:
                log.warning("no Index Service configured: routing sees no cached blocks")
                lookup = MemoryIndex().lookup
        self.keys = keys if keys is not None else ScopeKeys.from_file(settings.scope_keys)
        if start_hook is None and settings.start_command:
            start_hook = command_start_hook(settings.start_command,
                                            timeout_s=settings.start_command_timeout_s,
                                            env=settings.start_command_env)
        self.router = Router(self.registry, lookup, self.instances.prefetch, settings.placement,
                             keys=self.keys, start_hook=start_hook)
        #: uncached blocks recent routes sent to each instance (one prefill for many)
        self.in_flight = InFlight()
        self.failover = Failover(self.sessions, self._choose_for, self.instances.resume,
                                 settings.failover)
        self.resharder = Resharder(self.maps, self.instances.reshard, settings.reshard)
        self._tasks = TaskSet()
        self._sweeper: asyncio.Task | None = None
        self._started_at = clock()
        self._orphans_checked = False
        self._purged_at = clock()
        self._reshards_at = clock()

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        self._started_at = self.clock()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="pc-sweep")

    async def close(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        self._tasks.cancel()
        await cancel_and_wait(sweeper)
        await self._tasks.cancel_and_wait()
        await self.instances.aclose()
        if self._index is not None:
            await self._index.aclose()
        self.duties.release()
        self.sessions.close()
        if self.db is not None:
            self.db.close()
        if self.shared is not None:
            self.shared.close()

    async def _sweep_loop(self) -> None:
        cut_off = False
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                self.sweep()
            except StoreUnavailable as e:  # said once per outage, not every sweep
                if not cut_off:
                    log.warning("sweep: %s; routes answer 503 until the store answers", e.detail)
                cut_off = True
                continue
            except Exception:  # the sweeper must outlive one bad round
                log.exception("sweep failed")
            if cut_off:
                log.info("the store answers again")
                cut_off = False

    def require_store(self) -> None:
        """With a shared store: StoreUnavailable (503) when this process's copy of the
        instances is stale (the store cannot be reached)."""
        if isinstance(self.registry, SharedInstanceRegistry):
            self.registry.require_fresh()

    def sweep(self) -> None:
        """Expire instance records, and after the start-up grace period fail over sessions
        whose instance never reported to this PC (it died while the PC was down). With a
        shared store the copy of the instances is refreshed, and only the holder of the
        duties (`pc.duties`) does the rest."""
        if isinstance(self.registry, SharedInstanceRegistry):
            self.registry.refresh()
        if not self.duties.hold():
            self._orphans_checked = False  # checked again by whoever takes the duties
            self._started_at = self.clock()
            return
        self.handle(self.registry.expire())
        now = self.clock()
        if now - self._reshards_at >= 1.0:
            self._reshards_at = now
            if self.maps.abandoned(time.time()):
                self._spawn(self.resharder.finish_abandoned())
        if now - self._purged_at >= 10.0:
            self._purged_at = now
            self.sessions.purge_ended(self.settings.ended_sessions_keep_s)
        if (not self._orphans_checked
                and (self.clock() - self._started_at) * 1000 >= self.settings.startup_grace_ms):
            self._orphans_checked = True
            for inst in self.sessions.instances():
                if not self.registry.known(inst):
                    log.warning("instance %s has sessions but never reported", inst)
                    self._spawn(self.failover.instance_failed(inst))

    def handle(self, events: Sequence[InstanceFailed | StateChanged]) -> None:
        for e in events:
            if isinstance(e, InstanceFailed):
                log.warning("instance %s (epoch %d) failed: %s", e.instance, e.epoch, e.reason)
                self._spawn(self.failover.instance_failed(
                    e.instance, may_return=e.reason == "restarted"))
            elif e.old != e.new:
                log.info("instance %s: %s -> %s", e.instance, e.old, e.new)

    def _spawn(self, coro: Any) -> None:
        self._tasks.spawn(coro)

    async def idle(self, timeout: float = 10.0) -> None:
        """Wait for background failovers to finish (tests, shutdown)."""
        if self._tasks:
            await asyncio.wait_for(asyncio.gather(*list(self._tasks), return_exceptions=True),
                                   timeout)

    async def _choose_for(self, state: SessionState, exclude: frozenset[str]) -> str | None:
        cp = SessionCheckpoint.from_json(state.checkpoint)
        b = self.settings.placement.block_tokens_by_compat.get(
            cp.compat_id, self.settings.placement.block_tokens)
        keys = list(cp.prompt_blocks)
        scope_key = self.keys.key_for(scope_id=cp.scope_id)
        if scope_key is not None:  # the generated blocks the failed instance published
            chain = BlockKeyChain(scope_key, bytes.fromhex(cp.compat_id), b,
                                  keys=[bytes.fromhex(k) for k in keys])
            keys += [k.hex() for k in chain.extend(list(cp.prompt_tail) + list(cp.generated))]
        count = len(cp.prompt_blocks) * b + len(cp.prompt_tail) + len(cp.generated)
        return await self.router.choose(cp.scope_id, cp.compat_id, keys, token_count=count,
                                        block_tokens=b, exclude=exclude)

    async def set_state(self, instance: str, state: str) -> dict:
        change = self.registry.set_state(instance, state)
        status = self.registry.status_of(instance)
        assert status is not None
        forwarded = False
        try:
            await self.instances.put_state(status.instance, state, status.epoch)
            forwarded = True
        except KvspError as e:
            log.warning("PUT state to %s failed (it learns from its next status reply): %s",
                        status.instance, e.detail)
        return {"instance": status.instance, "state": status.state,
                "changed": change is not None, "forwarded": forwarded}
