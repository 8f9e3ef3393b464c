"""The fleet as data: rates, datagram sizes, the shapers' and the switch's rules (no root)."""

from __future__ import annotations

import pytest

from kvsp_moq.fleet.topology import (
    NFT_TABLE,
    Link,
    Topology,
    datagram_size,
    fleet_topology,
    host_ruleset,
    parse_rate,
    switch_ruleset,
)


@pytest.mark.parametrize("text, mbit", [
    ("200mbit", 200.0), ("1gbit", 1000.0), ("1G", 1000.0), ("500kbit", 0.5), ("2.5gbit", 2500.0),
    ("100", 100.0), (50, 50.0), ("75M", 75.0), ("10mbps", 10.0),
])
def test_rates_read_in_mbit_per_second(text: str | int, mbit: float) -> None:
    assert parse_rate(text) == mbit


@pytest.mark.parametrize("text", [None, "none", "unlimited", "0", ""])
def test_no_rate_means_unshaped(text: str | None) -> None:
    assert parse_rate(text) is None


@pytest.mark.parametrize("text", ["fast", "200 furlongs", "-5mbit", "1tbit"])
def test_a_rate_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


def test_datagrams_fill_one_ipv4_packet_of_the_path() -> None:
    assert datagram_size(1500) == 1472
    assert datagram_size(9000) == 8972
    assert datagram_size(65535) == 65507
    with pytest.raises(ValueError, match="1200"):
        datagram_size(1200)


def test_the_shaper_is_a_token_bucket_whose_burst_holds_a_gso_frame() -> None:
    args = Link(rate_mbit=200).shaper("eth0")
    assert args[:6] == ["qdisc", "replace", "dev", "eth0", "root", "tbf"]
    options = dict(zip(args[6::2], args[7::2]))
    assert options["rate"] == "200000kbit"
    assert int(options["burst"]) >= 65536 + 1500
    assert options["latency"] == "20ms"
    assert Link(rate_mbit=10_000).shaper("p1")[8:10] == ["burst", str(10_000 * 1_000_000 // 8 // 1000)]
    assert Link().shaper("eth0") == ["qdisc", "del", "dev", "eth0", "root"]


def test_links_refuse_what_no_link_is() -> None:
    for bad in ({"mtu": 100}, {"rate_mbit": 0}, {"loss_percent": 101}, {"queue_ms": 0}):
        with pytest.raises(ValueError):
            Link(**bad)  # type: ignore[arg-type]


def test_the_switch_drops_at_random_each_way_and_between_partitioned_hosts() -> None:
    ports = {"a": "p0", "b": "p1", "c": "p2"}
    links = {"a": Link(loss_percent=5), "b": Link(), "c": Link(loss_percent=0.25)}
    script = switch_ruleset(ports, links, [frozenset(("c", "a"))])
    lines = [line.strip() for line in script.splitlines()]
    assert lines[:2] == [f"add table bridge {NFT_TABLE}", f"delete table bridge {NFT_TABLE}"]
    assert 'iifname "p0" oifname "p2" drop' in lines and 'iifname "p2" oifname "p0" drop' in lines
    assert 'iifname "p0" numgen random mod 10000 < 500 counter drop comment "loss a"' in lines
    assert 'iifname "p2" numgen random mod 10000 < 25 counter drop comment "loss c"' in lines
    assert not any("oifname" in line and "numgen" in line for line in lines)  # the way in: host_ruleset
    assert not any('"p1"' in line for line in lines)
    assert "policy accept" in script


def test_an_empty_ruleset_still_replaces_the_old_one() -> None:
    script = switch_ruleset({"a": "p0"}, {"a": Link()})
    assert "drop" not in script and f"table bridge {NFT_TABLE} {{" in script


def test_what_a_link_loses_on_its_way_in_is_dropped_at_its_host_s_ingress() -> None:
    lines = [line.strip() for line in host_ruleset("a", Link(loss_percent=5)).splitlines()]
    assert f"table netdev {NFT_TABLE} {{" in lines
    assert 'type filter hook ingress device "eth0" priority 0; policy accept;' in lines
    assert 'numgen random mod 10000 < 500 counter drop comment "loss a"' in lines
    assert "drop" not in host_ruleset("a", Link())


def test_the_default_fleet_has_the_issue_s_links() -> None:
    topo = fleet_topology()
    assert [n.name for n in topo.nodes.values()] == ["index", "relay", "holder",
                                                      "client1", "client2", "client3", "client4"]
    assert topo.nodes["holder"].link.rate_mbit == 200
    assert topo.nodes["relay"].link.rate_mbit == 1000
    assert all(n.link.rate_mbit == 1000 for n in topo.of_role("client"))


def test_each_process_sends_datagrams_its_narrowest_path_carries() -> None:
    topo = Topology()
    topo.add("relay", "relay", Link(mtu=9000))
    topo.add("holder", "holder", Link(mtu=9000))
    topo.add("jumbo", "client", Link(mtu=9000))
    topo.add("small", "client", Link(mtu=1500))
    topo.add("index", "index", Link(mtu=1500))
    assert topo.datagram_size("holder") == 8972  # holder <-> relay: jumbo all the way
    assert topo.datagram_size("jumbo") == 8972
    assert topo.datagram_size("small") == 1472
    assert topo.datagram_size("relay") == 1472  # one datagram size for all of its peers
    assert topo.moqt_peers("index") == []
    with pytest.raises(ValueError, match="role"):
        topo.add("x", "router", Link())
    with pytest.raises(ValueError, match="exists"):
        topo.add("relay", "relay", Link())


def test_a_link_changed_is_recorded() -> None:
    topo = fleet_topology(clients=1)
    link = topo.with_link("client1", up=False, loss_percent=5.0)
    assert topo.nodes["client1"].link == link and not link.up and link.loss_percent == 5.0
