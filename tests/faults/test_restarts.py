"""The relay and the Index Service restarted under live holders and clients (issue #8, faults).

A relay that comes back on the same port starts empty: the holders must announce again on their
own, and a client that held a session to the old relay must open a new one. An Index Service
kept in memory comes back empty: each holder's periodic refresh sends every record, so lookups
recover within one refresh interval (a third of --record-ttl-ms).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.naming import moqt_record
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord
from tests.faults.conftest import Processes, block_key, free_port, lookup, make_container, stored_record

RECOVERY_S = 20.0


async def fetch_when_ready(fetcher: MoqtBlockFetcher, relay: str, record: ReplicaRecord,
                           timeout: float = RECOVERY_S) -> tuple[bytes, float, int]:
    """(container, seconds, failed attempts) of the first fetch that succeeds."""
    start = time.monotonic()
    attempts = 0
    while True:
        try:
            result = await fetcher.fetch_block([relay], record)
            return bytes(result.container.buffer), time.monotonic() - start, attempts
        except Exception as e:  # retried until the deadline
            attempts += 1
            if time.monotonic() - start > timeout:
                raise AssertionError(f"no fetch succeeded within {timeout} s ({attempts} attempts): {e}")
            await asyncio.sleep(0.2)


async def test_relay_restart_publishers_reannounce_subscribers_reconnect(procs: Processes) -> None:
    port = free_port(socket.SOCK_DGRAM)
    relay = procs.relay(port=port)
    holder = procs.holder(relay=relay.url)
    body = make_container(10, layers=8)
    record = moqt_record(stored_record(holder.url, block_key(10), body), relay.url)
    payloads = [bytes(x.k) + bytes(x.v) for x in Container(body).layers()]

    async with MoqtBlockFetcher(verify=False, timeout=3.0, layer_timeout=3.0) as fetcher:
        got, before_s, _ = await fetch_when_ready(fetcher, relay.url, record)
        assert [bytes(x.k) + bytes(x.v) for x in Container(got).layers()] == payloads

        relay.kill()
        relay.start()  # same port, empty cache, no announcements

        body2 = make_container(11, layers=8)  # never seen by the old relay: no cache can answer
        record2 = moqt_record(stored_record(holder.url, block_key(11), body2), relay.url)
        got2, recovery_s, failed = await fetch_when_ready(fetcher, relay.url, record2)
        assert Container(got2).layer_digests() == Container(body2).layer_digests()
        got1, _, _ = await fetch_when_ready(fetcher, relay.url, record, timeout=5.0)
        assert Container(got1).layer_digests() == Container(body).layer_digests()
    print(f"\nrelay restart: first fetch {before_s:.2f} s; fetch after restart succeeded "
          f"{recovery_s:.2f} s after the relay came back ({failed} failed attempts)")
    assert recovery_s < RECOVERY_S


@pytest.mark.parametrize("ttl_ms", [3000])
def test_index_restart_holders_republish_within_refresh(procs: Processes, ttl_ms: int) -> None:
    port = free_port()
    index = procs.index(port=port)
    h1 = procs.holder(index=index.url, ttl_ms=ttl_ms)
    h2 = procs.holder(index=index.url, ttl_ms=ttl_ms)
    keys = [block_key(20 + i) for i in range(4)]
    for i, key in enumerate(keys):
        stored_record((h1 if i % 2 else h2).url, key, make_container(20 + i))
    stored_record(h1.url, keys[0], make_container(20))  # a key with two replicas

    def complete() -> bool:
        found = lookup(index.url, keys)
        return all(found[k] for k in keys) and len(found[keys[0]]) == 2

    deadline = time.monotonic() + 10
    while not complete():
        assert time.monotonic() < deadline, "records were never published"
        time.sleep(0.05)

    # The holders are paused across the restart, so that the restarted index is seen empty
    # before any refresh can reach it; the interval is counted from when they go on.
    for h in (h1, h2):
        h.process.send_signal(signal.SIGSTOP)
    try:
        index.kill()
        index.start()
        assert not any(lookup(index.url, keys).values()), "an in-memory index comes back empty"
    finally:
        for h in (h1, h2):
            h.process.send_signal(signal.SIGCONT)
    restarted = time.monotonic()
    refresh_s = ttl_ms / 1000 / 3
    while not complete():
        assert time.monotonic() - restarted < refresh_s + 2.0, (
            f"lookups did not recover within one refresh interval ({refresh_s:.1f} s) plus 2 s: "
            f"{ {k[:8]: len(v) for k, v in lookup(index.url, keys).items()} }")
        time.sleep(0.05)
    recovered = time.monotonic() - restarted
    print(f"\nIS restart: every record back {recovered:.2f} s after restart (refresh {refresh_s:.1f} s)")
