"""How the Placement Controller reaches inference instances: its HTTP calls to them
(DESIGN §3 "Instance resources") and the start hook that launches one (§6.4)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from typing import Any

import httpx

from kvsp_moq.errors import TransportError
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.records import InstanceStatus, PrefetchDirective
from pc.placement import RouteRequest, StartHook

__all__ = ["InstanceClient", "command_start_hook"]


class InstanceClient:
    """The PC's calls to inference instances (DESIGN §3 "Instance resources")."""

    def __init__(self, *, token: str | None = None, timeout: float = 5.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self._own = client is None
        self._client = client

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def aclose(self) -> None:
        if self._own and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, method: str, url: str, body: Any, timeout: float | None = None
                    ) -> httpx.Response:
        try:
            return await self.client.request(method, url, json=body, headers=self.headers,
                                             timeout=timeout or self.timeout)
        except httpx.HTTPError as e:
            raise TransportError(f"{method} {url}: {type(e).__name__} {e}") from None

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        r = await self._call("POST", instance + "prefetch", directive.to_json())
        raise_for_problem(r)

    async def resume(self, instance: str, session: str, body: dict) -> None:
        r = await self._call("POST", f"{instance}sessions/{session}/resume", body)
        raise_for_problem(r)

    async def put_state(self, instance: str, state: str, epoch: int) -> None:
        r = await self._call("PUT", instance + "state", {"state": state, "epoch": epoch})
        raise_for_problem(r)

    async def reshard(self, instance: str, body: dict, timeout: float) -> int:
        return (await self._call("POST", instance + "reshard", body, timeout)).status_code


def _drain_and_reap(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    try:
        for _ in proc.stdout:
            pass
    finally:
        proc.stdout.close()
        proc.wait()


def command_start_hook(command: str, *, timeout_s: float = 60.0,
                       env: dict[str, str] | None = None) -> StartHook:
    """A start hook that runs a shell command to launch an instance (§6.4).

    The command finds the request in its environment (KVSP_SCOPE_ID, KVSP_COMPAT_ID,
    KVSP_REQUEST_REF, KVSP_TOKEN_COUNT; with `env`, e.g. KVSP_PC_URL and KVSP_INDEX_URL too)
    and prints, as the first line of its output, the new instance's base URL or a JSON Instance
    Status Record of what is known of it (rates, links); an empty line means none was started.
    Only that line is waited for, so the command may keep running while the instance starts:
    the directive then overlaps the start.
    """

    extra_env = env

    async def start(request: RouteRequest) -> str | InstanceStatus | None:
        env = dict(os.environ, **(extra_env or {}), KVSP_SCOPE_ID=request.scope_id, KVSP_COMPAT_ID=request.compat_id,
                   KVSP_REQUEST_REF=request.request_ref or "",
                   KVSP_TOKEN_COUNT=str(request.token_count))
        proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env)
        assert proc.stdout is not None
        loop = asyncio.get_running_loop()
        try:
            line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline),
                                          timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            proc.kill()
            raise TransportError(f"start command printed nothing within {timeout_s} s") from None
        finally:
            # The rest of its output is read (a closed pipe would kill a command that keeps
            # logging) and it is reaped whenever it ends, without holding up the request.
            threading.Thread(target=_drain_and_reap, args=(proc,), daemon=True).start()
        text = line.decode("utf-8", "replace").strip()
        if not text:
            return None
        if text.startswith("{"):
            data = json.loads(text)
            data.setdefault("state", "active")
            data.setdefault("ttl_ms", 1)  # replaced by the start grace period
            data.setdefault("epoch", 0)
            return InstanceStatus.from_json(data)
        return v.url(text, "instance", schemes=("http", "https"))

    return start
