"""Live KV (DESIGN §9): an agent with a relay publishes the prompt blocks it computes layer by
layer while its forward pass runs, with in-production records in the index; another agent that
gets a request with the same prefix meanwhile subscribes to those blocks through the relay
instead of computing them, verifies each layer against the digest it carries, and answers
exactly as one instance alone would. A producer that stops, or a layer that does not match its
digest, is a failed source: the consumer computes the prefix itself, still with the same answer."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agent.live import LivePass
from agent.service import Agent, AgentSettings
from kvsp_moq.frontend import decode_at
from kvsp_moq.holder.moqt_publisher import LiveBlock, LivePassTrack
from kvsp_moq.holder.store import BlockId
from kvsp_moq.index_client import IndexClient
from kvsp_moq.moqt.wire import Properties
from kvsp_moq.naming import LAYER_DIGEST_PROPERTY, PASS_DIGESTS_PROPERTY, PASS_KEYS_PROPERTY
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import LIVE_DIGEST, ReplicaRecord
from kvsp_moq.scope_keys import OPEN_SCOPE_KEY
from relay.service import BackgroundRelay
from tests.agent.conftest import tokens
from tests.polling import wait_until

B = 16
PROMPT = 8 * B + 5
NEW = 8
SCOPE = scope_id(OPEN_SCOPE_KEY).hex()


def settings(model_dir: Path, index_url: str, relay: str, **kw: Any) -> AgentSettings:
    kw.setdefault("choose_by_cost", False)
    kw.setdefault("warmup_tokens", 0)
    return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url, relay=relay,
                         relay_timeout_s=5.0, block_tokens=B, **kw)


def lookup(index_url: str, compat: str, keys: list[str]) -> list[list[ReplicaRecord]]:
    async def look() -> list[list[ReplicaRecord]]:
        async with IndexClient(index_url) as index:
            result = await index.lookup(SCOPE, compat, keys)
            return [list(b.replicas) for b in result.blocks[:result.matched]]
    import asyncio
    return asyncio.run(look())


def live_records(index_url: str, compat: str, keys: list[str]) -> list[list[ReplicaRecord]]:
    """The index's replicas of `keys` once every one has an in-production record (bounded)."""
    return wait_until(lambda: (lambda rs: rs if len(rs) == len(keys) and all(
        any(r.live for r in rep) for rep in rs) else None)(lookup(index_url, compat, keys)),
        timeout=20, what="in-production records of the blocks")


def prompt_keys(agent: Agent, prompt: list[int]) -> list[str]:
    from kvsp_moq.protocol.keys import BlockKeyChain
    chain = BlockKeyChain(OPEN_SCOPE_KEY, agent.engine.descriptor.compat_id, B)
    chain.extend(prompt)
    return [k.hex() for k in chain.keys[:len(prompt) // B]]


class Paced:
    """Slows the producer's forward pass after each layer, until released, and records what
    it saw: the pass is still running when the consumer subscribes."""

    def __init__(self, agent: Agent, *, per_layer_s: float = 0.0) -> None:
        self.release = threading.Event()
        self.layers_done = 0
        self.subscribed_while_computing = False
        self.per_layer_s = per_layer_s
        self.agent = agent
        live = agent.engine.live
        assert live is not None, "the agent has a relay: it produces live"
        original = live.open

        def open_paced(*args: Any, **kw: Any) -> LivePass | None:
            p = original(*args, **kw)
            if p is None:
                return None
            on_layer = p.on_layer

            def paced(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
                on_layer(index, k, v)
                self.layers_done = index + 1
                if index == 0:
                    # Hold the pass after layer 0 until the test lets it go on.
                    self.release.wait(30)
                elif self.per_layer_s:
                    self.release.wait(self.per_layer_s)
                moqt = agent.context.moqt_publisher
                if moqt is not None and moqt.stats.subscribes > 0:
                    self.subscribed_while_computing = True
            p.on_layer = paced  # type: ignore[method-assign]
            return p

        live.open = open_paced  # type: ignore[method-assign]


def post_async(url: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        r = httpx.post(url, json=body, timeout=90)
        out["status"], out["body"] = r.status_code, r.json()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_prefix_being_computed_streams_to_another_instance(model_dir: Path, index_url: str,
                                                            relay: BackgroundRelay) -> None:
    prompt = tokens(PROMPT, 91)
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        compat = a.context.compat_id
        keys = prompt_keys(a, prompt)
        pace = Paced(a, per_layer_s=0.2)
        ta, ra = post_async(a.url + "generate", {"tokens": prompt, "max_new_tokens": NEW})
        # A holds its pass after layer 0: every prompt block has an in-production record.
        found = live_records(index_url, compat, keys)
        record = next(r for r in found[0] if r.live)
        assert record.holder == relay.url and record.http_holder == a.url
        assert record.digest == LIVE_DIGEST and record.layer_digests is None
        wait_until(lambda: pace.layers_done == 1, timeout=20, what="A's pass holding after layer 0")
        tb, rb = post_async(b.url + "generate", {"tokens": prompt, "max_new_tokens": NEW})
        wait_until(lambda: a.context.moqt_publisher is not None and a.context.moqt_publisher.stats.subscribes > 0,
                   timeout=20, what="B subscribing to A's blocks in production")
        pace.release.set()
        ta.join(60)
        tb.join(60)
        assert ra["status"] == 200 and rb["status"] == 200, (ra, rb)
        assert pace.subscribed_while_computing
        # B loaded every prompt block it could (all but the last token's) from A's live tracks.
        assert rb["body"]["sources"]["moqt"] == len(keys)
        assert rb["body"]["sources"].get("recompute", 0) == 0
        assert ra["body"]["sources"]["recompute"] == len(keys)
        # Exactly what one instance alone answers.
        reference = a.context.adapter.generate_greedy(prompt, NEW)
        assert ra["body"]["tokens"] == rb["body"]["tokens"] == reference
        # The complete records replaced the in-production ones.
        final = wait_until(lambda: (lambda rs: rs if len(rs) == len(keys) and not any(
            r.live for rep in rs for r in rep) else None)(lookup(index_url, compat, keys)),
            timeout=20, what="the complete records")
        assert all(any(r.is_moqt and r.layer_digests for r in rep) for rep in final)


def test_a_producer_that_stops_is_a_failed_source(model_dir: Path, index_url: str,
                                                 relay: BackgroundRelay) -> None:
    """The producer's pass fails after layer 0: its live blocks are abandoned, their records
    withdrawn, and the consumer computes the prefix itself with the same answer."""
    prompt = tokens(PROMPT, 92)
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        compat = a.context.compat_id
        keys = prompt_keys(a, prompt)
        pace = Paced(a)
        ta, ra = post_async(a.url + "generate", {"tokens": prompt, "max_new_tokens": NEW})
        live_records(index_url, compat, keys)
        tb, rb = post_async(b.url + "generate", {"tokens": prompt, "max_new_tokens": NEW})
        wait_until(lambda: a.context.moqt_publisher is not None and a.context.moqt_publisher.stats.subscribes > 0,
                   timeout=20, what="B subscribing")
        # A's pass stops: its session is cancelled (as when the instance goes away).
        sid = next(iter(a.engine.sessions))
        task = a.engine.sessions[sid].task
        assert task is not None
        assert a.context.loop is not None
        a.context.loop.call_soon_threadsafe(task.cancel)
        pace.release.set()
        tb.join(60)
        ta.join(60)
        assert rb["status"] == 200, rb
        assert rb["body"]["sources"]["moqt"] == 0
        assert rb["body"]["sources"]["recompute"] == len(keys)
        assert rb["body"]["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        # B took A's pass track, which failed: it did not go on to A's blocks' own tracks (A
        # stopped producing them all), whose SUBSCRIBEs would only have waited.
        assert relay.snapshot()["subscribes"] == 1
        failures = b.engine.sessions[rb["body"]["session"]].load["failures"]
        assert any("pass track failed" in f["reason"] for f in failures), failures
        # A's in-production records are gone (B's complete ones are there).
        wait_until(lambda: not any(r.live for rep in lookup(index_url, compat, keys) for r in rep),
                   timeout=20, what="A's in-production records withdrawn")


@pytest.mark.parametrize("consumer_sorts", ["first", "after"])
def test_a_layer_that_does_not_match_its_digest_is_never_used(model_dir: Path, index_url: str,
                                                             relay: BackgroundRelay, consumer_sorts: str) -> None:
    """A live layer whose octets do not match the digest it carries (corrupted on its way, or a
    publisher at fault): the consumer refuses it (a failed source) before it enters the model,
    computes the prefix itself, and answers as one instance would. Whichever URL sorts first,
    it does not give way to that producer as a rival while it computes (it would only load the
    producer's blocks once stored)."""
    prompt = tokens(PROMPT, 93 if consumer_sorts == "first" else 95)
    with Agent(settings(model_dir, index_url, relay.url)) as x, \
            Agent(settings(model_dir, index_url, relay.url)) as y:
        b, a = sorted((x, y), key=lambda agent: agent.url, reverse=consumer_sorts == "after")
        compat = a.context.compat_id
        keys = prompt_keys(a, prompt)
        pace = Paced(a, per_layer_s=0.1)
        original = LiveBlock.properties

        def wrong_digest(self: LiveBlock, index: int) -> Properties:
            props = original(self, index)
            if index != 1:
                return props
            return tuple((t, bytes(32) if t == LAYER_DIGEST_PROPERTY else v) for t, v in props)

        original_pass = LivePassTrack.properties

        def wrong_digests(self: LivePassTrack, index: int) -> Properties:
            props = original_pass(self, index)
            if index != 1:
                return props
            return tuple((t, bytes(len(v)) if t == PASS_DIGESTS_PROPERTY else v) for t, v in props)

        LiveBlock.properties = wrong_digest  # type: ignore[method-assign]
        LivePassTrack.properties = wrong_digests  # type: ignore[method-assign]
        try:
            ta, ra = post_async(a.url + "generate", {"tokens": prompt, "max_new_tokens": NEW})
            live_records(index_url, compat, keys)
            tb, rb = post_async(b.url + "generate", {"tokens": prompt, "max_new_tokens": NEW})
            # B loading (its subscription at A, A still held before its first layer): a B that
            # came after A stored its blocks would read them with their true digests.
            wait_until(lambda: a.context.moqt_publisher is not None and a.context.moqt_publisher.stats.subscribes > 0
                       and len(b.engine._loaders) > 0, timeout=20, what="B subscribing")
            pace.release.set()
            tb.join(60)
            ta.join(60)
        finally:
            LiveBlock.properties = original  # type: ignore[method-assign]
            LivePassTrack.properties = original_pass  # type: ignore[method-assign]
        assert rb["status"] == 200, rb
        assert rb["body"]["sources"]["moqt"] == 0
        assert rb["body"]["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        failures = b.engine.sessions[rb["body"]["session"]].load["failures"]
        assert any("digest" in str(f) for f in failures), failures
        assert b.engine.live_outpaced == 0


def test_prefill_and_decode_on_two_instances(model_dir: Path, index_url: str,
                                             relay: BackgroundRelay) -> None:
    """POST prefill at A, then a generate at B with "prefill_at": A: B subscribes to A's blocks
    while A computes them, decodes, and answers exactly as one instance alone."""
    prompt = tokens(PROMPT, 94)
    # B would load a stored prefix in ranges of two layers; a live block is one subscription.
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url, layers_per_request=2)) as b:
        keys = prompt_keys(a, prompt)
        pace = Paced(a, per_layer_s=0.05)
        r = httpx.post(a.url + "prefill", json={"tokens": prompt}, timeout=30)
        assert r.status_code == 202, r.text
        # One pass track of every block ("passes"); a generate without its layout (as here)
        # takes each block's own track.
        assert r.json() == {"prompt_blocks": len(keys), "stored": 0, "live": keys,
                            "passes": [[0, len(keys)]]}
        tb, rb = post_async(b.url + "generate", {"tokens": prompt, "max_new_tokens": NEW,
                                                 "prefill_at": a.url})
        wait_until(lambda: a.context.moqt_publisher is not None
                   and a.context.moqt_publisher.stats.subscribes >= len(keys),
                   timeout=20, what="B subscribing to every block A computes")
        pace.release.set()
        tb.join(60)
        assert rb["status"] == 200, rb
        assert pace.subscribed_while_computing
        assert rb["body"]["sources"] == {"moqt": len(keys), "http": 0, "recompute": 0}
        assert rb["body"]["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        # A stored what it computed; B has every block too (loaded ones are stored).
        compat = a.context.compat_id
        wait_until(lambda: all(a.context.store.get(BlockId(compat, SCOPE, k)) for k in keys),
                   timeout=20, what="A storing its blocks")
        for k in keys:
            mine = a.context.store.get(BlockId(compat, SCOPE, k))
            theirs = b.context.store.get(BlockId(compat, SCOPE, k))
            assert theirs is not None and bytes(theirs.host.buffer) == bytes(mine.host.buffer)
        # One subscription per block, from B at the relay and from the relay at A, and one
        # copy of each layer out of A.
        assert relay.snapshot()["subscribes"] == len(keys)
        moqt = a.context.moqt_publisher
        assert moqt is not None and moqt.stats.subscribes == len(keys)
        containers = sum(a.context.store.get(BlockId(compat, SCOPE, k)).meta.size for k in keys)
        assert moqt.stats.bytes_sent <= containers  # the layers' payloads, once
        # B held A to what it sent: A's complete records list the digests the layers carried.
        wait_until(lambda: b.engine.live_audited == len(keys), timeout=20,
                   what="B comparing A's complete records with what it received")
        assert b.engine.live_mismatches == 0


@pytest.mark.parametrize("layout", ["told", "slots_swapped"])
def test_prefill_and_decode_over_the_pass_track(model_dir: Path, index_url: str, relay: BackgroundRelay,
                                                layout: str) -> None:
    """A generate that carries the producer's pass layout (`decode_at`: "prefill_passes") takes
    one subscription for the pass's blocks, not one per block, and answers as one instance
    alone. The layout came through the front end, so each slot is checked to be the block
    expected: a pass whose objects name other blocks for two slots ("slots_swapped") is a failed
    source for those two, and the prompt is computed from the first of them."""
    prompt = tokens(PROMPT, 102 if layout == "told" else 103)
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        keys = prompt_keys(a, prompt)
        pace = Paced(a, per_layer_s=0.05)
        original = LivePassTrack.properties

        def swapped(self: LivePassTrack, index: int) -> Properties:
            props = original(self, index)
            return tuple((t, v[32:64] + v[:32] + v[64:] if t == PASS_KEYS_PROPERTY else v)
                         for t, v in props)

        if layout == "slots_swapped":
            LivePassTrack.properties = swapped  # type: ignore[method-assign]
        try:
            r = httpx.post(a.url + "prefill", json={"tokens": prompt}, timeout=30)
            assert r.status_code == 202, r.text
            assert r.json()["passes"] == [[0, len(keys)]]
            tb, rb = post_async(b.url + "generate", {"tokens": prompt, "max_new_tokens": NEW,
                                                     **decode_at(a.url, r.json())})
            wait_until(lambda: a.context.moqt_publisher is not None
                       and a.context.moqt_publisher.stats.subscribes >= 1 and len(b.engine._loaders) > 0,
                       timeout=20, what="B subscribing to A's pass")
            pace.release.set()
            tb.join(60)
        finally:
            LivePassTrack.properties = original  # type: ignore[method-assign]
        assert rb["status"] == 200, rb
        assert pace.subscribed_while_computing
        assert rb["body"]["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        failures = b.engine.sessions[rb["body"]["session"]].load["failures"]
        if layout == "told":
            assert rb["body"]["sources"] == {"moqt": len(keys), "http": 0, "recompute": 0}
            assert not failures, failures
            # One subscription, from B at the relay and from the relay at A.
            assert relay.snapshot()["subscribes"] == 1
            moqt = a.context.moqt_publisher
            assert moqt is not None and moqt.stats.subscribes == 1
            wait_until(lambda: b.engine.live_audited == len(keys), timeout=20,
                       what="B comparing A's complete records with what it received")
            assert b.engine.live_mismatches == 0
        else:
            assert rb["body"]["sources"] == {"moqt": 0, "http": 0, "recompute": len(keys)}, rb["body"]
            assert sorted(f["block_key"] for f in failures if "slot" in f["reason"]) == sorted(keys[:2]), failures


def test_a_pass_after_blocks_the_producer_holds_is_laid_out_from_its_first_block(
        model_dir: Path, index_url: str, relay: BackgroundRelay) -> None:
    """The producer holds the prompt's first blocks already: its pass, and so the layout it
    answers, begins after them. The decode instance reads those blocks from their own tracks
    (stored at the producer) and the rest from the pass, with no failed source."""
    head = tokens(3 * B, 104)
    prompt = head + tokens(5 * B + 5, 105)
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        keys = prompt_keys(a, prompt)
        done = httpx.post(a.url + "generate", json={"tokens": head + [7], "max_new_tokens": 1}, timeout=60)
        assert done.status_code == 200, done.text
        r = httpx.post(a.url + "prefill", json={"tokens": prompt}, timeout=30)
        assert r.status_code == 202, r.text
        assert r.json()["stored"] == 3 and r.json()["passes"] == [[3, len(keys) - 3]], r.text
        rb = httpx.post(b.url + "generate", json={"tokens": prompt, "max_new_tokens": NEW,
                                                  **decode_at(a.url, r.json())}, timeout=60)
        assert rb.status_code == 200, rb.text
        body = rb.json()
        assert body["sources"] == {"moqt": len(keys), "http": 0, "recompute": 0}, body
        assert not b.engine.sessions[body["session"]].load["failures"]
        assert body["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        # Three block tracks and one pass track.
        assert relay.snapshot()["subscribes"] == 3 + 1


def test_a_decode_instance_does_not_give_way_over_the_block_with_its_last_token(
        model_dir: Path, index_url: str, relay: BackgroundRelay) -> None:
    """A prompt of whole blocks: the prefill instance's pass computes its last block too, and
    the decode instance computes that block as well (the last token is always computed where
    it is decoded). The decode instance does not take the prefill instance for a rival it must
    give way to, even when the prefill instance's URL sorts first: it loads every other block
    once, computes the last, and answers as one instance alone."""
    prompt = tokens(8 * B, 90)
    with Agent(settings(model_dir, index_url, relay.url)) as x, \
            Agent(settings(model_dir, index_url, relay.url)) as y:
        a, b = sorted((x, y), key=lambda agent: agent.url)  # a would win a tie-break
        keys = prompt_keys(a, prompt)
        assert len(keys) == 8
        pace = Paced(a, per_layer_s=0.05)
        r = httpx.post(a.url + "prefill", json={"tokens": prompt}, timeout=30)
        assert r.status_code == 202 and r.json()["live"] == keys, r.text
        tb, rb = post_async(b.url + "generate", {"tokens": prompt, "max_new_tokens": NEW,
                                                 "prefill_at": a.url})
        wait_until(lambda: a.context.moqt_publisher is not None
                   and a.context.moqt_publisher.stats.subscribes >= len(keys) - 1,
                   timeout=20, what="B subscribing to the blocks before its last")
        pace.release.set()
        tb.join(60)
        assert rb["status"] == 200, rb
        assert rb["body"]["sources"] == {"moqt": len(keys) - 1, "http": 0, "recompute": 1}, rb["body"]
        assert rb["body"]["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        assert b.engine.live_outpaced == 0
        moqt = a.context.moqt_publisher
        assert moqt is not None and moqt.stats.subscribes == len(keys) - 1  # each block once


def test_prefill_at_an_instance_without_relay_is_refused_or_ignored(model_dir: Path, index_url: str) -> None:
    with Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                             block_tokens=B, warmup_tokens=0)) as a:
        r = httpx.post(a.url + "prefill", json={"tokens": tokens(PROMPT, 95)}, timeout=30)
        assert r.status_code == 409 and r.json()["type"].endswith("kvsp-no-live-kv"), r.text
        # A decode instance without a relay cannot subscribe: it computes the prompt itself.
        r = httpx.post(a.url + "generate", json={"tokens": tokens(PROMPT, 95), "max_new_tokens": 1,
                                                 "prefill_at": "http://127.0.0.1:9/"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["sources"]["recompute"] == PROMPT // B


async def test_the_pc_places_prefill_and_decode_apart(model_dir: Path, index_url: str,
                                                      relay: BackgroundRelay, tmp_path: Path) -> None:
    """`kvsp index --pd length:N`: the route names a decode instance and a prefill instance; the
    front end starts both, and the tokens it delivers are those of one instance alone."""
    import asyncio

    from kvsp_moq.frontend import FrontEnd, Restart
    from kvsp_moq.scope_keys import OPEN_SCOPE
    from kvsp_moq.web import BackgroundServer
    from pc.app import PCSettings, create_pc_app
    from pc.disaggregation import SplitPolicy
    from pc.placement import ScopeKeys

    prompt = tokens(PROMPT, 96)
    pc_settings = PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index_url,
                             sweep_interval_s=0.05, pd=SplitPolicy.parse("length:64"))
    pc_app = create_pc_app(pc_settings, keys=ScopeKeys({OPEN_SCOPE: OPEN_SCOPE_KEY}))
    with BackgroundServer(pc_app) as pc, \
            Agent(settings(model_dir, index_url, relay.url, pc_url=pc.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url, pc_url=pc.url)) as b:
        agents = {a.url: a, b.url: b}
        wait_until(lambda: len(httpx.get(pc.url + "instances", timeout=5).json()["instances"]) == 2,
                   timeout=20, what="both agents reporting to the PC")
        route = {"tokens": prompt, "scope": OPEN_SCOPE, "compat_id": a.context.compat_id}
        generate = {"tokens": prompt, "max_new_tokens": NEW}
        async with FrontEnd(pc.url, timeout_s=60) as fe:
            started = await fe.start(route, generate)
            assert started.prefill is not None and started.prefill != started.instance
            assert set(agents) == {started.instance, started.prefill}
            assert started.decision["prefill"]["instance"] == started.prefill
            got = [t.token async for t in fe.stream(started.session, instance=started.instance,
                                                    max_tokens=NEW, restart=Restart(route, generate))]
        assert got == a.context.adapter.generate_greedy(prompt, NEW)
        decode = agents[started.instance].engine.sessions[started.session]
        assert decode.sources["moqt"] == len(prompt_keys(a, prompt))
        assert decode.sources.get("recompute", 0) == 0
        # The front end carried the producer's pass layout into the generate.
        assert decode.prefill_passes == ((0, len(prompt_keys(a, prompt))),)
        assert not decode.load["failures"], decode.load
        await asyncio.sleep(0)


def test_one_prefill_for_a_herd(model_dir: Path, index_url: str, relay: BackgroundRelay) -> None:
    """Three instances get requests sharing a new prefix while a fourth computes it: each finds
    the in-production records, subscribes through the relay instead of computing the prefix,
    computes only its own suffix, and answers as one instance alone. The shared blocks are
    slots of the producer's pass track: each instance takes one subscription for all of them,
    and the relay sends the producer's layers on to all three from one (DESIGN §9.6)."""
    shared = tokens(6 * B, 97)
    prompts = [shared + tokens(2 * B + 3, 200 + i) for i in range(4)]
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url, choose_by_cost=True)) as b, \
            Agent(settings(model_dir, index_url, relay.url, choose_by_cost=True)) as c, \
            Agent(settings(model_dir, index_url, relay.url, choose_by_cost=True)) as d:
        compat = a.context.compat_id
        keys = prompt_keys(a, shared)
        pace = Paced(a, per_layer_s=0.1)
        ta, ra = post_async(a.url + "generate", {"tokens": prompts[0], "max_new_tokens": NEW})
        live_records(index_url, compat, keys)
        herd = [post_async(x.url + "generate", {"tokens": p, "max_new_tokens": NEW})
                for x, p in zip((b, c, d), prompts[1:])]
        wait_until(lambda: relay.snapshot()["subscribes"] >= 3,
                   timeout=20, what="the herd subscribing to the pass track")
        pace.release.set()
        for t, _ in [(ta, ra), *herd]:
            t.join(60)
        adapter = a.context.adapter
        assert ra["status"] == 200 and ra["body"]["tokens"] == adapter.generate_greedy(prompts[0], NEW)
        for (_, r), p in zip(herd, prompts[1:]):
            assert r["status"] == 200, r
            assert r["body"]["sources"]["moqt"] == len(keys), r["body"]
            assert r["body"]["sources"]["recompute"] == len(prompt_keys(a, p)) - len(keys)
            assert r["body"]["tokens"] == adapter.generate_greedy(p, NEW)
        moqt = a.context.moqt_publisher
        # one, to the pass track, fanned out; no block's own track was asked for
        assert moqt is not None and moqt.stats.subscribes == 1 and relay.snapshot()["subscribes"] == 3


def test_a_producer_whose_complete_record_differs_from_what_it_sent_is_caught(
        model_dir: Path, index_url: str, relay: BackgroundRelay) -> None:
    """The layers a decode instance received live matched the digests they carried, but the
    producer's complete record lists others: the decode instance discards the copy it stored
    from those layers (and counts it), so it is not handed on as the producer's block."""
    import dataclasses
    import hashlib

    prompt = tokens(PROMPT, 98)
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        compat = a.context.compat_id
        keys = prompt_keys(a, prompt)
        publisher = a.context.publisher
        honest = publisher.records_for

        def lying(entry: Any) -> list[ReplicaRecord]:
            out = []
            for r in honest(entry):
                digests = tuple(hashlib.sha256(b"other" + bytes.fromhex(d)).hexdigest()
                                for d in r.layer_digests or ())
                whole = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
                out.append(dataclasses.replace(r, layer_digests=digests, digest="sha-256:" + whole))
            return out

        publisher.records_for = lying  # type: ignore[method-assign]
        r = httpx.post(a.url + "prefill", json={"tokens": prompt}, timeout=30)
        assert r.status_code == 202, r.text
        rb = httpx.post(b.url + "generate", json={"tokens": prompt, "max_new_tokens": NEW,
                                                  "prefill_at": a.url}, timeout=60)
        assert rb.status_code == 200, rb.text
        assert rb.json()["sources"]["moqt"] == len(keys)
        # The answer itself was right: every layer matched the digest it carried.
        assert rb.json()["tokens"] == a.context.adapter.generate_greedy(prompt, NEW)
        wait_until(lambda: b.engine.live_audited == len(keys), timeout=20,
                   what="B finding the producer's records at odds with what it sent")
        assert b.engine.live_mismatches == len(keys)
        assert all(b.context.store.get(BlockId(compat, SCOPE, k)) is None for k in keys)


async def test_the_pc_sends_a_herd_to_the_instance_computing_its_prefix(
        model_dir: Path, index_url: str, relay: BackgroundRelay, tmp_path: Path) -> None:
    """Two requests sharing a new prefix, routed before either instance has published anything:
    the PC remembers where it sent the first one's blocks and tells the second one's instance to
    subscribe to them there ("prefill": {"running": true, "blocks": n}); that instance computes
    only its own suffix, and both answer as one instance alone."""
    from kvsp_moq.frontend import FrontEnd
    from kvsp_moq.scope_keys import OPEN_SCOPE
    from kvsp_moq.web import BackgroundServer
    from pc.app import PCSettings, create_pc_app
    from pc.placement import ScopeKeys

    shared = tokens(6 * B, 99)
    prompts = [shared + tokens(2 * B + 3, 300 + i) for i in range(2)]
    pc_app = create_pc_app(PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index_url,
                                      sweep_interval_s=0.05),
                           keys=ScopeKeys({OPEN_SCOPE: OPEN_SCOPE_KEY}))
    with BackgroundServer(pc_app) as pc, \
            Agent(settings(model_dir, index_url, relay.url, pc_url=pc.url, warmup_tokens=8)) as a, \
            Agent(settings(model_dir, index_url, relay.url, pc_url=pc.url, warmup_tokens=8)) as b:
        agents = {a.url: a, b.url: b}
        wait_until(lambda: len([i for i in httpx.get(pc.url + "instances", timeout=5).json()["instances"]
                                if i["prefill_tokens_per_s"] > 0]) == 2,
                   timeout=20, what="both agents reporting their measured rates to the PC")
        for agent in agents.values():
            # No in-production records reach the index: what the second route knows of the
            # first one's blocks, it knows from the PC alone.
            moqt = agent.context.moqt_publisher
            assert moqt is not None
            moqt.on_live = None
        compat = a.context.compat_id
        routes = [{"tokens": p, "scope": OPEN_SCOPE, "compat_id": compat} for p in prompts]
        async with FrontEnd(pc.url, timeout_s=60) as fe:
            first = await fe.start(routes[0], {"tokens": prompts[0], "max_new_tokens": NEW})
            # At once: the first instance has a request more in its queue, so the second goes
            # to the other one.
            second = await fe.start(routes[1], {"tokens": prompts[1], "max_new_tokens": NEW})
            split = second.decision.get("prefill")
            assert split == {"instance": first.instance, "reason": "computing this prefix for another request",
                             "running": True, "blocks": len(shared) // B}, second.decision
            assert second.prefill == first.instance and second.instance != first.instance
            got = [[t.token async for t in fe.stream(s.session, instance=s.instance, max_tokens=NEW)]
                   for s in (first, second)]
        adapter = a.context.adapter
        assert got == [adapter.generate_greedy(p, NEW) for p in prompts]
        follower = agents[second.instance].engine.sessions[second.session]
        assert follower.sources["moqt"] == len(shared) // B, follower.sources
        assert follower.sources["recompute"] == len(prompts[1]) // B - len(shared) // B


def test_two_instances_that_start_one_prefix_together_settle_on_one_producer(
        model_dir: Path, index_url: str, relay: BackgroundRelay) -> None:
    """Two requests sharing a new prefix, both planned before either instance published
    anything: both start computing it. Once each sees the other's in-production records, the
    one whose URL sorts after the other's stops at its next layer, withdraws its records and
    subscribes to the other's tracks; both answer as one instance alone."""
    import asyncio
    import time

    shared = tokens(6 * B, 101)
    prompts = [shared + tokens(2 * B + 3, 400 + i) for i in range(2)]
    planned = {"count": 0}
    lock = threading.Lock()
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        winner, loser = sorted((a, b), key=lambda x: x.url)
        compat = a.context.compat_id
        keys = prompt_keys(a, shared)
        for agent in (a, b):
            engine = agent.engine
            plan = engine._plan

            async def together(*args: Any, _plan: Any = plan, _first: list = [True], **kw: Any) -> Any:
                out = await _plan(*args, **kw)
                if _first[0]:  # the first plan of each waits for the other's: neither sees anything
                    _first[0] = False
                    with lock:
                        planned["count"] += 1
                    for _ in range(500):
                        if planned["count"] >= 2:
                            break
                        await asyncio.sleep(0.01)
                return out

            engine._plan = together  # type: ignore[method-assign]
            live = engine.live
            assert live is not None
            opened = live.open

            def slow(*args: Any, _open: Any = opened, **kw: Any) -> LivePass | None:
                p = _open(*args, **kw)
                if p is not None:
                    on_layer = p.on_layer

                    def paced(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
                        on_layer(index, k, v)
                        time.sleep(0.15)  # on the model thread: a pass long enough to see the other
                    p.on_layer = paced  # type: ignore[method-assign]
                return p

            live.open = slow  # type: ignore[method-assign]
        ta, ra = post_async(a.url + "generate", {"tokens": prompts[0], "max_new_tokens": NEW})
        tb, rb = post_async(b.url + "generate", {"tokens": prompts[1], "max_new_tokens": NEW})
        ta.join(60)
        tb.join(60)
        assert ra.get("status") == 200 and rb.get("status") == 200, (ra, rb)
        adapter = a.context.adapter
        assert [ra["body"]["tokens"], rb["body"]["tokens"]] == [adapter.generate_greedy(p, NEW) for p in prompts]
        answers = {a.url: ra["body"], b.url: rb["body"]}
        assert (winner.engine.live_outpaced, loser.engine.live_outpaced) == (0, 1)
        assert "kvsp_agent_live_prefills_outpaced 1" in httpx.get(loser.url + "metrics").text
        lost = answers[loser.url]
        assert lost["sources"]["moqt"] == len(keys), lost  # the shared prefix, from the winner's tracks
        assert lost["sources"]["recompute"] == len(prompts[0]) // B - len(keys)
        won = answers[winner.url]
        assert won["sources"]["recompute"] == len(prompts[0]) // B
        moqt = winner.context.moqt_publisher
        assert moqt is not None and moqt.stats.subscribes >= 1  # its pass track, or its blocks' tracks
        # the loser's in-production records of the shared blocks are gone; the winner's
        # complete records replace its own
        final = wait_until(lambda: (lambda rs: rs if len(rs) == len(keys) and not any(
            r.live for rep in rs for r in rep) else None)(lookup(index_url, compat, keys)),
            timeout=20, what="only complete records of the shared blocks")
        assert all(any(r.http_holder == winner.url for r in rep) for rep in final)
