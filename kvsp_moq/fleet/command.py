"""`kvsp fleet`: build a fleet on one machine and keep it up until interrupted.

An index (IS and PC), a relay, a holder, fetch clients and optionally agents, each in a network
namespace of its own, on links with the MTU, rates and loss given, authenticated as across
machines. It prints where
everything is (namespaces, addresses, URLs, the work directory with the tokens and the relay's
certificate) as one JSON document, then waits; ^C or SIGTERM (or --duration) tears it all down.
Run commands on a host with `ip netns exec NAMESPACE ...`. Needs root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvsp_moq.errors import UsageError
from kvsp_moq.fleet.topology import fleet_topology, parse_rate

MiB = 1 << 20


def _rate(text: str) -> float | None:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[1].replace("\n", " ")
    p.add_argument("--clients", type=int, default=4, metavar="N", help="fetch clients (default 4)")
    p.add_argument("--agents", type=int, default=0, metavar="N",
                   help="inference instances (kvsp agent, the tiny model) reporting to the PC (default 0)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500)")
    p.add_argument("--holder-rate", type=_rate, default=200.0, metavar="RATE",
                   help="the holder's link, e.g. 200mbit (default), 1gbit, or none (unshaped)")
    p.add_argument("--relay-rate", type=_rate, default=1000.0, metavar="RATE",
                   help="the relay's link (default 1gbit)")
    p.add_argument("--client-rate", type=_rate, default=1000.0, metavar="RATE",
                   help="each client's link (default 1gbit)")
    p.add_argument("--index-rate", type=_rate, default=1000.0, metavar="RATE",
                   help="the index's link (default 1gbit)")
    p.add_argument("--agent-rate", type=_rate, default=1000.0, metavar="RATE",
                   help="each agent's link (default 1gbit)")
    p.add_argument("--client-loss", type=float, default=0.0, metavar="PERCENT",
                   help="frames dropped at random on each client's link, each way (default 0)")
    p.add_argument("--blocks", type=int, default=0, metavar="N",
                   help="blocks of 32 layers to store at the holder, their keys printed (default 0)")
    p.add_argument("--block-bytes", type=int, default=16 * MiB, metavar="OCTETS",
                   help="payload of each stored block (default 16 MiB)")
    p.add_argument("--workdir", metavar="DIR",
                   help="where tokens, keys, the relay's certificate and logs go (kept; default: a "
                        "temporary directory removed at the end)")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="tear the fleet down after this long (default: when interrupted)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvsp_moq.fleet.services import Fleet, terminate_as_interrupt

    if args.clients < 1:
        raise UsageError("--clients must be at least 1")
    if args.agents < 0:
        raise UsageError("--agents cannot be negative")
    if not 0 <= args.client_loss <= 100:
        raise UsageError("--client-loss is a percentage, 0 to 100")
    try:
        topology = fleet_topology(clients=args.clients, agents=args.agents, mtu=args.mtu,
                                  holder_rate=args.holder_rate, relay_rate=args.relay_rate,
                                  client_rate=args.client_rate, index_rate=args.index_rate,
                                  agent_rate=args.agent_rate, client_loss=args.client_loss)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        with terminate_as_interrupt(), Fleet(topology, workdir=args.workdir) as fleet:
            report = fleet.describe()
            if args.blocks > 0:
                seeder = fleet.seeder()
                seeded = seeder.request("seed", timeout=300, holder=fleet.holder_url(), blocks=args.blocks,
                                        block_bytes=args.block_bytes, seed=str(time.time_ns()))
                fleet.host(topology.of_role("holder")[0].name).stop(seeder.proc)
                report["blocks"] = seeded["keys"]
            first = topology.of_role("client")[0].name
            report["example"] = (
                f"ip netns exec {fleet.host(first).netns} kvsp get {fleet.relay_url} --index {fleet.index_url} "
                f"--relay-ca {fleet.relay_ca} --token-file {fleet.workdir / (first + '.token')} "
                f"--compat {report['compat_id']} --scope {report['scope_id']} --key KEY -o /dev/null --json")
            print(json.dumps(report, indent=2), flush=True)
            print("kvsp fleet: ready; ^C tears it down", file=sys.stderr, flush=True)
            deadline = None if args.duration is None else time.monotonic() + args.duration
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    print("kvsp fleet: torn down", file=sys.stderr, flush=True)
    return 0
