"""`kvsp bench loss`: the engines on a lossy virtual link, and the link itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvsp_moq.bench.loss import loss_model_mb_per_s, transfer
from kvsp_moq.bench.virtual_link import LinkDirection, VirtualLink


def test_the_quick_run_prints_every_engine_with_and_without_loss_as_json() -> None:
    out = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "loss", "--quick"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    report = json.loads(out)
    assert set(report["engines"]) == {"aioquic", "qh3"}
    for engine in report["engines"].values():
        rows = engine["rtt_ms"]["0.1"]
        assert rows["0%"]["vs_link"] > 0.5  # nothing but the link limits a clean transfer
        assert rows["0%"]["datagrams_dropped"] == 0 and rows["5%"]["datagrams_dropped"] > 0
        assert rows["5%"]["vs_no_loss"] < 1
        assert rows["5%"]["model_mb_per_s"] == pytest.approx(loss_model_mb_per_s(0.05, 100e-6), abs=0.1)


@pytest.mark.parametrize("engine", ["qh3", "aioquic"])
def test_a_lossy_transfer_arrives_whole_and_later(engine: str) -> None:
    # transfer() raises unless every octet arrived; TLS randomness moves the figures a little
    # between runs, the dropped datagrams of a seed do not change the outcome.
    lossy = transfer(engine, size=256 * 1024, loss=0.02, delay=50e-6, seed=7)
    clean = transfer(engine, size=256 * 1024, loss=0.0, delay=50e-6, seed=7)
    assert lossy["datagrams_dropped"] > 0 and clean["datagrams_dropped"] == 0
    assert lossy["mb_per_s"] < clean["mb_per_s"]


def test_the_link_queues_datagrams_at_its_rate_and_delays_them() -> None:
    # 1 MiB at 10 MB/s with 5 ms one way: no faster than the rate allows, plus the delay.
    arrived = [0]

    def on_event(is_server: bool, event: object) -> None:
        data = getattr(event, "data", None)
        if not is_server and isinstance(data, bytes):
            arrived[0] += len(data)

    link = VirtualLink("qh3", "qh3", on_event=on_event, up=LinkDirection(rate=10e6, delay=5e-3),
                       down=LinkDirection(rate=10e6, delay=5e-3))
    assert link.run_until(lambda: link.server_handshake_done, seconds=1.0)
    assert link.now >= 3 * 5e-3  # a client Initial, the server's flight, the client's Finished
    assert link.server is not None
    stream_id = link.server.get_next_available_stream_id(is_unidirectional=True)
    link.server.send_stream_data(stream_id, bytes(1 << 20), end_stream=True)
    start = link.now
    assert link.run_until(lambda: arrived[0] == 1 << 20, seconds=30.0)
    assert link.now - start >= (1 << 20) / 10e6 + 5e-3
