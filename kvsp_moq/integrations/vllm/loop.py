"""An asyncio event loop on a thread of its own, for a connector role that is called from
vLLM's threads but talks to the network.

vLLM calls the connector synchronously (the scheduler loop, the model runner); lookups, leases,
fetches and PUTs are the project's asyncio code. Each role instance owns one loop thread, never
a module-global one: in vLLM's one-process mode the scheduler and the worker share a process,
and two engines may run one after the other in it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """A running event loop; coroutines are handed to it from any thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        """Start `coro` on the loop; its result arrives in the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Run `coro` on the loop and wait for its result (never from the loop's own thread)."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is still running, then stop and close the loop."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(cancel_all(), timeout)
        except Exception:  # stopping anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
