"""Where the gateway's requests run: the PC routes, an instance generates (DESIGN §10).

A `Backend` takes a prompt already tokenized and keyed (`Job`) and starts it: it asks the PC
(`POST {pc}route`, with the Block Keys the gateway derived in the caller's scope) where the
prompt costs least, starts it there and hands back a `Run`, whose tokens arrive once each, in
order. `AgentBackend` drives `kvsp agent` instances: `POST {ii}generate` with a session id, the
tokens read through `FrontEnd`, so that a stream survives the loss of its instance (resumed
from the PC's checkpoint, or started again from the prompt, each token delivered once).

An instance with an OpenAI URL (vLLM with the KVSP connector) is started by `start_at` of
`kvsp_moq.gateway.openai_backend.FleetBackend`, which routes as this one does. The route
decision may name a prefill instance apart from the decode one ("prefill", `kvsp index --pd`,
or one computing the prompt's blocks for another request); `AgentBackend.start_prefill` has the
decode instance subscribe to its layers there.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Mapping, Protocol, Sequence

import httpx

from kvsp_moq.errors import (
    ConnectError,
    ForbiddenScope,
    KvspError,
    TransportError,
    Unauthorized,
    reason_of,
)
from kvsp_moq.frontend import FrontEnd, Restart, decode_at
from kvsp_moq.gateway.pc_client import PCClient
from kvsp_moq.gateway.scopes import Scope
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.pc_endpoints import PCEndpoints
from kvsp_moq.protocol.keys import block_keys
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.gateway")

__all__ = ["AgentBackend", "Backend", "Job", "Run", "route_body"]


@dataclass(frozen=True)
class Job:
    """A prompt to run: token ids, in a scope, with the instance's sampler."""

    tokens: tuple[int, ...]
    max_tokens: int
    sampler: Mapping[str, Any]
    scope: Scope
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))


class Run(Protocol):
    """A started generation."""

    instance: str
    route_ms: float
    """Time spent asking the PC, in ms."""
    decision: Mapping[str, Any]

    def tokens(self) -> AsyncGenerator[int, None]:
        """The output token ids, each once, in order (at most `Job.max_tokens`)."""
        ...

    async def cached_tokens(self) -> int:
        """Prompt tokens loaded rather than computed, once the output is complete."""
        ...

    async def stop(self) -> None:
        """No more tokens are wanted (a stop string, the client gone): the instance stops."""
        ...


class Backend(Protocol):
    async def start(self, job: Job, *, exclude: Sequence[str] = ()) -> Run: ...

    async def aclose(self) -> None: ...


def _upstream(err: KvspError, what: str) -> KvspError:
    """An upstream refusal of the gateway's own token is the gateway's fault, not the caller's."""
    if isinstance(err, (Unauthorized, ForbiddenScope)):
        return TransportError(f"{what} refused the gateway's token: {err.detail}")
    return err


def route_body(job: Job, compat_id: str, block_tokens: int) -> dict[str, Any]:
    """The §6.4 route request of a job: its Block Keys in the job's scope."""
    keys = block_keys(job.scope.key, bytes.fromhex(compat_id), job.tokens, block_tokens)
    return {"block_keys": [k.hex() for k in keys], "scope_id": job.scope.id,
            "compat_id": compat_id, "block_tokens": block_tokens,
            "token_count": len(job.tokens), "request_ref": job.request_id}


class AgentRun:
    def __init__(self, backend: "AgentBackend", job: Job, decision: Mapping[str, Any],
                 route: Mapping[str, Any], generate: Mapping[str, Any], route_ms: float) -> None:
        self.backend = backend
        self.job = job
        self.decision = decision
        self.instance = base_url(decision["instance"])
        self.route_ms = route_ms
        self._restart = Restart(route, generate)

    async def tokens(self) -> AsyncGenerator[int, None]:
        fe = self.backend.frontend()
        try:
            async for tok in fe.stream(self.job.request_id, instance=self.instance,
                                       max_tokens=self.job.max_tokens, restart=self._restart):
                yield tok.token
        except KvspError as e:
            raise _upstream(e, "an instance") from None

    async def cached_tokens(self) -> int:
        try:
            r = await self.backend.client.get(
                f"{self.instance}sessions/{self.job.request_id}",
                headers=self.backend.headers, timeout=self.backend.timeout_s)
        except httpx.HTTPError:
            return 0
        if r.status_code != 200:  # the session moved, or is gone
            return 0
        value = r.json().get("cached_tokens", 0)
        return value if type(value) is int else 0

    async def stop(self) -> None:
        """`DELETE {ii}sessions/{id}`, best effort: a session that moved or ended is left."""
        try:
            r = await self.backend.client.delete(
                f"{self.instance}sessions/{self.job.request_id}", headers=self.backend.headers,
                timeout=self.backend.timeout_s)
        except httpx.HTTPError as e:
            log.info("request %s: stopping it at %s failed: %s", self.job.request_id, self.instance, e)
            return
        if r.status_code not in (204, 404):
            log.info("request %s: stopping it at %s: HTTP %d", self.job.request_id, self.instance,
                     r.status_code)


class AgentBackend:
    """`kvsp agent` instances behind a PC."""

    def __init__(self, pc_url: str, *, compat_id: str, block_tokens: int,
                 token: str | None = None, client: httpx.AsyncClient | None = None,
                 timeout_s: float = 60.0, stream_timeout_s: float = 600.0,
                 stream_retries: int = 60) -> None:
        #: one PC, or several PC processes on one store (comma-separated URLs): a PC that
        #: cannot be reached or answers 503 is left for the next
        self.pcs = PCEndpoints(pc_url)
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.token = token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = client is None
        self.client = client or httpx.AsyncClient(trust_env=False, limits=httpx.Limits(
            max_connections=256, max_keepalive_connections=64))
        self.timeout_s = timeout_s
        #: `POST {pc}route` on connections of its own, kept alive (`pc_client`)
        self.pc = PCClient(self.pcs, token=token, timeout_s=timeout_s, client=self.client)
        self.stream_timeout_s = stream_timeout_s
        #: reconnections of one stream without a token in between (each waits up to 1 s):
        #: enough for the PC to see a lost instance fail and resume its sessions elsewhere
        self.stream_retries = stream_retries

    @property
    def pc_url(self) -> str:
        """The PC in use."""
        return self.pcs.url

    @pc_url.setter
    def pc_url(self, urls: str) -> None:
        """Route at other PCs from now on (one URL, or several comma-separated)."""
        self.pcs = self.pc.pcs = PCEndpoints(urls)

    def frontend(self) -> FrontEnd:
        """A front end on the shared client (cheap: it holds no connection of its own), with
        the PCs from the one in use."""
        at = self.pcs.urls.index(self.pcs.url)
        return FrontEnd(",".join(self.pcs.urls[at:] + self.pcs.urls[:at]), token=self.token,
                        client=self.client,
                        retries=self.stream_retries, timeout_s=self.stream_timeout_s,
                        read_timeout_s=self.timeout_s)

    def route_body(self, job: Job) -> dict[str, Any]:
        return route_body(job, self.compat_id, self.block_tokens)

    async def _post(self, url: str, body: Mapping[str, Any], what: str) -> httpx.Response:
        try:
            r = await self.client.post(url, json=body, headers=self.headers,
                                       timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise TransportError(f"{what} is unreachable: {reason_of(e, named=True)}") from None
        try:
            raise_for_problem(r)
        except KvspError as e:
            raise _upstream(e, what) from None
        return r

    async def route(self, route: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
        """`POST {pc}route` (the next PC when one cannot be reached or answers 503): the
        decision and the ms it took."""
        try:
            return await self.pc.route(route)
        except KvspError as e:
            raise _upstream(e, "the PC") from None

    async def start(self, job: Job, *, exclude: Sequence[str] = ()) -> Run:
        """Route and start; an instance that cannot be reached is excluded and the prompt
        routed once more (it died after its last status record). `exclude`: instances the
        PC must not choose (lost by this request already). The run's `route_ms` counts the
        Block Keys' derivation and the route calls."""
        t0 = time.perf_counter()
        route = self.route_body(job)
        if exclude:
            route["exclude"] = list(exclude)
        route_ms = (time.perf_counter() - t0) * 1000
        for attempt in range(2):
            decision, ms = await self.route(route)
            route_ms += ms
            instance = base_url(decision["instance"])
            try:
                return await self.start_at(instance, job, decision, route, route_ms)
            except ConnectError as e:
                if attempt:
                    raise
                log.info("request %s: %s; routing it elsewhere", job.request_id, e.detail)
                route = {**route, "exclude": [*route.get("exclude", []), instance]}
        raise AssertionError("unreachable")

    async def start_at(self, instance: str, job: Job, decision: Mapping[str, Any],
                       route: Mapping[str, Any], route_ms: float) -> Run:
        """Start the job at the instance the PC chose (a `kvsp agent`); ConnectError when it
        cannot be reached."""
        generate = {"tokens": list(job.tokens), "max_new_tokens": job.max_tokens,
                    "sampler": dict(job.sampler), "scope": job.scope.name}
        apart = await self.start_prefill(job, decision) if decision.get("prefill") else {}
        await self.start_generate(instance, job, {**generate, **apart})
        return AgentRun(self, job, decision, route, generate, route_ms)

    async def start_prefill(self, job: Job, decision: Mapping[str, Any]) -> dict[str, Any]:
        """A decision with prefill and decode apart (DESIGN §9.4): the members of the generate
        that has the decode instance subscribe to the prompt's layers at the prefill instance.
        One computing the blocks already for another request ("running") is not asked again;
        another is asked to (`POST {ii}prefill`). One that refuses or cannot be reached leaves
        the prompt to the decode instance (no members)."""
        split = decision["prefill"]
        at = base_url(split["instance"])
        if split.get("running"):
            return {"prefill_at": at, "prefill_blocks": split.get("blocks")}
        try:
            answer = await self._post(f"{at}prefill", {"tokens": list(job.tokens), "scope": job.scope.name},
                                      f"prefill instance {at}")
        except KvspError as e:  # refused (409 kvsp-no-live-kv: no relay) or unreachable
            log.info("request %s: prefill at %s refused or unreachable (%s); the decode instance "
                     "computes the prompt", job.request_id, at, getattr(e, "detail", e))
            return {}
        return decode_at(at, answer.json())

    async def start_generate(self, instance: str, job: Job, generate: Mapping[str, Any]) -> None:
        """Start the session; its tokens are read from the session's stream (FrontEnd)."""
        body = {**generate, "session": job.request_id, "stream": True}
        try:
            async with self.client.stream("POST", f"{instance}generate", json=body,
                                          headers=self.headers, timeout=self.timeout_s) as g:
                if g.status_code >= 400:
                    await g.aread()
                    try:
                        raise_for_problem(g)
                    except KvspError as e:
                        raise _upstream(e, f"instance {instance}") from None
        except httpx.ConnectError as e:
            raise ConnectError(f"instance {instance} is unreachable: "
                               f"{reason_of(e, named=True)}") from None
        except httpx.HTTPError as e:
            raise TransportError(f"instance {instance}: {reason_of(e, named=True)}") from None

    async def aclose(self) -> None:
        await self.pc.aclose()
        if self._own:
            await self.client.aclose()
