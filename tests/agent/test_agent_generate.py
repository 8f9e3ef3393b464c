"""The agent's load path end to end: a prefix computed by one agent, loaded over HTTP by another
while its model runs, gives the logits and tokens of a full recompute; a source that breaks
mid-load is made up for by another replica or by recomputation, with the same result."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agent.model import ModelAdapter
from agent.pool import KVPool, block_container
from agent.service import Agent, AgentSettings
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.protocol.container import Container
from kvsp_moq.web import BackgroundServer
from tests.agent.conftest import tokens

B = 16
PROMPT = 128
SUFFIX = 40
NEW = 8




@pytest.fixture(scope="module")
def reference(model_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(model_dir)



def settings(model_dir: Path, index_url: str, **kw: object) -> AgentSettings:
    return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                         block_tokens=B, warmup_tokens=0, keep_first_logits=True,
                         **kw)  # type: ignore[arg-type]


def generate(url: str, toks: list[int], n: int = NEW, **extra: object) -> dict:
    r = httpx.post(url + "generate", json={"tokens": toks, "max_new_tokens": n, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def first_logits(agent: Agent, session: str) -> torch.Tensor:
    logits = agent.engine.sessions[session].first_logits
    assert logits is not None
    return logits


def assert_same_as_recompute(reference: ModelAdapter, agent: Agent, toks: list[int], out: dict) -> None:
    full = reference.prefill(toks, return_kv=False).logits
    diff = (first_logits(agent, out["session"]) - full).abs().max().item()
    assert diff <= 1e-5, diff
    assert out["tokens"] == reference.generate_greedy(toks, len(out["tokens"]))


# ------------------------------------------------------------------ pool


def test_pool_places_blocks_by_key_and_exports_kvb1() -> None:
    pool = KVPool(num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu",
                  block_tokens=4, blocks=["a", "b"])
    blocks = [[(torch.randn(4, 2, 4), torch.randn(4, 2, 4)) for _ in range(3)] for _ in range(2)]
    for slot in (1, 0):  # any order: block i lands at rows [4i, 4i + 4)
        container = Container(block_container(blocks[slot]))
        assert (container.first_layer, container.layer_count, container.token_count) == (0, 3, 4)
        for layer in container.layers():
            pool.place(pool.slots["ab"[slot]], layer.index, layer.k, layer.v)
    for layer, (k, v) in enumerate(pool.prefix(2)):
        assert torch.equal(k, torch.cat([blocks[0][layer][0], blocks[1][layer][0]]))
        assert torch.equal(v, torch.cat([blocks[0][layer][1], blocks[1][layer][1]]))
    assert pool.export_block(1) == block_container(blocks[1])
    with pytest.raises(ValueError):
        pool.place(0, 0, b"\0" * 8, b"\0" * 8)


# ------------------------------------------------------------------ load over HTTP


def test_prefix_loaded_over_http_equals_recompute(model_dir: Path, index_url: str,
                                                  reference: ModelAdapter) -> None:
    prompt, suffix = tokens(PROMPT, 1), tokens(SUFFIX, 2)
    with Agent(settings(model_dir, index_url)) as a, Agent(settings(model_dir, index_url)) as b:
        first = generate(a.url, prompt, 2)
        assert first["cached_tokens"] == 0
        assert first["sources"]["recompute"] == PROMPT // B
        assert first["tokens"] == reference.generate_greedy(prompt, 2)

        out = generate(b.url, prompt + suffix, timeline=True)
        assert out["cached_tokens"] == PROMPT
        assert out["sources"]["http"] == PROMPT // B
        assert out["sources"]["recompute"] == SUFFIX // B
        assert out["load"]["failures"] == []
        assert_same_as_recompute(reference, b, prompt + suffix, out)
        spans = out["timeline"]
        assert [s["layer"] for s in spans] == list(range(reference.num_layers))
        for s in spans:  # each layer computes only after its load ended
            assert s["compute"][0] >= s["load"][1]

        # B keeps the blocks it loaded, the same octets as A's (same replica digests), so a
        # repeat on B finds them local.
        digests_a = {e.id.block_key: e.meta.digest for e in a.context.store.blocks()}
        digests_b = {e.id.block_key: e.meta.digest for e in b.context.store.blocks()}
        assert len(digests_a) == PROMPT // B
        assert {k: digests_b.get(k) for k in digests_a} == digests_a
        repeat = generate(b.url, prompt + suffix)
        assert repeat["sources"].get("local") == (PROMPT + SUFFIX) // B
        assert repeat["tokens"] == out["tokens"]

        # B stored and published the suffix block it computed; A now loads B's block too.
        again = generate(a.url, prompt + suffix)
        assert again["cached_tokens"] == PROMPT + SUFFIX // B * B
        assert again["sources"].get("local") == PROMPT // B
        assert again["sources"]["http"] == SUFFIX // B
        assert again["tokens"] == out["tokens"]


# ------------------------------------------------------------------ failing sources


class CuttingProxy:
    """Forwards to an agent; block bodies of the chosen keys stop halfway and the connection drops."""

    def __init__(self) -> None:
        self.target = ""
        self.cut: set[str] = set()
        self.cuts = 0
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def forward(request: Request) -> Response:
            path = request.url.path
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.request(request.method, self.target + path.lstrip("/"),
                                         params=request.query_params, content=await request.body(),
                                         headers={k: val for k, val in request.headers.items()
                                                  if k.lower() not in ("host", "content-length")})
            headers = {k: val for k, val in r.headers.items()
                       if k.lower() in ("content-type", "repr-digest", "location", "cache-control")}
            key = path.rstrip("/").rsplit("/", 1)[-1]
            if request.method == "GET" and "/blocks/" in path and key in self.cut and r.status_code == 200:
                with self.lock:
                    self.cuts += 1
                body = r.content
                headers["content-length"] = str(len(body))

                async def half() -> object:
                    yield body[:len(body) // 2]
                    await asyncio.sleep(0.01)
                    raise ConnectionResetError("cut")

                return StreamingResponse(half(), status_code=200, headers=headers)
            return Response(r.content, status_code=r.status_code, headers=headers)

        return Starlette(routes=[Route("/{path:path}", forward,
                                       methods=["GET", "HEAD", "POST", "PUT", "DELETE"])])


def test_source_cut_mid_load_is_recomputed(model_dir: Path, index_url: str,
                                           reference: ModelAdapter) -> None:
    proxy = CuttingProxy()
    prompt, suffix = tokens(PROMPT, 3), tokens(SUFFIX, 4)
    with BackgroundServer(proxy.app()) as proxy_server, \
            Agent(settings(model_dir, index_url, public_url=proxy_server.url)) as a, \
            Agent(settings(model_dir, index_url)) as b:
        proxy.target = a._server.url  # type: ignore[union-attr]
        generate(a.url, prompt, 1)
        keys = [k.hex() for k in a.engine.sessions[next(iter(a.engine.sessions))].sequence.chain.keys]
        proxy.cut = {keys[3]}  # block 3 breaks: blocks 0-2 load, the rest is recomputed
        out = generate(b.url, prompt + suffix)
        assert proxy.cuts >= 1
        assert out["cached_tokens"] == 3 * B
        assert out["load"]["failures"] and out["load"]["failures"][0]["block_key"] == keys[3]
        assert out["sources"]["http"] == 3
        assert_same_as_recompute(reference, b, prompt + suffix, out)


def test_broken_source_falls_back_to_another_replica(model_dir: Path, index_url: str,
                                                     reference: ModelAdapter) -> None:
    proxy = CuttingProxy()
    prompt, suffix = tokens(PROMPT, 5), tokens(SUFFIX, 6)
    with Holder(HolderSettings(listen="127.0.0.1:0", index_url=index_url)) as holder, \
            BackgroundServer(proxy.app()) as proxy_server, \
            Agent(settings(model_dir, index_url, public_url=proxy_server.url,
                           replicate_to=[holder.url])) as a, \
            Agent(settings(model_dir, index_url)) as b:
        proxy.target = a._server.url  # type: ignore[union-attr]
        generate(a.url, prompt, 1)
        keys = [k.hex() for k in a.engine.sessions[next(iter(a.engine.sessions))].sequence.chain.keys]
        deadline = 100
        for _ in range(deadline):  # the copies at the holder are published by the holder itself
            if all(holder.publisher.is_published(bid) for bid in [e.id for e in holder.store.blocks()]) \
                    and len(holder.store) == PROMPT // B:
                break
            threading.Event().wait(0.05)
        assert len(holder.store) == PROMPT // B
        proxy.cut = set(keys)  # every block body from A breaks halfway
        out = generate(b.url, prompt + suffix)
        assert proxy.cuts >= 1
        assert out["cached_tokens"] == PROMPT
        assert out["sources"]["http"] == PROMPT // B
        assert any(f["source"] == proxy_server.url for f in out["load"]["failures"])
        assert_same_as_recompute(reference, b, prompt + suffix, out)


def test_dead_holder_is_recomputed(model_dir: Path, index_url: str, reference: ModelAdapter) -> None:
    prompt, suffix = tokens(PROMPT, 7), tokens(SUFFIX, 8)
    a = Agent(settings(model_dir, index_url)).start()
    try:
        generate(a.url, prompt, 1)
    finally:
        a.stop()  # its records stay in the index until they expire; its holder is gone
    with Agent(settings(model_dir, index_url)) as b:
        out = generate(b.url, prompt + suffix)
        assert out["cached_tokens"] == 0
        assert out["sources"]["recompute"] == (PROMPT + SUFFIX) // B
        assert out["load"]["failures"]
        assert_same_as_recompute(reference, b, prompt + suffix, out)
