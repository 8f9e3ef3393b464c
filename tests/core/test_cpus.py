"""CPU sets and thread placement (`kvsp_moq.cpus`), and the hash workers that follow it."""

from __future__ import annotations

import os
import threading

import pytest

from kvsp_moq.cpus import (
    format_cpu_list,
    parse_cpu_list,
    place_thread,
    reserved_cpus,
    usable_cpus,
)
from kvsp_moq.hashing import hash_pool, place_workers


def test_cpu_lists() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    assert parse_cpu_list("5") == {5}
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_the_last_usable_cpu_of_each_numa_node() -> None:
    nodes = [frozenset(range(0, 8)), frozenset(range(8, 16))]
    assert reserved_cpus(frozenset(range(16)), nodes) == {7, 15}
    # a container limited to some CPUs: the last of those in each node it reaches
    assert reserved_cpus(frozenset({1, 2, 3}), nodes) == {3}
    assert reserved_cpus(frozenset({2, 9}), nodes) == {2, 9}
    assert reserved_cpus(frozenset({4}), []) == {4}  # no NUMA information
    assert reserved_cpus() <= usable_cpus()


def test_threads_are_moved_and_keep_their_place() -> None:
    target = frozenset({min(os.sched_getaffinity(0))})
    seen: list[set[int]] = []
    go = threading.Event()

    def body() -> None:
        go.wait(5)
        seen.append(os.sched_getaffinity(0))
        child = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        child.start()
        child.join(5)

    t = threading.Thread(target=body)
    t.start()
    assert place_thread(t, target)
    go.set()
    t.join(5)
    assert seen == [set(target), set(target)]  # and a thread it starts inherits the place


def test_hash_workers_started_later_go_there_too() -> None:
    everywhere = frozenset(os.sched_getaffinity(0))
    target = frozenset({min(everywhere)})
    try:
        for t in place_workers(target):
            place_thread(t, target)
        pool = hash_pool()
        # enough work at once that the pool starts every worker it may
        places = list(pool.map(lambda _: os.sched_getaffinity(0), range(64)))
        assert all(p == set(target) for p in places)
    finally:
        for t in place_workers(everywhere):
            place_thread(t, everywhere)
