"""`kvsp bench loss`: what each QUIC engine delivers on a lossy link, on a virtual clock.

A server engine writes one stream to a client engine across `VirtualLink` (1 Gbit/s each way,
datagrams of 1,452 octets), without loss and with a share of the datagrams dropped at random
each way, at a sub-millisecond and a 2 ms round trip. No CPU enters the figures: they are what
the engine's loss recovery, congestion control and pacing allow, the same on any machine, so a
change of engine (or of its settings) shows here first. The baseline is the same engine on the
same link without loss; `vs_link` compares with the link's rate, `vs_model` with what a
loss-based congestion controller allows at that round trip (`loss_model_mb_per_s`).
"""

from __future__ import annotations

import time
from typing import Any

from kvsp_moq.bench.virtual_link import LinkDirection, VirtualLink
from kvsp_moq.errors import Failed
from kvsp_moq.moqt.engine import StreamDataReceived
from kvsp_moq.moqt.quic.settings import ENGINES

MiB = 1 << 20
MB = 1e6
LINK_RATE = 125e6  # 1 Gbit/s, in octets per second
#: one-way delays: a round trip of 0.1 ms (one rack) and of 2 ms (across a region)
DELAYS = (50e-6, 1e-3)
LOSSES = (0.0, 0.002, 0.01, 0.05)
#: virtual seconds a transfer may take before the run is called failed
LIMIT_S = 120.0


def loss_model_mb_per_s(loss: float, rtt: float, mss: int = 1452 - 52) -> float:
    """What a loss-based congestion controller allows, at most the link's rate: MSS / RTT x
    sqrt(3/2) / sqrt(loss) (Mathis et al., 1997), in MB/s; the engines' figures against it
    say whether their congestion control or something else (pacing, timers) limits them."""
    return min(LINK_RATE, mss / rtt * (1.5 / loss) ** 0.5) / MB


def transfer(engine: str, *, size: int, loss: float, delay: float, seed: int = 1) -> dict[str, Any]:
    """`size` octets on one stream from a server to a client of `engine`: virtual seconds
    from the write to the client's FIN, and the sender's state at the end."""
    got = [0, 0]  # octets, FIN seen

    def on_event(is_server: bool, event: Any) -> None:
        if not is_server and isinstance(event, StreamDataReceived):
            got[0] += len(event.data)
            got[1] |= event.end_stream

    link = VirtualLink(engine, engine, seed=seed, on_event=on_event,
                       up=LinkDirection(rate=LINK_RATE, delay=delay, loss=loss),
                       down=LinkDirection(rate=LINK_RATE, delay=delay, loss=loss))
    if not link.run_until(lambda: link.server_handshake_done, seconds=10.0):
        raise Failed(f"{engine}: no handshake within 10 virtual seconds at {loss:.1%} loss")
    server = link.server
    assert server is not None
    stream_id = server.get_next_available_stream_id(is_unidirectional=True)
    server.send_stream_data(stream_id, bytes(size), end_stream=True)
    start = link.now
    if not link.run_until(lambda: bool(got[1]), seconds=LIMIT_S):
        raise Failed(f"{engine}: {got[0]} of {size} octets after {LIMIT_S:g} virtual seconds at {loss:.1%} loss")
    if got[0] != size:
        raise Failed(f"{engine}: {got[0]} octets arrived of {size}")
    seconds = link.now - start
    return {"seconds": round(seconds, 4), "mb_per_s": round(size / seconds / MB, 1),
            "datagrams_dropped": link.up.dropped + link.down.dropped, **link.sender_state()}


def run(*, quick: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    size = (2 if quick else 8) * MiB
    losses = (0.0, 0.05) if quick else LOSSES
    delays = DELAYS[:1] if quick else DELAYS
    engines: dict[str, Any] = {}
    for engine in ENGINES:
        by_rtt: dict[str, Any] = {}
        for delay in delays:
            rows: dict[str, Any] = {}
            for loss in losses:
                rows[f"{loss * 100:g}%"] = transfer(engine, size=size, loss=loss, delay=delay)
            clean = rows["0%"]["mb_per_s"]
            for loss, row in zip(losses, rows.values()):
                row["vs_no_loss"] = round(row["mb_per_s"] / clean, 3)
                row["vs_link"] = round(row["mb_per_s"] * MB / LINK_RATE, 3)
                if loss:
                    model = loss_model_mb_per_s(loss, 2 * delay)
                    row["model_mb_per_s"] = round(model, 1)
                    row["vs_model"] = round(row["mb_per_s"] / model, 3)
            by_rtt[f"{delay * 2e3:g}"] = rows
        engines[engine] = {"rtt_ms": by_rtt}
    return {
        "benchmark": "loss",
        "quick": quick,
        "link": {"mbit": LINK_RATE * 8 / 1e6, "datagram_size": 1452, "bytes": size},
        "engines": engines,
        "seconds": round(time.perf_counter() - started, 1),
        "note": "virtual clock: seconds and MB/s are the link's and the engines' timers', not the "
                "CPU's; loss is the share of datagrams dropped at random each way; vs_no_loss = MB/s "
                "with loss / MB/s without, same engine and round trip; vs_link = MB/s / the link's "
                "rate; model_mb_per_s = MSS / RTT x sqrt(1.5 / loss) (Mathis et al.), at most the link's rate, "
                "and vs_model = MB/s / that; cwnd (octets), srtt_ms, lost and pto are the sender's at the end",
    }
