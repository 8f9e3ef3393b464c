"""Check 6, the tripwire: the connector's methods match vLLM's base class, and the parts of vLLM
the connector reads are still there, shaped as it was written against (vLLM 0.32.0).

A vLLM upgrade that renames a parameter, adds an abstract method or moves a field of the
scheduler's output fails here, by name, before any engine runs. When it does, read the new
base class and `docs/vllm/README.md` (the call sequence), adapt the connector, then the pins.
Also here: the metadata is plain data, and a bad setting stops the engine with one line
naming the key.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.integrations.vllm import KVSPConnector
from kvsp_moq.integrations.vllm.metadata import KVSPMetadata, LoadSpec, RequestSpec, SaveSpec, is_plain
from tests_vllm.conftest import Engine, prompt

#: Base-class method -> its parameters, in vLLM 0.32.0, for every method the connector defines.
PINNED: dict[str, list[str]] = {
    "__init__": ["self", "vllm_config", "role", "kv_cache_config"],
    "bind_connector_metadata": ["self", "connector_metadata"],
    "build_connector_meta": ["self", "scheduler_output"],
    "build_connector_worker_meta": ["self"],
    "get_block_ids_with_load_errors": ["self"],
    "get_finished": ["self", "finished_req_ids"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "on_new_request": ["self", "request"],
    "register_kv_caches": ["self", "kv_caches"],
    "request_finished": ["self", "request", "block_ids"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "shutdown": ["self"],
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "update_connector_output": ["self", "connector_output"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "wait_for_layer_load": ["self", "layer_name"],
    "wait_for_save": ["self"],
}
ABSTRACT = {"build_connector_meta", "get_num_new_matched_tokens", "save_kv_layer", "start_load_kv",
            "update_state_after_alloc", "wait_for_layer_load", "wait_for_save"}
#: Methods of the connector that are not vLLM's.
OURS = {"stats"}


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_the_connector_matches_the_base_class() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as Base

    assert issubclass(KVSPConnector, Base)
    assert set(Base.__abstractmethods__) == ABSTRACT, (
        f"vLLM's abstract methods changed: {sorted(set(Base.__abstractmethods__) ^ ABSTRACT)}")
    assert not KVSPConnector.__abstractmethods__
    defined = {n for n in vars(KVSPConnector) if not n.startswith("_") or n == "__init__"}
    assert defined - OURS == set(PINNED), sorted(defined ^ set(PINNED))
    for name, pinned in PINNED.items():
        base = getattr(Base, name)
        assert [p for p, _ in _params(base)] == pinned, f"vLLM changed {name}{inspect.signature(base)}"
        assert _params(getattr(KVSPConnector, name)) == _params(base), (
            f"KVSPConnector.{name} does not take what vLLM passes: {inspect.signature(base)}")


def test_what_the_connector_reads_from_vllm_is_there() -> None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    def fields(cls: Any) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "finished_req_ids"} <= fields(SchedulerOutput)
    assert {"req_id", "prompt_token_ids", "block_ids", "num_computed_tokens"} <= fields(NewRequestData)
    assert {"req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"} <= fields(CachedRequestData)
    assert {"invalid_block_ids", "finished_recving", "kv_connector_worker_meta"} <= fields(KVConnectorOutput)
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # update_state_after_alloc's blocks

    assert callable(KVCacheBlocks.get_block_ids)
    assert {"kv_connector_extra_config", "kv_role", "kv_load_failure_policy",
            "kv_connector_module_path"} <= set(KVTransferConfig.model_fields if hasattr(
                KVTransferConfig, "model_fields") else fields(KVTransferConfig))
    source = inspect.getsource(Request.__init__)
    assert "self.request_id" in source and "self.prompt_token_ids" in source


def test_metadata_is_plain_data(model_dir: Path, index_url: str, keys_file: Path) -> None:
    """Every step's metadata, through a cold and a warm request: ints, strings, and records as
    the JSON text the IS sent (parsed again on the worker)."""
    seen: list[KVSPMetadata] = []
    with Engine(model_dir, {"index": index_url, "scope_keys": str(keys_file), "scope": "team"}) as e:
        side = e.scheduler_connector._scheduler
        build = side.build

        def spy(output: Any) -> KVSPMetadata:
            meta = build(output)
            seen.append(meta)
            return meta

        side.build = spy
        tokens = prompt(110, seed=13)
        e.generate([tokens])
        e.generate([tokens])
    loads = [s for m in seen for r in m.requests for s in r.loads]
    saves = [s for m in seen for r in m.requests for s in r.saves]
    assert len(loads) == 3 and len(saves) == 3
    for meta in seen:
        assert is_plain(meta), meta
    for load in loads:
        assert all(isinstance(json.loads(text), dict) for text in load.records)
    assert not is_plain(RequestSpec("r", "s", (LoadSpec(1, "k", (object(),)),)))  # type: ignore[arg-type]
    assert is_plain(RequestSpec("r", "s", (), (SaveSpec(1, "k"),)))


@pytest.mark.parametrize(("extra", "key"), [
    ({"relay": "http://x:1"}, "relay"),
    ({"holdr": "embedded"}, "holdr"),
    ({"lease_ms": 0}, "lease_ms"),
])
def test_a_bad_setting_stops_the_engine_naming_the_key(model_dir: Path, index_url: str,
                                                       extra: dict[str, Any], key: str) -> None:
    with pytest.raises(Exception) as caught:
        Engine(model_dir, {"index": index_url, **extra})
    text = str(caught.value)
    chain = caught.value
    while chain is not None and f"kv_connector_extra_config: {key}:" not in str(chain):
        chain = chain.__cause__ or chain.__context__
    assert chain is not None, text
    assert "\n" not in str(chain)


def test_a_sliding_window_model_is_refused_at_start(model_dir: Path, index_url: str,
                                                    tmp_path: Path) -> None:
    """A model whose cache is not all full-attention KV (here the tiny model as a Mistral with a
    window shorter than its context) stops the engine at start with one line: a cache hit would
    not equal a recompute."""
    import shutil

    model = tmp_path / "windowed"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update({"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                   "sliding_window": 64})
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as caught:
        Engine(model, {"index": index_url})
    chain: BaseException | None = caught.value
    while chain is not None and "sliding-window" not in str(chain):
        chain = chain.__cause__ or chain.__context__
    assert chain is not None, str(caught.value)
    assert "cannot be cached by KVSP" in str(chain) and "\n" not in str(chain)
