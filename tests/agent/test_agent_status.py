"""Instance status (KVSP §6.3): the record sent every ttl/3 with the start time as epoch, measured
rates and links; the PC's answers followed, from a sleep request to sleeping."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent.service import Agent, AgentSettings
from kvsp_moq.instance_status import Meters, StatusReporter, instance_id
from kvsp_moq.protocol.records import InstanceStatus
from kvsp_moq.web import BackgroundServer
from pc.lifecycle import instance_id as pc_instance_id
from tests.polling import wait_until


class RecordingPC:
    """Takes status records; answers with what `decide` makes of each."""

    def __init__(self, decide: Callable[[dict], str] = lambda body: body["state"]) -> None:
        self.decide = decide
        self.records: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def status(request: Request) -> Response:
            body = await request.json()
            InstanceStatus.from_json(body)  # a valid record, or the test fails on the 500
            with self.lock:
                self.records.append((request.path_params["id"], body))
            return JSONResponse({"state": self.decide(body)})

        return Starlette(routes=[Route("/instances/{id}/status", status, methods=["PUT"])])

    def first(self, predicate: Callable[[dict], bool]) -> dict | None:
        """The first record received that `predicate` holds for, if one has arrived."""
        with self.lock:
            return next((body for _, body in self.records if predicate(body)), None)




def test_status_record_rates_links_and_epoch(model_dir: Path, index_url: str) -> None:
    pc = RecordingPC()
    before = int(time.time() * 1000)
    with BackgroundServer(pc.app()) as server, \
            Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                                warmup_tokens=0)) as a, \
            Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                                pc_url=server.url, status_ttl_ms=300, warmup_tokens=16)) as b:
        first = wait_until(lambda: pc.first(lambda body: True), timeout=5.0, what="a status record")
        assert first["instance"] == b.url
        assert before <= first["epoch"] <= int(time.time() * 1000)
        assert first["ttl_ms"] == 300 and first["state"] == "active"
        assert first["prefill_tokens_per_s"] > 0 and first["decode_tokens_per_s"] > 0
        path_id = pc.records[0][0]
        assert path_id == instance_id(b.url) == pc_instance_id(b.url)

        prompt = list(range(3, 3 + 128))
        assert httpx.post(a.url + "generate", json={"tokens": prompt, "max_new_tokens": 1},
                          timeout=60).status_code == 200
        out = httpx.post(b.url + "generate", json={"tokens": prompt + [9, 9], "max_new_tokens": 1},
                         timeout=60).json()
        assert out["sources"]["http"] == 8
        linked = wait_until(lambda: pc.first(lambda body: any(link["holder"] == a.url for link in body["links"])),
                            timeout=5.0, what="a status record with a link to a")
        link = next(link for link in linked["links"] if link["holder"] == a.url)
        assert link["mbit_per_s"] > 0 and link["rtt_us"] > 0
        assert all(body["epoch"] == first["epoch"] for _, body in pc.records)
        times = len(pc.records)
        time.sleep(0.35)
        assert len(pc.records) >= times + 2  # every ttl/3


def test_sleep_request_drain_and_sleep(model_dir: Path) -> None:
    def decide(body: dict) -> str:
        if body["requested_state"] == "sleeping":
            return "draining"  # accepted (§6.3)
        return body["state"]

    pc = RecordingPC(decide)
    with BackgroundServer(pc.app()) as server, \
            Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), pc_url=server.url,
                                status_ttl_ms=150, sleep_after_s=0.1, warmup_tokens=0)) as a:
        wait_until(lambda: pc.first(lambda body: body["requested_state"] == "sleeping"), timeout=5.0,
                   what="a status record requesting sleep")
        wait_until(lambda: pc.first(lambda body: body["state"] == "sleeping"), timeout=5.0,
                   what="a status record of a sleeping instance")
        assert a.engine.state == "sleeping"
        r = httpx.post(a.url + "generate", json={"tokens": [5, 6], "max_new_tokens": 1})
        assert r.status_code == 503 and r.json()["type"] == "urn:kvsp:problem:kvsp-not-active"


async def test_an_answer_to_an_older_record_does_not_undo_a_state_change() -> None:
    """The PC sets the instance active while a record saying "sleeping" is on its way: the
    answer to that record ("sleeping") must not put the instance back to sleep."""
    state = {"now": "sleeping"}
    answered = asyncio.Event()
    release = asyncio.Event()

    class SlowClient:
        async def put(self, url: str, json: dict, headers: dict, timeout: float) -> httpx.Response:
            answered.set()
            await release.wait()
            return httpx.Response(200, json={"state": json["state"]},
                                  request=httpx.Request("PUT", url))

    reporter = StatusReporter(pc_url="http://pc/", instance_url=lambda: "http://me/",
                              client=SlowClient(), meters=Meters(), running=lambda: 0,
                              queued=lambda: 0, get_state=lambda: state["now"],
                              set_state=lambda s: state.update(now=s), epoch=1)
    report = asyncio.ensure_future(reporter.report())
    await answered.wait()
    state["now"] = "active"  # PUT state from the PC, meanwhile
    release.set()
    assert await report == "sleeping"
    assert state["now"] == "active"
    # Without a change meanwhile the PC's answer is adopted.
    state["now"] = "draining"

    class Refusing(SlowClient):
        async def put(self, url: str, json: dict, headers: dict, timeout: float) -> httpx.Response:
            return httpx.Response(200, json={"state": "active"}, request=httpx.Request("PUT", url))

    reporter.client = Refusing()
    assert await reporter.report() == "active" and state["now"] == "active"


def test_a_link_whose_rate_changes_is_believed_at_once_and_noise_is_averaged() -> None:
    meters = Meters()
    holder = "http://198.18.0.3:8900/"
    mb = 1 << 20
    meters.transfer(holder, 8 * mb, 8 * mb * 8 / 250e6)  # 250 Mbit/s
    meters.transfer(holder, 8 * mb, 8 * mb * 8 / 200e6)  # within a factor of two: averaged
    (link,) = meters.links()
    assert link.mbit_per_s == round(0.7 * 250 + 0.3 * 200, 1)
    meters.transfer(holder, 8 * mb, 8 * mb * 8 / 50e6)  # the path dropped to 50 Mbit/s
    assert meters.links()[0].mbit_per_s == 50.0
    meters.transfer(holder, 8 * mb, 8 * mb * 8 / 400e6)  # and came back faster
    assert meters.links()[0].mbit_per_s == 400.0
