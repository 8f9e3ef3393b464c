"""A vLLM engine in the Placement Controller (KVSP §6.3): its status, reported as an agent's is.

With `pc` and `instance_url` in `kv_connector_extra_config`, the scheduler's half of the connector
reports an Instance Status Record to `PUT {pc}instances/{id}/status` every third of
`status_ttl_ms`, under `instance_url` (the engine's OpenAI-compatible base URL, where the PC's
routes and the gateway send requests): requests waiting and running as the scheduler sees them,
prefill and decode rates measured from its steps (the tokens a step scheduled over the time
until the next step began), and the links to the holders its workers loaded from (rate and lease
round trip, as an agent measures them; the workers send what they saw each step as vLLM's
connector worker metadata). The PC then routes among vLLM engines and `kvsp agent`s alike by the
§6.4 cost. The reporting principal must list `instance_url` among its holders, as an agent's
lists its own URL.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import httpx

from kvsp_moq.instance_status import Meters, StatusReporter
from kvsp_moq.integrations.vllm.config import ConnectorConfig
from kvsp_moq.integrations.vllm.loop import LoopThread

if TYPE_CHECKING:  # metadata needs vllm; `live_holder` here is used without it
    from kvsp_moq.integrations.vllm.metadata import KVSPWorkerMetadata
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.vllm.status")

__all__ = ["EngineStatus", "live_holder"]


def live_holder(c: ConnectorConfig) -> str | None:
    """The embedded holder's URL when it publishes blocks live (prefill and decode apart: the
    PC may name this engine to compute a prompt for another instance, which subscribes to this
    holder's tracks). Its port must be fixed ("listen" with a port, or "public_url"): the
    scheduler cannot learn a port the worker's holder picks."""
    if not (c.live_kv and c.relay and c.embedded):
        return None
    if c.public_url:
        return base_url(c.public_url)
    host, _, port = c.listen.rpartition(":")
    if port in ("", "0") or host in ("0.0.0.0", "::", "[::]"):
        return None
    return f"http://{c.listen}/"


class EngineStatus:
    """Counts and rates of one engine's scheduler, and the reporter that sends them."""

    def __init__(self, config: ConnectorConfig, loop: LoopThread) -> None:
        assert config.pc is not None and config.instance_url is not None
        self.config = config
        self.loop = loop
        self.meters = Meters()
        self.waiting: set[str] = set()
        self.running: set[str] = set()
        self.state = "active"
        #: (when the last step was built, its prefill tokens, whether it decoded)
        self._last: tuple[float, int, bool] | None = None
        self.reporter: StatusReporter | None = None
        self.loop.call(self._start())

    async def _start(self) -> None:
        self._client = httpx.AsyncClient(trust_env=False, timeout=5.0)
        url = self.config.instance_url
        assert url is not None and self.config.pc is not None
        self.reporter = StatusReporter(
            pc_url=self.config.pc, instance_url=lambda: url, client=self._client, meters=self.meters,
            running=lambda: len(self.running), queued=lambda: len(self.waiting),
            get_state=lambda: self.state, set_state=self._set_state, token=self.config.token,
            ttl_ms=self.config.status_ttl_ms, live_kv=lambda: self.live_holder is not None,
            holder=self.live_holder)
        await self.reporter.start()
        log.info("reporting to the PC at %s as %s", self.config.pc, url)

    @property
    def live_holder(self) -> str | None:
        return live_holder(self.config)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            log.info("the PC sets this engine %s", state)
        self.state = state

    # ---------------------------------------------------------------- scheduler events

    def seen(self, req_id: str) -> None:
        if req_id not in self.running:
            self.waiting.add(req_id)

    def stepped(self, steps: list[tuple[str, int, int, int | None]]) -> None:
        """One scheduler step: (request, tokens computed before it, tokens it schedules, prompt
        length or None) per scheduled request."""
        now = time.monotonic()
        if self._last is not None:
            at, prefill, decoded = self._last
            if prefill:
                self.meters.prefilled(prefill, now - at)
            elif decoded:
                self.meters.decoded(1, now - at)
        prefill, decoded = 0, False
        for req_id, computed, scheduled, prompt in steps:
            self.waiting.discard(req_id)
            self.running.add(req_id)
            part = max(0, min(scheduled, prompt - computed)) if prompt is not None else 0
            prefill += part
            decoded = decoded or scheduled > part
        self._last = (now, prefill, decoded) if steps else None

    def links(self, seen: KVSPWorkerMetadata) -> None:
        """What the workers saw of their links in one step."""
        for holder, octets, seconds in seen.transfers:
            self.meters.transfer(holder, octets, seconds)
        for holder, seconds in seen.rtts:
            self.meters.rtt(holder, seconds)

    def finished(self, req_id: str) -> None:
        self.waiting.discard(req_id)
        self.running.discard(req_id)
        reporter = self.reporter
        if reporter is not None and not self.waiting and not self.running:
            self.loop.submit(reporter.report_now())  # the PC learns at once that it is free

    def stop(self) -> None:
        reporter = self.reporter
        if reporter is None:
            return
        self.reporter = None

        async def close() -> None:
            await reporter.stop()
            await self._client.aclose()

        try:
            self.loop.call(close(), 5.0)
        except Exception as e:  # stopping anyway
            log.debug("closing the status reporter: %s", e)

    def describe(self) -> dict[str, Any]:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "prefill_tokens_per_s": self.meters.prefill.value,
                "reports": self.reporter.reports if self.reporter is not None else 0}
