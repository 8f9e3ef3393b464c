"""An agent's settings give its engine's tunables and its own pool's holder settings, field for
field, so that a setting added to one of them cannot be forgotten on the way."""

from __future__ import annotations

from dataclasses import fields

from agent.options import EngineOptions
from agent.settings import AgentSettings
from kvsp_moq.holder.settings import HolderSettings
from kvsp_moq.moqt.quic.settings import QuicSettings


def test_engine_options_take_every_field_of_the_same_name() -> None:
    s = AgentSettings(block_tokens=32, lease_ms=7, load_concurrency=3, layers_per_request=2,
                      release_batch=5, max_unacked=9, token_interval_s=0.5, max_new_tokens=11,
                      replicate_to=["http://h.test/"], keep_first_logits=True,
                      choose_by_cost=False)
    options = s.engine_options()
    shared = {f.name for f in fields(EngineOptions)} & {f.name for f in fields(AgentSettings)}
    assert len(shared) >= 11
    for name in shared - {"replicate_to"}:
        assert getattr(options, name) == getattr(s, name), name
    assert options.replicate_to == ("http://h.test/",)
    assert options.pipelined == EngineOptions.pipelined  # not an agent setting: the default


def test_the_pool_is_a_holder_of_the_agents_url_store_relay_and_token() -> None:
    quic = QuicSettings(engine="aioquic", max_datagram_size=9000)
    s = AgentSettings(public_url="http://a.test:1/", data_dir="/tmp/pool", host_bytes=1 << 20,
                      disk_bytes=1 << 24, relay="moqt://r.test:4443", token="t", quic=quic,
                      max_block_bytes=1 << 22, record_ttl_ms=5000)
    h = s.holder_settings({})
    assert isinstance(h, HolderSettings)
    assert (h.public_url, h.data_dir, h.host_bytes, h.disk_bytes) == (
        "http://a.test:1/", "/tmp/pool", 1 << 20, 1 << 24)
    assert (h.relay, h.index_token, h.quic, h.max_block_bytes, h.record_ttl_ms) == (
        "moqt://r.test:4443", "t", quic, 1 << 22, 5000)
