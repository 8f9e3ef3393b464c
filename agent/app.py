"""The inference instance's HTTP resources (DESIGN §3, §6; KVSP §6.3, §6.5, §6.8, §6.9).

    POST  generate                      {"tokens", "max_new_tokens", "sampler", "session"?,
                                         "stream"?, "scope"?, "timeline"?, "prefill_at"?,
                                         "prefill_blocks"?, "prefill_passes"?}
    POST  prefill                       {"tokens", "scope"?} -> 202 {"prompt_blocks", "stored",
                                         "live": [keys], "passes": [[first, count]]}: computed
                                         here, published live
    GET   sessions/{id}                 the session's state and tokens so far
    DELETE sessions/{id}                the client needs no more tokens: stopped here, not resumed
    GET   sessions/{id}/stream?from=k   NDJSON {"index", "epoch", "token"}, then {"done": true}
    POST  sessions/{id}/resume          {"checkpoint", "epoch"} -> 202
    POST  prefetch                      a Prefetch Directive -> 202, Location prefetch/{directive}
    GET   prefetch/{directive}          {"directive", "state", "loaded": [keys], "failed"?,
                                         "sources"?}
    PUT   state                         {"state", "epoch"} (epoch: this instance's)
    GET   status                        the Instance Status Record as it would be sent now
    POST  reshard                       a reshard plan, commit or abort (§6.9)
    GET   reshard/{map}                 {"map", "version", "ranges", "pending", "last": {...,
                                         "fetched": [{"tokens", "from", "bytes"}], ...}}
    PUT   shards/{map}                  {"version", "tokens", "ranges"}: compute and hold ranges
    GET   kv?map=M&tokens=a-b           tokens [a, b) of a held range as a KVB1 container
    GET|HEAD|PUT blocks/{compat}/{scope}/{key}, POST leases, PUT|DELETE leases/{id}: the
                                        agent's own holder (§6.6, §6.7)

The answer to a generate without "stream" is `{"session", "epoch", "tokens", "prompt_tokens",
"cached_tokens", "ttft_ms", "sources": {"moqt", "http", "recompute"[, "local"]}, "load"?,
"load_choice"?, "timing": {"plan_ms", "load_ms"?, "forward_ms"}, "timeline"?}`. "load_choice"
says whether the agent loaded the cached prefix or found recomputing it cheaper, with the §6.4
estimates from its measured rates (`agent.choice`). "sources" counts complete prompt
blocks: loaded over MOQT, over HTTP, from the agent's own store ("local", only when non-zero),
and computed here ("recompute");
"cached_tokens" is the number of prompt tokens loaded rather than computed. It is sent once the
blocks computed for the request are stored and published, so a lookup made after it finds them.

With a relay (`AgentSettings.relay`) the agent is a MOQT publisher too, as a holder with a relay
is (`kvsp_moq.holder`): its store is served through the relay by a `BlockPublisher`, and each of
its replicas gets a MOQT record in the index beside the HTTP one. The status of a prefetch
directive counts the blocks loaded per transport under "sources" ({"moqt", "http"}).

Prefill and decode apart (DESIGN §9): `POST prefill` computes a prompt's complete blocks for
another instance and publishes each layer as it is computed (`agent.live`); it answers as soon
as the blocks' tracks exist, before the pass, with the layout of its pass tracks ("passes":
where each begins, how many blocks it has). A generate with "prefill_at" (that instance's base
URL) and that layout ("prefill_passes") subscribes to those tracks through this instance's relay
at once (one subscription per pass; without the layout, one per block), loads each layer
as it lands (verified against the digest it carries) while computing the rest of the prompt
behind it, and decodes. A producer that fails is a failed source: the prompt is computed here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agent.cores import CoreSplit
from agent.engine import Engine
from agent.model import ModelAdapter, load_model
from agent.prefetch import Prefetcher
from agent.requests import GenerateRequest, PrefillRequest
from agent.settings import AgentSettings
from agent.shards import ShardKeeper
from kvsp_moq.auth import ANY, Action, Authenticator
from kvsp_moq.errors import BadRecord, ForbiddenScope, KvspError, NotActive, NotFound, StaleEpoch
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.leases import LeaseClient
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.fetch.sources import HttpLayerSource, LocalLayerSource, MoqtLayerSource
from kvsp_moq.holder.api import repr_digest
from kvsp_moq.holder.assembly import HolderAssembly
from kvsp_moq.holder.moqt_publisher import BlockPublisher, LivePassTrack
from kvsp_moq.holder.store import BlockId
from kvsp_moq.instance_status import Meters, StatusReporter
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.container import MEDIA_TYPE as BLOCK_MEDIA_TYPE
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import PrefetchDirective
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.web import build_app, json_response, principal, read_json

log = logging.getLogger("kvsp.agent")

NDJSON = "application/x-ndjson"
_TOKENS = re.compile(r"^(\d{1,10})-(\d{1,10})$")

__all__ = ["AgentContext", "create_app"]


class AgentContext:
    """The parts of one agent, reachable from `app.state.agent` (tests, the demo, the bench)."""

    def __init__(self, settings: AgentSettings, adapter: ModelAdapter) -> None:
        self.settings = settings
        self.adapter = adapter
        self._url = ""
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.http_timeout_s, connect=min(settings.http_timeout_s, 5.0)),
            # A small pool: httpcore scans every pooled connection on each request.
            trust_env=False, limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
        self.auth = (settings.auth if settings.auth is not None
                     else Authenticator.from_file(settings.principals))
        # The agent's own pool is a holder like any other: blocks checked against the model's
        # geometry, what others PUT here only of its principal's scopes.
        compat = CompatDescriptor.from_dict(adapter.descriptor(settings.block_tokens))
        self.holder = HolderAssembly(settings.holder_settings({compat.compat_hex: compat}),
                                     auth=self.auth, client=self.client, what="the agent's")
        self.leases_table = self.holder.leases
        self.index = self.holder.index
        self.store = self.holder.store
        self.publisher = self.holder.publisher
        self.holder_api = self.holder.api
        self.meters = Meters()
        # Blocks over plain http:// go through the fetcher's lean client; the shared httpx
        # client carries everything else (leases, the IS, https:// sources).
        self.fetcher = HttpFetcher(client=self.client, token=settings.token, lean=True)
        self.lease_client = LeaseClient(self.client, token=settings.token, on_rtt=self.meters.rtt)
        self.local = LocalLayerSource(self.store, lambda: self.url)
        sources: list[Any] = list(settings.layer_sources)
        self.moqt_fetcher: MoqtBlockFetcher | None = None
        self.moqt_source: MoqtLayerSource | None = None
        self.relay_tls = self.holder.relay_tls
        if settings.relay:
            # MOQT first, HTTP as the fallback, recomputation last (DESIGN §5).
            self.moqt_fetcher = MoqtBlockFetcher(token=settings.token,
                                                 timeout=settings.relay_timeout_s, tls=self.relay_tls,
                                                 settings=settings.quic)
            self.moqt_source = MoqtLayerSource(self.moqt_fetcher, settings.relay)
            sources.insert(0, self.moqt_source)
        sources.append(HttpLayerSource(self.fetcher))
        options = settings.engine_options()
        self.prefetcher = Prefetcher(self.store, self.publisher.announce, self.fetcher,
                                     self.lease_client, self.index,
                                     on_transfer=self.meters.transfer, moqt=self.moqt_source)
        self.engine = Engine(
            adapter, store=self.store, announce=self.publisher.announce,
            is_published=self._is_published, record_for=self.publisher.record_for,
            client=self.client, index=self.index, leases=self.lease_client, sources=sources,
            local=self.local, scope_keys=settings.scope_keys, default_scope=settings.scope,
            self_url=lambda: self.url, pc_url=settings.pc_url, token=settings.token,
            options=options, meters=self.meters, prefetching=self.prefetcher.adopt,
            measure_link=self.prefetcher.measure, produce=self._produce if settings.relay else None)
        self.engine.exporter.published_change = self.publisher.sent
        self.engine.live_records_in = self.publisher.is_live_published
        self.engine.records_sent = self.publisher.sent
        default_scope = self.engine.scope_keys.get(settings.scope or "") if settings.scope else None
        self.shards = ShardKeeper(adapter, self.engine.run_model, self.client, token=settings.token,
                                  default_scope_id=(scope_id_of(default_scope).hex()
                                                    if default_scope is not None else None))
        self.reporter: StatusReporter | None = None
        if settings.pc_url:
            self.reporter = StatusReporter(
                pc_url=settings.pc_url, instance_url=lambda: self.url, client=self.client,
                meters=self.meters, running=lambda: self.engine.running,
                queued=lambda: self.engine.queued, get_state=lambda: self.engine.state,
                set_state=self._set_state, token=settings.token,
                ttl_ms=settings.status_ttl_ms, sleep_after_s=settings.sleep_after_s,
                kv_utilization=self._kv_utilization, epoch=settings.epoch,
                admitted=lambda: self.engine.admitted,
                live_kv=lambda: self.engine.live is not None and self.moqt_publisher is not None)
        self.epoch = self.reporter.epoch if self.reporter else (settings.epoch or 0)
        self.url = settings.public_url or ""
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cores: CoreSplit | None = None

    @property
    def url(self) -> str:
        """The agent's public base URL, ending in "/": its instance URL and holder URL."""
        return self._url

    @url.setter
    def url(self, value: str) -> None:
        self._url = base_url(value) if value else value
        self.publisher.holder_url = self._url

    @property
    def moqt_publisher(self) -> BlockPublisher | None:
        """The publisher serving the pool over MOQT, while it runs."""
        return self.holder.moqt_publisher

    @property
    def compat_id(self) -> str:
        return self.engine.compat_id

    def _produce(self, first: BlockId, layer_count: int, token_count: int) -> LivePassTrack:
        """The pass track of a pass published live through the pool's MOQT publisher, its
        first block `first` (`agent.live`)."""
        moqt = self.moqt_publisher
        if moqt is None:
            raise NotActive("the MOQT publisher is not running")
        return moqt.open_pass(first, layer_count=layer_count, token_count=token_count)

    def _set_state(self, state: str) -> None:
        self.engine.state = state

    def _is_published(self, bid: BlockId) -> bool:
        """In the index and, while the relay is reachable, announced there: a client that
        reads the records can then fetch the block over either transport."""
        if not self.publisher.is_published(bid):
            return False
        moqt = self.moqt_publisher
        if moqt is None or moqt.connection is None:
            return True
        return (bid.compat_id.lower(), bid.scope_id.lower()) in moqt.announced

    def _kv_utilization(self) -> float:
        budget = self.store.budget["host"]
        return self.store.used["host"] / budget if budget else 0.0

    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.holder.start()
        if self.settings.loader_cpus is not None:
            self.cores = CoreSplit(self.settings.loader_cpus)
            # (the model's thread exists from here on, so it is placed with the others)
            await self.engine.run_model(self.cores.on_model_thread)
            self.cores.apply([threading.current_thread()])
        if self.settings.warmup_tokens:
            await self.engine.warmup(self.settings.warmup_tokens)
        if self.moqt_source is not None:
            self.moqt_source.connect()
        if self.reporter is not None:
            await self.reporter.start()

    async def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.reporter is not None:
            await self.reporter.stop()
        await self.prefetcher.close()
        await self.engine.close()
        await self.holder.stop()
        if self.moqt_fetcher is not None:
            await self.moqt_fetcher.aclose()
        await self.fetcher.aclose()
        await self.client.aclose()
        if self.cores is not None:
            self.cores.restore()


# --------------------------------------------------------------------------- handlers


async def _ndjson(lines: AsyncIterator[dict[str, Any]],
                  before_done: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[bytes]:
    async for line in lines:
        if before_done is not None and line.get("done"):
            await before_done()
        yield json.dumps(line, separators=(",", ":")).encode() + b"\n"


def _routes(ctx: AgentContext) -> list[Route]:
    engine = ctx.engine

    async def generate(request: Request) -> Response:
        who = principal(request, Action.GENERATE)
        req = GenerateRequest.from_json(await read_json(request),
                                        max_tokens=ctx.settings.max_new_tokens)
        who.require_scope(scope_id_of(engine.scope_key(req.scope)).hex())
        session = await engine.generate(req)
        # The PC learns that the request ended before its client does, so that the client's
        # next request is placed knowing this instance is free again.
        ended = ctx.reporter.report_now if ctx.reporter is not None else None
        if req.stream:
            return StreamingResponse(_ndjson(session.stream(0), ended), media_type=NDJSON)
        await session.done.wait()
        if ended is not None:
            await ended()
        if session.state != "finished":
            raise KvspError(f"session {session.id} {session.state}: {session.error or ''}".strip())
        await engine.wait_published(session)
        out = {"session": session.id, "epoch": session.epoch, "tokens": list(session.generated),
               "prompt_tokens": len(req.tokens), "cached_tokens": session.cached_tokens,
               "ttft_ms": session.ttft_ms, "sources": dict(session.sources)}
        if session.load is not None:
            out["load"] = session.load
        if session.load_choice is not None:
            out["load_choice"] = session.load_choice.to_json()
        out["timing"] = dict(session.timing)
        if req.timeline and session.timeline is not None:
            out["timeline"] = session.timeline.to_json()
        return json_response(out)

    async def prefill(request: Request) -> Response:
        who = principal(request, Action.GENERATE)
        req = PrefillRequest.from_json(await read_json(request))
        who.require_scope(scope_id_of(engine.scope_key(req.scope)).hex())
        return json_response(await engine.prefill_for_other(req), status=202)

    def session_of(request: Request) -> Any:
        who = principal(request, Action.READ_SESSIONS)
        sid = v.uuid_text(request.path_params["session"], "session")
        session = engine.sessions.get(sid)
        if session is None:
            raise NotFound(f"no session {sid} here")
        who.require_scope(session.scope_id)
        return session

    async def get_session(request: Request) -> Response:
        return json_response(session_of(request).summary())

    async def stop_session(request: Request) -> Response:
        who = principal(request, Action.GENERATE)
        engine.stop(v.uuid_text(request.path_params["session"], "session"), by=who)
        return Response(status_code=204)

    async def stream(request: Request) -> Response:
        session = session_of(request)
        text = request.query_params.get("from", "0")
        if not text.isdigit():
            raise BadRecord("must be a non-negative integer", member="from")
        return StreamingResponse(_ndjson(session.stream(int(text))), media_type=NDJSON)

    async def resume(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        sid = v.uuid_text(request.path_params["session"], "session")
        session = await engine.resume(sid, await read_json(request), by=who)
        return json_response({"session": session.id, "epoch": session.epoch, "state": session.state,
                              "output_offset": len(session.generated)}, 202)

    async def prefetch(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        directive = PrefetchDirective.from_json(await read_json(request))
        who.require_scope(directive.scope_id)
        if directive.compat_id != ctx.compat_id:
            raise BadRecord("is not this instance's compatibility ID", member="compat_id")
        if engine.state != "active":
            raise NotActive(f"this instance is {engine.state}")
        state = ctx.prefetcher.submit(directive)
        return json_response(state.to_json(), 202,
                             headers={"Location": f"{ctx.url}prefetch/{directive.directive}"})

    async def prefetch_status(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        state = ctx.prefetcher.get(request.path_params["directive"])
        if state is None:
            raise NotFound("no such directive here")
        who.require_scope(state.directive.scope_id)
        return json_response(state.to_json())

    async def put_state(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        body = v.obj(await read_json(request), "body")
        state = v.string(v.required(body, "state"), "state", max_len=32)
        epoch = v.integer(v.required(body, "epoch"), "epoch")
        who.require_every_scope(engine.scopes_by_id, "this instance")
        if state not in ("active", "draining", "sleeping"):
            raise BadRecord("must be active, draining or sleeping", member="state")
        if epoch < ctx.epoch:
            raise StaleEpoch(f"this instance is at epoch {ctx.epoch}", member="epoch")
        if epoch > ctx.epoch:
            raise BadRecord(f"this instance is at epoch {ctx.epoch}, not {epoch}", member="epoch")
        engine.state = state
        return json_response({"state": engine.state, "epoch": ctx.epoch})

    async def status(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        if ANY not in who.scopes and who.scopes.isdisjoint(engine.scopes_by_id):
            raise ForbiddenScope(f"principal {who.name!r} holds no scope this instance serves")
        if ctx.reporter is not None:
            return json_response(ctx.reporter.record().to_json())
        return json_response({"instance": ctx.url, "epoch": ctx.epoch, "state": engine.state,
                              "running": engine.running, "queued": engine.queued})

    async def reshard(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        code, body = await ctx.shards.handle(await read_json(request), who)
        return json_response(body, code)

    async def reshard_status(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        return json_response(ctx.shards.status(request.path_params["map"], who))

    async def seed_shards(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        body = await read_json(request)
        return json_response(await ctx.shards.seed(request.path_params["map"], body, who))

    async def kv_range(request: Request) -> Response:
        who = principal(request, Action.TRANSFER_SHARDS)
        name = request.query_params.get("map")
        if not name:
            raise BadRecord("is required", member="map")
        m = _TOKENS.match(request.query_params.get("tokens", ""))
        if not m or int(m.group(1)) >= int(m.group(2)):
            raise BadRecord("must be a-b with a < b (half-open)", member="tokens")
        body = ctx.shards.container(name, int(m.group(1)), int(m.group(2)), who)
        return Response(body, media_type=BLOCK_MEDIA_TYPE,
                        headers={"Repr-Digest": repr_digest(hashlib.sha256(body).digest()),
                                 "Cache-Control": "private, no-store"})

    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/prefill", prefill, methods=["POST"]),
        Route("/sessions/{session}", get_session, methods=["GET"]),
        Route("/sessions/{session}", stop_session, methods=["DELETE"]),
        Route("/sessions/{session}/stream", stream, methods=["GET"]),
        Route("/sessions/{session}/resume", resume, methods=["POST"]),
        Route("/prefetch", prefetch, methods=["POST"]),
        Route("/prefetch/{directive}", prefetch_status, methods=["GET"]),
        Route("/state", put_state, methods=["PUT"]),
        Route("/status", status, methods=["GET"]),
        Route("/reshard", reshard, methods=["POST"]),
        Route("/reshard/{map}", reshard_status, methods=["GET"]),
        Route("/shards/{map}", seed_shards, methods=["PUT"]),
        Route("/kv", kv_range, methods=["GET"]),
    ]


def create_app(settings: AgentSettings, *, adapter: ModelAdapter | None = None) -> Starlette:
    """The agent as one Starlette app; its parts are on `app.state.agent` (an AgentContext).

    The public URL must be known before the app starts (records name it); set
    `app.state.agent.url` first when it is known only once the socket is bound.
    """
    if adapter is None:
        adapter = load_model(settings)
    ctx = AgentContext(settings, adapter)
    app = build_app(_routes(ctx) + ctx.holder_api.routes(), name="kvsp_agent", auth=ctx.auth,
                    on_startup=[ctx.startup], on_shutdown=[ctx.shutdown],
                    state={"agent": ctx, "store": ctx.store, "publisher": ctx.publisher},
                    openapi="agent")
    ctx.holder.add_gauges(app.state.metrics)
    gauges = app.state.metrics.gauges
    gauges["sessions_running"] = lambda: ctx.engine.running
    gauges["sessions_queued"] = lambda: ctx.engine.queued
    gauges["prefill_tokens_per_s"] = lambda: ctx.meters.prefill.value or 0.0
    gauges["decode_tokens_per_s"] = lambda: ctx.meters.decode.value or 0.0
    gauges["live_loads_audited"] = lambda: ctx.engine.live_audited
    gauges["live_loads_mismatched"] = lambda: ctx.engine.live_mismatches
    gauges["live_prefills_outpaced"] = lambda: ctx.engine.live_outpaced
    return app
