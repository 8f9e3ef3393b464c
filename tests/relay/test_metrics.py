"""The relay's HTTP metrics: GET /metrics in Prometheus text and GET /healthz, in process and
from `kvsp relay --metrics`."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
from starlette.testclient import TestClient

from kvsp_moq.auth import Authenticator
from relay.metrics import create_metrics_app, render, start_metrics_server

from .conftest import STEP, TrackPublisher, collect, dial, make_objects, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK_NS = NS + (b"k" * 32,)
NAME = b"1"


def parse(text: str) -> dict[str, float]:
    """Sample name -> value of a Prometheus text exposition (no labels needed here)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


async def get(url: str) -> httpx.Response:
    return await asyncio.to_thread(httpx.get, url, timeout=STEP)


def test_with_principals_metrics_are_for_the_metrics_role_only():
    auth = Authenticator.from_mapping({"principal": [
        {"name": "scraper", "token": "t-scrape", "roles": ["metrics"]},
        {"name": "tenant", "token": "t-tenant", "scopes": ["ab" * 16], "holders": ["*"],
         "roles": ["holder", "instance", "relay", "client"]},
    ]})
    with TestClient(create_metrics_app(lambda: {"sessions": 3}, auth)) as client:
        assert client.get("/healthz").status_code == 200  # liveness probes carry no token
        assert client.get("/metrics").status_code == 401
        refused = client.get("/metrics", headers={"Authorization": "Bearer t-tenant"})
        assert refused.status_code == 403
        assert refused.json()["type"].endswith("kvsp-forbidden-role")
        ok = client.get("/metrics", headers={"Authorization": "Bearer t-scrape"})
        assert ok.status_code == 200 and parse(ok.text)["kvsp_relay_sessions"] == 3


def test_render_types_counters_and_gauges():
    text = render({"objects_out": 3, "cache_bytes": 10, "cache_hits": 1})
    assert "# TYPE kvsp_relay_objects_forwarded_total counter\nkvsp_relay_objects_forwarded_total 3" in text
    assert "# TYPE kvsp_relay_cache_bytes gauge\nkvsp_relay_cache_bytes 10" in text
    assert "kvsp_relay_cache_hits_total 1" in text


async def test_metrics_count_cache_sessions_upstream_requests_and_forwarded_objects():
    objects = make_objects(1, 6, 2000)
    async with running_relay() as relay, publishing(relay.url, NS, TrackPublisher(objects)):
        server = await start_metrics_server(relay)
        client = await dial(relay.url)
        try:
            health = await get(server.url + "healthz")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 5), timeout=STEP))  # a miss
            await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 5), timeout=STEP))  # a hit
            response = await get(server.url + "metrics")
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain")
            figures = parse(response.text)
            assert figures["kvsp_relay_cache_misses_total"] == 1
            assert figures["kvsp_relay_cache_hits_total"] == 1
            assert figures["kvsp_relay_upstream_requests_total"] == 1
            assert figures["kvsp_relay_objects_forwarded_total"] == 2 * len(objects)
            assert figures["kvsp_relay_cache_bytes"] >= sum(len(p) for _, _, p in objects)
            assert figures["kvsp_relay_cache_objects"] == len(objects)
            assert figures["kvsp_relay_sessions"] == 2  # the publisher and the client
            assert figures["kvsp_relay_sessions_accepted_total"] == 2
            # The HTTP server's own request metrics follow.
            assert 'kvsp_relay_http_requests_total{method="GET",route="/healthz",status="200"} 1' in response.text
        finally:
            await client.aclose()
            await asyncio.get_running_loop().run_in_executor(None, server.stop)


async def test_relay_service_serves_metrics_when_asked(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0", "--cert-dir", str(tmp_path),
        "--metrics", "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        lines = []
        while not (lines and lines[-1].startswith("metrics at")) and len(lines) < 8:
            lines.append((await asyncio.wait_for(proc.stdout.readline(), 20)).decode())
        assert lines[-1].startswith("metrics at http://127.0.0.1:") and lines[-1].rstrip().endswith("/metrics")
        url = lines[-1].split()[-1]
        response = await get(url)
        assert response.status_code == 200
        figures = parse(response.text)
        assert figures["kvsp_relay_sessions"] == 0 and figures["kvsp_relay_cache_bytes"] == 0
        assert (await get(url.removesuffix("metrics") + "healthz")).status_code == 200
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
