"""A vLLM engine in the Placement Controller (KVSP §6.3): with `pc` and `instance_url` its
connector reports an Instance Status Record under its OpenAI URL, with the requests it runs and
the prefill rate it measured, so that the PC routes to it as to an agent."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from tests_vllm.conftest import Engine, eventually, prompt

OPENAI_URL = "http://127.0.0.1:18080/"


def instances(pc_url: str) -> list[dict]:
    return httpx.get(pc_url + "instances", timeout=5).json()["instances"]


def test_a_vllm_engine_reports_to_the_pc_and_is_routed_to(model_dir: Path, index_url: str,
                                                          tmp_path: Path) -> None:
    app = create_pc_app(PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index_url,
                                   sweep_interval_s=0.05))
    with BackgroundServer(app) as pc, \
            Engine(model_dir, {"index": index_url, "pc": pc.url, "instance_url": OPENAI_URL,
                               "status_ttl_ms": 5000}) as engine:
        listed = eventually(lambda: [i for i in instances(pc.url) if i["instance"] == OPENAI_URL],
                            "the engine's status at the PC")
        assert listed[0]["state"] == "active" and listed[0]["reported_state"] == "active"
        engine.generate([prompt(256, 1)])
        rated = eventually(lambda: [i for i in instances(pc.url) if i["instance"] == OPENAI_URL
                                    and i["prefill_tokens_per_s"] > 0], "a measured prefill rate")
        assert rated[0]["running"] == 0 and rated[0]["queued"] == 0
        # The PC routes a prompt to it (the only instance) by the §6.4 cost.
        r = httpx.post(pc.url + "route", json={"block_keys": ["ab" * 32], "token_count": 256,
                                               "scope_id": "00" * 16, "compat_id": "cd" * 32},
                       timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["instance"] == OPENAI_URL


def test_pc_needs_instance_url(model_dir: Path, index_url: str) -> None:
    import pytest

    with pytest.raises(Exception) as caught:
        Engine(model_dir, {"index": index_url, "pc": "http://127.0.0.1:9/"})
    chain: BaseException | None = caught.value
    while chain is not None and "kv_connector_extra_config: instance_url:" not in str(chain):
        chain = chain.__cause__ or chain.__context__
    assert chain is not None, str(caught.value)


def test_the_engines_status_carries_the_links_its_workers_loaded_over(
        model_dir: Path, index_url: str, tmp_path: Path) -> None:
    """The workers load, the scheduler reports: each step's link measurements reach the status
    as vLLM's connector worker metadata, and the PC lists the holder's rate (KVSP §6.3)."""
    app = create_pc_app(PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index_url,
                                   sweep_interval_s=0.05))
    tokens = prompt(256, 2)
    with BackgroundServer(app) as pc, \
            Engine(model_dir, {"index": index_url, "pc": pc.url, "instance_url": OPENAI_URL,
                               "status_ttl_ms": 5000}) as engine:
        first = engine.generate([tokens])  # computed and stored at its embedded holder
        holder = engine.worker_stats()["holder"]
        eventually(lambda: engine.worker_stats()["saved_blocks"] >= 7, "the blocks stored")
        again = engine.generate([tokens])  # loaded from there
        assert again[0][0] == first[0][0] and again[0][1] == 7 * 32
        listed = eventually(lambda: [i for i in instances(pc.url) if i["instance"] == OPENAI_URL
                                     and i.get("links")], "the engine's links at the PC")
        [link] = listed[0]["links"]
        assert link["holder"] == holder and link["mbit_per_s"] > 0 and link["rtt_us"] > 0, link
