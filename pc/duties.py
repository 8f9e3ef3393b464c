"""Duties done once across PC processes: a lease in the store.

What a PC does on its own, not asked by a request (failing instances whose status expired and
moving their sessions, the start-up check for sessions of instances that never reported), is
done by the one process that holds the lease. The holder renews it every sweep; when it dies
the lease runs out after `ttl_ms` and the next process to sweep takes it, so duties pause for at
most `ttl_ms` plus one sweep interval. Two holders can overlap only if one stalls past its
lease; even then no session is moved twice, because every move is a compare-and-set on the
session's epoch (`pc.redis_state.RedisSessionStore.move`).

One process alone (the memory/SQLite store) always holds its duties.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

from pc.redis_state import RedisState

log = logging.getLogger("kvsp.pc.duties")

__all__ = ["DutyLease"]

# KEYS[1] = the lease; ARGV = (holder name, ttl ms). 1 when the caller holds it afterwards.
_TAKE_OR_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class DutyLease:
    """Whether this process holds the duties now; `hold` takes or renews the lease."""

    def __init__(self, state: RedisState | None, *, ttl_ms: int = 3000,
                 name: str | None = None) -> None:
        self.r = state
        self.ttl_ms = ttl_ms
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.held = state is None
        self._script = None if state is None else state.client.register_script(_TAKE_OR_RENEW)

    def hold(self) -> bool:
        """Take the lease if it is free, renew it if ours; False when another process holds
        it (or the store cannot be reached: duties wait rather than run twice)."""
        if self.r is None or self._script is None:
            return True
        try:
            with self.r.unavailable("taking the duties"):
                held = bool(self._script(keys=[f"{self.r.p}duties"], args=[self.name, self.ttl_ms]))
        except Exception as e:  # the sweep goes on; duties resume when the store answers
            log.warning("duties lease: %s", getattr(e, "detail", e))
            held = False
        if held != self.held:
            log.info("%s the PC duties (%s)", "took" if held else "lost", self.name)
        self.held = held
        return held

    def holder(self) -> str | None:
        """The name of the process holding the lease now (None: nobody)."""
        if self.r is None:
            return self.name
        with self.r.unavailable("reading the duties"):
            return self.r.client.get(f"{self.r.p}duties")

    def release(self) -> None:
        """Give the lease up (a clean shutdown): another process takes over at its next sweep."""
        if self.r is None or not self.held:
            return
        try:
            with self.r.unavailable("releasing the duties"):
                pipe = self.r.client.pipeline()
                key = f"{self.r.p}duties"
                pipe.watch(key)
                if pipe.get(key) == self.name:
                    pipe.multi()
                    pipe.delete(key)
                    pipe.execute()
                pipe.reset()
        except Exception as e:
            log.info("releasing the duties lease: %s", getattr(e, "detail", e))
        self.held = False
