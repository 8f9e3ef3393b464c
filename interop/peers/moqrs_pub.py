"""A moq-rs publisher of deterministic objects, driven by the interop tests.

    python moqrs_pub.py URL PATH TRACK GROUPS OBJECTS SIZES SEED
        [--pause-ms 20] [--wait-subscriber] [--live] [--linger S] [--serve] [--timeout 60] [--log LEVEL]

Connects to the relay at URL (moqt://host:port: raw QUIC, no certificate check), creates the
broadcast PATH with the track TRACK and announces it, prints READY, then (after a first
subscriber when --wait-subscriber is given) writes GROUPS groups of OBJECTS frames each, group
g as group sequence g, with a pause between groups; frame sizes cycle through SIZES (e.g.
"16,1K,64K,256K") and payloads are those of moqrs_common.payload. After each group it prints
GROUP g, after the last it finishes the track (with --live: only when stopped, so that each
group must end on its own) and prints DONE, then stays up (so that the relay
can drain what it holds) until SIGTERM, the timeout or, with --linger, that many seconds.
With --serve, URL is a local address (127.0.0.1:0) on which a moq-rs server (moq.Server)
listens and prints LISTEN moqt://HOST:PORT; the broadcast is then offered to whoever connects
(moqrs_endpoint.py). Runs with the moq-rs virtual environment (interop/.venv-moqrs/bin/python).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moq
from moqrs_common import parse_sizes, payload
from moqrs_endpoint import endpoint


def say(text: str) -> None:
    print(text, flush=True)


async def main(a: argparse.Namespace) -> None:
    sizes = parse_sizes(a.sizes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with endpoint(a.url, a.serve) as client:
        broadcast = client.create_broadcast(a.path)
        track = broadcast.publish_track(a.track)
        broadcast.announce()
        say("READY")
        if a.wait_subscriber:
            await asyncio.wait_for(track.used(), a.timeout)
            # moq-rs starts serving a new subscription at the track's latest group once its
            # serving task runs; groups written before that are skipped, so give it a moment.
            await asyncio.sleep(0.3)
            say("SUBSCRIBED")
        for g in range(a.groups):
            group = track.create_group(g)
            for o in range(a.objects):
                group.write_frame(payload(a.seed, g, o, a.objects, sizes), timestamp_us=(g * a.objects + o) * 1000)
            group.finish()
            say(f"GROUP {g}")
            if a.pause_ms and g + 1 < a.groups:
                await asyncio.sleep(a.pause_ms / 1000)
        if not a.live:
            track.finish()
        say("DONE")
        try:
            await asyncio.wait_for(stop.wait(), a.timeout if a.linger is None else a.linger)
        except asyncio.TimeoutError:
            pass
        if a.live:
            track.finish()
        broadcast.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("path")
    p.add_argument("track")
    p.add_argument("groups", type=int)
    p.add_argument("objects", type=int)
    p.add_argument("sizes")
    p.add_argument("seed")
    p.add_argument("--pause-ms", type=float, default=20.0)
    p.add_argument("--wait-subscriber", action="store_true")
    p.add_argument("--live", action="store_true", help="leave the track open after the last group, until stopped")
    p.add_argument("--linger", type=float, default=None,
                   help="seconds to stay up after DONE (default: until stopped or the timeout)")
    p.add_argument("--serve", action="store_true", help="URL is a local address: be a moq-rs server there")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--log", default=os.environ.get("MOQ_LOG", "info"))
    args = p.parse_args()
    moq.log_level(args.log)
    asyncio.run(asyncio.wait_for(main(args), args.timeout * 2 + 10))
