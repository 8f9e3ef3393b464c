"""A moq-rs subscriber that checks what it receives, driven by the interop tests.

    python moqrs_sub.py URL PATH TRACK OBJECTS SIZES SEED
        [--groups N] [--wait announced|request] [--serve] [--timeout 30] [--log LEVEL]

Connects to the relay at URL (moqt://host:port, no certificate check), waits for the broadcast
PATH (announced_broadcast, or request_broadcast retried), subscribes to TRACK, prints SUBSCRIBED,
then reads groups as they arrive, each group's frames in order, and prints one JSON line per
object: {"group", "frame", "object", "size", "ok", "timestamp_us"} (frame: its place in the
group as read; sha256: of the payload; object: the object whose payload it is byte for byte, per moqrs_common.payload
for OBJECTS objects per group and the frame sizes SIZES, -1 and ok false when none). It ends when
the track ends, when N whole groups have arrived (with --groups), on an error or at the
timeout, and prints a last line: SUMMARY {"groups", "complete_groups", "objects", "bytes",
"mismatches", "first_group", "last_group", "per_group", "empty_groups", "error", "ended"}
(empty_groups: groups that ended holding no frame at all, reported apart, not as an error: moq-rs
surfaces a stream that carries only a status object, such as its END_OF_TRACK, as such a
group when it does not recognize it). With --serve, URL is a local
address (127.0.0.1:0) on which a moq-rs server (moq.Server) listens and prints LISTEN
moqt://HOST:PORT; PATH is then the broadcast a connecting client announces (moqrs_endpoint.py).
Runs with the moq-rs virtual environment (interop/.venv-moqrs/bin/python).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moq
from moqrs_common import parse_sizes, payload
from moqrs_endpoint import endpoint


def say(text: str) -> None:
    print(text, flush=True)


class Tally:
    def __init__(self) -> None:
        self.groups: dict[int, int] = {}
        self.complete: set[int] = set()
        self.empty: set[int] = set()
        self.objects = 0
        self.bytes = 0
        self.mismatches = 0
        self.error: str | None = None
        self.ended = "timeout"

    def summary(self) -> dict:
        seqs = sorted(self.groups)
        return {"groups": len(seqs), "complete_groups": len(self.complete), "objects": self.objects,
                "bytes": self.bytes, "mismatches": self.mismatches,
                "first_group": seqs[0] if seqs else None, "last_group": seqs[-1] if seqs else None,
                "per_group": {str(g): self.groups[g] for g in seqs}, "empty_groups": sorted(self.empty),
                "error": self.error, "ended": self.ended}


async def read_group(group, a: argparse.Namespace, sizes, tally: Tally, enough: asyncio.Event) -> None:
    seq = group.sequence
    tally.groups.setdefault(seq, 0)
    o = 0
    try:
        while o < 100_000:
            frame = await group.read_frame()
            if frame is None:
                break
            data = bytes(frame.payload)
            # A frame carries no object id: the o-th frame of a group should be object o, but a
            # subscriber joining mid-group may start later in it, so look for the object it is.
            obj = o
            ok = data == payload(a.seed, seq, o, a.objects, sizes)
            if not ok:
                obj = next((j for j in range(a.objects) if data == payload(a.seed, seq, j, a.objects, sizes)), -1)
                ok = obj >= 0
            tally.objects += 1
            tally.bytes += len(data)
            tally.mismatches += not ok
            tally.groups[seq] += 1
            say(json.dumps({"group": seq, "frame": o, "object": obj, "size": len(data), "ok": ok,
                            "timestamp_us": frame.timestamp_us, "sha256": hashlib.sha256(data).hexdigest()}))
            o += 1
    except Exception as e:  # reported, not raised
        if tally.error is None:
            tally.error = f"group {seq} after {o} objects: {type(e).__name__}: {e}"
        enough.set()
        return
    if o == a.objects and tally.groups[seq] == a.objects:
        tally.complete.add(seq)
    elif o == 0 and tally.groups[seq] == 0:
        tally.empty.add(seq)
    elif tally.error is None:
        tally.error = f"group {seq} ended after {o} of {a.objects} objects"
    if a.groups and len(tally.complete) >= a.groups:
        tally.ended = "groups"
        enough.set()


async def find_broadcast(client, a: argparse.Namespace, deadline: float):
    if a.wait == "announced":
        return await asyncio.wait_for(client.announced_broadcast(a.path).available(),
                                      max(0.1, deadline - time.monotonic()))
    while True:  # request_broadcast raises when nothing can serve the path yet
        try:
            return await client.request_broadcast(a.path)
        except moq.Error:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def main(a: argparse.Namespace, tally: Tally) -> None:
    sizes = parse_sizes(a.sizes)
    deadline = time.monotonic() + a.timeout
    enough = asyncio.Event()
    readers: set[asyncio.Task] = set()
    async with endpoint(a.url, a.serve) as client:
        broadcast = await find_broadcast(client, a, deadline)
        # No staleness limit: every group is read, none skipped for being late.
        track = await broadcast.subscribe_track(a.track, moq.Subscription(max_age_us=600_000_000))
        say("SUBSCRIBED")

        async def groups() -> None:
            n = 0
            while n < 10_000:
                group = await track.recv_group()
                if group is None:
                    tally.ended = "track ended"
                    return
                n += 1
                task = asyncio.ensure_future(read_group(group, a, sizes, tally, enough))
                readers.add(task)
                task.add_done_callback(readers.discard)

        arrivals = asyncio.ensure_future(groups())
        waiter = asyncio.ensure_future(enough.wait())
        try:
            await asyncio.wait({arrivals, waiter}, timeout=max(0.1, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
            if arrivals.done() and arrivals.exception() is not None:
                e = arrivals.exception()
                tally.error = tally.error or f"track: {type(e).__name__}: {e}"
                tally.ended = "track error"
            # The track ended: let the groups already taken finish (bounded).
            if readers:
                await asyncio.wait(set(readers), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        finally:
            for task in (arrivals, waiter, *readers):
                task.cancel()
            track.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("path")
    p.add_argument("track")
    p.add_argument("objects", type=int)
    p.add_argument("sizes")
    p.add_argument("seed")
    p.add_argument("--groups", type=int, default=0)
    p.add_argument("--wait", choices=("announced", "request"), default="announced")
    p.add_argument("--serve", action="store_true", help="URL is a local address: be a moq-rs server there")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--log", default=os.environ.get("MOQ_LOG", "info"))
    args = p.parse_args()
    moq.log_level(args.log)
    result = Tally()
    try:
        asyncio.run(asyncio.wait_for(main(args, result), args.timeout + 10))
    except Exception as e:  # the summary carries it
        if result.error is None:
            result.error = f"{type(e).__name__}: {e}"
        if isinstance(e, asyncio.TimeoutError):
            result.ended = "timeout"
    say("SUMMARY " + json.dumps(result.summary()))
