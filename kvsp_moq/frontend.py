"""The front end library (DESIGN §1, §6; KVSP §6.8): output tokens delivered exactly once, in
order, across instance failures.

The front end streams `GET {ii}sessions/{id}/stream?from=k` (NDJSON lines
`{"index": i, "epoch": e, "token": t}`), delivers index k, k+1, ... once each, and drops any
token whose epoch is lower than one already seen for the session (it comes from an instance
that lost the session). When the stream breaks it asks the PC (`GET {pc}sessions/{id}`) where
the session runs now and under which epoch, and reconnects there from its next undelivered
index. A resumed deterministic instance regenerates tokens it already sent; they are dropped
by index.

A session the PC holds no checkpoint of (its instance was lost before the first one was
acknowledged, e.g. during the prefill) is not the PC's to resume. Given the requests that
started it (`Restart`), the front end starts it again from its prompt on another instance, at an
epoch above any it has seen, so that the lost instance's tokens and checkpoints are stale; a
deterministic sampler regenerates the tokens already delivered (dropped by index), and a
non-deterministic one has released none (KVSP §6.8).

A stream ends the session when the instance closes it cleanly and the PC still places the
session there, or when it sends a line with `"done": true` (our convention), or after
`max_tokens` tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping

import httpx

from kvsp_moq.errors import KvspError, NotFound, TransportError, reason_of
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.pc_endpoints import PCEndpoints
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.frontend")


@dataclass(frozen=True)
class Token:
    index: int
    """Position in the session's output, from 0."""
    epoch: int
    """Session epoch of the instance that produced it."""
    token: int
    """The token identifier."""


@dataclass(frozen=True)
class Placement:
    """Where a session runs, as the PC says."""

    instance: str
    epoch: int
    output_offset: int = 0


@dataclass(frozen=True)
class Restart:
    """How the session was started: the body of `POST {pc}route` that placed it (tokens or
    block keys, scope, compat_id) and the body of `POST {ii}generate` that started it."""

    route: Mapping[str, Any]
    generate: Mapping[str, Any]


@dataclass(frozen=True)
class Started:
    """A session started where the PC placed it (`FrontEnd.start`)."""

    session: str
    instance: str
    """The instance that decodes (and streams) the session."""
    prefill: str | None
    """The instance that computed its prompt apart, publishing it live; None: `instance` did."""
    decision: Mapping[str, Any]
    """The PC's route decision."""


def decode_at(producer: str, answer: Any) -> dict[str, Any]:
    """The members of a generate that has its instance decode a prompt `producer` computes,
    from `producer`'s answer to `POST {ii}prefill` (DESIGN §9.4): its base URL, and the layout
    of its pass tracks, so that the blocks of one pass are one subscription, not one each (an
    answer without one leaves the blocks' own tracks; the decode instance checks the layout)."""
    members: dict[str, Any] = {"prefill_at": base_url(producer)}
    passes = answer.get("passes") if isinstance(answer, dict) else None
    if isinstance(passes, list) and passes:
        members["prefill_passes"] = passes
    return members


class _Broken(Exception):
    """The stream ended before the session did."""


class StreamCursor:
    """Exactly-once bookkeeping without I/O: which lines to deliver and from where to resume."""

    def __init__(self, start: int = 0) -> None:
        self.next_index = start
        self.max_epoch = 0
        self.done = False
        self.dropped_duplicates = 0
        self.dropped_stale = 0

    def accept(self, line: dict) -> Token | None:
        """The token to deliver for one NDJSON object, or None to drop it; raises ValueError on
        a malformed line and _Broken on a gap (the instance skipped an index)."""
        if line.get("done") is True:
            self.done = True
            return None
        index, epoch, token = line["index"], line["epoch"], line["token"]
        for value in (index, epoch, token):
            if type(value) is not int or value < 0:
                raise ValueError(f"malformed token line {line!r}")
        if epoch < self.max_epoch:
            self.dropped_stale += 1
            return None
        self.max_epoch = epoch
        if index < self.next_index:
            self.dropped_duplicates += 1
            return None
        if index > self.next_index:
            raise _Broken(f"gap: expected index {self.next_index}, got {index}")
        self.next_index += 1
        return Token(index, epoch, token)


class FrontEnd:
    """Delivers a session's output tokens from whichever instance serves it."""

    def __init__(self, pc_url: str, *, token: str | None = None,
                 client: httpx.AsyncClient | None = None, retries: int = 8,
                 backoff_s: float = 0.05, max_backoff_s: float = 1.0, timeout_s: float = 60.0,
                 read_timeout_s: float = 10.0, restart_after: int = 2) -> None:
        #: one URL, or several PC processes on one store (comma-separated): a PC that cannot
        #: be reached or answers 503 is left for the next
        self.pcs = PCEndpoints(pc_url)
        #: failed attempts at an instance, with no checkpoint at the PC, before a session with
        #: a `Restart` is started again elsewhere
        self.restart_after = restart_after
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = client is None
        self._client = client
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient()
        return self._client

    async def aclose(self) -> None:
        if self._own and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> "FrontEnd":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def pc_url(self) -> str:
        """The PC in use."""
        return self.pcs.url

    async def _pc(self, method: str, path: str, *, timeout: float, **kw: Any) -> httpx.Response:
        """One call to the PC in use; a PC that cannot be reached or answers 503 is left for
        the next (the caller's retries reach it)."""
        pc = self.pcs.url
        try:
            r = await self.client.request(method, f"{pc}{path}", headers=self.headers,
                                          timeout=timeout, **kw)
        except httpx.HTTPError as e:
            self.pcs.failed(pc)
            raise TransportError(f"PC {pc} unreachable: {reason_of(e, named=True)}") from None
        if r.status_code == 503:
            self.pcs.failed(pc)
        return r

    async def placement(self, session: str, *, timeout: float | None = None) -> Placement:
        """GET {pc}sessions/{id}: the session's instance and epoch."""
        r = await self._pc("GET", f"sessions/{session}", timeout=timeout or self.read_timeout_s)
        raise_for_problem(r)
        data = r.json()
        if not data.get("instance"):
            raise NotFound(f"session {session} has no instance yet")
        return Placement(data["instance"], int(data["epoch"]), int(data.get("output_offset", 0)))

    async def stream(self, session: str, *, instance: str | None = None, start: int = 0,
                     max_tokens: int | None = None,
                     restart: Restart | None = None) -> AsyncIterator[Token]:
        """Yield every output token of the session from index `start`, once, in order.

        `instance` is where to start (e.g. the route decision); without it the PC is asked.
        With `restart`, a session lost before the PC held a checkpoint of it is started again
        from its prompt elsewhere. Raises TransportError when retries or the overall timeout
        run out.
        """
        deadline = time.monotonic() + self.timeout_s
        cursor = StreamCursor(start)
        where = instance
        streamed_epoch: int | None = None
        last: str | None = instance
        failures = 0
        pause = self.backoff_s

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"session {session}: timed out after {self.timeout_s} s "
                                     f"at index {cursor.next_index}")
            return left

        while True:
            if max_tokens is not None and cursor.next_index - start >= max_tokens:
                return
            error: str
            try:
                if where is None:
                    try:
                        placed = await self.placement(
                            session, timeout=min(self.read_timeout_s, remaining()))
                        where, streamed_epoch = placed.instance, placed.epoch
                    except NotFound:
                        if last is None:
                            raise
                        if restart is not None and failures >= self.restart_after:
                            epoch = max(cursor.max_epoch, streamed_epoch or 0, 1) + 1
                            where = await self._restart(session, restart, last, epoch, remaining)
                            streamed_epoch = epoch
                        else:
                            where = last  # no checkpoint yet: nothing can have moved it
                last = where
                async with contextlib.aclosing(
                        self._one_stream(session, where, cursor, remaining)) as tokens:
                    async for tok in tokens:
                        failures, pause = 0, self.backoff_s
                        yield tok
                        if max_tokens is not None and cursor.next_index - start >= max_tokens:
                            return
                if cursor.done:
                    return
                # A clean end: over, unless the PC has moved the session meanwhile.
                try:
                    placed = await self.placement(
                        session, timeout=min(self.read_timeout_s, remaining()))
                except NotFound:
                    return
                moved = (base_url(placed.instance) != base_url(where)
                         or placed.epoch > max(cursor.max_epoch, streamed_epoch or 0))
                if not moved:
                    return
                where, streamed_epoch = placed.instance, placed.epoch
                continue
            except _Broken as e:
                error = str(e)
            except (httpx.HTTPError, KvspError, ValueError, KeyError, TypeError) as e:
                error = f"{type(e).__name__}: {getattr(e, 'detail', e)}"
            failures += 1
            if failures > self.retries:
                raise TransportError(f"session {session}: gave up after {self.retries} retries "
                                     f"at index {cursor.next_index} ({error})")
            log.info("session %s: stream from %s broke at index %d (%s); asking the PC",
                     session, where, cursor.next_index, error)
            await asyncio.sleep(min(pause, remaining()))
            pause = min(pause * 2, self.max_backoff_s)
            where = None  # ask the PC where the session is now

    async def start(self, route: Mapping[str, Any], generate: Mapping[str, Any], *,
                    session: str | None = None) -> Started:
        """`POST {pc}route`, then start the session where the decision says; read its tokens with
        `stream(started.session, instance=started.instance, restart=Restart(route, generate))`.

        A decision with "prefill" (prefill and decode apart, `pc.disaggregation`) first asks that
        instance to compute the prompt (`POST {ii}prefill`), then starts the generate with
        "prefill_at": the decode instance subscribes to the prompt's layers as they are computed.
        A prefill instance that refuses or cannot be reached leaves the whole request to the
        decode instance. One that is computing the prompt's first blocks already, for another
        request ("running"), is not asked again: the generate subscribes to those blocks
        ("prefill_blocks") and computes the rest."""
        r = await self._pc("POST", "route", json=dict(route), timeout=self.read_timeout_s)
        raise_for_problem(r)
        decision = r.json()
        instance = base_url(decision["instance"])
        body = {**generate, "session": session or str(uuid.uuid4()), "stream": True}
        prefill: str | None = None
        split = decision.get("prefill")
        if isinstance(split, dict) and split.get("instance") and split.get("running"):
            # That instance computes these blocks already, for another request: subscribe only.
            prefill = body["prefill_at"] = base_url(split["instance"])
            body["prefill_blocks"] = split.get("blocks")
        elif isinstance(split, dict) and split.get("instance"):
            at = base_url(split["instance"])
            ask = {"tokens": generate["tokens"]}
            if generate.get("scope") is not None:
                ask["scope"] = generate["scope"]
            try:
                p = await self.client.post(f"{at}prefill", json=ask, headers=self.headers,
                                           timeout=self.read_timeout_s)
                raise_for_problem(p)
                prefill = at
                body.update(decode_at(at, p.json()))
            except (httpx.HTTPError, KvspError) as e:
                log.info("prefill at %s refused or unreachable (%s); %s computes the prompt", at,
                         getattr(e, "detail", e), instance)
        try:
            async with self.client.stream("POST", f"{instance}generate", json=body, headers=self.headers,
                                          timeout=self.read_timeout_s) as g:
                if g.status_code >= 400:
                    await g.aread()
                    raise_for_problem(g)
        except httpx.HTTPError as e:
            raise TransportError(f"instance {instance} unreachable: {reason_of(e, named=True)}") from None
        return Started(body["session"], instance, prefill, decision)

    async def _restart(self, session: str, restart: Restart, lost: str, epoch: int,
                       remaining: Callable[[], float]) -> str:
        """Start the session again from its prompt on an instance the PC chooses, not `lost`;
        its base URL."""
        timeout = min(self.read_timeout_s, remaining())
        route = {**restart.route, "exclude": [*restart.route.get("exclude", []), base_url(lost)]}
        r = await self._pc("POST", "route", json=route, timeout=timeout)
        raise_for_problem(r)
        instance = base_url(r.json()["instance"])
        body = {**restart.generate, "session": session, "epoch": epoch, "stream": True}
        # Started once the instance answers; its tokens are read from the session's stream.
        async with self.client.stream("POST", f"{instance}generate", json=body,
                                      headers=self.headers, timeout=timeout) as g:
            if g.status_code >= 400:
                await g.aread()
                raise_for_problem(g)
        log.warning("session %s: %s was lost before the PC held a checkpoint; started again "
                    "from the prompt on %s at epoch %d", session, lost, instance, epoch)
        return instance

    async def _one_stream(self, session: str, instance: str, cursor: StreamCursor,
                          remaining: Callable[[], float]) -> AsyncGenerator[Token, None]:
        url = f"{base_url(instance)}sessions/{session}/stream"
        timeout = httpx.Timeout(min(self.read_timeout_s, remaining()))
        async with self.client.stream("GET", url, params={"from": cursor.next_index},
                                      headers=self.headers, timeout=timeout) as r:
            if r.status_code >= 400:
                await r.aread()
                raise_for_problem(r)
            async for text in r.aiter_lines():
                remaining()
                if not text.strip():
                    continue
                tok = cursor.accept(json.loads(text))
                if tok is not None:
                    yield tok
                if cursor.done:
                    return

    async def deliver(self, session: str, sink: Callable[[Token], Awaitable[None] | None], *,
                      instance: str | None = None, start: int = 0,
                      max_tokens: int | None = None, restart: Restart | None = None) -> int:
        """Hand each token to `sink` exactly once, in order; returns how many were delivered."""
        n = 0
        async for tok in self.stream(session, instance=instance, start=start,
                                     max_tokens=max_tokens, restart=restart):
            result = sink(tok)
            if inspect.isawaitable(result):
                await result
            n += 1
        return n
