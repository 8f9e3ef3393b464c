"""What a fleet on one machine looks like, as data: hosts, the link of each, and the commands and
rules that make those links real. Nothing here touches the system, so it is tested without root.

Every host has one link to a switch (a bridge). A link has an MTU, a rate, a loss rate and a
state (up or down); it shapes both directions: the host's own interface sends at the rate (its
NIC), and the switch's port sends to the host at the rate (the switch port). Loss drops frames
at random in each direction, one wire frame at a time: a lossy link's two ends send no GSO
aggregates (`gso_max_segs 1`), frames from the host are dropped at the switch and frames to it
at its interface's ingress. A partition drops everything between two hosts at the switch while
each keeps its link to the others.

Delay is not modelled: the kernels this runs on have no `netem` and no `fq` (whose departure
times a BPF program could set), and a user-space hop that delays each packet would spend more
CPU than the links it emulates. Loss uses nftables (`numgen random`) for the same reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

#: IPv4 and UDP headers: a UDP payload of MTU - 28 octets fills one IPv4 packet.
IPV4_UDP_OVERHEAD = 28
#: The smallest datagram QUIC may send (RFC 9000, 14.1), and the largest UDP payload.
MIN_QUIC_DATAGRAM = 1200
MAX_UDP_PAYLOAD = 65507
#: The nftables table a fleet's switch filters in (the switch namespace is the fleet's own).
NFT_TABLE = "kvsp_fleet"
#: Loss rates are applied in steps of 1/LOSS_SCALE.
LOSS_SCALE = 10_000

_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmg]?)(?:bit|bps|b)?(?:/s)?\s*$", re.I)
_UNIT = {"": 1.0, "k": 1e-3, "m": 1.0, "g": 1e3}


def parse_rate(text: str | float | int | None) -> float | None:
    """A link rate in Mbit/s from "200mbit", "1gbit", "500k", "1G" or a plain number (Mbit/s);
    None, "none", "0" or "unlimited" for an unshaped link."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        rate = float(text)
    else:
        if text.strip().lower() in ("", "none", "unlimited", "0"):
            return None
        match = _RATE.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a rate (e.g. 200mbit, 1gbit, 500kbit)")
        rate = float(match.group(1)) * _UNIT[match.group(2).lower()]
    if rate < 0:
        raise ValueError(f"a rate is not negative: {text!r}")
    return rate or None


def datagram_size(mtu: int) -> int:
    """The UDP payload that fills one IPv4 packet on a path of this MTU: what a QUIC endpoint
    should send there (larger datagrams are fragmented, or dropped where DF is set)."""
    size = min(mtu - IPV4_UDP_OVERHEAD, MAX_UDP_PAYLOAD)
    if size < MIN_QUIC_DATAGRAM:
        raise ValueError(f"an MTU of {mtu} cannot carry QUIC's {MIN_QUIC_DATAGRAM}-octet datagrams")
    return size


@dataclass(frozen=True)
class Link:
    """One host's link to the switch."""

    #: octets of the largest IP packet on the link
    mtu: int = 1500
    #: Mbit/s in each direction; None: not shaped (as fast as the CPUs move veth frames)
    rate_mbit: float | None = None
    #: percent of frames dropped at random in each direction
    loss_percent: float = 0.0
    #: False: the switch port is down (a cut cable)
    up: bool = True
    #: how long the shaper's queue may be, in milliseconds at the link's rate
    queue_ms: float = 20.0

    def __post_init__(self) -> None:
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"MTU {self.mtu} is outside 576..65535")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate {self.rate_mbit} Mbit/s is not positive")
        if not 0 <= self.loss_percent <= 100:
            raise ValueError(f"loss {self.loss_percent}% is outside 0..100")
        if self.queue_ms <= 0:
            raise ValueError(f"queue {self.queue_ms} ms is not positive")

    def shaper(self, dev: str) -> list[str]:
        """`tc` arguments that give `dev`'s sending side this link's rate (a token bucket whose
        burst holds one 64 KiB GSO frame, so frames are not cut up; the queue holds
        `queue_ms` at the rate), or that remove any shaping."""
        if self.rate_mbit is None:
            return ["qdisc", "del", "dev", dev, "root"]
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(128 << 10, int(rate_bytes / 1000), 2 * self.mtu)
        return ["qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{round(self.rate_mbit * 1000)}kbit", "burst", str(burst),
                "latency", f"{self.queue_ms:g}ms"]

    def describe(self) -> dict[str, object]:
        return {"mtu": self.mtu, "rate_mbit": self.rate_mbit, "loss_percent": self.loss_percent,
                "up": self.up}


def _loss_rule(match: str, percent: float, host: str) -> str:
    threshold = round(percent * LOSS_SCALE / 100)
    return f'{match} numgen random mod {LOSS_SCALE} < {threshold} counter drop comment "loss {host}"'


def _table(family: str, chain: str, hook: str, rules: list[str]) -> str:
    body = "".join(f"    {rule}\n" for rule in rules)
    # "add" then "delete" then define, in one transaction: replaces the table whether or not
    # it exists, with no moment without rules
    return (f"add table {family} {NFT_TABLE}\ndelete table {family} {NFT_TABLE}\n"
            f"table {family} {NFT_TABLE} {{\n  chain {chain} {{\n"
            f"    type filter hook {hook} priority 0; policy accept;\n{body}  }}\n}}\n")


def switch_ruleset(ports: Mapping[str, str], links: Mapping[str, Link],
                   partitions: Iterable[frozenset[str]] = ()) -> str:
    """The nftables script (one atomic transaction) that makes the switch drop what the
    partitions say, and what each lossy link loses on its way in (from its host); `ports` maps
    each host to its switch port. What a link loses on its way out is `host_ruleset`'s."""
    rules = []
    for pair in sorted(tuple(sorted(p)) for p in partitions):
        a, b = (ports[h] for h in pair)
        rules += [f'iifname "{a}" oifname "{b}" drop', f'iifname "{b}" oifname "{a}" drop']
    for host, link in links.items():
        if link.loss_percent > 0:
            rules.append(_loss_rule(f'iifname "{ports[host]}"', link.loss_percent, host))
    return _table("bridge", "forward", "forward", rules)


def host_ruleset(host: str, link: Link, dev: str = "eth0") -> str:
    """The nftables script, run in the host's namespace, that drops what its link loses on its
    way to the host: at the interface's ingress, where frames arrive one wire frame each (the
    switch port segments them for a lossy link), not at the switch, where a frame may still be
    a 64 KiB GSO aggregate whose loss would cut a burst out of a flow."""
    rules = [_loss_rule("", link.loss_percent, host).lstrip()] if link.loss_percent > 0 else []
    return _table("netdev", "ingress", f'ingress device "{dev}"', rules)


#: The roles of a fleet's hosts: the index (IS and PC), relays, holders, inference instances
#: (`kvsp agent`) and fetch clients (loads as an agent makes them, without a model).
ROLES = ("index", "relay", "holder", "agent", "client")
#: Roles that speak MOQT with the relay.
MOQT_ROLES = ("holder", "agent", "client")


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    link: Link


@dataclass
class Topology:
    """The hosts of a fleet, in the order their namespaces are made, and who speaks MOQT with
    whom (to size each one's datagrams to its paths)."""

    nodes: dict[str, Node] = field(default_factory=dict)

    def add(self, name: str, role: str, link: Link) -> Node:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
        if name in self.nodes:
            raise ValueError(f"host {name!r} exists")
        node = self.nodes[name] = Node(name, role, link)
        return node

    def of_role(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role]

    def with_link(self, name: str, **changes: object) -> Link:
        """The host's link with `changes` (e.g. up=False), recorded."""
        node = self.nodes[name]
        link = replace(node.link, **changes)  # type: ignore[arg-type]
        self.nodes[name] = replace(node, link=link)
        return link

    def moqt_peers(self, name: str) -> list[str]:
        """The hosts `name` exchanges MOQT datagrams with: relays with every holder, agent and
        client, and these with every relay."""
        role = self.nodes[name].role
        if role == "relay":
            return [n.name for n in self.nodes.values() if n.role in MOQT_ROLES]
        if role in MOQT_ROLES:
            return [n.name for n in self.of_role("relay")]
        return []

    def datagram_size(self, name: str) -> int:
        """The datagram size for `name`'s MOQT endpoints: its narrowest path's (the smallest MTU
        among its own link and those of its MOQT peers; a bridge does not fragment)."""
        mtus = [self.nodes[name].link.mtu] + [self.nodes[p].link.mtu for p in self.moqt_peers(name)]
        return datagram_size(min(mtus))


def fleet_topology(*, clients: int = 4, holders: int = 1, agents: int = 0, mtu: int = 1500,
                   holder_rate: float | None = 200.0, relay_rate: float | None = 1000.0,
                   client_rate: float | None = 1000.0, index_rate: float | None = 1000.0,
                   agent_rate: float | None = 1000.0, client_loss: float = 0.0) -> Topology:
    """The fleet the benchmark and the tests use: one index, one relay, `holders` holders,
    `agents` inference instances and `clients` fetch clients, each on a link of its own (rates
    in Mbit/s; None: unshaped)."""
    if clients < 1 or holders < 1 or agents < 0:
        raise ValueError("a fleet has at least one holder and one client")
    topo = Topology()
    topo.add("index", "index", Link(mtu=mtu, rate_mbit=index_rate))
    topo.add("relay", "relay", Link(mtu=mtu, rate_mbit=relay_rate))
    for i in range(holders):
        topo.add(f"holder{i + 1}" if holders > 1 else "holder", "holder", Link(mtu=mtu, rate_mbit=holder_rate))
    for i in range(agents):
        topo.add(f"agent{i + 1}", "agent", Link(mtu=mtu, rate_mbit=agent_rate))
    for i in range(clients):
        topo.add(f"client{i + 1}", "client", Link(mtu=mtu, rate_mbit=client_rate, loss_percent=client_loss))
    return topo
