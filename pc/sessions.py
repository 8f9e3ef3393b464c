"""Sessions, checkpoints and failover (KVSP §6.8).

The bookkeeping rules are pure functions over `SessionState`; `SessionStore` persists their
results in SQLite (WAL) so that a restarted PC still knows every session's epoch, instance and
latest checkpoint; `Failover` is the asyncio part that moves the sessions of a failed instance.

Wire formats (DESIGN §3, §6):

- `PUT {pc}sessions/{session}/checkpoint`: a Session Checkpoint (§4.4). It may carry an extra
  member "instance" (our extension; unknown members are ignored by other parties) with the base
  URL of the instance that serves the session; it is required for the first checkpoint of a
  session the PC has not placed. Reply: the session state below.
- `GET {pc}sessions/{session}`: `{"session", "epoch", "instance", "output_offset"}`, and
  `"ended": true` for a session deleted (ended) in the last `ended_sessions_keep_s`.
- `DELETE {pc}sessions/{session}` (our extension): the session is over; it is never resumed,
  and a later checkpoint of it is refused (kvsp-stale-epoch).
- `POST {ii}sessions/{session}/resume`: `{"checkpoint": <latest Session Checkpoint, verbatim,
  with the epoch it was taken under>, "epoch": <new session epoch>}`. Any 2xx accepts.

A session belongs to the scope of its first checkpoint (docs/authorization.md): a checkpoint of
another scope is refused, and only a principal that may speak for the instance named (its
"holders") may checkpoint for it. Within its scope, a higher epoch comes only from the instance
the PC moved the session to, or from another one once the session's instance is no longer
alive at the PC (a front end restarting a lost session from its prompt); otherwise any instance
of the scope could take a live session over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Protocol

from kvsp_moq.auth import OPEN, Principal
from kvsp_moq.errors import BadRecord, ForbiddenScope, KvspError, StaleEpoch
from kvsp_moq.protocol.records import SessionCheckpoint
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.pc.sessions")


@dataclass(frozen=True)
class SessionState:
    """What the PC keeps per session."""

    session: str
    epoch: int
    """The current session epoch; messages under a lower one are refused."""
    instance: str | None
    """Base URL of the instance that serves the session under `epoch`."""
    output_offset: int
    """output_offset of `checkpoint` (0 without one)."""
    checkpoint: dict | None
    """The latest accepted checkpoint, verbatim JSON; it may predate `epoch` after a failover."""
    ended: bool = False
    """Deleted (finished, or stopped by its client): kept a while so that a front end whose
    stream broke learns where it ended, never resumed, and no checkpoint brings it back."""

    def to_json(self) -> dict:
        out = {"session": self.session, "epoch": self.epoch, "instance": self.instance,
               "output_offset": self.output_offset}
        if self.ended:
            out["ended"] = True
        return out

    @property
    def checkpoint_epoch(self) -> int | None:
        return None if self.checkpoint is None else int(self.checkpoint["epoch"])

    @property
    def scope_id(self) -> str | None:
        """The scope the session started in (that of its checkpoints)."""
        return None if self.checkpoint is None else str(self.checkpoint["scope_id"]).lower()

    def require_access(self, who: Principal) -> None:
        """ForbiddenScope unless `who` holds the session's scope (the PC's own principal holds
        every scope, "*")."""
        if self.scope_id is not None:
            who.require_scope(self.scope_id)


def _never_live(instance: str) -> bool:
    return False


# --------------------------------------------------------------------------- rules


def accept_checkpoint(current: SessionState | None, checkpoint: SessionCheckpoint,
                      instance: str | None, *, by: Principal = OPEN,
                      is_live: Callable[[str], bool] = _never_live) -> SessionState:
    """The state after a checkpoint from principal `by` arrives (§6.8).

    A lower epoch than the session's is refused; within the current epoch the checkpoint with
    the highest output_offset is kept; a higher epoch (the instance knows of a move the PC has
    not made, e.g. after a PC restart with an older file) starts that epoch, unless it comes
    from another instance while the session's own is alive (`is_live`). The checkpoint must be
    in the session's scope, and `by` must hold it and speak for the instance.
    """
    by.require_scope(checkpoint.scope_id)
    inst = base_url(instance) if instance else None
    if current is None:
        if inst is None:
            raise BadRecord("the first checkpoint of a session must name the instance serving "
                            "it", member="instance")
        by.require_holder(inst)
        return SessionState(checkpoint.session, checkpoint.epoch, inst, checkpoint.output_offset,
                            checkpoint.to_json())
    if current.scope_id is not None and checkpoint.scope_id.lower() != current.scope_id:
        raise ForbiddenScope(f"session {current.session} belongs to another scope",
                             member="scope_id")
    if current.ended:
        raise StaleEpoch(f"session {current.session} has ended; it is not resumed",
                         member="session")
    serving = inst or current.instance
    if serving is not None:
        by.require_holder(serving)
    if checkpoint.epoch < current.epoch:
        raise StaleEpoch(f"session {current.session} is at epoch {current.epoch}; a checkpoint "
                         f"of epoch {checkpoint.epoch} is stale", member="epoch")
    if checkpoint.epoch > current.epoch:
        if (inst is not None and current.instance is not None and inst != current.instance
                and is_live(current.instance)):
            raise StaleEpoch(f"session {current.session} runs on {current.instance}, which is "
                             f"alive; only the PC moves it to another instance", member="epoch")
        return SessionState(current.session, checkpoint.epoch, inst or current.instance,
                            checkpoint.output_offset, checkpoint.to_json())
    if inst is not None and current.instance is not None and inst != current.instance:
        raise StaleEpoch(f"epoch {current.epoch} of session {current.session} belongs to "
                         f"{current.instance}, not {inst}", member="instance")
    newer = (current.checkpoint is None or current.checkpoint_epoch != checkpoint.epoch
             or checkpoint.output_offset > current.output_offset)
    if not newer:
        return current
    return SessionState(current.session, current.epoch, current.instance or inst,
                        checkpoint.output_offset, checkpoint.to_json())


def end_session(current: SessionState) -> SessionState:
    """DELETE: the session is over; what remains says where it ended."""
    return dataclasses.replace(current, ended=True)


def move_session(current: SessionState, new_instance: str) -> SessionState:
    """Failover: the next epoch, on another instance, with the same latest checkpoint."""
    return SessionState(current.session, current.epoch + 1, base_url(new_instance),
                        current.output_offset, current.checkpoint)


def resume_body(state: SessionState) -> dict:
    """The body of POST {ii}sessions/{session}/resume."""
    if state.checkpoint is None:
        raise BadRecord("a session without a checkpoint cannot be resumed", member="checkpoint")
    return {"checkpoint": state.checkpoint, "epoch": state.epoch}


# --------------------------------------------------------------------------- persistence

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL,
    instance TEXT,
    output_offset INTEGER NOT NULL,
    checkpoint TEXT,
    updated_ms INTEGER NOT NULL,
    ended_ms INTEGER
);
CREATE INDEX IF NOT EXISTS sessions_by_instance ON sessions (instance);
"""

_COLUMNS = "session, epoch, instance, output_offset, checkpoint, ended_ms"


def open_database(path: str | Path) -> sqlite3.Connection:
    """One SQLite connection in WAL mode, shared by the PC's stores under their own locks.

    synchronous=NORMAL: in WAL mode a committed transaction survives a crash of the process
    (a PC restart); only a power loss can take the last ones.
    """
    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


class SessionStore:
    """Session states in SQLite; every change is one transaction."""

    def __init__(self, db: sqlite3.Connection | str | Path) -> None:
        self._own = not isinstance(db, sqlite3.Connection)
        self.db: sqlite3.Connection = db if isinstance(db, sqlite3.Connection) else open_database(db)
        self._lock = threading.Lock()
        self.db.executescript(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(sessions)")}
        if "ended_ms" not in columns:  # a file from before ended sessions were kept
            self.db.execute("ALTER TABLE sessions ADD COLUMN ended_ms INTEGER")

    def close(self) -> None:
        if self._own:
            self.db.close()

    @staticmethod
    def _row(row: tuple) -> SessionState:
        session, epoch, instance, offset, checkpoint, ended_ms = row
        return SessionState(session, epoch, instance, offset,
                            json.loads(checkpoint) if checkpoint else None, ended_ms is not None)

    def _get(self, session: str) -> SessionState | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM sessions WHERE session = ?",
                              (session,)).fetchone()
        return None if row is None else self._row(row)

    def _put(self, state: SessionState) -> None:
        now_ms = int(time.time() * 1000)
        self.db.execute(
            "INSERT INTO sessions (session, epoch, instance, output_offset, checkpoint, "
            "updated_ms, ended_ms) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (session) DO UPDATE "
            "SET epoch = excluded.epoch, instance = excluded.instance, "
            "output_offset = excluded.output_offset, checkpoint = excluded.checkpoint, "
            "updated_ms = excluded.updated_ms, ended_ms = excluded.ended_ms",
            (state.session, state.epoch, state.instance, state.output_offset,
             json.dumps(state.checkpoint, separators=(",", ":")) if state.checkpoint else None,
             now_ms, now_ms if state.ended else None))

    def get(self, session: str) -> SessionState | None:
        with self._lock:
            return self._get(session)

    def checkpoint(self, checkpoint: SessionCheckpoint, instance: str | None, *,
                   by: Principal = OPEN, is_live: Callable[[str], bool] = _never_live
                   ) -> SessionState:
        """Apply a checkpoint (`accept_checkpoint`; refusals raise) and persist the result."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                current = self._get(checkpoint.session)
                state = accept_checkpoint(current, checkpoint, instance, by=by, is_live=is_live)
                if state != current:
                    self._put(state)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return state

    def move(self, session: str, new_instance: str, *, expect_epoch: int) -> SessionState | None:
        """Compare-and-set failover: None when the session changed epoch meanwhile."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                current = self._get(session)
                if current is None or current.epoch != expect_epoch or current.ended:
                    self.db.execute("COMMIT")
                    return None
                state = move_session(current, new_instance)
                self._put(state)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return state

    def delete(self, session: str, *, by: Principal = OPEN) -> bool:
        """End a session (`end_session`): only a principal of its scope that speaks for its
        instance may. False when there is no such session, or it has ended already."""
        with self._lock:
            current = self._get(session)
            if current is None or current.ended:
                return False
            current.require_access(by)
            if current.instance is not None:
                by.require_holder(current.instance)
            self._put(end_session(current))
            return True

    def purge_ended(self, keep_s: float) -> int:
        """Forget sessions that ended more than `keep_s` ago."""
        cutoff = int((time.time() - keep_s) * 1000)
        with self._lock:
            return self.db.execute("DELETE FROM sessions WHERE ended_ms < ?", (cutoff,)).rowcount

    def on_instance(self, instance: str) -> list[SessionState]:
        with self._lock:
            rows = self.db.execute(
                f"SELECT {_COLUMNS} FROM sessions WHERE instance = ? AND ended_ms IS NULL "
                "ORDER BY session", (base_url(instance),)).fetchall()
        return [self._row(r) for r in rows]

    def instances(self) -> set[str]:
        with self._lock:
            rows = self.db.execute("SELECT DISTINCT instance FROM sessions "
                                   "WHERE instance IS NOT NULL AND ended_ms IS NULL").fetchall()
        return {r[0] for r in rows}

    def count(self) -> int:
        """Sessions not ended."""
        with self._lock:
            return self.db.execute("SELECT COUNT(*) FROM sessions WHERE ended_ms IS NULL"
                                   ).fetchone()[0]


class Sessions(Protocol):
    """Where the PC keeps sessions: `SessionStore` (SQLite) or `pc.redis_state`'s (Redis)."""

    def get(self, session: str) -> SessionState | None: ...

    def checkpoint(self, checkpoint: SessionCheckpoint, instance: str | None, *,
                   by: Principal = OPEN, is_live: Callable[[str], bool] = _never_live
                   ) -> SessionState: ...

    def move(self, session: str, new_instance: str, *, expect_epoch: int
             ) -> SessionState | None: ...

    def delete(self, session: str, *, by: Principal = OPEN) -> bool: ...

    def on_instance(self, instance: str) -> list[SessionState]: ...

    def instances(self) -> set[str]: ...

    def count(self) -> int: ...

    def purge_ended(self, keep_s: float) -> int: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- failover

#: Picks an instance for a session, never one in `exclude`; None when there is none.
Chooser = Callable[[SessionState, frozenset[str]], Awaitable[str | None]]
#: Sends POST {ii}sessions/{session}/resume; raises on anything but 2xx.
ResumeSender = Callable[[str, str, dict], Awaitable[None]]


@dataclass(frozen=True)
class FailoverSettings:
    max_targets: int = 3
    """How many different instances one session is offered to before giving up."""
    attempts_per_target: int = 3
    """POST resume tries per instance (transport errors and 5xx)."""
    backoff_s: float = 0.05
    """First pause between tries; doubles each time."""


@dataclass(frozen=True)
class FailoverResult:
    session: str
    instance: str | None
    """Where the session runs now; None when no instance took it."""
    epoch: int
    tried: tuple[str, ...]


class Failover:
    """Moves each session of a failed instance to another one, raising its epoch (§6.8)."""

    def __init__(self, store: Sessions, choose: Chooser, send_resume: ResumeSender,
                 settings: FailoverSettings | None = None) -> None:
        self.store = store
        self.choose = choose
        self.send_resume = send_resume
        self.settings = settings or FailoverSettings()
        self._busy: set[str] = set()

    async def instance_failed(self, instance: str, *, may_return: bool = False
                              ) -> list[FailoverResult]:
        """Move every session of `instance`. `may_return`: the instance restarted and is
        itself a candidate again (its old incarnation's sessions are gone either way)."""
        results = []
        for state in self.store.on_instance(instance):
            result = await self.move(state.session, failed=instance, may_return=may_return)
            if result is not None:
                results.append(result)
        return results

    async def move(self, session: str, *, failed: str, may_return: bool = False
                   ) -> FailoverResult | None:
        """Move one session off `failed`; None when it is not there (any more)."""
        if session in self._busy:
            return None
        self._busy.add(session)
        try:
            return await self._move(session, base_url(failed), may_return)
        finally:
            self._busy.discard(session)

    async def _move(self, session: str, failed: str, may_return: bool) -> FailoverResult | None:
        state = self.store.get(session)
        if state is None or state.instance != failed:
            return None
        if state.checkpoint is None:
            log.warning("session %s on failed %s has no checkpoint; it cannot be resumed",
                        session, failed)
            return FailoverResult(session, None, state.epoch, ())
        tried: list[str] = []
        exclude = set() if may_return else {failed}
        for _ in range(self.settings.max_targets):
            target = await self.choose(state, frozenset(exclude))
            if target is None:
                break
            target = base_url(target)
            exclude.add(target)
            moved = self.store.move(session, target, expect_epoch=state.epoch)
            if moved is None:
                return None  # someone else moved it meanwhile
            state = moved
            tried.append(target)
            if await self._resume(target, state):
                log.info("session %s resumed on %s at epoch %d", session, target, state.epoch)
                return FailoverResult(session, target, state.epoch, tuple(tried))
        log.error("session %s could not be resumed (tried %s)", session, tried or "nothing")
        return FailoverResult(session, None, state.epoch, tuple(tried))

    async def _resume(self, target: str, state: SessionState) -> bool:
        body = resume_body(state)
        pause = self.settings.backoff_s
        for attempt in range(self.settings.attempts_per_target):
            try:
                await self.send_resume(target, state.session, body)
                return True
            except KvspError as e:
                log.warning("resume of %s on %s failed (try %d): %s", state.session, target,
                            attempt + 1, e.detail)
                if 400 <= e.status < 500 and e.status not in (408, 429):
                    return False  # refused: another try would get the same answer
            if attempt + 1 < self.settings.attempts_per_target:
                await asyncio.sleep(pause)
                pause *= 2
        return False


def sessions_to_json(states: Iterable[SessionState]) -> list[dict[str, Any]]:
    return [s.to_json() for s in states]
