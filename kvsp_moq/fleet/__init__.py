"""A fleet on one machine: the index (IS and PC), a relay, holders, agents and fetch clients,
each in a network namespace of its own, on links with their own MTU, rate, loss and state.

    topology.py  what the fleet looks like, as data (links, hosts, the switch's rules)
    network.py   FleetNetwork: the namespaces, veth links, tc shapers and nftables rules
    services.py  Fleet: the servers and clients running on that network, authenticated
    client.py    the fetch client process (an agent's loads, without a model)
    agent.py     `kvsp agent` as the fleet runs it, its output optionally paced
    bench.py     `kvsp bench fleet`: fan-out through the relay against HTTP, and MTUs
    command.py   `kvsp fleet`: build one, print where everything is, tear it down on ^C
"""
