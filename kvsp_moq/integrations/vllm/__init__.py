"""KVSP inside vLLM: a KV connector (vLLM 0.32, `KVConnectorBase_V1`).

    vllm serve MODEL_DIR --kv-transfer-config '{"kv_connector": "KVSPConnector",
        "kv_connector_module_path": "kvsp_moq.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"index": "http://IS/", "holder": "embedded"}}'

Modules by job: `config` (kv_connector_extra_config), `descriptor` (the Compatibility
Descriptor from the engine's model directory, as `kvsp agent` computes it), `scheduler`
(lookups, per-step plans), `metadata` (plain data to the workers), `worker` (loads and saves),
`layout` (paged cache <-> kvsp-layout-1), `transport` (the library's load path), `publish`
(embedded holder or PUT), `connector` (the class vLLM instantiates).

`KVSPConnector` is resolved on first access, so `config` and `layout` import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVSPConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVSPConnector":
        from kvsp_moq.integrations.vllm.connector import KVSPConnector

        return KVSPConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
