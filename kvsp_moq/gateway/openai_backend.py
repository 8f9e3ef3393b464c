"""Instances with an OpenAI URL (vLLM with the KVSP connector) behind the PC (DESIGN §10).

A vLLM engine whose connector has `pc` and `instance_url` reports §6.3 status under its OpenAI
base URL, so the PC routes to it as to a `kvsp agent`. `FleetBackend` routes as `AgentBackend`
and then asks what the chosen instance speaks, once per instance (`InstanceApis`): one that
answers `GET {instance}v1/models` with OpenAI's model list is an OpenAI engine, anything else an
agent. So one gateway serves a fleet of both kinds; `--instance-api agent|openai` fixes the
answer instead (then an agent is never probed).

An OpenAI engine is sent `POST {instance}v1/completions` with the prompt as token ids (the
gateway tokenized it, chat template included), `stream: true`, `return_token_ids: true` and the
sampler as temperature/top_p/seed; its token ids are what the gateway detokenizes, cuts at stop
strings and sends. `stream_options.include_usage` brings vLLM's count of prompt tokens it did
not compute (`prompt_tokens_details.cached_tokens`, with `--enable-prompt-tokens-details`).

A stream survives its engine (`OpenAIRun`): when the connection breaks, or the stream ends
without a finish reason, or the engine answers an error of its own (5xx) mid-stream, the
request is routed again with the lost engine excluded and continues there from the prompt and
the tokens already delivered, `max_tokens` reduced by their number; each token is delivered
once, and greedy output is the one an uninterrupted run gives. The prompt's blocks are loaded
from KVSP there, where a replica outlives the lost engine (a storage holder, `holder: URL`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Mapping, Sequence

import httpx

from kvsp_moq.errors import ConnectError, TransportError, reason_of
from kvsp_moq.gateway.backend import AgentBackend, Job, Run
from kvsp_moq.gateway.errors import ApiError
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tasks import TaskSet

log = logging.getLogger("kvsp.gateway")

__all__ = ["INSTANCE_APIS", "FleetBackend", "InstanceApis", "OpenAIRun", "engine_request"]

#: `--instance-api`: probe each instance, or take every one for an agent or an OpenAI engine.
INSTANCE_APIS = ("auto", "agent", "openai")
#: Instances whose API is remembered; beyond that the memory starts again.
MAX_KNOWN = 4096
#: How long an instance's API is believed (a URL may be given to another server).
KNOWN_S = 300.0
#: Instances one output may lose (each continued on another), at most.
MAX_CONTINUATIONS = 4


@dataclass(frozen=True)
class Api:
    """What an instance speaks: "agent" or "openai", and an OpenAI engine's model name."""

    kind: str
    model: str | None = None


class InstanceApis:
    """The API of each instance, asked once (`GET {instance}v1/models`) and remembered."""

    def __init__(self, client: httpx.AsyncClient, headers: Mapping[str, str], *,
                 fixed: str = "auto", timeout_s: float = 10.0) -> None:
        if fixed not in INSTANCE_APIS:
            raise ValueError(f"instance API must be one of {', '.join(INSTANCE_APIS)}")
        self.client = client
        self.headers = dict(headers)
        self.fixed = fixed
        self.timeout_s = timeout_s
        self._known: dict[str, tuple[float, Api]] = {}

    async def of(self, instance: str) -> Api:
        """ConnectError when the instance cannot be reached (the caller routes elsewhere)."""
        if self.fixed == "agent":
            return Api("agent")
        now = time.monotonic()
        known = self._known.get(instance)
        if known is not None and now - known[0] < KNOWN_S:
            return known[1]
        api = await self._probe(instance)
        if len(self._known) >= MAX_KNOWN:
            self._known.clear()
        self._known[instance] = (now, api)
        return api

    def forget(self, instance: str) -> None:
        self._known.pop(instance, None)

    async def _probe(self, instance: str) -> Api:
        try:
            r = await self.client.get(f"{instance}v1/models", headers=self.headers,
                                      timeout=self.timeout_s)
        except httpx.ConnectError as e:
            raise ConnectError(f"instance {instance} is unreachable: "
                               f"{reason_of(e, named=True)}") from None
        except httpx.HTTPError as e:
            raise TransportError(f"instance {instance}: {reason_of(e, named=True)}") from None
        model = _model_of(r)
        if model is not None:
            return Api("openai", model)
        if self.fixed == "openai":
            raise TransportError(f"instance {instance} does not list a model at /v1/models "
                                 f"(HTTP {r.status_code}); is it an OpenAI-compatible engine?")
        return Api("agent")


def _model_of(r: httpx.Response) -> str | None:
    """The first model of an OpenAI model list, or None when this is not one."""
    if r.status_code != 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return None
    data = body.get("data") if isinstance(body, dict) and body.get("object") == "list" else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    model = data[0].get("id")
    return model if isinstance(model, str) and model else None


def engine_request(job: Job, model: str, apart: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The body of `POST {instance}v1/completions` for a job: token ids in and out, streamed.
    `apart` (prefill and decode apart: "prefill_at", "prefill_blocks") becomes the connector's
    `kv_transfer_params`: the engine subscribes to the prompt's layers there."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(job.tokens), "max_tokens": job.max_tokens,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if apart and apart.get("prefill_at"):
        params: dict[str, Any] = {"kvsp_prefill_at": apart["prefill_at"]}
        if apart.get("prefill_blocks") is not None:
            params["kvsp_prefill_blocks"] = apart["prefill_blocks"]
        body["kv_transfer_params"] = params
    sampler = job.sampler
    if sampler.get("method") == "greedy":
        body["temperature"] = 0.0
    else:
        params = sampler.get("params") or {}
        body["temperature"] = float(params.get("temperature", 1.0))
        body["top_p"] = float(params.get("p", 1.0))
    if sampler.get("seed") is not None:
        body["seed"] = int(sampler["seed"])
    return body


class Broken(Exception):
    """The engine's stream ended before its output did (the engine died, or failed)."""


class OpenAIRun:
    """One job on an OpenAI engine, continued on another when the engine is lost."""

    def __init__(self, backend: "FleetBackend", job: Job, decision: Mapping[str, Any],
                 instance: str, model: str, route_ms: float, *,
                 exclude: Sequence[str] = (), apart: Mapping[str, Any] | None = None) -> None:
        self.backend = backend
        self.job = job
        self.decision = decision
        self.instance = instance
        self.model = model
        self.route_ms = route_ms
        #: instances this output may not go to (lost by it already)
        self.exclude = tuple(exclude)
        #: prefill and decode apart: where the prompt's layers come from
        self.apart = dict(apart or {})
        self._response: httpx.Response | None = None
        self._cached = 0
        self._next: Run | None = None

    async def open(self) -> None:
        """Send the request; refusals before the first token are the caller's errors (4xx
        relayed in OpenAI's shape) or the engine's (TransportError). ConnectError when the
        engine cannot be reached or fails (5xx): the request is routed elsewhere."""
        b = self.backend
        request = b.client.build_request(
            "POST", f"{self.instance}v1/completions",
            json=engine_request(self.job, self.model, self.apart),
            headers={**b.headers, "X-Request-Id": self.job.request_id},
            timeout=b.timeout_s)  # also the longest wait for the next event: then it is lost
        try:
            r = await b.client.send(request, stream=True)
        except httpx.ConnectError as e:
            raise ConnectError(f"instance {self.instance} is unreachable: "
                               f"{reason_of(e, named=True)}") from None
        except httpx.HTTPError as e:
            raise TransportError(f"instance {self.instance}: {reason_of(e, named=True)}") from None
        if r.status_code >= 400:
            try:
                await r.aread()
            except httpx.HTTPError:
                pass
            finally:
                await r.aclose()
            raise _refusal(r, self.instance)
        self._response = r

    async def _events(self) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's JSON events, until `[DONE]`; Broken when it breaks before."""
        r = self._response
        assert r is not None
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise Broken(f"an event that is not JSON: {data[:80]!r}") from None
                if isinstance(event, dict):
                    yield event
        except httpx.HTTPError as e:
            raise Broken(reason_of(e, named=True)) from None
        raise Broken("the stream ended without [DONE]")

    async def _read(self) -> AsyncGenerator[int, None]:
        """This engine's token ids; Broken when it is lost before its output ends."""
        async with _closing(self._events()) as events:
            async for event in events:
                error = event.get("error")
                if error is not None:
                    api = _stream_error(error)
                    if api.status < 500:
                        raise api
                    raise Broken(f"the engine failed: {api.message}")
                self._note_usage(event.get("usage"))
                tokens: list[int] = []
                finished = False
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids") or ()
                    tokens.extend(t for t in ids if type(t) is int)
                    finished = finished or choice.get("finish_reason") is not None
                if finished:  # the usage event and [DONE] follow at once: read them first
                    try:
                        async for rest in events:
                            self._note_usage(rest.get("usage"))
                    except Broken:
                        pass  # the output is whole; only the count is lost
                for t in tokens:
                    yield t
                if finished:
                    return

    def _note_usage(self, use: Any) -> None:
        details = use.get("prompt_tokens_details") if isinstance(use, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int:
            self._cached = cached

    async def tokens(self) -> AsyncGenerator[int, None]:
        out: list[int] = []
        try:
            async with _closing(self._read()) as read:
                async for t in read:
                    out.append(t)
                    yield t
            return
        except Broken as e:
            if len(out) >= self.job.max_tokens:
                return
            reason = str(e)
        finally:
            await self._close()
        nxt = await self._continue(out, reason)
        async with _closing(nxt.tokens()) as more:
            async for t in more:
                yield t

    async def _continue(self, out: Sequence[int], reason: str) -> Run:
        """The rest of the output on another engine, from the prompt and `out`."""
        if len(self.exclude) >= MAX_CONTINUATIONS:
            raise TransportError(f"instance {self.instance} was lost mid-stream ({reason}), "
                                 f"and {len(self.exclude)} others before it")
        log.warning("request %s: instance %s lost after %d tokens (%s); continuing elsewhere",
                    self.job.request_id, self.instance, len(out), reason)
        self.backend.apis.forget(self.instance)
        self.backend.continued += 1
        job = Job(self.job.tokens + tuple(out), self.job.max_tokens - len(out),
                  self.job.sampler, self.job.scope)
        nxt = await self.backend.start(job, exclude=(*self.exclude, self.instance))
        self._next = nxt
        return nxt

    async def _close(self) -> None:
        r, self._response = self._response, None
        if r is not None:
            await r.aclose()

    async def cached_tokens(self) -> int:
        """vLLM's count for the engine that ended the output, at most the client's prompt
        (a continuation's prompt also holds the tokens already delivered)."""
        if self._next is not None:
            return min(len(self.job.tokens), await self._next.cached_tokens())
        return self._cached

    async def stop(self) -> None:
        """Close the stream: vLLM aborts a request whose client went away."""
        await self._close()
        if self._next is not None:
            await self._next.stop()


class _closing:
    """`contextlib.aclosing` for an async generator, typed for mypy."""

    def __init__(self, gen: AsyncGenerator[Any, None]) -> None:
        self.gen = gen

    async def __aenter__(self) -> AsyncGenerator[Any, None]:
        return self.gen

    async def __aexit__(self, *exc: object) -> None:
        await self.gen.aclose()


def _stream_error(error: Any) -> ApiError:
    if not isinstance(error, dict):
        return ApiError(502, f"the engine sent an error: {error!r}"[:300])
    code = error.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else 500
    return ApiError(status, str(error.get("message") or "the engine failed"),
                    param=error.get("param") if isinstance(error.get("param"), str) else None)


def _refusal(r: httpx.Response, instance: str) -> Exception:
    """An engine's answer >= 400 to a request: the caller's fault (4xx, relayed as OpenAI's
    error with the engine's message), the engine's (5xx: ConnectError, so that the request is
    routed elsewhere) or the gateway's (its token refused: TransportError)."""
    try:
        error = r.json().get("error")
    except (ValueError, AttributeError, httpx.ResponseNotRead):
        error = None
    message = (error.get("message") if isinstance(error, dict) else None) or r.text[:300]
    if 400 <= r.status_code < 500 and r.status_code not in (401, 403, 408):
        param = error.get("param") if isinstance(error, dict) else None
        return ApiError(r.status_code, f"instance {instance}: {message}",
                        param=param if isinstance(param, str) else None)
    if r.status_code >= 500:
        return ConnectError(f"instance {instance} answered HTTP {r.status_code}: {message}")
    return TransportError(f"instance {instance} answered HTTP {r.status_code}: {message}")


class FleetBackend(AgentBackend):
    """`kvsp agent`s and OpenAI engines (vLLM with the KVSP connector) behind one PC."""

    def __init__(self, pc_url: str, *, instance_api: str = "auto", **kw: Any) -> None:
        super().__init__(pc_url, **kw)
        self.apis = InstanceApis(self.client, self.headers, fixed=instance_api,
                                 timeout_s=min(10.0, self.timeout_s))
        #: outputs continued on another engine after theirs was lost
        self.continued = 0
        #: prompts computed by one engine for another (their answers are not read)
        self.prefills = TaskSet()

    async def start_at(self, instance: str, job: Job, decision: Mapping[str, Any],
                       route: Mapping[str, Any], route_ms: float) -> Run:
        api = await self.apis.of(instance)
        if api.kind == "agent":
            return await super().start_at(instance, job, decision, route, route_ms)
        assert api.model is not None
        apart = await self.start_prefill(job, decision) if decision.get("prefill") else {}
        run = OpenAIRun(self, job, decision, instance, api.model, route_ms,
                        exclude=route.get("exclude", ()), apart=apart)
        try:
            await run.open()
        except ConnectError:
            self.apis.forget(instance)
            raise
        return run

    async def start_prefill(self, job: Job, decision: Mapping[str, Any]) -> dict[str, Any]:
        """Prefill and decode apart (DESIGN §9.4), whichever kind each instance is. A `kvsp
        agent` is asked as `AgentBackend` asks it. An OpenAI engine computes the prompt as a
        request of one token whose answer nobody reads (its connector publishes the blocks
        live as vLLM saves them); the decode side subscribes to the tracks of the holder the
        decision names ("holder", the engine's embedded holder). Without one, or when the
        engine cannot be asked, the decode instance computes the prompt itself."""
        split = decision["prefill"]
        at = base_url(split["instance"])
        api = await self.apis.of(at)
        if api.kind == "agent":
            return await super().start_prefill(job, decision)
        holder = split.get("holder")
        if not holder:
            log.info("request %s: prefill engine %s names no holder; the decode instance "
                     "computes the prompt", job.request_id, at)
            return {}
        if split.get("running"):
            return {"prefill_at": base_url(holder), "prefill_blocks": split.get("blocks")}
        assert api.model is not None
        body = {"model": api.model, "prompt": list(job.tokens), "max_tokens": 1,
                "temperature": 0.0, "stream": False}
        self.prefills.spawn(self._prefill(at, job, body))
        return {"prefill_at": base_url(holder)}

    async def _prefill(self, at: str, job: Job, body: Mapping[str, Any]) -> None:
        try:
            r = await self.client.post(f"{at}v1/completions", json=dict(body),
                                       headers={**self.headers, "X-Request-Id": f"{job.request_id}-prefill"},
                                       timeout=self.timeout_s)
            if r.status_code >= 400:
                log.info("request %s: prefill at %s answered %d", job.request_id, at, r.status_code)
        except httpx.HTTPError as e:  # the decode side's subscriptions time out and it computes
            log.info("request %s: prefill at %s failed: %s", job.request_id, at, e)

    async def aclose(self) -> None:
        await self.prefills.cancel_and_wait()
        await super().aclose()
