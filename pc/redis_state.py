"""The Placement Controller's state in Redis (or Valkey), shared by every PC process on it.

`kvsp index --store redis://...` runs the PC on this module: any number of processes, on any
machines, given the same store act as one PC. What they share, and how:

- Sessions and their checkpoints (§6.8): `RedisSessionStore`. Each change applies the rules
  of `pc.sessions` (`accept_checkpoint`, `move_session`) to the state read from Redis inside
  a WATCH/MULTI transaction, so two processes never both raise an epoch or both move a
  session: the second one's transaction fails and is run again on the new state.
- Instances, their status and links (§6.3): `SharedInstanceRegistry`. A status PUT to any
  process runs the registry's state machine on the entry read from Redis, in a transaction,
  and writes it back; every process reads all entries each sweep (`refresh`, one MGET) and
  routes on that copy, so a route costs no round trip. A status reported to one process is
  used by a route at another within a sweep interval. Expiry is on the wall clock
  (`time.time`): machines that share a store must keep their clocks in step (NTP).
- Shard Maps: `RedisShardMapStore`, read from Redis each time.
- Duties (failing expired instances and moving their sessions, the start-up orphan check) run
  in the process that holds the lease (`pc.duties`).

What stays with each process: requests routed but not yet accounted for by a status record
(each PC counts its own), the herd table of `pc.disaggregation` (5 s), and the link and
prefetch bookkeeping of requests in flight. Losing them costs a less even spread for a few
seconds, never a wrong answer.

While Redis cannot be reached every operation that needs it answers 503 (`StoreUnavailable`),
and so do routes once the copy of the registry is older than `stale_after_s`: a PC cut off from
the store refuses rather than answering from stale memory. Nothing acknowledged is lost when
Redis restarts with its append-only file on (``appendfsync always``; ``everysec`` may lose the
last second on a crash of the server's machine).

Key layout (``P`` = ``{prefix}:pc:``, prefix ``kvsp``):

- ``P i:<instance base URL>``, string: an instance entry (JSON); ``P instances``, set of URLs.
- ``P s:<session>``, string: a session's state and latest checkpoint (JSON); ``P sessions``,
  set of session ids; ``P on:<instance base URL>``, set: the sessions an instance serves;
  ``P on``, set: instances that serve or served sessions.
- ``P m:<map>``, string: a Shard Map (JSON).
- ``P duties``, string with a TTL: the name of the process holding the duties.

Calls are synchronous, one round trip each (sub-millisecond on a LAN), made from the event
loop: the rules stay plain functions, and a transaction never interleaves with another
coroutine of the same process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Callable, Iterator, TypeVar

from kvsp_moq.auth import ANY, OPEN, Principal
from kvsp_moq.errors import StoreUnavailable
from kvsp_moq.protocol.records import InstanceStatus, SessionCheckpoint, ShardMap
from kvsp_moq.protocol.urls import base_url
from pc.lifecycle import InstanceFailed, InstanceRegistry, LifecycleSettings, Reply, StateChanged, _Entry
from pc.reshard import PendingReshard
from pc.sessions import SessionState, _never_live, accept_checkpoint, end_session, move_session

try:
    import redis
    from redis import exceptions as redis_errors
except ImportError:  # the `redis` extra is not installed
    redis = None  # type: ignore[assignment]  # optional extra: None marks it absent
    redis_errors = None  # type: ignore[assignment]  # optional extra: None marks it absent

log = logging.getLogger("kvsp.pc.redis")

__all__ = ["RedisSessionStore", "RedisShardMapStore", "RedisState", "SharedInstanceRegistry"]

T = TypeVar("T")

#: A transaction whose keys keep changing under it is tried at most this often.
MAX_TRIES = 64


class RedisState:
    """One connection pool to the store, its key names, and transactions over it."""

    def __init__(self, url: str, *, prefix: str = "kvsp", timeout_s: float = 1.0,
                 password: str | None = None) -> None:
        if redis is None:
            raise RuntimeError("the redis extra is not installed: pip install 'kvsp-moq[redis]'")
        self.url = url
        #: decode_responses: every reply is str (Any: the stubs cannot know that)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s,
                                           decode_responses=True,
                                           **({"password": password} if password else {}))
        self.p = f"{prefix}:pc:"

    def __str__(self) -> str:
        conn = self.client.connection_pool.connection_kwargs
        return f"redis {conn.get('host', conn.get('path'))}:{conn.get('port', '')}/{conn.get('db', 0)}"

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def unavailable(self, where: str) -> Iterator[None]:
        """Failures a retry can mend become `StoreUnavailable` (HTTP 503)."""
        try:
            yield
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, TimeoutError) as e:
            raise StoreUnavailable(f"PC store {where}: {e}") from None
        except redis_errors.ResponseError as e:
            if str(e).startswith(("LOADING", "READONLY", "MASTERDOWN", "BUSY", "TRYAGAIN")):
                raise StoreUnavailable(f"PC store {where}: {e}") from None
            raise

    def transact(self, where: str, watch: list[str], read: Callable[[Any], T],
                 write: Callable[[Any, T], Any]) -> Any:
        """`read` the watched keys, then queue `write`'s commands, atomically: run again when
        another process changed a watched key meanwhile. A refusal raised by `write` (a rule
        of the protocol) writes nothing."""
        with self.unavailable(where):
            for _ in range(MAX_TRIES):
                with self.client.pipeline() as pipe:
                    try:
                        pipe.watch(*watch)
                        value = read(pipe)
                        pipe.multi()
                        out = write(pipe, value)
                        pipe.execute()
                        return out
                    except redis_errors.WatchError:
                        continue
        raise StoreUnavailable(f"PC store {where}: still contended after {MAX_TRIES} tries")


# --------------------------------------------------------------------------- sessions


def _state_json(state: SessionState) -> str:
    return json.dumps({**state.to_json(), "checkpoint": state.checkpoint}, separators=(",", ":"))


def _state_from(raw: str | None) -> SessionState | None:
    if raw is None:
        return None
    d = json.loads(raw)
    return SessionState(d["session"], int(d["epoch"]), d["instance"], int(d["output_offset"]),
                        d["checkpoint"], bool(d.get("ended", False)))


class RedisSessionStore:
    """`pc.sessions.SessionStore` in Redis: the same rules, each change one transaction."""

    def __init__(self, state: RedisState, *, ended_keep_s: float = 300.0) -> None:
        self.r = state
        self.p = state.p
        self.ended_keep_s = ended_keep_s

    def close(self) -> None:
        pass  # the connection is the RedisState's

    def _key(self, session: str) -> str:
        return f"{self.p}s:{session}"

    def _write(self, pipe: Any, state: SessionState, old: SessionState | None) -> None:
        pipe.set(self._key(state.session), _state_json(state))
        pipe.sadd(f"{self.p}sessions", state.session)
        if old is not None and old.instance and old.instance != state.instance:
            pipe.srem(f"{self.p}on:{old.instance}", state.session)
        if state.instance:
            pipe.sadd(f"{self.p}on:{state.instance}", state.session)
            pipe.sadd(f"{self.p}on", state.instance)

    def get(self, session: str) -> SessionState | None:
        with self.r.unavailable("reading a session"):
            return _state_from(self.r.client.get(self._key(session)))

    def checkpoint(self, checkpoint: SessionCheckpoint, instance: str | None, *,
                   by: Principal = OPEN, is_live: Callable[[str], bool] = _never_live
                   ) -> SessionState:
        """Apply a checkpoint (`accept_checkpoint`; refusals raise) and persist the result."""
        key = self._key(checkpoint.session)

        def write(pipe: Any, current: SessionState | None) -> SessionState:
            state = accept_checkpoint(current, checkpoint, instance, by=by, is_live=is_live)
            if state != current:
                self._write(pipe, state, current)
            return state

        return self.r.transact("storing a checkpoint", [key],
                               lambda pipe: _state_from(pipe.get(key)), write)

    def move(self, session: str, new_instance: str, *, expect_epoch: int) -> SessionState | None:
        """Compare-and-set failover: None when the session changed epoch meanwhile (in any
        process)."""
        key = self._key(session)

        def write(pipe: Any, current: SessionState | None) -> SessionState | None:
            if current is None or current.epoch != expect_epoch or current.ended:
                return None
            state = move_session(current, new_instance)
            self._write(pipe, state, current)
            return state

        return self.r.transact("moving a session", [key],
                               lambda pipe: _state_from(pipe.get(key)), write)

    def delete(self, session: str, *, by: Principal = OPEN) -> bool:
        """End a session (`end_session`): only a principal of its scope that speaks for its
        instance may. What remains expires after `ended_keep_s`."""
        key = self._key(session)

        def write(pipe: Any, current: SessionState | None) -> bool:
            if current is None or current.ended:
                return False
            current.require_access(by)
            if current.instance is not None:
                by.require_holder(current.instance)
                pipe.srem(f"{self.p}on:{current.instance}", session)
            pipe.set(key, _state_json(end_session(current)), px=int(self.ended_keep_s * 1000))
            pipe.srem(f"{self.p}sessions", session)
            return True

        return self.r.transact("deleting a session", [key],
                               lambda pipe: _state_from(pipe.get(key)), write)

    def on_instance(self, instance: str) -> list[SessionState]:
        inst = base_url(instance)
        with self.r.unavailable("listing sessions"):
            ids = sorted(self.r.client.smembers(f"{self.p}on:{inst}"))
            raws = self.r.client.mget([self._key(s) for s in ids]) if ids else []
        states = [_state_from(raw) for raw in raws]
        return [s for s in states if s is not None and s.instance == inst and not s.ended]

    def instances(self) -> set[str]:
        with self.r.unavailable("listing instances with sessions"):
            insts = sorted(self.r.client.smembers(f"{self.p}on"))
            with self.r.client.pipeline(transaction=False) as pipe:
                for inst in insts:
                    pipe.scard(f"{self.p}on:{inst}")
                counts = pipe.execute()
        return {inst for inst, n in zip(insts, counts) if n}

    def count(self) -> int:
        """Sessions not ended."""
        with self.r.unavailable("counting sessions"):
            return int(self.r.client.scard(f"{self.p}sessions"))

    def purge_ended(self, keep_s: float) -> int:
        return 0  # ended sessions expire in Redis itself


# --------------------------------------------------------------------------- shard maps


class RedisShardMapStore:
    """`pc.reshard.ShardMapStore` in Redis: the authoritative version of each map."""

    def __init__(self, state: RedisState) -> None:
        self.r = state

    def get(self, name: str) -> ShardMap | None:
        with self.r.unavailable("reading a shard map"):
            raw = self.r.client.get(f"{self.r.p}m:{name}")
        return None if raw is None else ShardMap.from_json(json.loads(raw))

    def put(self, m: ShardMap) -> None:
        with self.r.unavailable("storing a shard map"):
            self.r.client.set(f"{self.r.p}m:{m.map}",
                              json.dumps(m.to_json(), separators=(",", ":")))

    def begin(self, pending: PendingReshard) -> None:
        with self.r.unavailable("storing a reshard"):
            with self.r.client.pipeline() as pipe:
                pipe.set(f"{self.r.p}rs:{pending.map}", json.dumps(pending.to_json()))
                pipe.sadd(f"{self.r.p}reshards", pending.map)
                pipe.execute()

    def end(self, name: str) -> None:
        with self.r.unavailable("ending a reshard"):
            with self.r.client.pipeline() as pipe:
                pipe.delete(f"{self.r.p}rs:{name}")
                pipe.srem(f"{self.r.p}reshards", name)
                pipe.execute()

    def abandoned(self, now: float) -> list[PendingReshard]:
        with self.r.unavailable("reading reshards"):
            names = sorted(self.r.client.smembers(f"{self.r.p}reshards"))
            raws = self.r.client.mget([f"{self.r.p}rs:{n}" for n in names]) if names else []
        pending = [PendingReshard.from_json(json.loads(raw)) for raw in raws if raw]
        return [p for p in pending if p.decide_by < now]


# --------------------------------------------------------------------------- instances


class SharedInstanceRegistry(InstanceRegistry):
    """`InstanceRegistry` whose entries live in Redis; this process routes on a copy of them.

    Every change is the base class's rule run on the entry just read from Redis, inside a
    transaction on that entry's key; `refresh` brings the copy up to date.
    """

    def __init__(self, state: RedisState, settings: LifecycleSettings | None = None, *,
                 clock: Callable[[], float] = time.time, stale_after_s: float = 2.0) -> None:
        super().__init__(settings, clock=clock)
        self.r = state
        self.stale_after_s = stale_after_s
        self._raw: dict[str, str] = {}
        self._fresh_at: float | None = None

    def _key(self, url: str) -> str:
        return f"{self.r.p}i:{url}"

    def _load(self, url: str, raw: str | None) -> None:
        """Take the stored entry as this process's copy, keeping what this process routed."""
        mine = self._entries.get(url)
        if raw is None:
            self._entries.pop(url, None)
            self._raw.pop(url, None)
        elif self._raw.get(url) != raw or mine is None:
            self._entries[url] = _Entry.from_json(json.loads(raw), mine.routed if mine else None)
            self._raw[url] = raw

    def _transact(self, url: str, where: str, change: Callable[[], T]) -> T:
        key = self._key(url)

        def write(pipe: Any, _: None) -> T:
            out = change()
            entry = self._entries.get(url)
            if entry is None:
                pipe.delete(key)
                pipe.srem(f"{self.r.p}instances", url)
                self._raw.pop(url, None)
            else:
                raw = json.dumps(entry.to_json(), separators=(",", ":"))
                pipe.set(key, raw)
                pipe.sadd(f"{self.r.p}instances", url)
                self._raw[url] = raw
            return out

        return self.r.transact(where, [key], lambda pipe: self._load(url, pipe.get(key)), write)

    def refresh(self) -> None:
        """Read every entry (one round trip for the set, one for the entries)."""
        with self.r.unavailable("reading instances"):
            urls = sorted(self.r.client.smembers(f"{self.r.p}instances"))
            raws = self.r.client.mget([self._key(u) for u in urls]) if urls else []
        for url, raw in zip(urls, raws):
            self._load(url, raw)
        for url in set(self._entries) - set(urls):
            self._load(url, None)
        self._fresh_at = time.monotonic()

    def require_fresh(self) -> None:
        """StoreUnavailable when the copy is older than `stale_after_s`: a PC cut off from the
        store refuses to route rather than route on what it remembers."""
        if self._fresh_at is None:
            self.refresh()
        elif time.monotonic() - self._fresh_at > self.stale_after_s:
            try:
                self.refresh()
            except StoreUnavailable as e:
                raise StoreUnavailable(f"{e.detail}; the PC's copy of the instances is "
                                       f"{time.monotonic() - self._fresh_at:.1f} s old") from None

    def report(self, record: InstanceStatus, by: Principal = OPEN) -> Reply:
        url = base_url(record.instance)
        return self._transact(url, "storing a status", lambda: InstanceRegistry.report(self, record, by))

    def set_state(self, instance: str, state: str) -> StateChanged | None:
        url = base_url(instance)
        return self._transact(url, "setting a state",
                              lambda: InstanceRegistry.set_state(self, url, state))

    def register_started(self, started: str | InstanceStatus, scope_id: str = ANY) -> bool:
        url = base_url(started if isinstance(started, str) else started.instance)
        return self._transact(url, "registering an instance",
                              lambda: InstanceRegistry.register_started(self, started, scope_id))

    def forget(self, instance: str) -> bool:
        url = base_url(instance)
        return self._transact(url, "forgetting an instance",
                              lambda: InstanceRegistry.forget(self, url))

    def expire(self) -> list[InstanceFailed]:
        """Marks failed, in the store, each instance whose record expired; an instance another
        process marked or that reported meanwhile is left as the store has it."""
        self.refresh()
        out = []
        for url in self.expired():
            failed = self._transact(url, "expiring an instance", self._expiring(url))
            if failed is not None:
                out.append(failed)
        return out

    def _expiring(self, url: str) -> Callable[[], InstanceFailed | None]:
        return lambda: InstanceRegistry.expire_one(self, url)

