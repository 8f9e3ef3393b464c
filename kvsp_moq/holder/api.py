"""The holder's HTTP resources: blocks (KVSP §6.7) and leases (§6.6).

    GET|HEAD|PUT  blocks/{compat}/{scope}/{block_key}   [?layers=a-b] [&codec=n]
    POST          leases
    PUT|DELETE    leases/{lease}

A GET streams the container in chunks that are views into the stored buffer, so serving a
64 MiB block never copies it. Only codec 1 (raw) exists and the holder does not transcode:
`codec=n` for a codec it does not hold answers 404 "kvsp-codec-unavailable", which a client
treats like any other miss (§6.1) and moves to the next source.

A holder stores blocks of the scopes it serves only (`kvsp_moq.holder.tenancy`): a PUT of any
other scope is refused with 403 before its body is read, whatever the writer's token allows.
"""

from __future__ import annotations

import base64
import logging
import re
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvsp_moq.auth import Action, Authenticator
from kvsp_moq.errors import (
    BadRecord,
    CodecUnavailable,
    NotFound,
    Overloaded,
    PreconditionFailed,
    PreconditionRequired,
)
from kvsp_moq.holder import tenancy as tenancy_rule
from kvsp_moq.holder.index_publisher import IndexPublisher
from kvsp_moq.holder.leases import LeaseTable
from kvsp_moq.holder.store import CHUNK, BlockId, BlockRead, BlockStore
from kvsp_moq.holder.tenancy import Tenancy
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.container import MEDIA_TYPE as BLOCK_MEDIA_TYPE
from kvsp_moq.protocol.records import LeaseGrant, LeaseRequest
from kvsp_moq.web import (
    declared_length,
    json_response,
    parse_json,
    principal,
    read_body,
    read_json,
)

log = logging.getLogger("kvsp.holder")
_LAYERS = re.compile(r"^(\d{1,10})-(\d{1,10})$")
_CODEC = re.compile(r"^\d{1,5}$")
_LEASE_ID = re.compile(r"^[0-9a-f]{32}$")




# --------------------------------------------------------------------------- parsing


def parse_block_id(params: dict[str, Any]) -> BlockId:
    """The path members of a block resource, each refusal naming its member."""
    return BlockId(v.hexn(params["compat"], 32, "compat"), v.hexn(params["scope"], 16, "scope"),
                   v.hexn(params["key"], 32, "block_key"))


def parse_layers(text: str | None) -> tuple[int, int] | None:
    """`layers=a-b`, an inclusive range of layer numbers."""
    if text is None:
        return None
    m = _LAYERS.match(text)
    if not m:
        raise BadRecord("must be a-b with decimal layer numbers", member="layers")
    a, b = int(m.group(1)), int(m.group(2))
    if a > b or b > 0xFFFFFFFF:
        raise BadRecord("must be a-b with a <= b < 2^32", member="layers")
    return a, b


def parse_codec(text: str | None) -> int | None:
    if text is None:
        return None
    if not _CODEC.match(text) or int(text) > 0xFFFF:
        raise BadRecord("must be a codec number in [0, 65535]", member="codec")
    return int(text)


def repr_digest(digest: bytes) -> str:
    """The RFC 9530 Repr-Digest field value for a SHA-256 digest."""
    return "sha-256=:" + base64.b64encode(digest).decode() + ":"


# --------------------------------------------------------------------------- responses


class BlockResponse:
    """A container streamed in chunks that share the stored buffer; unpins it when done."""

    def __init__(self, read: BlockRead, digest: bytes, max_age_s: int, *, body: bool,
                 chunk: int = CHUNK) -> None:
        self.read = read
        self.body = body
        self.chunk = chunk
        self.headers = [
            (b"content-type", BLOCK_MEDIA_TYPE.encode()),
            (b"content-length", str(read.size).encode()),
            (b"repr-digest", repr_digest(digest).encode()),
            (b"cache-control", f"private, immutable, max-age={max_age_s}".encode()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            if not self.body:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            chunks = list(self.read.chunks(self.chunk))
            last = len(chunks) - 1
            for i, piece in enumerate(chunks):
                await send({"type": "http.response.body", "body": piece, "more_body": i < last})
        finally:
            self.read.release()


# --------------------------------------------------------------------------- the app


class HolderApi:
    """Request handlers over one store, lease table and publisher."""

    def __init__(self, store: BlockStore, leases: LeaseTable, publisher: IndexPublisher, *,
                 max_block_bytes: int, chunk_bytes: int = CHUNK,
                 max_put_inflight_bytes: int | None = None,
                 tenancy: Tenancy | None = None, scope_quota: int | None = None) -> None:
        self.store = store
        self.leases = leases
        self.publisher = publisher
        self.max_block_bytes = max_block_bytes
        self.chunk_bytes = chunk_bytes
        #: the octets PUTs being received may reserve together (their declared lengths)
        self.max_put_inflight_bytes = (max_put_inflight_bytes if max_put_inflight_bytes is not None
                                       else 2 * max_block_bytes)
        self.put_inflight_bytes = 0
        #: octets each scope may hold (None: an equal share when several scopes are served)
        self.scope_quota = scope_quota
        self.tenancy = Tenancy.any()
        self.apply_tenancy(tenancy or Tenancy.any())

    # ---------------------------------------------------------------- tenancy

    def resolve_tenancy(self, auth: Authenticator, token: str | None,
                        serve_scopes: Iterable[str] | None = None) -> Tenancy:
        """Serve the scopes `kvsp_moq.holder.tenancy.resolve` gives for this holder's
        principals, own token and configured list; SettingError when they cannot be known."""
        tenancy = tenancy_rule.resolve(auth, token, serve_scopes)
        self.apply_tenancy(tenancy)
        return tenancy

    def apply_tenancy(self, tenancy: Tenancy) -> None:
        """Store only these scopes, each within its quota, and pin no more than that."""
        self.tenancy = tenancy
        self.store.scope_quota = self.quota_of
        self.leases.scope_limit = self.lease_share

    def quota_of(self, scope_id: str) -> int | None:
        """Octets this scope may hold here (None: no limit but the store's)."""
        return self.tenancy.quota(self.store.capacity, self.scope_quota)

    def lease_share(self, scope_id: str) -> int:
        """Octets of this scope's blocks that leases may pin: what the scope may hold."""
        quota = self.quota_of(scope_id)
        return self.store.capacity if quota is None else min(quota, self.store.capacity)

    async def get_block(self, request: Request) -> Any:
        bid = parse_block_id(request.path_params)
        layers = parse_layers(request.query_params.get("layers"))
        codec = parse_codec(request.query_params.get("codec"))
        principal(request, Action.READ_BLOCKS).require_scope(bid.scope_id)
        entry = self.store.get(bid)
        if entry is None:
            raise NotFound("no replica of this block here")
        if codec is not None and codec != entry.meta.codec:
            raise CodecUnavailable(f"held in codec {entry.meta.codec} only; this holder does "
                                   f"not transcode", member="codec")
        first, last = layers if layers is not None else (None, None)
        read = await self.store.open_read(bid, first, last)
        try:
            digest = await read.digest()
        except BaseException:
            read.release()
            raise
        max_age = self.publisher.remaining_ttl_ms(bid) // 1000
        return BlockResponse(read, digest, max_age, body=request.method != "HEAD",
                             chunk=self.chunk_bytes)

    async def put_block(self, request: Request) -> Response:
        bid = parse_block_id(request.path_params)
        principal(request, Action.STORE_BLOCKS).require_scope(bid.scope_id)
        self.tenancy.require(bid.scope_id)
        condition = request.headers.get("if-none-match")
        if condition is None or condition.strip() != "*":
            raise PreconditionRequired("storing a block needs If-None-Match: *")
        if bid in self.store:
            raise PreconditionFailed("a replica of this block is already held; it is kept")
        # The body is received into a buffer of its declared length: that length is known, and
        # bounded, before anything is read, and all PUTs being received share one budget, so
        # clients sending slowly cannot reserve more memory than it.
        size = declared_length(request, self.max_block_bytes, required=True)
        assert size is not None
        if self.put_inflight_bytes + size > self.max_put_inflight_bytes:
            raise Overloaded(f"{self.put_inflight_bytes} octets of blocks are being received; "
                             f"{size} more would exceed {self.max_put_inflight_bytes}")
        self.put_inflight_bytes += size
        try:
            body = await read_body(request, self.max_block_bytes, length_required=True,
                                   preallocate=True)
        finally:
            self.put_inflight_bytes -= size
        entry = await self.store.put(bid, body)
        self.publisher.announce(entry)
        return json_response(self.publisher.record_for(entry).to_json(), 201)

    async def create_lease(self, request: Request) -> Response:
        who = principal(request, Action.READ_BLOCKS)
        lease_req = LeaseRequest.from_json(await read_json(request, max_bytes=8 << 20))
        octets = 0
        pins: dict[str, tuple[str, int]] = {}
        for i, key in enumerate(lease_req.block_keys):
            held = [e for e in self.store.by_key(key) if who.may_use_scope(e.id.scope_id)]
            if not held:
                raise NotFound("this block is not held here", member=f"block_keys[{i}]")
            largest = max(held, key=lambda e: e.size)
            if key not in pins:
                octets += largest.size
                pins[key] = (largest.id.scope_id, largest.size)
        lease = self.leases.create(who.name, lease_req.block_keys, octets, lease_req.ttl_ms,
                                   pins=pins)
        return json_response(LeaseGrant(lease.id, lease.ttl_ms).to_json(), 201,
                             headers={"Location": f"leases/{lease.id}"})

    async def renew_lease(self, request: Request) -> Response:
        lease_id = self._lease_id(request)
        who = principal(request, Action.READ_BLOCKS)
        ttl_ms = None
        raw = await read_body(request, 65536)
        if raw:
            data = v.obj(parse_json(raw))
            if "ttl_ms" in data:
                ttl_ms = v.integer(data["ttl_ms"], "ttl_ms", low=1)
        lease = self.leases.renew(lease_id, who.name, ttl_ms)
        return json_response(LeaseGrant(lease.id, lease.ttl_ms).to_json())

    async def release_lease(self, request: Request) -> Response:
        self.leases.release(self._lease_id(request), principal(request, Action.READ_BLOCKS).name)
        return Response(status_code=204)

    @staticmethod
    def _lease_id(request: Request) -> str:
        lease_id = request.path_params["lease"]
        if not _LEASE_ID.match(lease_id):
            raise BadRecord("must be 32 lowercase hex digits", member="lease")
        return lease_id

    def routes(self) -> list[Route]:
        return [
            Route("/blocks/{compat}/{scope}/{key}", self.get_block, methods=["GET", "HEAD"]),
            Route("/blocks/{compat}/{scope}/{key}", self.put_block, methods=["PUT"]),
            Route("/leases", self.create_lease, methods=["POST"]),
            Route("/leases/{lease}", self.renew_lease, methods=["PUT"]),
            Route("/leases/{lease}", self.release_lease, methods=["DELETE"]),
        ]
