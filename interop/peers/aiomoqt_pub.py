"""An aiomoqt publisher of deterministic objects, driven by the interop tests.

    python aiomoqt_pub.py moqt://127.0.0.1:PORT NAMESPACE TRACK GROUPS OBJECTS SIZES SEED
        [--live] [--pause-ms 0] [--timeout 60]

Announces NAMESPACE ("/"-separated fields), answers one SUBSCRIBE for TRACK, and sends GROUPS
groups of OBJECTS objects, one subgroup stream per group (each ended by its stream's FIN),
object o of group g being SIZES[(g * OBJECTS + o) % len(SIZES)] octets of SHAKE-256 over
"SEED:g:o" (moqrs_common.payload; SIZES is one size or a list such as "16,1K,64K,256K"), so the
receiving side can recompute every byte; then PUBLISH_DONE. With --live, PUBLISH_DONE waits
for SIGTERM (or the timeout), so each group must end by its own stream's end. Prints READY once
the namespace is accepted, GROUP g after each group and DONE after the last.
Runs with the aiomoqt virtual environment (interop/.venv-aiomoqt/bin/python).
"""

import argparse
import asyncio
import os
import signal
import sys

from aiomoqt.client import MOQTClient
from aiomoqt.context import profile_for
from aiomoqt.messages import SubgroupHeader
from aiomoqt.types import MOQTMessageType, RequestErrorCode, SubscribeDoneCode
from aiomoqt.utils.url import parse_relay_url

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moqrs_common import parse_sizes, payload


class Publisher:
    def __init__(self, track: str) -> None:
        self.track = track.encode()
        self.request = None
        self.alias = None
        self.subscribed = asyncio.Event()

    async def on_subscribe(self, session, msg) -> None:
        name = msg.track_name if isinstance(msg.track_name, bytes) else str(msg.track_name).encode()
        if name != self.track or self.request is not None:
            session.subscribe_error(request_id=msg.request_id, error_code=RequestErrorCode.DOES_NOT_EXIST,
                                    reason="no such track")
            return
        ok = session.subscribe_ok(request_msg=msg)
        self.request, self.alias = msg, ok.track_alias
        self.subscribed.set()

    async def send(self, session, a: argparse.Namespace, stop: asyncio.Event) -> None:
        groups, objects, sizes, seed = a.groups, a.objects, parse_sizes(a.sizes), a.seed
        prof = profile_for(session.negotiated_draft)
        for group in range(groups):
            stream_id = await session.open_uni_stream()
            header = SubgroupHeader(track_alias=self.alias, group_id=group, subgroup_id=0,
                                    publisher_priority=128, prof=prof)
            session.stream_write(stream_id, header.serialize().data)
            for obj in range(objects):
                buf = header.next_object(payload=payload(seed, group, obj, objects, sizes), object_id=obj)
                await session.stream_write_drain(stream_id, buf.data)
            session.stream_write(stream_id, b"", end_stream=True)
            print(f"GROUP {group}", flush=True)
            if a.pause_ms and group + 1 < groups:
                await asyncio.sleep(a.pause_ms / 1000)
        if a.live:
            print("SENT", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), a.timeout)
            except asyncio.TimeoutError:
                pass
        session.subscribe_done(request_id=self.request.request_id, status_code=SubscribeDoneCode.TRACK_ENDED,
                               stream_count=groups, reason="track ended")


async def main(a: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    relay = parse_relay_url(a.url)
    client = MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True, verify_tls=False,
                        supported_drafts=a.draft)
    publisher = Publisher(a.track)
    client.register_handler(MOQTMessageType.SUBSCRIBE, publisher.on_subscribe)
    async with client.connect() as session:
        await session.client_session_init()
        await session.publish_namespace(namespace=a.namespace, parameters={}, wait_response=True)
        print("READY", flush=True)
        await asyncio.wait_for(publisher.subscribed.wait(), 30)
        await publisher.send(session, a, stop)
        print("DONE", flush=True)
        await asyncio.sleep(2.0)  # let the relay take the last objects before the session ends
        session.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("namespace")
    p.add_argument("track")
    p.add_argument("groups", type=int)
    p.add_argument("objects", type=int)
    p.add_argument("sizes")
    p.add_argument("seed")
    p.add_argument("--live", action="store_true", help="send PUBLISH_DONE only when stopped")
    p.add_argument("--pause-ms", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--draft", type=int, default=18, help="the only MOQT draft offered")
    args = p.parse_args()
    asyncio.run(asyncio.wait_for(main(args), args.timeout * 2 + 10))
