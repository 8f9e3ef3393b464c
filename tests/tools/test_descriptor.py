"""`kvsp descriptor`: the descriptor, and so the Compatibility ID, that the agent itself uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent.model import ModelAdapter, load_model
from agent.service import AgentSettings
from agent.tiny import ensure_tiny_model
from kvsp_moq.cli import main
from kvsp_moq.protocol.compat import CompatDescriptor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny" / "tiny")


def kvsp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # not what the test itself printed (transformers' progress bars)
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def agent_compat(adapter: ModelAdapter, block_tokens: int) -> str:
    """As agent/engine.py computes it."""
    return CompatDescriptor.from_dict(adapter.descriptor(block_tokens)).compat_hex


def test_descriptor_of_a_directory_is_the_adapters(capsys, model_dir: Path, tmp_path: Path) -> None:
    adapter = ModelAdapter.load(model_dir)
    rc, out, err = kvsp(capsys, "descriptor", str(model_dir))
    assert rc == 0 and err == ""
    assert json.loads(out) == adapter.descriptor(16)
    path = tmp_path / "d.json"
    assert kvsp(capsys, "descriptor", str(model_dir), "--out", str(path))[:2] == (0, "")
    rc, out, _ = kvsp(capsys, "compat-id", str(path))
    assert out.strip() == agent_compat(adapter, 16)
    rc, out, _ = kvsp(capsys, "descriptor", str(model_dir), "--out", str(path))
    assert rc == 2
    rc, out, _ = kvsp(capsys, "descriptor", str(model_dir), "--block-tokens", "64", "--compat-id")
    assert out.strip() == agent_compat(adapter, 64)


def test_tiny_under_data_is_what_kvsp_agent_uses(capsys, model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    # The agent makes tiny under DATA/models/tiny; a copy of the same model saves making it again.
    shutil.copytree(model_dir, data / "models" / "tiny")
    settings = AgentSettings(model="tiny", data_dir=data, dtype="bfloat16", block_tokens=32)
    agent = load_model(settings)
    rc, out, err = kvsp(capsys, "descriptor", "tiny", "--data", str(data), "--dtype", "bfloat16",
                        "--block-tokens", "32")
    assert rc == 0 and err == ""
    descriptor = json.loads(out)
    assert descriptor == agent.descriptor(32)
    assert descriptor["model"] == "llama-tiny" and descriptor["kv_dtype"] == "bfloat16"
    rc, out, _ = kvsp(capsys, "descriptor", "tiny", "--data", str(data), "--dtype", "bfloat16",
                      "--block-tokens", "32", "--compat-id")
    assert out.strip() == agent_compat(agent, settings.block_tokens)


def test_refusals_are_one_line(capsys, tmp_path: Path) -> None:
    rc, _, err = kvsp(capsys, "descriptor", str(tmp_path / "missing"))
    assert rc == 2 and err.count("\n") == 1 and "not a model directory" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = kvsp(capsys, "descriptor", str(tmp_path / "empty"))
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err


def test_descriptor_from_the_files_alone_is_the_adapters(model_dir: Path, tmp_path: Path) -> None:
    """`model_descriptor` reads the config and hashes the files without loading weights; the
    agent's adapter, `kvsp descriptor` and the vLLM connector all call it."""
    from kvsp_moq.model_descriptor import load_config, model_descriptor

    adapter = ModelAdapter.load(model_dir)
    assert model_descriptor(model_dir, dtype="float32", block_tokens=32) == adapter.descriptor(32)
    assert model_descriptor(model_dir, dtype="float32", block_tokens=32,
                            config=load_config(model_dir)) == adapter.descriptor(32)
    # the name is the directory's: another directory with the same files is another model name
    other = tmp_path / "elsewhere"
    shutil.copytree(model_dir, other)
    assert model_descriptor(other, dtype="float32", block_tokens=32)["model"] == "llama-elsewhere"
    with pytest.raises(ValueError):
        model_descriptor(model_dir, dtype="float33", block_tokens=32)
    with pytest.raises(ValueError):
        model_descriptor(model_dir, dtype="float32", block_tokens=0)
