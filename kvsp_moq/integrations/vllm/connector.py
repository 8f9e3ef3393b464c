"""`KVSPConnector`: KVSP as a vLLM 0.32 KV connector (`KVConnectorBase_V1`).

vLLM creates one instance per role: SCHEDULER in the engine core (lookups and per-step plans,
`scheduler.SchedulerSide`) and WORKER in each worker (loads, saves and the embedded holder,
`worker.WorkerSide`). Each method here hands over to its role's half; a method of the other
role is never called on an instance. kv_role "kv_consumer" only loads, "kv_producer" only
saves, "kv_both" does both.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvsp_moq.integrations.vllm.config import parse_extra_config
from kvsp_moq.integrations.vllm.descriptor import engine_descriptor, engine_facts
from kvsp_moq.integrations.vllm.metadata import KVSPMetadata, KVSPWorkerMetadata
from kvsp_moq.integrations.vllm.scheduler import SchedulerSide
from kvsp_moq.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvsp.vllm")

__all__ = ["KVSPConnector"]


class KVSPConnector(KVConnectorBase_V1):
    """Prefix blocks looked up in a KVSP Index Service, loaded layer by layer from holders (MOQT
    through a relay first, HTTP otherwise), and the prompt blocks computed here published."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = parse_extra_config(transfer.kv_connector_extra_config)
        kv_role = transfer.kv_role or "kv_both"
        load = kv_role in ("kv_both", "kv_consumer")
        save = kv_role in ("kv_both", "kv_producer")
        self.facts = engine_facts(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            descriptor = engine_descriptor(self.facts)
            self._scheduler = SchedulerSide(self.config, descriptor, load=load, save=save)
            log.info("KVSP connector (scheduler): compat %s, scope %s, index %s",
                     descriptor.compat_hex, self.config.scope, self.config.index)
        else:
            self._worker = WorkerSide(self.config, self.facts, load=load, save=save)

    # ---------------------------------------------------------------- both roles

    def stats(self) -> dict[str, Any]:
        """This role's counters: lookups and hits (scheduler); blocks loaded by transport,
        load errors and saves (worker). RequestOutput.num_cached_tokens still counts a load
        that failed and was recomputed, so hits are counted here."""
        if self._scheduler is not None:
            return dict(self._scheduler.stats)
        assert self._worker is not None
        return self._worker.snapshot()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # ---------------------------------------------------------------- scheduler role

    def on_new_request(self, request: "Request") -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, num_external_tokens, blocks)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            self._scheduler.connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request)

    # ---------------------------------------------------------------- worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata if isinstance(connector_metadata, KVSPMetadata)
                              else None)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is ever sent asynchronously (saves copy out at once); the requests whose
        asynchronous load ended are received."""
        assert self._worker is not None
        return None, self._worker.finished_loads(finished_req_ids)

    def build_connector_worker_meta(self) -> KVSPWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.link_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()
