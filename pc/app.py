"""The Placement Controller over HTTP (DESIGN §3 "PC resources"): lifecycle, sessions,
routing and resharding bundled in `PlacementController`, its routes, and an app factory for
running the PC on its own.

Resources (all JSON, `application/kvsp+json`; errors are problem documents):

- `PUT /instances/{id}/status`: an Instance Status Record; reply `{"state": ...}` (§6.3).
  `{id}` is `instance_id(url)`: the first 16 octets, in hex, of SHA-256 over the instance's base
  URL with its trailing slash (the percent-encoded URL is accepted too). The body's "instance"
  member is authoritative; an `{id}` naming another instance is refused (400, member
  "instance"). Role "instance".
- `GET /instances`: `{"instances": [record + "id", "reported_state", "expires_in_ms",
  "routed", "provisional"]}`: "queued" as reported; "routed" counts requests routed there that
  no record has accounted for yet; "provisional" marks an instance the start hook launched
  that has not reported yet ("reported_state" null).
- `PUT /instances/{id}/state`: `{"state": "active" | "draining" | "sleeping"}`; the PC records it
  and forwards `PUT {ii}state` with `{"state": ..., "epoch": <instance epoch>}`. Role "pc".
- `PUT /sessions/{session}/checkpoint`, `GET /sessions/{session}`, `DELETE /sessions/{session}`
  (our extension: the session ended, do not resume it): see `pc.sessions`.
- `POST /route`: see `pc.placement`. Role "pc", or "client" holding the scope.
- `POST /reshard/{map}`: a Shard Map of version v+1 (plus an optional top-level
  "deadline_ms"); runs §6.9 and answers the outcome. A map the PC does not know yet is
  installed as given (201), with no traffic. Role "admin".
- `GET /shardmaps/{map}`: the authoritative version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp_moq.auth import Action, Authenticator
from kvsp_moq.errors import BadRecord, KvspError, NotFound, TransportError
from kvsp_moq.index_client import IndexClient, raise_for_problem
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.records import InstanceStatus, PrefetchDirective, SessionCheckpoint, ShardMap
from kvsp_moq.tasks import TaskSet
from kvsp_moq.web import build_app, json_response, principal, read_json
from pc.lifecycle import InstanceFailed, InstanceRegistry, LifecycleSettings, StateChanged, id_matches
from pc.placement import (
    LookupFn,
    MemoryIndex,
    PlacementSettings,
    Router,
    RouteRequest,
    ScopeKeys,
    StartHook,
    index_client_lookup,
)
from pc.reshard import Resharder, ReshardSettings, ShardMapStore
from pc.sessions import Failover, FailoverSettings, SessionState, SessionStore, open_database

log = logging.getLogger("kvsp.pc")


@dataclass(frozen=True)
class PCSettings:
    database: str = "kvsp-pc.sqlite3"
    """SQLite file of sessions and shard maps (WAL); it survives a PC restart."""
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


class InstanceClient:
    """The PC's calls to inference instances (DESIGN §3 "Instance resources")."""

    def __init__(self, *, token: str | None = None, timeout: float = 5.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self._own = client is None
        self._client = client

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def aclose(self) -> None:
        if self._own and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, method: str, url: str, body: Any, timeout: float | None = None
                    ) -> httpx.Response:
        try:
            return await self.client.request(method, url, json=body, headers=self.headers,
                                             timeout=timeout or self.timeout)
        except httpx.HTTPError as e:
            raise TransportError(f"{method} {url}: {type(e).__name__} {e}") from None

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        r = await self._call("POST", instance + "prefetch", directive.to_json())
        raise_for_problem(r)

    async def resume(self, instance: str, session: str, body: dict) -> None:
        r = await self._call("POST", f"{instance}sessions/{session}/resume", body)
        raise_for_problem(r)

    async def put_state(self, instance: str, state: str, epoch: int) -> None:
        r = await self._call("PUT", instance + "state", {"state": state, "epoch": epoch})
        raise_for_problem(r)

    async def reshard(self, instance: str, body: dict, timeout: float) -> int:
        return (await self._call("POST", instance + "reshard", body, timeout)).status_code


def _drain_and_reap(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    try:
        for _ in proc.stdout:
            pass
    finally:
        proc.stdout.close()
        proc.wait()


def command_start_hook(command: str, *, timeout_s: float = 60.0,
                       env: dict[str, str] | None = None) -> StartHook:
    """A start hook that runs a shell command to launch an instance (§6.4).

    The command finds the request in its environment (KVSP_SCOPE_ID, KVSP_COMPAT_ID,
    KVSP_REQUEST_REF, KVSP_TOKEN_COUNT; with `env`, e.g. KVSP_PC_URL and KVSP_INDEX_URL too)
    and prints, as the first line of its output, the new instance's base URL or a JSON Instance
    Status Record of what is known of it (rates, links); an empty line means none was started.
    Only that line is waited for, so the command may keep running while the instance starts:
    the directive then overlaps the start.
    """

    extra_env = env

    async def start(request: RouteRequest) -> str | InstanceStatus | None:
        env = dict(os.environ, **(extra_env or {}), KVSP_SCOPE_ID=request.scope_id, KVSP_COMPAT_ID=request.compat_id,
                   KVSP_REQUEST_REF=request.request_ref or "",
                   KVSP_TOKEN_COUNT=str(request.token_count))
        proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env)
        assert proc.stdout is not None
        loop = asyncio.get_running_loop()
        try:
            line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline),
                                          timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            proc.kill()
            raise TransportError(f"start command printed nothing within {timeout_s} s") from None
        finally:
            # The rest of its output is read (a closed pipe would kill a command that keeps
            # logging) and it is reaped whenever it ends, without holding up the request.
            threading.Thread(target=_drain_and_reap, args=(proc,), daemon=True).start()
        text = line.decode("utf-8", "replace").strip()
        if not text:
            return None
        if text.startswith("{"):
            data = json.loads(text)
            data.setdefault("state", "active")
            data.setdefault("ttl_ms", 1)  # replaced by the start grace period
            data.setdefault("epoch", 0)
            return InstanceStatus.from_json(data)
        return v.url(text, "instance", schemes=("http", "https"))

    return start


class PlacementController:
    """Lifecycle, sessions, routing and resharding of one PC, and the tasks that tie them."""

    def __init__(self, settings: PCSettings, *, lookup: LookupFn | None = None,
                 start_hook: StartHook | None = None, keys: ScopeKeys | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.registry = InstanceRegistry(settings.lifecycle, clock=clock)
        self.db = open_database(settings.database)
        self.sessions = SessionStore(self.db)
        self.maps = ShardMapStore(self.db)
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
        self.failover = Failover(self.sessions, self._choose_for, self.instances.resume,
                                 settings.failover)
        self.resharder = Resharder(self.maps, self.instances.reshard, settings.reshard)
        self._tasks = TaskSet()
        self._sweeper: asyncio.Task | None = None
        self._started_at = clock()
        self._orphans_checked = False

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        self._started_at = self.clock()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="pc-sweep")

    async def close(self) -> None:
        tasks = [t for t in (self._sweeper, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.instances.aclose()
        if self._index is not None:
            await self._index.aclose()
        self.sessions.close()
        self.db.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                self.sweep()
            except Exception:  # the sweeper must outlive one bad round
                log.exception("sweep failed")

    def sweep(self) -> None:
        """Expire instance records, and after the start-up grace period fail over sessions
        whose instance never reported to this PC (it died while the PC was down)."""
        self.handle(self.registry.expire())
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


# --------------------------------------------------------------------------- routes


def _instance_for(pc: PlacementController, path_id: str) -> InstanceStatus:
    status = pc.registry.find_by_id(path_id)
    if status is None:
        raise NotFound(f"no instance {path_id}")
    return status


def create_pc_routes(pc: PlacementController) -> list[Route]:
    async def put_status(request: Request) -> Response:
        who = principal(request, Action.REPORT)
        record = InstanceStatus.from_json(await read_json(request))
        if not id_matches(request.path_params["id"], record.instance):
            raise BadRecord("names another instance than the resource path", member="instance")
        reply = pc.registry.report(record, who)
        pc.handle(reply.events)
        return json_response(reply.to_json())

    async def list_instances(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        return json_response({"instances": pc.registry.describe(who)})

    async def put_state(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        body = v.obj(await read_json(request), "body")
        state = v.string(v.required(body, "state"), "state", max_len=32)
        status = _instance_for(pc, request.path_params["id"])
        who.require_every_scope(pc.registry.scopes_of(status.instance), f"instance {status.instance}")
        return json_response(await pc.set_state(status.instance, state))

    def session_id(request: Request) -> str:
        return v.uuid_text(request.path_params["session"], "session")

    async def put_checkpoint(request: Request) -> Response:
        who = principal(request, Action.REPORT)
        body = await read_json(request)
        checkpoint = SessionCheckpoint.from_json(body)
        if checkpoint.session != session_id(request):
            raise BadRecord("differs from the session in the path", member="session")
        instance = body.get("instance")
        if instance is not None:
            instance = v.url(instance, "instance", schemes=("http", "https"))
        state = pc.sessions.checkpoint(checkpoint, instance, by=who,
                                       is_live=pc.registry.is_alive)
        return json_response(state.to_json())

    async def get_session(request: Request) -> Response:
        who = principal(request, Action.READ_SESSIONS)
        state = pc.sessions.get(session_id(request))
        if state is None:
            raise NotFound(f"no session {request.path_params['session']}")
        state.require_access(who)
        return json_response(state.to_json())

    async def delete_session(request: Request) -> Response:
        who = principal(request, Action.REPORT)
        if not pc.sessions.delete(session_id(request), by=who):
            raise NotFound(f"no session {request.path_params['session']}")
        return Response(status_code=204)

    async def route(request: Request) -> Response:
        who = principal(request, Action.ROUTE)
        req = pc.router.parse(await read_json(request))
        who.require_scope(req.scope_id)
        decision = await pc.router.route(req)
        return json_response(decision.to_json())

    async def reshard(request: Request) -> Response:
        principal(request, Action.RESHARD)
        body = v.obj(await read_json(request), "body")
        target = ShardMap.from_json(body)
        if target.map != request.path_params["map"]:
            raise BadRecord("differs from the map in the path", member="map")
        deadline = body.get("deadline_ms")
        if deadline is not None:
            deadline = v.integer(deadline, "deadline_ms", low=1, high=600_000)
        outcome = await pc.resharder.reshard(target, deadline_ms=deadline)
        if outcome is None:
            return json_response({"map": target.map, "version": target.version,
                                  "installed": True}, status=201)
        return json_response(outcome.to_json())

    async def get_shardmap(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        m = pc.maps.get(request.path_params["map"])
        if m is None:
            raise NotFound(f"no shard map {request.path_params['map']}")
        who.require_resource_scope(m.scope_id)
        return json_response(m.to_json())

    return [
        Route("/instances/{id}/status", put_status, methods=["PUT"]),
        Route("/instances/{id}/state", put_state, methods=["PUT"]),
        Route("/instances", list_instances, methods=["GET"]),
        Route("/sessions/{session}/checkpoint", put_checkpoint, methods=["PUT"]),
        Route("/sessions/{session}", get_session, methods=["GET"]),
        Route("/sessions/{session}", delete_session, methods=["DELETE"]),
        Route("/route", route, methods=["POST"]),
        Route("/reshard/{map}", reshard, methods=["POST"]),
        Route("/shardmaps/{map}", get_shardmap, methods=["GET"]),
    ]


def create_pc_app(settings: PCSettings, *, lookup: LookupFn | None = None,
                  start_hook: StartHook | None = None, keys: ScopeKeys | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Starlette:
    """The PC alone (`kvsp index --role pc`); `app.state.pc` is the controller."""
    pc = PlacementController(settings, lookup=lookup, start_hook=start_hook, keys=keys,
                             clock=clock)
    auth = Authenticator.from_file(settings.principals)
    if auth.is_open:
        log.warning("no principals file: the PC runs open")
    return build_app(create_pc_routes(pc), name="kvsp_pc", auth=auth, on_startup=[pc.start],
                     on_shutdown=[pc.close], state={"pc": pc}, openapi="pc")
