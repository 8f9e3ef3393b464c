"""aiomoqt publisher and subscriber for `kvsp bench moqt`: blocks through aiomoqt's relay.

    python aiomoqt_bench.py pub URL NAMESPACE SEED LAYERS SIZE[,SIZE...]
    python aiomoqt_bench.py sub URL NAMESPACE LAYERS      (track names on stdin, one a line)

The publisher answers every SUBSCRIBE for a track named "b<SIZE>-<anything>" with LAYERS
objects of group 0 on one subgroup stream, object i being SHAKE-256 over "SEED-SIZE-0:0:i"
(SIZE/LAYERS octets), the bytes of layer i of the bench's first block of that size; then
PUBLISH_DONE. Payloads are computed before READY is printed.

The subscriber prints READY once its session is up, then takes the track names it reads on
stdin one after another (so a caller can interleave other measurements) and prints one JSON
line per track:
{"track", "first_s", "total_s", "bytes", "sha256"}, times measured from sending SUBSCRIBE
to the first and the last object, sha256 over the payloads in object order.
Runs with the aiomoqt virtual environment (interop/.venv-aiomoqt/bin/python).
"""

import asyncio
import hashlib
import json
import sys
import time

from aiomoqt.client import MOQTClient
from aiomoqt.context import profile_for
from aiomoqt.messages import SubgroupHeader
from aiomoqt.track import SubscribedTrack
from aiomoqt.types import MOQTMessageType, ObjectStatus, RequestErrorCode, SubscribeDoneCode
from aiomoqt.utils.url import parse_relay_url


def client_for(url: str) -> MOQTClient:
    relay = parse_relay_url(url)
    return MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True, verify_tls=False,
                      supported_drafts=18)


def layer_bytes(seed: str, layer: int, size: int) -> bytes:
    return hashlib.shake_256(f"{seed}:0:{layer}".encode()).digest(size)


async def publish(url: str, namespace: str, seed: str, layers: int, sizes: list[int]) -> None:
    payloads = {size: [layer_bytes(f"{seed}-{size}-0", i, size // layers) for i in range(layers)] for size in sizes}
    client = client_for(url)
    tasks = set()

    async def serve(session, msg) -> None:
        name = msg.track_name.decode() if isinstance(msg.track_name, bytes) else str(msg.track_name)
        size = int(name[1:].split("-")[0]) if name.startswith("b") else -1
        if size not in payloads:
            session.subscribe_error(request_id=msg.request_id, error_code=RequestErrorCode.DOES_NOT_EXIST,
                                    reason="no such track")
            return
        ok = session.subscribe_ok(request_msg=msg)
        header = SubgroupHeader(track_alias=ok.track_alias, group_id=0, subgroup_id=0, publisher_priority=128,
                                prof=profile_for(session.negotiated_draft))
        stream_id = await session.open_uni_stream()
        session.stream_write(stream_id, header.serialize().data)
        for i, payload in enumerate(payloads[size]):
            await session.stream_write_drain(stream_id, header.next_object(payload=payload, object_id=i).data)
        session.stream_write(stream_id, b"", end_stream=True)
        session.subscribe_done(request_id=msg.request_id, status_code=SubscribeDoneCode.TRACK_ENDED,
                               stream_count=1, reason="track ended")

    async def on_subscribe(session, msg) -> None:
        task = asyncio.ensure_future(serve(session, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    client.register_handler(MOQTMessageType.SUBSCRIBE, on_subscribe)
    async with client.connect() as session:
        await session.client_session_init()
        await session.publish_namespace(namespace=namespace, parameters={}, wait_response=True)
        print("READY", flush=True)
        await asyncio.sleep(3600)


async def subscribe(url: str, namespace: str, layers: int) -> None:
    client = client_for(url)
    loop = asyncio.get_running_loop()
    async with client.connect() as session:
        await session.client_session_init()
        print("READY", flush=True)
        while True:
            track = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if not track:
                break
            received: list[bytes] = []
            times: list[float] = []
            complete = asyncio.Event()

            def on_object(msg, size, recv_time, group_id=None, subgroup_id=None, *_):
                if getattr(msg, "status", None) not in (None, ObjectStatus.NORMAL):
                    return
                times.append(time.perf_counter())
                received.append(bytes(msg.payload or b""))
                if len(received) == layers:
                    complete.set()

            subscription = SubscribedTrack(session, namespace, track, on_object=on_object)
            subscription._quiet = True
            start = time.perf_counter()
            await subscription.subscribe(forward=1, filter_type=None)
            await asyncio.wait_for(complete.wait(), 120)
            digest = hashlib.sha256(b"".join(received)).hexdigest()
            print(json.dumps({"track": track, "first_s": times[0] - start, "total_s": times[-1] - start,
                              "bytes": sum(len(p) for p in received), "sha256": digest}), flush=True)
        print("DONE", flush=True)
        session.close()


if __name__ == "__main__":
    mode, url, namespace = sys.argv[1:4]
    if mode == "pub":
        seed, layers, sizes = sys.argv[4], int(sys.argv[5]), [int(s) for s in sys.argv[6].split(",")]
        asyncio.run(publish(url, namespace, seed, layers, sizes))
    else:
        asyncio.run(asyncio.wait_for(subscribe(url, namespace, int(sys.argv[4])), 1800))
