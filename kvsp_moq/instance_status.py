"""Instance status (KVSP §6.3): what an inference instance (a `kvsp agent`, a vLLM engine with
the KVSP connector) measures about itself and reports to the PC.
`Meters` keeps moving averages of prefill and decode throughput and, per holder, of the link
rate and round-trip time observed by the loader (transfers and lease round trips), the inputs
the PC's placement estimates consume (§6.4). `StatusReporter` sends the Instance Status Record
to `PUT {pc}instances/{id}/status` every ttl_ms / 3, with the start time in milliseconds as the
epoch, adopts the state the PC answers with, asks to sleep once idle for long enough, and
reports "sleeping" once draining has left nothing running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from kvsp_moq.errors import KvspError
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.pc_endpoints import PCEndpoints
from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.protocol.records import INSTANCE_STATES, InstanceStatus, Link
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tasks import TaskSet, cancel_and_wait

log = logging.getLogger("kvsp.status")

__all__ = ["Ewma", "Meters", "StatusReporter"]


@dataclass
class Ewma:
    """An exponentially weighted moving average; None until the first sample.

    With `restart_factor`, a sample that far from the average (above or below) replaces it:
    a link whose rate changed (a cut-down path, a congested one) is believed at once, where an
    average would take several slow loads to follow it, each one placed as if it were fast.
    """

    alpha: float = 0.3
    value: float | None = None
    restart_factor: float | None = None

    def add(self, sample: float) -> None:
        value, factor = self.value, self.restart_factor
        if value is None or (factor is not None and value > 0
                             and not value / factor <= sample <= value * factor):
            self.value = sample
        else:
            self.value = (1 - self.alpha) * value + self.alpha * sample


#: A link rate more than this factor from its average restarts it (one load is one sample:
#: all its octets over its span, `kvsp_moq.fetch.transfers`, so a single sample is not noise).
LINK_RESTART_FACTOR = 2.0


@dataclass
class _LinkStats:
    mbit_per_s: Ewma = field(default_factory=lambda: Ewma(restart_factor=LINK_RESTART_FACTOR))
    rtt_us: Ewma = field(default_factory=Ewma)


class Meters:
    """Throughput of the model and of the links to holders, as the loader observes them.

    Transfers shorter than `min_octets` say more about latency than about the link's rate and
    only count as round trips.
    """

    def __init__(self, *, min_octets: int = 64 << 10) -> None:
        self.prefill = Ewma()
        self.decode = Ewma()
        self.min_octets = min_octets
        self._links: dict[str, _LinkStats] = {}

    def prefilled(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self.prefill.add(tokens / seconds)

    def decoded(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self.decode.add(tokens / seconds)

    def transfer(self, holder: str, octets: int, seconds: float) -> None:
        if seconds <= 0 or octets < self.min_octets:
            return
        self._links.setdefault(base_url(holder), _LinkStats()).mbit_per_s.add(octets * 8 / seconds / 1e6)

    def rtt(self, holder: str, seconds: float) -> None:
        if seconds > 0:
            self._links.setdefault(base_url(holder), _LinkStats()).rtt_us.add(seconds * 1e6)

    def links(self) -> tuple[Link, ...]:
        out = []
        for holder, stats in sorted(self._links.items()):
            if stats.mbit_per_s.value is None:
                continue  # a rate is what placement needs; an RTT alone says too little
            out.append(Link(holder, round(stats.mbit_per_s.value, 1),
                            round(stats.rtt_us.value or 0.0, 1)))
        return tuple(out)


class StatusReporter:
    """Reports the instance's status to the PC until stopped."""

    def __init__(self, *, pc_url: "str | PCEndpoints", instance_url: Callable[[], str],
                 client: httpx.AsyncClient,
                 meters: Meters, running: Callable[[], int], queued: Callable[[], int],
                 get_state: Callable[[], str], set_state: Callable[[str], None],
                 token: str | None = None, ttl_ms: int = 3000, batch_size: int = 1,
                 kv_utilization: Callable[[], float] = lambda: 0.0,
                 sleep_after_s: float | None = None, epoch: int | None = None,
                 admitted: Callable[[], int] | None = None,
                 live_kv: Callable[[], bool] = lambda: False, holder: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: one URL, or several PC processes on one store (tried in turn when one fails)
        self.pc = PCEndpoints(pc_url)
        self.instance_url = instance_url
        self.client = client
        self.meters = meters
        self.running = running
        self.queued = queued
        self.get_state = get_state
        self.set_state = set_state
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.ttl_ms = ttl_ms
        self.batch_size = batch_size
        self.kv_utilization = kv_utilization
        self.sleep_after_s = sleep_after_s
        self.epoch = epoch if epoch is not None else int(time.time() * 1000)
        self.admitted = admitted
        self.live_kv = live_kv
        self.holder = holder
        self.clock = clock
        self.reports = 0
        self.failures = 0
        self._idle_since: float | None = None
        self._task: asyncio.Task | None = None
        # Reports go out one at a time, so that the PC gets them in order (the "admitted"
        # counts of consecutive records are compared there).
        self._lock = asyncio.Lock()
        self._queued: asyncio.Future[None] | None = None
        self._pushes = TaskSet()
        self._failing = False

    def record(self) -> InstanceStatus:
        """The Instance Status Record as of now."""
        state = self.get_state()
        running, queued = self.running(), self.queued()
        now = self.clock()
        busy = running + queued > 0
        self._idle_since = None if busy else (self._idle_since if self._idle_since is not None else now)
        requested = None
        if state == "draining" and not busy:
            state = "sleeping"  # draining finished: report it, the PC moves us to sleeping
            self.set_state("sleeping")
        elif (state == "active" and self.sleep_after_s is not None and self._idle_since is not None
              and now - self._idle_since >= self.sleep_after_s):
            requested = "sleeping"
        return InstanceStatus(
            instance=base_url(self.instance_url()), epoch=self.epoch, state=state, ttl_ms=self.ttl_ms,
            running=running, queued=queued, batch_size=self.batch_size,
            kv_utilization=min(1.0, max(0.0, float(self.kv_utilization()))),
            prefill_tokens_per_s=round(self.meters.prefill.value or 0.0, 1),
            decode_tokens_per_s=round(self.meters.decode.value or 0.0, 1),
            links=self.meters.links(), requested_state=requested,
            admitted=None if self.admitted is None else self.admitted(), live_kv=self.live_kv(),
            holder=self.holder)

    async def report(self) -> str:
        """One status PUT; returns the state the PC answered and adopts it, unless the state
        changed while the answer was on its way (PUT state from the PC: the answer was about
        the record, which is older)."""
        record = self.record()
        sent_in = self.get_state()
        pc = self.pc.url
        url = f"{pc}instances/{instance_id(record.instance)}/status"
        try:
            r = await self.client.put(url, json=record.to_json(), headers=self.headers,
                                      timeout=max(0.5, self.ttl_ms / 3000))
        except httpx.HTTPError as e:
            self.pc.failed(pc)
            raise KvspError(f"PC {pc}: {type(e).__name__} {e}") from None
        if r.status_code == 503:
            self.pc.failed(pc)
        raise_for_problem(r)
        state = r.json().get("state")
        self.reports += 1
        current = self.get_state()
        if state in INSTANCE_STATES and state != current and current == sent_in:
            log.info("the PC says %s (was %s)", state, current)
            self.set_state(state)
        return str(state)

    def push(self) -> "asyncio.Future[None]":
        """Report as soon as the report in flight is done (pushes asked for meanwhile share
        it), so that the PC sees a request end now rather than at the next round."""
        if self._queued is None or self._queued.done():
            self._queued = self._pushes.add(asyncio.ensure_future(self._push()))
        return self._queued

    async def report_now(self, timeout: float = 0.25) -> None:
        """push() and wait for it, at most `timeout` and not at all while the PC fails."""
        pushed = self.push()
        if not self._failing:
            await asyncio.wait([pushed], timeout=timeout)

    async def _push(self) -> None:
        async with self._lock:
            self._queued = None  # the record is taken now: later pushes need another one
            await self._report_logged()

    async def _report_logged(self) -> None:
        try:
            await self.report()
            self._failing = False
        except KvspError as e:
            self.failures += 1
            self._failing = True
            log.warning("status report failed: %s", e.detail)
        except Exception:  # keep reporting whatever one round did
            self.failures += 1
            self._failing = True
            log.exception("status report failed")

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvsp-status")

    async def stop(self) -> None:
        self._pushes.cancel()
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _loop(self) -> None:
        interval = self.ttl_ms / 3000
        while True:
            async with self._lock:
                await self._report_logged()
            await asyncio.sleep(interval)
