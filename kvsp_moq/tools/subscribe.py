"""`kvsp subscribe`: watch the objects of one MOQT track arrive through a relay.

One line per object, as it arrives, so a block being computed can be seen layer by layer;
with a Replica Record each object's payload is checked against its layer digest (for raw
blocks the payload is K then V of the layer, DESIGN §4).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time

from kvsp_moq.errors import KvspError, Unauthorized, reason_of
from kvsp_moq.moqt.certs import add_relay_tls_options
from kvsp_moq.tools import Failed, UsageError, add_common, guarded, read_record


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "SUBSCRIBE to one track at a MOQT relay and print one line per object as it arrives: "
        "group, object, size and, with --record, whether the payload matches the layer "
        "digest. Ends when the track ends, after --count objects or after --timeout seconds. "
        "Exit status: 0 done, 1 refused, nothing arrived or a digest mismatch, 2 bad arguments or "
        "a token the relay refused.")
    p.add_argument("relay", metavar="moqt://RELAY", help="the relay's moqt:// URI")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--namespace", metavar="B64",
                      help="the track namespace, as a record's base64url moqt_namespace")
    what.add_argument("--record", metavar="FILE",
                      help="a MOQT Replica Record: its namespace, codec and layer digests")
    p.add_argument("--track", metavar="NAME", help="track name (default: the codec, \"1\")")
    p.add_argument("--count", type=int, metavar="N", help="stop after N objects")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="stop after S seconds (default: when the track ends)")
    p.add_argument("--json", action="store_true", help="print each line as a JSON object")
    add_relay_tls_options(p, aliases=True)
    add_common(p, block=False, timeout=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return guarded("subscribe", lambda: _subscribe(args), args)


async def _subscribe(args: argparse.Namespace) -> int:
    from kvsp_moq.moqt.certs import untrusted_certificate
    from kvsp_moq.moqt.errors import MoqtError, RequestError
    from kvsp_moq.moqt.quic import connect
    from kvsp_moq.naming import decode_namespace
    from kvsp_moq.tools.get import relay_tls

    if not args.relay.lower().startswith("moqt://"):
        raise UsageError(f"the relay must be a moqt:// URI, not {args.relay!r}")
    tls = relay_tls(args, args.relay)
    if args.count is not None and args.count <= 0:
        raise UsageError("--count must be positive")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    digests: list[bytes] | None = None
    if args.record:
        record = read_record(args.record)
        if not record.moqt_namespace:
            raise UsageError(f"record {args.record} has no moqt_namespace: not a MOQT replica")
        namespace_text, codec = record.moqt_namespace, record.codec
        digests = record.layer_digest_bytes() if record.layer_digests is not None else None
    else:
        namespace_text, codec = args.namespace, 1
    try:
        namespace = decode_namespace(namespace_text)
    except KvspError as e:
        raise UsageError(e.detail) from None
    if not namespace:
        raise UsageError("the namespace is empty")
    track = (args.track if args.track is not None else str(codec)).encode()
    step = args.timeout if args.timeout is not None else 10.0
    started = time.monotonic()
    deadline = None if args.timeout is None else started + args.timeout
    try:
        connection = await asyncio.wait_for(
            connect(args.relay, **tls.connect_options(), authorization=args.token, timeout=step), step)
    except asyncio.TimeoutError:
        raise Failed(f"relay {args.relay} did not answer within {step:g} s") from None
    except (MoqtError, OSError, ValueError) as e:
        untrusted = untrusted_certificate(e, args.relay, tls)
        if untrusted is not None:
            raise UsageError(untrusted) from None
        raise Failed(f"cannot reach relay {args.relay}: {reason_of(e)}") from None
    seen = mismatched = 0
    try:
        try:
            subscription = await connection.subscribe(namespace, track, forward=True,
                                                      authorization=args.token, timeout=step)
        except Unauthorized as e:  # the token: exit status 2, as for `kvsp get` and `kvsp put`
            raise Unauthorized(f"the relay refused the subscription: {reason_of(e)}") from None
        except RequestError as e:
            raise Failed(f"the relay refused the subscription: {reason_of(e)}") from None
        except asyncio.TimeoutError:
            raise Failed(f"no answer to SUBSCRIBE within {step:g} s") from None
        iterator = subscription.__aiter__()
        try:
            while args.count is None or seen < args.count:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    obj = await asyncio.wait_for(iterator.__anext__(), remaining)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    break
                seen += 1
                check = None
                if digests is not None:
                    if obj.group_id != 0 or not 0 <= obj.object_id < len(digests):
                        check = "no-digest"
                    else:
                        ok = hashlib.sha256(obj.payload).digest() == digests[obj.object_id]
                        check = "digest-ok" if ok else "digest-MISMATCH"
                        mismatched += not ok
                elapsed = time.monotonic() - started
                if args.json:
                    print(json.dumps({"group": obj.group_id, "object": obj.object_id,
                                      "size": len(obj.payload), "digest": check,
                                      "ms": round(elapsed * 1000, 3)}), flush=True)
                else:
                    tail = f" {check}" if check else ""
                    print(f"group {obj.group_id} object {obj.object_id} size {len(obj.payload)}"
                          f"{tail} {elapsed * 1000:.1f}ms", flush=True)
        finally:
            await subscription.aclose()
    finally:
        await connection.aclose()
    if mismatched:
        raise Failed(f"{mismatched} of {seen} objects do not match their layer digest")
    if not seen:
        raise Failed("no object arrived")
    return 0
