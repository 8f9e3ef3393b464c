"""Live KV from vLLM: with a relay and its embedded holder, the connector publishes each saved
block's layer l over MOQT as `save_kv_layer` hands it over, and stores the block from those
layers. Subscribers that asked for the block tracks before the request (the relay holds their
SUBSCRIBE until the engine produces them) receive every layer, each checked against the digest
it carries, byte for byte the stored block; the complete records replace the in-production
ones, and a restarted engine loads the blocks with vLLM's greedy output unchanged."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx

from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import LIVE_DIGEST, ReplicaRecord
from kvsp_moq.scope_keys import read_scope_keys
from tests_vllm.conftest import Engine, block_keys, compat_of, eventually, free_port, prompt, records_of

PROMPT = prompt(110, seed=7)  # 3 complete blocks before the last token
LAYERS = 8  # the tiny model's


def _subscribe(records: list[ReplicaRecord], out: dict[str, Any], ready: threading.Event) -> None:
    """On a thread of its own: one subscription per block, each collecting its layers."""

    async def run() -> None:
        fetcher = MoqtBlockFetcher(verify=False, timeout=30.0, layer_timeout=30.0,
                                   live_layer_timeout=30.0)
        try:
            streams = [fetcher.layers([], r, (0, LAYERS - 1), live=True) for r in records]

            async def collect(stream: Any) -> list[Any]:
                return [layer async for layer in stream]

            tasks = [asyncio.ensure_future(collect(s)) for s in streams]
            await asyncio.sleep(0.5)  # the SUBSCRIBEs are at the relay before the request
            ready.set()
            out["layers"] = await asyncio.gather(*tasks)
            out["carried"] = [dict(s.carried) for s in streams]
        except BaseException as e:  # reported to the test
            out["error"] = e
            ready.set()
        finally:
            await fetcher.aclose()

    asyncio.run(run())


def test_a_prefill_publishes_its_blocks_live(model_dir: Path, index_url: str, keys_file: Path,
                                            tmp_path: Path, reference: Any, relay: Any) -> None:
    (expected,) = reference(PROMPT)
    port = free_port()
    holder = f"http://127.0.0.1:{port}/"
    config = {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
              "holder": "embedded", "listen": f"127.0.0.1:{port}", "data": str(tmp_path / "h"),
              "relay": relay.url, "relay_timeout_s": 5.0}
    key = read_scope_keys(keys_file)["team"]
    compat, sid = compat_of(model_dir), scope_id(key).hex()
    keys = block_keys(key, compat, PROMPT)
    assert len(keys) == 3
    # What a decode instance derives from the producer's URL alone (no lookup): its tracks.
    records = [ReplicaRecord(block_key=k, compat_id=compat, scope_id=sid, holder=relay.url, codec=1,
                             size=0, digest=LIVE_DIGEST, ttl_ms=10_000, live=True, http_holder=holder,
                             moqt_namespace=BlockTrack.for_holder(compat, sid, k, holder).moqt_namespace)
               for k in keys]
    with Engine(model_dir, config) as engine:
        got: dict[str, Any] = {}
        ready = threading.Event()
        subscriber = threading.Thread(target=_subscribe, args=(records, got, ready), daemon=True)
        subscriber.start()
        assert ready.wait(30)
        [(tokens, cached)] = engine.generate([PROMPT])
        subscriber.join(60)
        assert not subscriber.is_alive() and "error" not in got, got.get("error")
        assert tokens == expected and cached == 0
        stats = engine.worker_stats()
        assert stats["live_blocks"] == 3 and stats["live_aborted"] == 0, stats
        eventually(lambda: engine.worker_stats()["saved_blocks"] == 3, "the live blocks stored")

        def complete() -> bool:  # the complete records replaced the in-production ones
            found = records_of(index_url, sid, compat, keys)
            return all(rs and not any(r.live for r in rs) and all(r.layer_digests for r in rs)
                       for rs in found)

        eventually(complete, "complete records of the three blocks")
        for k, layers, carried in zip(keys, got["layers"], got["carried"]):
            r = httpx.get(f"{holder}blocks/{compat}/{sid}/{k}", timeout=10)
            assert r.status_code == 200
            stored = Container(r.content)
            assert len(layers) == LAYERS
            for i, layer in enumerate(layers):
                assert (bytes(layer.k), bytes(layer.v)) == (bytes(stored.layer(i).k),
                                                           bytes(stored.layer(i).v))
            assert carried == dict(enumerate(stored.layer_digests()))
