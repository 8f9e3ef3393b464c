"""The JSON records of KVSP (§4.4, §6.2, §6.5, §6.6, §6.9) as validated immutable values.

`from_json` checks types, hex lengths, ranges and UUIDs and ignores unknown members (§4.4);
`to_json` gives back the JSON object. Nothing invalid gets past `from_json`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol import validate as v

INSTANCE_STATES = ("active", "draining", "sleeping", "failed")
TIERS = ("device", "host", "disk")
DIRECTIVE_STATES = ("pending", "partial", "complete", "failed")


def _opt(data: dict, name: str) -> Any:
    value = data.get(name)
    return value


# --------------------------------------------------------------------------- replicas


class BlockId(NamedTuple):
    """What a stored replica is keyed by: the three path members of a block resource.

    Defined here, not in the holder's store, so that readers of replicas (the local layer
    source) name a block without depending on the store.
    """

    compat_id: str
    scope_id: str
    block_key: str

    @property
    def path(self) -> str:
        return f"{self.compat_id}/{self.scope_id}/{self.block_key}"


@dataclass(frozen=True)
class Residency:
    """Which inclusive range of layers sits in which tier, and how fast that tier reads."""

    tier: str
    layers: tuple[int, int]
    read_mbit_per_s: float | None = None

    @classmethod
    def from_json(cls, data: Any, member: str = "residency") -> "Residency":
        data = v.obj(data, member)
        tier = v.string(v.required(data, "tier", member + "."), member + ".tier", max_len=64)
        a, b = v.pair(v.required(data, "layers", member + "."), member + ".layers")
        if a > b:
            raise BadRecord("range start exceeds its end", member=member + ".layers")
        rate = data.get("read_mbit_per_s")
        if rate is not None:
            rate = v.number(rate, member + ".read_mbit_per_s", low_open=True)
        return cls(tier, (a, b), rate)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"tier": self.tier, "layers": list(self.layers)}
        if self.read_mbit_per_s is not None:
            out["read_mbit_per_s"] = self.read_mbit_per_s
        return out


def check_disjoint(ranges: list[tuple[int, int]], member: str, *, half_open: bool = False) -> None:
    """Refuse overlapping ranges (inclusive by default)."""
    ordered = sorted(ranges)
    for (a1, b1), (a2, b2) in zip(ordered, ordered[1:]):
        if (a2 < b1) if half_open else (a2 <= b1):
            raise BadRecord(f"ranges {[a1, b1]} and {[a2, b2]} overlap", member=member)


@dataclass(frozen=True)
class ReplicaRecord:
    """Where one copy of a block lives (§4.4), as published to the Index Service."""

    block_key: str
    compat_id: str
    scope_id: str
    holder: str
    codec: int
    size: int
    digest: str
    ttl_ms: int
    layer_digests: tuple[str, ...] | None = None
    residency: tuple[Residency, ...] = ()
    moqt_namespace: str | None = None
    http_holder: str | None = None
    #: In production (an extension member, `"live": true`): the block's track exists and its
    #: layers are being computed; no digests are known yet (`digest` is `LIVE_DIGEST`), each
    #: layer carries its own. The complete record replaces it, or it is withdrawn.
    live: bool = False
    #: An in-production block that is also one slot of a pass track (an extension member,
    #: `"live_pass": {"moqt_namespace": ..., "slot": j}`, DESIGN §9.6): the track in that
    #: namespace whose object l is layer l of every block of the pass, this block's at slot j.
    live_pass: tuple[str, int] | None = None

    @classmethod
    def from_json(cls, data: Any) -> "ReplicaRecord":
        data = v.obj(data)
        req = lambda n: v.required(data, n)  # noqa: E731
        holder = v.url(req("holder"), "holder")
        layer_digests = data.get("layer_digests")
        if layer_digests is not None:
            layer_digests = v.hex_array(layer_digests, 32, "layer_digests", min_len=1, max_len=1 << 16)
        residency = tuple(
            Residency.from_json(r, f"residency[{i}]")
            for i, r in enumerate(v.array(data.get("residency", []), "residency", lambda x, m: x,
                                          max_len=64))
        )
        check_disjoint([r.layers for r in residency], "residency")
        if layer_digests is not None:
            for i, r in enumerate(residency):
                if r.layers[1] >= len(layer_digests):
                    raise BadRecord(
                        f"layer {r.layers[1]} beyond the {len(layer_digests)} listed layers",
                        member=f"residency[{i}].layers",
                    )
        record_digest = v.digest(req("digest"), "digest")
        if layer_digests is not None:
            expected = hashlib.sha256(bytes.fromhex("".join(layer_digests))).hexdigest()
            if record_digest != "sha-256:" + expected:
                raise BadRecord("does not match the layer digests", member="digest")
        moqt_namespace = data.get("moqt_namespace")
        if holder.lower().startswith("moqt://"):
            moqt_namespace = v.string(v.required(data, "moqt_namespace"), "moqt_namespace")
        elif moqt_namespace is not None:
            moqt_namespace = v.string(moqt_namespace, "moqt_namespace")
        http_holder = data.get("http_holder")
        if http_holder is not None:
            http_holder = v.url(http_holder, "http_holder", schemes=("http", "https"))
        live = v.boolean(data.get("live", False), "live")
        if live and (not holder.lower().startswith("moqt://") or layer_digests is not None):
            raise BadRecord("an in-production record is a MOQT replica's, without layer digests",
                            member="live")
        live_pass = data.get("live_pass")
        if live_pass is not None:
            if not live:
                raise BadRecord("only an in-production record names a pass track", member="live_pass")
            live_pass = v.obj(live_pass, "live_pass")
            live_pass = (v.string(v.required(live_pass, "moqt_namespace", "live_pass."),
                                  "live_pass.moqt_namespace", max_len=1024),
                         v.integer(v.required(live_pass, "slot", "live_pass."), "live_pass.slot",
                                   high=1 << 20))
        return cls(
            block_key=v.hexn(req("block_key"), 32, "block_key"),
            compat_id=v.hexn(req("compat_id"), 32, "compat_id"),
            scope_id=v.hexn(req("scope_id"), 16, "scope_id"),
            holder=holder,
            codec=v.integer(req("codec"), "codec", high=0xFFFF),
            size=v.integer(req("size"), "size"),
            digest=record_digest,
            ttl_ms=v.integer(req("ttl_ms"), "ttl_ms", low=1),
            layer_digests=layer_digests,
            residency=residency,
            moqt_namespace=moqt_namespace,
            http_holder=http_holder,
            live=live,
            live_pass=live_pass,
        )

    @functools.cached_property
    def encoded(self) -> bytes:
        """`to_json()` as compact JSON, made once: a holder sends the same records again at
        every refresh."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "block_key": self.block_key,
            "compat_id": self.compat_id,
            "scope_id": self.scope_id,
            "holder": self.holder,
            "codec": self.codec,
            "size": self.size,
            "digest": self.digest,
        }
        if self.layer_digests is not None:
            out["layer_digests"] = list(self.layer_digests)
        if self.residency:
            out["residency"] = [r.to_json() for r in self.residency]
        out["ttl_ms"] = self.ttl_ms
        if self.moqt_namespace is not None:
            out["moqt_namespace"] = self.moqt_namespace
        if self.http_holder is not None:
            out["http_holder"] = self.http_holder
        if self.live:
            out["live"] = True
        if self.live_pass is not None:
            out["live_pass"] = {"moqt_namespace": self.live_pass[0], "slot": self.live_pass[1]}
        return out

    @property
    def is_moqt(self) -> bool:
        return self.holder.lower().startswith("moqt://")

    @property
    def layer_count(self) -> int | None:
        return None if self.layer_digests is None else len(self.layer_digests)

    def layer_digest_bytes(self) -> list[bytes]:
        return [bytes.fromhex(d) for d in self.layer_digests or ()]

    def tier_of(self, layer: int) -> Residency | None:
        for r in self.residency:
            if r.layers[0] <= layer <= r.layers[1]:
                return r
        return None


#: The `digest` of an in-production record: nothing matches it, so a peer that ignores `live`
#: and fetches the block fails its check (a failed source) rather than using unverified data.
LIVE_DIGEST = "sha-256:" + "0" * 64


def replica_id(holder: str, moqt_namespace: str | None = None) -> str:
    """Identity of a replica under its block key (DESIGN §3): one per holder and namespace."""
    h = hashlib.sha256(holder.encode() + b"\x00" + (moqt_namespace or "").encode())
    return h.digest()[:16].hex()


# --------------------------------------------------------------------------- instances


@dataclass(frozen=True)
class Link:
    holder: str
    mbit_per_s: float
    rtt_us: float = 0.0

    @classmethod
    def from_json(cls, data: Any, member: str) -> "Link":
        data = v.obj(data, member)
        return cls(
            holder=v.url(v.required(data, "holder", member + "."), member + ".holder"),
            mbit_per_s=v.number(v.required(data, "mbit_per_s", member + "."),
                                member + ".mbit_per_s", low_open=True),
            rtt_us=v.number(data.get("rtt_us", 0), member + ".rtt_us"),
        )

    def to_json(self) -> dict:
        return {"holder": self.holder, "mbit_per_s": self.mbit_per_s, "rtt_us": self.rtt_us}


@dataclass(frozen=True)
class InstanceStatus:
    """Instance Status Record (§4.4, §6.3)."""

    instance: str
    epoch: int
    state: str
    ttl_ms: int
    running: int = 0
    queued: int = 0
    batch_size: int = 0
    kv_utilization: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    links: tuple[Link, ...] = ()
    requested_state: str | None = None
    #: Extension member: requests the instance has admitted in this epoch. With it the PC
    #: knows exactly which of the requests it routed a record already counts in running or
    #: queued (§6.4 wait_us); without it, it can only guess from the time (see pc/lifecycle).
    admitted: int | None = None
    #: Extension member: the instance publishes the prompt blocks it computes live over MOQT
    #: (DESIGN §9), so another instance may subscribe to them while they are computed; only
    #: such an instance is named to compute a prompt for another one.
    live_kv: bool = False
    #: Extension member: the base URL of the holder that serves (and live-publishes) the
    #: instance's blocks, when it is not the instance's own URL (a vLLM engine's embedded
    #: holder); another instance subscribes to the tracks of that holder.
    holder: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> "InstanceStatus":
        data = v.obj(data)
        state = v.required(data, "state")
        if state not in INSTANCE_STATES:
            raise BadRecord(f"must be one of {', '.join(INSTANCE_STATES)}", member="state")
        requested = data.get("requested_state")
        if requested is not None and requested not in INSTANCE_STATES:
            raise BadRecord(f"must be null or one of {', '.join(INSTANCE_STATES)}",
                            member="requested_state")
        return cls(
            instance=v.url(v.required(data, "instance"), "instance", schemes=("http", "https")),
            epoch=v.integer(v.required(data, "epoch"), "epoch"),
            state=state,
            ttl_ms=v.integer(v.required(data, "ttl_ms"), "ttl_ms", low=1),
            running=v.integer(data.get("running", 0), "running"),
            queued=v.integer(data.get("queued", 0), "queued"),
            batch_size=v.integer(data.get("batch_size", 0), "batch_size"),
            kv_utilization=v.number(data.get("kv_utilization", 0.0), "kv_utilization", high=1.0),
            prefill_tokens_per_s=v.number(data.get("prefill_tokens_per_s", 0.0),
                                          "prefill_tokens_per_s"),
            decode_tokens_per_s=v.number(data.get("decode_tokens_per_s", 0.0),
                                         "decode_tokens_per_s"),
            links=tuple(v.array(data.get("links", []), "links", Link.from_json, max_len=4096)),
            requested_state=requested,
            admitted=None if data.get("admitted") is None else v.integer(data["admitted"], "admitted"),
            live_kv=v.boolean(data.get("live_kv", False), "live_kv"),
            holder=(None if data.get("holder") is None
                    else v.url(data["holder"], "holder", schemes=("http", "https"))),
        )

    def to_json(self) -> dict:
        out = {
            "instance": self.instance,
            "epoch": self.epoch,
            "state": self.state,
            "running": self.running,
            "queued": self.queued,
            "batch_size": self.batch_size,
            "kv_utilization": self.kv_utilization,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "links": [link.to_json() for link in self.links],
            "requested_state": self.requested_state,
            "ttl_ms": self.ttl_ms,
        }
        if self.admitted is not None:
            out["admitted"] = self.admitted
        if self.live_kv:
            out["live_kv"] = True
        if self.holder is not None:
            out["holder"] = self.holder
        return out


# --------------------------------------------------------------------------- sessions


@dataclass(frozen=True)
class Sampler:
    method: str
    params: dict = field(default_factory=dict)
    seed: int = 0
    step: int = 0
    deterministic: bool = False

    @classmethod
    def from_json(cls, data: Any, member: str = "sampler") -> "Sampler":
        data = v.obj(data, member)
        params = data.get("params", {})
        v.obj(params, member + ".params")
        return cls(
            method=v.string(v.required(data, "method", member + "."), member + ".method",
                            max_len=64),
            params=dict(params),
            seed=v.integer(data.get("seed", 0), member + ".seed"),
            step=v.integer(data.get("step", 0), member + ".step"),
            deterministic=v.boolean(data.get("deterministic", False), member + ".deterministic"),
        )

    def to_json(self) -> dict:
        return {"method": self.method, "params": dict(self.params), "seed": self.seed,
                "step": self.step, "deterministic": self.deterministic}


@dataclass(frozen=True)
class SessionCheckpoint:
    """What another instance needs to resume a session (§4.4, §6.8)."""

    session: str
    epoch: int
    compat_id: str
    scope_id: str
    prompt_blocks: tuple[str, ...]
    prompt_tail: tuple[int, ...]
    generated: tuple[int, ...]
    output_offset: int
    sampler: Sampler

    @classmethod
    def from_json(cls, data: Any) -> "SessionCheckpoint":
        data = v.obj(data)
        generated = tuple(v.tokens(v.required(data, "generated"), "generated"))
        offset = v.integer(v.required(data, "output_offset"), "output_offset")
        if offset > len(generated):
            raise BadRecord("exceeds the number of generated tokens", member="output_offset")
        return cls(
            session=v.uuid_text(v.required(data, "session"), "session"),
            epoch=v.integer(v.required(data, "epoch"), "epoch"),
            compat_id=v.hexn(v.required(data, "compat_id"), 32, "compat_id"),
            scope_id=v.hexn(v.required(data, "scope_id"), 16, "scope_id"),
            prompt_blocks=v.hex_array(v.required(data, "prompt_blocks"), 32, "prompt_blocks"),
            prompt_tail=tuple(v.tokens(v.required(data, "prompt_tail"), "prompt_tail")),
            generated=generated,
            output_offset=offset,
            sampler=Sampler.from_json(v.required(data, "sampler")),
        )

    def to_json(self) -> dict:
        return {
            "session": self.session,
            "epoch": self.epoch,
            "compat_id": self.compat_id,
            "scope_id": self.scope_id,
            "prompt_blocks": list(self.prompt_blocks),
            "prompt_tail": list(self.prompt_tail),
            "generated": list(self.generated),
            "output_offset": self.output_offset,
            "sampler": self.sampler.to_json(),
        }


# --------------------------------------------------------------------------- resharding


def _half_open(value: Any, member: str) -> tuple[int, int]:
    a, b = v.pair(value, member)
    if a >= b:
        raise BadRecord("a half-open token range needs start < end", member=member)
    return a, b


@dataclass(frozen=True)
class Shard:
    tokens: tuple[int, int]
    instance: str


@dataclass(frozen=True)
class ShardMap:
    """A split of one context by token range across a parallel group (§6.9)."""

    map: str
    version: int
    shards: tuple[Shard, ...]
    #: Extension member: the scope whose context is split. Instances serve its ranges only to
    #: principals of that scope; a map without one, only to principals of every scope ("*").
    scope_id: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> "ShardMap":
        data = v.obj(data)
        shards = []
        for i, s in enumerate(v.array(v.required(data, "shards"), "shards", lambda x, m: x,
                                      min_len=1, max_len=4096)):
            member = f"shards[{i}]"
            s = v.obj(s, member)
            shards.append(Shard(
                _half_open(v.required(s, "tokens", member + "."), member + ".tokens"),
                v.url(v.required(s, "instance", member + "."), member + ".instance"),
            ))
        for i in range(1, len(shards)):
            if shards[i].tokens[0] != shards[i - 1].tokens[1]:
                raise BadRecord("ranges must be contiguous, in ascending order",
                                member=f"shards[{i}].tokens")
        return cls(v.string(v.required(data, "map"), "map", max_len=256),
                   v.integer(v.required(data, "version"), "version"), tuple(shards),
                   _optional_scope(data))

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "map": self.map, "version": self.version,
            "shards": [{"tokens": list(s.tokens), "instance": s.instance} for s in self.shards]}
        if self.scope_id is not None:
            out["scope_id"] = self.scope_id
        return out

    def ranges_of(self, instance: str) -> list[tuple[int, int]]:
        return [s.tokens for s in self.shards if s.instance == instance]


@dataclass(frozen=True)
class RangeFetch:
    tokens: tuple[int, int]
    source: str


@dataclass(frozen=True)
class ReshardPlan:
    """POST reshard from version `from_version` to `to_version` (§6.9)."""

    map: str
    from_version: int
    to_version: int
    deadline_ms: int
    retain: tuple[tuple[int, int], ...] = ()
    fetch: tuple[RangeFetch, ...] = ()
    release: tuple[tuple[int, int], ...] = ()
    kind: Literal["plan"] = "plan"
    #: Extension member: the map's scope (ShardMap.scope_id), for a member new to the map.
    scope_id: str | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "map": self.map, "from": self.from_version, "to": self.to_version,
            "deadline_ms": self.deadline_ms,
            "retain": [list(r) for r in self.retain],
            "fetch": [{"tokens": list(f.tokens), "from": f.source} for f in self.fetch],
            "release": [list(r) for r in self.release],
        }
        if self.scope_id is not None:
            out["scope_id"] = self.scope_id
        return out


@dataclass(frozen=True)
class ReshardDecision:
    """POST reshard with {"commit": v} or {"abort": v}."""

    map: str
    kind: Literal["commit", "abort"]
    version: int

    def to_json(self) -> dict:
        return {"map": self.map, self.kind: self.version}


def parse_reshard(data: Any) -> ReshardPlan | ReshardDecision:
    data = v.obj(data)
    name = v.string(v.required(data, "map"), "map", max_len=256)
    for kind in ("commit", "abort"):
        if kind in data:
            return ReshardDecision(name, kind, v.integer(data[kind], kind))
    src = v.integer(v.required(data, "from"), "from")
    dst = v.integer(v.required(data, "to"), "to")
    if dst != src + 1:
        raise BadRecord("must be from + 1", member="to")
    retain = tuple(v.array(data.get("retain", []), "retain", _half_open))
    release = tuple(v.array(data.get("release", []), "release", _half_open))
    fetch = []
    for i, f in enumerate(v.array(data.get("fetch", []), "fetch", lambda x, m: x)):
        member = f"fetch[{i}]"
        f = v.obj(f, member)
        fetch.append(RangeFetch(_half_open(v.required(f, "tokens", member + "."), member + ".tokens"),
                                v.url(v.required(f, "from", member + "."), member + ".from")))
    check_disjoint(list(retain) + [f.tokens for f in fetch], "retain", half_open=True)
    return ReshardPlan(name, src, dst, v.integer(v.required(data, "deadline_ms"), "deadline_ms",
                                                 low=1),
                       retain, tuple(fetch), release, scope_id=_optional_scope(data))


def _optional_scope(data: dict) -> str | None:
    value = data.get("scope_id")
    return None if value is None else v.hexn(value, 16, "scope_id")


# --------------------------------------------------------------------------- prefetch, leases


@dataclass(frozen=True)
class PrefetchBlock:
    block_key: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class PrefetchDirective:
    """Load these blocks before the request arrives (§6.5)."""

    directive: str
    scope_id: str
    compat_id: str
    blocks: tuple[PrefetchBlock, ...]
    deadline_ms: int
    lease_ms: int
    request_ref: str | None = None
    layer_order: str = "ascending"

    @classmethod
    def from_json(cls, data: Any) -> "PrefetchDirective":
        data = v.obj(data)
        blocks = []
        for i, b in enumerate(v.array(v.required(data, "blocks"), "blocks", lambda x, m: x,
                                      max_len=65536)):
            member = f"blocks[{i}]"
            b = v.obj(b, member)
            blocks.append(PrefetchBlock(
                v.hexn(v.required(b, "block_key", member + "."), 32, member + ".block_key"),
                tuple(v.array(v.required(b, "sources", member + "."), member + ".sources", v.url,
                              min_len=1, max_len=64)),
            ))
        order = data.get("layer_order", "ascending")
        if order != "ascending":
            raise BadRecord('only "ascending" is defined', member="layer_order")
        ref = data.get("request_ref")
        return cls(
            directive=v.uuid_text(v.required(data, "directive"), "directive"),
            scope_id=v.hexn(v.required(data, "scope_id"), 16, "scope_id"),
            compat_id=v.hexn(v.required(data, "compat_id"), 32, "compat_id"),
            blocks=tuple(blocks),
            deadline_ms=v.integer(v.required(data, "deadline_ms"), "deadline_ms", low=1),
            lease_ms=v.integer(v.required(data, "lease_ms"), "lease_ms", low=1),
            request_ref=None if ref is None else v.string(ref, "request_ref", max_len=1024),
            layer_order=order,
        )

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "directive": self.directive,
            "scope_id": self.scope_id,
            "compat_id": self.compat_id,
            "blocks": [{"block_key": b.block_key, "sources": list(b.sources)} for b in self.blocks],
            "layer_order": self.layer_order,
            "deadline_ms": self.deadline_ms,
            "lease_ms": self.lease_ms,
        }
        if self.request_ref is not None:
            out["request_ref"] = self.request_ref
        return out


@dataclass(frozen=True)
class LeaseRequest:
    """POST leases (§6.6): protect these blocks from eviction for ttl_ms."""

    block_keys: tuple[str, ...]
    ttl_ms: int

    @classmethod
    def from_json(cls, data: Any) -> "LeaseRequest":
        data = v.obj(data)
        return cls(
            v.hex_array(v.required(data, "block_keys"), 32, "block_keys", min_len=1, max_len=65536),
            v.integer(v.required(data, "ttl_ms"), "ttl_ms", low=1),
        )

    def to_json(self) -> dict:
        return {"block_keys": list(self.block_keys), "ttl_ms": self.ttl_ms}


@dataclass(frozen=True)
class LeaseGrant:
    lease: str
    ttl_ms: int

    @classmethod
    def from_json(cls, data: Any) -> "LeaseGrant":
        data = v.obj(data)
        return cls(v.string(v.required(data, "lease"), "lease", max_len=256),
                   v.integer(v.required(data, "ttl_ms"), "ttl_ms", low=1))

    def to_json(self) -> dict:
        return {"lease": self.lease, "ttl_ms": self.ttl_ms}


# --------------------------------------------------------------------------- lookup


@dataclass(frozen=True)
class LookupRequest:
    """POST lookup (§6.2): block keys in prefix order, optionally targets for estimates."""

    scope_id: str
    compat_id: str
    block_keys: tuple[str, ...]
    targets: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, data: Any) -> "LookupRequest":
        data = v.obj(data)
        targets = data.get("targets")
        if targets is not None:
            targets = tuple(v.array(targets, "targets", v.url, max_len=4096))
        return cls(
            scope_id=v.hexn(v.required(data, "scope_id"), 16, "scope_id"),
            compat_id=v.hexn(v.required(data, "compat_id"), 32, "compat_id"),
            block_keys=v.hex_array(v.required(data, "block_keys"), 32, "block_keys", max_len=1 << 20),
            targets=targets,
        )

    def to_json(self) -> dict:
        out: dict[str, Any] = {"scope_id": self.scope_id, "compat_id": self.compat_id,
                               "block_keys": list(self.block_keys)}
        if self.targets is not None:
            out["targets"] = list(self.targets)
        return out
