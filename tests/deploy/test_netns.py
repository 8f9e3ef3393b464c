"""The namespace network that deployment tests run on: hosts reach each other at their
addresses with the MTU asked for, a cut link partitions, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsp_moq.netns import Host, Network, unavailable


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")


#: a UDP echo server: one datagram back for each received
ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
print("listening", flush=True)
while True:
    data, peer = s.recvfrom(65536)
    s.sendto(data, peer)
"""

#: one unfragmentable datagram of a given size (UDP payload), and its echo
SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO: never fragment
s.settimeout(2)
try:
    s.sendto(b"x" * int(sys.argv[2]), (sys.argv[1], 9999))
    print("ok" if len(s.recv(65536)) == int(sys.argv[2]) else "short")
except OSError as e:
    print("timeout" if isinstance(e, TimeoutError) else "too big")
"""


def send(host: Host, address: str, size: int) -> str:
    out = host.run([sys.executable, "-c", SEND, address, str(size)], capture_output=True, text=True)
    return out.stdout.strip() or out.stderr


def test_hosts_reach_each_other_at_the_mtu_and_a_cut_link_partitions() -> None:
    assert unavailable() is None, unavailable()  # these tests need root: they fail, not skip
    with Network(prefix="kvsptest", mtu=1500) as net:
        a, b = net.add_host("a"), net.add_host("b", mtu=9000)
        assert a.address == "198.18.0.1" and b.address == "198.18.0.2"
        server = b.start([sys.executable, "-c", ECHO, b.address], stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline() == b"listening\n"
        assert send(a, b.address, 1472) == "ok"
        assert send(a, b.address, 2000) == "too big"  # a's link has a 1,500-byte MTU
        net.set_link("b", False)
        assert send(a, b.address, 100) == "timeout"
        net.set_link("b", True)
        assert send(a, b.address, 100) == "ok"
        sleeper = b.start(["sleep", "60"])
        assert any(name.startswith("kvsptest-b") for name in namespaces())
    assert sleeper.poll() is not None
    assert not any(name.startswith("kvsptest-") for name in namespaces())


def test_only_the_benchmarking_range_is_used() -> None:
    with pytest.raises(ValueError, match="benchmarking range"):
        Network(subnet="10.0.0.0/24")
