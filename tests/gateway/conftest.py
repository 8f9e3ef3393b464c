"""A PC, an Index Service and two tiny-model agents on 127.0.0.1, with the gateway in front."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent.service import Agent, AgentSettings
from agent.tiny import ensure_tiny_model
from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.gateway.app import GatewaySettings, create_app
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app

B = 16


@dataclass
class Stack:
    model_dir: Path
    index: str
    pc: str
    agents: list[Agent]
    gateway: str
    app: Any

    @property
    def v1(self) -> str:
        return self.gateway + "v1"


@contextlib.contextmanager
def make_stack(model_dir: Path, db: Path, *, pc: dict[str, Any] | None = None,
               holder: bool = False, dead_pc: bool = False, **agent: Any) -> Iterator[Stack]:
    """Index, PC, two agents (`agent`: more AgentSettings) and the gateway, stopped after;
    with `holder`, a holder the agents replicate their blocks to; with `dead_pc`, the
    gateway's first PC URL is another PC's, stopped before the gateway starts."""
    with contextlib.ExitStack() as stack:
        index = stack.enter_context(BackgroundServer(create_index_app(IndexSettings())))
        if holder:
            h = stack.enter_context(Holder(HolderSettings(listen="127.0.0.1:0",
                                                          index_url=index.url)))
            agent["replicate_to"] = [h.url]
        pc_app = create_pc_app(PCSettings(database=str(db), index_url=index.url, **(pc or {})))
        pc_server = stack.enter_context(BackgroundServer(pc_app))
        agents = []
        for _ in range(2):
            a = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                                    warmup_tokens=0, index_url=index.url, pc_url=pc_server.url,
                                    **agent)).start()
            stack.callback(a.stop)
            agents.append(a)
        pc_urls = pc_server.url
        if dead_pc:
            with BackgroundServer(create_pc_app(PCSettings(database=str(db) + ".dead"))) as dead:
                pc_urls = f"{dead.url},{pc_server.url}"
        app = create_app(GatewaySettings(pc_url=pc_urls, model_dir=model_dir,
                                         block_tokens=B, default_max_tokens=8))
        gateway = stack.enter_context(BackgroundServer(app))
        yield Stack(model_dir, index.url, pc_server.url, agents, gateway.url, app)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with make_stack(model_dir, tmp_path_factory.mktemp("gateway-pc") / "pc.sqlite3") as s:
        yield s
