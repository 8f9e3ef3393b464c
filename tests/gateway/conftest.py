"""A PC, an Index Service and two tiny-model agents on 127.0.0.1, with the gateway in front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from agent.service import Agent, AgentSettings
from agent.tiny import ensure_tiny_model
from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.gateway.app import GatewaySettings, create_app
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
    app: object

    @property
    def v1(self) -> str:
        return self.gateway + "v1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    db = tmp_path_factory.mktemp("gateway-pc") / "pc.sqlite3"
    with BackgroundServer(create_index_app(IndexSettings())) as index, \
            BackgroundServer(create_pc_app(PCSettings(database=str(db),
                                                      index_url=index.url))) as pc:
        agents = [Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                                      warmup_tokens=0, index_url=index.url,
                                      pc_url=pc.url)).start() for _ in range(2)]
        try:
            app = create_app(GatewaySettings(pc_url=pc.url, model_dir=model_dir, block_tokens=B,
                                             default_max_tokens=8))
            with BackgroundServer(app) as gateway:
                yield Stack(model_dir, index.url, pc.url, agents, gateway.url, app)
        finally:
            for a in agents:
                a.stop()
