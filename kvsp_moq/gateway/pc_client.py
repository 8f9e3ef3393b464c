"""The gateway's `POST {pc}route`: HTTP/1.1 on kept-alive connections, with little per call.

Every request the gateway serves waits for one route decision, so the PC call is most of the
gateway's own time. Through httpx it cost ~1 ms more than the PC's own answer on two cores
(its request and response models, httpcore's pool, anyio's streams, headers and body sent
apart); `kvsp bench gateway --overhead-only` measures both paths. `PCClient` sends each request
in one write through the project's lean HTTP/1.1 client (`kvsp_moq.fetch.http1`, the block
GETs' own), on a connection kept open for the next. It is plain HTTP to the PC, the same bytes
on the wire (the §6.4 request and decision are unchanged); an `https` PC URL goes through httpx.

Several PC URLs (comma-separated, `kvsp_moq.pc_endpoints`) are several PC processes on one
store: a PC that cannot be reached or answers 503 is left for the next, within the same call.
A connection the PC closed while it was idle (its keep-alive timeout) is found closed before it
is used, or fails before any byte of an answer; the call is then sent once more on a new one.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping
from urllib.parse import urlsplit

import httpx

from kvsp_moq.errors import KvspError, TransportError, reason_of
from kvsp_moq.fetch.http1 import Answer, Http1Pool
from kvsp_moq.index_client import raise_for_answer
from kvsp_moq.pc_endpoints import PCEndpoints

__all__ = ["MAX_ANSWER", "PCClient"]

#: The longest answer read from the PC (a decision is a few KiB).
MAX_ANSWER = 4 << 20
#: Connections open at once to the PCs: enough for the route calls in flight at once.
MAX_CONNECTIONS = 32


class PCClient:
    """Calls to one PC, or several PC processes on one store (`PCEndpoints`)."""

    def __init__(self, pc_urls: str | PCEndpoints, *, token: str | None = None,
                 timeout_s: float = 60.0, client: httpx.AsyncClient | None = None,
                 lean: bool = True) -> None:
        self.pcs = pc_urls if isinstance(pc_urls, PCEndpoints) else PCEndpoints(pc_urls)
        self.token = token
        self.timeout_s = timeout_s
        #: httpx carries the calls that the lean path does not (https)
        self.client = client
        self._own = client is None
        #: False: every call through httpx (the path this one replaced; the benchmark's baseline)
        self.lean = lean
        self._pool = Http1Pool(timeout=timeout_s, connect_timeout=min(timeout_s, 5.0),
                               max_connections=MAX_CONNECTIONS)
        if token and not token.isprintable():
            raise ValueError("the PC token must be printable (no line breaks)")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    # --------------------------------------------------------------------- the PC's route
    async def route(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
        """`POST {pc}route`: the decision and the ms the call took. A PC that cannot be
        reached or answers 503 is left for the next one, each tried once; KvspError (the PC's
        problem, or TransportError) when none answers."""
        t0 = time.perf_counter()
        payload = json.dumps(body, separators=(",", ":")).encode()
        answer = await self.call("POST", "route", payload)
        try:
            decision = json.loads(answer.body)
        except ValueError:
            decision = None
        if not isinstance(decision, dict):
            raise TransportError(f"the PC's route decision is not a JSON object: "
                                 f"{answer.body[:80]!r}")
        return decision, (time.perf_counter() - t0) * 1000

    async def call(self, method: str, path: str, payload: bytes | None = None) -> Answer:
        """`method {pc}path` at the PC in use, then the next ones; the first answer that is not
        a 503, raised as the project's error when it is a problem (>= 400)."""
        last: KvspError | None = None
        for _ in range(len(self.pcs.urls)):
            pc = self.pcs.url
            try:
                answer = await self._call(pc, method, path, payload)
            except TransportError as e:
                self.pcs.failed(pc)
                last = e
                continue
            if answer.status == 503:
                self.pcs.failed(pc)
                try:
                    _raise_for(answer)
                except KvspError as e:
                    last = e
                continue
            _raise_for(answer)
            return answer
        assert last is not None
        raise last

    async def _call(self, pc: str, method: str, path: str, payload: bytes | None) -> Answer:
        if not self.lean or urlsplit(pc).scheme != "http":
            return await self._call_httpx(pc, method, path, payload)
        headers = {**self._headers, "Content-Type": "application/json"} if payload is not None \
            else self._headers
        try:
            return await self._pool.call(method, f"{pc}{path}", headers, payload,
                                         max_answer=MAX_ANSWER)
        except TransportError as e:
            raise TransportError(f"the PC {pc} is unreachable: {e.detail}") from None

    async def _call_httpx(self, pc: str, method: str, path: str, payload: bytes | None) -> Answer:
        if self.client is None:
            self.client = httpx.AsyncClient(trust_env=False)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        try:
            r = await self.client.request(method, f"{pc}{path}", content=payload, headers=headers,
                                          timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise TransportError(f"the PC {pc} is unreachable: {reason_of(e, named=True)}") from None
        return Answer(r.status_code, r.headers.get("content-type", ""), r.content)

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        await self._pool.aclose()
        if self._own and self.client is not None:
            await self.client.aclose()
            self.client = None


def _raise_for(answer: Answer) -> None:
    """A problem answer (>= 400) as the project's error, as for any other call."""
    raise_for_answer(answer.status, answer.content_type, answer.body)
