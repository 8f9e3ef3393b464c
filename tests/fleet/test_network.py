"""The fleet's links: shaped at both ends, lossy and partitioned at the switch, cut and restored,
counted; nothing left behind. These need root (they fail, not skip, without it)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvsp_moq.errors import KvspError, NamespaceError
from kvsp_moq.fleet.network import FleetNetwork
from kvsp_moq.fleet.topology import Link

from .probes import delivered, echo_server, reaches, send, streamed

PREFIX = f"kvspfn{os.getpid()}"


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def qdisc(netns: str, dev: str) -> dict:
    out = subprocess.run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


@pytest.fixture
def net():
    with FleetNetwork(prefix=PREFIX) as network:
        yield network
    assert not any(name.startswith(PREFIX + "-") for name in namespaces())


def test_a_rate_shapes_both_ends_of_the_link_and_can_be_changed(net: FleetNetwork) -> None:
    a = net.add_host("a", link=Link(rate_mbit=50))
    net.add_host("b", link=Link(mtu=9000))
    for netns, dev in ((a.netns, "eth0"), (net.switch, net.port("a"))):
        q = qdisc(netns, dev)
        assert q["kind"] == "tbf" and q["options"]["rate"] == 50_000_000 // 8, q
    assert qdisc(net.hosts["b"].netns, "eth0")["kind"] == "noqueue"
    net.set_rate("a", 1000)
    assert qdisc(a.netns, "eth0")["options"]["rate"] == 1000_000_000 // 8
    net.set_rate("a", None)
    assert qdisc(a.netns, "eth0")["kind"] == "noqueue"
    assert qdisc(net.switch, net.port("a"))["kind"] == "noqueue"
    assert net.describe()["b"]["mtu"] == 9000


def test_loss_drops_about_that_share_each_way_and_is_lifted(net: FleetNetwork) -> None:
    a, b = net.add_host("a"), net.add_host("b")
    echo_server(a)
    echo_server(b)
    assert reaches(a, b.address) and reaches(b, a.address)  # addresses resolved before the loss
    net.set_loss("a", 50)
    got = delivered(a, b, 2000)
    assert 700 < got < 1300, got  # binomial(2000, 0.5): 1000 +- 22
    got = delivered(b, a, 2000)
    assert 700 < got < 1300, got
    assert net.dropped("a") >= 4000 - 2 * 1300 and net.dropped("b") == 0
    net.set_loss("a", 0)
    assert delivered(a, b, 2000) == 2000


def test_a_partition_separates_two_hosts_and_no_other_then_heals(net: FleetNetwork) -> None:
    a, b, c = (net.add_host(n) for n in "abc")
    for host in (a, b, c):
        echo_server(host)
    net.partition("a", "b")
    assert send(a, b.address) == "timeout" and send(b, a.address) == "timeout"
    assert send(a, c.address) == "ok" and send(b, c.address) == "ok"
    net.heal("a", "b")
    assert reaches(a, b.address) and reaches(b, a.address)
    net.partition("a", "c")
    net.partition("b", "c")
    assert send(a, c.address) == "timeout"
    net.heal()
    assert reaches(a, c.address) and reaches(b, c.address)
    with pytest.raises(KeyError):
        net.partition("a", "nobody")


def gso_max_segs(netns: str, dev: str) -> int:
    out = subprocess.run(["ip", "-n", netns, "-d", "-j", "link", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["gso_max_segs"]


def test_a_lossy_link_carries_wire_frames_so_that_a_loss_is_one_frame(net: FleetNetwork) -> None:
    a, b = net.add_host("a", link=Link(loss_percent=0.01)), net.add_host("b")
    assert gso_max_segs(a.netns, "eth0") == gso_max_segs(net.switch, net.port("a")) == 1
    assert gso_max_segs(b.netns, "eth0") > 1
    before = net.counters("a")
    assert streamed(b, a, 4 << 20) == 4 << 20 and streamed(a, b, 4 << 20) == 4 << 20
    moved = net.counters("a") - before
    # every frame at most one MTU's worth (GSO aggregates would be a few dozen frames)
    assert moved.rx_packets >= (4 << 20) // 1500 and moved.tx_packets >= (4 << 20) // 1500, moved
    net.set_loss("a", 0)
    assert gso_max_segs(a.netns, "eth0") == 65535


def test_a_cut_link_is_a_partition_from_everyone_until_restored(net: FleetNetwork) -> None:
    a, b = net.add_host("a"), net.add_host("b", link=Link(up=False))
    echo_server(b)
    assert send(a, b.address) == "timeout"
    net.set_link("b", True)
    assert reaches(a, b.address)
    net.set_link("a", False)
    assert send(b, a.address) == "timeout" and not net.links["a"].up
    net.set_link("a", True)


def test_counters_count_what_left_and_arrived(net: FleetNetwork) -> None:
    a, b = net.add_host("a"), net.add_host("b")
    before_a, before_b = net.counters("a"), net.counters("b")
    assert delivered(a, b, 500) == 500
    sent, received = net.counters("a") - before_a, net.counters("b") - before_b
    assert sent.tx_packets >= 550 and sent.tx_bytes >= 500 * (64 + 42)
    assert received.rx_packets >= 550 and received.rx_bytes >= 500 * (64 + 42)


def test_probes_run_inside_a_host(net: FleetNetwork) -> None:
    a = net.add_host("a")
    b = net.add_host("b")
    assert not net.tcp_open("a", b.address, 9)  # nothing listens
    here = os.stat("/proc/thread-self/ns/net").st_ino
    there = net.in_host("a", lambda: os.stat("/proc/thread-self/ns/net").st_ino)
    assert there == os.stat(f"/run/netns/{a.netns}").st_ino != here
    assert os.stat("/proc/thread-self/ns/net").st_ino == here  # this thread stayed where it was


def test_the_mtu_is_fixed_when_the_host_is_made(net: FleetNetwork) -> None:
    net.add_host("a")
    with pytest.raises(ValueError, match="fixed"):
        net.apply("a", Link(mtu=9000))


def test_namespace_error_is_one_of_ours_and_a_runtime_error() -> None:
    assert issubclass(NamespaceError, KvspError) and issubclass(NamespaceError, RuntimeError)
    from kvsp_moq import netns

    assert netns.NamespaceError is NamespaceError
