"""A relay chain (DESIGN §4): client -> relay B (`kvsp relay --upstream A`) -> relay A ->
`kvsp holder --relay A`. Relay B caches what it relays, so a second client asking B for the
same blocks and layer ranges is served there without a single request reaching relay A.

Relay A runs in this process so that its own counters tell what reached it; B and the holder
are processes.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.fetch.stream import FetchedBlock
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.naming import BlockTrack, moqt_record
from kvsp_moq.protocol.container import Container
from relay.relay import Relay, RelaySettings

from .helpers import (
    COMPAT,
    SCOPE,
    STEP,
    eventually,
    healthy,
    logged,
    make_block,
    put_block,
    relay_cert,
    relay_up,
    services,
)

RANGES = [(2, 6), (0, 11), (9, 9)]
#: Relay A's counters that any request reaching it moves.
TRAFFIC = ("fetches", "subscribes", "track_statuses", "objects_out", "bytes_out", "upstream_requests",
           "cache_hits", "cache_misses")


async def fetch_all(fetcher: MoqtBlockFetcher, records: list, blocks: list) -> list[FetchedBlock]:
    """Every block whole and every range of RANGES, each checked against the stored octets."""
    results = []
    for record, block in zip(records, blocks):
        whole = await fetcher.fetch_block([], record)
        assert bytes(whole.container.buffer) == block.data
        results.append(whole)
        for first, last in RANGES:
            part = await fetcher.fetch_block([], record, (first, last))
            assert bytes(part.container.buffer) == Container(block.data).slice(first, last)
            results.append(part)
    return results


async def test_a_second_client_is_served_from_the_near_relay(tmp_path: Path) -> None:
    blocks = [make_block(40 + n, layers=12) for n in range(3)]
    certificate = generate_self_signed()
    a_cert = tmp_path / "relay-a-cert.pem"
    a_cert.write_bytes(certificate.certificate_pem)
    relay_a = await Relay(RelaySettings(certificate=certificate)).start()
    try:
        async with services(tmp_path) as run, httpx.AsyncClient(timeout=10, trust_env=False) as client:
            relay_b = await run.relay("relay-b", "--upstream", relay_a.url, "--upstream-ca", str(a_cert))
            holder = await run.holder("holder", "--relay", relay_a.url, "--relay-ca", str(a_cert))
            await relay_up(relay_b)
            await healthy(client, holder)
            await logged(relay_b, f"connected to upstream relay {relay_a.url}")

            records = [moqt_record(await put_block(client, holder, b), relay_b.url) for b in blocks]
            prefix = BlockTrack.for_holder(COMPAT, SCOPE, blocks[0].bid.block_key, holder.url).announce_prefix
            await eventually(lambda: relay_a.routes.lookup(prefix) is not None,
                             "the holder's announcement at relay A", service=holder)

            cafile = str(relay_cert(relay_b))
            async with MoqtBlockFetcher(cafile=cafile, timeout=STEP, layer_timeout=STEP) as first:
                before_first = relay_a.snapshot()
                got = await fetch_all(first, records, blocks)
                assert all(r.source == relay_b.url and r.failures == [] for r in got)
            after_first = relay_a.snapshot()
            # The first client's requests went B -> A -> holder: A saw them and relayed the layers.
            assert after_first["fetches"] > before_first["fetches"]
            assert after_first["objects_out"] - before_first["objects_out"] >= sum(
                Container(b.data).layer_count for b in blocks)

            async with MoqtBlockFetcher(cafile=cafile, timeout=STEP, layer_timeout=STEP) as second:
                got = await fetch_all(second, records, blocks)
                assert all(r.source == relay_b.url and r.failures == [] for r in got)
            after_second = relay_a.snapshot()
            moved = {name: after_second[name] - after_first[name] for name in TRAFFIC}
            assert moved == dict.fromkeys(TRAFFIC, 0), f"the second client reached relay A: {moved}"
    finally:
        await relay_a.aclose()
