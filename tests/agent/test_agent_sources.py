"""Block sources in order (DESIGN §5): MOQT first through the agent's relay, HTTP as the fallback,
recomputation last; any `LayerSource` plugs in the same way."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.sources import LayerTuple
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.protocol.records import ReplicaRecord
from tests.agent.conftest import tokens

B = 16
PROMPT = 128




@pytest.fixture(scope="module")
def reference(model_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(model_dir)



def settings(model_dir: Path, index_url: str, **kw: Any) -> AgentSettings:
    return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                         block_tokens=B, warmup_tokens=0, keep_first_logits=True, **kw)


class ViaHttp:
    """A source of kind "moqt" that reads over HTTP; it fails after `fail_after` layers."""

    kind = "moqt"
    needs_lease = True

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.fetcher: HttpFetcher | None = None
        self.layers_given = 0

    def accepts(self, record: ReplicaRecord) -> bool:
        return record.holder.startswith("http://")

    async def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]:
        if self.fetcher is None:
            self.fetcher = HttpFetcher()
        stream = self.fetcher.layers([record.holder], record, (first, last))
        try:
            async for layer in stream:
                if self.fail_after is not None and self.layers_given >= self.fail_after:
                    raise ConnectionResetError("the relay went away")
                self.layers_given += 1
                yield layer.index, layer.k, layer.v
        finally:
            await stream.aclose()


@pytest.mark.parametrize("fail_after", [None, 10])
def test_a_plugged_source_comes_first_and_http_takes_over(model_dir: Path, index_url: str,
                                                         reference: ModelAdapter,
                                                         fail_after: int | None) -> None:
    prompt = tokens(PROMPT, 41 if fail_after is None else 42)
    source = ViaHttp(fail_after)
    with Agent(settings(model_dir, index_url)) as a, \
            Agent(settings(model_dir, index_url, layer_sources=[source])) as b:
        httpx.post(a.url + "generate", json={"tokens": prompt, "max_new_tokens": 1}, timeout=60)
        out = httpx.post(b.url + "generate", json={"tokens": prompt + [7, 8], "max_new_tokens": 4},
                         timeout=60).json()
        assert out["cached_tokens"] == PROMPT
        assert source.layers_given >= 1
        if fail_after is None:
            assert out["sources"]["moqt"] == PROMPT // B and out["load"]["failures"] == []
        else:  # blocks cut short continue over HTTP from their first missing layer
            assert out["sources"]["moqt"] + out["sources"]["http"] == PROMPT // B
            assert out["sources"]["http"] >= 1
            assert {f["kind"] for f in out["load"]["failures"]} == {"moqt"}
        assert out["tokens"] == reference.generate_greedy(prompt + [7, 8], 4)


async def test_blocks_load_through_a_relay(model_dir: Path, index_url: str, reference: ModelAdapter,
                                           tmp_path: Path) -> None:
    import relay.relay as relay_mod
    from kvsp_moq.moqt.certs import generate_self_signed

    relay = await relay_mod.Relay(relay_mod.RelaySettings(certificate=generate_self_signed())).start()
    try:
        with Holder(HolderSettings(listen="127.0.0.1:0", index_url=index_url, relay=relay.url)) as holder:
            prompt, suffix = tokens(PROMPT, 43), tokens(40, 44)
            a = Agent(settings(model_dir, index_url, replicate_to=[holder.url])).start()
            b = Agent(settings(model_dir, index_url, relay=relay.url)).start()
            try:
                async with httpx.AsyncClient(timeout=60) as client:
                    await client.post(a.url + "generate", json={"tokens": prompt, "max_new_tokens": 1})
                    a.stop()  # only the holder's replicas remain: over MOQT, and over HTTP
                    for _ in range(200):  # the holder stores, announces and publishes both records
                        blocks = holder.store.blocks()
                        pairs = {(e.id.compat_id, e.id.scope_id) for e in blocks}
                        moqt = holder.moqt_publisher
                        if (len(blocks) == PROMPT // B and moqt is not None and pairs <= moqt.announced
                                and all(holder.publisher.is_published(e.id) for e in blocks)):
                            break
                        await asyncio.sleep(0.05)
                    r = await client.post(b.url + "generate", json={"tokens": prompt + suffix,
                                                                    "max_new_tokens": 4})
                out = r.json()
                assert out["cached_tokens"] == PROMPT, out
                assert out["sources"]["moqt"] == PROMPT // B, (out["sources"], out["load"]["failures"])
                assert out["load"]["failures"] == []
                assert out["tokens"] == reference.generate_greedy(prompt + suffix, 4)
                full = reference.prefill(prompt + suffix, return_kv=False).logits
                got = b.engine.sessions[out["session"]].first_logits
                assert (got - full).abs().max().item() <= 1e-5
            finally:
                a.stop()
                b.stop()
    finally:
        await relay.aclose()
