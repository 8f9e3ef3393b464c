"""Fixtures of the agent tests: the tiny model, built once, and an Index Service per module."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from agent.tiny import ensure_tiny_model
from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.web import BackgroundServer


def tokens(n: int, seed: int) -> list[int]:
    """Deterministic token ids in the tiny model's vocabulary (ids 0-2 are special)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4096, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")


@pytest.fixture(scope="module")
def index_url() -> Iterator[str]:
    with BackgroundServer(create_index_app(IndexSettings())) as server:
        yield server.url
