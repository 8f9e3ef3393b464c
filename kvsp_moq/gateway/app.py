"""The gateway's HTTP app: OpenAI's API in front of the PC (DESIGN §10).

    GET  /v1/models                 the served model
    GET  /v1/models/{model}         one model, or 404
    POST /v1/completions            text or token-id prompt; SSE with "stream"
    POST /v1/chat/completions       messages through the chat template; SSE with "stream"
    GET  /healthz, GET /metrics     as every server of the project

Per request: the caller's token (role "client") and scope (`kvsp_moq.gateway.scopes`), the
prompt tokenized as the model does (`kvsp_moq.gateway.text`), the Block Keys derived and the
PC asked where to run (`kvsp_moq.gateway.backend`), the tokens detokenized as they arrive and
cut at stop strings. The gateway's own time per request, tokenization and the route included,
generation not, is the `X-KVSP-Gateway-Ms` response header and the `kvsp_gateway_overhead_ms_*`
metrics.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvsp_moq.auth import Action, Authenticator
from kvsp_moq.errors import KvspError
from kvsp_moq.gateway.backend import Backend, Job, Run
from kvsp_moq.gateway.errors import ApiError, install_handlers
from kvsp_moq.gateway.openai_backend import FleetBackend
from kvsp_moq.gateway.requests import Ask, parse_chat, parse_completion
from kvsp_moq.gateway.responses import DONE, Shape, sse, usage
from kvsp_moq.gateway.scopes import SCOPE_HEADER, ScopeChooser
from kvsp_moq.gateway.text import ModelText, StopScan
from kvsp_moq.model_descriptor import DEFAULT_BLOCK_TOKENS, model_descriptor
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY
from kvsp_moq.web import build_app, principal, read_json

log = logging.getLogger("kvsp.gateway")

__all__ = ["GatewaySettings", "create_app"]

OVERHEAD_HEADER = "X-KVSP-Gateway-Ms"
MAX_BODY = 16 << 20


@dataclass(frozen=True)
class GatewaySettings:
    pc_url: str
    """The PC, or several PC processes on one store (comma-separated URLs)."""
    model_dir: str | Path
    """The model's directory (tokenizer, chat template, descriptor); resolve "tiny" first."""
    served_name: str | None = None
    """The model's name in the API; default: its descriptor's name (`<model_type>-<dir>`)."""
    token: str | None = None
    """The gateway's own bearer token at the PC and the instances (role "client")."""
    principals: str | Path | None = None
    auth: Authenticator | None = None
    scope_keys: Mapping[str, bytes] = field(default_factory=dict)
    """Scope name -> key; empty: the open scope (loopback only)."""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    dtype: str = "float32"
    default_max_tokens: int = 256
    """Output tokens of a chat request that names no limit."""
    timeout_s: float = 60.0
    instance_api: str = "auto"
    """What the instances speak: "auto" (asked once each: `kvsp agent` or an OpenAI engine such
    as vLLM with the KVSP connector), "agent" or "openai" (`kvsp_moq.gateway.openai_backend`)."""


class Overhead:
    """The gateway's own milliseconds per request: tokenization and the route."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokenize_ms = 0.0
        self.route_ms = 0.0

    def add(self, tokenize_ms: float, route_ms: float) -> None:
        self.requests += 1
        self.tokenize_ms += tokenize_ms
        self.route_ms += route_ms


class Gateway:
    """The parts of one gateway, on `app.state.gateway`."""

    def __init__(self, settings: GatewaySettings, backend: Backend | None = None) -> None:
        self.settings = settings
        self.text = ModelText(settings.model_dir)
        descriptor = model_descriptor(settings.model_dir, dtype=settings.dtype,
                                      block_tokens=settings.block_tokens)
        self.compat_id = CompatDescriptor.from_dict(descriptor).compat_hex
        self.model = settings.served_name or str(descriptor["model"])
        self.created = int(time.time())
        self.scopes = ScopeChooser(dict(settings.scope_keys) or {OPEN_SCOPE: OPEN_SCOPE_KEY})
        self.backend: Backend = backend or FleetBackend(
            settings.pc_url, instance_api=settings.instance_api, compat_id=self.compat_id,
            block_tokens=settings.block_tokens, token=settings.token, timeout_s=settings.timeout_s)
        self.overhead = Overhead()

    async def shutdown(self) -> None:
        await self.backend.aclose()

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "kvsp"}

    def prompt_tokens(self, ask: Ask) -> list[int]:
        try:
            if ask.prompt_tokens is not None:
                tokens = list(ask.prompt_tokens)
            elif ask.chat:
                tokens = self.text.chat_tokens(ask.messages)
            else:
                tokens = self.text.encode(ask.prompt or "")
        except ValueError as e:
            raise ApiError(400, str(e), param="messages" if ask.chat else "prompt") from None
        if not tokens:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        return tokens


class Output:
    """One request's output: text pieces as they may be sent, the finish reason, the count."""

    def __init__(self, gw: Gateway, ask: Ask, prompt: list[int], run: Run) -> None:
        self.gw, self.ask, self.prompt, self.run = gw, ask, prompt, run
        self.completion_tokens = 0
        self.finish = "length"

    async def pieces(self) -> AsyncIterator[str]:
        text = self.gw.text
        detok = text.detokenizer(self.prompt)
        scan = StopScan(self.ask.stop)
        complete = False
        try:
            async with contextlib.aclosing(self.run.tokens()) as tokens:
                async for tid in tokens:
                    self.completion_tokens += 1
                    if tid in text.eos_ids:
                        self.finish = "stop"
                        break
                    piece = scan.push(detok.add(tid))
                    if piece:
                        yield piece
                    if scan.stopped:
                        self.finish = "stop"
                        break
                else:
                    complete = True
        finally:
            if not complete:  # ended early (a stop, the client gone): the instance stops too
                await self.run.stop()
        rest = scan.flush()
        if rest:
            yield rest

    async def usage(self) -> dict[str, Any]:
        return usage(len(self.prompt), self.completion_tokens, await self.run.cached_tokens())


async def _stream(out: Output, shape: Shape) -> AsyncIterator[bytes]:
    """SSE events; an error after the first event is an event too (an OpenAI client raises
    it), as the status line has gone out."""
    first = True
    try:
        async for piece in out.pieces():
            yield sse(shape.chunk(piece, first=first))
            first = False
        yield sse(shape.chunk(None if shape.chat else "", out.finish, first=first))
        if out.ask.include_usage:
            yield sse(shape.usage_chunk(await out.usage()))
    except (KvspError, ApiError) as e:
        api = e if isinstance(e, ApiError) else ApiError.from_kvsp(e)
        log.warning("stream %s failed: %s", shape.id, api.message)
        yield sse(api.to_json())
    yield DONE


def _routes(gw: Gateway) -> list[Route]:
    async def models(request: Request) -> Response:
        principal(request, Action.GENERATE)
        return JSONResponse({"object": "list", "data": [gw.model_card()]})

    async def model(request: Request) -> Response:
        principal(request, Action.GENERATE)
        if request.path_params["model"] != gw.model:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(gw.model_card())

    async def complete(request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        who = principal(request, Action.GENERATE)
        body = await read_json(request, max_bytes=MAX_BODY)
        ask = parse_chat(body) if chat else parse_completion(body)
        if ask.model != gw.model:
            raise ApiError(404, f"the model {ask.model!r} does not exist; this gateway serves "
                                f"{gw.model!r}", param="model", code="model_not_found")
        scope = gw.scopes.choose(who, request.headers.get(SCOPE_HEADER))
        prompt = gw.prompt_tokens(ask)
        max_tokens = ask.max_tokens or gw.settings.default_max_tokens
        job = Job(tuple(prompt), max_tokens, ask.sampling.sampler(), scope)
        tokenize_ms = (time.perf_counter() - t0) * 1000
        run = await gw.backend.start(job)
        overhead = tokenize_ms + run.route_ms
        gw.overhead.add(tokenize_ms, run.route_ms)
        headers = {OVERHEAD_HEADER: f"{overhead:.3f}"}
        shape = Shape.new(chat, job.request_id, gw.model)
        out = Output(gw, ask, prompt, run)
        if ask.stream:
            return StreamingResponse(_stream(out, shape), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        text = "".join([piece async for piece in out.pieces()])
        return JSONResponse(shape.whole(text, out.finish, await out.usage()), headers=headers)

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def create_app(settings: GatewaySettings, *, backend: Backend | None = None) -> Starlette:
    """The gateway as one Starlette app; its parts are on `app.state.gateway`."""
    gw = Gateway(settings, backend)
    auth = (settings.auth if settings.auth is not None
            else Authenticator.from_file(settings.principals))
    app = build_app(_routes(gw), name="kvsp_gateway", auth=auth, on_shutdown=[gw.shutdown],
                    state={"gateway": gw})
    install_handlers(app)
    gauges = app.state.metrics.gauges
    gauges["overhead_requests"] = lambda: gw.overhead.requests
    gauges["overhead_ms_tokenize_sum"] = lambda: round(gw.overhead.tokenize_ms, 3)
    gauges["overhead_ms_route_sum"] = lambda: round(gw.overhead.route_ms, 3)
    # outputs continued on another OpenAI engine after theirs was lost
    gauges["continued"] = lambda: getattr(gw.backend, "continued", 0)
    return app
